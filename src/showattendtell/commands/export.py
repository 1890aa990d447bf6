"""`sat export`: a training checkpoint -> a self-describing, pickle-free model file; or a model
file -> the same weights with other stored decoding defaults (e.g. the bundled models'
``--no-repeat-ngram 2``)."""

from __future__ import annotations

import argparse

from showattendtell.cli_common import add_decoding_args, decoding_overrides
from showattendtell.data.datasets import DATASETS


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a model file")
    p.add_argument("checkpoint", help="Lightning .ckpt written by sat train; or a model file "
                                      "(.safetensors or a `sat models` name) to store other "
                                      "decoding defaults with its weights")
    p.add_argument("output", help="model file to write (.safetensors)")
    p.add_argument("--half", action="store_true", help="store weights as float16")
    p.add_argument("--interpolate", metavar="MODEL", default=None,
                   help="export alpha * checkpoint + (1 - alpha) * MODEL (WiSE-FT: a fine-tuned "
                        "checkpoint moved back toward the model file it started from)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="the checkpoint's weight with --interpolate (default 0.5)")
    g = p.add_argument_group("consensus index (for --rerank consensus; consensus.py)")
    g.add_argument("--consensus-root", default=None, metavar="DIR",
                   help="add an index of this dataset's photos and captions (the training "
                        "split: the photos whose captions the model learnt from)")
    g.add_argument("--consensus-dataset", default="flickr8k",
                   choices=DATASETS, help="its format (default flickr8k)")
    g.add_argument("--consensus-split", default="train", help="its split (default train)")
    g.add_argument("--consensus-neighbours", type=int, default=None, metavar="K",
                   help="training photos consulted for each photo (default 60)")
    g.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="read the photos' grids from this feature-cache folder (one that sat "
                        "train wrote under data.feature_cache for this model's encoder) instead "
                        "of encoding them again; checked against the model on a few photos")
    add_decoding_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from showattendtell.decoding import DecodingConfig
    from showattendtell.model_file import ModelFileError, save_model

    overrides = decoding_overrides(args)
    if _is_model_file(args.checkpoint):  # its weights, its stored decoding with the overrides
        from showattendtell.catalog import resolve_model
        from showattendtell.model_file import read_model

        model, stored, info = read_model(resolve_model(args.checkpoint))
        decoding = stored.with_overrides(**overrides)
        info = {**info, "re_exported_from": str(args.checkpoint)}
    else:
        from showattendtell.lit_module import load_checkpoint

        decoding = DecodingConfig().with_overrides(**overrides)
        module = load_checkpoint(args.checkpoint)
        model = module.model
        info = {"checkpoint": str(args.checkpoint), "epoch": module.checkpoint_epoch}
    if args.interpolate:
        from showattendtell.catalog import resolve_model
        from showattendtell.model_file import read_model

        start, _, _ = read_model(resolve_model(args.interpolate))
        try:
            model.interpolate_(start, args.alpha)
        except ValueError as e:
            raise ModelFileError(f"cannot interpolate {args.checkpoint} with "
                                 f"{args.interpolate}: {e}") from None
        info.update(interpolated_with=str(args.interpolate), alpha=args.alpha)
    if args.consensus_root:
        model.consensus = build_consensus_index(
            model, args.consensus_dataset, args.consensus_root, args.consensus_split,
            args.feature_cache, args.consensus_neighbours)
        info.update(consensus=f"{args.consensus_dataset} {args.consensus_split} "
                              f"({len(model.consensus.references)} photos)")
    model.check_decoding(decoding)  # e.g. --rerank consensus without an index
    path = save_model(model, args.output, decoding, half=args.half, info=info)
    print(f"wrote {path}")
    return 0


def _is_model_file(source: str) -> bool:
    from showattendtell.catalog import named_models

    return source.endswith(".safetensors") or source in named_models()


def build_consensus_index(model, dataset: str, root: str, split: str,
                          feature_cache: str | None = None, neighbours: int | None = None):
    """A ConsensusIndex of a split's photos: each photo's pooled grid from ``model``'s encoder
    (read from the feature cache where it holds the photo, else encoded by the image pipeline)
    and its captions, tokenised; photos that do not decode are left out, with a warning."""
    import logging

    import torch

    from showattendtell.consensus import DEFAULT_NEIGHBOURS, ConsensusIndex
    from showattendtell.data.datasets import load_split
    from showattendtell.data.feature_cache import FeatureCache
    from showattendtell.decoding import DecodingConfig
    from showattendtell.errors import UsageError
    from showattendtell.inference import Captioner
    from showattendtell.pipeline import encode_files
    from showattendtell.progress import Progress
    from showattendtell.vocab import tokenize

    log = logging.getLogger(__name__)
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
        _check_cache(captioner, [im for im in images if im.image_id in pooled][:4], pooled,
                     feature_cache)
        log.info("consensus index: %d of %d photos from the feature cache %s", len(pooled),
                 len(images), cache.dir)
    todo = [im for im in images if im.image_id not in pooled]
    if todo:
        with Progress(len(todo), "consensus index") as progress:
            for batch, grids in encode_files([im.path for im in todo], captioner.encode,
                                             captioner.input_size, device=captioner.device,
                                             progress=progress):
                rows = iter(ConsensusIndex.pool(grids).cpu() if grids is not None else [])
                for item in batch.items:
                    if item.error is None:
                        pooled[todo[item.index].image_id] = next(rows)
    model.cpu()
    kept = [im for im in images if im.image_id in pooled]
    if len(kept) < len(images):
        log.warning("consensus index: %d photos did not decode and are left out",
                    len(images) - len(kept))
    k = DEFAULT_NEIGHBOURS if neighbours is None else neighbours
    if not 1 <= k <= len(kept):
        raise UsageError(f"--consensus-neighbours must be from 1 to {len(kept)} (the photos "
                         f"of the index), not {k}")
    return ConsensusIndex(torch.stack([pooled[im.image_id] for im in kept]),
                          [[" ".join(tokenize(c)) for c in im.captions] for im in kept], k)


def _check_cache(captioner, images, pooled, folder: str) -> None:
    """The cached grids of a few photos must be what the model's encoder computes (to the
    cache's float16 rounding): a cache of another encoder would pick wrong neighbours."""
    import torch

    from showattendtell.consensus import ConsensusIndex
    from showattendtell.errors import UsageError

    if not images:
        raise UsageError(f"--feature-cache {folder} holds none of the split's photos: give the "
                         "cache folder of this model's training run, or leave the option out")
    batch = torch.stack([captioner.preprocess(im.path) for im in images])
    ours = ConsensusIndex.pool(captioner.encode(batch)).cpu()
    cached = torch.stack([pooled[im.image_id] for im in images])
    if not torch.allclose(ours, cached, rtol=1e-2, atol=1e-2):
        raise UsageError(f"--feature-cache {folder} holds another encoder's features than this "
                         "model's: give the cache folder of its training run, or leave the "
                         "option out (the photos are then encoded, a few minutes on a CPU)")
