"""Person-mask coverage of the encoder's grid cells, one map per photo, read for training.

``scripts/label_person_masks.py`` writes these files once per dataset (from an offline person
segmenter, in an environment of its own); training reads them to supervise the attention of the
words that name people (``objectives.GroundingConfig``). Only numpy is needed here, so the
labelling environment uses the same writer as the trainer's reader.

File format (``.npz``, numpy's zip of arrays, read with ``allow_pickle=False``; no pickle):

    ids        (N,) unicode      image ids, as the dataset reader names them (Flickr8k: the file
                                 name), unique
    coverage   (N, g, g) uint8   round(255 x the share of grid cell (r, c) that the person mask
                                 covers); g is the encoder's grid (9 for EfficientNet-Lite2 at
                                 260 px)
    meta       () unicode        JSON: {"format": 1, "grid": g, ...} plus how the masks were made
                                 (segmenter, threshold): provenance, not read by training

Cell geometry is the captioner's (``attention_correctness``): the photo is resized to a square
without keeping its aspect ratio, so cell (r, c) of a W x H photo is the rectangle
[c W/g, (c+1) W/g) x [r H/g, (r+1) H/g), and a pixel cut by a cell edge counts toward each cell
in proportion to its overlap. A map of zeros means the segmenter found no person.
Quantised to 1/255, a 7000-photo Flickr8k file is 567 kB before compression.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from showattendtell.errors import UsageError

FORMAT = 1


class PersonMasksError(UsageError, ValueError):
    """The person-mask file is missing or is not one that label_person_masks.py wrote."""


class PersonMasks:
    """Read access: ``masks.coverage_of(image_id)`` -> (g, g) float32 in [0, 1], or None for a
    photo the file does not hold."""

    def __init__(self, ids: Sequence[str], coverage: np.ndarray, meta: Mapping):
        self.ids = list(ids)
        self.coverage = coverage  # (N, g, g) uint8
        self.meta = dict(meta)
        self.row = {image_id: i for i, image_id in enumerate(self.ids)}

    @property
    def grid(self) -> int:
        return int(self.coverage.shape[1])

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, image_id: str) -> bool:
        return image_id in self.row

    def coverage_of(self, image_id: str) -> np.ndarray | None:
        i = self.row.get(image_id)
        return None if i is None else self.coverage[i].astype(np.float32) / 255.0


def write_person_masks(
    path: str | Path, ids: Sequence[str], coverage: np.ndarray, meta: Mapping | None = None
) -> None:
    """Write ``coverage`` ((N, g, g) shares in [0, 1]) of the photos ``ids`` to ``path``.

    Written to a temporary name and renamed, so an interrupted run never leaves half a file.
    """
    coverage = np.asarray(coverage, dtype=np.float64)
    ids = [str(i) for i in ids]
    if coverage.ndim != 3 or coverage.shape[1] != coverage.shape[2]:
        raise ValueError(f"coverage must be (N, g, g), not {coverage.shape}")
    if coverage.shape[0] != len(ids):
        raise ValueError(f"{len(ids)} ids for {coverage.shape[0]} coverage maps")
    if len(set(ids)) != len(ids):
        raise ValueError("image ids must be unique")
    if coverage.size and (coverage.min() < 0 or coverage.max() > 1):
        raise ValueError("coverage is a share of each cell: values must lie in [0, 1]")
    info = {**(meta or {}), "format": FORMAT, "grid": int(coverage.shape[1])}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez_compressed(
        tmp,
        ids=np.asarray(ids, dtype=np.str_),
        coverage=np.round(coverage * 255).astype(np.uint8),
        meta=np.asarray(json.dumps(info, sort_keys=True), dtype=np.str_),
    )
    os.replace(tmp, path)


def read_person_masks(path: str | Path, grid: int | None = None) -> PersonMasks:
    """Read a file of ``write_person_masks``; ``grid``: the encoder's, checked against it."""
    path = Path(path)
    hint = "make it with scripts/label_person_masks.py (see its docstring)"
    if not path.is_file():
        raise PersonMasksError(f"person masks: {path} not found: {hint}")
    try:
        with np.load(path, allow_pickle=False) as z:
            ids, coverage, meta = z["ids"], z["coverage"], json.loads(str(z["meta"]))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise PersonMasksError(
            f"person masks: {path} is not a person-mask file "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
            f"{hint}"
        ) from None
    if (
        meta.get("format") != FORMAT
        or coverage.dtype != np.uint8
        or coverage.ndim != 3
        or ids.ndim != 1
        or len(ids) != len(coverage)
        or coverage.shape[1] != coverage.shape[2]
    ):
        raise PersonMasksError(
            f"person masks: {path} is not a person-mask file of format {FORMAT}: {hint}"
        )
    if grid is not None and coverage.shape[1] != grid:
        raise PersonMasksError(
            f"person masks: {path} has {coverage.shape[1]}x{coverage.shape[1]} cells but the "
            f"encoder makes a {grid}x{grid} grid: label the photos again with --grid {grid}"
        )
    return PersonMasks([str(i) for i in ids], coverage, meta)
