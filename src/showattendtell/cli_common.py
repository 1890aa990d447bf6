"""Argument helpers shared by the `sat` subcommands (kept import-light: no torch here)."""

from __future__ import annotations

import argparse


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beam-size", type=int, default=None, help="beam width (1: greedy)")
    p.add_argument("--max-length", type=int, default=None, help="maximum words per caption")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="rank beams by log p / length**alpha")
    p.add_argument("--hard-mode", choices=("argmax", "sample", "expectation"), default=None,
                   help="hard-attention inference: most likely location (default), a sampled "
                        "one, or the expected context")
    p.add_argument("--no-repeat-ngram", type=int, default=None, metavar="N",
                   help="never repeat an N-word sequence within a caption (0: allow)")


def decoding_kwargs(args: argparse.Namespace) -> dict:
    """The decoding overrides given on the command line (None: the model's default)."""
    return {"beam_size": args.beam_size, "max_length": args.max_length,
            "length_penalty": args.length_penalty, "hard_mode": args.hard_mode,
            "no_repeat_ngram": args.no_repeat_ngram}
