"""`sat caption`'s job: list the inputs, plan (what is left with --resume, the output's lock),
caption them in batches on one or several processes, write every record whole and in input order,
and sum up. cli/caption.py parses and checks the arguments, then runs this.

The pipeline: worker processes decode and preprocess images (a bad file becomes an error record,
never an exception), the main process encodes and decodes whole batches, and every output line is
written with one write and flushed at once, in input order. So an interrupted run (Ctrl-C, kill)
leaves only complete lines behind, and ``--resume`` carries on where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from showattendtell.captioning.captioner import Captioner, load_model
from showattendtell.captioning.distributed import Processes, accelerator_for, share_batches
from showattendtell.captioning.overlays import overlay_names, write_overlay
from showattendtell.captioning.pipeline import Record, caption_files
from showattendtell.captioning.records import (
    ResumePoint,
    Writer,
    check_made_by,
    low_output,
    open_output,
    output_format,
    scan_output,
    unmarked_warning,
)
from showattendtell.cli.common import (
    decoding_overrides,
    resume_gc,
    warn_ignored_decoding,
)
from showattendtell.errors import Terminated, UsageError, UserError, sigterm_as_ctrl_c
from showattendtell.images.files import list_images
from showattendtell.images.pipeline import default_workers
from showattendtell.outputs import (
    OutputError,
    OutputLock,
    check_new_output,
    prepare_folder,
    printable_path,
)
from showattendtell.progress import Progress
from showattendtell.search.options import DecodingConfig

URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def _stdin_paths() -> list[str]:
    """The paths listed on standard input, one per line (blank lines skipped). Read as bytes
    and decoded as the file system does (os.fsdecode), so a name that is not UTF-8 names its
    file as it would on the command line."""
    if sys.stdin is None:
        raise UsageError("- reads image paths from standard input, but there is none")
    if sys.stdin.isatty():
        print(
            "reading image paths from standard input, one per line; end with Ctrl-D",
            file=sys.stderr,
        )
    data = sys.stdin.buffer.read()
    if _looks_like_image(data):
        raise UsageError(
            "standard input holds image data, but - reads file paths, one per line: save the "
            "image to a file and caption that (sat caption photo.jpg), or list paths (find "
            "photos -name '*.jpg' | sat caption -)"
        )
    return [os.fsdecode(line.rstrip(b"\r")) for line in data.split(b"\n") if line.strip()]


def _looks_like_image(data: bytes) -> bool:
    """Whether standard input is an image's bytes rather than a list of paths: JPEG's or PNG's
    signature, WebP's RIFF header, HEIC's and AVIF's ftyp box, or a NUL byte, which no path
    holds and the headers of GIF, BMP and TIFF do."""
    head = data[:16]
    if head.startswith((b"\xff\xd8\xff", b"\x89PNG")):
        return True
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return True
    return head[4:8] == b"ftyp" or b"\x00" in data[:4096]


def _count_files(counts: Counter[str]) -> str:
    n = counts.total()
    return f"{n} file" + ("" if n == 1 else "s")


def _suffix_counts(counts: Counter[str], show: int = 5) -> list[str]:
    """'.txt: 2', '.pdf: 1', 'no suffix: 1', most common first."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:show]
    parts = [f"{s or 'no suffix'}: {n}" for s, n in ranked]
    if len(counts) > show:
        parts.append("...")
    return parts


def _inputs(
    args: argparse.Namespace, unreadable: list[tuple[Path, str]] | None = None
) -> list[str]:
    """The image paths to caption, in order: one per path as typed or listed on standard input
    (-), repeats included, so that the records match the arguments one for one; a folder gives
    its photos each time it is given. A path typed that does not exist is a usage error (a
    typo); one listed on standard input gets an error record, as an unreadable file does (a
    long list with one stale line still captions the rest). Sub-folders that cannot be read
    (--recursive) are warned about and appended to ``unreadable``."""

    typed = [p for p in args.paths if p != "-"]
    listed = _stdin_paths() if "-" in args.paths else []
    urls = [p for p in typed + listed if URL.match(p) and not os.path.exists(p)]
    if urls:
        raise UsageError(
            f"{urls[0]} is a web address: download it first (e.g. curl -O "
            "URL), then caption the file"
        )
    missing = [p for p in typed if not os.path.exists(p)]
    if missing:
        raise UsageError(f"no such file or folder: {missing[0]}")
    given_paths: list[str] = []
    for p in args.paths:
        given_paths += listed if p == "-" else [p]
        if p == "-":
            listed = []  # - given twice reads standard input once
    if not given_paths:
        raise UsageError("no image paths on standard input")
    paths: list[str] = []
    empty: list[str] = []
    not_read: list[tuple[Path, str]] = []
    for given in given_paths:
        skipped: Counter[str] = Counter()
        found = [str(p) for p in list_images([given], args.recursive, skipped, not_read)]
        if skipped:
            print(
                f"warning: {given}: skipped {_count_files(skipped)} not named as images "
                f"({', '.join(_suffix_counts(skipped))})",
                file=sys.stderr,
            )
        if not found:
            empty.append(given)
        paths += found
    for folder, why in not_read:
        print(
            f"warning: cannot read the folder {printable_path(str(folder))} ({why}): "
            "its photos are left out",
            file=sys.stderr,
        )
    if unreadable is not None:
        unreadable += not_read
    hint = _recursive_hint(args.recursive, empty)
    if not paths:
        raise UsageError(
            "no image files found in "
            + ", ".join(given_paths[:5])
            + (", ..." if len(given_paths) > 5 else "")
            + hint
        )
    for given in empty:
        print(f"warning: no image files in {given}{hint}", file=sys.stderr)
    return paths


def _recursive_hint(recursive: bool, folders: list[str]) -> str:
    """' (use --recursive for sub-folders)' where one of ``folders`` has a sub-folder that
    --recursive would look into; else nothing (the advice would not help)."""
    if recursive:
        return ""
    for folder in folders:
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            if any(e.is_dir() and not e.name.startswith(".") for e in entries):
                return " (use --recursive for sub-folders)"
    return ""


@dataclass
class Plan:
    """What to caption, worked out by the first process and sent to the others."""

    todo: list[str]  # input paths not in the output yet, in input order
    skipped: int  # inputs already in the output (--resume)
    fields: tuple[str, ...] | None  # the CSV columns of the file being continued
    sheets: dict[str, str] | None = None  # --overlays: the PNG name of each path to do
    made_by: list[dict] = field(default_factory=list)  # what made the file's captions (--resume)
    unreadable: int = 0  # sub-folders that could not be read (--recursive): their photos missing
    low: ResumePoint | None = None  # --min-confidence --resume: what the low file holds


def _plan(
    args: argparse.Namespace, fmt: str, lock: list[OutputLock]
) -> tuple[Plan, ResumePoint | None]:
    """Find the inputs, lock the output file and read what --resume continues, create the output
    folders: all before a model is loaded, so a usage error costs nothing. The lock, appended to
    ``lock``, is held until the run ends."""
    unreadable: list[tuple[Path, str]] = []
    paths = _inputs(args, unreadable)
    out_path = Path(args.output) if args.output else None
    resume: ResumePoint | None = None
    existed = out_path is not None and out_path.exists()
    if out_path is not None:
        if _inputs_among([out_path], paths):  # even with --overwrite: it would be emptied first
            raise UsageError(
                f"--output {out_path} is one of the photos to caption; give a new name"
            )
        if not existed or out_path.is_file():
            prepare_folder("--output", out_path.parent)
        # locked first: a second run on a busy output is told so, whatever else it asked
        lock.append(OutputLock(out_path))
        check_new_output("--output", out_path, args.overwrite or args.resume, resume=True)
    low = _plan_low(args, fmt, out_path, paths, lock)
    if args.resume and out_path is not None and existed:
        resume = scan_output(out_path, fmt, args.with_attention)  # refuses a foreign file
        warning = unmarked_warning(out_path, resume)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    done = (resume.done if resume else Counter()) + (low.done if low else Counter())
    todo = _not_done(paths, done)
    sheets = None
    if todo and args.overlays:
        prepare_folder("--overlays", Path(args.overlays))
        names = overlay_names(paths)  # of every input: a resumed run names sheets the same
        sheets = {p: names[p] for p in todo}
        _check_sheets(Path(args.overlays), sheets, paths, args.overwrite or args.resume)
    skipped, missing = len(paths) - len(todo), len(unreadable)
    made_by = list(resume.made_by) if resume else []
    made_by += [m for m in (low.made_by if low else []) if m not in made_by]
    fields = resume.fields if resume else None
    return Plan(todo, skipped, fields, sheets, made_by, missing, low), resume


def _plan_low(
    args: argparse.Namespace,
    fmt: str,
    out_path: Path | None,
    paths: list[str],
    lock: list[OutputLock],
) -> ResumePoint | None:
    """--min-confidence's file (OUT.low.jsonl beside OUT.jsonl): locked and checked like
    --output; with --resume, what it already holds (its records count as done). A run resumed
    without --min-confidence whose first run had it is refused: the records in the low file
    would be captioned again into --output."""
    if out_path is None:
        return None
    path = low_output(out_path)
    if args.min_confidence is None:
        if args.resume and path.is_file() and path.stat().st_size > 0:
            raise UsageError(
                f"--resume: {path} holds the low-confidence captions of the run being "
                "continued: give its --min-confidence again"
            )
        return None
    if _inputs_among([path], paths):
        raise UsageError(f"--min-confidence's file {path} is one of the photos to caption")
    existed = path.exists()
    lock.append(OutputLock(path))
    check_new_output("--min-confidence's file", path, args.overwrite or args.resume, resume=True)
    if args.resume and existed:
        return scan_output(path, fmt, args.with_attention)
    return None


def _not_done(paths: list[str], done: Counter[str]) -> list[str]:
    """The inputs without a record in the file being resumed. Records are in input order, so
    of inputs that share a record's path (one given twice, or two names that print alike) the
    first ones are done, as many as the file holds records of that path."""
    done, todo = Counter(done), []
    for p in paths:
        # the file holds each path as written (printable_path); one written before that, raw
        key = printable_path(p) if done[printable_path(p)] > 0 else p
        if done[key] > 0:
            done[key] -= 1
        else:
            todo.append(p)
    return todo


def _inputs_among(targets: list[Path], paths: list[str]) -> dict[Path, str]:
    """The targets that are one of the input files (by any spelling, or a link), with that
    input. Compared by the files' identity (device and inode): one ``stat`` per input, and
    none when no target exists yet."""
    ids = {}
    for target in targets:
        with contextlib.suppress(OSError):  # not there (yet): not an input
            st = target.stat()
            ids[(st.st_dev, st.st_ino)] = target
    found: dict[Path, str] = {}
    for p in paths if ids else ():
        with contextlib.suppress(OSError):  # gone since it was listed: its record says so
            st = os.stat(p)
            target = ids.get((st.st_dev, st.st_ino))
            if target is not None:
                found.setdefault(target, p)
    return found


def _check_sheets(folder: Path, sheets: dict[str, str], paths: list[str], replace: bool) -> None:
    """Before any work: no sheet is written over an input photo, and existing files in the
    overlays folder are replaced only with --overwrite (or --resume, whose interrupted run
    wrote them)."""
    existing = [folder / name for name in sheets.values() if (folder / name).exists()]
    photo = next(iter(_inputs_among(existing, paths).values()), None)
    if photo is not None:
        raise UsageError(
            f"--overlays {folder}: a sheet would replace the photo {photo}; give another folder"
        )
    if existing and not replace:
        raise UsageError(
            f"--overlays {folder}: {len(existing)} of the sheets to write already exist "
            f"(e.g. {existing[0].name}); add --overwrite to replace them, or give another folder"
        )


def run(args: argparse.Namespace) -> int:
    """Caption what ``args`` names (checked by cli/caption.py first); the exit status."""
    decoding = decoding_overrides(args)
    fmt = output_format(args.output, args.format)

    several = args.devices * args.num_nodes > 1
    procs = Processes(
        args.devices, args.num_nodes, accelerator_for(args.device) if several else "cpu"
    )
    # Only the first process reads the inputs and the output file; with --devices N it does so
    # before it starts the others, so a usage error stops the run before any process starts.
    plan: Plan | UserError | None = None
    resume: ResumePoint | None = None
    lock: list[OutputLock] = []
    # SIGTERM stops the run as Ctrl-C does: complete records kept, the resume command printed
    with sigterm_as_ctrl_c():
        try:
            if procs.rank == 0:
                try:
                    plan, resume = _plan(args, fmt, lock)
                except UserError as e:
                    if not procs.started_externally:
                        raise
                    plan = e  # torchrun / SLURM: the others are waiting for the plan; tell them too
                if isinstance(plan, Plan) and not plan.todo and not procs.started_externally:
                    return _nothing_to_do(plan, args)
            return _run_planned(args, plan, resume, fmt, decoding, procs)
        finally:
            for held in lock:
                held.release()


def resume_command(args: argparse.Namespace) -> str | None:
    """The `sat caption` command line that finishes an interrupted run: the same, with
    --resume (and without --overwrite, which would start the file again)."""
    given = getattr(args, "command_line", None)
    if not given or not args.output:
        return None
    kept = [a for a in given if a not in ("--resume", "--overwrite")]
    return shlex.join(["sat", *kept, "--resume"])


def _run_planned(
    args: argparse.Namespace,
    plan: Plan | UserError | None,
    resume: ResumePoint | None,
    fmt: str,
    decoding: dict[str, Any],
    procs: Processes,
) -> int:
    procs.launch()
    try:
        plan = procs.broadcast(plan)
        if isinstance(plan, UserError):
            if procs.rank == 0:
                raise plan
            return 0
        assert plan is not None
        if not plan.todo:
            return _nothing_to_do(plan, args) if procs.rank == 0 else 0
        return _caption(args, plan, resume, fmt, decoding, procs)
    finally:
        procs.close()


FEW_PHOTOS = 32  # at most this many, --device auto captions on the CPU (see _device)


def _device(args: argparse.Namespace, photos: int, procs: Processes) -> str:
    """This process's device. ``--device auto`` means a GPU when there is one, except for a
    few photos captioned by one process: starting a GPU cost 4.4 s for one photo on an H100
    machine (cuDNN's first convolutions 3.2 s, moving the model 0.7 s, recording the search's
    CUDA graph 0.5 s), where 2 CPU cores caption 32 photos in 3.3 s from the command
    (docs/captioning.md). ``--decode-on gpu`` and float16 (``--precision 16``) need the GPU."""
    device = procs.device(args.device)
    if device != "auto" or photos > FEW_PHOTOS or args.decode_on == "gpu" or args.precision == "16":
        return device

    if torch.cuda.device_count() == 0:  # asks NVML, without starting CUDA
        return device
    print(
        f"captioning {photos} photo{'s' if photos > 1 else ''} on the CPU, sooner than starting "
        "the GPU for so few (--device cuda uses it)",
        file=sys.stderr,
    )
    return "cpu"


def _caption(
    args: argparse.Namespace,
    plan: Plan,
    resume: ResumePoint | None,
    fmt: str,
    decoding: dict[str, Any],
    procs: Processes,
) -> int:
    """Load the model on every process, open the output on the first, caption."""

    procs.share_cores(args.threads)
    try:
        captioner = load_model(args.model, _device(args, len(plan.todo), procs), args.precision)
    except ValueError as e:  # --device cuda without a GPU, an unknown device name
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e)) from None
    if args.decode_on == "gpu" and captioner.device.type != "cuda":
        raise UsageError(
            "--decode-on gpu needs a CUDA GPU (--device cuda); without one, leave it out"
        )
    config = captioner.check_decoding(**decoding)  # the overrides, resolved once for the run
    made_by = captioner.made_by(config)
    made_by["decoding"]["decode_on"] = args.decode_on  # nvJPEG's pixels change some captions
    if plan.made_by:  # --resume; checked only now: the model file holds the defaults
        try:
            check_made_by(Path(args.output), plan.made_by, made_by)
        except UsageError:
            if procs.rank == 0:
                raise
            return 0  # the first process says why
    if procs.rank == 0:
        warn_ignored_decoding(decoding, captioner)

    captioner.prepare(config)  # with all the threads, before the lanes share them
    resume_gc()  # paused by `sat caption` while torch and the model loaded (cli.main)
    stream = None
    if procs.rank == 0 and args.output:
        stream = open_output(Path(args.output), resume if args.resume else None)
    writer = Writer(fmt, args.with_attention, stream, plan.fields, made_by)
    if args.min_confidence is not None:
        _open_low(writer, args, plan, fmt, procs.rank == 0)
    fresh = plan.fields is None  # a new file: its format's header, if it has one
    overlays = None
    if args.overlays and plan.sheets is not None:
        overlays = {p: Path(args.overlays) / name for p, name in plan.sheets.items()}
    return _caption_loop(captioner, plan, args, config, writer, fresh, overlays, procs)


def _open_low(writer: Writer, args: argparse.Namespace, plan: Plan, fmt: str, main: bool) -> None:
    """Give ``writer`` the writer of --min-confidence's file (on the first process: opened,
    cut back to its last whole record when resumed, its format's header when it is new)."""
    low_fields = plan.low.fields if plan.low is not None else None
    stream = None
    path = low_output(Path(args.output))
    if main:
        stream = open_output(path, plan.low if args.resume else None)
    writer.low = Writer(fmt, args.with_attention, stream, low_fields, writer.made_by)
    writer.min_confidence = args.min_confidence
    if main and low_fields is None:
        try:
            writer.low.header()
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


def _nothing_to_do(plan: Plan, args: argparse.Namespace) -> int:
    print(
        f"nothing to do: all {plan.skipped} images are already in {args.output}"
        + (f"; {_folders(plan.unreadable)} could not be read" if plan.unreadable else ""),
        file=sys.stderr,
    )
    return 1 if plan.unreadable else 0


def _folders(n: int) -> str:
    return f"{n} folder" + ("" if n == 1 else "s")


def _caption_loop(
    captioner: Captioner,
    plan: Plan,
    args: argparse.Namespace,
    decoding: DecodingConfig,
    writer: Writer,
    fresh: bool,
    overlays: dict[str, Path] | None,
    procs: Processes,
) -> int:
    """Every process captions its batches; at each step the first process gathers that step's
    records from all of them and writes them, in input order, one whole record per write.
    One writer means a kill of any process loses at most the records of the step in flight and
    never leaves a duplicate: the file is what --resume continues."""

    main = procs.rank == 0
    batches, records = _my_records(captioner, plan.todo, args, decoding, procs)
    written = _Written()
    show = _progress_shown(writer, main)
    interrupted = 0  # the exit status of an interrupted run: 130 Ctrl-C, 143 SIGTERM
    error: str | None = None
    hint = " (run again with --resume to finish)"  # the disk-full case says more, below
    try:
        if fresh and main:
            writer.header()
        with Progress(len(plan.todo), "captioning", enabled=show) as progress:
            _write_steps(records, batches, writer, overlays, procs, progress, written)
    except KeyboardInterrupt as e:
        interrupted = 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:  # `sat caption DIR | head`: the reader has gone; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a full disk, a vanished network folder: keep what is written
        error = f"cannot write to {args.output or 'standard output'}: {e.strerror or e}"
        hint = " (free some space and run again with --resume)"
        if not args.output:  # stdout is unusable: keep the interpreter from flushing it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except RuntimeError as e:  # a collective failed: another process was killed or crashed
        if procs.fabric is None:
            raise
        error = f"a captioning process stopped ({str(e).splitlines()[0][:200]})"
    finally:
        records.close()
        for w in (writer, writer.low):
            if w is not None and w.stream is not None:
                w.stream.close()
    if not main:
        return 0 if error is None else 1
    return _exit_status(plan, args, written, interrupted, error, hint)


class _Written:
    """The records that reached the output so far. They live outside the loop that writes
    them so that a run stopped half-way (Ctrl-C, a full disk, a lost process) still reports
    how many it kept."""

    def __init__(self) -> None:
        self.ok = 0
        self.failures: list[Record] = []
        self.no_sheet: list[tuple[str, str]] = []  # (path, why): captioned, its sheet not written
        self.low = 0  # captions sent to --min-confidence's file


def _my_records(
    captioner: Captioner,
    todo: list[str],
    args: argparse.Namespace,
    decoding: DecodingConfig,
    procs: Processes,
) -> tuple[list[range], Iterator[Record]]:
    """(every batch, as ranges of input positions; this process's records, captioned lazily):
    each process captions only its own batches, and the step loop pulls their records step by
    step, so nothing runs ahead of what is written by more than the pipeline's lanes."""
    batches, mine = share_batches(len(todo), args.batch_size, procs.rank, procs.world_size)
    workers = args.workers
    if workers is None:  # the processes of one machine share its cores
        workers = default_workers(captioner.device)
        workers = max(1, workers // procs.local_world_size) if workers else 0
    records = caption_files(
        captioner,
        [todo[i] for g in mine for i in batches[g]],
        args.batch_size,
        workers,
        None,
        args.lanes,
        jpeg_on_device=args.decode_on == "gpu",
        decoding=decoding,
    )
    return batches, records


def _progress_shown(writer: Writer, main: bool) -> bool | None:
    """Progress's ``enabled``: a bar on a terminal, unless the records go to a pipe; log lines
    when stderr is no terminal; nothing from any process but the first (one report per run)."""
    bar = sys.stderr.isatty() and (writer.stream is not None or sys.stdout.isatty())
    return (True if bar else (False if sys.stderr.isatty() else None)) if main else False


def _write_steps(
    records: Iterator[Record],
    batches: list[range],
    writer: Writer,
    overlays: dict[str, Path] | None,
    procs: Processes,
    progress: Progress,
    written: _Written,
) -> None:
    """Step by step, every process formats its batch's records (overlays and warnings done
    where they were captioned) and the first writes them all, in rank order, so that the
    output is in input order. ``written`` counts each record as it is written: an exception
    from here leaves it true to the file."""

    steps = -(-len(batches) // procs.world_size)
    for step in range(steps):
        g = step * procs.world_size + procs.rank
        lines = [
            _formatted(rec, writer, overlays)
            for rec in islice(records, len(batches[g]) if g < len(batches) else 0)
        ]
        parts = procs.gather(lines)
        for part in parts or []:
            for path, line, failure, no_sheet, low in part:
                (writer.low if low else writer).write_line(line)
                written.low += low
                if failure is None:
                    written.ok += 1
                else:
                    written.failures.append(Record(path, error=failure))
                if no_sheet is not None:
                    written.no_sheet.append((path, no_sheet))
            progress(len(part))


def _exit_status(
    plan: Plan,
    args: argparse.Namespace,
    written: _Written,
    interrupted: int,
    error: str | None,
    hint: str,
) -> int:
    """The first process's last word and the run's exit status: an error line saying what is
    intact (1); else the summary, then 130/143 for an interrupted run, 1 if an image failed."""
    if error is not None:
        print(
            f"error: {error}; the {written.ok + len(written.failures)} records written before "
            "are intact" + (hint if args.output else ""),
            file=sys.stderr,
        )
        return 1
    _summary(
        plan,
        args,
        written.ok,
        written.failures,
        bool(interrupted),
        unreadable=plan.unreadable,
        no_sheet=written.no_sheet,
    )
    if args.min_confidence is not None and args.output:
        print(
            f"{written.low} captions below --min-confidence {args.min_confidence:g} went to "
            f"{printable_path(str(low_output(Path(args.output))))}",
            file=sys.stderr,
        )
    if interrupted:
        return interrupted
    return 1 if written.failures or written.no_sheet or plan.unreadable else 0


def _formatted(
    rec: Record, writer: Writer, overlays: dict[str, Path] | None
) -> tuple[str, str, str | None, str | None, bool]:
    """(path, output line, error or None, why its overlay sheet is missing or None, whether it
    goes to --min-confidence's file) for one record; its overlay and warning done here, by the
    process that captioned it."""
    no_sheet = None
    if rec.result is not None and overlays is not None:
        try:
            write_overlay(overlays[rec.path], rec)
        except Exception as e:  # noqa: BLE001 - the caption is still worth keeping
            no_sheet = (e.strerror if isinstance(e, OSError) else None) or str(e)
            print(f"warning: no overlay sheet for {rec.path}: {no_sheet}", file=sys.stderr)
    if rec.result is not None and rec.result.warning:
        print(f"warning: {rec.path}: {rec.result.warning}", file=sys.stderr)
    target = writer.target(rec)
    return rec.path, target.line(rec), rec.error, no_sheet, target is not writer


def _summary(
    plan: Plan,
    args: argparse.Namespace,
    ok: int,
    failures: list[Record],
    interrupted: bool,
    show: int = 10,
    unreadable: int = 0,
    no_sheet: list[tuple[str, str]] | tuple = (),
) -> None:
    """The end-of-run report on standard error of a run of ``plan`` (one process or Ray):
    counts, then the failed files and why; an interrupted run says how to finish it (the
    command, as `sat train` does). Folders that could not be read and overlay sheets that could
    not be written count as failures too: work that is missing is never reported as done.
    ``unreadable``: the sub-folders not read (both engines count them and exit 1)."""
    skipped, total, output = plan.skipped, len(plan.todo), args.output
    command, stdin = resume_command(args), "-" in args.paths
    parts = [f"captioned {ok}", f"failed {len(failures)}"]
    if no_sheet:
        parts.append(f"no overlay sheet for {len(no_sheet)} (their captions are written)")
    if unreadable:
        parts.append(f"{_folders(unreadable)} could not be read (see the warnings above)")
    if skipped:
        parts.append(f"skipped {skipped} already in {output}")
    if interrupted:
        left = f"interrupted with {total - ok - len(failures)} left"
        if command:
            left += (
                "; resume with (the same list of paths on standard input):"
                if stdin
                else "; resume with:"
            ) + f"\n  {command}"
        elif output:
            left += " (run again with --resume to finish)"
        parts.append(left)
    print("; ".join(parts), file=sys.stderr)
    for rec in failures[:show]:
        print(f"  {rec.path}: {rec.error}", file=sys.stderr)
    if len(failures) > show:
        print(f"  ... and {len(failures) - show} more (see the error records)", file=sys.stderr)
    for path, why in no_sheet[:show]:
        print(f"  {path}: no overlay sheet: {why}", file=sys.stderr)
    if len(no_sheet) > show:
        print(f"  ... and {len(no_sheet) - show} more sheets not written", file=sys.stderr)
