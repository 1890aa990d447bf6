"""Captioning on a Ray cluster with Ray Data (the optional extra ``showattendtell[ray]``).

Why Ray Data rather than more code of our own: on a cluster where workers come and go, its
streaming executor retries a decoding task or a captioning actor that died (a lost node, a
SIGKILL) without stopping the run, decodes on CPUs while GPUs caption (the two stages scale
apart), and holds back the decoding when the captioning falls behind. One machine keeps Lightning
Fabric (distributed.py): its processes share one pipeline and cost no cluster to start.

Two stages, both usable in any Ray Data pipeline:

- ``decode_images``: a ``map_batches`` function (Ray tasks on CPUs) that reads and decodes the
  files of a ``path`` column into resized uint8 ``pixels`` (an unreadable file gets an ``error``
  instead, never an exception), as `sat caption`'s decoding processes do;
- ``CaptionImages``: a callable class for ``map_batches`` with an actor pool: each actor loads
  the model once and captions whole batches; the ``record`` column holds what `sat caption`
  writes for the photo (one JSON object), field for field.

``caption_dataset`` chains them with `sat caption`'s resources (one actor a GPU, or ``actors``
on CPUs). This module imports ray; nothing else in the package does (the CLI imports it only
for ``--engine ray``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.catalog import resolve_models
from showattendtell.captioning.pipeline import Record
from showattendtell.captioning.records import record_dict
from showattendtell.images.files import LoadedImage, normalise
from showattendtell.images.jpeg_device import load_jpeg
from showattendtell.model_file import describe_model
from showattendtell.search.options import DEFAULT_BATCH_SIZE

# Columns: the input's, then these
PATH = "path"  # the photo's path as the records name it (str, or bytes as os.fsencode gives)
FILE = "file"  # optional: where to read it, when not at PATH (the CLI's absolute paths)
PIXELS, ERROR, WARNING = "pixels", "error", "warning"  # decode_images adds these
CAPTION, RECORD = "caption", "record"  # CaptionImages adds these (and drops pixels and file)

DECODE_CPUS = 0.5  # a decoding task's CPU share: it waits on the disk part of the time
CPU_RESERVED_FOR_DECODING = 0.5  # on a cluster without GPUs, CPUs left to the decoding tasks


def _text(value: str | bytes) -> str:
    """A path column's value as a str: bytes (names that are not UTF-8 travel as bytes, which
    Arrow's strings cannot hold) as the file system decodes them."""
    return os.fsdecode(value) if isinstance(value, bytes) else str(value)


def model_input_size(model: str | Path | None = None) -> int:
    """The side in pixels that ``model`` (a file, a name, None: the default) reads photos at,
    from the model file's header alone: what ``decode_images`` needs."""
    return int(describe_model(resolve_models(model)[0])["input_size"])


def decode_images(
    batch: dict[str, np.ndarray],
    input_size: int,
    load: Callable[[str, int, int], LoadedImage] = load_jpeg,
) -> dict[str, np.ndarray]:
    """For ``Dataset.map_batches(batch_format="numpy")``: read and decode the ``path`` column's
    files (or the ``file`` column's, when given) into ``pixels`` (N, 3, S, S) uint8, resized as
    `sat caption` resizes them, with ``error`` and ``warning`` ("" for none). A file that cannot
    be decoded gets an error and black pixels; this never raises for a bad file.

    ``load`` is the decoder of one file (`sat caption`'s decoding processes' by default: plain
    JPEGs by torchvision, the rest by PIL, the same pixels)."""
    where = batch[FILE] if FILE in batch else batch[PATH]
    n = len(where)
    pixels = np.zeros((n, 3, input_size, input_size), dtype=np.uint8)
    errors, warnings = [""] * n, [""] * n
    for i, file in enumerate(where):
        item = load(_text(file), input_size, i)
        if item.error is not None:
            errors[i] = item.error
        else:
            pixels[i] = item.tensor.numpy()
            warnings[i] = item.warning or ""
    out = {k: v for k, v in batch.items()}
    out.update({PIXELS: pixels, ERROR: np.array(errors), WARNING: np.array(warnings)})
    return out


class CaptionImages:
    """A callable class for ``Dataset.map_batches``: the model is loaded once an actor, then
    every batch is captioned as one (greedy for beam 1, batched beam search otherwise).

    Its batches hold the columns ``decode_images`` made (``path``, ``pixels``, ``error``,
    ``warning``); a batch with a ``path`` column only is decoded here first. It returns the
    input's columns without ``pixels`` and ``file``, plus ``caption`` ("" where the photo could
    not be decoded), ``error`` ("" where it was captioned) and ``record``: the JSON object
    `sat caption` writes for the photo (caption, score, log_prob, words, familiarity,
    confidence, warning, model, model_sha256, decoding; with ``with_attention`` the grids too).

    ``model``: a model file or name (`sat models`), the same on every node; ``device``: "auto"
    (the actor's GPU when Ray gave it one), "cpu" or "cuda"; ``threads``: torch's CPU threads
    (default: what Ray's ``num_cpus`` for the actor allows); ``decoding``: the decoding
    options (beam_size, max_length, ...), as ``Captioner.caption`` takes them.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "auto",
        precision: str = "32",
        with_attention: bool = False,
        threads: int | None = None,
        **decoding: Any,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.captioner = load_model(model, device, precision)
        # the overrides, resolved once for the actor's life
        self.decoding = self.captioner.check_decoding(**decoding)
        self.with_attention = with_attention
        self.made_by = self.captioner.made_by(self.decoding)
        self.made_by["decoding"]["decode_on"] = "cpu"  # as `sat caption` says where it decoded
        self.captioner.prepare(self.decoding)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if PIXELS not in batch:
            batch = decode_images(batch, self.captioner.input_size)
        errors, warnings = batch[ERROR], batch[WARNING]
        good = [i for i, e in enumerate(errors) if not e]
        results = iter(())
        if good:
            images = normalise(torch.from_numpy(np.ascontiguousarray(batch[PIXELS][good])))
            results = iter(self.captioner.caption_batch(images, self.decoding))
        captions, records = [], []
        for path, error, warning in zip(batch[PATH], errors, warnings, strict=True):
            if error:
                rec = Record(_text(path), error=str(error))
            else:
                rec = Record(_text(path), result=next(results))
                rec.result.add_warning(str(warning) or None)
            captions.append(rec.result.caption if rec.result is not None else "")
            d = record_dict(rec, self.with_attention, self.made_by)
            records.append(json.dumps(d, ensure_ascii=False, allow_nan=False))
        out = {k: v for k, v in batch.items() if k not in (PIXELS, FILE, WARNING)}
        out.update({CAPTION: np.array(captions), ERROR: errors, RECORD: np.array(records)})
        return out


def cluster_gpus() -> int:
    """GPUs in the Ray cluster this process is connected to."""
    return int(ray.cluster_resources().get("GPU", 0))


def caption_dataset(
    ds: ray.data.Dataset,
    model: str | Path | None = None,
    *,
    actors: int | None = None,
    device: str = "auto",
    batch_size: int = DEFAULT_BATCH_SIZE,
    precision: str = "32",
    with_attention: bool = False,
    threads: int | None = None,
    decode: Callable[..., dict[str, np.ndarray]] = decode_images,
    captioning: type[CaptionImages] = CaptionImages,
    **decoding: Any,
) -> ray.data.Dataset:
    """``ds`` (a ``path`` column) decoded in Ray tasks on CPUs and captioned by a pool of
    ``actors`` (default: one a GPU of the cluster, 1 without GPUs; ``device="cpu"``: CPUs only).

    On GPUs each actor takes one GPU and one CPU. Without, each takes a share of the CPUs, at
    most one, leaving half a CPU to the decoding tasks (each takes half a CPU), and runs torch on
    ``threads`` (default: the CPUs over the actors). ``decode`` and ``captioning`` are the two
    stages (the tests put a fault into each)."""
    gpus = cluster_gpus() if device != "cpu" else 0
    actors = actors or max(1, gpus)
    resources: dict[str, float]
    if gpus:
        resources = {"num_gpus": 1, "num_cpus": 1}
    else:
        cpus = float(ray.cluster_resources().get("CPU", 1))
        share = max(0.1, (cpus - CPU_RESERVED_FOR_DECODING) / actors)
        resources = {"num_cpus": min(1.0, share)}
        threads = threads or max(1, int(cpus // actors))
        device = "cpu"
    decoded = ds.map_batches(
        decode,
        batch_size=batch_size,
        batch_format="numpy",
        fn_kwargs={"input_size": model_input_size(model)},
        num_cpus=DECODE_CPUS,
    )
    return decoded.map_batches(
        captioning,
        batch_size=batch_size,
        batch_format="numpy",
        fn_constructor_kwargs={
            "model": str(model) if model is not None else None,
            "device": device,
            "precision": precision,
            "with_attention": with_attention,
            "threads": threads,
            **decoding,
        },
        compute=ray.data.ActorPoolStrategy(size=actors),
        **resources,
    )
