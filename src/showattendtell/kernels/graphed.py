"""Fixed-shape GPU work replayed as CUDA graphs: the training step's forward and backward
(``GraphedLoss``) and the search (``GraphedFunction``, used by decoding.py).

Why: on a GPU the decoder is thousands of small kernels (a few dozen per word, and per
direction in training), and the host launching them one by one, not the GPU's arithmetic, sets
the time (benchmarks/README.md, "gpu_report.py"). A CUDA graph replays all of them with one
launch. For training, ``torch.cuda.make_graphed_callables`` records the forward and the backward
once, on a sample batch, and gives back a callable that autograd treats as one operation: the
gradients reach the parameters as usual, so Lightning's backward, gradient clipping and
optimiser step run unchanged outside the graph.

What a graph needs, and how the callers give it:
- the same shapes every call: the fixed-shape recurrence and search, captions padded to a
  fixed length (``pad_captions``), a search batch padded to a recorded size or a power of two;
- no host synchronisation inside: the fixed-shape pass masks the padding instead of selecting
  the real tokens, and the losses take the mask (losses.py);
- inputs copied into the graph's own tensors, and outputs copied out before the next replay
  (both classes do it).
Random numbers (dropout, sampled locations) are drawn afresh at every replay: CUDA graphs
advance the generator's offset each time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_GRAPHS = 4  # search graphs kept at once, per decoder and search (batch sizes, options)
MAX_FAILURES = 3  # recordings that may fail before a search runs without graphs for good
# Other threads may use the GPU while a graph records: the DataLoader's pin-memory thread pins
# the next batches meanwhile. CUDA's default ("global") mode forbids that and the recording
# fails; "thread_local" forbids the unsafe calls in the recording thread only.
CAPTURE_MODE = "thread_local"


def pad_captions(captions: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """(B, T+1) captions padded with ``pad`` (the vocabulary's <pad>) to (B, length), so that
    every batch has one shape."""
    if captions.size(1) > length:
        raise ValueError(f"captions of {captions.size(1)} tokens do not fit {length}")
    return F.pad(captions, (0, length - captions.size(1)), value=pad)


class _Call(nn.Module):
    """``fn(module, *inputs)`` as a module: make_graphed_callables graphs modules, and collects
    the parameters whose gradients the backward graph computes from them."""

    def __init__(self, module: nn.Module, fn: Callable[..., tuple[torch.Tensor, ...]]):
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.fn(self.module, *inputs))


class GraphedLoss:
    """``fn(module, *inputs) -> (loss, *logs)`` with its forward and backward as CUDA graphs:
    recorded at the first call, replayed at every later call with the same key (the inputs'
    shapes, dtypes and ``requires_grad``, the autocast state, train or eval mode). A call with
    another key (an epoch's last, smaller batch) runs ``fn`` directly, with the same values.
    ``fn`` must keep to what a graph allows (fixed shapes, no host synchronisation, no Python
    branch on a tensor's value); its outputs are tensors, the first one differentiable.

    One graph only, recorded first: recording needs every earlier autograd graph that reaches
    the parameters gone (its gradient accumulators are tied to the stream they ran on, and a
    recording on another one fails), and before the first training step there is none. If
    recording fails all the same, training goes on without graphs after one warning.
    """

    def __init__(self, module: nn.Module, fn: Callable[..., tuple[torch.Tensor, ...]]):
        self.call = _Call(module, fn)
        self.key: tuple | None = None
        self.graphed: nn.Module | None = None
        self.failed = False

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if inputs[0].device.type != "cuda":  # nothing to record: fn itself (tests run this)
            return self.call(*inputs)
        dtype = _autocast_dtype()
        key = (
            *((tuple(x.shape), x.dtype, x.requires_grad) for x in inputs),
            dtype,
            self.call.module.training,
        )
        if self.key is None and not self.failed:
            self.key = key
            try:
                self.graphed = self._record(inputs, dtype)
            except RuntimeError as e:  # torch.AcceleratorError included
                self.failed = True
                warnings.warn(
                    f"training without CUDA graphs: recording one failed "
                    f"({str(e).splitlines()[0]})",
                    stacklevel=2,
                )
        if self.graphed is None or key != self.key:
            return self.call(*inputs)
        # the graph's output tensors are overwritten by the next replay: hand out copies
        return tuple(o.clone() for o in self.graphed(*inputs))

    def _record(self, inputs: tuple[torch.Tensor, ...], dtype) -> nn.Module:
        sample = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
        call = _Call(self.call.module, self.call.fn).train(self.call.module.training)
        # The recording's gradient accumulators run on its side stream and later backward
        # passes on the default one, as make_graphed_callables intends; autograd would warn
        # of that at every run (one line about streams that a user cannot act on).
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        with (
            autocast_nocache(dtype),
            thread_local_capture(torch.cuda.make_graphed_callables) as mode,
        ):
            return torch.cuda.make_graphed_callables(call, sample, allow_unused_input=True, **mode)


class GraphedObjective:
    """A training objective ``(model, annotations, batch) -> (loss, logs)`` that reads only the
    batch's captions and lengths, through ``GraphedLoss``: captions padded to ``tokens``
    (None: as they come), so that every full batch has the shape of the recorded one."""

    def __init__(self, objective: Callable, model: nn.Module, tokens: int | None, pad: int):
        self.tokens, self.pad, self.names = tokens, pad, []

        def fn(decoder, annotations, captions, lengths):
            loss, logs = objective(model, annotations, {"captions": captions, "lengths": lengths})
            self.names = list(logs)
            return (loss, *logs.values())

        self.loss = GraphedLoss(model.decoder, fn)

    def __call__(self, annotations: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
        captions = batch["captions"]
        if self.tokens is not None and captions.size(1) <= self.tokens:
            captions = pad_captions(captions, self.tokens, self.pad)
        loss, *logs = self.loss(annotations, captions, batch["lengths"])
        return loss, dict(zip(self.names, logs, strict=True))


class GraphedFunction:
    """``fn(*inputs) -> tensors`` without autograd (the search), run as CUDA graphs: recorded
    at the first call with each new key (the inputs' shapes and dtypes, the autocast state and
    the caller's ``key``), replayed after. Callers in several threads (the web service) take
    turns: a replay overwrites the graph's tensors, so each call returns copies of them."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]]):
        self.fn = fn
        self.graphs: dict[tuple, tuple] = {}
        self.lock = threading.Lock()
        self.failures = 0  # recordings that failed; MAX_FAILURES: ``fn`` runs directly for good
        self.state: tuple | None = None  # what the graphs were recorded against (forget_unless)

    def forget_unless(self, state: tuple) -> None:
        """Drop every graph (and the GPU memory it holds) unless they were recorded against
        ``state``, which then becomes theirs: e.g. the weights' versions."""
        with self.lock:
            if state != self.state:
                self.graphs.clear()
                self.state = state

    @staticmethod
    def _key(inputs: tuple[torch.Tensor, ...], key: tuple, rows: int | None = None) -> tuple:
        """What a graph is recorded for: the inputs' shapes (their first dimension ``rows``
        where given) and dtypes, the autocast state and the caller's key."""
        dtype = _autocast_dtype()
        shapes = (x.shape if rows is None else (rows, *x.shape[1:]) for x in inputs)
        return (*((tuple(s), x.dtype) for s, x in zip(shapes, inputs, strict=True)), dtype, *key)

    def batch_sizes(self, *inputs: torch.Tensor, key: tuple = ()) -> list[int]:
        """The batch sizes (the inputs' first dimension) of the graphs recorded for what this
        call would be but for its batch size."""
        with self.lock:
            return [
                n
                for n in {k[0][0][0] for k in self.graphs}
                if self._key(inputs, key, n) in self.graphs
            ]

    def __call__(self, *inputs: torch.Tensor, key: tuple = ()) -> tuple[torch.Tensor, ...]:
        full = self._key(inputs, key)
        with self.lock:
            entry = self.graphs.get(full)
            if entry is None and self.failures < MAX_FAILURES:
                if len(self.graphs) >= MAX_GRAPHS:
                    self.graphs.pop(next(iter(self.graphs)))
                try:
                    entry = self.graphs[full] = self._record(inputs, _autocast_dtype())
                except RuntimeError as e:  # torch.AcceleratorError included
                    self.failures += 1
                    if self.failures == MAX_FAILURES:
                        warnings.warn(
                            f"running without CUDA graphs: recording one failed "
                            f"{MAX_FAILURES} times ({str(e).splitlines()[0]})",
                            stacklevel=2,
                        )
            if entry is None:
                return tuple(self.fn(*inputs))
            graph, static_inputs, static_outputs = entry
            for x, s in zip(inputs, static_inputs, strict=True):
                s.copy_(x)
            graph.replay()
            return tuple(o.clone() for o in static_outputs)

    def _record(self, inputs: tuple[torch.Tensor, ...], dtype) -> tuple:
        static = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), autocast_nocache(dtype):
            for _ in range(2):  # warm-up off the capture: cuBLAS handles, lazy tables
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with (
            torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE),
            autocast_nocache(dtype),
        ):
            outputs = tuple(self.fn(*static))
        return graph, static, outputs


@contextlib.contextmanager
def thread_local_capture(record: Callable) -> Iterator[dict]:
    """Keyword arguments that make ``record`` capture in ``CAPTURE_MODE``.

    ``make_graphed_callables`` takes ``capture_error_mode`` in newer torch only; before, it
    records through ``torch.cuda.graph`` with CUDA's global mode always, and a training graph
    fails to record whenever the DataLoader's pin-memory thread pins a batch meanwhile (torch
    2.11 is one of them). There ``torch.cuda.graph`` is given the mode for the length of the
    recording.
    """
    if "capture_error_mode" in inspect.signature(record).parameters:
        yield {"capture_error_mode": CAPTURE_MODE}
        return
    original = torch.cuda.graph
    torch.cuda.graph = functools.partial(original, capture_error_mode=CAPTURE_MODE)
    try:
        yield {}
    finally:
        torch.cuda.graph = original


def _autocast_dtype() -> torch.dtype | None:
    """CUDA autocast's dtype, None where it is off: part of what a graph is recorded for."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def autocast_nocache(dtype: torch.dtype | None) -> torch.autocast:
    """The caller's CUDA autocast state (``_autocast_dtype``) with its weight cache off: a graph
    must cast the weights inside itself, not read a cast made outside it (or freed with it)."""
    return torch.autocast("cuda", dtype=dtype, enabled=dtype is not None, cache_enabled=False)
