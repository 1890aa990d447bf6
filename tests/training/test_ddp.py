"""`sat train` on several processes (Lightning DDP), with 2 CPU processes (gloo backend).

Each run is `python -m showattendtell.cli train` in a subprocess (Lightning starts the second
process by running the same command again; one test starts both with torchrun instead), on a
synthetic Flickr8k-format folder of 24 training and 7 validation images. 7 is odd on purpose:
DistributedSampler gives each of the 2 processes 4 validation images, one of them twice.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.data import write_flickr8k_folder
from helpers.processes import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
N_TRAIN, N_DEV, BATCH = 24, 7, 8
PAIRS = 5 * N_TRAIN  # five captions an image: one training example each
STEPS_1 = math.ceil(PAIRS / BATCH)  # optimizer steps an epoch, 1 process: 15
STEPS_2 = math.ceil(math.ceil(PAIRS / 2) / BATCH)  # 2 processes, 60 pairs each: 8
DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
WARNINGS = ("sync_dist", "It is recommended to use `self.log(")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def sat_train(
    args: list[str], cwd: Path, launcher: list[str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    launcher = launcher or [sys.executable, "-m"]
    cmd = [*launcher, "showattendtell.cli", "train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stderr[-12000:]}"
    return proc


def tiny(flickr: Path, run_dir: str, *more: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--data.root",
        str(flickr),
        "--data.feature_cache",
        "cache",
        "--data.val_batch_size",
        "2",
        "--run.dir",
        run_dir,
        *more,
    ]


def metrics(run_dir: Path) -> list[dict[str, str]]:
    rows = []
    for f in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        rows += list(csv.DictReader(f.open()))
    return rows


def ckpt_state(path: Path) -> tuple[int, int]:
    c = torch.load(path, map_location="cpu", weights_only=True)
    return c["epoch"], c["global_step"]


@pytest.fixture(scope="module")
def flickr(tmp_path_factory) -> Path:
    return write_flickr8k_folder(
        tmp_path_factory.mktemp("flickr_ddp") / "data", n_train=N_TRAIN, n_dev=N_DEV
    )


@pytest.fixture(scope="module")
def ddp_run(flickr, tmp_path_factory):
    """One epoch on 2 processes, starting with no feature cache."""
    work = tmp_path_factory.mktemp("ddp")
    proc = sat_train(tiny(flickr, "runs/ddp", *DDP, "--trainer.max_epochs", "1"), work)
    return SimpleNamespace(
        work=work,
        run=work / "runs" / "ddp",
        proc=proc,
        last=work / "runs" / "ddp" / "checkpoints" / "last.ckpt",
    )


def test_ddp_fills_the_feature_cache_once(ddp_run, flickr):
    """Lightning calls prepare_data on local rank 0 only (prepare_data_per_node=True, the
    default) and the other processes wait at a barrier before setup: the cache holds every
    image exactly once, one process extracted, and no temporary file is left."""
    assert ddp_run.proc.stderr.count("extracting encoder features of") == 1
    (cache,) = (ddp_run.work / "cache").iterdir()
    keys = Counter(k for f in cache.glob("shard-*.keys.json") for k in json.loads(f.read_text()))
    images = {p.name for p in (flickr / "images").glob("*.jpg")}
    assert set(keys) == images and set(keys.values()) == {1}
    assert len(list(cache.glob("shard-*.npy"))) == len(list(cache.glob("shard-*.keys.json")))
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]
    assert ddp_run.proc.stderr.count("MEMBER: 2/2") == 1  # it did run on 2 processes
    assert ckpt_state(ddp_run.last) == (0, STEPS_2)


def test_ddp_run_has_no_sync_dist_warnings(ddp_run):
    """Every epoch-level self.log has sync_dist=True (the scores are the same on every rank, so
    the mean over ranks is that value), so Lightning does not warn."""
    out = ddp_run.proc.stdout + ddp_run.proc.stderr
    assert not [w for w in WARNINGS if w in out]


VALIDATE = """\
import json, sys
from pathlib import Path

import lightning as L

from showattendtell.cli.train import build_cli


class CountImages(L.Callback):
    seen = 0

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, *rest):
        CountImages.seen += len(batch["index"])


cli = build_cli(sys.argv[2:])
cli.trainer.callbacks.append(CountImages())
cli.trainer.validate(cli.model, datamodule=cli.datamodule, ckpt_path=sys.argv[1], verbose=False)
t = cli.trainer
out = {k: float(v) for k, v in t.callback_metrics.items()}
out["seen"] = CountImages.seen
Path(f"val-{t.world_size}-{t.global_rank}.json").write_text(json.dumps(out))
"""


def test_validation_scores_each_image_once_on_every_rank_as_one_process(ddp_run, flickr):
    """The scores of a DDP validation are those of a 1-process validation of the same checkpoint.

    Each process decodes its share of the validation images (DistributedSampler: 4 each, one
    image twice, to even out 7 images), the predictions, keyed by image id, are gathered with
    all_gather_object and scored by every process; the module logs ``val/images``, how many
    images were scored. `trainer.validate` of the DDP run's checkpoint, on 2 processes and on 1
    (a small script around build_cli, as `sat train` uses), writes each process's logged
    metrics: val/images is the split's 7 everywhere (8 decoded on 2 processes), and BLEU-4,
    CIDEr, ... are exactly equal on both ranks and to the 1-process values, and to what the
    DDP training run logged for that epoch (metrics.csv).
    """
    work = ddp_run.work
    (work / "validate.py").write_text(VALIDATE)
    for devices in (["--trainer.devices", "2", "--trainer.strategy", "ddp"], []):
        cmd = [
            sys.executable,
            "validate.py",
            str(ddp_run.last),
            *tiny(flickr, "runs/validate", *devices),
        ]
        proc = subprocess.run(
            cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-12000:]
    rank0, rank1, single = (
        json.loads((work / f"val-{n}.json").read_text()) for n in ("2-0", "2-1", "1-0")
    )
    assert rank0["seen"] + rank1["seen"] == N_DEV + 1 and single["seen"] == N_DEV
    keys = ("val/images", "val/bleu1", "val/bleu4", "val/rouge_l", "val/cider")
    for m in (rank0, rank1):
        assert {k: m[k] for k in keys} == {k: single[k] for k in keys}
    assert single["val/images"] == N_DEV
    (logged,) = [r for r in metrics(ddp_run.run) if r.get("val/bleu4")]
    assert {k: float(logged[k]) for k in keys} == {k: single[k] for k in keys}


def test_checkpoints_resume_across_process_counts(ddp_run, flickr):
    """A DDP checkpoint resumes on 1 process and a 1-process one under DDP. global_step counts
    optimizer steps, one per batch on each process: an epoch is 15 steps on 1 process and 8 on
    2 (60 training pairs each, batches of 8)."""
    work = ddp_run.work
    shutil.copy(ddp_run.last, work / "ddp-epoch0.ckpt")
    last = work / "runs" / "resumed" / "checkpoints" / "last.ckpt"
    sat_train(
        tiny(flickr, "runs/resumed", "--trainer.max_epochs", "2", "--ckpt_path", "ddp-epoch0.ckpt"),
        work,
    )
    assert ckpt_state(last) == (1, STEPS_2 + STEPS_1)
    shutil.copy(last, work / "one-epoch1.ckpt")
    sat_train(
        tiny(
            flickr,
            "runs/resumed",
            *DDP,
            "--trainer.max_epochs",
            "3",
            "--ckpt_path",
            "one-epoch1.ckpt",
        ),
        work,
    )
    assert ckpt_state(last) == (2, STEPS_2 + STEPS_1 + STEPS_2)


def _finite_train_nll(run_dir: Path) -> list[float]:
    values = [float(r["train/nll"]) for r in metrics(run_dir) if r.get("train/nll")]
    assert values and all(math.isfinite(v) for v in values)
    return values


def test_hard_attention_under_torchrun(ddp_run, flickr):
    """Hard attention (REINFORCE) on 2 processes started by torchrun, as the several-nodes
    command of docs/training.md does (here one node): Lightning takes rank and world size from
    torchrun's environment and starts no process of its own."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "-m",
    ]
    proc = sat_train(
        tiny(
            flickr,
            "runs/hard",
            *DDP,
            "--trainer.num_nodes",
            "1",
            "--trainer.max_epochs",
            "1",
            "--model.decoder.attention",
            "hard",
        ),
        ddp_run.work,
        launcher=torchrun,
    )
    assert "MEMBER: 2/2" in proc.stderr
    _finite_train_nll(ddp_run.work / "runs" / "hard")
    assert ckpt_state(ddp_run.work / "runs" / "hard" / "checkpoints" / "last.ckpt") == (0, STEPS_2)
    assert not [w for w in WARNINGS if w in proc.stdout + proc.stderr]


def test_self_critical_under_ddp(ddp_run, flickr):
    sat_train(
        tiny(
            flickr,
            "runs/sc",
            *DDP,
            "--trainer.max_epochs",
            "1",
            "--model.objective.self_critical",
            "2",
            "--model.init_from",
            str(ddp_run.last),
        ),
        ddp_run.work,
    )
    _finite_train_nll(ddp_run.work / "runs" / "sc")
    rewards = [
        float(r["train/reward"])
        for r in metrics(ddp_run.work / "runs" / "sc")
        if r.get("train/reward")
    ]
    assert rewards and all(math.isfinite(r) for r in rewards)


def _baseline_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from helpers import make_batch, small_decoder

    from showattendtell.training.objectives import HardAttentionConfig, HardAttentionReinforce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = SimpleNamespace(decoder=small_decoder(attention="hard", seed=1))
    # first step: rank 0 samples locations, rank 1 takes the expected context
    objective = HardAttentionReinforce(HardAttentionConfig(expectation_prob=float(rank == 1)))
    a, caps, lengths = make_batch(seed=10 + rank)  # each rank its own batch
    batch = {"captions": caps, "lengths": lengths}
    torch.manual_seed(rank)
    _, logs1 = objective(model, a, batch)
    b1 = float(objective.baseline)
    objective.config.expectation_prob = 0.0  # second step: both sample
    _, logs2 = objective(model, a, batch)
    torch.save(
        {
            "b1": b1,
            "b2": float(objective.baseline),
            "nll1": float(logs1["caption_nll"]),
            "nll2": float(logs2["caption_nll"]),
        },
        f"{out}/{rank}.pt",
    )
    dist.destroy_process_group()


def test_reinforce_baseline_is_the_same_on_every_process(tmp_path):
    """Under DDP the moving-average baseline b moves by the mean log-likelihood of the step's
    sampled captions over all processes, so it stays one number for the run (and the checkpoint,
    saved by rank 0, holds what every process used); a process whose batch took the expected
    context still joins the all_reduce, so none waits forever."""
    import torch.multiprocessing as mp

    mp.spawn(_baseline_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert r0["b1"] == r1["b1"] == pytest.approx(0.1 * -r0["nll1"])  # rank 0's batch only
    assert (
        r0["b2"] == r1["b2"] == pytest.approx(0.9 * r0["b1"] + 0.1 * -(r0["nll2"] + r1["nll2"]) / 2)
    )  # equal batch sizes
    assert r0["b2"] != r0["b1"]
