"""onnxruntime against the PyTorch path: the same model, photos and search, in the same run.

The model is exported with `sat export MODEL OUT --format onnx` (or --onnx names an export), and
both paths caption the same preprocessed photos from their tensors (encoder + search, the
model's stored decoding with the beam size set): greedy and beam 3, one photo at a time (batch
1) and in batches of 32. Each round times every case on both paths one after the other, so a
change in the machine's load hits both alike; medians over the rounds are reported, with the
share of captions that are equal on the two paths.

    python benchmarks/onnx_runtime.py --images ../shared/data/coco2017_val_subset/images
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from showattendtell.captioning.captioner import Captioner, load_model
from showattendtell.captioning.catalog import resolve_model
from showattendtell.captioning.onnx_export import export_onnx
from showattendtell.model_file import read_model


def photos(folders: list[str], n: int, captioner: Captioner) -> torch.Tensor:
    files = sorted(p for f in folders for p in Path(f).glob("*.jpg"))[:n]
    if len(files) < n:
        raise SystemExit(f"{n} photos wanted, {len(files)} found in {', '.join(folders)}")
    return torch.stack([captioner.preprocess(p) for p in files])


def timed(captioner: Captioner, images: torch.Tensor, batch: int, beam: int):
    """(seconds, captions) for ``images`` in batches of ``batch``."""
    start, captions = time.perf_counter(), []
    for i in range(0, len(images), batch):
        results = captioner.caption_batch(images[i : i + batch], beam_size=beam)
        captions += [r.caption for r in results]
    return time.perf_counter() - start, captions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flickr8k_lite2_soft", help="model file or name")
    parser.add_argument("--onnx", default=None, help="its ONNX export (default: exported now)")
    parser.add_argument("--images", nargs="+", required=True, help="folders of .jpg photos")
    parser.add_argument("--single", type=int, default=8, help="photos captioned at batch 1")
    parser.add_argument("--batch", type=int, default=32, help="the large batch (one batch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's and onnxruntime's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.onnx
        if folder is None:
            model, decoding, info = read_model(resolve_model(args.model))
            folder = export_onnx(model, decoding, Path(tmp) / "onnx", info)
        paths = {"pytorch": load_model(args.model, "cpu"), "onnxruntime": load_model(folder)}
        images = photos(args.images, max(args.single, args.batch), paths["pytorch"])
        cases = [(b, beam) for b in (1, args.batch) for beam in (1, 3)]
        for captioner in paths.values():  # warm-up: first calls, the consensus tables
            captioner.prepare()
            timed(captioner, images[:2], 2, 3)
        seconds = {(p, c): [] for p in paths for c in cases}
        captions: dict = {}
        for _ in range(args.rounds):
            for batch, beam in cases:
                n = args.single if batch == 1 else args.batch
                for name, captioner in paths.items():
                    s, caps = timed(captioner, images[:n], batch, beam)
                    seconds[name, (batch, beam)].append(s / n)
                    captions[name, (batch, beam)] = caps

    print(f"{'batch':>5} {'search':>7} {'pytorch':>14} {'onnxruntime':>14} {'ratio':>6}  equal")
    rows = []
    for batch, beam in cases:
        pt = statistics.median(seconds["pytorch", (batch, beam)])
        ox = statistics.median(seconds["onnxruntime", (batch, beam)])
        a, b = captions["pytorch", (batch, beam)], captions["onnxruntime", (batch, beam)]
        equal = sum(x == y for x, y in zip(a, b, strict=True))
        search = "greedy" if beam == 1 else f"beam {beam}"
        print(
            f"{batch:>5} {search:>7} {pt * 1e3:>9.0f} ms/ph {ox * 1e3:>9.0f} ms/ph "
            f"{pt / ox:>5.2f}x  {equal}/{len(a)}"
        )
        rows.append(
            {
                "batch": batch,
                "beam": beam,
                "pytorch_ms_per_photo": round(pt * 1e3, 1),
                "onnxruntime_ms_per_photo": round(ox * 1e3, 1),
                "speedup": round(pt / ox, 3),
                "equal": equal,
                "photos": len(a),
            }
        )
    print(json.dumps({"threads": torch.get_num_threads(), "rounds": args.rounds, "cases": rows}))


if __name__ == "__main__":
    main()
