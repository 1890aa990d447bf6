"""benchmarks/gpu_report.py, the one command for a GPU machine, runs end to end on a CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_report import PARTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_report_runs_every_part_on_a_cpu():
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_report.py",
            "--device",
            "cpu",
            "--quick",
            "--parts",
            *PARTS,
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["agreement"] == {"images": 2, "same_greedy": 2, "same_stored": 2}
    for part in (*report["captioning"].values(), *report["training"].values()):
        assert "error" not in part, part
    assert report["captioning"]["32_batch4"]["images_per_s_beam3"] > 0
    assert report["training"]["fp32_batch4"]["speedup_vs_peer"] > 0
    profile = report["training"]["fp32_batch4"]["profile"]  # the step's operators, by time
    assert profile["count_per_step"] > 0 and any("addmm" in name for name, *_ in profile["top"])
    assert report["decoding"]["one_core_images_per_s"] > 0
    assert report["startup"]["median_s"] > 0
    assert report["sat_train"]["exit"] == 0, report["sat_train"]
    assert report["bulk"]["greedy"]["captioned"] == 8, report["bulk"]  # all photos, timed
    assert report["bulk"]["greedy"]["first_caption_s"] > 0
    served = report["service"]  # `sat serve --api-only` under load, one client in the smoke test
    assert "error" not in served, served
    assert served["clients_1"]["requests"] == 4 and served["clients_1"]["p95_ms"] > 0
    assert (served["max_batch"], served["concurrency"]) == (8, 8)  # the CPU's defaults
    assert served["clients_1"]["mean_batch"] == 1.0  # one client: one photo a batch


def test_train_benchmark_asks_to_be_run_as_a_module():
    """Its peer lives with the tests' oracles: run as a script, one clear line."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: run this benchmark from the repository root as "
        "python -m benchmarks.train_throughput"
    ]


def test_bulk_run_is_not_blocked_by_what_it_writes_to_stderr(tmp_path):
    """`sat caption` warns once per unfamiliar photo; 10,000 warnings overflow a pipe."""
    from benchmarks.gpu_report import timed_bulk_run

    out = tmp_path / "out.jsonl"
    script = (
        "import sys, time; sys.stderr.write('warning\\n' * 100_000); sys.stderr.flush(); "
        f"f = open({str(out)!r}, 'w'); f.write('a\\n'); f.flush(); time.sleep(0.3); "
        "f.write('b\\nc\\n')"
    )
    result = timed_bulk_run([sys.executable, "-c", script], out, limit_s=60)
    assert result["exit"] == 0 and result["captioned"] == 3, result
    assert result["first_caption_s"] < result["seconds"]


def test_a_bulk_run_says_which_of_its_processes_were_busy(tmp_path):
    """Once running, the CPU used by the main process and by the others it started (the
    decoding processes): here a main process that spins and one child that sleeps."""
    from benchmarks.gpu_report import timed_bulk_run

    out = tmp_path / "out.jsonl"
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        f"f = open({str(out)!r}, 'w'); f.write('a\\n'); f.flush(); "
        "end = time.monotonic() + 1.5\n"
        "while time.monotonic() < end: pass\n"
        "f.write('b\\n'); f.close(); child.kill()"
    )
    result = timed_bulk_run([sys.executable, "-c", script], out, limit_s=60)
    assert result["exit"] == 0 and result["captioned"] == 2, result
    assert result["decoding_processes"] == 1, result
    assert result["main_cpu_percent"] > result["decoding_cpu_percent"] >= 0, result


def test_a_bulk_run_stopped_before_its_first_caption_says_so(tmp_path):
    """A limit shorter than the start-up stops the run with nothing to measure: the result says
    that, with the run's last words, instead of a silent rate of nothing."""
    from benchmarks.gpu_report import timed_bulk_run

    out = tmp_path / "out.jsonl"
    script = (
        "import sys, time; print('loading the model', file=sys.stderr, flush=True); time.sleep(30)"
    )
    result = timed_bulk_run([sys.executable, "-c", script], out, limit_s=1.5)
    assert result["captioned"] == 0 and result["stopped_after_s"] == 1.5, result
    assert result["error"] == ["no caption within 1.5 s", "loading the model"]
    assert "images_per_s_running" not in result


def test_the_report_s_processes_keep_a_bytecode_cache_of_their_own(monkeypatch):
    """Where Python writes no bytecode, each process the report starts would compile its
    imports: inside ``bytecode_cache`` they write it to a folder of the report's, and the
    environment is as it was afterwards."""
    import os

    from benchmarks.gpu_report import bytecode_cache

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    with bytecode_cache():
        cache = os.environ["PYTHONPYCACHEPREFIX"]
        assert "PYTHONDONTWRITEBYTECODE" not in os.environ
        probe = "import sys; print(sys.dont_write_bytecode, sys.pycache_prefix)"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert out.stdout.split() == ["False", cache]
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1" and "PYTHONPYCACHEPREFIX" not in os.environ
    assert not Path(cache).exists()  # removed with the report


def test_the_gpu_busy_time_counts_overlapping_kernels_once():
    """A step's profile gives the time the GPU is busy: kernels on two streams that overlap
    count once, a gap between kernels not at all."""
    from benchmarks.train_throughput import _union_us

    assert _union_us([(5, 6), (0, 2), (1, 3), (1.5, 2.5)]) == 4
    assert _union_us([]) == 0
