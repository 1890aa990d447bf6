"""End-to-end captioning speed from image files, against the encoder alone on the same images.

Measures what `sat caption` does (worker processes decoding files, batched encoder, batched
greedy / beam-3 decoding, JSON lines written) and what the CNN alone costs on the same images
already in memory, so the ratio says how much loading, decoding and writing add on top of it.
Warm-up first, then several repetitions; medians are reported. The last line of output is one
JSON object, for scripts.

    python benchmarks/caption_throughput.py --model models/flickr8k_lite2_soft.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from showattendtell.caption_output import Writer
from showattendtell.images import list_images
from showattendtell.inference import Captioner, load_model
from showattendtell.pipeline import caption_files, default_workers

DEFAULT_IMAGES = Path(__file__).resolve().parents[2] / "shared/data/coco2017_val_subset/images"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_rate(fn: Callable[[], int], repeats: int, device: torch.device) -> float:
    """Median images/s of ``repeats`` runs of ``fn`` (which returns how many images it did)."""
    rates = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        n = fn()
        sync(device)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def end_to_end(captioner: Captioner, paths: list[str], batch_size: int, workers: int,
               beam_size: int) -> int:
    """What `sat caption -o FILE` does, with the lines written to /dev/null."""
    with open(os.devnull, "wb", buffering=0) as sink:
        writer = Writer("jsonl", False, sink)
        n = 0
        for rec in caption_files(captioner, paths, batch_size, workers, beam_size=beam_size):
            if rec.result is None:
                raise SystemExit(f"{rec.path}: {rec.error}")
            writer.write(rec)
            n += 1
    return n


def encoder_alone(captioner: Captioner, batches: list[torch.Tensor]) -> int:
    for b in batches:
        captioner.encode(b)
    return sum(len(b) for b in batches)


def latencies_ms(captioner: Captioner, paths: list[str], beam_size: int) -> list[float]:
    """One image at a time, from the file to the caption (what a single request costs)."""
    out = []
    for p in paths:
        sync(captioner.device)
        t0 = time.perf_counter()
        captioner.caption([p], beam_size=beam_size)
        sync(captioner.device)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    mem = {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        mem["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return {k: round(v, 1) for k, v in mem.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model file (default: the bundled model)")
    ap.add_argument("--images", default=str(DEFAULT_IMAGES), help="folder of images")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cpu", "cuda"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N images")
    ap.add_argument("--latency-images", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = [str(p) for p in list_images([args.images])][: args.limit]
    if not paths:
        raise SystemExit(f"no images in {args.images}")
    captioner = load_model(args.model, args.device)
    dev = captioner.device

    # warm-up: worker start, allocator, kernels (cuDNN autotuning on a GPU)
    warm = paths[: args.batch_size]
    end_to_end(captioner, warm, args.batch_size, args.workers, 1)
    end_to_end(captioner, warm, args.batch_size, args.workers, 3)
    latencies_ms(captioner, paths[:2], 3)

    lat = latencies_ms(captioner, paths[: args.latency_images], 3)
    greedy = median_rate(lambda: end_to_end(captioner, paths, args.batch_size, args.workers, 1),
                         args.repeats, dev)
    beam3 = median_rate(lambda: end_to_end(captioner, paths, args.batch_size, args.workers, 3),
                        args.repeats, dev)
    tensors = [captioner.preprocess(p) for p in paths]
    batches = [torch.stack(tensors[i: i + args.batch_size]).to(dev)
               for i in range(0, len(tensors), args.batch_size)]
    encoder_alone(captioner, batches[:1])
    encoder = median_rate(lambda: encoder_alone(captioner, batches), args.repeats, dev)

    result = {
        "model": captioner.name,
        "input_size": captioner.input_size,
        "images": len(paths),
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "batch_size": args.batch_size,
        "workers": args.workers,
        "repeats": args.repeats,
        "latency_p50_ms": round(float(np.percentile(lat, 50)), 1),
        "latency_p95_ms": round(float(np.percentile(lat, 95)), 1),
        "images_per_s_greedy": round(greedy, 2),
        "images_per_s_beam3": round(beam3, 2),
        "encoder_images_per_s": round(encoder, 2),
        "ratio_greedy_to_encoder": round(greedy / encoder, 3),
        "ratio_beam3_to_encoder": round(beam3 / encoder, 3),
        **peak_memory_mb(dev),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    rows = [
        ("single image, beam 3, p50 / p95",
         f"{result['latency_p50_ms']} / {result['latency_p95_ms']} ms"),
        ("batch, greedy", f"{result['images_per_s_greedy']} img/s"),
        ("batch, beam 3", f"{result['images_per_s_beam3']} img/s"),
        ("encoder alone", f"{result['encoder_images_per_s']} img/s"),
        ("greedy / encoder", f"{result['ratio_greedy_to_encoder']:.0%}"),
        ("beam 3 / encoder", f"{result['ratio_beam3_to_encoder']:.0%}"),
        ("peak RSS (main / workers)",
         f"{result['peak_rss_mb']} / {result['peak_rss_workers_mb']} MB"),
    ]
    if "peak_gpu_mb" in result:
        rows.append(("peak GPU memory", f"{result['peak_gpu_mb']} MB"))
    print(f"{result['model']} ({result['input_size']} px) on {result['device']}, "
          f"{len(paths)} images, batch {args.batch_size}, {args.workers} workers, "
          f"median of {args.repeats}, load average {result['load_average']}")
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
