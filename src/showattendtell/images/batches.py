"""Many files decoded in DataLoader workers (batch captioning, evaluation, feature cache): a
batch crosses from its decoding process as one tensor of pixels and one of JPEG bytes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from showattendtell.images.files import LoadedImage, load_image
from showattendtell.images.jpeg_device import decode_jpegs, load_jpeg, read_jpeg


@dataclass
class ImageBatch:
    """Consecutive inputs (in input order); ``tensors`` stacks the good ones, and ``jpegs``
    holds the bytes of the JPEGs left to the GPU end to end (``jpeg_spans``: item, start, end).

    Why whole-batch tensors: a decoding process hands each tensor over in its own shared-memory
    file, whose descriptor the main process fetches over a socket. With a tensor per photo the
    main process spent 0.64 ms a photo receiving them, at most about 1,560 photos/s for a
    GPU to caption; with the batch's tensors 0.035 ms (`benchmarks/gpu_report.py --device cpu
    --parts decoding`, 2 cores, ``main_cpu_ms_per_image``).
    """

    items: list[LoadedImage] = field(default_factory=list)
    tensors: torch.Tensor | None = None
    jpegs: torch.Tensor | None = None
    jpeg_spans: list[tuple[int, int, int]] = field(default_factory=list)

    def decoded(self) -> list[int]:
        """Input indices of the images stacked in ``tensors``, in order."""
        return [x.index for x in self.items if x.error is None]

    def failures(self) -> list[tuple[int, str]]:
        """(input index, "path: reason") of the inputs that did not decode."""
        return [(x.index, f"{x.path}: {x.error}") for x in self.items if x.error is not None]

    def images(self, device: torch.device, input_size: int) -> torch.Tensor | None:
        """The decoded images (N, 3, S, S) uint8 on ``device`` in ``decoded()`` order, with
        the JPEGs left to the GPU (``jpeg_device``) decoded there. Call it before
        ``decoded()``: a JPEG that neither the GPU nor the CPU can decode gets its error here."""
        for i, start, end in self.jpeg_spans:  # each JPEG's bytes, a view of the batch's
            self.items[i].jpeg = self.jpegs[start:end]
        cpu = self.tensors
        if cpu is not None:
            cpu = cpu.to(device, non_blocking=device.type == "cuda")  # pinned: asynchronous
        pending = [x for x in self.items if x.jpeg is not None and x.error is None]
        if not pending:
            return cpu
        done = dict(zip(map(id, pending), decode_jpegs(pending, input_size, device), strict=True))
        rest = iter(cpu if cpu is not None else ())
        out = []
        for x in self.items:
            if x.jpeg is not None:  # None where it failed (its error is set now)
                if done.get(id(x)) is not None:
                    out.append(done[id(x)])
            elif x.error is None:
                out.append(next(rest))
        return torch.stack(out) if out else None

    def pin_memory(self) -> ImageBatch:
        """Page-locked tensors (the DataLoader's pin-memory thread calls this), so that the
        copy to the GPU runs while the GPU works."""
        if self.tensors is not None:
            self.tensors = self.tensors.pin_memory()
        return self


class ImageFiles(Dataset):
    """A map-style dataset over image paths whose items never raise: errors become records.
    Its tensors are resized uint8 images (see ``normalise``); with ``jpeg_on_device`` the
    JPEGs the GPU decodes are only read (``jpeg_device.read_jpeg``); in a decoding process
    plain JPEGs are decoded by torchvision (``jpeg_device.load_jpeg``, the same pixels)."""

    def __init__(self, paths: Sequence[str | Path], input_size: int, jpeg_on_device: bool = False):
        self.paths, self.input_size = [str(p) for p in paths], input_size
        self.jpeg_on_device = jpeg_on_device

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> LoadedImage:
        if self.jpeg_on_device:
            return read_jpeg(self.paths[i], self.input_size, i)
        if get_worker_info() is not None:
            return load_jpeg(self.paths[i], self.input_size, i)
        return load_image(self.paths[i], self.input_size, i, normalised=False)


def collate_images(items: list[LoadedImage]) -> ImageBatch:
    """One batch of a decoding process's items, their tensors joined (see ImageBatch)."""
    good = [x.tensor for x in items if x.tensor is not None]
    batch = ImageBatch(items, torch.stack(good) if good else None)
    jpegs = [(i, x.jpeg) for i, x in enumerate(items) if x.jpeg is not None]
    if jpegs:
        ends = list(itertools.accumulate(len(data) for _, data in jpegs))
        batch.jpegs = torch.cat([data for _, data in jpegs])
        batch.jpeg_spans = [(i, end - len(d), end) for (i, d), end in zip(jpegs, ends, strict=True)]
    for x in items:  # now in the batch's tensors
        x.tensor = x.jpeg = None
    return batch


def batch_indices(n: int, batch_size: int, lanes: int = 1) -> list[range]:
    """Consecutive batches of ``batch_size`` indices of ``range(n)``, except that the last
    ``lanes`` batches share what is left evenly.

    Why: lanes (pipeline.in_lanes) run batches side by side, one CPU thread each, so with
    120 photos in batches of 16 the last lane would caption 16 photos on one core while the
    other had 8 and then nothing to do; batches of 12 and 12 end together.
    """
    full = max(0, -(-n // batch_size) - lanes)  # batches before the last round
    rest = n - full * batch_size
    parts = min(lanes, rest)
    sizes = [batch_size] * full + [rest // parts + (i < rest % parts) for i in range(parts)]
    ends = list(itertools.accumulate(sizes))
    return [range(end - k, end) for end, k in zip(ends, sizes, strict=True)]  # not lists: a


def load_batches(
    paths: Sequence[str | Path],
    input_size: int,
    batch_size: int,
    workers: int,
    pin_memory: bool = False,
    lanes: int = 1,
    jpeg_on_device: bool = False,
) -> Iterator[ImageBatch]:
    """Batches of decoded, resized uint8 images in input order, decoded by ``workers``
    processes (``normalise`` them where they are used); the last ``lanes`` batches share the
    remainder (``batch_indices``). ``jpeg_on_device``: JPEGs are left to
    ``ImageBatch.images`` to decode on the GPU. The processes start, and decode ahead, at
    once, not at the first batch asked for: the caller's own start-up work overlaps theirs."""
    loader = DataLoader(
        ImageFiles(paths, input_size, jpeg_on_device),
        batch_sampler=batch_indices(len(paths), batch_size, lanes),
        num_workers=workers,
        collate_fn=collate_images,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
        worker_init_fn=quiet_when_orphaned,
    )
    return iter(loader)


def quiet_when_orphaned(worker_id: int) -> None:
    """In a decoding process: say nothing when the main process has gone (Ctrl-C, `kill`).

    A worker's queue thread that finds the connection to its parent closed prints a traceback
    (multiprocessing's ``_on_queue_feeder_error``), and so does the thread that hands the
    parent the file descriptors of a batch's shared memory (``resource_sharer``, through
    ``sys.excepthook``), which a user would read as a crash after the run's own last word; the
    worker exits right after all the same. Other errors still print.
    """
    import multiprocessing.queues
    import sys

    shown = multiprocessing.queues.Queue._on_queue_feeder_error

    def feeder_error(e: BaseException, obj: object) -> None:
        if not isinstance(e, ORPHANED):
            shown(e, obj)

    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(feeder_error)
    hook = sys.excepthook

    def excepthook(kind, value, tb) -> None:
        if not isinstance(value, ORPHANED):
            hook(kind, value, tb)

    sys.excepthook = excepthook


ORPHANED = (BrokenPipeError, ConnectionError, EOFError)  # a decoding process's parent has gone
