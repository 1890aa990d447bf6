"""Image files -> decoded (in worker processes on a GPU, in this process on a CPU:
``default_workers``) -> encoded in batches, in input order, with ``lanes`` batches in flight.

``captioning.pipeline.caption_files`` (`sat caption`, `sat evaluate`) captions what comes out;
the feature cache stores the grids.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import torch

from showattendtell.images.batches import ImageBatch, load_batches
from showattendtell.images.files import normalise
from showattendtell.progress import Progress
from showattendtell.search.options import DEFAULT_BATCH_SIZE  # with sat caption --help, torch-free

T = TypeVar("T")
U = TypeVar("U")
_END = object()


CPU_CORES_PER_WORKER = 8  # on a CPU, one image-decoding process per this many cores


def default_workers(device: torch.device | str = "cpu") -> int:
    """Image-decoding worker processes for ``device``.

    On a GPU: one per core but one (for the main process), at most 16: the GPU captions a
    batch far sooner than one core decodes it, so decoding sets the rate there
    (benchmarks/README.md, gpu_report.py's bulk part). On a CPU: none
    up to 8 cores (the main thread decodes a batch when a lane is free to take it). The CNN
    already keeps every core busy there, so worker processes add no parallelism, only their
    start and the copy-on-write page faults of forked processes, which made captioning slower
    (benchmarks/caption_throughput.py). Beyond 8 cores one thread decoding would fall behind the
    CNN, hence one worker per 8 cores, at most 4.
    """
    cores = os.cpu_count() or 1
    if torch.device(device).type == "cpu":
        return min(4, cores // CPU_CORES_PER_WORKER) if cores > CPU_CORES_PER_WORKER else 0
    return max(1, min(16, cores - 1))


def default_lanes(device: torch.device | str) -> int:
    """Batches in flight at once: 2 on a CPU with 2 or more threads, else 1 (see ``in_lanes``)."""
    return 1 if torch.device(device).type != "cpu" else min(2, torch.get_num_threads())


GPU_HOST_THREADS = 2  # torch's CPU threads in the main process while a GPU captions


# devices on which encode_files runs ``encode`` once on blank photos while the decoding
# processes start (tests add "cpu")
WARM_UP_DEVICES = {"cuda"}


@contextlib.contextmanager
def host_threads(device: torch.device) -> Iterator[None]:
    """On a GPU, few CPU threads for torch in this process while the pipeline runs (restored
    after). Why: its CPU work there is small, but each small CPU operation wakes torch's
    threads, one per core, which then spin waiting for more and take the cores the decoding
    processes need (on an H100 machine, `top` showed the main process at 850 % CPU and the
    decoding processes starved). On a CPU, nothing changes."""
    before = torch.get_num_threads()
    if device.type == "cuda" and before > GPU_HOST_THREADS:
        torch.set_num_threads(GPU_HOST_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def threads_per_lane(lanes: int) -> Iterator[int]:
    """Give each of ``lanes`` threads its share of torch's CPU threads, for the block; yields
    that share, which each lane thread must also set for itself (see ``in_lanes``)."""
    before = torch.get_num_threads()
    share = max(1, before // lanes)
    torch.set_num_threads(share)
    try:
        yield share
    finally:
        torch.set_num_threads(before)


def in_lanes(fn: Callable[[T], U], items: Iterable[T], lanes: int) -> Iterator[U]:
    """``fn(item)`` for every item, in order, with up to ``lanes`` calls running at once in
    threads that share the CPU threads between them.

    Why: the search's small per-word matmuls keep two threads only half busy; in lanes, one
    batch's CNN runs while another's search does (benchmarks/caption_throughput.py measures
    one lane against two). Torch releases the GIL inside its operators, so
    threads suffice; with one lane this is a plain loop. The caller's grad mode
    (``torch.inference_mode``, ``torch.no_grad``), which torch keeps per thread, holds in the
    lanes too.
    """
    if lanes <= 1:
        yield from map(fn, items)
        return
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def call(item: T) -> U:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(item)

    source, exhausted = iter(items), False
    # Each lane sets its share itself: MKL's thread count (the matmuls) is per thread, and a
    # new thread's is all cores whatever the main thread set, so two lanes ran 2 x 2 matmul
    # threads on 2 cores (torch.get_num_threads() in a lane says 1 all the same).
    with (
        threads_per_lane(lanes) as share,
        ThreadPoolExecutor(
            lanes, "sat-lane", initializer=torch.set_num_threads, initargs=(share,)
        ) as pool,
    ):
        pending: deque[Future[U]] = deque()  # in input order; at most 2 x lanes
        try:
            while pending or not exhausted:
                # A lane that is done takes the next item at once, even while an earlier one
                # still runs in another lane (its result waits its turn to be yielded).
                while (
                    not exhausted
                    and len(pending) < 2 * lanes
                    and sum(not f.done() for f in pending) < lanes
                ):
                    item = next(source, _END)
                    if item is _END:
                        exhausted = True
                    else:
                        pending.append(pool.submit(call, item))
                if pending and not pending[0].done():
                    wait([f for f in pending if not f.done()], return_when=FIRST_COMPLETED)
                while pending and pending[0].done():
                    yield pending.popleft().result()
        finally:  # the consumer stopped early (an error, Ctrl-C): start nothing new
            for f in pending:
                f.cancel()


def encode_files(
    paths: Sequence[str | Path],
    encode: Callable[[torch.Tensor], torch.Tensor],
    input_size: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    workers: int | None = None,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    lanes: int | None = None,
    jpeg_on_device: bool = False,
) -> Iterator[tuple[ImageBatch, Any]]:
    """(batch, ``encode``'s output for its decoded images or None) for consecutive inputs, in
    input order; images are decoded by ``workers`` processes (default ``default_workers``;
    0: in this process) while ``lanes`` batches (default ``default_lanes``) are encoded at
    once. ``jpeg_on_device``: JPEGs are decoded in batches on ``device`` (``jpeg_device``)."""
    device = torch.device(device)
    workers = default_workers(device) if workers is None else workers
    if len(paths) <= batch_size:  # one batch: nothing to decode ahead, and starting the
        workers = 0  # processes (forks of this one, 16 on a GPU machine) costs seconds
    lanes = default_lanes(device) if lanes is None else lanes
    if device.type == "cuda":  # one batch at a time: the GPU runs one batch's kernels at a
        lanes = 1  # time anyway, and a CUDA graph being recorded (decoding.py) must have the
        # GPU to itself (another thread's kernels would break the recording)
    pin = device.type == "cuda"

    def run(batch: ImageBatch) -> tuple[ImageBatch, Any]:
        images = batch.images(device, input_size)
        if images is None:
            return batch, None
        return batch, encode(normalise(images))

    batches = load_batches(paths, input_size, batch_size, workers, pin, lanes, jpeg_on_device)
    with host_threads(device):
        if workers and device.type in WARM_UP_DEVICES:
            warm_up(encode, min(batch_size, len(paths)), input_size, device)
        for batch, out in in_lanes(run, batches, lanes):
            yield batch, out
            if progress is not None:
                progress(len(batch.items))


def warm_up(
    encode: Callable[[torch.Tensor], Any], rows: int, input_size: int, device: torch.device
) -> None:
    """``encode`` on a batch of blank photos of the first batch's shape, its output dropped.

    Why: on a GPU the first batch of a shape pays for cuDNN's first convolutions, recording the
    search's CUDA graph and compiling its Triton kernels (seconds: 5.2 s of convolutions and 1.4 s
    of recording in `sat caption` over 720 photos on an H100), and the decoding processes take
    seconds to start and hand over their first batch (5.9 s in the same run). Done while they
    start, the two overlap instead of adding up before the first caption.
    """
    blank = torch.zeros(rows, 3, input_size, input_size, dtype=torch.uint8, device=device)
    encode(normalise(blank))
