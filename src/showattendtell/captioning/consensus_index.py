"""Building a model's consensus index (search/consensus.py) from a dataset split: each photo's
pooled grid from the model's encoder and its captions (`sat export --consensus-root`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from showattendtell.captioning.captioner import Captioner
from showattendtell.data.datasets import load_split
from showattendtell.data.feature_cache import FeatureCache
from showattendtell.errors import UsageError
from showattendtell.images.pipeline import encode_files
from showattendtell.model import CaptionModel
from showattendtell.progress import Progress
from showattendtell.search.consensus import DEFAULT_NEIGHBOURS, ConsensusIndex
from showattendtell.search.decoding import DecodingConfig

log = logging.getLogger(__name__)


def build_index(
    model: CaptionModel,
    dataset: str,
    root: str | Path,
    split: str = "train",
    feature_cache: str | Path | None = None,
    neighbours: int | None = None,
) -> ConsensusIndex:
    """A ConsensusIndex of a split's photos for ``model``: each photo's pooled grid from the
    model's encoder (read from ``feature_cache`` where it holds the photo, else encoded by the
    image pipeline) and its captions, tokenised as the training captions are. Photos that do not
    decode are left out, with a warning. Raises UsageError (one line, what to do) for a split
    without photos, a feature cache of another encoder or ``neighbours`` out of range."""

    images = load_split(dataset, root, split).images
    if not images:
        raise UsageError(f"--consensus-root {root}: no photos of the {split} split found")
    pooled: dict[str, torch.Tensor] = {}
    captioner = Captioner(model, DecodingConfig())
    if feature_cache:
        cache = FeatureCache(feature_cache)
        for im in images:
            grid = cache.get(im.image_id)
            if grid is not None:
                pooled[im.image_id] = ConsensusIndex.pool(grid[None])[0]
        _check_cache(
            captioner,
            [im for im in images if im.image_id in pooled][:4],
            pooled,
            str(feature_cache),
        )
        log.info(
            "consensus index: %d of %d photos from the feature cache %s",
            len(pooled),
            len(images),
            cache.dir,
        )
    todo = [im for im in images if im.image_id not in pooled]
    if todo:
        with Progress(len(todo), "consensus index") as progress:
            for batch, grids in encode_files(
                [im.path for im in todo],
                captioner.encode,
                captioner.input_size,
                device=captioner.device,
                progress=progress,
            ):
                rows = iter(ConsensusIndex.pool(grids).cpu() if grids is not None else [])
                for item in batch.items:
                    if item.error is None:
                        pooled[todo[item.index].image_id] = next(rows)
    model.cpu()
    kept = [im for im in images if im.image_id in pooled]
    if len(kept) < len(images):
        log.warning(
            "consensus index: %d photos did not decode and are left out", len(images) - len(kept)
        )
    k = DEFAULT_NEIGHBOURS if neighbours is None else neighbours
    if not 1 <= k <= len(kept):
        raise UsageError(
            f"--consensus-neighbours must be from 1 to {len(kept)} (the photos "
            f"of the index), not {k}"
        )
    return ConsensusIndex(
        torch.stack([pooled[im.image_id] for im in kept]),
        [[" ".join(model.vocab.tokenize(c)) for c in im.captions] for im in kept],  # its tokens
        k,
    )


def _check_cache(
    captioner: Captioner, images: list, pooled: dict[str, torch.Tensor], folder: str
) -> None:
    """The cached grids of a few photos must be what the model's encoder computes (to the
    cache's float16 rounding): a cache of another encoder would pick wrong neighbours."""

    if not images:
        raise UsageError(
            f"--feature-cache {folder} holds none of the split's photos: give the "
            "cache folder of this model's training run, or leave the option out"
        )
    batch = torch.stack([captioner.preprocess(im.path) for im in images])
    ours = ConsensusIndex.pool(captioner.encode(batch)).cpu()
    cached = torch.stack([pooled[im.image_id] for im in images])
    if not torch.allclose(ours, cached, rtol=1e-2, atol=1e-2):
        raise UsageError(
            f"--feature-cache {folder} holds another encoder's features than this "
            "model's: give the cache folder of its training run, or leave the "
            "option out (the photos are then encoded, a few minutes on a CPU)"
        )
