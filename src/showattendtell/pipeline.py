"""The one image pipeline: files -> decoded in worker processes -> encoded in batches ->
captioned, with every input accounted for in input order (an undecodable file is a record with
an error, never an exception).

`sat caption` and `sat evaluate` run ``caption_files``; the feature cache runs
``encode_files`` and stores the grids; the web service, whose images arrive decoded, runs
``Captioner.caption_batch`` on its own batches. Distributed captioning splits the paths and
runs the same functions in each process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from showattendtell.images import ImageBatch, load_batches, normalise
from showattendtell.progress import Progress

if TYPE_CHECKING:
    from showattendtell.inference import Captioner, CaptionResult


@dataclass
class Record:
    """One input's outcome: a caption result or why there is none, for the image at ``path``."""

    path: str
    result: CaptionResult | None = None
    error: str | None = None


def default_workers() -> int:
    """Image-decoding worker processes: one per core, at most 4 (the CNN needs cores too)."""
    return min(4, os.cpu_count() or 1)


def encode_files(paths: Sequence[str | Path], encode: Callable[[torch.Tensor], torch.Tensor],
                 input_size: int, batch_size: int = 16, workers: int | None = None,
                 device: torch.device | str = "cpu", progress: Progress | None = None,
                 ) -> Iterator[tuple[ImageBatch, torch.Tensor | None]]:
    """(batch, its annotation grids (n_decoded, L, D) or None) for consecutive inputs, in input
    order; images are decoded by ``workers`` processes while the encoder runs."""
    device = torch.device(device)
    workers = default_workers() if workers is None else workers
    pin = device.type == "cuda"
    for batch in load_batches(paths, input_size, batch_size, workers, pin):
        grids = None
        if batch.tensors is not None:
            grids = encode(normalise(batch.tensors.to(device, non_blocking=pin)))
        yield batch, grids
        if progress is not None:
            progress(len(batch.items))


def caption_files(captioner: Captioner, paths: Sequence[str | Path], batch_size: int = 16,
                  workers: int | None = None, progress: Progress | None = None,
                  **decoding: Any) -> Iterator[Record]:
    """Caption image files; yields one Record per path, in input order, as batches finish.

    Encoding and decoding are batched (greedy for beam 1, batched beam search otherwise); image
    decoding overlaps with them in worker processes. Decoding options are checked first.
    """
    captioner.decoding.with_overrides(**decoding)
    for batch, grids in encode_files(paths, captioner.encode, captioner.input_size, batch_size,
                                     workers, captioner.device, progress):
        results = iter(captioner.caption_annotations(grids, **decoding)
                       if grids is not None else [])
        for item in batch.items:
            if item.error is not None:
                yield Record(item.path, error=item.error)
            else:
                result = next(results)
                result.warning = item.warning
                yield Record(item.path, result=result)
