"""`sat caption`: caption image files and folders, fast and without losing work.

This module is the parser and the checks that need nothing loaded; the job (caption_job.py) is
imported once they pass. It stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from showattendtell.captioning.records import format_help
from showattendtell.cli.common import (
    add_decoding_args,
    add_device_args,
    add_model_arg,
    check_device_before_imports,
)
from showattendtell.errors import UsageError
from showattendtell.search.options import DEFAULT_BATCH_SIZE

if TYPE_CHECKING:
    pass


def add_parser(sub) -> None:
    p = sub.add_parser(
        "caption",
        help="caption image files and folders (JSON Lines or CSV)",
        description="Caption images (JPEG, PNG, WebP, BMP, GIF, TIFF, HEIC/HEIF, AVIF) and "
        "folders of images (other files in them are counted and skipped). "
        "Writes one JSON object (or CSV row) per image; unreadable files get an "
        "error record and never stop the run. Exit status: 0 all captioned, "
        "1 some failed, 2 usage error.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="image files and/or folders, each captioned as often as it is given; - reads "
        "more paths from standard input, one per line (e.g. find photos -name '*.jpg' | sat "
        "caption - -o out.jsonl)",
    )
    p.add_argument("-r", "--recursive", action="store_true", help="look into sub-folders too")
    _add_output_args(p)
    _add_speed_args(p)
    add_model_arg(p)
    _add_process_args(p)
    _add_engine_args(p)
    add_device_args(p)
    add_decoding_args(p)
    p.set_defaults(func=run)
    _hint_paths_like_options(p)


NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")  # a value, not an option, to argparse too


def _hint_paths_like_options(p: argparse.ArgumentParser) -> None:
    """argparse takes a photo named ``-dash.jpg`` for an unknown option and says only that PATH
    is missing or that the argument is not recognised (or, for ``-rose.jpg``, reads -r -o
    se.jpg). So an argument before ``--`` that starts with "-" and is no option of this
    command, but names a file or folder, or looks like a file name, is refused first with
    what to type instead."""
    parse = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        given = sys.argv[1:] if args is None else list(args)
        for arg in given[: given.index("--") if "--" in given else len(given)]:
            if _path_like_option(p, arg):
                p.error(
                    f"{arg} is read as an option; for a file whose name starts with -, write "
                    f"./{arg}, or put -- before it (after the options): sat caption -- {arg}"
                )
        return parse(args, namespace)

    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _path_like_option(p: argparse.ArgumentParser, arg: str) -> bool:
    """Whether ``arg`` is more likely a path than an option: see _hint_paths_like_options."""
    if not arg.startswith("-") or arg == "-" or NEGATIVE_NUMBER.fullmatch(arg):
        return False
    known = p._option_string_actions
    if arg.split("=", 1)[0] in known:  # --format=csv
        return False
    short = known.get(arg[:2])
    if short is not None and short.nargs != 0:  # -oFILE: -o and its value
        return False
    return os.path.lexists(arg) or ("." in arg and "=" not in arg)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Where the records go and what they hold."""
    p.add_argument(
        "-o", "--output", default=None, help="file to write (default or -: standard output)"
    )
    p.add_argument(
        "--format",
        default=None,
        help=format_help(),
    )
    p.add_argument(
        "--with-attention",
        action="store_true",
        help="add each word's attention grid (and hard-attention locations)",
    )
    p.add_argument(
        "--overlays",
        metavar="DIR",
        default=None,
        help="also write one PNG per image: the caption over a grid of word panels, "
        "each showing where the model looked",
    )
    p.add_argument(
        "--min-confidence",
        type=float,
        default=None,
        metavar="X",
        help="send the captions whose confidence (0..1, the probability that a caption is "
        "good) is below X to a second file beside --output, OUT.low.jsonl for OUT.jsonl, in "
        "the same format; --output keeps the others and the error records",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="append to --output, skipping images already in it (with the model and decoding "
        "options its captions were made with; others are refused)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output file and existing --overlays sheets (without it, "
        "or --resume, they are refused and left as they were)",
    )


def _add_speed_args(p: argparse.ArgumentParser) -> None:
    """How the work is batched and spread over the machine's cores (and GPU)."""
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"images per batch (default {DEFAULT_BATCH_SIZE})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="image-decoding processes (default: cores - 1, at most 16, on a GPU; 0 "
        "on a CPU with up to 8 cores; 0 decodes in the main process)",
    )
    p.add_argument(
        "--decode-on",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where JPEGs are decoded: cpu (default, in the decoding processes) or "
        "gpu (in batches, by nvJPEG; other formats on the CPU); needs "
        "--device cuda",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the network (default: torch's, one per core); 1 can be "
        "much faster on a machine busy with other work",
    )
    p.add_argument(
        "--lanes",
        type=int,
        default=None,
        help="batches captioned at once on a CPU, each on its share of the threads (default: "
        "2 with 2 or more threads, else 1); a GPU takes one batch at a time",
    )


def _add_process_args(p: argparse.ArgumentParser) -> None:
    """Several captioning processes, GPUs or machines sharing one run."""
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="N",
        help="captioning processes on this machine (default 1): one per GPU with "
        "--device cuda/auto on a GPU machine, else CPU processes sharing the "
        "cores; they split the photos and write one output in input order",
    )
    p.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        metavar="M",
        help="machines taking part (default 1); start the same command on each with "
        "MASTER_ADDR, MASTER_PORT and NODE_RANK set, or under torchrun / SLURM",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Where the work runs: this machine, or a Ray cluster (cli/caption_ray.py)."""
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local (default: this machine's processes, --devices) or ray: a Ray cluster "
        "decodes in tasks and captions in an actor pool, one actor a GPU or --devices N on "
        "CPUs (pip install 'showattendtell[ray]'); -o FOLDER/ with --format parquet or jsonl "
        "writes a folder of shards",
    )
    p.add_argument(
        "--address",
        default=None,
        help="with --engine ray: the cluster to join, auto (the one `ray start` started here) "
        "or ray://HOST:PORT; default: start Ray on this machine for the run",
    )


def _check_engine_args(args: argparse.Namespace) -> bool:
    """The checks of --engine ray; True when it is asked for (a folder output is then allowed)."""
    if args.engine != "ray":
        if args.address:
            raise UsageError("--address is the Ray cluster to join: add --engine ray")
        if args.format == "parquet":
            raise UsageError("--format parquet writes a folder of shards: add --engine ray")
        return False
    if args.num_nodes > 1:
        raise UsageError("--num-nodes is for --engine local; Ray's cluster is its nodes")
    if args.overlays:
        raise UsageError("--engine ray writes no --overlays: use --engine local for them")
    if args.min_confidence is not None:
        raise UsageError("--engine ray writes no --min-confidence file: use --engine local for it")
    if args.decode_on == "gpu":
        raise UsageError("--engine ray decodes on CPUs in Ray tasks: leave out --decode-on gpu")
    if args.lanes is not None:
        raise UsageError("--lanes is for --engine local: Ray captions with --devices actors")
    return True


def _check_args(args: argparse.Namespace) -> None:
    if args.output == "-":
        args.output = None
    if args.resume and not args.output:
        raise UsageError("--resume needs --output FILE (the file to continue)")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues --output and --overwrite replaces it: give one")
    if args.min_confidence is not None:
        if not 0.0 <= args.min_confidence <= 1.0:
            raise UsageError(f"--min-confidence must be from 0 to 1, not {args.min_confidence:g}")
        if not args.output:
            raise UsageError(
                "--min-confidence sends low-confidence captions to a file beside --output: "
                "give --output FILE"
            )
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    if args.lanes is not None and args.lanes < 1:
        raise UsageError("--lanes must be at least 1")
    if args.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    if args.workers is not None and args.workers < 0:
        raise UsageError("--workers must be 0 or more")
    ray = _check_engine_args(args)
    if args.output and os.path.isdir(args.output) and not ray:
        raise UsageError(f"--output {args.output} is a folder; give a file name")
    same = args.output and args.overlays
    if same and os.path.abspath(args.output) == os.path.abspath(args.overlays):
        raise UsageError("-o is a file and --overlays a folder: give them different names")
    if args.overlays and os.path.exists(args.overlays) and not os.path.isdir(args.overlays):
        raise UsageError(f"--overlays {args.overlays} exists and is not a folder")
    check_device_before_imports(args)
    if args.output:
        _check_writable("--output", Path(args.output).parent)
        _check_file_writable(Path(args.output))
    if args.overlays:
        _check_writable("--overlays", Path(args.overlays))


def _check_writable(option: str, folder: Path) -> None:
    """Whether files can be made in ``folder``, or in the nearest folder above it that exists
    (where it would be created): tried with a real, removed file, as outputs.prepare_folder
    does once the inputs are listed, but creating nothing. Said now, before the imports."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            f"cannot create the folder for {option} ({folder}): a file of that name is in the way"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".sat-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "write into" if existing == folder else "create"  # as prepare_folder says it
        raise UsageError(
            f"cannot {what} the folder for {option} ({folder}): {e.strerror or e}"
        ) from None


def _check_file_writable(path: Path) -> None:
    """An existing --output that cannot be opened to write (its mode, a read-only mount)."""
    if not path.is_file():
        return
    try:
        with open(path, "ab"):  # opened to append: nothing written
            pass
    except OSError as e:
        raise UsageError(f"cannot write --output {path}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    """The cheap checks first (a usage error answers at once), then the job and its imports."""
    _check_args(args)
    if args.engine == "ray":
        return _run_on_ray(args)
    from showattendtell.cli import caption_job

    return caption_job.run(args)


def _run_on_ray(args: argparse.Namespace) -> int:
    """--engine ray: its job, or one line saying how to install Ray."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(
            "--engine ray needs Ray: pip install 'showattendtell[ray]' (or 'ray[data]')"
        )
    from showattendtell.cli import caption_ray

    return caption_ray.run(args)
