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

This module is the parser and the checks that need nothing loaded; the job (evaluate_job.py) is
imported once they pass. It stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from showattendtell.cli.common import (
    add_decoding_args,
    add_device_args,
    add_model_arg,
    decoding_overrides,
)
from showattendtell.cli.evaluate_captions import EvaluateError, scored_again
from showattendtell.cli.train_checks import check_dataset_root
from showattendtell.data.datasets import check_split_name, check_split_ratio_taken, list_datasets
from showattendtell.data.own_captions import check_split_ratio
from showattendtell.outputs import check_new_output, prepare_folder


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
    """The cheap checks first (a usage error answers at once), then the job and its imports."""
    _check_arguments(args)
    check_split_name("--split", args.dataset, args.root, args.split)
    decoding = decoding_overrides(args)
    output = _output_path(args)
    from showattendtell.cli import evaluate_job

    return evaluate_job.run(args, decoding, output)


def _check_arguments(args: argparse.Namespace) -> None:
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
        check_split_ratio_taken(args.dataset, "--split-ratio")
        check_split_ratio(args.split_ratio, "--split-ratio")


def _output_path(args: argparse.Namespace) -> Path | None:
    """The --output file, checked before any photo is read: its folder can be created and
    written, and an existing non-empty file is replaced only with --overwrite. None: the
    default name, which needs the model's name; its folder (the current one) is checked and
    the file itself once the model is loaded (still before captioning)."""
    if args.output is None:
        prepare_folder("--output", Path("."))
        return None
    path = Path(args.output)
    check_new_output("--output", path, args.overwrite or scored_again(path, args.resume))
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
