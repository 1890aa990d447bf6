"""The loaded models and the one worker thread that runs them, batching concurrent requests."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from showattendtell.captioning.captioner import Captioner, CaptionResult, load_model
from showattendtell.captioning.catalog import bundled_models, default_model_path, resolve_models
from showattendtell.errors import UserError
from showattendtell.images.files import image_warning, preprocess
from showattendtell.search import familiarity
from showattendtell.search.decoding import DECODING_OPTIONS, DecodingConfig
from showattendtell.search.options import check_overrides

from .cache import CacheBound
from .capacity import default_capacity

log = logging.getLogger(__name__)

# How long a batch about to start waits, at most, for requests received and still decoding
# their photos: a photo of a few MB decodes in tens of milliseconds, a large one in more.
GATHER_S = 0.25
BATCHES_KEPT = 1000  # batch sizes remembered (CaptionService.batch_sizes); /metrics counts all


class ServiceError(UserError):
    """A request the service cannot answer (no image, an unknown model)."""


@dataclass
class _Job:
    captioner: Captioner
    tensor: torch.Tensor
    decoding: DecodingConfig  # complete: the model's defaults with the request's overrides
    warning: str | None = None  # the photo's own (a degenerate photo), added to its result
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        """Jobs with equal keys are decoded together: same model and every decoding value."""
        return (self.captioner.name, self.decoding)


@dataclass
class Arrival:
    """A request announced to the worker by ``CaptionService.arriving``; done once its photos
    are queued or it was refused."""

    done: bool = False


class CaptionService:
    """Loaded models plus one worker thread that runs them.

    Requests decode and preprocess their image on their own (Gradio worker) thread, then queue
    the tensor. The worker takes everything queued at that moment (up to ``max_batch``), groups
    it by model and complete decoding settings, and encodes + decodes each group as one batch. A
    lone request therefore waits for nothing, and under load the requests that piled up during
    the previous batch share the next one. Running torch on a single thread also keeps concurrent
    requests from oversubscribing the CPU cores.

    A request whose photo is received but still being decoded says so (:meth:`arriving`): the
    idle worker, given a first request, waits for such requests (at most ``gather_s``
    seconds) rather than start without them, so that requests sent together are captioned
    together instead of the first alone and the others after it, which costs a batch's fixed
    time (8 clients at once: batches of 4 on average without the wait; benchmarks/README.md,
    http_api.py). A worker that finds requests queued when its last batch ends takes them at
    once: under steady load the decoding of the next requests overlaps the batch.

    Each captioner's ``decoding`` is the default of its requests (the model file's stored
    settings with the `sat serve` decoding options applied); a request's options override it.
    """

    def __init__(
        self,
        captioners: dict[str, Captioner],
        max_batch: int = 8,
        max_upload_bytes: int = 10 * 2**20,
        gather_s: float = GATHER_S,
    ):
        if not captioners:
            raise ServiceError("no model to serve")
        self.captioners = captioners
        self.max_upload_bytes = max_upload_bytes  # for images sent inline (data URLs)
        self.max_batch = max(1, max_batch)
        self.gather_s = gather_s
        # each item: the photos of one call, captioned in one batch when the worker is free;
        # None: stop. The condition guards the items and both counts, and wakes the worker.
        self._items: deque[list[_Job] | None] = deque()
        self._waiting = 0  # photos queued (an item holds one or more)
        self._arriving = 0  # requests received, decoding their photos (arriving())
        self._cond = threading.Condition()
        self._worker = threading.Thread(target=self._run, name="caption-worker", daemon=True)
        self._worker.start()
        # the latest batches' sizes (tests, benchmarks), bounded: a service runs for weeks
        self.batch_sizes: deque[int] = deque(maxlen=BATCHES_KEPT)
        self.cache = CacheBound(None)  # Gradio's cache bound; launch() sets the real one
        # called from the worker thread after every batch: its size, then each caption made
        # (warning included); the HTTP API's metrics count them here, the page's and API's alike
        self.on_batch: list[Callable[[int], None]] = []
        self.on_caption: list[Callable[[CaptionResult], None]] = []

    @property
    def running(self) -> bool:
        """Whether the worker thread still takes requests (not after ``close``)."""
        return self._worker.is_alive()

    @property
    def queue_depth(self) -> int:
        """Photos waiting for the worker (not those in the batch it is captioning now)."""
        return self._waiting

    @property
    def device(self) -> str:
        """The device the models run on, as torch names it ("cpu", "cuda:0"): the first model's
        (`sat serve` loads them all on one)."""
        return str(next(iter(self.captioners.values())).device)

    @property
    def names(self) -> list[str]:
        return list(self.captioners)

    def get(self, name: str | None) -> Captioner:
        if not name:
            return next(iter(self.captioners.values()))
        if not isinstance(name, str) or name not in self.captioners:
            raise ServiceError(f"unknown model {name!r}; available: {', '.join(self.captioners)}")
        return self.captioners[name]

    def decoding(self, name: str | None, **overrides: Any) -> DecodingConfig:
        """The settings a request gets: the model's defaults with ``overrides`` (None: keep),
        checked by DecodingConfig (a DecodingError names a value out of range). An option that
        does not apply to the model (a hard-attention mode for a soft-attention model) stays
        the model's own, so that it neither splits batches nor shows in the settings."""

        captioner = self.get(name)
        config = captioner.check_decoding(**overrides)
        fixed = {
            n: getattr(captioner.decoding, n)
            for n, opt in DECODING_OPTIONS.items()
            if not captioner.applies(opt)
        }
        return config.with_overrides(**fixed)

    def caption(
        self,
        image: Image.Image,
        model: str | None = None,
        decoding: DecodingConfig | None = None,
        timeout: float = 300.0,
    ) -> CaptionResult:
        """Caption one decoded RGB image (batched with concurrent requests); ``decoding``
        (resolved: :meth:`decoding`) None: the model's defaults. The result's warning flags a
        degenerate photo; its ``consensus`` holds the beams' consensus scores when they were
        reranked by them."""
        return self.submit(image, model, decoding).result(timeout=timeout)

    def submit(
        self,
        image: Image.Image,
        model: str | None = None,
        decoding: DecodingConfig | None = None,
        arrival: Arrival | None = None,
    ) -> Future[CaptionResult]:
        """Queue one decoded RGB image and return at once: the future's result comes when the
        worker has captioned it. ``arrival``: the request's, from :meth:`arriving`."""
        return self.submit_all([image], model, decoding, arrival)[0]

    def submit_all(
        self,
        images: Sequence[Image.Image],
        model: str | None = None,
        decoding: DecodingConfig | None = None,
        arrival: Arrival | None = None,
    ) -> list[Future[CaptionResult]]:
        """:meth:`submit` for several photos (one HTTP request's), queued as one item: the
        worker captions them in one batch (``max_batch`` photos at a time) without a thread
        waiting on each. ``arrival``: the request's, from :meth:`arriving`."""
        captioner = self.get(model)
        jobs = [
            _Job(
                captioner,
                preprocess(image, captioner.input_size),
                decoding or captioner.decoding,
                image_warning(image),
            )
            for image in images
        ]
        self._put(jobs, arrival)
        return [job.future for job in jobs]

    @contextmanager
    def arriving(self) -> Iterator[Arrival]:
        """Around the decoding and submitting of a request already received: until its photos
        are submitted (``submit_all(..., arrival=)``) or the block ends (refused), a batch about
        to start waits for this request, at most ``gather_s``."""
        arrival = Arrival()
        with self._cond:
            self._arriving += 1
        try:
            yield arrival
        finally:
            with self._cond:
                if not arrival.done:
                    arrival.done = True
                    self._arriving -= 1
                    self._cond.notify_all()

    def close(self) -> None:
        self.cache.stop()
        self._put(None)

    def _put(self, item: list[_Job] | None, arrival: Arrival | None = None) -> None:
        with self._cond:
            self._items.append(item)
            self._waiting += len(item or ())
            if arrival is not None and not arrival.done:  # it has arrived: one wake-up
                arrival.done = True
                self._arriving -= 1
            self._cond.notify_all()

    def _take(self) -> tuple[list[_Job], bool]:
        """The next batch's jobs (waiting for the first): everything queued, up to
        ``max_batch`` photos, and the requests still arriving, for at most ``gather_s``; and
        whether to stop after it."""
        jobs: list[_Job] = []
        with self._cond:  # released while it waits
            idle = not self._items
            while not self._items:
                self._cond.wait()
            # only a batch that starts a burst waits: under steady load the photos queued
            # during the last batch go at once, and those still decoding join the next one
            # (which they would delay; decoding overlaps captioning instead)
            deadline = time.monotonic() + (self.gather_s if idle else 0.0)
            while True:
                while self._items and len(jobs) < self.max_batch:
                    item = self._items.popleft()
                    if item is None:
                        return jobs, True
                    self._waiting -= len(item)  # taken: no longer waiting
                    jobs += item
                left = deadline - time.monotonic()
                if len(jobs) >= self.max_batch or not self._arriving or left <= 0:
                    return jobs, False
                self._cond.wait(left)

    def _run(self) -> None:
        while True:
            jobs, stop = self._take()
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                for start in range(0, len(group), self.max_batch):
                    self._run_group(group[start : start + self.max_batch])
            if stop:
                return

    def _run_group(self, group: list[_Job]) -> None:
        self.batch_sizes.append(len(group))
        self._notify(self.on_batch, len(group))
        first = group[0]
        try:
            results = first.captioner.caption_batch(
                torch.stack([j.tensor for j in group]), first.decoding
            )
        except Exception as e:  # keep serving; every waiting request gets the error
            log.exception("captioning failed")
            for job in group:
                job.future.set_exception(e)
            return
        for job, one in zip(group, results, strict=True):
            one.add_warning(job.warning)
            self._notify(self.on_caption, one)
            job.future.set_result(one)

    @staticmethod
    def _notify(listeners: list[Callable[[Any], None]], value: Any) -> None:
        for listener in listeners:
            try:
                listener(value)
            except Exception:  # a metric that fails must not fail a caption
                log.exception("a service listener failed")


def model_paths(specs: Sequence[str | Path] | None) -> list[list[Path]]:
    """The model files of each model --model names (paths or model names, `sat models`; A+B:
    an ensemble, several files), or the default model and any other bundled ones. Every spec is
    resolved before any model loads: an unknown name is a ModelNotFound (exit status 2) listing
    the names there are."""
    if specs:
        return [resolve_models(s) for s in specs]
    found = [default_model_path()]
    return [[p] for p in found + [p for p in bundled_models() if p != found[0]]]


def load_service(
    specs: Sequence[str | Path] | None = None,
    device: str = "auto",
    max_batch: int | None = None,
    decoding: Mapping[str, Any] | None = None,
    precision: str = "32",
) -> CaptionService:
    """Load every model (named by file stem) onto ``device`` and start the worker.

    ``max_batch``: the most photos captioned as one batch; None: the default of the device the
    models loaded on (capacity.py: 64 on a GPU, 8 on the CPU).

    ``decoding``: options (None values: keep each model's stored one) that replace the stored
    defaults of every model; checked before any model loads.
    """
    overrides = dict(decoding or {})
    check_overrides(**overrides)  # a bad value fails before the slow part; each model's
    # defaults are then its stored settings with these, resolved once below
    captioners: dict[str, Captioner] = {}
    for paths in model_paths(specs):
        captioner = load_model(paths, device, precision)
        name = captioner.name  # the file stem, or A+B for an ensemble
        if name in captioners:  # same stem in two folders
            name = "+".join(f"{p.parent.name}/{p.stem}" for p in paths)
        captioner.name = name
        captioner.decoding = captioner.check_decoding(**overrides)
        if captioner.model.consensus is not None:  # its CIDEr-D tables and
            captioner.model.consensus.prepare()  # familiarity calibration now,
            familiarity.for_index(captioner.model.consensus).reference()  # not on a request
        captioners[name] = captioner
        log.info("loaded %s (%s attention) on %s", name, captioner.attention_type, captioner.device)
    if max_batch is None:
        max_batch = default_capacity(str(next(iter(captioners.values())).device)).max_batch
    return CaptionService(captioners, max_batch=max_batch)
