"""`sat evaluate`'s job: load the split and the model, caption the split's photos (kept as
they are made, evaluate_captions.py), write the results and score them. cli/evaluate.py parses and
checks the arguments, then runs this.
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

from PIL import Image

import showattendtell.images.files  # noqa: F401 - registers HEIC/HEIF with Pillow
from showattendtell.captioning.captioner import finite_or_none, load_model
from showattendtell.captioning.pipeline import Record, caption_files
from showattendtell.cli.common import warn_ignored_decoding
from showattendtell.cli.evaluate_captions import (
    Captions,
    EvaluateError,
    PartialCaptions,
    scored_again,
    settings,
    write_json_atomic,
)
from showattendtell.data.datasets import load_split, split_names
from showattendtell.errors import sigterm_as_ctrl_c
from showattendtell.evaluation.attention_correctness import (
    CocoInstances,
    InstancesError,
    score_results,
)
from showattendtell.evaluation.metrics import (
    repetition,
    require_java,
    score_captions,
    skipped_metrics,
)
from showattendtell.network.tokenizers import DEFAULT_TOKENIZER, get_tokenizer
from showattendtell.outputs import check_new_output
from showattendtell.progress import Progress
from showattendtell.search.options import DecodingConfig

log = logging.getLogger("showattendtell.cli.evaluate")  # the messages of `sat evaluate`


def run(args: argparse.Namespace, decoding: dict, output: Path | None) -> int:
    """Evaluate with the checked arguments: ``decoding`` the decoding overrides, ``output`` the
    --output file (None: the default name, made from the model's once it is loaded)."""
    split, images = _split_images(args)
    # a partly present split is scored on the images present (the loader warned with the count)
    instances = None
    if args.instances is not None:
        instances = _load_instances(args.instances, split, images)

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
            output = Path(_default_output(captioner.name, args))
            check_new_output(
                "--output", output, args.overwrite or scored_again(output, args.resume)
            )
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
