"""Argument helpers shared by the `sat` subcommands (kept import-light: no torch here)."""

from __future__ import annotations

import argparse

DECODING_OPTIONS = ("beam_size", "max_length", "length_penalty", "hard_mode", "no_repeat_ngram",
                    "rerank")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The decoding options; each defaults to the value stored in the model file. Their ranges
    are checked by ``DecodingConfig`` (decoding.py), the one place for the CLI, API and service."""
    g = p.add_argument_group("decoding (default: the model file's stored settings; "
                             "`sat models` lists them)")
    g.add_argument("--beam-size", type=int, default=None, help="beam width, 1-20 (1: greedy)")
    g.add_argument("--max-length", type=int, default=None, help="maximum words per caption, 1-100")
    g.add_argument("--length-penalty", type=float, default=None,
                   help="rank beams by log p / length**alpha, alpha from 0 to 5")
    g.add_argument("--hard-mode", default=None, metavar="{argmax,sample,expectation}",
                   help="hard attention only: attend to the most likely location (argmax), a "
                        "sampled one (sample), or use the expected context (expectation)")
    g.add_argument("--no-repeat-ngram", type=int, default=None, metavar="N",
                   help="never repeat an N-word sequence within a caption (0: allow)")
    g.add_argument("--rerank", default=None, metavar="{none,consensus}",
                   help="consensus: choose among the beam's captions the one that best agrees "
                        "with the captions of similar training photos (models with a "
                        "consensus index; `sat models` says which)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """Where and how the network runs: --device and --precision."""
    p.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda or "
                                                    "cuda:N")
    p.add_argument("--precision", default="32", choices=("32", "bf16", "16"),
                   help="32 (default; float32), or mixed precision bf16 / 16 (float16: GPU only)")


def decoding_overrides(args: argparse.Namespace) -> dict:
    """The decoding options given on the command line (None: the model's default), checked now,
    before a model is loaded: a DecodingError (exit status 2) names the bad one."""
    from showattendtell.decoding import DecodingConfig

    given = {k: getattr(args, k) for k in DECODING_OPTIONS}
    DecodingConfig().with_overrides(**given)
    return given
