"""`sat caption`: caption image files."""

from __future__ import annotations

import argparse
import sys

from showattendtell.cli_common import add_decoding_args, decoding_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("caption", help="caption images")
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files")
    p.add_argument("--model", default=None, help="model file (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    add_decoding_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from showattendtell.images import ImageError
    from showattendtell.inference import load_model

    captioner = load_model(args.model, args.device)
    failed = 0
    for path in args.paths:
        try:
            result = captioner.caption([path], **decoding_kwargs(args))[0]
        except ImageError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(result.caption if len(args.paths) == 1 else f"{path}\t{result.caption}")
    return 1 if failed else 0
