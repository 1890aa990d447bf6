"""`sat evaluate`: batched captioning of a split, COCO results file, official scores as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import COCO_SUBSET, FLICKR8K, needs_coco_subset, needs_flickr8k, write_flickr8k_folder
from helpers.evaluate import evaluate_argv
from helpers.marks import needs_java

from showattendtell import metrics
from showattendtell.cli import main

KEYS = ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"]
REPETITION = ["repeated_bigram_captions", "mean_words"]


def flickr8k_argv(model_file, root, *extra, split="dev", output=None):
    """The arguments of `sat evaluate` of ``model_file`` on a Flickr8k split at ``root``."""
    return evaluate_argv("flickr8k", root, split, *extra, model=model_file, output=output)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A small untrained model: the evaluation plumbing, not caption quality, is under test
    (built in seconds, unlike a trained one on this shared machine)."""
    import torch

    from showattendtell.decoder import DecoderConfig
    from showattendtell.encoder import EncoderConfig
    from showattendtell.model import CaptionModel, DecodingConfig
    from showattendtell.model_file import save_model
    from showattendtell.vocab import Vocabulary

    torch.manual_seed(0)
    vocab = Vocabulary.build(
        [
            "a man riding a wave",
            "two dogs on the grass",
            "a plate of food",
            "a red bus on the road",
        ],
        min_count=1,
    )
    model = CaptionModel(
        vocab,
        EncoderConfig(backbone="resnet50", weights=None, input_size=64),
        DecoderConfig("soft", 16, 32, 16, 0.0),
    )
    path = tmp_path_factory.mktemp("eval_model") / "untrained.safetensors"
    return save_model(model.eval(), path, DecodingConfig(beam_size=2, max_length=6))


@needs_java
@needs_coco_subset
def test_evaluate_coco_subset(model_file, tmp_path, capsys, caplog):
    out = tmp_path / "res" / "results.json"
    options = ["--limit", "6", "--batch-size", "4", "--num-workers", "1", "--beam-size", "2"]
    rc = main(evaluate_argv("coco", COCO_SUBSET, "val", *options, model=model_file, output=out))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    scores = json.loads(captured.out.strip().splitlines()[-1])
    assert list(scores) == KEYS + REPETITION  # SPICE's models are not installed: skipped
    repetition = {k: scores.pop(k) for k in REPETITION}
    assert all(0.0 <= v <= 10.0 for v in scores.values())
    results = json.loads(out.read_text())
    assert repetition == {
        k: round(v, 4)
        for k, v in metrics.repetition({r["image_id"]: r["caption"] for r in results}).items()
    }
    assert len(results) == 6
    assert all(isinstance(r["image_id"], int) and isinstance(r["caption"], str) for r in results)
    present = sorted(int(p.stem) for p in (COCO_SUBSET / "images").glob("*.jpg"))[:6]
    assert sorted(r["image_id"] for r in results) == present
    assert "captioned 6 images" in captured.err
    assert any("skipped 4960 of 5000" in r.getMessage() for r in caplog.records)
    assert not list(out.parent.glob("*.tmp"))

    # the printed scores are those of the written captions
    from showattendtell.data.datasets import load_split

    refs = {im.coco_id: im.captions for im in load_split("coco", COCO_SUBSET, "val").images}
    again = metrics.score_captions(
        {r["image_id"]: r["caption"] for r in results},
        {r["image_id"]: refs[r["image_id"]] for r in results},
        spice=False,
    )
    assert {k: round(v, 6) for k, v in again.items()} == scores


@needs_java
def test_evaluate_flickr_skips_an_undecodable_image(model_file, tmp_path, capsys, caplog):
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=4)
    bad = sorted((root / "images").glob("*.jpg"))[-1]
    bad.write_bytes(b"GIF89a broken")
    out = tmp_path / "flickr.json"
    rc = main(flickr8k_argv(model_file, root, "--num-workers", "0", output=out))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert list(json.loads(captured.out.strip().splitlines()[-1])) == KEYS + REPETITION
    results = json.loads(out.read_text())
    assert len(results) == 3 and bad.name not in {r["image_id"] for r in results}
    assert all(r["image_id"].endswith(".jpg") for r in results)  # Flickr: file names
    assert "1 undecodable" in captured.err
    assert any(str(bad) in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


@needs_flickr8k
def test_withheld_test_images_fail_clearly(model_file, capsys):
    rc = main(flickr8k_argv(model_file, FLICKR8K, split="test"))
    err = capsys.readouterr().err
    assert rc == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("error:") and str(FLICKR8K / "images") in line and "1000" in line


def test_without_java_it_says_so_before_captioning(
    model_file, synthetic_flickr, monkeypatch, capsys
):
    monkeypatch.setattr(metrics.shutil, "which", lambda name: None)
    rc = main(flickr8k_argv(model_file, synthetic_flickr))
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    assert "need Java" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--dataset", "coco", "--root", "/nonexistent/coco"], "does not exist"),
        (["--dataset", "flickr8k", "--root", "{synthetic}", "--split", "validation"], "splits"),
        (["--dataset", "flickr8k", "--root", "{synthetic}", "--batch-size", "0"], "positive"),
    ],
)
def test_bad_arguments_are_one_line_errors(synthetic_flickr, capsys, args, match):
    args = [a.replace("{synthetic}", str(synthetic_flickr)) for a in args]
    rc = main(["evaluate", *args])
    err = capsys.readouterr().err
    assert rc != 0 and match in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_unwritable_output_is_refused_before_any_photo_is_read(
    where, model_file, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    """Root may write anywhere chmod allows, so the tests use places no one can write: a path
    whose folder would have to be a file, and /proc."""
    from showattendtell.commands import evaluate

    def never(*args, **kwargs):
        raise AssertionError("captioning started")

    monkeypatch.setattr(evaluate, "caption_split", never)
    (tmp_path / "notes").write_text("a file, not a folder\n")
    out = (
        tmp_path / "notes" / "sub" / "r.json"
        if where == "under_a_file"
        else Path("/proc/sat-results.json")
    )
    rc = main(flickr8k_argv(model_file, synthetic_flickr, output=out))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err, err
    assert "--output" in err and str(out.parent) in err


@needs_java
def test_an_existing_output_is_kept_unless_overwrite(model_file, tmp_path, capsys):
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=2)
    out = tmp_path / "results.json"
    out.write_text("my notes\n")
    args = flickr8k_argv(model_file, root, "--num-workers", "0", output=out)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "already exists" in err and "--overwrite" in err and "\n" not in err
    assert out.read_text() == "my notes\n"
    assert main([*args, "--overwrite"]) == 0
    assert len(json.loads(out.read_text())) == 2


@needs_java
def test_scores_are_printed_when_the_results_cannot_be_written(
    model_file, tmp_path, monkeypatch, capsys
):
    """The folder was writable at the start but the disk is full at the end: the scores of
    the whole split still reach standard output, one line says what was not written and
    where the captions were kept instead."""
    import errno

    from showattendtell.commands import evaluate

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluate, "write_json_atomic", full_disk)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=2)
    out = tmp_path / "results.json"
    rc = main(flickr8k_argv(model_file, root, "--num-workers", "0", output=out))
    captured = capsys.readouterr()
    assert rc == 1
    assert list(json.loads(captured.out.strip().splitlines()[-1])) == KEYS + REPETITION
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(out) in errors[0] and "No space left" in errors[0]
    kept = list((tmp_path / "tmp").glob("results-*.json"))
    assert len(kept) == 1 and str(kept[0]) in errors[0]
    assert len(json.loads(kept[0].read_text())) == 2
    assert not out.exists()


def test_overwrite_never_replaces_a_file_of_the_dataset(model_file, tmp_path, capsys):
    """--output a photo or the split file of --root, even with --overwrite, would lose it; a
    results file there may be replaced. Refused before Java is looked for or a model loaded."""
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=2)
    photo = next((root / "images").iterdir())
    dataset_files = [photo, *(p for p in root.iterdir() if p.is_file())]
    before = {p: p.read_bytes() for p in dataset_files}
    for target in dataset_files:
        args = flickr8k_argv(model_file, root, "--num-workers", "0", output=target)
        assert main([*args, "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith("not a results file; write the results elsewhere") and "\n" not in err
    assert {p: p.read_bytes() for p in dataset_files} == before
    from showattendtell.commands.evaluate import _is_results_file

    mine = root / "results.json"
    mine.write_text(json.dumps([{"image_id": "1000_synthetic", "caption": "a dog"}]))
    assert _is_results_file(mine)
    mine.write_text("[1, 2]")
    assert not _is_results_file(mine)


def test_a_results_file_gets_the_usual_permissions(tmp_path):
    """Written through a private temporary file and renamed, it is still readable by others
    under umask 022, as a file made by open() would be."""
    import os

    from showattendtell.commands.evaluate import write_json_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "results.json", [])
    finally:
        os.umask(old)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o644
