"""The output file of `sat caption`: one JSON Lines or CSV record per image, written whole, and
what ``--resume`` may read back from it.

Every record is written with one write and flushed at once, so an interrupted run leaves complete
records, plus at worst one partial last record if the process was killed mid-write. ``--resume``
reads the whole file before it changes anything: every complete record must be one of ours, and
the only thing it ever removes is that one partial last record (its image is captioned again).
Any other file is refused and left byte for byte as it was.

Each format is one ``OutputFormat`` entry in a registry (``register_output_format``,
``get_output_format``, ``list_output_formats``): its name (--format), its suffix, its header, how
a record becomes a line and how --resume reads a file back.

Import-light (no torch): the CLI imports it when it builds its parser.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import stat
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from showattendtell.outputs import OutputError, printable_path
from showattendtell.registry import Registry
from showattendtell.search.options import DECODING_OPTIONS

if TYPE_CHECKING:
    from showattendtell.captioning.pipeline import Record

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")  # names that promise what is not written
MADE_BY_FIELDS = ("model", "decoding", "model_sha256")  # what made a caption: Captioner.made_by
CSV_FIELDS = (
    "path",
    "caption",
    "score",
    "log_prob",
    "error",
    "warning",
    "familiarity",
    "confidence",
    *MADE_BY_FIELDS,
)
ATTENTION_FIELDS = ("attention", "locations")
# files written before the confidence column (confidence.py); still resumable, as are these:
_CSV_BEFORE_CONFIDENCE = tuple(f for f in CSV_FIELDS if f != "confidence")
_CSV_BEFORE_WARNINGS = _CSV_BEFORE_CONFIDENCE[:5]  # before the warning column
_CSV_BEFORE_FAMILIARITY = _CSV_BEFORE_CONFIDENCE[:6]  # and the familiarity column
_CSV_BEFORE_MADE_BY = _CSV_BEFORE_CONFIDENCE[:7]  # and the model and decoding columns
_CSV_BEFORE_SHA256 = _CSV_BEFORE_CONFIDENCE[:9]  # and the model_sha256 column
LOW_SUFFIX = ".low"  # --min-confidence: OUT.jsonl's records below it go to OUT.low.jsonl
JSONL_RECORD_START = '{"path": '  # how every JSON line we write begins


def record_dict(rec: Record, with_attention: bool, made_by: dict | None = None) -> dict:
    """One record as JSON: a caption's fields, then what made it (``made_by``: the model's name
    and its decoding options, so that --resume can refuse to add another model's captions),
    then the attention grids; an error record is its path and error only."""
    if rec.result is None:
        error = rec.error if rec.error is None else printable_path(rec.error)
        return {"path": printable_path(rec.path), "error": error}
    result = rec.result.to_dict(with_attention)
    grids = {k: result.pop(k) for k in ATTENTION_FIELDS if k in result}
    d = {"path": printable_path(rec.path), **result, **(made_by or {}), **grids}
    if d.get("warning"):
        d["warning"] = printable_path(d["warning"])
    return d


def csv_fields(with_attention: bool) -> tuple[str, ...]:
    return CSV_FIELDS + (ATTENTION_FIELDS if with_attention else ())


def low_output(path: Path) -> Path:
    """Where --min-confidence sends the records below it: OUT.jsonl -> OUT.low.jsonl (a name
    without a suffix gets ``.low`` at its end)."""
    if path.suffix:
        return path.with_name(path.stem + LOW_SUFFIX + path.suffix)
    return path.with_name(path.name + LOW_SUFFIX)


@dataclass(frozen=True)
class OutputFormat:
    """One output format of `sat caption`, as data: a new format is one
    ``register_output_format`` call (and, where it needs them, its line and scan functions)."""

    name: str  # the --format value
    suffix: str  # the --output suffix that picks it without --format
    line: Callable[[dict, tuple[str, ...]], str]  # (record_dict, CSV columns) -> the line
    scan: Callable[[Path, str, bool], ResumePoint]  # (path, text, with_attention): --resume
    header: Callable[[tuple[str, ...]], str] | None = None  # the first line of a new file


_FORMATS: Registry[OutputFormat] = Registry(
    "output format",
    lambda name, names: OutputError(f"--format must be one of {', '.join(names)}, not {name!r}"),
)
get_output_format = _FORMATS.find  # the format, or an OutputError (exit status 2) naming them all


def register_output_format(fmt: OutputFormat) -> OutputFormat:
    """A format of its own suffix too: ``output_format`` tells formats apart by suffix."""
    if any(f.suffix == fmt.suffix for f in _FORMATS.values()):
        raise ValueError(f"output format {fmt.name!r}: suffix {fmt.suffix} already registered")
    return _FORMATS.register(fmt)


def list_output_formats() -> list[str]:
    """The registered formats' names; the first is the default (standard output)."""
    return list(_FORMATS)


def output_format(name: str | None, given: str | None) -> str:
    """The format to write: ``given`` (--format), else the one --output's suffix names, the
    first registered (JSON Lines) for standard output and names without a suffix (/dev/null).
    Any other suffix is refused rather than guessed: ``x.csv.gz`` or ``x.txt`` would get JSON
    Lines. So is a compressed name with any format, for a file that is not compressed."""
    suffix = Path(name).suffix.lower() if name else ""
    if suffix in COMPRESSED:
        plain = name[: -len(suffix)]
        raise OutputError(
            f"--output {name}: `sat caption` writes no compressed files; write {plain} "
            "and compress it once the run is done"
        )
    if given is not None:
        return get_output_format(given).name
    if not suffix:
        return list_output_formats()[0]
    by_suffix = {f.suffix: f.name for f in _FORMATS.values()}
    if suffix not in by_suffix:
        names = " or ".join(by_suffix)
        formats = " or ".join(f"--format {f}" for f in _FORMATS)
        raise OutputError(
            f"--output {name}: the format is taken from the suffix, {names}, not {suffix}; "
            f"rename it, or give {formats}"
        )
    return by_suffix[suffix]


def format_help() -> str:
    """--format's help, from the registry."""
    names = list_output_formats()
    suffixes = " or ".join(_FORMATS[n].suffix for n in names)
    return (
        f"{' or '.join(names)}; default: from the --output suffix, {suffixes} ({names[0]} for "
        "standard output and a name without a suffix; any other suffix is refused)"
    )


class Writer:
    """Writes complete records, each with a single write followed by a flush.

    A kill between writes leaves whole records only; a record is never split over two writes
    (short writes of a regular file are retried until the record is out). CSV rows follow
    ``fields`` (a resumed file keeps its own header's layout). ``made_by``
    (``Captioner.made_by``) goes into every caption record.
    """

    def __init__(
        self,
        fmt: str,
        with_attention: bool,
        stream: IO[bytes] | None = None,
        fields: tuple[str, ...] | None = None,
        made_by: dict | None = None,
    ):
        self.fmt, self.with_attention, self.stream = fmt, with_attention, stream
        self.spec = get_output_format(fmt)
        self.fields = fields or csv_fields(with_attention)
        self.made_by = made_by
        self.low: Writer | None = None  # --min-confidence: where the records below it go
        self.min_confidence = 0.0

    def target(self, rec: Record) -> Writer:
        """The writer of ``rec``: ``low`` for a caption whose confidence is below
        ``min_confidence``, else this one (errors and captions without a confidence too)."""
        conf = None if rec.result is None else rec.result.confidence
        if self.low is not None and conf is not None and conf < self.min_confidence:
            return self.low
        return self

    def write(self, rec: Record) -> None:
        self.write_line(self.line(rec))

    def line(self, rec: Record) -> str:
        """The record as it goes into the file (one JSON line or one CSV row, newline included);
        several captioning processes format their own and one writes them all."""
        return self.dict_line(record_dict(rec, self.with_attention, self.made_by))

    def dict_line(self, d: dict) -> str:
        """``line`` of a record already made into a dict (``record_dict``): the Ray engine's
        records arrive from its actors as JSON objects."""
        return self.spec.line(d, self.fields)

    def header(self) -> None:
        """The first line of a new file, for a format that has one (CSV's columns)."""
        if self.spec.header is not None:
            self.write_line(self.spec.header(self.fields))

    def write_line(self, line: str) -> None:
        data = line.encode("utf-8", "backslashreplace")  # always UTF-8 (see printable_path)
        if self.stream is None:  # standard output: looked up now (a progress bar may wrap it)
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        start = self._end()
        view = memoryview(data)
        try:
            while view:
                n = self.stream.write(view)
                view = view[n:]
            self.stream.flush()
        except OSError:
            # a full disk mid-record: cut the file back to its last whole record (cutting
            # needs no space), so that any reader, not only --resume, finds whole records
            if start is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.stream.truncate(start)
            raise

    def _end(self) -> int | None:
        """Where the next record starts: the end of the file (appended to), from the file
        system, not the stream's position, which a truncation leaves behind; None for what is
        no regular file (a pipe, /dev/full)."""
        try:
            st = os.fstat(self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None


def _csv_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, allow_nan=False)
    return str(value)


def _jsonl_line(d: dict, fields: tuple[str, ...]) -> str:
    return json.dumps(d, ensure_ascii=False, allow_nan=False) + "\n"


def _csv_row(d: dict, fields: tuple[str, ...]) -> str:
    return _csv_line([_csv_cell(d.get(f)) for f in fields])


def _csv_line(row: list) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(row)
    return buf.getvalue()


# --------------------------------------------------------------------------- --resume


@dataclass
class ResumePoint:
    """What a previous run left in the output file."""

    # paths with a complete record, each as often as it is there: an input given twice, or two
    # names that print alike (a byte that is not UTF-8, \xNN, beside a name holding "\xNN")
    done: Counter[str] = field(default_factory=Counter)
    keep_bytes: int = 0  # the file is cut to this length before appending (drops a partial tail)
    fields: tuple[str, ...] | None = None  # the CSV header's columns (None: no header yet)
    # what made its captions (Captioner.made_by), each once; and how many captions say nothing
    # of it (written before records carried it)
    made_by: list[dict] = field(default_factory=list)
    unmarked: int = 0

    def saw(self, model: object, decoding: object, sha256: object = None) -> None:
        """One caption record's ``model``, ``decoding`` and ``model_sha256`` fields (None or
        "": not there)."""
        if not isinstance(model, str) or not model:
            self.unmarked += 1
            return
        made_by: dict = {"model": model}
        if isinstance(sha256, str) and sha256:
            made_by["model_sha256"] = sha256
        made_by["decoding"] = decoding if isinstance(decoding, dict) else {}
        if made_by not in self.made_by:
            self.made_by.append(made_by)


def scan_output(path: Path, fmt: str, with_attention: bool) -> ResumePoint:
    """Read an output file to resume; nothing is changed. Raises OutputError (exit 2) for a
    file that is not a `sat caption` output of this format and these options."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise OutputError(f"--resume: cannot read {path}: {e.strerror or e}") from None
    text = data.decode("utf-8", "surrogateescape")
    point = get_output_format(fmt).scan(path, text, with_attention)
    point.keep_bytes = len(text[: point.keep_bytes].encode("utf-8", "surrogateescape"))
    return point


def _not_ours(path: Path, fmt: str, where: str) -> OutputError:
    other = " or ".join(f"--format {f}" for f in list_output_formats() if f != fmt)
    return OutputError(
        f"--resume: {path} is not a `sat caption` {fmt.upper()} file ({where}); "
        f"it is left as it was. Is it the right file (or {other})?"
    )


def _scan_jsonl(path: Path, text: str, with_attention: bool) -> ResumePoint:
    point = ResumePoint()
    end = text.rfind("\n") + 1
    complete, tail = text[:end], text[end:]
    for n, line in enumerate(complete.split("\n")[:-1], 1):
        if not line.strip():
            continue
        rec = _json_record(line)
        if rec is None:
            raise _not_ours(path, "jsonl", f"line {n}")
        _check_attention(
            path, "caption" in rec and ("attention" in rec) != with_attention, with_attention
        )
        if "caption" in rec:
            point.saw(rec.get("model"), rec.get("decoding"), rec.get("model_sha256"))
        point.done[rec["path"]] += 1
    ours = tail.startswith(JSONL_RECORD_START) or JSONL_RECORD_START.startswith(tail)
    if not ours:  # a last line without a newline that is not the start of one of our records
        raise _not_ours(path, "jsonl", f"its last line, {_preview(tail)}, is not a record")
    point.keep_bytes = end  # cut the partial tail, if any: that image is captioned again
    return point


def _json_record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if (
        isinstance(rec, dict)
        and isinstance(rec.get("path"), str)
        and ("caption" in rec or "error" in rec)
    ):
        return rec
    return None


def _csv_records(text: str):
    """(row, end offset in characters, terminated by a newline) for every CSV record. Records
    may span lines (quoted newlines in file names), so lines are fed to csv.reader one by one
    and each row's end is where the reader stopped consuming."""
    consumed = 0
    last_line_ended = True

    def lines():
        nonlocal consumed, last_line_ended
        for line in re.findall(r"[^\n]*\n|[^\n]+\Z", text):  # only "\n" ends a line here
            consumed += len(line)
            last_line_ended = line.endswith("\n")
            yield line

    reader = csv.reader(lines(), strict=True)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:  # an unterminated quote at the very end: a partial record
            yield None, consumed, False
            return
        yield row, consumed, last_line_ended


def _scan_csv(path: Path, text: str, with_attention: bool) -> ResumePoint:
    point = ResumePoint()
    layouts = [csv_fields(a) for a in (False, True)]
    layouts += [
        old + extra
        for old in (
            _CSV_BEFORE_WARNINGS,
            _CSV_BEFORE_FAMILIARITY,
            _CSV_BEFORE_MADE_BY,
            _CSV_BEFORE_SHA256,
            _CSV_BEFORE_CONFIDENCE,
        )
        for extra in ((), ATTENTION_FIELDS)
    ]
    header = "\n".join(",".join(f) for f in layouts)
    for n, (row, end, ended) in enumerate(_csv_records(text), 1):
        if not ended:  # the last record, cut short by a kill: it must be a prefix of a record
            if n == 1:
                ok = row is not None and any(",".join(f).startswith(",".join(row)) for f in layouts)
            else:
                ok = row is None or 0 < len(row) <= len(point.fields)
            if not ok:
                raise _not_ours(path, "csv", "its last line is not a record")
            break
        if n == 1:
            if tuple(row) not in layouts:
                raise _not_ours(path, "csv", f"no `{header.splitlines()[0]}` header")
            point.fields = tuple(row)
            _check_attention(path, ("attention" in row) != with_attention, with_attention)
        elif len(row) != len(point.fields):
            raise _not_ours(
                path, "csv", f"record {n} has {len(row)} columns, the header {len(point.fields)}"
            )
        else:
            _saw_csv_row(point, dict(zip(point.fields, row, strict=True)))
            point.done[row[0]] += 1
        point.keep_bytes = end
    return point


def _saw_csv_row(point: ResumePoint, row: dict[str, str]) -> None:
    """A CSV row's part in ``point.made_by``: a caption (no error) with its model, decoding
    and model_sha256 cells, empty in a file written before those columns."""
    if row["error"]:
        return
    try:
        decoding = json.loads(row.get("decoding") or "{}")
    except ValueError:
        decoding = None
    point.saw(row.get("model"), decoding, row.get("model_sha256"))


def _check_attention(path: Path, mismatch: bool, with_attention: bool) -> None:
    if mismatch:
        hint = (
            "was written without --with-attention: drop that option"
            if with_attention
            else "was written with --with-attention: add that option"
        )
        raise OutputError(f"--resume: {path} {hint} to continue it (or write a new file)")


def check_made_by(path: Path, found: list[dict], ours: dict) -> None:
    """Refuse (OutputError, exit 2) to add this run's captions, made as ``ours`` says
    (``Captioner.made_by``), to a file holding captions another model or other decoding
    options made (``found``: ``ResumePoint.made_by``): the file would mix them without a
    word. The model file's SHA-256 and the decoding options are compared where both name
    them (records written by an earlier version lack some)."""
    for theirs in found:
        keys = [k for k in theirs["decoding"] if k in ours["decoding"]]
        differ = [k for k in keys if theirs["decoding"][k] != ours["decoding"][k]]
        digests = theirs.get("model_sha256"), ours.get("model_sha256")
        other_file = None not in digests and digests[0] != digests[1]
        same_name = theirs["model"] == ours["model"]
        if same_name and not differ and not other_file:
            continue
        digest = other_file and same_name  # where the names alone do not tell them apart
        raise OutputError(
            f"--resume: {path} holds captions made with {_made_with(theirs, differ, digest)}"
            f"; this run would add captions made with {_made_with(ours, differ, digest)}: "
            "give the same --model and decoding options to continue it, or write a new file "
            "(another --output, or --overwrite instead of --resume)"
        )


def _made_with(made_by: dict, options: list[str], by_file: bool = False) -> str:
    """'model tiny, --beam-size 1': the model and the given decoding options, as flags;
    ``by_file``: the model with the start of its file's SHA-256, where two files share a name."""
    parts = [f"model {made_by['model']}"]
    if by_file:
        parts[0] += f" (file SHA-256 {made_by['model_sha256'][:12]}...)"
    for name in options:
        value = made_by["decoding"][name]
        flag = (
            DECODING_OPTIONS[name].flag
            if name in DECODING_OPTIONS
            else f"--{name.replace('_', '-')}"
        )
        parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return ", ".join(parts)


def unmarked_warning(path: Path, point: ResumePoint) -> str | None:
    """The warning for a file with captions that do not say what made them (written before
    records carried it): only the user can tell whether they are this run's."""
    n = point.unmarked
    if not n:
        return None
    some, them = ("1 caption in it does", "it") if n == 1 else (f"{n:,} captions in it do", "them")
    return (
        f"--resume: {path} was written by an older `sat caption`: {some} not say which model "
        f"and decoding options made {them}; continuing it, so make sure they were this run's"
    )


def _preview(s: str, n: int = 30) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


register_output_format(OutputFormat("jsonl", ".jsonl", _jsonl_line, _scan_jsonl))
register_output_format(
    OutputFormat("csv", ".csv", _csv_row, _scan_csv, header=lambda fields: _csv_line(list(fields)))
)


def open_output(path: Path, resume: ResumePoint | None) -> IO[bytes]:
    """Open the output file for appending, first cutting a partial last record (``resume``) or
    the old contents (a fresh run). Called once captioning can start, so a run that fails
    before it (a bad model file) leaves an existing file untouched."""
    try:
        stream = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by the caller
        if resume is None:
            if path.is_file():
                stream.truncate(0)
        elif resume.keep_bytes < path.stat().st_size:
            stream.truncate(resume.keep_bytes)
    except OSError as e:
        raise OutputError(f"cannot write --output {path}: {e.strerror or e}") from None
    return stream
