"""The `sat` command line: train, features, export, caption (and evaluate, data, serve)."""

from __future__ import annotations

import argparse
import logging
import sys

USAGE_ERROR, FAILED = 2, 1


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beam-size", type=int, default=None, help="beam width (1: greedy)")
    p.add_argument("--max-length", type=int, default=None, help="maximum words per caption")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="rank beams by log p / length**alpha")
    p.add_argument("--hard-mode", choices=("argmax", "sample", "expectation"), default=None,
                   help="hard-attention inference: most likely location (default), a sampled "
                        "one, or the expected context")


def _decoding_kwargs(args: argparse.Namespace) -> dict:
    return {"beam_size": args.beam_size, "max_length": args.max_length,
            "length_penalty": args.length_penalty, "hard_mode": args.hard_mode}


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from showattendtell.lit_module import CaptionModule
    from showattendtell.model import DecodingConfig
    from showattendtell.model_file import ModelFileError, save_model

    try:
        module = CaptionModule.load_from_checkpoint(args.checkpoint, map_location="cpu",
                                                    weights_only=True)
    except FileNotFoundError:
        raise ModelFileError(f"checkpoint not found: {args.checkpoint}") from None
    except (RuntimeError, KeyError, EOFError, torch.serialization.pickle.UnpicklingError) as e:
        raise ModelFileError(f"{args.checkpoint} is not a showattendtell checkpoint ({e})") from None
    decoding = DecodingConfig(**{k: v for k, v in _decoding_kwargs(args).items() if v is not None})
    info = {"checkpoint": str(args.checkpoint), "epoch": module.current_epoch}
    path = save_model(module.model, args.output, decoding, half=args.half, info=info)
    print(f"wrote {path}")
    return 0


def cmd_caption(args: argparse.Namespace) -> int:
    from showattendtell.images import ImageError
    from showattendtell.inference import load_model

    captioner = load_model(args.model, args.device)
    failed = 0
    for path in args.paths:
        try:
            result = captioner.caption([path], **_decoding_kwargs(args))[0]
        except ImageError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(result.caption if len(args.paths) == 1 else f"{path}\t{result.caption}")
    return FAILED if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sat", description="Show, Attend and Tell image captioning.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("train", help="train a model: sat train --config configs/NAME.yaml "
                                 "[--trainer.max_epochs N ...] [--ckpt_path last.ckpt]",
                   add_help=False)
    sub.add_parser("features", help="fill the encoder-feature cache for a training config: "
                                    "sat features --config configs/NAME.yaml", add_help=False)

    p = sub.add_parser("export", help="write a training checkpoint as a model file")
    p.add_argument("checkpoint", help="Lightning .ckpt written by sat train")
    p.add_argument("output", help="model file to write (.safetensors)")
    p.add_argument("--half", action="store_true", help="store weights as float16")
    _add_decoding_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("caption", help="caption images")
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files")
    p.add_argument("--model", default=None, help="model file (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    _add_decoding_args(p)
    p.set_defaults(func=cmd_caption)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    # train and features hand their arguments to LightningCLI (YAML configs, dotted overrides)
    if argv and argv[0] in ("train", "features"):
        from showattendtell import train

        (train.train if argv[0] == "train" else train.extract_features)(argv[1:])
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    from showattendtell.errors import USER_ERRORS

    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR if isinstance(e, (FileNotFoundError,)) else FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
