"""`sat caption --engine ray`: the job on a Ray cluster (captioning/ray_engine.py).

The driver (this process) lists the inputs, plans the run as the one-process job does (caption_job:
what is left with --resume, the output's lock), checks the model and decoding options, then
streams the photos through Ray Data: decoded in tasks, captioned in an actor pool. The records
come back to the driver, which writes them as the one-process job does: one file (JSON Lines or
CSV) in input order, every record with one write, or a folder of shards each renamed into place
whole (captioning/shards.py). A record Ray hands over twice (a retried task's) is written once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.catalog import resolve_models
from showattendtell.captioning.pipeline import Record
from showattendtell.captioning.ray_engine import caption_dataset
from showattendtell.captioning.records import (
    ResumePoint,
    Writer,
    check_made_by,
    open_output,
    output_format,
    unmarked_warning,
)
from showattendtell.captioning.shards import (
    SHARD_FORMATS,
    next_number,
    remove_leftovers,
    scan_shards,
    shards,
    write_shard,
)
from showattendtell.cli.caption_job import (
    Plan,
    _inputs,
    _not_done,
    _nothing_to_do,
    _plan,
    _summary,
)
from showattendtell.cli.common import decoding_overrides, warn_ignored_decoding
from showattendtell.errors import Terminated, UsageError, UserError, sigterm_as_ctrl_c
from showattendtell.outputs import OutputError, OutputLock, prepare_folder
from showattendtell.progress import Progress

SHARD_ROWS = 10_000  # records a shard holds at most
SHARD_SECONDS = 60.0  # and the longest a record waits on the driver before its shard is written
OBJECT_STORE_BYTES = 2 * 1024**3  # a Ray instance started here: its object store at most
LOCK_NAME = ".sat-caption.lock"  # in a folder of shards: held for the run (OutputLock)


def is_folder_output(args: argparse.Namespace) -> bool:
    """``-o OUT/`` (a trailing slash, or an existing folder) or ``--format parquet``: shards."""
    out = args.output or ""
    return out.endswith(("/", os.sep)) or os.path.isdir(out) or args.format == "parquet"


def run(args: argparse.Namespace) -> int:
    """Caption what ``args`` names on Ray; the exit status (as the one-process job's)."""
    decoding = decoding_overrides(args)
    folder = is_folder_output(args)
    lock: list[OutputLock] = []
    with sigterm_as_ctrl_c():
        try:
            if folder:
                fmt = args.format or "parquet"
                plan, next_shard = _plan_shards(args, fmt, lock)
                resume = None
            else:
                fmt = output_format(args.output, args.format)
                plan, resume = _plan(args, fmt, lock)
                next_shard = 0
            if not plan.todo:
                return _nothing_to_do(plan, args)
            made_by = _checked_made_by(args, plan, decoding)
            return _caption(args, plan, resume, fmt, decoding, made_by, folder, next_shard)
        finally:
            for held in lock:
                held.release()


def _plan_shards(args: argparse.Namespace, fmt: str, lock: list[OutputLock]) -> tuple[Plan, int]:
    """The plan for a folder of shards: the inputs, the folder locked (a lock file in it), its
    shards read with --resume or refused without --resume / --overwrite (removed with
    --overwrite); (plan, the next shard's number)."""
    if fmt not in SHARD_FORMATS:
        raise UsageError(
            f"-o {args.output}: a folder of shards is written as --format parquet or jsonl, "
            f"not {fmt}"
        )
    if not args.output:
        raise UsageError("--format parquet writes a folder of shards: give -o FOLDER/")
    paths = _inputs(args)
    folder = Path(args.output)
    prepare_folder("--output", folder)
    lock.append(OutputLock(folder / LOCK_NAME, name=f"--output {folder}"))
    existing = shards(folder)
    if existing and not (args.resume or args.overwrite):
        raise OutputError(
            f"--output {folder} already holds {len(existing)} shards (e.g. {existing[0].name}); "
            "add --resume to continue them, add --overwrite to replace them, or give another "
            "folder"
        )
    remove_leftovers(folder)
    point = ResumePoint()
    if args.resume:
        point = scan_shards(folder, fmt, args.with_attention)
        warning = unmarked_warning(folder, point)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    elif args.overwrite:
        for p in existing:
            p.unlink()
    todo = _not_done(paths, point.done)
    plan = Plan(todo, len(paths) - len(todo), None, None, point.made_by)
    return plan, next_number(folder)


def _checked_made_by(args: argparse.Namespace, plan: Plan, decoding: dict[str, Any]) -> dict:
    """What will make the captions (model, decoding options), checked on the driver before the
    cluster works: bad decoding options, and with --resume another model's or options'
    captions in the output, are usage errors here. The model is loaded on the CPU for this
    (a second or so for the bundled one); the actors load their own."""
    try:
        captioner = load_model(args.model, "cpu", "32")
        config = captioner.check_decoding(**decoding)
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UsageError(str(e)) from None
    warn_ignored_decoding(decoding, captioner)
    made_by = captioner.made_by(config)
    made_by["decoding"]["precision"] = args.precision  # what the actors caption in
    made_by["decoding"]["decode_on"] = "cpu"
    if plan.made_by:
        check_made_by(Path(args.output), plan.made_by, made_by)
    return made_by


def _connect(address: str | None) -> bool:
    """Join the cluster at ``address`` ("auto": the one `ray start` started on this machine),
    or start a Ray instance on this machine for the run; False where this process was already
    connected (`sat caption` called from a program using Ray: its connection is kept)."""
    import ray

    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address:
        options["address"] = address
    else:  # a local instance: no dashboard, a bounded object store
        options.update(include_dashboard=False, object_store_memory=_store_bytes())
    try:
        ray.init(**options)
    except ConnectionError as e:
        raise UsageError(
            f"--address {address}: no Ray cluster there ({str(e).splitlines()[0]}); start one "
            "with `ray start --head` (docs/captioning.md)"
        ) from None
    for name in ("ray", "ray.data"):  # Ray Data sets its own level when it is imported
        logging.getLogger(name).setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # ours counts photos (Progress)
    ctx.print_on_execution_start = False
    return True


def _store_bytes() -> int:
    """The object store of a Ray instance started here: a tenth of the memory, at most
    OBJECT_STORE_BYTES (Ray's default, 30 %, is more than decoded batches in flight need)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return OBJECT_STORE_BYTES
    return max(100 * 1024**2, min(OBJECT_STORE_BYTES, memory // 10))


def _absolute_model(spec: str | None) -> str | None:
    """The model as the actors find it (their working folder is Ray's): absolute file paths."""
    if spec is None:
        return None
    return "+".join(str(p.resolve()) for p in resolve_models(spec))


def _dataset(args: argparse.Namespace, todo: list[str], decoding: dict[str, Any]):
    """The run as a Ray Dataset: index (input position), path (as given) and file (absolute),
    paths as bytes (a name that is not UTF-8 cannot be an Arrow string), in blocks of a few
    batches, so that many decoding tasks can run at once."""
    import pyarrow as pa
    import ray

    rows = max(args.batch_size * 4, 1)
    tables = []
    for start in range(0, len(todo), rows):
        part = todo[start : start + rows]
        tables.append(
            pa.table(
                {
                    "index": pa.array(range(start, start + len(part)), pa.int64()),
                    "path": pa.array([os.fsencode(p) for p in part], pa.binary()),
                    "file": pa.array([os.fsencode(os.path.abspath(p)) for p in part], pa.binary()),
                }
            )
        )
    return caption_dataset(
        ray.data.from_arrow(tables),
        _absolute_model(args.model),
        actors=args.devices if args.devices > 1 else None,
        device=args.device,
        batch_size=args.batch_size,
        precision=args.precision,
        with_attention=args.with_attention,
        threads=args.threads,
        **decoding,
    )


class _Out:
    """Where the driver puts records: the output file in input order, or shards."""

    def __init__(self, args, fmt, plan, resume, made_by, folder: bool, next_shard: int):
        self.seen = bytearray(len(plan.todo))  # 1 where the record of that input came back
        self.folder = Path(args.output) if folder else None
        self.fmt, self.with_attention = fmt, args.with_attention
        self.next_shard, self.pending_shard, self.since = next_shard, [], time.monotonic()
        self.writer = None
        if self.folder is None:
            stream = None
            if args.output:
                stream = open_output(Path(args.output), resume if args.resume else None)
            self.writer = Writer(fmt, args.with_attention, stream, plan.fields, made_by)
            if fmt == "csv" and plan.fields is None:
                self.writer.header()
        self.waiting: dict[int, dict] = {}  # records ahead of the next in input order
        self.next_index = 0
        self.ok, self.failures = 0, []

    def add(self, index: int, record: dict) -> int:
        """Take one record; how many records were written (or shard-bound) by it."""
        if self.seen[index]:
            return 0  # handed over twice (a retried task): written once
        self.seen[index] = 1
        if self.folder is not None:  # shards: in the order they come
            self._count(record)
            self.pending_shard.append(record)
            if len(self.pending_shard) >= SHARD_ROWS:
                self.flush()
            return 1
        self.waiting[index] = record
        n = 0
        while self.next_index in self.waiting:
            d = self.waiting.pop(self.next_index)
            self.writer.write_line(self.writer.dict_line(d))
            self._count(d)
            self.next_index += 1
            n += 1
        return n

    def tick(self) -> None:
        if self.pending_shard and time.monotonic() - self.since >= SHARD_SECONDS:
            self.flush()

    def _count(self, d: dict) -> None:
        if "error" in d and "caption" not in d:
            self.failures.append(Record(d["path"], error=d["error"]))
        else:
            self.ok += 1

    def flush(self) -> None:
        """Write the records held for a shard (a folder output)."""
        if self.folder is not None and self.pending_shard:
            write_shard(
                self.folder, self.next_shard, self.fmt, self.pending_shard, self.with_attention
            )
            self.next_shard += 1
            self.pending_shard = []
        self.since = time.monotonic()

    def close(self) -> None:
        if self.writer is not None and self.writer.stream is not None:
            self.writer.stream.close()


def _caption(args, plan, resume, fmt, decoding, made_by, folder: bool, next_shard: int) -> int:
    import ray

    connected = _connect(args.address)
    out: _Out | None = None
    interrupted, error = 0, None
    kept = 0
    try:
        ds = _dataset(args, plan.todo, decoding)
        out = _Out(args, fmt, plan, resume, made_by, folder, next_shard)
        # a bar on a terminal unless the records go to a pipe; log lines when stderr is no terminal
        bar = sys.stderr.isatty() and (args.output is not None or sys.stdout.isatty())
        show = True if bar else (False if sys.stderr.isatty() else None)
        with Progress(len(plan.todo), "captioning", enabled=show) as progress:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for index, record in zip(batch["index"], batch["record"], strict=True):
                    n = out.add(int(index), json.loads(str(record)))
                    if n:
                        progress(n)
                out.tick()
        out.flush()
    except KeyboardInterrupt as e:
        interrupted = 143 if isinstance(e, Terminated) else 130
        if out is not None:
            out.flush()  # what came back is worth its shard
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        error = f"cannot write to {args.output or 'standard output'}: {e.strerror or e}"
    except (ray.exceptions.RayError, ray.exceptions.UserCodeException) as e:
        # a stage failed for good (after Ray's retries): one line; Ray's log has the rest
        error = f"the Ray job stopped ({str(e).strip().splitlines()[-1][:300]})"
    finally:
        if out is not None:
            out.close()
            kept = out.ok + len(out.failures) - len(out.pending_shard)
        if connected:
            ray.shutdown()
    ok, failures = (out.ok, out.failures) if out is not None else (0, [])
    if error is not None:
        print(
            f"error: {error}; the {kept} records written before are intact"
            + (" (run again with --resume to finish)" if args.output else ""),
            file=sys.stderr,
        )
        return 1
    _summary(plan, args, ok, failures, bool(interrupted), unreadable=plan.unreadable)
    if interrupted:
        return interrupted
    return 1 if failures or plan.unreadable else 0
