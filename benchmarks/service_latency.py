"""Latency of `sat serve` for one image through Gradio's API: alone, and under concurrent clients.

Starts `sat serve` in a subprocess (so clients and server do not share a GIL) on 127.0.0.1, then
times ``Client.predict(image, api_name="/caption")`` end to end (upload, queue, captioning,
JSON back): first N requests one after another from one client, then the same from
``--clients`` clients at once. Prints p50/p95/mean per scenario and one JSON line.

    python benchmarks/service_latency.py --model models/flickr8k_lite2_soft.safetensors \
        --device cpu --requests 16 --clients 8 --max-batch 8 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE = ROOT.parent / "shared/data/coco2017_val_subset/images/000000000139.jpg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_api(proc: subprocess.Popen, url: str, log: IO[str], timeout: float) -> None:
    """Return once the Gradio API at ``url`` answers; exit with the end of the server's ``log``
    if ``proc`` (the server) stops first, or say so if it does not answer within ``timeout`` s."""
    from gradio_client import Client

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"sat serve exited:\n{log.read()[-3000:]}")
        try:
            Client(url, verbose=False)
            return
        except Exception:  # not listening yet, or the app not built yet
            time.sleep(1)
    proc.kill()
    raise SystemExit("sat serve did not start in time")


def start_sat_serve(
    port: int, serve_args: list[str], env: dict[str, str] | None = None, timeout: float = 300.0
) -> subprocess.Popen:
    """`sat serve --port PORT SERVE_ARGS` in a subprocess (so that clients and server do not share
    a GIL), ``env`` added to this environment; returns once its API answers. Its output goes to a
    temporary file, read back if it stops: a pipe nobody reads would block a chatty server."""
    cmd = [sys.executable, "-m", "showattendtell.cli", "serve", "--port", str(port), *serve_args]
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (outlives this function: the server's log)
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})},
    )
    wait_for_api(proc, f"http://127.0.0.1:{port}/", log, timeout)
    return proc


def start_server(model: str | None, device: str, max_batch: int, port: int) -> subprocess.Popen:
    """`sat serve` with this benchmark's options; returns once its API answers."""
    args = ["--device", device, "--max-batch", str(max_batch), "--concurrency", "8", "--examples"]
    return start_sat_serve(port, [*args, "--model", model] if model else args)


def write_stand_in(path: Path) -> Path:
    """A model with the flickr8k_soft architecture (ResNet-50 at 224 px, 7x7 grid, 512/1024/512
    decoder, Flickr8k-sized vocabulary) and untrained weights, for timing before a trained model
    exists. Untrained captions run to max_length (20 words), so decoding is a worst case."""
    from showattendtell.model import CaptionModel, DecodingConfig
    from showattendtell.model_file import save_model
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.network.vocab import SPECIALS, Vocabulary

    vocab = Vocabulary([*SPECIALS, *(f"w{i}" for i in range(2900))])
    enc = EncoderConfig(backbone="resnet50", weights=None, caffe_style=True, input_size=224)
    model = CaptionModel(vocab, enc, DecoderConfig("soft", 512, 1024, 512, 0.5))
    return save_model(model.eval(), path, DecodingConfig(beam_size=3, max_length=20))


def timed_requests(url: str, image: str, n: int, out: list[float]) -> None:
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False)
    for _ in range(n):
        t = time.perf_counter()
        result = client.predict(handle_file(image), api_name="/caption")
        out.append(time.perf_counter() - t)
        assert result["words"], result


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    a = np.array(latencies)
    return {
        "n": len(a),
        "p50_s": round(float(np.percentile(a, 50)), 3),
        "p95_s": round(float(np.percentile(a, 95)), 3),
        "mean_s": round(float(a.mean()), 3),
        "throughput_per_s": round(len(a) / wall, 2),
    }


def measure(url: str, image: str, requests: int, clients: int) -> dict[str, dict]:
    timed_requests(url, image, 2, [])  # warm-up: first-call allocations, connection set-up
    alone: list[float] = []
    t = time.perf_counter()
    timed_requests(url, image, requests, alone)
    res = {"alone": summary(alone, time.perf_counter() - t)}
    together: list[float] = []
    per_client = max(1, requests // clients)
    threads = [
        threading.Thread(target=timed_requests, args=(url, image, per_client, together))
        for _ in range(clients)
    ]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    res[f"{clients}_clients"] = summary(together, time.perf_counter() - t)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model file (default: sat serve's default model)")
    p.add_argument("--image", default=str(DEFAULT_IMAGE))
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=16, help="requests per scenario")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument(
        "--max-batch",
        type=int,
        nargs="+",
        default=[8],
        help="server batch limits to compare (1: no batching)",
    )
    p.add_argument("--url", help="measure a running server instead of starting one")
    p.add_argument(
        "--stand-in",
        metavar="PATH",
        help="write an untrained model with the flickr8k_soft architecture to PATH "
        "and serve it (when no trained model exists yet)",
    )
    args = p.parse_args()
    if args.stand_in:
        args.model = str(write_stand_in(Path(args.stand_in)))
    import torch

    report = {
        "model": args.model,
        "image": args.image,
        "device": args.device,
        "cpu_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "runs": {},
    }
    if args.url:
        report["runs"]["url"] = measure(args.url, args.image, args.requests, args.clients)
    for mb in [] if args.url else args.max_batch:
        port = free_port()
        proc = start_server(args.model, args.device, mb, port)
        try:
            runs = measure(f"http://127.0.0.1:{port}/", args.image, args.requests, args.clients)
        finally:
            proc.terminate()
            proc.wait(30)
        report["runs"][f"max_batch={mb}"] = runs
    for name, runs in report["runs"].items():
        for scenario, s in runs.items():
            print(
                f"{name:14s} {scenario:10s} p50 {s['p50_s']:.3f}s  p95 {s['p95_s']:.3f}s  "
                f"mean {s['mean_s']:.3f}s  {s['throughput_per_s']:.2f} req/s  (n={s['n']})"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
