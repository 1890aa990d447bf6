"""COCO from the command line, end to end, on real COCO 2017 photos: `sat train` with
configs/coco_lite2_{soft,hard}.yaml, `sat export`, `sat evaluate`, in the official 2017 layout and
with Karpathy's dataset_coco.json. A pipeline check on 80 + 40 photos with a small decoder and one
short epoch, not a trained model: the scores are not looked at, only that each step works."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from helpers.data import SHARED

from showattendtell.cli.main import main
from showattendtell.evaluation import metrics

ROOT = Path(__file__).resolve().parents[2]
TRAIN_MINI = SHARED / "data" / "coco2017_train_mini"  # 80 train2017 photos and their captions
VAL_SUBSET = SHARED / "data" / "coco2017_val_subset"  # 40 val2017 photos, the full val captions
KEYS = ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (TRAIN_MINI / "annotations" / "captions_train2017.json").is_file()
        or not (VAL_SUBSET / "annotations" / "captions_val2017.json").is_file(),
        reason=f"real COCO 2017 photos not found at {TRAIN_MINI} and {VAL_SUBSET}",
    ),
    pytest.mark.skipif(
        not metrics.java_available(),
        reason="Java is not installed (sat evaluate's official scorers need it)",
    ),
]

# Small enough for a loaded 2-core CPU: a 64-unit LSTM, one epoch of 13 steps of 32 captions.
FAST = [
    "--trainer.max_epochs",
    "1",
    "--model.decoder.hidden_dim",
    "64",
    "--model.decoder.embed_dim",
    "32",
    "--model.decoder.attention_dim",
    "32",
    "--data.batch_size",
    "32",
    "--data.min_word_count",
    "1",
    "--data.num_workers",
    "0",
    "--trainer.enable_progress_bar",
    "false",
]


def _photo_ids(folder: Path) -> list[int]:
    return sorted(int(p.stem) for p in (folder / "images").glob("*.jpg"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two intra-op threads on two cores shared with other jobs spin against each other: one
    thread ran this module's training 6x faster and the encoder 2x faster on this machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    """The official 2017 layout load_coco reads: annotations/captions_{train,val}2017.json and
    the photos in train2017/, val2017/ (symlinks to the shared folders, nothing copied)."""
    root = tmp_path_factory.mktemp("coco2017")
    (root / "annotations").mkdir()
    for folder, split in ((TRAIN_MINI, "train"), (VAL_SUBSET, "val")):
        name = f"captions_{split}2017.json"
        (root / "annotations" / name).symlink_to(folder / "annotations" / name)
        (root / f"{split}2017").symlink_to(folder / "images", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory) -> Path:
    """One cache for the module: the photos are encoded once, by the first run."""
    return tmp_path_factory.mktemp("cache")


def _train(config: str, root: Path, run_dir: Path, cache: Path, *extra: str) -> None:
    args = [
        "train",
        "--config",
        str(ROOT / "configs" / config),
        "--data.root",
        str(root),
        "--run.dir",
        str(run_dir),
        "--data.feature_cache",
        str(cache),
        *FAST,
        *extra,
    ]
    assert main(args) == 0


def _export(run_dir: Path, out: Path, *extra: str) -> Path:
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    assert main(["export", str(best), str(out), *extra]) == 0
    return out


def _evaluate(model: Path, root: Path, split: str, out: Path, capsys) -> tuple[dict, list, str]:
    capsys.readouterr()
    rc = main(
        [
            "evaluate",
            "--dataset",
            "coco",
            "--root",
            str(root),
            "--split",
            split,
            "--model",
            str(model),
            "--beam-size",
            "1",
            "--num-workers",
            "0",
            "--output",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    scores = json.loads(captured.out.strip().splitlines()[-1])
    extra = {"SPICE", "repeated_bigram_captions", "mean_words"}  # SPICE: with its models only
    assert set(KEYS) <= set(scores) <= {*KEYS, *extra}
    assert all(0.0 <= scores[k] <= 10.0 for k in KEYS)
    return scores, json.loads(out.read_text()), captured.err


def _cached_ids(cache: Path) -> set[str]:
    from showattendtell.data.feature_cache import FeatureCache

    (folder,) = cache.iterdir()  # one encoder: one folder
    assert folder.name.startswith("efficientnet_lite2-260px-9x9-")
    return set(FeatureCache(folder).index)


@pytest.fixture(scope="module")
def soft_run(coco_root, feature_cache, tmp_path_factory):
    """configs/coco_lite2_soft.yaml on the official train / val files, exported."""
    work = tmp_path_factory.mktemp("soft")
    _train(
        "coco_lite2_soft.yaml",
        coco_root,
        work / "run",
        feature_cache,
        "--data.train_split",
        "train",
        "--data.val_split",
        "val",
    )
    return work, _export(work / "run", work / "soft.safetensors")


def test_soft_config_on_the_official_2017_files(soft_run, coco_root, feature_cache, capsys, caplog):
    work, model = soft_run
    train_ids, val_ids = _photo_ids(TRAIN_MINI), _photo_ids(VAL_SUBSET)
    assert (len(train_ids), len(val_ids)) == (80, 40)
    assert _cached_ids(feature_cache) == {str(i) for i in train_ids + val_ids}
    assert (work / "run" / "checkpoints" / "last.ckpt").is_file()
    header = next((work / "run").rglob("metrics.csv")).read_text().splitlines()[0]
    assert "val/cider" in header  # the config's run.monitor, logged each epoch

    caplog.set_level(logging.WARNING)
    scores, results, err = _evaluate(model, coco_root, "val", work / "val.json", capsys)
    assert sorted(r["image_id"] for r in results) == val_ids  # the COCO ids, as ints
    assert all(isinstance(r["caption"], str) and r["caption"] for r in results)
    assert "captioned 40 images of coco/captions_val2017.json" in err
    assert any("skipped 4960 of 5000" in r.getMessage() for r in caplog.records)


def test_hard_config_starts_from_the_exported_soft_model(
    soft_run, coco_root, feature_cache, tmp_path, capsys, caplog
):
    from showattendtell.captioning.captioner import load_model

    _, soft = soft_run
    caplog.set_level(logging.INFO, logger="showattendtell")
    _train(
        "coco_lite2_hard.yaml",
        coco_root,
        tmp_path / "run",
        feature_cache,
        "--data.train_split",
        "train",
        "--data.val_split",
        "val",
        "--model.init_from",
        str(soft),
    )
    assert not any("extracting" in r.getMessage() for r in caplog.records)  # the soft run's cache
    ckpt = torch_load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert ckpt["hyper_parameters"]["init_from"] == str(soft)
    assert ckpt["hyper_parameters"]["decoder"]["attention"] == "hard"
    assert ckpt["global_step"] == 13  # the 400 captions of the 80 train photos, 32 a step
    hard = _export(tmp_path / "run", tmp_path / "hard.safetensors", "--hard-mode", "expectation")
    captioner = load_model(str(hard), "cpu")
    assert captioner.attention_type == "hard" and captioner.decoding.hard_mode == "expectation"
    _, results, err = _evaluate(hard, coco_root, "val", tmp_path / "val.json", capsys)
    assert len(results) == 40 and "captioned 40 images" in err


def _karpathy_file(path: Path) -> dict[str, list[int]]:
    """dataset_coco.json in Karpathy's format, from the real captions of the 120 photos: the
    train2017 ones as train (60) and restval (20), the val2017 ones as val (20) and test (20).
    Its file names are Karpathy's (train2014/COCO_train2014_<id>.jpg), which the loader finds
    as <id>.jpg in the 2017 folders."""
    splits: dict[str, list[int]] = {}
    images = []
    for folder, year_split, names in (
        (TRAIN_MINI, "train", ("train", "restval")),
        (VAL_SUBSET, "val", ("val", "test")),
    ):
        coco = json.loads((folder / "annotations" / f"captions_{year_split}2017.json").read_text())
        ids = _photo_ids(folder)
        present = set(ids)
        captions: dict[int, list[dict]] = {}
        for a in coco["annotations"]:
            if a["image_id"] in present:
                captions.setdefault(a["image_id"], []).append(a)
        half = len(ids) * 3 // 4 if year_split == "train" else len(ids) // 2
        for k, cocoid in enumerate(ids):
            split = names[0] if k < half else names[1]
            splits.setdefault(split, []).append(cocoid)
            imgid = len(images)
            sentences = [
                {
                    "tokens": re.findall(r"[a-z0-9]+", a["caption"].lower()),
                    "raw": a["caption"],
                    "imgid": imgid,
                    "sentid": a["id"],
                }
                for a in sorted(captions[cocoid], key=lambda a: a["id"])
            ]
            images.append(
                {
                    "filepath": f"{year_split}2014",
                    "sentids": [s["sentid"] for s in sentences],
                    "filename": f"COCO_{year_split}2014_{cocoid:012d}.jpg",
                    "imgid": imgid,
                    "split": split,
                    "sentences": sentences,
                    "cocoid": cocoid,
                }
            )
    path.write_text(json.dumps({"images": images, "dataset": "coco"}))
    return splits


def test_karpathy_split_file_with_the_default_splits(
    coco_root, feature_cache, tmp_path, capsys, caplog
):
    from showattendtell.data.datasets import load_split

    root = tmp_path / "coco"  # dataset_coco.json and the image folders
    root.mkdir()
    for folder in ("train2017", "val2017"):
        (root / folder).symlink_to((coco_root / folder).resolve(), target_is_directory=True)
    splits = _karpathy_file(root / "dataset_coco.json")
    counts = {}
    for name in ("train", "restval", "train+restval", "val", "test"):
        split = load_split("coco", root, name)
        assert not split.missing
        counts[name] = len(split.images)
    assert counts == {"train": 60, "restval": 20, "train+restval": 80, "val": 20, "test": 20}
    test = load_split("coco", root, "test").images
    assert [im.coco_id for im in test] == splits["test"]
    assert all(
        im.path.resolve() == (VAL_SUBSET / "images" / f"{im.coco_id:012d}.jpg").resolve()
        for im in test
    )
    assert len(test[0].captions) >= 5 and test[0].image_id == str(test[0].coco_id)

    caplog.set_level(logging.INFO, logger="showattendtell")
    _train("coco_lite2_soft.yaml", root, tmp_path / "run", feature_cache)  # train+restval / val
    assert _cached_ids(feature_cache) >= {str(i) for i in splits["train"] + splits["val"]}
    ckpt = torch_load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 13  # train+restval: all 80 photos' 400 captions
    model = _export(tmp_path / "run", tmp_path / "soft.safetensors")
    _, results, err = _evaluate(model, root, "test", tmp_path / "test.json", capsys)
    assert sorted(r["image_id"] for r in results) == splits["test"]
    assert "captioned 20 images of dataset_coco.json/test" in err


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
