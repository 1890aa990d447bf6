"""What the confidence (search/confidence.py) costs a caption: photos/s of captioning with it,
with its signals' second decoder pass (each best caption teacher-forced through the decoder
again, as it was computed before the search kept each word's log-probability), and without any
confidence, on the same photos.

The photos are decoded and encoded once (the encoder does not change with the confidence: it is
timed once and added to each figure); then, for each decoding (greedy and the model's stored
one), several rounds each run the three ways one after the other, in an order that rotates from
round to round so that a change in the machine's load hits all of them alike; medians are
reported, and the ratios to "none", which are what to read on a busy machine.

    python benchmarks/confidence_cost.py --images ../shared/data/flickr8k/images --photos 200

The last line of output is one JSON object, for scripts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from showattendtell.captioning.captioner import Captioner, load_model
from showattendtell.images.files import list_images
from showattendtell.search import confidence

WAYS = ("kept", "second pass", "none")


def _second_pass(signals: Callable) -> Callable:
    """confidence.signals as it was: the hypotheses without their words' log-probabilities,
    so that it feeds each best caption to the decoder again."""

    def run(decoder, annotations, hypotheses, *args, **kwargs):
        bare = [[dataclasses.replace(h, word_log_probs=None) for h in hyps] for hyps in hypotheses]
        return signals(decoder, annotations, bare, *args, **kwargs)

    return run


def _no_confidence(self, annotations, hypotheses, captions, cfg, typicality):
    """Captioner._confidence without a confidence: only the log-probability per word, which
    the familiarity warning reads; no signal, no fit."""
    per_word = [confidence.finite(h[0].log_prob) / (len(h[0].tokens) + 1) for h in hypotheses]
    return {"log_prob_per_word": np.asarray(per_word)}, None


def _time(captioner: Captioner, grids: list[torch.Tensor], decoding, way: str) -> float:
    """Seconds to caption every batch of annotation grids one way."""
    patches = {
        "kept": [],
        "second pass": [mock.patch.object(confidence, "signals", _second_pass(confidence.signals))],
        "none": [mock.patch.object(Captioner, "_confidence", _no_confidence)],
    }[way]
    for p in patches:
        p.start()
    try:
        t0 = time.perf_counter()
        for g in grids:
            captioner.caption_annotations(g, decoding)
        return time.perf_counter() - t0
    finally:
        for p in patches:
            p.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, nargs="+", required=True, help="photo folders")
    p.add_argument("--photos", type=int, default=200, help="the first N photos (sorted)")
    p.add_argument("--model", default=None, help="model file or name (default: the default)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    captioner = load_model(args.model, "cpu")
    files = sorted(f for folder in args.images for f in list_images([folder]))[: args.photos]
    pixels = [captioner.preprocess(f) for f in files]
    batches = [
        torch.stack(pixels[i : i + args.batch_size]) for i in range(0, len(files), args.batch_size)
    ]
    captioner.prepare()
    captioner.caption_annotations(captioner.encode(batches[0][:2]))  # warm-up: tables, calibration
    t0 = time.perf_counter()
    grids = [captioner.encode(b) for b in batches]
    encoder_s = time.perf_counter() - t0
    n = len(files)
    print(
        f"model {captioner.name}, {n} photos, batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads; encoder {n / encoder_s:.1f} photos/s"
    )
    decodings = {
        "greedy": captioner.check_decoding(beam_size=1),
        "stored": captioner.decoding,
    }
    out: dict[str, dict] = {"photos": n, "encoder_photos_per_s": n / encoder_s}
    for name, decoding in decodings.items():
        _time(captioner, grids[:1], decoding, "kept")  # warm-up of this decoding
        seconds: dict[str, list[float]] = {w: [] for w in WAYS}
        for r in range(args.rounds):
            for way in WAYS[r % 3 :] + WAYS[: r % 3]:
                seconds[way].append(_time(captioner, grids, decoding, way))
        median = {w: statistics.median(s) for w, s in seconds.items()}
        rates = {w: n / (encoder_s + s) for w, s in median.items()}
        print(f"\n{name} ({decoding.to_dict()}): photos/s with the encoder (search alone)")
        for w in WAYS:
            extra = (median[w] - median["none"]) / n * 1e3
            print(
                f"  {w:12s} {rates[w]:6.1f} ({n / median[w]:6.1f})  "
                f"{rates[w] / rates['none']:6.1%} of none; {extra:+.2f} ms a photo"
            )
        out[name] = {
            "photos_per_s": rates,
            "search_photos_per_s": {w: n / s for w, s in median.items()},
            "rounds_s": seconds,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
