"""`POST /v1/captions` against Gradio's `/caption` API of the same `sat serve`, with 1, 8 and 32
clients, and a direct batched `Captioner` call of the same photo for reference.

Starts one `sat serve` (the page and the HTTP API in one process, as it runs by default) in a
subprocess on 127.0.0.1, so that clients and server do not share a GIL. For each number of
clients it sends ``--requests`` requests of one photo in all, spread over the clients, first
through the HTTP API (httpx, one connection a client), then through Gradio's API
(``gradio_client``), and times each end to end, with the mean batch the server's worker
captioned meanwhile (its /metrics). Then, in this process, ``Captioner`` captions
the same photo in batches of 1, 8 and 32 (one call a batch: decoding the photo,
preprocessing, encoder, search).
Prints one line a scenario and one JSON line.

    python benchmarks/http_api.py --requests 32 --clients 1 8 32 -- --beam-size 3 --rerank none
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from service_latency import DEFAULT_IMAGE, free_port, start_sat_serve, summary


class HttpClient:
    """One client of POST /v1/captions (httpx, one connection)."""

    def __init__(self, url: str, image: Path):
        self.client = httpx.Client(base_url=url, timeout=600)
        self.data = image.read_bytes()

    def request(self) -> None:
        response = self.client.post("/v1/captions", files=[("images", ("photo.jpg", self.data))])
        assert response.status_code == 200, response.text
        assert response.json()["records"][0]["words"]


class GradioClient:
    """One client of Gradio's /caption (gradio_client; made before the timing starts, as it
    fetches the app's configuration first)."""

    def __init__(self, url: str, image: Path):
        from gradio_client import Client, handle_file

        self.client = Client(url + "/", verbose=False, httpx_kwargs={"timeout": 600})
        self.file = handle_file(str(image))

    def request(self) -> None:
        result = self.client.predict(self.file, api_name="/caption")
        assert result["words"], result


def concurrent(make, url: str, image: Path, requests: int, clients: int) -> dict[str, float]:
    """``requests`` requests spread over ``clients`` threads, each with its own client, made
    before the clock starts; failed requests are counted, not timed."""
    per_client = max(1, requests // clients)
    made = [make(url, image) for _ in range(clients)]
    latencies: list[float] = []
    failures: list[str] = []
    start = threading.Barrier(clients + 1)

    def run(client) -> None:
        start.wait()
        for _ in range(per_client):
            t = time.perf_counter()
            try:
                client.request()
            except Exception as e:  # a timeout under load: reported, not hidden
                failures.append(f"{type(e).__name__}: {e}"[:200])
                continue
            latencies.append(time.perf_counter() - t)

    threads = [threading.Thread(target=run, args=(c,)) for c in made]
    for th in threads:
        th.start()
    start.wait()
    t = time.perf_counter()
    for th in threads:
        th.join()
    result = summary(latencies, time.perf_counter() - t) if latencies else {"n": 0}
    result["failed"] = len(failures)
    if failures:
        result["first_failure"] = failures[0]
    return result


def batches(url: str) -> tuple[float, float]:
    """(photos, batches) the server's worker has captioned so far, off its /metrics."""
    lines = httpx.get(url + "/metrics", timeout=60).text.splitlines()
    value = {k: v for k, _, v in (line.partition(" ") for line in lines if line.startswith("sat_"))}
    return float(value["sat_batch_size_sum"]), float(value["sat_batch_size_count"])


def direct(model: str | None, device: str, image: str, sizes: list[int], repeats: int, decoding):
    """One ``Captioner.caption`` call (decoding the photo, preprocessing, encoder, search) per
    batch of the same photo, ``repeats`` times per size."""
    from showattendtell.captioning.captioner import load_model
    from showattendtell.captioning.catalog import default_model_path

    captioner = load_model(model or default_model_path(), device)
    captioner.decoding = captioner.check_decoding(**decoding)
    results = {}
    for size in sizes:
        captioner.caption([image] * size)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            captioner.caption([image] * size)
            times.append(time.perf_counter() - t)
        a = np.array(times)
        results[f"batch_{size}"] = {
            "n": repeats,
            "p50_s": round(float(np.percentile(a, 50)), 3),
            "p95_s": round(float(np.percentile(a, 95)), 3),
            "photos_per_s": round(size * repeats / float(a.sum()), 2),
        }
    return results


def decoding_of(serve_args: list[str]) -> dict:
    """The decoding options among `sat serve`'s arguments, for the direct call."""
    from showattendtell.cli.common import add_decoding_args, decoding_overrides

    p = argparse.ArgumentParser()
    add_decoding_args(p)
    known, _ = p.parse_known_args(serve_args)
    return {k: v for k, v in decoding_overrides(known).items() if v is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model file or name (default: sat serve's default)")
    p.add_argument("--image", default=str(DEFAULT_IMAGE))
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=32, help="requests per scenario")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=4, help="direct calls per batch size (0: none)")
    p.add_argument(
        "--apis",
        nargs="+",
        choices=("http", "gradio"),
        default=["http", "gradio"],
        help="the APIs timed (default both; the page is served either way)",
    )
    p.add_argument("serve_args", nargs="*", help="more `sat serve` options, after --")
    args = p.parse_args()
    import torch

    report: dict = {
        "model": args.model,
        "image": args.image,
        "serve_args": args.serve_args,
        "cpus": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "runs": {},
    }
    image = Path(args.image)
    if not image.is_file():  # before the server: a wrong path fails at once
        raise SystemExit(f"--image {image}: no such file")
    port = free_port()
    serve = ["--device", args.device, "--examples", *args.serve_args]
    proc = start_sat_serve(port, [*serve, "--model", args.model] if args.model else serve)
    url = f"http://127.0.0.1:{port}"
    try:
        apis = [
            (n, m) for n, m in (("http", HttpClient), ("gradio", GradioClient)) if n in args.apis
        ]
        for _, make in apis:  # warm-up: first-call allocations
            warm = make(url, image)
            warm.request()
            warm.request()
        for clients in args.clients:
            for name, make in apis:
                before = batches(url)
                run = concurrent(make, url, image, args.requests, clients)
                after = batches(url)
                made = after[1] - before[1]
                run["mean_batch"] = round((after[0] - before[0]) / made, 2) if made else None
                report["runs"][f"{name}_{clients}"] = run
                print(f"{name}_{clients}", json.dumps(run), flush=True)  # as it goes
    finally:
        proc.terminate()
        proc.wait(60)
    report["direct"] = (
        direct(args.model, args.device, str(image), args.clients, args.repeats, decoding_of(serve))
        if args.repeats
        else {}
    )
    report["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    for name, s in report["runs"].items():
        if not s["n"]:
            print(f"{name:10s} every request failed: {s.get('first_failure')}")
            continue
        print(
            f"{name:10s} p50 {s['p50_s']:.3f}s  p95 {s['p95_s']:.3f}s  "
            f"{s['throughput_per_s']:.2f} req/s  mean batch {s['mean_batch']}  "
            f"(n={s['n']}, failed {s['failed']})"
        )
    for name, s in report["direct"].items():
        print(
            f"direct {name:9s} p50 {s['p50_s']:.3f}s  p95 {s['p95_s']:.3f}s  "
            f"{s['photos_per_s']:.2f} photos/s  (n={s['n']})"
        )
    print(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # service_latency's helpers
    main()
