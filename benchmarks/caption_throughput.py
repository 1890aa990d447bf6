"""End-to-end captioning speed from image files, against the encoder alone on the same images.

Measures what `sat caption` does (files decoded as it decodes them: in the main thread on a CPU,
in worker processes on a GPU; batched encoder, batched greedy / beam-3 decoding, JSON lines
written) and what the CNN alone costs on the same images
already in memory, so the ratio says how much loading, decoding and writing add on top of it.
Warm-up first, then several rounds, each timing the encoder alone, greedy, beam 3 and the
encoder alone again one after the other (so that a change in the machine's load hits all of
them alike; the reference is timed twice a round because it moves more than the pipeline);
medians are reported.
The last line of output is one JSON object, for scripts. ``--profile`` adds where the time of
one greedy and one beam-3 run goes (image decoding, encoder, decoder steps,
search bookkeeping, results, JSON lines, waiting), so that the gap to the encoder can be
explained, not guessed.

    python benchmarks/caption_throughput.py --model models/flickr8k_lite2_soft.safetensors
    python benchmarks/caption_throughput.py --profile \
        --images ../shared/data/coco2017_val_subset/images ../shared/data/coco2017_train_mini/images
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from showattendtell.captioning.captioner import PRECISIONS, Captioner, load_model
from showattendtell.captioning.pipeline import DEFAULT_BATCH_SIZE, caption_files
from showattendtell.captioning.records import Writer
from showattendtell.images.files import list_images
from showattendtell.images.pipeline import default_lanes, default_workers, in_lanes
from showattendtell.search.decoding import SEARCH_STRATEGIES

DEFAULT_IMAGES = Path(__file__).resolve().parents[2] / "shared/data/coco2017_val_subset/images"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn: Callable[[], Any], device: torch.device, running: bool = False) -> float:
    """Images/s of one run of ``fn``, which returns how many images it did, or (how many, when
    its first batch was done, how many by then). ``running``: the rate from the first batch
    on (a run's start, its decoding processes starting up, is then left out: on a GPU with 120
    photos it would be most of the run, and `sat caption` pays it once per run)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    t1 = time.perf_counter()
    n, first_s, first_n = out if isinstance(out, tuple) else (out, None, 0)
    if running and first_s is not None and n >= 4 * first_n:  # a few batches after the first
        return (n - first_n) / (t1 - first_s)
    return n / (t1 - t0)


def cycled(paths: list[str], count: int) -> list[str]:
    """``paths`` repeated until there are at least ``count`` of them."""
    return (paths * max(1, -(-count // max(1, len(paths)))))[: max(count, len(paths))]


def end_to_end(
    captioner: Captioner,
    paths: list[str],
    batch_size: int,
    workers: int,
    beam_size: int,
    lanes: int,
    jpeg_on_device: bool = False,
) -> tuple[int, float | None, int]:
    """What `sat caption -o FILE` does, with the lines written to /dev/null. Returns how many
    photos, and when (``time.perf_counter``) the first batch was written and how many by then."""
    with open(os.devnull, "wb", buffering=0) as sink:
        writer = Writer("jsonl", False, sink)
        n, first_s, first_n = 0, None, 0
        for rec in caption_files(
            captioner,
            paths,
            batch_size,
            workers,
            lanes=lanes,
            jpeg_on_device=jpeg_on_device,
            decoding=captioner.check_decoding(beam_size=beam_size),
        ):
            if rec.result is None:
                raise SystemExit(f"{rec.path}: {rec.error}")
            writer.write(rec)
            n += 1
            if first_s is None and n >= min(batch_size, len(paths)):
                first_s, first_n = time.perf_counter(), n
    return n, first_s, first_n


def encoder_alone(captioner: Captioner, batches: list[torch.Tensor], lanes: int = 1) -> int:
    """The CNN alone on images already decoded: one batch at a time on all of torch's threads
    (``lanes`` 1, the reference of the reported ratios), or ``lanes`` batches at once."""
    for _ in in_lanes(captioner.encode, batches, lanes):
        pass
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


class Timers:
    """Wall time spent inside wrapped callables, by name (main process only). On a GPU each
    timed call starts and ends with a synchronisation: the GPU's queued work is then counted
    in the stage that queued it, not in the first later one that waits for it (which costs
    the overlap of the stages, so a profiled run is a little slower than a plain one)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.device = device

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.device is not None:
                sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.device is not None:
                    sync(self.device)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        return timed


@contextlib.contextmanager
def instrumented(captioner: Captioner, timers: Timers) -> Iterator[None]:
    """Time the encoder, the search, its decoder steps and the whole per-batch result step by
    wrapping them on these instances (the library itself carries no timing code)."""
    targets = [
        (captioner, "encode", "encoder"),
        (captioner, "caption_annotations", "results"),
        (captioner.model, "generate", "search"),
        (captioner.model.decoder, "start", "decoder start"),
        (captioner.model.decoder, "step", "decoder steps"),
    ]
    for obj, attr, name in targets:
        object.__setattr__(obj, attr, timers.wrap(name, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, _ in targets:
            object.__delattr__(obj, attr)


def cpu_seconds() -> tuple[float, float]:
    """(this process, its finished children) user + system CPU seconds."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def profile_run(
    captioner: Captioner,
    paths: list[str],
    batch_size: int,
    workers: int,
    beam_size: int,
    jpeg_on_device: bool = False,
) -> dict[str, float]:
    """One end-to-end run, one batch at a time (1 lane, so that the stages add up to the wall
    time), with every main-process stage timed, in ms per image; the workers' CPU time is what
    their processes used (they exit at the end of the run)."""
    timers = Timers(captioner.device)
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    with instrumented(captioner, timers), open(os.devnull, "wb", buffering=0) as sink:
        writer = Writer("jsonl", False, sink)
        write = timers.wrap("JSON lines", writer.write)
        for rec in caption_files(
            captioner,
            paths,
            batch_size,
            workers,
            lanes=1,
            jpeg_on_device=jpeg_on_device,
            decoding=captioner.check_decoding(beam_size=beam_size),
        ):
            write(rec)
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds()
    sec = timers.seconds
    per = 1000 / len(paths)
    start, steps = sec.get("decoder start", 0.0), sec.get("decoder steps", 0.0)
    parts = {
        "encoder": sec["encoder"],
        "decoder start (W_a a)": start,
        "decoder steps": steps,
        "search bookkeeping": sec["search"] - start - steps,
        "results (words, attention maps)": sec["results"] - sec["search"],
        "JSON lines": sec["JSON lines"],
    }
    # with 0 workers the main thread decodes the images here
    parts["image decoding or waiting, other"] = wall - sum(parts.values())
    out = {k: round(v * per, 2) for k, v in parts.items()}
    out["total"] = round(wall * per, 2)
    out["main process CPU"] = round((cpu1[0] - cpu0[0]) * per, 2)
    out["worker processes CPU"] = round((cpu1[1] - cpu0[1]) * per, 2)
    return out


def decode_cost_ms(paths: list[str], input_size: int) -> float:
    """Decode + resize of one image on one core, as a decoding process does it
    (``jpeg_device.load_jpeg``), ms/img."""
    from showattendtell.images.jpeg_device import load_jpeg

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        load_jpeg(paths[0], input_size)  # imports torchvision, as a decoding process does once
        t0 = time.perf_counter()
        for p in paths:
            load_jpeg(p, input_size)
        return (time.perf_counter() - t0) * 1000 / len(paths)
    finally:
        torch.set_num_threads(threads)


def print_profile(
    profiles: dict[str, dict[str, float]], encoder_ms: float, decode_ms: float, cores: int
) -> None:
    names = list(next(iter(profiles.values())))
    print(
        f"where the time goes, ms per image (encoder alone {encoder_ms:.2f}; image decoding "
        f"on one core {decode_ms:.2f} = {decode_ms / encoder_ms:.0%} of the encoder, "
        f"{cores} cores)"
    )
    print(f"  {'':<34}" + "".join(f"{k:>10}" for k in profiles))
    for name in names:
        print(f"  {name:<34}" + "".join(f"{p[name]:>10.2f}" for p in profiles.values()))


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    mem = {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        mem["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return {k: round(v, 1) for k, v in mem.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model file (default: the bundled model)")
    ap.add_argument(
        "--images",
        nargs="+",
        default=[str(DEFAULT_IMAGES)],
        help="folders (or files) of images, read in place",
    )
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    ap.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="as sat caption's default"
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="image-decoding processes (default: sat caption's for the device)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds; medians are reported")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N images")
    ap.add_argument(
        "--min-batches",
        type=int,
        default=None,
        help="repeat the images until a run has this many batches (default: 16 on a GPU, "
        "where one batch of 120 photos takes milliseconds; 1 on a CPU)",
    )
    ap.add_argument("--latency-images", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--precision",
        default="32",
        choices=tuple(PRECISIONS),
        help="as sat caption's: float32, or mixed precision (16: GPU only)",
    )
    ap.add_argument(
        "--lanes",
        type=int,
        default=None,
        help="batches in flight at once (default: the pipeline's, 2 on a CPU)",
    )
    ap.add_argument(
        "--search",
        default="auto",
        choices=SEARCH_STRATEGIES,
        help="the search's strategy (default: by device; decoding._strategy)",
    )
    ap.add_argument(
        "--decode-on",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where JPEGs are decoded, as sat caption's --decode-on (gpu: nvJPEG, CUDA only)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print where the time of a greedy and a beam-3 run goes",
    )
    return ap.parse_args(argv)


def measure_rounds(
    captioner: Captioner, paths: list[str], args: argparse.Namespace, lanes: int
) -> tuple[list[float], list[tuple[float, ...]]]:
    """Warm-up, single-image latencies, then ``repeats`` rounds of (encoder, greedy, beam 3,
    encoder[, encoder in lanes]) images/s."""
    dev = captioner.device
    gpu_jpeg = args.decode_on == "gpu"
    # warm-up: worker start, allocator, kernels (cuDNN autotuning on a GPU)
    warm = paths[: args.batch_size]
    end_to_end(captioner, warm, args.batch_size, args.workers, 1, lanes, gpu_jpeg)
    end_to_end(captioner, warm, args.batch_size, args.workers, 3, lanes, gpu_jpeg)
    latencies_ms(captioner, paths[:2], 3)

    lat = latencies_ms(captioner, paths[: args.latency_images], 3)
    decoded = {p: captioner.preprocess(p) for p in dict.fromkeys(paths)}  # each photo once
    tensors = [decoded[p] for p in paths]
    batches = [
        torch.stack(tensors[i : i + args.batch_size]).to(dev)
        for i in range(0, len(tensors), args.batch_size)
    ]
    encoder_alone(captioner, batches[:2], lanes)
    timed = [
        lambda: encoder_alone(captioner, batches),
        lambda: end_to_end(captioner, paths, args.batch_size, args.workers, 1, lanes, gpu_jpeg),
        lambda: end_to_end(captioner, paths, args.batch_size, args.workers, 3, lanes, gpu_jpeg),
        lambda: encoder_alone(captioner, batches),
    ]
    if lanes > 1:  # in 1 lane it is the same measurement as the one before
        timed.append(lambda: encoder_alone(captioner, batches, lanes))
    running = args.workers > 0
    return lat, [tuple(rate(fn, dev, running) for fn in timed) for _ in range(args.repeats)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = [str(p) for p in list_images(args.images)][: args.limit]
    if not paths:
        raise SystemExit(f"no images in {args.images}")
    if args.min_batches is None:  # on a GPU a few batches would time mostly their start
        args.min_batches = 16 if args.device == "cuda" else 1
    paths = cycled(paths, args.min_batches * args.batch_size)
    captioner = load_model(args.model, args.device, args.precision)
    captioner.model.search_strategy = args.search
    dev = captioner.device
    lanes = default_lanes(dev) if args.lanes is None else args.lanes
    if args.workers is None:
        args.workers = default_workers(dev)
    lat, rounds = measure_rounds(captioner, paths, args, lanes)
    greedy, beam3 = (statistics.median(r[i] for r in rounds) for i in (1, 2))
    encoder_runs = [x for r in rounds for x in (r[0], r[3])]  # the reference, twice a round
    encoder = statistics.median(encoder_runs)
    encoder_lanes = statistics.median(r[4] for r in rounds) if lanes > 1 else encoder
    profiles = {}
    if args.profile:
        profiles = {
            name: profile_run(
                captioner, paths, args.batch_size, args.workers, beam, args.decode_on == "gpu"
            )
            for name, beam in (("greedy", 1), ("beam 3", 3))
        }
        decode_ms = decode_cost_ms(paths, captioner.input_size)

    result = {
        "model": captioner.name,
        "input_size": captioner.input_size,
        "images": len(paths),
        "rate_from": "first batch" if args.workers > 0 else "start",
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "batch_size": args.batch_size,
        "workers": args.workers,
        "lanes": lanes,
        "precision": args.precision,
        "search": args.search,
        "decode_on": args.decode_on,
        "repeats": args.repeats,
        "latency_p50_ms": round(float(np.percentile(lat, 50)), 1),
        "latency_p95_ms": round(float(np.percentile(lat, 95)), 1),
        "images_per_s_greedy": round(greedy, 2),
        "images_per_s_beam3": round(beam3, 2),
        "encoder_images_per_s": round(encoder, 2),
        "encoder_in_lanes_images_per_s": round(encoder_lanes, 2),
        "ratio_greedy_to_encoder": round(greedy / encoder, 3),
        "ratio_beam3_to_encoder": round(beam3 / encoder, 3),
        "ratio_greedy_to_encoder_in_lanes": round(greedy / encoder_lanes, 3),
        "ratio_beam3_to_encoder_in_lanes": round(beam3 / encoder_lanes, 3),
        "rounds_images_per_s": [[round(x, 2) for x in r] for r in rounds],  # as in ``timed``
        "encoder_images_per_s_min_max": [round(min(encoder_runs), 2), round(max(encoder_runs), 2)],
        **peak_memory_mb(dev),
        **(
            {"profile_ms_per_image": profiles, "decode_ms_per_image_one_core": round(decode_ms, 2)}
            if profiles
            else {}
        ),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print_summary(result, lanes)
    if profiles:
        print_profile(profiles, 1000 / encoder, decode_ms, os.cpu_count() or 1)
    print(json.dumps(result))
    return 0


def print_summary(result: dict[str, Any], lanes: int) -> None:
    rows = [
        (
            "single image, beam 3, p50 / p95",
            f"{result['latency_p50_ms']} / {result['latency_p95_ms']} ms",
        ),
        ("batch, greedy", f"{result['images_per_s_greedy']} img/s"),
        ("batch, beam 3", f"{result['images_per_s_beam3']} img/s"),
        (
            "encoder alone (median, min-max)",
            f"{result['encoder_images_per_s']} img/s, "
            f"{'-'.join(map(str, result['encoder_images_per_s_min_max']))}",
        ),
        ("greedy / encoder", f"{result['ratio_greedy_to_encoder']:.0%}"),
        ("beam 3 / encoder", f"{result['ratio_beam3_to_encoder']:.0%}"),
    ]
    if lanes > 1:
        rows += [
            (f"encoder alone, {lanes} lanes", f"{result['encoder_in_lanes_images_per_s']} img/s"),
            (
                f"greedy / encoder in {lanes} lanes",
                f"{result['ratio_greedy_to_encoder_in_lanes']:.0%}",
            ),
            (
                f"beam 3 / encoder in {lanes} lanes",
                f"{result['ratio_beam3_to_encoder_in_lanes']:.0%}",
            ),
        ]
    rows += [
        (
            "peak RSS (main / workers)",
            f"{result['peak_rss_mb']} / {result['peak_rss_workers_mb']} MB",
        ),
    ]
    if "peak_gpu_mb" in result:
        rows.append(("peak GPU memory", f"{result['peak_gpu_mb']} MB"))
    print(
        f"{result['model']} ({result['input_size']} px) on {result['device']}, "
        f"{result['images']} images, batch {result['batch_size']}, {result['workers']} "
        f"workers, {lanes} lanes, precision {result['precision']}, "
        f"medians of {result['repeats']} rounds, load average {result['load_average']}"
    )
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
