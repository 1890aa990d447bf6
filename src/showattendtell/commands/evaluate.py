"""`sat evaluate`: caption a dataset split and score it with the official COCO caption toolkit.

The last line of standard output is one JSON object keyed by the toolkit's metric names
(``Bleu_1`` ... ``Bleu_4``, ``METEOR``, ``ROUGE_L``, ``CIDEr``, and ``SPICE`` when it can run),
with ``repeated_bigram_captions`` (the share of captions that repeat a word bigram) and
``mean_words``;
everything else (counts, timings, where the captions went) goes to standard error. The generated
captions are written in the COCO results format, ``[{"image_id": ..., "caption": ...}, ...]``:
``image_id`` is the COCO id (an int) for COCO, the image file name (a string) for Flickr.

With ``--instances`` (COCO instance annotations of the split's photos) the JSON also has
``"attention_correctness"``: how much of each generated word's attention lies on the masks of the
COCO category it names (defined and aggregated in attention_correctness.py).
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

from showattendtell.cli_common import (
    add_decoding_args,
    add_device_args,
    add_model_arg,
    decoding_overrides,
    warn_ignored_decoding,
)
from showattendtell.data.datasets import DATASETS
from showattendtell.errors import UsageError

log = logging.getLogger(__name__)


class EvaluateError(UsageError, ValueError):
    """Bad arguments or nothing to score."""


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
        choices=DATASETS,
        help="coco (official files, or Karpathy's split with dataset_coco.json), "
        "flickr8k (original release files), karpathy (dataset_*.json)",
    )
    p.add_argument("--root", required=True, help="the dataset folder (see data/README.md)")
    p.add_argument(
        "--split",
        default="test",
        help="split to evaluate (default test; flickr8k: train/dev/test; coco without "
        "Karpathy's split: train/val)",
    )
    p.add_argument(
        "--output",
        default=None,
        help="where to write the captions as COCO results JSON "
        "(default: <model>-<dataset>-<split>-results.json); an existing "
        "file is replaced only with --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
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
    from showattendtell.data.datasets import load_split
    from showattendtell.metrics import repetition, require_java, score_captions

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
    decoding = decoding_overrides(args)
    output = _output_path(args)
    # say so before spending minutes on captioning
    require_java(
        "sat evaluate scores with the official COCO caption toolkit, whose PTB tokenizer "
        "and METEOR need Java"
    )
    split = load_split(args.dataset, args.root, args.split)
    split.require_images()
    images = split.images[: args.limit] if args.limit else split.images
    # a partly present split is scored on the images present (the loader warned with the count)
    instances = _load_instances(args.instances, split) if args.instances is not None else None

    from showattendtell.inference import finite_or_none, load_model

    captioner = load_model(args.model, args.device, args.precision)
    warn_ignored_decoding(decoding, captioner)
    if output is None:  # the default name, from the model's: checked before captioning too
        from showattendtell.caption_output import check_new_output

        output = Path(_default_output(captioner.name, args))
        check_new_output("--output", output, args.overwrite)
    t0 = time.perf_counter()
    kept: dict = {}  # image_id -> CaptionResult, for attention correctness
    captions, failed = caption_split(
        captioner,
        images,
        args.batch_size,
        args.num_workers,
        on_result=kept.__setitem__ if instances is not None else None,
        **decoding,
    )
    elapsed = time.perf_counter() - t0
    if not captions:
        raise EvaluateError(f"none of the {len(images)} images of {split.name} could be decoded")
    by_id = {im.image_id: im for im in images}
    results = [{"image_id": _result_id(by_id[k]), "caption": c} for k, c in captions.items()]
    # A write that fails now (a disk that filled up, a folder removed during the run) must not
    # lose the scores of the whole split: they are printed, and the failure said, below.
    unwritten = _write_results(output, results)
    print(
        f"captioned {len(captions)} images of {split.name} in {elapsed:.1f} s "
        f"({len(captions) / max(elapsed, 1e-9):.1f} img/s"
        f"{f', {len(failed)} undecodable images skipped' if failed else ''})"
        + ("" if unwritten else f"; wrote {output}"),
        file=sys.stderr,
    )

    references = {k: by_id[k].captions for k in captions}
    scores = score_captions(captions, references, official=True, spice=not args.no_spice)
    out = {k: finite_or_none(v, 6) for k, v in scores.items()}
    out.update({k: round(v, 4) for k, v in repetition(captions).items()})
    print(
        f"{out['repeated_bigram_captions']:.1%} of the captions repeat a word bigram; "
        f"{out['mean_words']:.1f} words a caption",
        file=sys.stderr,
    )
    if instances is not None:
        from showattendtell.attention_correctness import score_results

        ac = score_results(
            instances,
            (
                (by_id[k].coco_id, r.words, r.attention, r.locations, by_id[k].path)
                for k, r in kept.items()
            ),
        )
        out["attention_correctness"] = ac
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
    print(json.dumps(out, allow_nan=False))
    if unwritten:
        print(f"error: {unwritten}; the scores above are complete", file=sys.stderr)
        return 1
    return 0


def _default_output(model_name: str, args: argparse.Namespace) -> str:
    return f"{model_name}-{args.dataset}-{args.split}-results.json"


def _output_path(args: argparse.Namespace) -> Path | None:
    """The --output file, checked before any photo is read: its folder can be created and
    written, and an existing non-empty file is replaced only with --overwrite. None: the
    default name, which needs the model's name; its folder (the current one) is checked and
    the file itself once the model is loaded (still before captioning)."""
    from showattendtell.caption_output import check_new_output, prepare_folder

    if args.output is None:
        prepare_folder("--output", Path("."))
        return None
    path = Path(args.output)
    check_new_output("--output", path, args.overwrite)
    _check_not_a_dataset_file(path, Path(args.root))
    return path


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


def _load_instances(path: str, split):
    """The instances file, checked before any captioning: it must annotate some of the split's
    COCO photos (an instances file of another split or year is a mistake, not zero words)."""
    from showattendtell.attention_correctness import CocoInstances, InstancesError

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
    return instances


def caption_split(
    captioner,
    images: list,
    batch_size: int = 32,
    num_workers: int | None = None,
    on_result=None,
    **decoding,
) -> tuple[dict[str, str], dict[str, str]]:
    """Caption a split's images through the one pipeline (pipeline.caption_files).

    Returns (image_id -> caption, image_id -> reason for the undecodable ones, which are
    reported and skipped). ``on_result(image_id, CaptionResult)``, when given, receives each
    full result (words, per-word attention) as it is made.
    """
    from showattendtell.pipeline import caption_files
    from showattendtell.progress import Progress

    captions: dict[str, str] = {}
    failed: dict[str, str] = {}
    with Progress(len(images), "captions") as progress:
        records = caption_files(
            captioner, [im.path for im in images], batch_size, num_workers, progress, **decoding
        )
        for im, rec in zip(images, records, strict=True):
            if rec.result is None:
                log.warning("skipping undecodable image: %s: %s", rec.path, rec.error)
                failed[im.image_id] = rec.error
                continue
            captions[im.image_id] = rec.result.caption
            if on_result is not None:
                on_result(im.image_id, rec.result)
    return captions, failed


def _result_id(im) -> int | str:
    """COCO results want the integer image id; Flickr images are named by their file name."""
    return im.coco_id if im.coco_id is not None else im.image_id


def write_json_atomic(path: Path, data) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file.
    The temporary file is made by open(), so the result has the permissions the umask gives
    (mkstemp's would be private, 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
