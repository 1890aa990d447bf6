"""`sat caption --engine ray` and the Ray Data stages (captioning/ray_engine.py) on a local Ray
cluster of two nodes: the records are the one-process run's, field for field; a captioning actor
or a decoding task killed (SIGKILL) mid-run costs no photo and doubles none; a driver killed
mid-run leaves whole records that --resume completes; a folder of shards resumes likewise."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from helpers.data import ROOT
from helpers.disk import refuse_listing
from helpers.photos import write_photos
from helpers.processes import start_sat, wait_for_records

from showattendtell.cli.main import main

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'showattendtell[ray]'")

N = 24  # photos, plus one file that is no photo
MB = 1024**2


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of one CPU each, small object stores, no dashboard (2 cores are shared)."""
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 100 * MB, "include_dashboard": False},
    )
    c.add_node(num_cpus=1, object_store_memory=100 * MB)
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ray") / "photos"
    folder.mkdir()
    write_photos(folder, N, name="{i:02d}.png")
    (folder / "zz-bad.png").write_bytes(b"not a photo")
    return folder


@pytest.fixture(scope="module")
def one_process(photos, tiny_model_file) -> list[dict]:
    """The reference: `sat caption` in one process, batches of 4."""
    out = photos.parent / "one.jsonl"
    argv = ["caption", str(photos), "-o", str(out), "--model", str(tiny_model_file)]
    assert main([*argv, "--batch-size", "4"]) == 1  # the bad file fails
    return records(out)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sat_ray(args: list[str], model: Path, cluster) -> list[str]:
    """`sat caption ARGS` on the test cluster, in batches of 4 (main's argv)."""
    argv = ["caption", *args, "--model", str(model), "--batch-size", "4", "--engine", "ray"]
    return [*argv, "--address", cluster.address]


@pytest.mark.slow
def test_records_are_the_one_process_runs(photos, one_process, tiny_model_file, cluster, capsys):
    out = photos.parent / "ray.jsonl"
    assert main(sat_ray([str(photos), "-o", str(out)], tiny_model_file, cluster)) == 1
    assert records(out) == one_process  # field for field, in input order
    assert f"captioned {N}; failed 1" in capsys.readouterr().err


@pytest.mark.slow
def test_an_unreadable_sub_folder_is_counted_and_fails_the_run(
    tmp_path, tiny_model_file, cluster, monkeypatch, capsys
):
    """As in one process: the folder is named, counted in the summary, and the exit status is 1."""
    tree = tmp_path / "tree"
    (tree / "locked").mkdir(parents=True)
    write_photos(tree, 1, name="a.png")
    write_photos(tree / "locked", 1, name="b.png")
    refuse_listing(monkeypatch, tree / "locked")
    out = tmp_path / "ray.jsonl"
    assert main(sat_ray([str(tree), "-r", "-o", str(out)], tiny_model_file, cluster)) == 1
    assert [Path(r["path"]).name for r in records(out)] == ["a.png"]
    err = capsys.readouterr().err
    assert "cannot read the folder" in err and "(permission denied)" in err
    assert "captioned 1; failed 0; 1 folder could not be read" in err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_folder_of_shards_resumes(photos, one_process, tiny_model_file, cluster, fmt):
    """A first run over some photos, a stale temporary shard of a killed run, then --resume
    over all: every photo once, each record the one-process run's."""
    import pyarrow.parquet as pq

    from showattendtell.captioning import shards

    out = photos.parent / f"shards-{fmt}"
    first = sorted(photos.iterdir())[:10]
    args = ["-o", f"{out}/", "--format", fmt]
    assert main(sat_ray([*map(str, first), *args], tiny_model_file, cluster)) == 0
    (out / f".part-000099.{fmt}.tmp").write_bytes(b"half a shard")
    assert main(sat_ray([str(photos), *args], tiny_model_file, cluster)) == 2  # no --resume
    assert main(sat_ray([str(photos), *args, "--resume"], tiny_model_file, cluster)) == 1
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".sat")) == [
        shards.shard_name(0, fmt),
        shards.shard_name(1, fmt),
    ]
    got = []
    for shard in shards.shards(out, fmt):
        if fmt == "jsonl":
            got += records(shard)
        else:
            for row in pq.read_table(shard).to_pylist():
                d = {k: v for k, v in row.items() if v is not None}
                if "decoding" in d:
                    d["decoding"] = json.loads(d["decoding"])
                if "caption" in d:
                    d.setdefault("familiarity", None)  # null in JSON, absent here
                got.append(d)
    want = {r["path"]: r for r in one_process}
    assert sorted(r["path"] for r in got) == sorted(want)  # each exactly once
    for r in got:
        assert r == want[r["path"]]


def _claim(marker: str) -> bool:
    """True in the one process that renames ``marker`` away (the fault happens once)."""
    try:
        os.rename(marker, marker + ".taken")
        return True
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_killed_actor_and_a_killed_decoding_task_cost_nothing(
    photos, one_process, tiny_model_file, cluster, tmp_path
):
    """On two nodes, the second batch a captioning actor takes and the second block a decoding
    task takes SIGKILL their own process: Ray restarts them and retries; every photo comes out
    once, with the one-process run's record."""
    from showattendtell.captioning.ray_engine import CaptionImages, caption_dataset, decode_images

    actor_marker, task_marker = tmp_path / "actor", tmp_path / "task"
    actor_marker.touch()
    task_marker.touch()
    calls = tmp_path / "calls"
    calls.mkdir()

    def killing_decode(batch, input_size):
        if int(batch["index"][0]) >= 8 and _claim(str(task_marker)):
            os.kill(os.getpid(), signal.SIGKILL)
        return decode_images(batch, input_size)

    class KillingCaption(CaptionImages):
        def __call__(self, batch):
            if int(batch["index"][0]) >= 8 and _claim(str(actor_marker)):
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__call__(batch)

    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)
    # the workers cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    paths = sorted(str(p) for p in photos.iterdir())
    ds = ray.data.from_items(
        [{"index": i, "path": p} for i, p in enumerate(paths)], override_num_blocks=6
    )
    try:
        out = caption_dataset(
            ds, tiny_model_file, batch_size=4, decode=killing_decode, captioning=KillingCaption
        ).take_all()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert (
        Path(str(actor_marker) + ".taken").exists() and Path(str(task_marker) + ".taken").exists()
    )
    got = sorted((json.loads(r["record"]) for r in out), key=lambda r: r["path"])
    assert [r["path"] for r in got] == paths  # every photo exactly once
    assert got == sorted(one_process, key=lambda r: r["path"])


@pytest.mark.slow
def test_a_killed_driver_resumes(photos, one_process, tiny_model_file, cluster):
    """The driver killed (SIGKILL) once records are written: they are whole and in input order,
    and --resume completes the file with the one-process run's records, none twice."""
    out = photos.parent / "killed.jsonl"
    args = sat_ray([str(photos), "-o", str(out)], tiny_model_file, cluster)[1:]
    args[args.index("4")] = "1"  # batches of one photo: slow enough to stop midway
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = start_sat(["caption", *args], photos.parent, env=env)
    wait_for_records(out, 3, proc, timeout=600)
    proc.kill()
    proc.communicate(timeout=60)
    kept = records(out)
    assert 3 <= len(kept) <= N and kept == one_process[: len(kept)]
    assert main(["caption", *args, "--resume"]) == 1
    assert records(out) == one_process


def test_usage_errors_before_any_work(photos, capsys, monkeypatch):
    base = ["caption", str(photos), "--model", "tiny"]  # refused before a model is looked for
    cases = [
        (["--address", "auto"], "add --engine ray"),
        (["-o", "x/", "--format", "parquet"], "add --engine ray"),
        (["--engine", "ray", "--overlays", "sheets"], "--engine local"),
        (["--engine", "ray", "-o", "x.jsonl", "--min-confidence", "0.5"], "--engine local"),
        (["--engine", "ray", "--decode-on", "gpu"], "decodes on CPUs"),
        (["--engine", "ray", "-o", "x.txt/", "--format", "csv"], "parquet or jsonl"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert main([*base, "--engine", "ray"]) == 2
    assert "pip install 'showattendtell[ray]'" in capsys.readouterr().err


def test_records_handed_over_twice_or_out_of_order_are_written_once_in_order(tmp_path):
    """The driver's side alone: Ray hands back blocks in any order, and a retried task's block
    may come twice; the file gets each record once, in input order."""
    from argparse import Namespace

    from showattendtell.cli.caption_job import Plan
    from showattendtell.cli.caption_ray import _Out

    out = tmp_path / "out.jsonl"
    args = Namespace(output=str(out), with_attention=False, resume=False)
    plan = Plan(["a", "b", "c"], 0, None)
    rec = {p: {"path": p, "caption": f"a {p}", "model": "m"} for p in "abc"}
    sink = _Out(args, "jsonl", plan, None, {}, folder=False, next_shard=0)
    assert sink.add(1, rec["b"]) == 0  # waits for a
    assert sink.add(0, rec["a"]) == 2
    assert sink.add(1, rec["b"]) == 0  # again: dropped
    assert sink.add(2, {"path": "c", "error": "not an image file"}) == 1
    sink.close()
    assert [json.loads(line)["path"] for line in out.read_text().splitlines()] == ["a", "b", "c"]
    assert (sink.ok, [r.path for r in sink.failures]) == (2, ["c"])


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_shards_are_read_back_for_resume_and_foreign_ones_refused(tmp_path, fmt):
    from showattendtell.captioning import shards
    from showattendtell.outputs import OutputError

    made_by = {"model": "tiny", "decoding": {"beam_size": 1, "precision": "32"}}
    caption = {"path": "a.png", "caption": "red", "score": -1.0, "log_prob": -1.0}
    caption.update(words=["red"], familiarity=None, confidence=0.25, **made_by)
    shards.write_shard(tmp_path, 0, fmt, [caption, {"path": "b.png", "error": "empty"}], False)
    shards.write_shard(tmp_path, 3, fmt, [{"path": "a.png", "error": "gone"}], False)
    assert shards.next_number(tmp_path) == 4
    assert not list(tmp_path.glob(".*.tmp"))  # renamed into place
    point = shards.scan_shards(tmp_path, fmt, with_attention=False)
    assert point.done == {"a.png": 2, "b.png": 1}
    assert point.made_by == [made_by]
    if fmt == "parquet":  # every field of a record is a column: none is dropped
        import pyarrow.parquet as pq

        row = pq.read_table(tmp_path / shards.shard_name(0, fmt)).to_pylist()[0]
        assert {k: v for k, v in row.items() if k != "decoding"} == {
            **{k: v for k, v in caption.items() if k != "decoding"},
            "warning": None,
            "error": None,
            "model_sha256": None,
        }
    with pytest.raises(OutputError, match="with-attention"):
        shards.scan_shards(tmp_path, fmt, with_attention=True)
    (tmp_path / shards.shard_name(5, fmt)).write_text("notes\n")
    with pytest.raises(OutputError, match="not a `sat caption`"):
        shards.scan_shards(tmp_path, fmt, with_attention=False)
