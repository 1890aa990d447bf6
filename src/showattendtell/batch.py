"""`sat caption`: caption image files and folders, fast and without losing work.

The pipeline: worker processes decode and preprocess images (a bad file becomes an error record,
never an exception), the main process encodes and decodes whole batches, and every output line is
written with one write and flushed at once, in input order. So an interrupted run (Ctrl-C, kill)
leaves only complete lines behind, and ``--resume`` carries on where it stopped.

The top of this module stays import-light (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from showattendtell.cli_common import add_decoding_args, decoding_kwargs
from showattendtell.errors import UserError

if TYPE_CHECKING:

    from showattendtell.inference import Captioner, CaptionResult

FORMATS = ("jsonl", "csv")
CSV_FIELDS = ("path", "caption", "score", "log_prob", "error")


class UsageError(UserError):
    """A bad command line (missing path, conflicting options): exit status 2."""

    exit_code = 2


def default_workers() -> int:
    """Image-decoding worker processes: one per core, at most 4 (the CNN needs cores too)."""
    return min(4, os.cpu_count() or 1)


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
    p.add_argument("--model", default=None, help="model file (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    add_decoding_args(p)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- loading images


# --------------------------------------------------------------------------- captioning


@dataclass
class Record:
    """One output line: a caption result or an error, for the image at ``path``."""

    path: str
    result: CaptionResult | None = None
    error: str | None = None


def caption_files(captioner: Captioner, paths: list[str], batch_size: int = 16,
                  workers: int | None = None, **decoding: Any) -> Iterator[Record]:
    """Caption image files; yields one Record per path, in input order, as batches finish.

    Encoding and decoding are batched (greedy for beam 1, batched beam search otherwise); image
    decoding overlaps with them in worker processes.
    """
    from showattendtell.images import load_batches

    workers = default_workers() if workers is None else workers
    pin = captioner.device.type == "cuda"
    for batch in load_batches(paths, captioner.input_size, batch_size, workers, pin):
        results: list[CaptionResult] = []
        if batch.tensors is not None:
            annotations = captioner.encode(batch.tensors.to(captioner.device, non_blocking=pin))
            results = captioner.caption_annotations(annotations, **decoding)
        it = iter(results)
        for item in batch.items:
            if item.error is not None:
                yield Record(item.path, error=item.error)
            else:
                yield Record(item.path, result=next(it))


# --------------------------------------------------------------------------- output


def record_dict(rec: Record, with_attention: bool) -> dict:
    if rec.result is None:
        return {"path": rec.path, "error": rec.error}
    return {"path": rec.path, **rec.result.to_dict(with_attention)}


class Writer:
    """Writes complete lines, each with a single write followed by a flush.

    A kill between writes leaves whole lines only; a line is never split over two writes
    (short writes of a regular file are retried until the line is out).
    """

    def __init__(self, fmt: str, with_attention: bool, stream: IO[bytes] | None = None):
        self.fmt, self.with_attention, self.stream = fmt, with_attention, stream

    def header(self) -> None:
        if self.fmt == "csv":
            fields = CSV_FIELDS + (("attention", "locations") if self.with_attention else ())
            self._write(self._csv_line(list(fields)))

    def write(self, rec: Record) -> None:
        d = record_dict(rec, self.with_attention)
        if self.fmt == "jsonl":
            line = json.dumps(d, ensure_ascii=False) + "\n"
        else:
            row = [d["path"], d.get("caption", ""), d.get("score", ""), d.get("log_prob", ""),
                   d.get("error", "")]
            if self.with_attention:
                row += [json.dumps(d["attention"]) if "attention" in d else "",
                        json.dumps(d["locations"]) if "locations" in d else ""]
            line = self._csv_line(row)
        self._write(line)

    @staticmethod
    def _csv_line(row: list) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(row)
        return buf.getvalue()

    def _write(self, line: str) -> None:
        data = line.encode("utf-8", "surrogateescape")  # undecodable file names round-trip
        if self.stream is None:  # standard output: looked up now (a progress bar may wrap it)
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        view = memoryview(data)
        while view:
            n = self.stream.write(view)
            view = view[n:]
        self.stream.flush()


def read_done(path: Path, fmt: str) -> set[str]:
    """Paths already in an output file; first drops a truncated last line left by a kill."""
    if not path.is_file() or path.stat().st_size == 0:
        return set()
    with open(path, "r+b") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # killed mid-line (not by us: we write whole lines) - drop it
            f.truncate(end)
            data = data[:end]
    text = data.decode("utf-8", "surrogateescape")
    done: set[str] = set()
    if fmt == "jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                done.add(json.loads(line)["path"])
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"--resume: {path} line {n} is not a `sat caption` JSON line; "
                                 "is it the right file (or --format csv)?") from None
    else:
        rows = list(csv.reader(io.StringIO(text)))
        if rows and rows[0][:1] != ["path"]:
            raise UsageError(f"--resume: {path} is not a `sat caption` CSV file (no 'path' "
                             "header); is it the right file (or --format jsonl)?")
        done = {r[0] for r in rows[1:] if r}
    return done


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
    if args.beam_size is not None and args.beam_size < 1:
        raise UsageError("--beam-size must be at least 1")
    if args.output and os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a folder; give a file name")
    if args.overlays and os.path.exists(args.overlays) and not os.path.isdir(args.overlays):
        raise UsageError(f"--overlays {args.overlays} exists and is not a folder")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    fmt = _format(args)
    paths = _inputs(args)
    out_path = Path(args.output) if args.output else None
    done = read_done(out_path, fmt) if args.resume and out_path else set()
    todo = [p for p in paths if p not in done]
    skipped = len(paths) - len(todo)
    if not todo:
        print(f"nothing to do: all {len(paths)} images are already in {args.output}",
              file=sys.stderr)
        return 0

    from showattendtell.inference import load_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        captioner = load_model(args.model, args.device)
    except ValueError as e:  # --device cuda without a GPU, an unknown device name
        raise UsageError(str(e)) from None
    overlays = Path(args.overlays) if args.overlays else None
    if overlays:
        overlays.mkdir(parents=True, exist_ok=True)

    stream = None
    if out_path:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not (args.resume and out_path.is_file() and out_path.stat().st_size > 0)
        stream = open(out_path, "ab" if args.resume else "wb", buffering=0)  # noqa: SIM115
    else:
        fresh = True
    writer = Writer(fmt, args.with_attention, stream)
    return _caption_loop(captioner, todo, args, writer, fresh, overlays, skipped)


def _caption_loop(captioner: Captioner, todo: list[str], args: argparse.Namespace, writer: Writer,
                  fresh: bool, overlays: Path | None, skipped: int) -> int:
    from showattendtell.progress import ProgressBar

    ok, failures = 0, []
    show_bar = sys.stderr.isatty() and (writer.stream is not None or sys.stdout.isatty())
    interrupted = False
    try:
        if fresh:
            writer.header()
        with ProgressBar(len(todo), "captioning", enabled=show_bar) as advance:
            for rec in caption_files(captioner, todo, args.batch_size, args.workers,
                                     **decoding_kwargs(args)):
                if rec.result is not None and overlays is not None:
                    try:
                        write_overlay(overlays, rec)
                    except Exception as e:  # noqa: BLE001 - the caption is still worth keeping
                        print(f"warning: no overlay for {rec.path}: {e}", file=sys.stderr)
                writer.write(rec)
                if rec.result is None:
                    failures.append(rec)
                else:
                    ok += 1
                advance(1)
    except KeyboardInterrupt:
        interrupted = True
    except BrokenPipeError:  # `sat caption DIR | head`: the reader has gone; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if writer.stream is not None:
            writer.stream.close()
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
