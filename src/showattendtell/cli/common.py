"""Argument helpers shared by the `sat` subcommands.

The decoding flags are made from ``showattendtell.search.options.DECODING_OPTIONS``, the table the
web service's controls and API inputs are made from too; like this module, it imports no torch
(`sat --help` and `sat --version` start in a fraction of a second).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from showattendtell.errors import UsageError
from showattendtell.search.options import (
    DECODING_OPTIONS,
    DEVICES,
    check_overrides,
    ignored_decoding,
    is_device_name,
)

MODEL_HELP = (
    "model file or name (`sat models`; default: $SAT_MODEL or the bundled model), or "
    "A+B for an ensemble of models that share an encoder"
)


def add_model_arg(p: argparse.ArgumentParser, menu: bool = False) -> None:
    """``--model``, the one declaration for every subcommand; ``menu``: repeatable (`sat serve`'s
    model menu, one entry per --model)."""
    if menu:
        p.add_argument(
            "--model",
            action="append",
            metavar="MODEL",
            help=f"{MODEL_HELP}; repeat for a model menu (each named by its file "
            "stem; default: the bundled default model, then the others)",
        )
    else:
        p.add_argument("--model", default=None, help=MODEL_HELP)


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The decoding options, one flag per ``DecodingConfig`` field (its ``option`` metadata);
    each defaults to None, the value stored in the model file. ``DecodingConfig`` checks the
    ranges, the one place for the CLI, API and service."""
    g = p.add_argument_group(
        "decoding (default: the model file's stored settings; `sat models` lists them)"
    )
    types = {"int": int, "float": float}
    for opt in DECODING_OPTIONS.values():
        metavar = opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.choices else None)
        g.add_argument(
            opt.flag,
            dest=opt.name,
            type=types.get(opt.kind),
            default=None,
            metavar=metavar,
            help=opt.help,
        )


def device_name(value: str) -> str:
    """``--device``'s value, checked here: torch's own message for "gpu" or "mps" is a
    traceback from deep inside model loading."""
    if is_device_name(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not a device: give {DEVICES}")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """Where and how the network runs: --device and --precision."""
    p.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="auto (a GPU when present; `sat caption` of up to 32 photos: the CPU, which is done "
        "sooner), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--precision",
        default="32",
        choices=("32", "bf16", "16"),
        help="32 (default; float32), or mixed precision bf16 / 16 (float16: GPU only)",
    )


# Where a GPU driver shows itself without importing torch: NVIDIA's (Linux), AMD ROCm's (which
# torch.cuda also drives) and WSL2's GPU paravirtualisation.
GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def no_gpu_driver() -> bool:
    """True where no CUDA GPU can be present, known without importing torch (seconds): macOS,
    or Linux without any GPU driver's files. False where it cannot be told (Windows): torch
    then decides, later."""
    if sys.platform == "darwin":
        return True
    if sys.platform.startswith("linux"):
        return not any(os.path.exists(f) for f in GPU_DRIVER_FILES)
    return False


def check_device_before_imports(args: argparse.Namespace) -> None:
    """``--device cuda`` on a machine without a GPU driver: the same line torch's check gives,
    without the seconds its import takes."""
    device = str(getattr(args, "device", ""))
    if not device.startswith("cuda") or not no_gpu_driver():
        return
    if device != "cuda" and (getattr(args, "devices", 1) or 1) > 1:
        return  # `--devices N --device cuda:1` is wrong anywhere: the run's own check says why
    model = getattr(args, "model", None)
    if model and os.path.isfile(os.path.join(str(model), "encoder.onnx")):
        return  # an exported ONNX folder runs on the CPU only: the Captioner says so
    raise UsageError("--device cuda was asked for, but no CUDA GPU is available")


def decoding_overrides(args: argparse.Namespace) -> dict:
    """The decoding options given on the command line (None: the model's default), checked now,
    before a model is loaded: a DecodingError (exit status 2) names the bad one."""
    given = {k: getattr(args, k) for k in DECODING_OPTIONS}
    check_overrides(**given)  # each on its own: the model's stored settings complete them
    return given


def warn_ignored_decoding(decoding: dict, captioner) -> None:
    """One warning line for each decoding option the model ignores (``ignored_decoding``),
    rather than silence."""
    for message in ignored_decoding(decoding, captioner):
        print(f"warning: {message}", file=sys.stderr)


_gc_paused = False


def pause_gc() -> None:
    """Pause Python's cycle collector while `sat caption` starts (cli.main, for the program
    only): importing torch and reading a model create about a million objects and no garbage,
    and the collector would walk them again and again (benchmarks/README.md: start-up)."""
    global _gc_paused
    gc.disable()
    _gc_paused = True


def resume_gc() -> None:
    """The model is ready: the collector on again, with every object alive now frozen (left to
    the process's end). The interpreter's last collection then skips torch's objects, a large
    part of a CPU's exit, while what the run creates after this is collected and finalised as
    usual (data loaders shut their workers down). Nothing unless pause_gc paused it."""
    global _gc_paused
    if _gc_paused:
        gc.freeze()
        gc.enable()
        _gc_paused = False
