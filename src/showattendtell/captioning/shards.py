"""A folder of record shards (`sat caption --engine ray -o OUT/ --format parquet|jsonl`): for jobs
too large for one file, the records in numbered files, each written whole.

Every shard is written to a hidden temporary name and renamed into place when complete
(``os.replace`` is atomic), so a killed run leaves whole shards only, plus at worst a temporary
file that the next run removes. ``--resume`` reads the shards' paths and what made their
captions, as it reads one output file (records.py). Records are the same objects as the JSON
Lines file's; in Parquet the ``decoding`` field is a JSON string (as in CSV) and the grids of
``--with-attention`` nested lists.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from showattendtell.captioning.records import ResumePoint, scan_output
from showattendtell.outputs import OutputError

SHARD_FORMATS = ("parquet", "jsonl")
SHARD_NAME = re.compile(r"part-(\d{6})\.(parquet|jsonl)")
TEMPORARY = re.compile(r"\.part-\d{6}\.(parquet|jsonl)\.tmp")


def shard_name(number: int, fmt: str) -> str:
    return f"part-{number:06d}.{fmt}"


def shards(folder: Path, fmt: str | None = None) -> list[Path]:
    """The shard files in ``folder`` (of ``fmt``, or of any format), in order."""
    found = [
        p
        for p in folder.iterdir()
        if (m := SHARD_NAME.fullmatch(p.name)) and (fmt is None or m.group(2) == fmt)
    ]
    return sorted(found)


def next_number(folder: Path) -> int:
    """The number of the next shard: after every shard there, of any format."""
    numbers = [int(SHARD_NAME.fullmatch(p.name).group(1)) for p in shards(folder)]
    return max(numbers, default=-1) + 1


def remove_leftovers(folder: Path) -> int:
    """Remove the temporary files of shards a killed run was writing; how many."""
    gone = 0
    for p in folder.iterdir():
        if TEMPORARY.fullmatch(p.name):
            p.unlink(missing_ok=True)
            gone += 1
    return gone


def _parquet_schema(with_attention: bool):
    import pyarrow as pa  # with the [ray] extra

    fields = [
        ("path", pa.string()),
        ("caption", pa.string()),
        ("score", pa.float64()),
        ("log_prob", pa.float64()),
        ("words", pa.list_(pa.string())),
        ("familiarity", pa.float64()),
        ("confidence", pa.float64()),
        ("warning", pa.string()),
        ("error", pa.string()),
        ("model", pa.string()),
        ("model_sha256", pa.string()),
        ("decoding", pa.string()),
    ]
    if with_attention:
        fields += [
            ("attention", pa.list_(pa.list_(pa.list_(pa.float64())))),
            ("locations", pa.list_(pa.list_(pa.int64()))),
        ]
    return pa.schema(fields)


def write_shard(
    folder: Path, number: int, fmt: str, records: Sequence[dict], with_attention: bool
) -> Path:
    """Write ``records`` (``record_dict``s) as shard ``number``: to a temporary name, flushed to
    disk, then renamed into place. Returns its path."""
    path = folder / shard_name(number, fmt)
    tmp = folder / f".{path.name}.tmp"
    try:
        if fmt == "jsonl":
            text = "".join(
                json.dumps(d, ensure_ascii=False, allow_nan=False) + "\n" for d in records
            )
            with open(tmp, "wb") as f:
                f.write(text.encode("utf-8", "backslashreplace"))
                f.flush()
                os.fsync(f.fileno())
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = _parquet_schema(with_attention)
            rows = [
                {**d, "decoding": json.dumps(d["decoding"]) if "decoding" in d else None}
                for d in records
            ]
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the shard {path}: {e.strerror or e}") from None
    return path


def scan_shards(folder: Path, fmt: str, with_attention: bool) -> ResumePoint:
    """What the shards of ``folder`` hold, for --resume: every record's path and what made its
    captions. A shard that is not ours (or written with another --with-attention) is refused,
    as a foreign output file is, and nothing is changed."""
    point = ResumePoint()
    others = [p.name for p in shards(folder) if not p.name.endswith(fmt)]
    if others:
        raise OutputError(
            f"--resume: {folder} holds shards of another format ({others[0]}); give that "
            "--format to continue it"
        )
    for path in shards(folder, fmt):
        if fmt == "jsonl":
            part = scan_output(path, "jsonl", with_attention)
            if part.keep_bytes < path.stat().st_size:  # shards are renamed into place whole
                raise OutputError(f"--resume: {path} ends in a partial record: not our shard")
            point.done.update(part.done)
            point.unmarked += part.unmarked
            for made_by in part.made_by:
                if made_by not in point.made_by:
                    point.made_by.append(made_by)
        else:
            _scan_parquet(path, with_attention, point)
    return point


def _scan_parquet(path: Path, with_attention: bool, point: ResumePoint) -> None:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["path", "error", "model", "decoding", "model_sha256"])
        names = pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a foreign file
        raise OutputError(f"--resume: {path} is not a `sat caption` Parquet shard ({e})") from None
    if ("attention" in names) != with_attention:
        hint = "drop" if with_attention else "add"
        raise OutputError(
            f"--resume: {path} was written {'without' if with_attention else 'with'} "
            f"--with-attention: {hint} that option to continue it"
        )
    for row in table.to_pylist():
        if not row["error"]:
            decoding = json.loads(row["decoding"]) if row["decoding"] else {}
            point.saw(row["model"], decoding, row["model_sha256"])
        point.done[row["path"]] += 1
