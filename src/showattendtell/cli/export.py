"""`sat export`: a training checkpoint -> a self-describing, pickle-free model file; or a model
file -> the same weights with other stored decoding defaults (e.g. the bundled models'
``--no-repeat-ngram 2``); either as an ONNX model folder with ``--format onnx``
(captioning/onnx_export.py).

This module is the parser and the checks that need nothing loaded; the job (export_job.py) is
imported once they pass, before the checkpoint (gigabytes, minutes on a network disk) is read.
It stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from showattendtell.captioning.catalog import named_models, resolve_model
from showattendtell.cli.common import add_decoding_args, decoding_overrides
from showattendtell.cli.train_checks import check_dataset_root
from showattendtell.data.datasets import check_split_name, list_datasets
from showattendtell.errors import UsageError
from showattendtell.outputs import OutputError, check_new_output

DEFAULT_ALPHA = 0.5
FORMATS = ("safetensors", "onnx")
ONNX_INSTALL = 'pip install "showattendtell[onnx]"'
ONNX_FORMAT = "showattendtell/onnx-model"  # onnx_model.FORMAT, without importing torch here


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a model file")
    p.add_argument(
        "checkpoint",
        help="Lightning .ckpt written by sat train; or a model file "
        "(.safetensors, a model folder or a `sat models` name) to store other "
        "decoding defaults with its weights",
    )
    p.add_argument(
        "output",
        help="model file to write (.safetensors), or with --format onnx a new folder; an "
        "existing file (an earlier ONNX export) is replaced only with --overwrite",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors (default): one model file; onnx: a folder of ONNX graphs (encoder, "
        "decoder start, decoder step) with the vocabulary and stored decoding, that "
        "sat caption, sat evaluate and Captioner run with onnxruntime "
        f"({ONNX_INSTALL})",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output file (e.g. re-export a run's model)",
    )
    p.add_argument("--half", action="store_true", help="store weights as float16")
    p.add_argument(
        "--interpolate",
        metavar="MODEL",
        default=None,
        help="export alpha * checkpoint + (1 - alpha) * MODEL (WiSE-FT: a fine-tuned "
        "checkpoint moved back toward the model file it started from)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=None,
        help=f"the checkpoint's weight with --interpolate, from 0 to 1 (default {DEFAULT_ALPHA})",
    )
    g = p.add_argument_group("consensus index (for --rerank consensus; consensus.py)")
    g.add_argument(
        "--consensus-root",
        default=None,
        metavar="DIR",
        help="add an index of this dataset's photos and captions (the training "
        "split: the photos whose captions the model learnt from)",
    )
    g.add_argument(
        "--consensus-dataset",
        default="flickr8k",
        choices=list_datasets(),
        help="its format (default flickr8k)",
    )
    g.add_argument("--consensus-split", default="train", help="its split (default train)")
    g.add_argument(
        "--consensus-neighbours",
        type=int,
        default=None,
        metavar="K",
        help="training photos consulted for each photo (default 60)",
    )
    g.add_argument(
        "--feature-cache",
        default=None,
        metavar="DIR",
        help="read the photos' grids from this feature-cache folder (one that sat "
        "train wrote under data.feature_cache for this model's encoder) instead "
        "of encoding them again; checked against the model on a few photos",
    )
    p.add_argument(
        "--confidence",
        metavar="FILE",
        default=None,
        help="store these confidence fits (JSON that scripts/confidence_study.py --save "
        "wrote for this model) in the model file; without it a model file keeps the fits it "
        "has, and a checkpoint gets none (its captions are then scored by the default "
        "model's fits)",
    )
    add_decoding_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The cheap checks first (every argument that can be checked without reading the
    checkpoint), then the job and its imports."""
    overrides = decoding_overrides(args)
    output = _check_output(args)
    _check_source(args.checkpoint)
    interpolate, alpha = _check_interpolate(args)
    _check_consensus(args)
    from showattendtell.cli import export_job

    return export_job.run(args, output, overrides, interpolate, alpha)


def _check_output(args: argparse.Namespace) -> Path:
    """Before a checkpoint is read: the output can be written, and an existing file is
    replaced only when asked (a model file may be the only copy of weeks of training)."""
    output = Path(args.output)
    if args.format == "onnx":
        _check_onnx_output(args, output)
        return output
    if output.suffix.lower() != ".safetensors":
        raise UsageError(
            f"output: {output} would hold a safetensors model file under another name; name "
            f"it {output.with_suffix('.safetensors').name}"
        )
    check_new_output("output", output, args.overwrite)
    return output


def _check_onnx_output(args: argparse.Namespace, output: Path) -> None:
    """--format onnx: the packages are there, and the output is a new or empty folder, or an
    earlier ONNX export replaced with --overwrite (never a folder of other files)."""
    if args.half:
        raise UsageError("--half is for model files: an ONNX export is float32; leave --half out")
    missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"--format onnx needs {' and '.join(missing)}: {ONNX_INSTALL}")
    if output.exists() and not output.is_dir():
        raise OutputError(f"output {output} is a file: --format onnx writes a folder")
    if not output.is_dir() or not any(output.iterdir()):
        return
    try:
        fmt = json.loads((output / "config.json").read_text(encoding="utf-8")).get("format")
    except (OSError, ValueError, AttributeError):
        fmt = None
    if fmt != ONNX_FORMAT:
        raise OutputError(
            f"output {output} is a folder with other files in it: give a new or empty folder"
        )
    if not args.overwrite:
        raise OutputError(
            f"output {output} already holds an ONNX export; add --overwrite to replace it, "
            "or give another folder"
        )


def _check_source(source: str) -> None:
    """A checkpoint or model file that is not there (a typo) is a usage error, said for this
    command's argument rather than for `sat caption`'s --model."""
    if not Path(source).exists() and source not in named_models():
        raise UsageError(
            f"checkpoint: {source} not found: give a .ckpt file that sat train wrote (e.g. "
            "runs/NAME/checkpoints/last.ckpt) or a model file (.safetensors, or a name "
            "`sat models` lists)"
        )


def _check_interpolate(args: argparse.Namespace) -> tuple[Path | None, float]:
    """(--interpolate's model file, --alpha), checked before the checkpoint is read: the file is
    there (the job reads its header before the checkpoint: is it a model file?), and the weight
    is one that ``CaptionModel.interpolate_`` takes. (None, ...): no --interpolate."""
    if args.interpolate is None:
        if args.alpha is not None:
            raise UsageError(
                f"--alpha {args.alpha:g} is the checkpoint's weight with --interpolate MODEL: "
                "give that too, or leave --alpha out"
            )
        return None, DEFAULT_ALPHA
    alpha = DEFAULT_ALPHA if args.alpha is None else args.alpha
    if not 0.0 <= alpha <= 1.0:
        raise UsageError(
            f"--alpha {alpha:g}: must be from 0 to 1 (the checkpoint's weight; "
            "--interpolate's model gets 1 - alpha)"
        )
    return resolve_model(args.interpolate, "--interpolate"), alpha


def _check_consensus(args: argparse.Namespace) -> None:
    """The consensus-index options, checked before the checkpoint is read: the dataset folder
    and split (as `sat train` and `sat evaluate` check theirs), K, the feature-cache folder;
    and the options that only --consensus-root uses are not given without it."""
    if args.consensus_root is None:
        for flag, value in (
            ("--consensus-neighbours", args.consensus_neighbours),
            ("--feature-cache", args.feature_cache),
        ):
            if value is not None:
                raise UsageError(
                    f"{flag} is for the consensus index of --consensus-root DIR: give that "
                    f"too, or leave {flag} out"
                )
        return
    root, dataset = args.consensus_root, args.consensus_dataset
    check_dataset_root("--consensus-root", root, dataset)
    check_split_name("--consensus-split", dataset, root, args.consensus_split)
    k = args.consensus_neighbours
    if k is not None and k < 1:
        raise UsageError(f"--consensus-neighbours {k}: must be 1 or more")
    if args.feature_cache is not None:
        _check_feature_cache(Path(args.feature_cache))


def _check_feature_cache(folder: Path) -> None:
    """--feature-cache names one encoder's cache (its meta.json), not the data.feature_cache
    folder that holds one per encoder: the line names the caches found there."""
    if (folder / "meta.json").is_file():
        return
    inside = sorted(p.parent.name for p in folder.glob("*/meta.json"))
    hint = (
        f"it holds the caches {', '.join(inside)}: give the one of this model's encoder"
        if inside
        else "give the cache folder of this model's encoder under the training run's "
        "data.feature_cache"
    )
    raise UsageError(f"--feature-cache {folder}: no feature cache there (no meta.json); {hint}")
