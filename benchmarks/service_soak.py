"""Soak test of `sat serve`: thousands of unique photos through the API, watching the server's
upload cache and memory.

A service that runs for weeks must not keep every upload on disk or a little memory per request.
This starts `sat serve` in a subprocess with its own Gradio cache folder (GRADIO_TEMP_DIR), sends
``--requests`` different photos through ``/caption`` from ``--clients`` clients at once, and
every ``--every`` answers prints the cache's size (files, MB) and the server's resident memory
(RSS). The last line is one JSON object with the memory growth over the second half of the
requests and the largest cache seen.

    nice -n 10 python benchmarks/service_soak.py --requests 2000 --clients 8 \
        --photos ../shared/data/flickr8k/images -- --beam-size 1 --cache-mb 50

Photos: the JPEGs of ``--photos`` (read in place, sorted by name), or ``--generate``: distinct
synthetic 480-pixel photos written to a temporary folder. Arguments after ``--`` go to
`sat serve` (e.g. ``--cache-mb``, ``--model``, decoding options).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# run as a script: benchmarks/ is on the path
from service_latency import free_port, start_sat_serve

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PHOTOS = ROOT.parent / "shared/data/flickr8k/images"


def generate_photos(folder: Path, n: int, size: int = 480, seed: int = 0) -> list[Path]:
    """``n`` different photos: smooth random colour fields with shapes and noise, as JPEGs of
    about the size of a resized phone photo (a few tens of KB)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        base = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((size, size * 3 // 4), Image.Resampling.BICUBIC)
        draw = ImageDraw.Draw(img)
        for _ in range(3):
            x, y = rng.integers(0, size, 2)
            r = int(rng.integers(20, 120))
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.integers(0, 255, 3)))
        noise = rng.normal(0, 12, (img.height, img.width, 3))
        arr = np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8)
        path = folder / f"soak_{i:05d}.jpg"
        Image.fromarray(arr).save(path, quality=88)
        paths.append(path)
    return paths


def start_server(port: int, cache: Path, serve_args: list[str]):
    """`sat serve` in a subprocess with its own Gradio cache; returns once its API answers."""
    return start_sat_serve(
        port,
        ["--device", "cpu", "--examples", *serve_args],
        env={"GRADIO_TEMP_DIR": str(cache)},
        timeout=600.0,
    )


def cache_usage(cache: Path) -> tuple[int, int]:
    """(files, bytes) under the server's Gradio cache folder."""
    files = size = 0
    for dirpath, _, names in os.walk(cache):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except FileNotFoundError:  # removed while we looked
                pass
    return files, size


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def warm_up(url: str, photo: Path) -> None:
    """One request before the clock starts: the first batch's allocations are not the soak."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, httpx_kwargs={"timeout": 300})
    client.predict(handle_file(str(photo)), api_name="/caption")


class Soak:
    """Clients that share one list of photos, each sending the next one until all are sent."""

    def __init__(self, url: str, photos: list[Path], clients: int):
        self.url, self.photos, self.clients = url, photos, clients
        self.lock = threading.Lock()
        self.next = 0
        self.done = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []

    def take(self) -> Path | None:
        with self.lock:
            if self.next >= len(self.photos):
                return None
            self.next += 1
            return self.photos[self.next - 1]

    def client(self) -> None:
        from gradio_client import Client, handle_file

        # a generous HTTP timeout: a soak measures the server, not httpx's 5-second default on a
        # machine whose cores the server keeps busy
        client = Client(self.url, verbose=False, httpx_kwargs={"timeout": 300})
        while (photo := self.take()) is not None:
            t = time.perf_counter()
            try:
                result = client.predict(handle_file(str(photo)), api_name="/caption")
                ok = bool(result.get("words"))
            except Exception as e:  # counted and reported, the soak goes on
                ok, result = False, str(e)
            with self.lock:
                self.done += 1
                self.latencies.append(time.perf_counter() - t)
                if not ok:
                    self.errors.append(f"{photo.name}: {result}")

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.client, daemon=True) for _ in range(self.clients)]
        for t in threads:
            t.start()
        return threads


def watch(soak: Soak, pid: int, cache: Path, every: int) -> list[dict]:
    """Sample cache and memory every ``every`` answers until all are in; print each sample."""
    samples: list[dict] = []
    t0 = time.perf_counter()
    print(
        f"{'answers':>8} {'cache files':>11} {'cache MB':>9} {'RSS MB':>8} {'req/s':>6}", flush=True
    )
    mark = 0
    while True:
        with soak.lock:
            done = soak.done
        if done >= mark + every or done == len(soak.photos):
            mark = done - done % every if done < len(soak.photos) else done
            files, size = cache_usage(cache)
            s = {
                "answers": done,
                "cache_files": files,
                "cache_mb": round(size / 2**20, 2),
                "rss_mb": round(rss_mb(pid), 1),
                "req_per_s": round(done / (time.perf_counter() - t0), 2),
            }
            samples.append(s)
            print(
                f"{done:8d} {files:11d} {s['cache_mb']:9.2f} {s['rss_mb']:8.1f} "
                f"{s['req_per_s']:6.2f}",
                flush=True,
            )
            if done == len(soak.photos):
                return samples
        time.sleep(0.2)


def at(samples: list[dict], answers: int) -> dict:
    """The first sample taken at or after ``answers`` answers."""
    return next(s for s in samples if s["answers"] >= answers)


def report(args: argparse.Namespace, samples: list[dict], soak: Soak) -> dict:
    n = len(soak.photos)
    half, end = at(samples, n // 2), samples[-1]
    second = [s["rss_mb"] for s in samples if s["answers"] >= half["answers"]]
    lat = np.array(soak.latencies)
    return {
        "requests": n,
        "clients": args.clients,
        "errors": len(soak.errors),
        "serve_args": args.serve_args,
        "photos": str(args.photos or "generated"),
        "rss_mb_at_half": half["rss_mb"],
        "rss_mb_at_end": end["rss_mb"],
        "rss_growth_second_half_mb": round(end["rss_mb"] - half["rss_mb"], 1),
        "rss_mb_max_second_half": max(second),
        "rss_mb_max_minus_half": round(max(second) - half["rss_mb"], 1),
        "cache_mb_max": max(s["cache_mb"] for s in samples),
        "cache_files_max": max(s["cache_files"] for s in samples),
        "cache_mb_at_end": end["cache_mb"],
        "p50_s": round(float(np.median(lat)), 3),
        "req_per_s": end["req_per_s"],
        "cpus": os.cpu_count(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="unique photos to send")
    p.add_argument("--clients", type=int, default=8, help="clients sending at once")
    p.add_argument("--every", type=int, default=100, help="print a sample every N answers")
    p.add_argument(
        "--photos",
        type=Path,
        default=None,
        help=f"folder of JPEG photos (default {DEFAULT_PHOTOS} when it exists)",
    )
    p.add_argument("--generate", action="store_true", help="send generated photos instead")
    p.add_argument("serve_args", nargs="*", help="after --: options for `sat serve`")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sat-soak-"))
    try:
        if not args.generate and args.photos is None and DEFAULT_PHOTOS.is_dir():
            args.photos = DEFAULT_PHOTOS
        if args.generate or args.photos is None:
            photos = generate_photos(work / "photos", args.requests)
        else:
            photos = sorted(args.photos.glob("*.jpg"))[: args.requests]
        if len(photos) < args.requests:
            raise SystemExit(f"{args.photos} has {len(photos)} photos, fewer than --requests")
        port = free_port()
        proc = start_server(port, work / "cache", args.serve_args)
        try:
            url = f"http://127.0.0.1:{port}/"
            warm_up(url, photos[0])
            soak = Soak(url, photos, args.clients)
            threads = soak.start()
            samples = watch(soak, proc.pid, work / "cache", args.every)
            for t in threads:
                t.join()
        finally:
            proc.terminate()
            proc.wait(60)
        for e in soak.errors[:5]:
            print(f"error: {e}", file=sys.stderr)
        print(json.dumps(report(args, samples, soak)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
