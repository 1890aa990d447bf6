"""The data and training path at COCO's real size, on synthetic data.

COCO's Karpathy split has 123,287 images and about 616k captions. This script builds a dataset of
that size in Karpathy's ``dataset_coco.json`` format, with captions sampled from the real COCO
captions in ../shared (empty image files: nothing here decodes an image) and small synthetic
feature grids, then times the project's own code at each stage:

    index          load_karpathy: reading the JSON, finding every image file
    vocab          Vocabulary.build over every training caption
    pairs          CaptionPairs: every (image, caption) pair encoded to word ids
    cache_write    the feature cache's shards (one grid per image)
    cache_index    opening the cache: the key -> (shard, row) index
    cache_read     reading the grids of 10 % of the images, in random order (memory-mapped)
    train_first_steps, train_steps
                   training steps (20, then 100): DataLoader over all pairs (shuffled), the
                   cached grids, the maximum-likelihood objective, backward, Adam
    val_scoring    validation scoring (BLEU, ROUGE-L, CIDEr-D) of 5,000 images at full scale
    cider_df       the self-critical reward's document frequencies over every training reference

Each scale runs in its own process (so its peak memory is its own). Per-item times are compared
between scales: a stage is linear when its time per item at full scale is at most 1.5x that at
1/10. The last line of standard output is
``{"scales": [{"images": N, "captions": C, "peak_rss_mb": M, "stages": {...}}, ...], ...}``.

    python benchmarks/coco_scale.py                 # 1/10, then full scale
    python benchmarks/coco_scale.py --scales 0.01   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the library load in the child process only
    from showattendtell.data.datamodule import CaptionPairs
    from showattendtell.data.datasets import CaptionedImage
    from showattendtell.data.feature_cache import FeatureCache
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.network.vocab import Vocabulary

COCO_IMAGES = 123_287  # Karpathy's train + restval + val + test
CAPTIONS_PER_IMAGE = 5  # 616,767 at COCO's 5.003 per image; 5 here
VAL_IMAGES = 5000
COCO_VOCABULARY = 10_000  # Karpathy's COCO vocabulary at min count 5: 9,487 words
WARMUP_STEPS = 20
TRAIN_STEPS = 100
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CAPTION_FILES = (
    SHARED / "coco2017_val_subset/annotations/captions_val2017.json",
    SHARED / "coco2017_train_mini/annotations/captions_train2017.json",
)


def real_captions() -> list[str]:
    found = [f for f in CAPTION_FILES if f.is_file()]
    if not found:
        raise SystemExit(
            f"no COCO caption file found ({CAPTION_FILES[0]}): the simulation "
            "samples the real COCO captions in ../shared"
        )
    return [a["caption"] for f in found for a in json.loads(f.read_text())["annotations"]]


def build_dataset(root: Path, images: int, captions: list[str], seed: int = 0) -> dict:
    """dataset_coco.json in Karpathy's format plus an empty file per image; the split sizes keep
    Karpathy's proportions (5000 val, 5000 test at full scale)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n_val = max(1, round(images * VAL_IMAGES / COCO_IMAGES))
    folder = root / "train2014"
    folder.mkdir(parents=True)
    entries, sent = [], 0
    picks = rng.integers(0, len(captions), size=(images, CAPTIONS_PER_IMAGE))
    for i in range(images):
        split = (
            "val" if i < n_val else "test" if i < 2 * n_val else ("train" if i % 7 else "restval")
        )
        name = f"COCO_train2014_{i:012d}.jpg"
        (folder / name).touch()
        sentences = []
        for j in picks[i]:
            sentences.append(
                {
                    "raw": captions[j],
                    "sentid": sent,
                    "imgid": i,
                    "tokens": captions[j].lower().split(),
                }
            )
            sent += 1
        entries.append(
            {
                "filepath": "train2014",
                "filename": name,
                "imgid": i,
                "split": split,
                "cocoid": i + 1,
                "sentids": [s["sentid"] for s in sentences],
                "sentences": sentences,
            }
        )
    (root / "dataset_coco.json").write_text(json.dumps({"images": entries, "dataset": "coco"}))
    return {"val": n_val}


class Stages:
    """Each stage's seconds and the number of items it handled: the scales are compared on time
    per item, so a stage's time is never recorded without its item count."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.items: dict[str, int] = {}

    @contextlib.contextmanager
    def timed(self, name: str, n: int) -> Iterator[None]:
        """Time the block as stage ``name`` over ``n`` items."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - t0, 3)
            self.items[name] = n


def time_cache(
    root: Path, enc: EncoderConfig, everything: list[CaptionedImage], stages: Stages
) -> FeatureCache:
    """Write, index and read back the feature cache of every image: the cache is what training
    reads, so its cost per image must not grow with the number of images."""
    import numpy as np

    from showattendtell.data.feature_cache import FeatureCache

    # the smallest real annotation vectors (VGG's 512-d), on a 2x2 grid: 4 KB per image,
    # 0.5 GB at full scale (a real 14x14x512 cache is 25 GB)
    grid_len, feat_dim = 4, enc.feature_dim
    cache = FeatureCache.for_config(root / "cache", enc)
    with stages.timed("cache_write", len(everything)):
        grids = (
            np.random.default_rng(0).standard_normal((1024, grid_len, feat_dim)).astype(np.float16)
        )
        for start in range(0, len(everything), 1024):
            keys = [im.image_id for im in everything[start : start + 1024]]
            # the shard writer extract() uses, fed synthetic grids (no encoder runs here)
            cache._write_shard(keys, [grids[: len(keys)]], len(keys))
    with stages.timed("cache_index", len(everything)):
        cache = FeatureCache(cache.dir)
    probe = np.random.default_rng(1).permutation(len(everything))[: len(everything) // 10]
    with stages.timed("cache_read", len(probe)):
        for k in probe:
            cache[everything[k].image_id]
    return cache


def time_training(
    pairs: CaptionPairs, vocab: Vocabulary, enc: EncoderConfig, stages: Stages
) -> None:
    """Time training steps over every pair, with the model at COCO's vocabulary size whatever
    the scale, so that a step's cost differs between scales only through the data path."""
    import torch

    from showattendtell.data.datamodule import collate_captions
    from showattendtell.model import CaptionModel
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.vocab import Vocabulary
    from showattendtell.training.objectives import MaximumLikelihood

    # The model's output layer has COCO's usual vocabulary size at both scales (padded with
    # unused words): a 1/10 sample has fewer words with 5 occurrences, and a smaller output
    # layer would make its steps faster for a reason that is not the data path.
    torch.manual_seed(0)
    padded = Vocabulary(
        [*vocab.itos, *(f"<unused{i}>" for i in range(max(0, COCO_VOCABULARY - len(vocab))))]
    )
    model = CaptionModel(
        padded, enc, DecoderConfig("soft", 32, 64, 32, 0.0), load_encoder_weights=False
    )
    opt = torch.optim.Adam(model.decoder.parameters(), lr=1e-3)
    objective = MaximumLikelihood(1.0)
    loader = torch.utils.data.DataLoader(
        pairs, batch_size=64, shuffle=True, collate_fn=collate_captions, num_workers=0
    )
    batches = iter(loader)

    def run_steps(steps: int) -> None:
        nonlocal batches
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:  # a small scale has fewer batches than steps: a new epoch
                batches = iter(loader)
                batch = next(batches)
            loss, _ = objective(model, batch["inputs"], batch)
            opt.zero_grad()
            loss.backward()
            opt.step()

    # the first steps open the memory-mapped shards they touch (one-off, O(shards)); the
    # steps after them are what an epoch is made of
    with stages.timed("train_first_steps", WARMUP_STEPS):
        run_steps(WARMUP_STEPS)
    with stages.timed("train_steps", TRAIN_STEPS):
        run_steps(TRAIN_STEPS)


def time_scoring(train: list[CaptionedImage], val: list[CaptionedImage], stages: Stages) -> None:
    """Time what reads every reference: validation scoring and the self-critical reward's
    document frequencies, both built over all captions at once."""
    from showattendtell.evaluation.metrics import CiderDReward, score_captions
    from showattendtell.network.vocab import tokenize

    refs = {im.image_id: im.captions for im in val}
    preds = {k: v[0] for k, v in refs.items()}  # a reference as the "caption"
    with stages.timed("val_scoring", len(refs)):
        score_captions(preds, {k: v[1:] for k, v in refs.items()}, official=False)

    with stages.timed("cider_df", len(train)):
        CiderDReward([[" ".join(tokenize(c)) for c in im.captions] for im in train])


def run_scale(fraction: float) -> dict:
    """Build a dataset of ``fraction`` of COCO's size in a temporary folder and time every
    stage of the data and training path on it (in this process, so the peak RSS is this
    scale's own)."""
    import torch

    from showattendtell.data.datamodule import CaptionPairs, _Source
    from showattendtell.data.datasets import load_karpathy
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.network.vocab import Vocabulary

    torch.set_num_threads(1)
    images = max(100, round(COCO_IMAGES * fraction))
    stages = Stages()

    with tempfile.TemporaryDirectory(prefix="coco_scale_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        sizes = build_dataset(root, images, real_captions())
        setup_s = time.perf_counter() - t0

        with stages.timed("index", images):
            train = load_karpathy(root, "train+restval").images
            val = load_karpathy(root, "val").images
        train_captions = [c for im in train for c in im.captions]
        n_caps = images * CAPTIONS_PER_IMAGE

        with stages.timed("vocab", len(train_captions)):
            vocab = Vocabulary.build(train_captions, min_count=5)

        enc = EncoderConfig(backbone="vgg16", weights=None, input_size=32, grid_size=2)
        cache = time_cache(root, enc, train + val, stages)

        source = _Source(cache, enc.input_size)
        with stages.timed("pairs", len(train_captions)):
            pairs = CaptionPairs(train, vocab, source, max_length=30)

        time_training(pairs, vocab, enc, stages)
        time_scoring(train, val, stages)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "fraction": fraction,
        "images": images,
        "captions": n_caps,
        "train_images": len(train),
        "val_images": sizes["val"],
        "vocabulary": len(vocab),
        "setup_s": round(setup_s, 1),
        "peak_rss_mb": round(peak, 1),
        "stages": stages.seconds,
        "items": stages.items,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scales",
        type=float,
        nargs="+",
        default=[0.1, 1.0],
        help="fractions of COCO's size (default: 0.1 1.0)",
    )
    p.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:  # a child process: one scale
        print(json.dumps(run_scale(args.one)))
        return
    t0 = time.perf_counter()
    scales = []
    for f in args.scales:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(f)], capture_output=True, text=True, check=False
        )
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        scales.append(json.loads(out.stdout.strip().splitlines()[-1]))
        s = scales[-1]
        print(
            f"scale {f:g}: {s['images']} images, {s['captions']} captions, peak RSS "
            f"{s['peak_rss_mb']:.0f} MB: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in s["stages"].items()),
            file=sys.stderr,
        )
    result = {
        "scales": [
            {k: s[k] for k in ("images", "captions", "vocabulary", "peak_rss_mb", "stages")}
            for s in scales
        ]
    }
    if len(scales) >= 2:  # per-item time, largest scale over smallest
        small, large = scales[0], scales[-1]
        ratio = {}
        for k in large["stages"]:
            per_small = small["stages"][k] / max(small["items"][k], 1)
            per_large = large["stages"][k] / max(large["items"][k], 1)
            ratio[k] = round(per_large / max(per_small, 1e-12), 2)
        result["per_item_ratio"] = ratio
        result["linear"] = all(r <= 1.5 for r in ratio.values())
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
