"""`sat caption --devices N`: several processes (Lightning's launcher, gloo on CPU) caption 60 real
photos into one output file, the same as one process writes; a kill -9 of any or all of them,
or a Ctrl-C, then --resume, gives every photo exactly once, in input order."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from helpers.data import ROOT, SHARED
from helpers.photos import link_photos
from helpers.processes import start_sat, wait_for_records

from showattendtell.captioning.distributed import share_batches
from showattendtell.cli.main import main

TRAIN_MINI = SHARED / "data" / "coco2017_train_mini" / "images"
N = 60
needs_train_mini = pytest.mark.skipif(
    len(list(TRAIN_MINI.glob("*.jpg"))) < N,
    reason=f"{N} real COCO photos not found in {TRAIN_MINI} (see data/README.md)",
)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """A folder of links to 60 real COCO train2017 photos (read in place)."""
    return link_photos(
        tmp_path_factory.mktemp("dist") / "photos", sorted(TRAIN_MINI.glob("*.jpg"))[:N]
    )


def sat_caption(args: list[str], cwd: Path, mark: str = "", **popen) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
        "SAT_TEST_MARK": mark,
    }
    return start_sat(["caption", *args], cwd, env=env, **popen)


def finished(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def records(path: Path) -> list[dict]:
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(path.read_text())))
    return [json.loads(line) for line in path.read_text().splitlines()]


def same_captions(got: list[dict], want: list[dict]) -> None:
    assert [r["path"] for r in got] == [r["path"] for r in want]  # order and each exactly once
    assert [r["caption"] for r in got] == [r["caption"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert float(a["score"]) == pytest.approx(float(b["score"]), abs=1e-3)


@pytest.fixture(scope="module")
def one_process(photos) -> list[dict]:
    """The reference: one process, batches of 4."""
    code, err = finished(
        sat_caption(["photos", "-o", "one.jsonl", "--batch-size", "4"], photos.parent)
    )
    assert code == 0, err
    return records(photos.parent / "one.jsonl")


@needs_train_mini
@pytest.mark.slow
def test_two_processes_write_what_one_writes(photos, one_process):
    code, err = finished(
        sat_caption(
            ["photos", "-o", "two.jsonl", "--batch-size", "4", "--devices", "2"], photos.parent
        )
    )
    assert code == 0, err
    assert f"{N}/{N} images" in err  # progress counts the photos of both processes
    assert f"captioned {N}; failed 0" in err
    same_captions(records(photos.parent / "two.jsonl"), one_process)


def processes(mark: str) -> dict[int, tuple[int, str | None]]:
    """pid -> (parent pid, LOCAL_RANK or None) of every live process of one test run."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if f"SAT_TEST_MARK={mark}".encode() not in env or ") Z " in stat:
            continue
        rank = next((v.split(b"=")[1].decode() for v in env if v.startswith(b"LOCAL_RANK=")), None)
        found[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), rank)
    return found


def rank_pid(mark: str, rank: int) -> int:
    """The pid of captioning process ``rank`` (not one of its image-decoding workers)."""
    procs = processes(mark)
    for pid, (ppid, local_rank) in procs.items():
        parent = procs.get(ppid)
        if rank == 0 and local_rank is None and parent is None:
            return pid
        if rank > 0 and local_rank == str(rank) and parent is not None and parent[1] is None:
            return pid
    raise AssertionError(f"no process of rank {rank} in {procs}")


def stop_midway(args: list[str], cwd: Path, out: Path, stop: str, kept: int, want) -> int:
    """`sat caption ARGS`, stopped by ``stop`` once ``out`` holds 8 records more than ``kept``:
    every process ends, and what is left is a prefix of ``want``. Returns its length."""
    mark = uuid.uuid4().hex
    proc = sat_caption(args, cwd, mark, start_new_session=True)
    wait_for_records(out, kept + 8, proc, timeout=240)
    if stop == "kill all":
        os.killpg(proc.pid, signal.SIGKILL)
    elif stop == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole group
    else:
        os.kill(rank_pid(mark, int(stop[-1])), signal.SIGKILL)
    code, err = finished(proc, 60)
    deadline = time.monotonic() + 60  # the other processes notice and stop
    while processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes(mark), "a captioning process outlived the run"
    if stop == "ctrl-c":
        assert code == 130 and "interrupted" in err and "--resume" in err, err
    else:
        assert code != 0
    partial = records(out)
    assert kept + 8 <= len(partial) < N
    same_captions(partial, want[: len(partial)])  # a prefix, in input order
    return len(partial)


@needs_train_mini
@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "then"), [("kill rank 1", "kill rank 0"), ("ctrl-c", "kill all")]
)
def test_stopped_resumed_stopped_again_and_resumed(photos, one_process, first, then):
    """Each way a run stops (a kill -9 of either process or of all, Ctrl-C), once in a first
    run and once in a resumed one; the last --resume gives every photo once, in input order.
    Batches of one photo keep the runs slow enough to stop midway."""
    fmt = "csv" if first == "kill rank 1" else "jsonl"
    out = photos.parent / f"stopped-{first.replace(' ', '-')}.{fmt}"
    args = ["photos", "-o", out.name, "--batch-size", "1", "--devices", "2"]
    kept = stop_midway(args, photos.parent, out, first, 0, one_process)
    kept = stop_midway([*args, "--resume"], photos.parent, out, then, kept, one_process)
    code, err = finished(sat_caption([*args, "--resume"], photos.parent))
    assert code == 0, err
    assert f"skipped {kept} already in" in err
    same_captions(records(out), one_process)


def test_batches_are_shared_out_once_in_order():
    for n, size, world in [(60, 4, 2), (61, 4, 3), (5, 16, 4), (1, 1, 2)]:
        batches, _ = share_batches(n, size, 0, world)
        mine = [share_batches(n, size, r, world)[1] for r in range(world)]
        assert sorted(g for m in mine for g in m) == list(range(len(batches)))
        assert [i for b in batches for i in b] == list(range(n))
        # step s of every process holds batches s*world .. s*world + world - 1
        for r, m in enumerate(mine):
            assert all(g % world == r for g in m)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "--devices and --num-nodes must be at least 1"),
        (["--devices", "2", "--device", "cuda:1"], "names one device"),
    ],
)
def test_usage_errors(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "a.jpg").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert main(["caption", "a.jpg", *argv]) == 2
    assert message in capsys.readouterr().err
