"""The captions of one `sat evaluate` run, kept as they are made so that an interrupted run
resumes: what the run made (``Captions``), the partial file beside the results that holds them
(``PartialCaptions``) and the settings that made them (``settings``), which --resume compares.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from showattendtell.captioning.catalog import resolve_models
from showattendtell.captioning.records import Writer, open_output, scan_output
from showattendtell.errors import Terminated, UsageError
from showattendtell.outputs import OutputLock, printable_path
from showattendtell.search.options import DECODING_OPTIONS, DecodingConfig

log = logging.getLogger("showattendtell.cli.evaluate")  # the messages of `sat evaluate`


class EvaluateError(UsageError, ValueError):
    """Bad arguments or nothing to score."""


class Captions:
    """What an evaluation made, by image id: the captions, why an image could not be read, and
    with --instances each caption's (words, attention (n_words, g, g), attended cells or None);
    ``reused`` of them (``reused_failed`` of the failed) came from an interrupted run's file."""

    def __init__(self) -> None:
        self.captions: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.attention: dict[str, tuple] = {}
        self.reused = self.reused_failed = 0

    @property
    def done(self) -> set[str]:
        return self.captions.keys() | self.failed.keys()

    @classmethod
    def reused_from(cls, partial: PartialCaptions, images: list, grid: int | None) -> Captions:
        """The records --resume read back, for the images of this run; with their attention
        (as kept: 5 decimals), shaped (n_words, grid, grid), when ``grid`` is given."""
        import numpy as np

        made = cls()
        for im in images:
            rec = partial.records.get(printable_path(im.image_id))
            if rec is None:
                continue
            if "caption" not in rec:
                made.failed[im.image_id] = rec.get("error") or "not decodable"
                continue
            made.captions[im.image_id] = rec["caption"]
            if grid is not None:
                cells = rec.get("locations")
                made.attention[im.image_id] = (
                    rec["words"],
                    np.asarray(rec["attention"], dtype=np.float32).reshape(-1, grid, grid),
                    None if cells is None else [tuple(c) for c in cells],
                )
        made.reused, made.reused_failed = len(made.done), len(made.failed)
        return made

    def add(self, new: Captions) -> None:
        self.captions.update(new.captions)
        self.failed.update(new.failed)
        self.attention.update(new.attention)

    def summary(
        self, split: str, elapsed: float, partial: PartialCaptions, output: Path, unwritten
    ) -> str:
        """The line on this run's captioning: its own captions and skipped images, then how
        many came from an interrupted run's file and where the results went."""
        made = len(self.captions) - (self.reused - self.reused_failed)
        failed = len(self.failed) - self.reused_failed
        return (
            f"captioned {made} images of {split} in {elapsed:.1f} s "
            f"({made / max(elapsed, 1e-9):.1f} img/s"
            f"{f', {failed} undecodable images skipped' if failed else ''})"
            + (f"; {self.reused} more from {partial.path}" if self.reused else "")
            + ("" if unwritten else f"; wrote {output}")
        )


PARTIAL_FORMAT = "sat evaluate partial captions 1"


class PartialCaptions:
    """The captions of a `sat evaluate` run so far, so that Ctrl-C or SIGTERM loses none of them.

    ``RESULTS.partial.jsonl`` beside the results file holds `sat caption`'s JSON Lines records
    (caption_output.Writer: whole records, a kill leaves at worst a partial last one), each
    record's "path" the image's id in the split, so a resumed run finds it however --root is
    spelled; ``RESULTS.partial.json`` holds the settings that made them (``settings``).
    ``--resume`` reuses the records (caption_output.scan_output checks the file first) when the
    settings are the same. Both files go once the results file is written. An --output that is
    no regular file (/dev/null) keeps none.

    The run holds an exclusive ``fcntl.flock`` on the partial file from ``start`` until the
    files go (or the run ends), so that a second run on the same --output stops in one line
    instead of interleaving its records with this run's. The lock is advisory, held by an
    open file description, and dropped by the kernel when the process ends however it ends:
    no stale lock file for a later --resume to trip on (caption_output.OutputLock, as `sat
    caption` locks its output). The file locked is the partial file itself (created empty when
    missing, removed again by ``release`` while still empty).
    """

    def __init__(self, output: Path) -> None:
        regular = output.is_file() or not output.exists()
        self.output = output
        self.path = output.with_name(output.name + ".partial.jsonl") if regular else None
        self.settings_path = output.with_name(output.name + ".partial.json") if regular else None
        self.records: dict[str, dict] = {}  # image id -> its record, read back by --resume
        self.writer = None
        self.written = 0  # records written by this run
        self.lock = None  # the OutputLock on the partial file

    def start(self, settings: dict, resume: bool) -> None:
        """Before captioning: lock the partial file, read back what --resume reuses, or refuse
        to start again over the captions an interrupted run left (without --resume); then open
        the file to append. A refusal lets the lock go."""
        if self.path is None:
            if resume:
                raise EvaluateError(f"--resume needs an --output file, not {self.output}")
            return
        # locked first: a second run on a busy --output is told so, whatever else it asked
        self.hold()
        try:
            self._start(settings, resume)
        except BaseException:
            self.release()
            raise

    def _start(self, settings: dict, resume: bool) -> None:
        left = self.path.is_file() and self.path.stat().st_size > 0
        if left and not resume:
            raise EvaluateError(
                f"{self.path} holds the captions of an interrupted run: add --resume to "
                "reuse them, or delete it to start again"
            )
        point = None
        if left:
            settings, point = self._read_back(settings)
        elif resume:
            log.info("--resume: no captions of an interrupted run in %s: captioning all", self.path)
        try:
            write_json_atomic(self.settings_path, settings)
        except OSError as e:
            raise EvaluateError(f"cannot write {self.settings_path}: {e.strerror or e}") from None
        self.writer = Writer("jsonl", settings["attention"], open_output(self.path, point))

    def _read_back(self, settings: dict):
        """(the settings to keep writing with, the ResumePoint) of the partial file, whose
        records are read into ``records``; EvaluateError if its settings are not this run's."""
        try:
            saved = json.loads(self.settings_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if (
            not isinstance(saved, dict)
            or saved.get("format") != PARTIAL_FORMAT
            or not isinstance(saved.get("model"), list)
        ):
            raise EvaluateError(
                f"--resume: {self.settings_path}, the settings of the captions in {self.path}, "
                f"is missing or damaged; delete {self.path} to start again"
            )
        differ = _difference(saved, settings)
        if differ is not None:
            raise EvaluateError(
                f"--resume: the captions in {self.path} were made with {differ}; give the "
                "same to reuse them, or delete that file to start again"
            )
        settings = {**settings, "attention": bool(saved.get("attention"))}  # records keep it
        point = scan_output(self.path, "jsonl", settings["attention"])
        text = self.path.read_bytes()[: point.keep_bytes].decode("utf-8", "surrogateescape")
        for line in text.splitlines():
            if line.strip():
                rec = json.loads(line)
                self.records[rec["path"]] = rec
        return settings, point

    def hold(self) -> None:
        """Take the lock on the partial file (once), or refuse: another run holds it
        (caption_output.OutputLock)."""
        if self.lock is not None or self.path is None:
            return
        self.lock = OutputLock(
            self.path,
            busy=f"another sat evaluate is writing {self.path} (process still running); wait "
            "for it, or choose another --output",
            name=str(self.path),
        )

    def release(self) -> None:
        """Let another run have the partial file; one the lock made, still empty, goes too."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def write(self, rec) -> None:
        if self.writer is not None:
            self.writer.write(rec)
        self.written += 1

    def close(self) -> None:
        if self.writer is not None and self.writer.stream is not None:
            self.writer.stream.close()

    def remove(self) -> None:
        """Remove both files, then the lock: no other run can start on them in between."""
        for path in (self.path, self.settings_path):
            if path is not None:
                path.unlink(missing_ok=True)
        self.release()  # the lock removes no file put at the path since: another run's

    def write_failed(self, e: OSError, done: int, total: int) -> int:
        """A full disk (or a vanished folder) while captioning: the partial file holds whole
        records only (the Writer cut a record it could not finish), so say what is kept and
        how to go on, in one line; exit status 1."""
        self.release()
        print(
            f"error: cannot write {self.path}: {e.strerror or e}; {done} of {total} images "
            "captioned are kept there: free some space and run the same command with --resume",
            file=sys.stderr,
        )
        return 1

    def interrupted(
        self, e: KeyboardInterrupt, done: int, total: int, args, scoring: bool = False
    ) -> int:
        """Say what is kept and how to go on; the exit status (130 Ctrl-C, 143 SIGTERM).
        ``scoring``: stopped after the captions were all made and written to the results
        file, while they were scored; --resume scores them without captioning again."""
        self.release()
        if scoring:
            what = f"interrupted while scoring: {done} of {total} images captioned, written to "
            what += f"{self.output}" + (f" and kept in {self.path}" if self.path else "")
            print(f"{what}; {self._again(args, 'score them')}", file=sys.stderr)
        elif self.path is None:
            print(f"interrupted: {done} of {total} images captioned, not kept", file=sys.stderr)
        else:
            print(
                f"interrupted: {done} of {total} images captioned, kept in {self.path}; "
                + self._again(args, "resume"),
                file=sys.stderr,
            )
        return 143 if isinstance(e, Terminated) else 130

    def _again(self, args, verb: str) -> str:
        """'resume with:\n  sat evaluate ... --resume': the command that goes on."""
        if self.path is None:
            return "run it again to score them"
        given = getattr(args, "command_line", None)
        if given:
            kept = [a for a in given if a != "--overwrite"]  # would refuse with --resume
            command = shlex.join(["sat", *kept, *([] if "--resume" in kept else ["--resume"])])
            return f"{verb} with:\n  {command}"
        return f"run the same command with --resume to {verb.split()[0]}"


def scored_again(output: Path, resume: bool) -> bool:
    """Whether --resume may replace an existing ``output``: it holds the captions of a run
    stopped while scoring (or before), which are also kept in its partial file, so rewriting
    it from them loses nothing. Any other existing file still needs --overwrite."""
    if not resume:
        return False
    kept = PartialCaptions(output).path
    return kept is not None and kept.is_file() and kept.stat().st_size > 0


def settings(args: argparse.Namespace, decoding: DecodingConfig, attention: bool) -> dict:
    """What the captions depend on, so that --resume reuses only captions made the same way:
    the model files, the split, --precision and the decoding settings in effect; not
    --batch-size, --num-workers, --device or --limit. ``attention``: the records keep each
    caption's attention (for --instances)."""
    models = []
    for path in resolve_models(args.model):
        st = path.stat()
        models.append(
            {"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        )
    return {
        "format": PARTIAL_FORMAT,
        "model": models,
        "dataset": args.dataset,
        "root": str(Path(args.root).resolve()),
        "split": args.split,
        "precision": args.precision,
        "decoding": decoding.to_dict(),
        "attention": attention,
    }


def _difference(saved: dict, now: dict) -> str | None:
    """The first setting that differs between an interrupted run's captions and this run, as
    the option to give (None: the same)."""
    defaults = DecodingConfig().to_dict()  # an option newer than the saved captions: its
    # default is what made them
    if saved.get("model") != now["model"]:
        old = "+".join(str(m.get("path")) for m in saved["model"] if isinstance(m, dict))
        new = "+".join(m["path"] for m in now["model"])
        return f"--model {old}" + (" before it changed" if old == new else f" (this run: {new})")
    for key in ("dataset", "root", "split", "precision"):
        if saved.get(key) != now[key]:
            return f"--{key} {saved.get(key)} (this run: {now[key]})"
    old = saved.get("decoding") if isinstance(saved.get("decoding"), dict) else {}
    for name, value in now["decoding"].items():
        if old.get(name, defaults.get(name)) != value:
            flag = DECODING_OPTIONS[name].flag if name in DECODING_OPTIONS else name
            return f"{flag} {old.get(name)} (this run: {value})"
    if now["attention"] and not saved.get("attention"):
        return "no --instances (their attention was not kept)"
    return None


def write_json_atomic(path: Path, data) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file.
    The temporary file is made by open(), so the result has the permissions the umask gives
    (mkstemp's would be private, 0600). An existing path that is no regular file (/dev/null, a
    FIFO) is written as it is: a rename would replace it (as root, /dev/null itself)."""
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
