"""One command for what a GPU gives: captions checked against the CPU's, captioning, image
decoding, start-up and training timed, printed as one JSON line.

    python benchmarks/gpu_report.py --device cuda --images FOLDER

Needs only torch and the project (installed, as for `sat`), no network: it uses the bundled
model, the photos in FOLDER (default: the service's example photos) and synthetic training
batches. Parts, each also a field of the JSON line:

- ``agreement``: the float32 captions on the device against the CPU's (greedy, and the model's
  stored decoding), per photo; on CUDA also the pipeline's greedy captions with JPEGs decoded
  on the GPU against those decoded on the CPU;
- ``captioning``: benchmarks/caption_throughput.py in float32 and bf16 at batch 32 and 128:
  greedy, beam 3 and the encoder alone, images/s;
- ``decoding``: the image-decoding stage alone (files to resized tensors, no model), images/s
  on one core and in the pipeline's worker processes; on CUDA also batched
  ``torchvision.io.decode_jpeg(device="cuda")`` of the JPEGs, for comparison;
- ``startup``: `sat caption PHOTO` from the command to the printed caption, seconds; on CUDA
  also with ``--device cuda`` (``--device auto`` captions a few photos on the CPU);
- ``training``: benchmarks/train_throughput.py (ours and the peer) in float32 and bf16 at batch
  64 and 256, tokens/s, with a profile of the batch-64 steps (``--profile``: the kernels a step
  runs and how long the GPU is busy in it); and float32 at batch 64 without the step's Triton
  kernels (``--step autograd``), which shows what they give;
- ``sat_train``: a short `sat train` of configs/tiny.yaml on the photos (captioned by the model)
  with ``--trainer.accelerator gpu --trainer.precision bf16-mixed`` on CUDA, seconds;
- ``bulk``: `sat caption FOLDER -o FILE` over ``--bulk`` photos (the given ones, hard-linked
  over and over into a temporary folder), bf16 on CUDA, batch 128: greedy, beam 3 and the
  model's stored decoding (beam 5, consensus reranking) with JPEGs decoded on the CPU (the
  default), greedy and beam 3 with them decoded on the GPU (``--decode-on gpu``): seconds to
  the first caption and images/s once running (read off the output file as it grows), and
  the CPU the main process and the decoding processes used meanwhile (percent of one core).

- ``service``: `sat serve --api-only` (the HTTP API without Gradio, which the GPU machine lacks)
  in a subprocess on 127.0.0.1, bf16 on CUDA, beam 3: ``POST /v1/captions`` of one photo a
  request from 1, 16 and 64 concurrent clients for ``--service-s`` seconds each after a warm-up:
  captions/s, the p50 / p95 latency, milliseconds, and the mean batch the worker captioned;
  with the limits the device gave the server (``max_batch``, ``concurrency``: 64 on CUDA).

``--quick`` makes every part as small as it gets (the test suite's smoke test on a CPU).
``--output FILE`` rewrites FILE with the report so far after each part (a run cut short keeps
what it measured). ``--parts`` runs only the named parts; by default all but ``bulk``, whose
five runs take up to five times ``--bulk-limit-s`` (45 s each: the rate once running is
measured by then): the default parts other than ``service`` took about 6.5 minutes on an H100
(benchmarks/README.md); ``service`` adds the server's start and three times ``--service-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGES = ROOT / "service" / "examples"


def run_json(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run a benchmark from the repository root and parse its last line (one JSON object);
    a failure is reported in the result instead of stopping the report."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def agreement(paths: list[str], device: str, limit: int) -> dict[str, Any]:
    """How many photos get the same float32 caption on ``device`` as on the CPU."""
    from showattendtell.captioning.captioner import load_model

    photos = paths[:limit]
    cpu, dev = load_model(None, "cpu"), load_model(None, device)
    out: dict[str, Any] = {"images": len(photos)}
    for name, options in (("greedy", {"beam_size": 1}), ("stored", {})):
        same = sum(
            a.caption == b.caption
            for a, b in zip(
                caption_all(cpu, photos, options), caption_all(dev, photos, options), strict=True
            )
        )
        out[f"same_{name}"] = same
    if device.startswith("cuda"):  # the pipeline with JPEGs decoded by nvJPEG, greedy
        from showattendtell.captioning.pipeline import caption_files

        greedy = dev.check_decoding(beam_size=1)
        runs = [
            [r.result.caption if r.result else r.error
             for r in caption_files(dev, photos, 32, 4, jpeg_on_device=flag, decoding=greedy)]
            for flag in (False, True)
        ]  # fmt: skip
        out["same_greedy_decode_on_gpu"] = sum(a == b for a, b in zip(*runs, strict=True))
    return out


def caption_all(captioner, paths: list[str], options: dict, batch: int = 32) -> list:
    return [
        r
        for i in range(0, len(paths), batch)
        for r in captioner.caption(paths[i : i + batch], **options)
    ]


def decoding(paths: list[str], device: str, input_size: int, quick: bool) -> dict[str, Any]:
    """The image-decoding stage alone: files to resized uint8 tensors, images/s, on one core
    and in the pipeline's worker processes (one per core but one, batches of 128), each doing
    what a worker does (``jpeg_device.load_jpeg``); and the handing over of JPEGs' bytes
    alone, as for ``--decode-on gpu`` (``jpeg_bytes_``). With each rate, the main process's
    CPU time a photo: receiving the batches is its share of the work.

    The workers' rate is timed once every worker has handed over its first batch (batch i
    goes to worker i mod W): a long run's rate, not the processes' start, which
    ``first_round_s`` gives apart."""

    import torch

    from showattendtell.images.jpeg_device import load_jpeg

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a worker process
    load_jpeg(paths[0], input_size)  # imports and first-call costs, as a worker's start
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        load_jpeg(p, input_size, i)
    out: dict[str, Any] = {
        "one_core_images_per_s": round(len(paths) / (time.perf_counter() - t0), 1)
    }
    torch.set_num_threads(threads)
    workers = 0 if quick else max(1, (os.cpu_count() or 1) - 1)
    out["workers"] = workers
    for prefix, on_device in (("", False), ("jpeg_bytes_", True)):
        rates = _loader_rate(paths, input_size, workers, quick, on_device)
        out.update({prefix + k: v for k, v in rates.items()})
    if device.startswith("cuda"):
        out["nvjpeg_batched_images_per_s"] = nvjpeg_rate(paths, input_size)
    return out


def _loader_rate(
    paths: list[str], input_size: int, workers: int, quick: bool, jpeg_on_device: bool
) -> dict[str, Any]:
    """``load_batches`` over the photos repeated: images/s and main-process CPU ms a photo
    once every worker has delivered a batch; the seconds until then."""
    import resource

    from showattendtell.images.batches import load_batches

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    batch = 4 if quick else 128
    warm, timed = max(workers, 1), (2 if quick else 3) * max(workers, 1)  # batches
    many = (paths * (-(-(warm + timed) * batch // len(paths))))[: (warm + timed) * batch]
    t0 = time.perf_counter()
    batches = load_batches(many, input_size, batch, workers, jpeg_on_device=jpeg_on_device)
    for _ in range(warm):  # every worker started and delivered once
        next(batches).decoded()
    t1, c1 = time.perf_counter(), cpu()
    n = sum(len(b.items) for b in batches)
    seconds = time.perf_counter() - t1
    return {
        "images_per_s": round(n / seconds, 1),
        "main_cpu_ms_per_image": round((cpu() - c1) / n * 1e3, 3),
        "first_round_s": round(t1 - t0, 2),
        "images_timed": n,
    }


def nvjpeg_rate(paths: list[str], input_size: int) -> float | str:
    """Batched GPU JPEG decoding and resizing of the JPEG files (EXIF orientation not applied:
    a measure of the decoder's rate, not a replacement of the pipeline's)."""
    import torch
    import torch.nn.functional as F
    from torchvision.io import decode_jpeg

    jpegs = [p for p in paths if p.lower().endswith((".jpg", ".jpeg"))]
    if not jpegs:
        return "no JPEG files"
    data = [torch.frombuffer(Path(p).read_bytes(), dtype=torch.uint8) for p in jpegs]

    def run() -> None:
        for i in range(0, len(data), 64):
            for img in decode_jpeg(data[i : i + 64], device="cuda"):
                F.interpolate(
                    img[None].float(),
                    size=(input_size, input_size),
                    mode="bilinear",
                    antialias=True,
                )
        torch.cuda.synchronize()

    try:
        run()  # warm-up
        t0 = time.perf_counter()
        run()
        return round(len(jpegs) / (time.perf_counter() - t0), 1)
    except RuntimeError as e:  # a JPEG nvjpeg cannot decode (CMYK, progressive on old CUDA)
        return f"error: {e}".splitlines()[0]


def startup(photo: str, device: str, runs: int, warm: bool = True) -> dict[str, Any]:
    """`sat caption PHOTO`: the command to the printed caption, seconds (median). On a GPU
    machine as a user runs it (``--device auto`` captions a few photos on the CPU) and with
    ``--device cuda`` (what starting the GPU costs). With ``warm``, each is timed after one
    untimed run, which fills the report's bytecode cache (``bytecode_cache``) where earlier
    parts did not (the smoke test, which times nothing, skips it)."""
    if not device.startswith("cuda"):
        return _startup_times(photo, ["--device", device], runs, warm)
    result = _startup_times(photo, [], runs, warm)
    if "error" not in result:
        result["cuda"] = _startup_times(photo, ["--device", device], runs, warm)
    return result


def _startup_times(photo: str, options: list[str], runs: int, warm: bool) -> dict[str, Any]:
    sat = [sys.executable, "-m", "showattendtell.cli", "caption", photo, *options]
    times = []
    for i in range(runs + warm):  # with ``warm`` the first is not timed
        t0 = time.perf_counter()
        proc = subprocess.run(sat, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if i >= warm:
            times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1:]}
    return {"median_s": round(statistics.median(times), 2), "runs_s": [round(t, 2) for t in times]}


@contextlib.contextmanager
def bytecode_cache() -> Iterator[None]:
    """Python's bytecode cached for the report's processes, in a folder of the report's own.

    Why: where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, or a read-only environment,
    as on the H100 machine), every process compiles each module it imports at its start: each
    `sat caption` 2.6 s there, and each decoding process torchvision's sources, whereas an
    installed package has its bytecode cached. The processes the report starts (benchmarks,
    `sat caption`, and their decoding processes) then time captioning, not compiling."""
    from unittest import mock

    with (
        tempfile.TemporaryDirectory(prefix="gpu_report_pycache_") as cache,
        mock.patch.dict(os.environ, {"PYTHONPYCACHEPREFIX": cache}),  # restored after
    ):
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        yield


def sat_train(paths: list[str], device: str, quick: bool) -> dict[str, Any]:
    """A short `sat train` (configs/tiny.yaml, one epoch) on a Flickr8k-format folder of the
    photos, each with the CPU's beam captions as its references."""
    from showattendtell.captioning.captioner import load_model

    photos = paths[: 8 if quick else 64]
    captioner = load_model(None, "cpu")
    refs = [
        [caption for caption, _ in r.beams] or [r.caption]
        for r in caption_all(captioner, photos, {"beam_size": 3})
    ]
    with tempfile.TemporaryDirectory(prefix="gpu_report_") as tmp:
        root = Path(tmp) / "data"
        (root / "images").mkdir(parents=True)
        names = []
        for i, p in enumerate(photos):
            names.append(f"{i:05d}{Path(p).suffix.lower()}")
            shutil.copy(p, root / "images" / names[-1])
        tokens = [
            f"{n}#{k}\t{c}" for n, cs in zip(names, refs, strict=True) for k, c in enumerate(cs[:5])
        ]
        (root / "Flickr8k.token.txt").write_text("\n".join(tokens) + "\n")
        split = len(names) * 3 // 4
        (root / "Flickr_8k.trainImages.txt").write_text("\n".join(names[:split]) + "\n")
        (root / "Flickr_8k.devImages.txt").write_text("\n".join(names[split:]) + "\n")
        (root / "Flickr_8k.testImages.txt").write_text("")
        gpu = device.startswith("cuda")
        cmd = [
            sys.executable,
            "-m",
            "showattendtell.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--data.root",
            str(root),
            "--run.dir",
            str(Path(tmp) / "run"),
            "--trainer.max_epochs",
            "1",
            "--trainer.accelerator",
            "gpu" if gpu else "cpu",
            "--trainer.precision",
            "bf16-mixed" if gpu else "32-true",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        out: dict[str, Any] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "images": len(photos),
            "exit": proc.returncode,
            "precision": "bf16-mixed" if gpu else "32-true",
        }
        if proc.returncode:
            out["error"] = proc.stderr.strip().splitlines()[-3:]
        return out


def bulk(paths: list[str], device: str, count: int, quick: bool, limit_s: float) -> dict[str, Any]:
    """`sat caption FOLDER -o FILE` over ``count`` photos: seconds from the command to the first
    caption, and images/s from then to the last (what a long run settles at). A run still going
    after ``limit_s`` is stopped and its rate taken over what it captioned."""

    gpu = device.startswith("cuda")
    out: dict[str, Any] = {"images": count, "precision": "bf16" if gpu else "32"}
    with tempfile.TemporaryDirectory(prefix="gpu_report_bulk_") as tmp:
        folder = Path(tmp) / "photos"
        folder.mkdir()
        for i in range(count):
            src = Path(paths[i % len(paths)])
            dst = folder / f"{i:06d}{src.suffix.lower()}"
            try:
                os.link(src, dst)
            except OSError:  # another file system: a copy
                shutil.copy(src, dst)
        # greedy, beam 3 and the model's stored decoding (beam 5, consensus reranking)
        runs = [("greedy", ["--beam-size", "1"]), ("beam3", ["--beam-size", "3"]), ("stored", [])]
        if quick:  # the smoke test: one run shows the part works
            runs = runs[:1]
        if gpu:  # JPEGs decoded by nvJPEG
            runs += [
                ("greedy_decode_on_gpu", ["--beam-size", "1", "--decode-on", "gpu"]),
                ("beam3_decode_on_gpu", ["--beam-size", "3", "--decode-on", "gpu"]),
            ]
        for name, extra in runs:
            cmd = [sys.executable, "-m", "showattendtell.cli", "caption", str(folder),
                   "-o", str(Path(tmp) / f"{name}.jsonl"), "--device", device,
                   "--precision", out["precision"], "--batch-size", "128", *extra]  # fmt: skip
            out[name] = timed_bulk_run(cmd, Path(tmp) / f"{name}.jsonl", limit_s)
    return out


def timed_bulk_run(cmd: list[str], output: Path, limit_s: float) -> dict[str, Any]:
    """Run ``cmd`` and watch ``output`` grow (each record is flushed as it is written)."""
    import signal

    t0 = time.perf_counter()
    # stderr to a file: a pipe nobody reads fills with the per-photo warnings and blocks the run
    log = output.with_suffix(".stderr")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    first, stopped, cpu = None, False, []  # cpu: session_cpu samples once running
    while proc.poll() is None:
        if first is None and output.exists() and output.stat().st_size > 0:
            first = (time.perf_counter() - t0, lines(output))
        if first is not None and (not cpu or time.perf_counter() - cpu[-1][0] > 0.5):
            cpu.append((time.perf_counter(), *session_cpu(proc.pid)))
        if time.perf_counter() - t0 > limit_s:
            stopped = True
            end, done = time.perf_counter() - t0, lines(output) if output.exists() else 0
            os.killpg(proc.pid, signal.SIGKILL)  # its decoding processes too
            proc.wait()
            break
        time.sleep(0.05)
    if not stopped:
        end = time.perf_counter() - t0
        done = lines(output) if output.exists() else 0
    stderr = log.read_text(errors="replace")
    result: dict[str, Any] = {"exit": proc.returncode, "seconds": round(end, 2), "captioned": done}
    if stopped:
        result["stopped_after_s"] = limit_s
    if stopped and first is None:  # a limit below the start-up time measures nothing
        result["error"] = [f"no caption within {limit_s:g} s", *stderr.strip().splitlines()[-2:]]
    elif not stopped and (proc.returncode or first is None):
        result["error"] = stderr.strip().splitlines()[-3:]
    if first is None or "error" in result:
        return result
    t_first, n_first = first
    result["first_caption_s"] = round(t_first, 2)
    if end > t_first and done > n_first:
        result["images_per_s_running"] = round((done - n_first) / (end - t_first), 1)
    result["images_per_s_overall"] = round(done / end, 1)
    if len(cpu) > 1:  # who was busy once running: the main process or the decoding ones
        (t_a, main_a, others_a, _), (t_b, main_b, others_b, n) = cpu[0], cpu[-1]
        result["main_cpu_percent"] = round(100 * (main_b - main_a) / (t_b - t_a), 1)
        result["decoding_cpu_percent"] = round(100 * (others_b - others_a) / (t_b - t_a), 1)
        result["decoding_processes"] = n
    return result


def session_cpu(pid: int) -> tuple[float, float, int]:
    """CPU seconds used so far by process ``pid`` and by the other processes of its session
    (its image-decoding processes), and how many those are; from /proc (zeros elsewhere).

    Why: a bulk rate alone does not say what holds it; a main process near 100 % is bound by
    its own work, decoding processes near 100 % each by decoding, neither by the GPU."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    main = others = 0.0
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) != pid:  # the session: the run and every process it started
            continue
        used = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if int(stat.parent.name) == pid:
            main = used
        else:
            others, n = others + used, n + 1
    return main, others, n


def lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def captioning(images: str, device: str, quick: bool) -> dict[str, Any]:
    """benchmarks/caption_throughput.py per precision and batch size (its JSON fields)."""
    out = {}
    for precision in ("32",) if quick else ("32", "bf16"):
        for batch in (4,) if quick else (32, 128):
            cmd = f"--precision {precision} --batch-size {batch} --latency-images 2 --repeats "
            cmd += "1 --limit 4" if quick else "2"
            out[f"{precision}_batch{batch}"] = run_json(
                [sys.executable, "benchmarks/caption_throughput.py", "--device",
                 device.split(":")[0], "--images", images, *cmd.split()], 900
            )  # fmt: skip
    return out


def training(device: str, quick: bool) -> dict[str, Any]:
    """benchmarks/train_throughput.py (ours and the peer) per precision and batch size."""
    sizes = "--grid 2 --feature-dim 16 --vocab 50 --embed-dim 8 --hidden-dim 8 "
    sizes += "--attention-dim 8 --reps 1 --matmul-sizes 256"
    out = {}
    for precision in ("fp32",) if quick else ("fp32", "bf16"):
        for batch in (4,) if quick else (64, 256):
            cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--device", device,
                   "--batch", str(batch), "--precision", precision]  # fmt: skip
            if batch in (4, 64):  # where the time of a step goes (kernels, the GPU's busy time)
                cmd += ["--profile", "1" if quick else "5"]
            out[f"{precision}_batch{batch}"] = run_json(cmd + (sizes.split() if quick else []), 900)
    if not quick:  # what the step's Triton kernels (gpu_kernels.py) give: the step without them
        cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--device", device,
               "--batch", "64", "--precision", "fp32", "--step", "autograd"]  # fmt: skip
        out["fp32_batch64_autograd"] = run_json(cmd, 900)
    return out


def input_size(report: dict[str, Any]) -> int:
    """The bundled model's input size: from the captioning part when it ran, else its file."""
    sizes = [c["input_size"] for c in report.get("captioning", {}).values() if "input_size" in c]
    if sizes:
        return sizes[0]
    from showattendtell.captioning.captioner import load_model

    return load_model(None, "cpu").input_size


SERVICE_CLIENTS = (1, 16, 64)


def service(paths: list[str], device: str, quick: bool, seconds: float) -> dict[str, Any]:
    """Requests/s and latency of the HTTP API served headless, as a replica behind a load
    balancer runs: one photo a request, each client sending its next request when the answer
    to the last one is in."""
    gpu = device.startswith("cuda")
    precision = "bf16" if gpu else "32"
    port = _free_port()
    cmd = [sys.executable, "-m", "showattendtell.cli", "serve", "--api-only", "--host",
           "127.0.0.1", "--port", str(port), "--device", device, "--precision", precision,
           "--beam-size", "3"]  # fmt: skip
    out: dict[str, Any] = {"precision": precision, "beam_size": 3}
    photos = [Path(p).read_bytes() for p in paths[: 2 if quick else 64]]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            t0 = time.perf_counter()
            _wait_ready(url, server, 600)
            out["ready_s"] = round(time.perf_counter() - t0, 1)
            clients = (1,) if quick else SERVICE_CLIENTS
            _load(url, photos, 2, 4)  # warm-up: the first batches of a shape are slow on a GPU
            served = _served(url)  # the limits the device's defaults gave it
            out.update(
                max_batch=int(served["sat_max_batch"]), concurrency=int(served["sat_concurrency"])
            )
            for n in clients:
                out[f"clients_{n}"] = run = _load(url, photos, n, 4 if quick else None, seconds)
                after = _served(url)
                batches = after["sat_batch_size_count"] - served["sat_batch_size_count"]
                photos_in = after["sat_batch_size_sum"] - served["sat_batch_size_sum"]
                run["mean_batch"] = round(photos_in / batches, 1) if batches else None
                served = after
        except Exception as e:  # noqa: BLE001 - say what the server said
            log.seek(0)
            out["error"] = f"{type(e).__name__}: {e}"
            out["server_log"] = log.read().decode(errors="replace").splitlines()[-5:]
        finally:
            server.terminate()  # SIGTERM: the server finishes what is in flight and exits
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVED = ("sat_max_batch", "sat_concurrency", "sat_batch_size_sum", "sat_batch_size_count")


def _served(url: str) -> dict[str, float]:
    """The server's limits and its batches so far, read off its /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith(SERVED))
    return {name: float(values.get(name, "nan")) for name in SERVED}


def _wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    import httpx  # the HTTP API's client: .gpu-payload carries it with FastAPI and uvicorn

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if server.poll() is not None:
            raise RuntimeError(f"sat serve exited with status {server.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling a server that is loading its models: nothing to wait on
    raise TimeoutError(f"sat serve not ready after {timeout_s:.0f} s")


def _load(
    url: str, photos: list[bytes], clients: int, requests: int | None, seconds: float = 0.0
) -> dict[str, Any]:
    """``clients`` threads, each with its own connection, posting photos in turn: ``requests``
    each, or as many as fit in ``seconds``. Captions/s over the whole, latency percentiles."""
    import threading

    import httpx

    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    end_at: list[float] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            start.wait()
            i = 0
            while (requests is not None and i < requests) or (
                requests is None and time.perf_counter() < end_at[0]
            ):
                photo = photos[(k + i * clients) % len(photos)]
                t = time.perf_counter()
                r = http.post("/v1/captions", files=[("images", ("photo.jpg", photo))])
                took = time.perf_counter() - t
                with lock:
                    if r.status_code == 200:
                        latencies.append(took)
                    else:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    end_at.append(t0 + seconds)
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    ms = sorted(x * 1000 for x in latencies)
    out: dict[str, Any] = {
        "requests": len(latencies),
        "captions_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(ms[len(ms) // 2], 1) if ms else None,
        "p95_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.95))], 1) if ms else None,
    }
    if failures:
        out["failures"] = len(failures)
        out["first_failure"] = failures[0]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu")
    ap.add_argument("--images", default=str(DEFAULT_IMAGES), help="a folder of photos")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="every part at its smallest: a smoke test, not a measurement",
    )
    ap.add_argument("--agreement-images", type=int, default=120)
    ap.add_argument("--bulk", type=int, default=10_000, help="photos in the bulk part")
    ap.add_argument(
        "--bulk-limit-s",
        type=float,
        default=45.0,
        help="a bulk run still going after this many seconds is stopped (its rate stands)",
    )
    ap.add_argument(
        "--service-s",
        type=float,
        default=20.0,
        help="seconds of load for each number of clients in the service part",
    )
    ap.add_argument("--output", default=None, help="also write the report here, part by part")
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=[p for p in PARTS if p != "bulk"],
        help="the parts to run (default: all but bulk)",
    )
    return ap.parse_args(argv)


PARTS = (
    "agreement",
    "captioning",
    "training",
    "startup",
    "decoding",
    "sat_train",
    "bulk",
    "service",
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from showattendtell.images.files import list_images

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA GPU; use --device cpu")
    paths = [str(p) for p in list_images([args.images])]
    if not paths:
        raise SystemExit(f"error: no images in {args.images}; pass --images FOLDER")
    q = args.quick
    dev = args.device
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "images": len(paths),
        "quick": q,
    }
    parts = {
        "agreement": lambda: agreement(paths, dev, 2 if q else args.agreement_images),
        "captioning": lambda: captioning(args.images, dev, q),
        "decoding": lambda: decoding(paths[:4] if q else paths, dev, input_size(report), q),
        "startup": lambda: startup(paths[0], dev, 1 if q else 3, warm=not q),
        "training": lambda: training(dev, q),
        "sat_train": lambda: sat_train(paths, dev, q),
        "bulk": lambda: bulk(paths, dev, 8 if q else args.bulk, q, args.bulk_limit_s),
        "service": lambda: service(paths, dev, q, args.service_s),
    }
    with contextlib.nullcontext() if q else bytecode_cache():  # a smoke test times nothing
        for name in PARTS:
            if name not in args.parts:
                continue
            t0 = time.perf_counter()
            try:
                report[name] = parts[name]()
            except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
                report[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            if args.output:
                Path(args.output).write_text(json.dumps(report) + "\n")
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
