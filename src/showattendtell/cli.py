"""The `sat` command line. Each subcommand lives in its own module with ``add_parser(sub)``."""

from __future__ import annotations

import argparse
import logging
import sys

# Modules that add subcommands, each with ``add_parser(sub)``; their top level imports no torch.
from showattendtell import batch, catalog, download, evaluate
from showattendtell.cli_common import add_decoding_args, decoding_overrides
from showattendtell.errors import UserError
from showattendtell.service import serve

COMMAND_MODULES = (batch, evaluate, download, catalog, serve)  # caption, evaluate, data, models,
# serve; train and features go to LightningCLI (train.py), export is below


def cmd_export(args: argparse.Namespace) -> int:
    from showattendtell.decoding import DecodingConfig
    from showattendtell.lit_module import load_checkpoint
    from showattendtell.model_file import ModelFileError, save_model

    decoding = DecodingConfig().with_overrides(**decoding_overrides(args))
    module = load_checkpoint(args.checkpoint)
    info = {"checkpoint": str(args.checkpoint), "epoch": module.checkpoint_epoch}
    if args.interpolate:
        from showattendtell.catalog import resolve_model
        from showattendtell.model_file import read_model

        start, _, _ = read_model(resolve_model(args.interpolate))
        try:
            module.model.interpolate_(start, args.alpha)
        except ValueError as e:
            raise ModelFileError(f"cannot interpolate {args.checkpoint} with "
                                 f"{args.interpolate}: {e}") from None
        info.update(interpolated_with=str(args.interpolate), alpha=args.alpha)
    path = save_model(module.model, args.output, decoding, half=args.half, info=info)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sat", description="Show, Attend and Tell captioning.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("train", add_help=False,
                   help="train a model: sat train --config configs/NAME.yaml "
                        "[--trainer.max_epochs N ...] [--ckpt_path last.ckpt]")
    sub.add_parser("features", add_help=False,
                   help="fill the encoder-feature cache of a training config: "
                        "sat features --config configs/NAME.yaml")
    p = sub.add_parser("export", help="write a training checkpoint as a model file")
    p.add_argument("checkpoint", help="Lightning .ckpt written by sat train")
    p.add_argument("output", help="model file to write (.safetensors)")
    p.add_argument("--half", action="store_true", help="store weights as float16")
    p.add_argument("--interpolate", metavar="MODEL", default=None,
                   help="export alpha * checkpoint + (1 - alpha) * MODEL (WiSE-FT: a fine-tuned "
                        "checkpoint moved back toward the model file it started from)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="the checkpoint's weight with --interpolate (default 0.5)")
    add_decoding_args(p)
    p.set_defaults(func=cmd_export)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def _log_package_to_stderr() -> None:
    """Our INFO lines (dataset counts, feature-extraction progress) under LightningCLI, which
    configures only Lightning's own loggers. The root logger is left alone: configuring it would
    print Lightning's lines twice."""
    pkg = logging.getLogger("showattendtell")
    if not pkg.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        pkg.addHandler(handler)
        pkg.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        # train and features hand their arguments to LightningCLI (YAML configs, dotted overrides)
        if argv and argv[0] in ("train", "features"):
            _log_package_to_stderr()
            from showattendtell import train

            return (train.train if argv[0] == "train" else train.extract_features)(argv[1:])
        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
