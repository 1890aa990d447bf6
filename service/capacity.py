"""How much `sat serve` takes on at once, by the device its models run on.

The defaults of ``--concurrency``, ``--max-batch`` and ``--threads`` are decided once the device
is known (the models loaded): a GPU captions a batch of 64 in about the time a CPU takes for one
photo, so it needs many requests in flight to fill its batches, while a CPU's batch of 8 already
takes about a second. A flag given on the command line always wins. Imports nothing heavy:
`sat serve --help` states the rule from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capacity:
    """Requests worked on at once (``--concurrency``: the page's and the HTTP API's each), the
    most photos captioned as one batch (``--max-batch``) and torch's CPU threads (``--threads``;
    None: torch's own, one per core)."""

    concurrency: int
    max_batch: int
    threads: int | None


# On the CPU: a batch of 8 takes about a second on 2 cores, and a batch of 32 gives no more
# photos a second (8.1 against 7.6 at beam 1: benchmarks/README.md, http_api.py).
CPU = Capacity(concurrency=8, max_batch=8, threads=None)
# On a GPU: batches of 64 photos (an H100 captions 1,345 photos/s at beam 3 in bf16 batches of
# 128, about 50 ms for 64), with as many requests in flight to fill them. torch gets 2 CPU
# threads, as `sat caption` gives it on a GPU (images.pipeline.GPU_HOST_THREADS): its CPU work
# there is small, and a thread per core would spin and take the cores that decode the uploads.
GPU = Capacity(concurrency=64, max_batch=64, threads=2)

RULE = (
    f"{GPU.concurrency} / {GPU.max_batch} / {GPU.threads} on a GPU, {CPU.concurrency} / "
    f"{CPU.max_batch} / torch's own (one per core) on the CPU"
)

# Gradio's own default thread pool (Blocks.max_threads), kept while it is large enough
GRADIO_THREADS = 40


def default_capacity(device: str) -> Capacity:
    """The defaults for a device named as torch names it ("cpu", "cuda", "cuda:1")."""
    return GPU if str(device).startswith("cuda") else CPU


def resolve_capacity(
    device: str,
    concurrency: int | None = None,
    max_batch: int | None = None,
    threads: int | None = None,
) -> Capacity:
    """The device's defaults, with every value given (not None) in their place."""
    d = default_capacity(device)
    return Capacity(
        d.concurrency if concurrency is None else concurrency,
        d.max_batch if max_batch is None else max_batch,
        d.threads if threads is None else threads,
    )


def gradio_threads(concurrency: int) -> int:
    """The page's thread pool for ``concurrency`` captions at once: each caption also runs its
    upload's preprocessing and its images' postprocessing in the pool, and the word views and
    the model menu take threads of their own, hence twice the concurrency; never below
    Gradio's default."""
    return max(GRADIO_THREADS, 2 * concurrency)
