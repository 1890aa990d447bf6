"""Captioning files through the image pipeline (images/pipeline.py: decoded, encoded in
batches), with every input accounted for in input order (an undecodable file is a record with
an error, never an exception).

`sat caption` and `sat evaluate` run ``caption_files``; the web service, whose images arrive
decoded, runs ``Captioner.caption_batch`` on its own batches. Distributed captioning splits the
paths and runs the same functions in each process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from showattendtell.captioning.captioner import Captioner, CaptionResult
from showattendtell.images.pipeline import encode_files
from showattendtell.progress import Progress
from showattendtell.search.options import DEFAULT_BATCH_SIZE, DecodingConfig


@dataclass
class Record:
    """One input's outcome: a caption result or why there is none, for the image at ``path``."""

    path: str
    result: CaptionResult | None = None
    error: str | None = None


def caption_files(
    captioner: Captioner,
    paths: Sequence[str | Path],
    batch_size: int = DEFAULT_BATCH_SIZE,
    workers: int | None = None,
    progress: Progress | None = None,
    lanes: int | None = None,
    jpeg_on_device: bool = False,
    decoding: DecodingConfig | None = None,
) -> Iterator[Record]:
    """Caption image files; yields one Record per path, in input order, as batches finish.

    Encoding and decoding are batched (greedy for beam 1, batched beam search otherwise), with
    ``lanes`` batches in flight (``in_lanes``); image decoding overlaps with them (in
    ``workers`` processes, or in this process's main thread while the lanes compute).
    ``decoding``: resolved by the caller (``Captioner.check_decoding``), None: the model's
    stored settings; checked against the model before any work.
    """
    decoding = decoding or captioner.decoding
    captioner.model.check_decoding(decoding)

    def caption(images: torch.Tensor) -> list[CaptionResult]:
        return captioner.caption_annotations(captioner.encode(images), decoding)

    for batch, results in encode_files(
        paths,
        caption,
        captioner.input_size,
        batch_size,
        workers,
        captioner.device,
        progress,
        lanes,
        jpeg_on_device,
    ):
        it = iter(results or [])
        for item in batch.items:
            if item.error is not None:
                yield Record(item.path, error=item.error)
            else:
                result = next(it)
                result.add_warning(item.warning)
                yield Record(item.path, result=result)
