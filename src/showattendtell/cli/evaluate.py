"""`sat evaluate`: caption a dataset split and score it with the official COCO caption toolkit.

The last line of standard output is one JSON object keyed by the toolkit's metric names
(``Bleu_1`` ... ``Bleu_4``, ``METEOR``, ``ROUGE_L``, ``CIDEr``, and ``SPICE`` when it can run),
with ``repeated_bigram_captions`` (the share of captions that repeat a word bigram) and
``mean_words``. A model of another tokenizer than English PTB (``--data.tokenizer unicode``) is
scored on its own tokens without METEOR and SPICE (English-only; one line on standard error says
so), and the JSON names its ``tokenizer``;
everything else (counts, timings, where the captions went) goes to standard error. The generated
captions are written in the COCO results format, ``[{"image_id": ..., "caption": ...}, ...]``:
``image_id`` is the COCO id (an int) for COCO, the image file name (a string) for Flickr.

With ``--instances`` (COCO instance annotations of the split's photos) the JSON also has
``"attention_correctness"``: how much of each generated word's attention lies on the masks of the
COCO category it names (defined and aggregated in attention_correctness.py).

Captions are kept as they are made in a partial file beside the results (evaluate_captions.py),
so that Ctrl-C or SIGTERM loses none of them and ``--resume`` captions only the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from showattendtell.cli.common import (
    add_decoding_args,
    add_device_args,
    add_model_arg,
    decoding_overrides,
    warn_ignored_decoding,
)
from showattendtell.cli.evaluate_captions import (
    Captions,
    EvaluateError,
    PartialCaptions,
    settings,
    write_json_atomic,
)
from showattendtell.data.datasets import check_split_name, list_datasets, split_names
from showattendtell.errors import sigterm_as_ctrl_c
from showattendtell.network.tokenizers import DEFAULT_TOKENIZER, get_tokenizer
from showattendtell.search.options import DecodingConfig

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "evaluate",
        help="caption a dataset split and score it (BLEU-1..4, METEOR, ROUGE-L, "
        "CIDEr-D, SPICE; attention correctness with --instances)",
        description="Caption every image of a split with a model and score the captions with the "
        "official COCO caption toolkit. Prints the scores as one JSON object on the "
        "last line of standard output.",
    )
    add_model_arg(p)
    p.add_argument(
        "--dataset",
        required=True,
        choices=list_datasets(),
        help="coco (official files, or Karpathy's split with dataset_coco.json), "
        "flickr8k (original release files), karpathy (dataset_*.json), captions (a folder "
        "of photos and a captions.csv or captions.jsonl)",
    )
    p.add_argument("--root", required=True, help="the dataset folder (see data/README.md)")
    p.add_argument(
        "--split",
        default="test",
        help="split to evaluate (default test; flickr8k: train/dev/test; coco without "
        "Karpathy's split: train/val)",
    )
    p.add_argument(
        "--split-ratio",
        type=float,
        default=None,
        metavar="R",
        help="--dataset captions without a split column: the training share the model was "
        "trained with (--data.split_ratio; default 0.8), which decides the val and test photos",
    )
    p.add_argument(
        "--output",
        default=None,
        help="where to write the captions as COCO results JSON "
        "(default: <model>-<dataset>-<split>-results.json); an existing "
        "file is replaced only with --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the captions an interrupted run kept in <output>.partial.jsonl (same "
        "model, split, precision and decoding options) and caption only the rest",
    )
    p.add_argument("--batch-size", type=int, default=32, help="images per batch")
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="image-decoding processes (default: as sat caption's --workers)",
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N images")
    p.add_argument("--no-spice", action="store_true", help="skip SPICE even if it can run")
    add_device_args(p)
    p.add_argument(
        "--instances",
        default=None,
        metavar="FILE",
        help="COCO instance annotations of the split's photos "
        "(annotations/instances_<split><year>.json): also report attention "
        "correctness, the share of a word's attention on the masks of the COCO "
        "category it names (COCO photos only; others are skipped)",
    )
    add_decoding_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from showattendtell.evaluation.metrics import require_java

    _check_arguments(args)
    check_split_name("--split", args.dataset, args.root, args.split)
    decoding = decoding_overrides(args)
    output = _output_path(args)
    split, images = _split_images(args)
    # a partly present split is scored on the images present (the loader warned with the count)
    instances = None
    if args.instances is not None:
        instances = _load_instances(args.instances, split, images)

    from showattendtell.captioning.captioner import load_model

    # a given --output is locked before the model loads: a second run on it stops at once
    partial = PartialCaptions(output) if output is not None else None
    try:
        if partial is not None:
            partial.hold()
        captioner = load_model(args.model, args.device, args.precision)
        # said before spending minutes on captioning: English models are scored with the
        # official toolkit (Java); others on their own tokens (metrics.score_captions)
        if get_tokenizer(_tokenizer(captioner)).english:
            require_java(
                "sat evaluate scores with the official COCO caption toolkit, whose PTB "
                "tokenizer and METEOR need Java"
            )
        warn_ignored_decoding(decoding, captioner)
        config = captioner.check_decoding(**decoding)  # the overrides, resolved once
        if partial is None:  # the default name, from the model's: checked before captioning too
            from showattendtell.outputs import check_new_output

            output = Path(_default_output(captioner.name, args))
            check_new_output("--output", output, args.overwrite or _scored_again(output, args))
            partial = PartialCaptions(output)
        partial.start(settings(args, config, instances is not None), args.resume)
    except BaseException:
        if partial is not None:
            partial.release()
        raise
    grid = captioner.model.encoder.config.grid if instances is not None else None
    made = Captions.reused_from(partial, images, grid)
    todo = [im for im in images if im.image_id not in made.done]
    t0 = time.perf_counter()
    try:
        with sigterm_as_ctrl_c():
            new = caption_split(
                captioner,
                todo,
                args.batch_size,
                args.num_workers,
                on_record=partial.write,
                keep_attention=instances is not None,
                decoding=config,
            )
    except KeyboardInterrupt as e:
        return partial.interrupted(e, len(made.done) + partial.written, len(images), args)
    except OSError as e:  # a full disk: the captions written so far are kept, whole
        return partial.write_failed(e, len(made.done) + partial.written, len(images))
    finally:
        partial.close()
    made.add(new)
    elapsed = time.perf_counter() - t0
    return _finish(
        args, split, images, made, output, partial, elapsed, instances, _tokenizer(captioner)
    )


def _tokenizer(captioner) -> str:
    """The tokenizer of the model's vocabulary (network/tokenizers.py), which its captions are
    scored with."""
    vocab = getattr(captioner.model, "vocab", None)
    return getattr(vocab, "tokenizer", DEFAULT_TOKENIZER)


def _check_arguments(args: argparse.Namespace) -> None:
    from showattendtell.cli.train_checks import check_dataset_root

    if (
        args.batch_size < 1
        or (args.num_workers or 0) < 0
        or (args.limit is not None and args.limit < 1)
    ):
        raise EvaluateError("--batch-size and --limit must be positive, --num-workers >= 0")
    if args.instances is not None and args.dataset == "flickr8k":
        raise EvaluateError(
            "--instances needs COCO photos (--dataset coco, or karpathy with "
            "dataset_coco.json): Flickr8k has no COCO instance annotations"
        )
    check_dataset_root("--root", args.root, args.dataset)
    if args.split_ratio is not None:
        from showattendtell.data.datasets import check_split_ratio_taken
        from showattendtell.data.own_captions import check_split_ratio

        check_split_ratio_taken(args.dataset, "--split-ratio")
        check_split_ratio(args.split_ratio, "--split-ratio")


def _finish(
    args: argparse.Namespace,
    split,
    images: list,
    made: Captions,
    output: Path,
    partial: PartialCaptions,
    elapsed: float,
    instances,
    tokenizer: str = DEFAULT_TOKENIZER,
) -> int:
    """Write the results, then score them: the scores JSON on standard output, the rest on
    standard error. The partial captions go once the results file holds them all."""
    from showattendtell.captioning.captioner import finite_or_none
    from showattendtell.evaluation.metrics import repetition, score_captions, skipped_metrics

    captions = {
        im.image_id: made.captions[im.image_id] for im in images if im.image_id in made.captions
    }
    if not captions:
        partial.remove()  # every image was tried: nothing to resume
        raise EvaluateError(f"none of the {len(images)} images of {split.name} could be decoded")
    by_id = {im.image_id: im for im in images}
    results = [{"image_id": _result_id(by_id[k]), "caption": c} for k, c in captions.items()]
    # A write that fails now (a disk that filled up, a folder removed during the run) must not
    # lose the scores of the whole split: they are printed, and the failure said, below.
    unwritten = _write_results(output, results)
    print(made.summary(split.name, elapsed, partial, output, unwritten), file=sys.stderr)

    references = {k: by_id[k].captions for k in captions}
    # The partial captions stay until the scores are out: stopped while scoring (minutes of
    # Java), --resume scores them without captioning a photo again.
    try:
        with sigterm_as_ctrl_c():
            scores = score_captions(
                captions,
                references,
                official=True,
                spice=not args.no_spice,
                tokenizer=tokenizer,
            )
    except KeyboardInterrupt as e:
        return partial.interrupted(e, len(captions), len(images), args, scoring=True)
    if not unwritten:
        partial.remove()
    out = {k: finite_or_none(v, 6) for k, v in scores.items()}
    out.update({k: round(v, 4) for k, v in repetition(captions, tokenizer).items()})
    skipped = skipped_metrics(tokenizer)
    if skipped:
        out["tokenizer"] = tokenizer
        print(skipped, file=sys.stderr)
    print(
        f"{out['repeated_bigram_captions']:.1%} of the captions repeat a word bigram; "
        f"{out['mean_words']:.1f} words a caption",
        file=sys.stderr,
    )
    if instances is not None:
        out["attention_correctness"] = _attention_correctness(instances, made, by_id, args)
    print(json.dumps(out, allow_nan=False))
    if unwritten:
        print(f"error: {unwritten}; the scores above are complete", file=sys.stderr)
        return 1
    return 0


def _attention_correctness(instances, made: Captions, by_id: dict, args) -> dict:
    from showattendtell.evaluation.attention_correctness import score_results

    ac = score_results(
        instances,
        (
            (by_id[k].coco_id, words, attention, locations, by_id[k].path)
            for k, (words, attention, locations) in made.attention.items()
            if k in by_id
        ),
    )
    found = (
        f"{ac['correctness']} of the attention ({ac['measured_on']}) on the "
        "category's masks, "
        f"{ac['uniform']} for uniform attention, ratio {ac['ratio']}"
        if ac["words"]
        else "no generated word names a COCO category of its photo"
    )
    print(
        f"attention correctness: {ac['words']} words in {ac['images']} photos "
        f"({ac['skipped_images']} photos not in {args.instances} skipped): {found}",
        file=sys.stderr,
    )
    return ac


def _default_output(model_name: str, args: argparse.Namespace) -> str:
    return f"{model_name}-{args.dataset}-{args.split}-results.json"


def _output_path(args: argparse.Namespace) -> Path | None:
    """The --output file, checked before any photo is read: its folder can be created and
    written, and an existing non-empty file is replaced only with --overwrite. None: the
    default name, which needs the model's name; its folder (the current one) is checked and
    the file itself once the model is loaded (still before captioning)."""
    from showattendtell.outputs import check_new_output, prepare_folder

    if args.output is None:
        prepare_folder("--output", Path("."))
        return None
    path = Path(args.output)
    check_new_output("--output", path, args.overwrite or _scored_again(path, args))
    _check_not_a_dataset_file(path, Path(args.root))
    return path


def _scored_again(output: Path, args: argparse.Namespace) -> bool:
    """Whether --resume may replace an existing ``output``: it holds the captions of a run
    stopped while scoring (or before), which are also kept in its partial file, so rewriting
    it from them loses nothing. Any other existing file still needs --overwrite."""
    if not args.resume:
        return False
    kept = PartialCaptions(output).path
    return kept is not None and kept.is_file() and kept.stat().st_size > 0


def _check_not_a_dataset_file(path: Path, root: Path) -> None:
    """An existing --output in the dataset's folder is replaced (with --overwrite) only if it
    is a results file: a photo or a captions file there would be lost for good."""
    if not path.is_file() or not path.resolve().is_relative_to(root.resolve()):
        return
    if _is_results_file(path):
        return
    raise EvaluateError(
        f"--output {path} is a file of the dataset in --root {root}, not a results file; "
        "write the results elsewhere"
    )


def _is_results_file(path: Path, max_bytes: int = 200 * 2**20) -> bool:
    """A results file of `sat evaluate` (COCO's format: a list of image_id and caption)."""
    if path.stat().st_size > max_bytes:
        return False
    try:
        results = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(results, list) and all(
        isinstance(r, dict) and {"image_id", "caption"} <= r.keys() for r in results[:1]
    )


def _write_results(output: Path, results: list) -> str | None:
    """Write the results file; on failure, keep them in a file of the temporary folder and
    return one line saying so (None: written)."""
    try:
        write_json_atomic(output, results)
        return None
    except OSError as e:
        what = f"could not write the captions to {output} ({e.strerror or e})"
    try:
        fd, kept = tempfile.mkstemp(prefix=f"{output.stem}-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(results, f, ensure_ascii=False)
        return f"{what}; they are kept in {kept}"
    except OSError:
        return what


def _split_images(args: argparse.Namespace) -> tuple:
    """(the split, the images to evaluate: its first --limit). A split that lists no image is a
    usage error naming the other splits; a split whose images are all absent from disk stays a
    MissingImagesError (exit status 1: the data is missing, not the command wrong)."""
    from showattendtell.data.datasets import load_split

    split = load_split(args.dataset, args.root, args.split, args.split_ratio)
    if not split.num_annotated:
        others = [n for n in split_names(args.dataset, Path(args.root)) if n != args.split]
        raise EvaluateError(
            f"--split {args.split}: {split.name} lists no images; evaluate one of the other "
            f"splits ({', '.join(others)})"
        )
    split.require_images()
    return split, split.images[: args.limit] if args.limit else split.images


def _load_instances(path: str, split, images: list):
    """The instances file, checked before any captioning: it must annotate some of the split's
    COCO photos (an instances file of another split or year is a mistake, not zero words)."""
    from showattendtell.evaluation.attention_correctness import CocoInstances, InstancesError

    ids = {im.coco_id for im in split.images if im.coco_id is not None}
    if not ids:
        raise EvaluateError(
            f"--instances needs COCO photos: the images of {split.name} have no "
            "COCO ids (use --dataset coco)"
        )
    instances = CocoInstances(path)
    annotated = len(ids & instances.image_ids)
    if not annotated:
        raise InstancesError(
            f"{path} annotates none of the {len(ids)} photos of {split.name} "
            f"(its {len(instances.image_ids)} images have other ids: the "
            "instances file of another split or year?)"
        )
    log.info(
        "%s annotates %d of the %d photos of %s; attention correctness skips the others",
        path,
        annotated,
        len(ids),
        split.name,
    )
    _check_instance_sizes(path, instances, images)
    return instances


def _check_instance_sizes(path: str, instances, images: list) -> None:
    """One warning when photos are not the size the instances file gives them: their masks
    (drawn at that size) are stretched over the photo, which is right for the annotated photo
    resized, and meaningless for a crop, a padded or rotated copy, or another photo. Only the
    files' headers are read."""
    annotated = [im for im in images if im.coco_id in instances.image_ids]
    first, differ = None, 0
    for im in annotated:
        info = instances.coco.imgs[im.coco_id]
        expected = (int(info["width"]), int(info["height"]))
        sizes = _photo_sizes(im.path)
        if sizes and expected not in sizes:
            differ += 1
            first = first or (im, sizes[0], expected)
    if first is None:
        return
    im, (w, h), (ew, eh) = first
    more = (
        f" (and {differ - 1} more of the {len(annotated)} annotated photos)" if differ > 1 else ""
    )
    log.warning(
        "--instances: %s is %dx%d pixels, but %s gives it %dx%d%s: attention correctness "
        "stretches each mask over its photo, right only if the photo is the annotated one "
        "resized (not cropped, padded, rotated or another photo)",
        im.path,
        w,
        h,
        path,
        ew,
        eh,
        more,
    )


def _photo_sizes(path: Path) -> list[tuple[int, int]]:
    """(width, height) of the photo as stored and, for an EXIF orientation that turns it, as
    shown: the instances file may give either (attention_correctness turns a mask drawn at the
    stored size). Empty for a file whose header cannot be read (captioning reports it)."""
    from PIL import Image

    import showattendtell.images.files  # noqa: F401 - registers HEIC/HEIF with Pillow

    try:
        with Image.open(path) as img:
            w, h = img.size
            turned = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)
    except Exception:  # noqa: BLE001 - Pillow raises many kinds for a bad header
        return []
    return [(w, h), (h, w)] if turned else [(w, h)]


def caption_split(
    captioner,
    images: list,
    batch_size: int = 32,
    num_workers: int | None = None,
    on_record=None,
    keep_attention: bool = False,
    decoding: DecodingConfig | None = None,
) -> Captions:
    """Caption a split's images through the one pipeline (pipeline.caption_files).

    The undecodable images are reported and skipped (``Captions.failed``). ``on_record(Record)``,
    when given, receives each image's record as it is made, its ``path`` the image's id;
    ``keep_attention``: keep each caption's words and attention (``Captions.attention``).
    ``decoding``: resolved (``Captioner.check_decoding``), None: the model's stored settings.
    """
    from showattendtell.captioning.pipeline import Record, caption_files
    from showattendtell.progress import Progress

    made = Captions()
    if not images:
        return made
    with Progress(len(images), "captions") as progress:
        records = caption_files(
            captioner,
            [im.path for im in images],
            batch_size,
            num_workers,
            progress,
            decoding=decoding,
        )
        for im, rec in zip(images, records, strict=True):
            if on_record is not None:
                on_record(Record(im.image_id, rec.result, rec.error))
            if rec.result is None:
                log.warning("skipping undecodable image: %s: %s", rec.path, rec.error)
                made.failed[im.image_id] = rec.error
                continue
            made.captions[im.image_id] = rec.result.caption
            if keep_attention:
                r = rec.result
                made.attention[im.image_id] = (r.words, r.attention, r.locations)
    return made


def _result_id(im) -> int | str:
    """COCO results want the integer image id; Flickr images are named by their file name."""
    return im.coco_id if im.coco_id is not None else im.image_id
