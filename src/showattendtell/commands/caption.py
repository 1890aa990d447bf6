"""`sat caption`: caption image files and folders, fast and without losing work.

The pipeline: worker processes decode and preprocess images (a bad file becomes an error record,
never an exception), the main process encodes and decodes whole batches, and every output line is
written with one write and flushed at once, in input order. So an interrupted run (Ctrl-C, kill)
leaves only complete lines behind, and ``--resume`` carries on where it stopped.

The top of this module stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from showattendtell.caption_output import (
    FORMATS,
    OutputError,
    ResumePoint,
    Writer,
    open_output,
    prepare_folder,
    scan_output,
)
from showattendtell.cli_common import add_decoding_args, add_device_args, decoding_overrides
from showattendtell.errors import UsageError, UserError
from showattendtell.pipeline import Record, default_workers

if TYPE_CHECKING:
    from showattendtell.inference import Captioner


def add_parser(sub) -> None:
    p = sub.add_parser(
        "caption", help="caption image files and folders (JSON Lines or CSV)",
        description="Caption images (JPEG, PNG, WebP, BMP, GIF, TIFF) and folders of images. "
                    "Writes one JSON object (or CSV row) per image; unreadable files get an "
                    "error record and never stop the run. Exit status: 0 all captioned, "
                    "1 some failed, 2 usage error.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files and/or folders")
    p.add_argument("-r", "--recursive", action="store_true", help="look into sub-folders too")
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default: standard output)")
    p.add_argument("--format", default=None,
                   help="jsonl (default) or csv; default from the --output suffix")
    p.add_argument("--with-attention", action="store_true",
                   help="add each word's attention grid (and hard-attention locations)")
    p.add_argument("--overlays", metavar="DIR", default=None,
                   help="also write one PNG per image: the caption over a grid of word panels, "
                        "each showing where the model looked")
    p.add_argument("--resume", action="store_true",
                   help="append to --output, skipping images already in it")
    p.add_argument("--batch-size", type=int, default=16, help="images per batch (default 16)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"image-decoding processes (default min(4, cores) = {default_workers()}; "
                        "0 decodes in the main process)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the network (default: torch's, one per core); 1 can be "
                        "much faster on a machine busy with other work")
    p.add_argument("--model", default=None,
                   help="model file or name (`sat models`; default: the bundled model)")
    add_device_args(p)
    add_decoding_args(p)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- overlays


def overlay_name(path: str) -> str:
    """A unique, flat PNG name for an input path: 'photos/a.jpg' -> 'photos__a.jpg.png'."""
    parts = [p for p in Path(path).parts if p not in ("/", ".", "..") and not p.endswith(":\\")]
    return "__".join(parts) + ".png"


def write_overlay(directory: Path, rec: Record) -> None:
    from showattendtell.images import open_image
    from showattendtell.overlay import caption_sheet

    assert rec.result is not None
    caption_sheet(open_image(rec.path), rec.result).save(directory / overlay_name(rec.path))


# --------------------------------------------------------------------------- the command


def _format(args: argparse.Namespace) -> str:
    fmt = args.format
    if fmt is None:
        fmt = "csv" if args.output and args.output.lower().endswith(".csv") else "jsonl"
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return fmt


def _inputs(args: argparse.Namespace) -> list[str]:
    """The image paths to caption, in order, as typed or found (deduplicated)."""
    from showattendtell.images import list_images

    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        raise UsageError(f"no such file or folder: {missing[0]}")
    paths: list[str] = []
    seen: set[str] = set()
    empty: list[str] = []
    for given in args.paths:
        found = [str(p) for p in list_images([given], args.recursive)]
        if not found:
            empty.append(given)
        for p in found:
            if p not in seen:
                seen.add(p)
                paths.append(p)
    hint = "" if args.recursive else " (use --recursive for sub-folders)"
    if not paths:
        raise UsageError("no image files found in " + ", ".join(args.paths) + hint)
    for given in empty:
        print(f"warning: no image files in {given}{hint}", file=sys.stderr)
    return paths


def _check_args(args: argparse.Namespace) -> None:
    if args.resume and not args.output:
        raise UsageError("--resume needs --output FILE (the file to continue)")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    if args.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    if args.workers is not None and args.workers < 0:
        raise UsageError("--workers must be 0 or more")
    if args.output and os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a folder; give a file name")
    if args.overlays and os.path.exists(args.overlays) and not os.path.isdir(args.overlays):
        raise UsageError(f"--overlays {args.overlays} exists and is not a folder")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    decoding = decoding_overrides(args)
    fmt = _format(args)
    paths = _inputs(args)
    out_path = Path(args.output) if args.output else None
    resume: ResumePoint | None = None
    if args.resume and out_path is not None and out_path.exists():
        resume = scan_output(out_path, fmt, args.with_attention)  # refuses a foreign file
    done = resume.done if resume else set()
    todo = [p for p in paths if p not in done]
    skipped = len(paths) - len(todo)
    if not todo:
        print(f"nothing to do: all {len(paths)} images are already in {args.output}",
              file=sys.stderr)
        return 0
    # every folder is created (or refused) before a model is loaded
    if out_path is not None:
        prepare_folder("--output", out_path.parent)
        if out_path.exists() and not os.access(out_path, os.W_OK):
            raise OutputError(f"cannot write --output {out_path}: permission denied")
    overlays = Path(args.overlays) if args.overlays else None
    if overlays is not None:
        prepare_folder("--overlays", overlays)

    from showattendtell.inference import load_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        captioner = load_model(args.model, args.device, args.precision)
    except ValueError as e:  # --device cuda without a GPU, an unknown device name
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e)) from None

    stream = open_output(out_path, resume if args.resume else None) if out_path else None
    fields = resume.fields if resume else None
    writer = Writer(fmt, args.with_attention, stream, fields)
    fresh = fmt == "csv" and fields is None
    return _caption_loop(captioner, todo, args, decoding, writer, fresh, overlays, skipped)


def _caption_loop(captioner: Captioner, todo: list[str], args: argparse.Namespace,
                  decoding: dict[str, Any], writer: Writer, fresh: bool, overlays: Path | None,
                  skipped: int) -> int:
    from showattendtell.pipeline import caption_files
    from showattendtell.progress import Progress

    ok, failures = 0, []
    # a bar on a terminal, unless the records go to a pipe; log lines when stderr is no terminal
    bar = sys.stderr.isatty() and (writer.stream is not None or sys.stdout.isatty())
    show = True if bar else (False if sys.stderr.isatty() else None)
    interrupted = False
    write_error: OSError | None = None
    try:
        if fresh:
            writer.header()
        with Progress(len(todo), "captioning", enabled=show) as progress:
            for rec in caption_files(captioner, todo, args.batch_size, args.workers,
                                     progress, **decoding):
                if rec.result is not None and overlays is not None:
                    try:
                        write_overlay(overlays, rec)
                    except Exception as e:  # noqa: BLE001 - the caption is still worth keeping
                        print(f"warning: no overlay for {rec.path}: {e}", file=sys.stderr)
                if rec.result is not None and rec.result.warning:
                    print(f"warning: {rec.path}: {rec.result.warning}", file=sys.stderr)
                writer.write(rec)
                if rec.result is None:
                    failures.append(rec)
                else:
                    ok += 1
    except KeyboardInterrupt:
        interrupted = True
    except BrokenPipeError:  # `sat caption DIR | head`: the reader has gone; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a full disk, a vanished network folder: keep what is written
        write_error = e
    finally:
        if writer.stream is not None:
            writer.stream.close()
    if write_error is not None:
        target = args.output or "standard output"
        print(f"error: cannot write to {target}: {write_error.strerror or write_error}; the "
              f"{ok + len(failures)} records written before are intact"
              + (" (free some space and run again with --resume)" if args.output else ""),
              file=sys.stderr)
        if not args.output:  # stdout is unusable: keep the interpreter from flushing it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    _summary(ok, failures, skipped, len(todo), interrupted, args.output)
    if interrupted:
        return 130
    return 1 if failures else 0


def _summary(ok: int, failures: list[Record], skipped: int, total: int, interrupted: bool,
             output: str | None, show: int = 10) -> None:
    """The end-of-run report on standard error: counts, then the failed files and why."""
    parts = [f"captioned {ok}", f"failed {len(failures)}"]
    if skipped:
        parts.append(f"skipped {skipped} already in {output}")
    if interrupted:
        parts.append(f"interrupted with {total - ok - len(failures)} left"
                     + (" (run again with --resume to finish)" if output else ""))
    print("; ".join(parts), file=sys.stderr)
    for rec in failures[:show]:
        print(f"  {rec.path}: {rec.error}", file=sys.stderr)
    if len(failures) > show:
        print(f"  ... and {len(failures) - show} more (see the error records)", file=sys.stderr)
