"""`sat export`'s job: read the checkpoint or model file (and --interpolate's model, the
--confidence fits), build the consensus index if asked, and write the model file or the ONNX
folder. cli/export.py parses and checks the arguments, then runs this.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from showattendtell.captioning import onnx_model
from showattendtell.captioning.catalog import FOLDER_CONFIG, named_models, resolve_model
from showattendtell.captioning.consensus_index import build_index
from showattendtell.captioning.onnx_export import export_onnx
from showattendtell.captioning.pretrained import folder_format, read_folder
from showattendtell.errors import UsageError
from showattendtell.model_file import ModelFileError, describe_model, read_model, save_model
from showattendtell.outputs import OutputError
from showattendtell.search.confidence import ConfidenceFitError, ConfidenceFits
from showattendtell.search.decoding import DecodingConfig


def run(
    args: argparse.Namespace,
    output: Path,
    overrides: dict,
    interpolate: Path | None,
    alpha: float,
) -> int:
    """Export with the checked arguments: ``overrides`` the decoding options given, ``output``
    the file or folder to write, ``interpolate`` --interpolate's model file (None: none) and
    ``alpha`` the checkpoint's weight. The model file to interpolate with and the confidence
    fits are read before the checkpoint is."""
    if interpolate is not None:
        describe_model(interpolate)  # NotAModelFile: a photo, a text, a checkpoint, ...
    fits = _read_confidence(args.confidence)
    try:  # a source that is no checkpoint or model file (a photo, a text) is a usage error
        if Path(args.checkpoint).is_dir():  # a model folder (Captioner.save_pretrained)
            model, stored = _read_folder(args.checkpoint)
            decoding = stored.with_overrides(**overrides)
            info = {"re_exported_from": str(args.checkpoint)}
        elif _is_model_file(args.checkpoint):  # its weights, its stored decoding with overrides
            model, stored, info = read_model(resolve_model(args.checkpoint))
            decoding = stored.with_overrides(**overrides)
            info = {**info, "re_exported_from": str(args.checkpoint)}
        else:
            # Lightning (seconds to import) only for a checkpoint, not to re-export a model file
            from showattendtell.training.lit_module import load_checkpoint

            decoding = DecodingConfig().with_overrides(**overrides)
            module = load_checkpoint(args.checkpoint)
            model = module.model
            info = {"checkpoint": str(args.checkpoint), "epoch": module.checkpoint_epoch}
    except ModelFileError as e:
        raise UsageError(str(e)) from None
    if interpolate is not None:
        start, _, _ = read_model(interpolate)
        try:
            model.interpolate_(start, alpha)
        except ValueError as e:
            raise ModelFileError(
                f"cannot interpolate {args.checkpoint} with {args.interpolate}: {e}"
            ) from None
        info.update(interpolated_with=str(args.interpolate), alpha=alpha)
    if args.consensus_root:
        model.consensus = build_index(
            model,
            args.consensus_dataset,
            args.consensus_root,
            args.consensus_split,
            args.feature_cache,
            args.consensus_neighbours,
        )
        info.update(
            consensus=f"{args.consensus_dataset} {args.consensus_split} "
            f"({len(model.consensus.references)} photos)"
        )
    if fits is not None:
        model.confidence = fits
    model.check_decoding(decoding)  # e.g. --rerank consensus without an index
    if args.format == "onnx":
        try:
            path = export_onnx(model, decoding, output, info)
        except OSError as e:  # the export is written beside and renamed: nothing half-written
            raise OutputError(f"cannot write {output}: {e.strerror or e}") from None
        print(f"wrote {path}/ (ONNX: run it with sat caption --model {path})")
        return 0
    try:
        path = save_model(model, output, decoding, half=args.half, info=info)
    except OSError as e:  # a disk that filled up while exporting: the old file is untouched
        output.with_name(output.name + ".tmp").unlink(missing_ok=True)
        raise OutputError(f"cannot write {output}: {e.strerror or e}") from None
    print(f"wrote {path}")
    return 0


def _read_confidence(path: str | None):
    """--confidence's fits (confidence.ConfidenceFits), read and checked before the checkpoint
    is; None without --confidence."""
    if path is None:
        return None
    try:
        return ConfidenceFits.from_json(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--confidence {path}: cannot read it ({e})") from None
    except ConfidenceFitError as e:
        raise UsageError(
            f"--confidence {path}: not the fits that scripts/confidence_study.py --save "
            f"writes ({e})"
        ) from None


def _read_folder(source: str):
    """(model, stored decoding) of a model folder; an ONNX export has no weights to export."""
    if not (Path(source) / FOLDER_CONFIG).is_file():
        raise UsageError(
            f"checkpoint: {source} is a folder without a {FOLDER_CONFIG}: give a .ckpt file that "
            "sat train wrote (e.g. runs/NAME/checkpoints/last.ckpt), a model file (.safetensors) "
            "or a model folder (Captioner.save_pretrained)"
        )
    folder = resolve_model(source, "checkpoint")
    if folder_format(folder) == onnx_model.FORMAT:
        raise UsageError(
            f"checkpoint: {source} is an ONNX export: export from the model file it was made "
            "from (a .safetensors file or a `sat models` name)"
        )
    model, stored, _ = read_folder(folder)
    return model, stored


def _is_model_file(source: str) -> bool:
    return source.endswith(".safetensors") or source in named_models()
