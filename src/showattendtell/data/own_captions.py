"""The ``captions`` dataset format: your own photos and a file of their captions, any language.

The folder holds the photos (in it or in sub-folders) and one captions file:

- ``captions.csv``: a header line naming the columns ``image`` and ``caption`` (and optionally
  ``split``), then one row per caption; a photo with several captions has several rows;
- or ``captions.jsonl``: one JSON object per line, ``{"image": ..., "caption": ...}`` (the
  caption a string or a list of strings; ``"split"`` optional).

``image`` is the photo's path relative to the folder (or to its ``images/`` sub-folder). With a
``split`` column, its values are the split names (every row of a photo in the same split; ``dev``
and ``val`` name the same split when only one of them is used). Without one, the photos are
split by ``split_ratio`` (the training share, default 0.8; the rest halved into ``val`` and
``test``), in an order fixed by a hash of each photo's name, so that every command that reads
the folder with the same ratio gets the same splits.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from showattendtell.data.splits import (
    CaptionedImage,
    DatasetError,
    Split,
    SplitError,
    finish_split,
    read_text,
)

log = logging.getLogger(__name__)

CSV_NAME, JSONL_NAME = "captions.csv", "captions.jsonl"
DEFAULT_SPLIT_RATIO = 0.8
RATIO_SPLITS = ("train", "val", "test")
HOW = "see docs/training.md, 'Your own photos and captions'"


@dataclass
class CaptionsFile:
    """What a captions file says: each photo's captions (in the file's order) and split."""

    path: Path
    captions: dict[str, list[str]] = field(default_factory=dict)  # image -> captions
    splits: dict[str, str] | None = None  # image -> split name, when the file has the column
    empty: int = 0  # rows with an empty caption, skipped


def captions_file(root: Path) -> Path:
    """The folder's captions file; a DatasetError that says what to write when there is none."""
    found = [root / n for n in (CSV_NAME, JSONL_NAME) if (root / n).is_file()]
    if len(found) > 1:
        raise DatasetError(
            f"{root} has both {CSV_NAME} and {JSONL_NAME}: keep the one that holds the captions"
        )
    if not found:
        raise DatasetError(
            f"no {CSV_NAME} or {JSONL_NAME} in {root}: write one with a row per caption "
            f"(columns image,caption and optionally split; {HOW})"
        )
    return found[0]


_CACHE: dict[tuple, CaptionsFile] = {}


def read_captions_file(root: Path) -> CaptionsFile:
    """The folder's captions file, read once per version of the file (the split checks, each
    split and the vocabulary all ask for it)."""
    path = captions_file(root)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        rows = _csv_rows(path) if path.suffix == ".csv" else _jsonl_rows(path)
        _CACHE.clear()
        _CACHE[key] = _collect(path, rows)
    return _CACHE[key]


def _csv_rows(path: Path):
    """(line, image, [captions], split or None) of each row of a CSV file with a header."""
    reader = csv.reader(io.StringIO(read_text(path).removeprefix("\ufeff"), newline=""))
    header = next(reader, None)
    while header is not None and not any(h.strip() for h in header):
        header = next(reader, None)  # blank lines before the header
    if header is None:
        raise DatasetError(
            f"{path} is empty: write a header line image,caption, then a row a caption"
        )
    columns = [h.strip().lower() for h in header]
    missing = [c for c in ("image", "caption") if c not in columns]
    if missing:
        raise DatasetError(
            f"{path} has no {' or '.join(repr(c) for c in missing)} column (its header: "
            f"{','.join(header)}): its first line must name the columns image,caption "
            "(and optionally split)"
        )
    at = {c: columns.index(c) for c in ("image", "caption", "split") if c in columns}
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) < len(columns):
            raise DatasetError(
                f"{path}, line {reader.line_num}: {len(row)} fields, the header names "
                f'{len(columns)}: quote a caption that holds a comma ("...")'
            )
        split = row[at["split"]].strip() if "split" in at else None
        yield reader.line_num, row[at["image"]].strip(), [row[at["caption"]]], split


def _jsonl_rows(path: Path):
    """(line, image, [captions], split or None) of each object of a JSON Lines file."""
    for number, line in enumerate(read_text(path).removeprefix("\ufeff").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}, line {number}: not JSON ({e.msg}): fix the line") from None
        if not isinstance(row, dict) or "image" not in row or "caption" not in row:
            raise DatasetError(
                f'{path}, line {number}: not an object with "image" and "caption": write '
                '{"image": "photo.jpg", "caption": "..."} (and optionally "split")'
            )
        caption, split = row["caption"], row.get("split")
        captions = caption if isinstance(caption, list) else [caption]
        if not isinstance(row["image"], str) or not all(isinstance(c, str) for c in captions):
            raise DatasetError(
                f'{path}, line {number}: "image" must be a string, "caption" a string or a '
                "list of strings"
            )
        if split is not None and not isinstance(split, str):
            raise DatasetError(f'{path}, line {number}: "split" must be a string')
        yield number, row["image"].strip(), captions, None if split is None else split.strip()


def _collect(path: Path, rows) -> CaptionsFile:
    found = CaptionsFile(path)
    for number, image, captions, split in rows:
        if not image:
            raise DatasetError(
                f"{path}, line {number}: no image named: fill it in or remove the line"
            )
        if split is not None:
            if not split:
                raise DatasetError(
                    f"{path}, line {number}: no split named for {image}: fill it in "
                    "(train, val, test, ...)"
                )
            found.splits = found.splits if found.splits is not None else {}
            before = found.splits.setdefault(image, split)
            if before != split:
                raise DatasetError(
                    f"{path}, line {number}: {image} is in split {split!r} here and {before!r} "
                    "on an earlier line: put every caption of a photo in one split"
                )
        kept = [" ".join(c.split()) for c in captions]
        found.empty += sum(not c for c in kept)
        found.captions.setdefault(image, []).extend(c for c in kept if c)
    found.captions = {k: v for k, v in found.captions.items() if v}
    if not found.captions:
        raise DatasetError(f"{path} holds no caption: add a row per caption (image,caption; {HOW})")
    if found.empty:
        log.warning("%s: skipped %d empty captions", path, found.empty)
    return found


def _aliases(names: list[str]) -> list[str]:
    """``dev`` and ``val`` are one split when the file uses only one of them (the training
    settings name the validation split ``dev`` by default)."""
    if "val" in names and "dev" not in names:
        return [*names, "dev"]
    if "dev" in names and "val" not in names:
        return [*names, "val"]
    return names


def captions_split_names(root: Path, split_ratio: float | None = None) -> list[str]:
    """The split names of the folder's captions file (its split column's, else train/val/test)."""
    if not Path(root).is_dir():  # the folder checks say what is wrong
        return _aliases(list(RATIO_SPLITS))
    found = read_captions_file(Path(root))
    if found.splits is None:
        return _aliases(list(RATIO_SPLITS))
    return _aliases(list(dict.fromkeys(found.splits.values())))


def check_split_ratio(ratio: float | None, option: str = "--data.split_ratio") -> None:
    """A split ratio out of range is a usage error (exit status 2)."""
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio < 1):
        raise SplitError(
            f"{option} {ratio}: must be between 0 and 1 (the training share, e.g. 0.8)"
        )


def _by_ratio(images: list[str], ratio: float) -> dict[str, str]:
    """Image -> train/val/test: the first ``ratio`` of the images in the order of their names'
    hashes train, the rest halved (val takes the odd one)."""
    order = sorted(images, key=lambda n: hashlib.sha256(n.encode("utf-8")).hexdigest())
    n_train = min(len(order), max(1, round(ratio * len(order))))
    n_val = math.ceil((len(order) - n_train) / 2)
    return {
        name: "train" if i < n_train else "val" if i < n_train + n_val else "test"
        for i, name in enumerate(order)
    }


def _photo_path(root: Path, image: str) -> Path:
    path = root / image  # an absolute path stays what it is
    if not path.is_file() and (root / "images" / image).is_file():
        return root / "images" / image
    return path


def load_own_captions(root: str | Path, split: str, split_ratio: float | None = None) -> Split:
    """The split ``split`` of a folder of photos and their captions file."""
    root = Path(root)
    check_split_ratio(split_ratio)
    found = read_captions_file(root)
    if found.splits is not None and split_ratio is not None:
        raise DatasetError(
            f"{found.path} has a split column and a split ratio was given: drop one of them"
        )
    names = captions_split_names(root)
    if split not in names:
        raise DatasetError(f"{found.path} has the splits {', '.join(names)}, not {split!r}")
    splits = found.splits or _by_ratio(list(found.captions), split_ratio or DEFAULT_SPLIT_RATIO)
    wanted = {split, *({"val", "dev"} if split in ("val", "dev") else ())}
    items = [
        CaptionedImage(image, _photo_path(root, image), captions)
        for image, captions in found.captions.items()
        if splits.get(image) in wanted
    ]
    hint = (
        f"the image column gives each photo's path in the folder: correct it in {found.path.name}"
    )
    return finish_split(f"{found.path.name}/{split}", items, root, hint)
