"""`sat evaluate`: batched captioning of a split, COCO results file, official scores as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.data import (
    COCO_SUBSET,
    FLICKR8K,
    needs_coco_subset,
    needs_flickr8k,
    write_flickr8k_folder,
)
from helpers.evaluate import evaluate_argv
from helpers.marks import needs_java

from showattendtell.cli import evaluate_job
from showattendtell.cli.main import main
from showattendtell.evaluation import metrics

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

    from showattendtell.model import CaptionModel, DecodingConfig
    from showattendtell.model_file import save_model
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.encoder import EncoderConfig
    from showattendtell.network.vocab import Vocabulary

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
@pytest.mark.slow
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
        (["--dataset", "coco", "--root", "/nonexistent/coco"], "no such folder"),
        (["--dataset", "flickr8k", "--root", "{synthetic}", "--split", "validation"], "splits"),
        (["--dataset", "flickr8k", "--root", "{synthetic}", "--batch-size", "0"], "positive"),
    ],
)
def test_bad_arguments_are_one_line_errors(synthetic_flickr, capsys, args, match):
    args = [a.replace("{synthetic}", str(synthetic_flickr)) for a in args]
    rc = main(["evaluate", *args])
    err = capsys.readouterr().err
    assert rc != 0 and match in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("dataset", ["coco", "flickr8k"])
def test_a_root_that_is_no_folder_is_a_usage_error(dataset, tmp_path, capsys):
    """A mistyped --root, or a file given for it, is a usage error (exit 2, before any model is
    read) saying what the folder holds; `sat data coco` makes a COCO folder."""
    missing, photo = tmp_path / "missing", tmp_path / "photo.jpg"
    photo.write_bytes(b"")
    layout = {
        "coco": "the COCO folder (annotations/captions_*.json and the photo folders, or "
        "Karpathy's dataset_coco.json); `sat data coco --root {download}` downloads it",
        "flickr8k": "the Flickr8k folder (Flickr8k.token.txt, Flickr_8k.*Images.txt and "
        "images/; see data/README.md)",
    }[dataset]
    for root, what, download in (
        (missing, "no such folder", missing),
        (photo, "is a file, not a folder", "DIR"),
    ):
        assert main(["evaluate", "--dataset", dataset, "--root", str(root)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --root {root}: {what}: give " + layout.format(download=download)


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_unwritable_output_is_refused_before_any_photo_is_read(
    where, model_file, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    """Root may write anywhere chmod allows, so the tests use places no one can write: a path
    whose folder would have to be a file, and /proc."""

    def never(*args, **kwargs):
        raise AssertionError("captioning started")

    monkeypatch.setattr(evaluate_job, "caption_split", never)
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
    where the captions were kept instead (and the partial captions stay, for --resume)."""
    import errno

    write = evaluate_job.write_json_atomic

    def full_disk(path, data):
        if path != out:  # the partial captions' settings, written at the start
            return write(path, data)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluate_job, "write_json_atomic", full_disk)
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
    assert len((tmp_path / "results.json.partial.jsonl").read_text().splitlines()) == 2


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
    from showattendtell.cli.evaluate import _is_results_file

    mine = root / "results.json"
    mine.write_text(json.dumps([{"image_id": "1000_synthetic", "caption": "a dog"}]))
    assert _is_results_file(mine)
    mine.write_text("[1, 2]")
    assert not _is_results_file(mine)


def test_a_results_file_gets_the_usual_permissions(tmp_path):
    """Written through a private temporary file and renamed, it is still readable by others
    under umask 022, as a file made by open() would be."""
    import os

    from showattendtell.cli.evaluate_captions import write_json_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "results.json", [])
    finally:
        os.umask(old)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o644


def no_java_needed(monkeypatch) -> None:
    """Skip the Java check: these runs stop before anything is scored."""
    monkeypatch.setattr(evaluate_job, "require_java", lambda *args, **kwargs: None)


@pytest.mark.parametrize(
    ("dataset", "split", "line"),
    [
        ("flickr8k", "bogus", "the splits of flickr8k are train, dev, val, test"),
        (
            "coco",
            "test",
            "the splits of the official COCO files are train, val (test and restval need "
            "Karpathy's dataset_coco.json in {root})",
        ),
        (
            "flickr8k",
            "test",
            "flickr8k/test lists no images; evaluate one of the other splits (train, dev, val)",
        ),
    ],
)
def test_a_split_that_is_not_there_is_a_usage_error(
    dataset, split, line, model_file, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    """A split name the dataset does not have, or a split listing no image (the synthetic
    folder's test split file is empty), is a mistyped command: exit 2, the splits there are."""
    no_java_needed(monkeypatch)
    argv = evaluate_argv(dataset, synthetic_flickr, split, model=model_file, output=tmp_path / "r")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --split {split}: " + line.format(root=synthetic_flickr)


def write_coco_like(root: Path, sizes, annotated=None, turned=()) -> Path:
    """A COCO folder in Karpathy's format (dataset_coco.json, split "test", COCO ids 1..n) of
    plain photos, photo i of ``sizes[i]`` as stored (with EXIF orientation 6, shown turned by
    90 degrees, for i in ``turned``), and an instances file giving photo i the size
    ``annotated[i]`` (default: its own), a person on its left half and a dog on its right
    half; returns the instances file."""
    from PIL import Image

    root.mkdir(parents=True)
    annotated = annotated or sizes
    entries, images, anns = [], [], []
    for i, ((w, h), (aw, ah)) in enumerate(zip(sizes, annotated, strict=True), 1):
        exif = Image.Exif()
        if i - 1 in turned:
            exif[0x0112] = 6
        Image.new("RGB", (w, h), (40 * i % 256, 90, 160)).save(root / f"{i}.jpg", exif=exif)
        sentences = [{"raw": "a man riding a wave"}, {"raw": "two dogs on the grass"}]
        entries.append(
            {"filename": f"{i}.jpg", "split": "test", "cocoid": i, "sentences": sentences}
        )
        images.append({"id": i, "width": aw, "height": ah, "file_name": f"{i}.jpg"})
        for n, (cat, x) in enumerate(((1, 0), (18, aw // 2))):
            box = [x, 0, aw // 2, ah]
            polygon = [x, 0, x + aw // 2, 0, x + aw // 2, ah, x, ah]
            anns.append(
                {
                    "id": 10 * i + n,
                    "image_id": i,
                    "category_id": cat,
                    "iscrowd": 0,
                    "area": float(aw // 2 * ah),
                    "bbox": box,
                    "segmentation": [polygon],
                }
            )
    (root / "dataset_coco.json").write_text(json.dumps({"images": entries}))
    instances = root / "instances.json"
    categories = [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}]
    data = {"images": images, "annotations": anns, "categories": categories}
    instances.write_text(json.dumps(data))
    return instances


def test_instances_of_other_photo_sizes_are_warned_about_once(
    model_file, tmp_path, monkeypatch, caplog
):
    """Masks are drawn at the size the instances file gives; on photos of another size they
    are stretched, right only for resized copies of the annotated photos: one warning names
    the first photo that differs and both sizes, before any captioning. A photo annotated as
    shown (turned by its EXIF orientation) is not one of them."""

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    no_java_needed(monkeypatch)
    monkeypatch.setattr(evaluate_job, "caption_split", stop)
    sizes = [(40, 30)] * 4
    annotated = [(40, 30), (30, 40), (80, 60), (30, 30)]  # 2: shown turned; 3 and 4 differ

    def argv(root: Path, instances: Path) -> list[str]:
        options = ["--instances", str(instances)]
        out = root / "r.json"
        return evaluate_argv("karpathy", root, "test", *options, model=model_file, output=out)

    instances = write_coco_like(tmp_path / "coco", sizes, annotated, turned={1})
    with pytest.raises(Stop):
        main(argv(tmp_path / "coco", instances))
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--instances")]
    assert warned == [
        f"--instances: {tmp_path / 'coco' / '3.jpg'} is 40x30 pixels, but {instances} gives it "
        "80x60 (and 1 more of the 4 annotated photos): attention correctness stretches each "
        "mask over its photo, right only if the photo is the annotated one resized (not "
        "cropped, padded, rotated or another photo)"
    ]
    caplog.clear()
    instances = write_coco_like(tmp_path / "same", sizes, [(40, 30), (30, 40)] * 2, turned={1, 3})
    with pytest.raises(Stop):
        main(argv(tmp_path / "same", instances))
    assert not [r for r in caplog.records if r.getMessage().startswith("--instances")]


def interrupt_after(monkeypatch, n: int, stop: type[BaseException] = KeyboardInterrupt) -> list:
    """Captioning stops as on Ctrl-C (``stop``: KeyboardInterrupt) or SIGTERM (Terminated)
    after ``n`` records; returns the lists of photos each later run was asked to caption."""
    real = getattr(evaluate_job.caption_files, "unwrapped", evaluate_job.caption_files)
    asked: list[list[str]] = []

    def caption_files(captioner, paths, *args, **kwargs):
        asked.append([Path(p).name for p in paths])
        for i, rec in enumerate(real(captioner, paths, *args, **kwargs)):
            if i == n:
                raise stop()
            yield rec

    caption_files.unwrapped = real
    monkeypatch.setattr(evaluate_job, "caption_files", caption_files)
    return asked


@needs_java
def test_an_interrupted_evaluation_keeps_its_captions_and_resumes(
    model_file, tmp_path, monkeypatch, capsys
):
    """SIGTERM or Ctrl-C while captioning keeps what is captioned beside --output and says the
    command that goes on; --resume captions only the rest, and the results and scores are those
    of a run never interrupted. Without --resume the kept captions are not thrown away."""
    import shlex

    from showattendtell.errors import Terminated

    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=6)
    out, partial = tmp_path / "r.json", tmp_path / "r.json.partial.jsonl"
    argv = flickr8k_argv(model_file, root, "--num-workers", "0", "--batch-size", "2", output=out)
    interrupt_after(monkeypatch, 3, Terminated)
    assert main(argv) == 143
    assert capsys.readouterr().err.endswith(
        f"interrupted: 3 of 6 images captioned, kept in {partial}; resume with:\n"
        f"  {shlex.join(['sat', *argv, '--resume'])}\n"
    )
    assert not out.exists() and len(partial.read_text().splitlines()) == 3

    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {partial} holds the captions of an interrupted run: add --resume to reuse "
        "them, or delete it to start again"
    )
    asked = interrupt_after(monkeypatch, 1)
    assert main([*argv, "--resume"]) == 130
    assert len(asked[0]) == 3  # the three left
    assert "interrupted: 4 of 6 images captioned" in capsys.readouterr().err
    asked = interrupt_after(monkeypatch, 99)
    assert main([*argv, "--resume"]) == 0
    resumed = capsys.readouterr()
    assert len(asked) == 1 and len(asked[0]) == 2
    assert "captioned 2 images of flickr8k/dev" in resumed.err
    assert f"4 more from {partial}" in resumed.err
    assert not partial.exists() and not (tmp_path / "r.json.partial.json").exists()

    fresh = tmp_path / "fresh.json"
    assert main(flickr8k_argv(model_file, root, "--num-workers", "0", output=fresh)) == 0
    scores = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(out.read_text()) == json.loads(fresh.read_text())
    assert resumed.out.strip().splitlines()[-1] == scores


def test_resume_reuses_only_captions_made_the_same_way(model_file, tmp_path, monkeypatch, capsys):
    no_java_needed(monkeypatch)
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=4)
    out, partial = tmp_path / "r.json", tmp_path / "r.json.partial.jsonl"
    argv = flickr8k_argv(model_file, root, "--num-workers", "0", output=out)
    interrupt_after(monkeypatch, 2)
    assert main(argv) == 130
    capsys.readouterr()
    kept = partial.read_bytes()
    for extra, made_with in [
        (["--beam-size", "1"], "--beam-size 2 (this run: 1)"),
        (["--precision", "bf16"], "--precision 32 (this run: bf16)"),
    ]:
        assert main([*argv, *extra, "--resume"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --resume: the captions in {partial} were made with {made_with}; give the "
            "same to reuse them, or delete that file to start again"
        )
    settings = tmp_path / "r.json.partial.json"
    settings.write_text("{}")
    assert main([*argv, "--resume"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --resume: {settings}, the settings of the captions in {partial}, is missing "
        f"or damaged; delete {partial} to start again"
    )
    assert partial.read_bytes() == kept


def test_a_second_run_on_the_same_output_stops_in_one_line(
    model_file, tmp_path, monkeypatch, capsys
):
    """While a run holds the partial captions (here: a flock taken by this process on its own
    open of the file, which conflicts with the command's open as another process's would), a
    second run on that --output, fresh or --resume, exits 2 in one line and leaves both files
    byte for byte, before the model loads; once the lock goes, --resume goes on."""
    fcntl = pytest.importorskip("fcntl")
    no_java_needed(monkeypatch)
    loads = []
    load = evaluate_job.load_model
    monkeypatch.setattr(
        evaluate_job, "load_model", lambda *a, **k: loads.append(a) or load(*a, **k)
    )
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=4)
    out, partial = tmp_path / "r.json", tmp_path / "r.json.partial.jsonl"
    settings = tmp_path / "r.json.partial.json"
    argv = flickr8k_argv(model_file, root, "--num-workers", "0", output=out)
    interrupt_after(monkeypatch, 2)
    assert main(argv) == 130
    capsys.readouterr()
    kept = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (partial, settings)}
    with open(partial, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        loads.clear()
        for extra in ([], ["--resume"]):
            assert main([*argv, *extra]) == 2
            assert capsys.readouterr().err.strip() == (
                f"error: another sat evaluate is writing {partial} (process still running); "
                "wait for it, or choose another --output"
            )
            assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept} == kept
        assert not out.exists() and loads == []  # refused before the model loaded
    asked = interrupt_after(monkeypatch, 1)
    assert main([*argv, "--resume"]) == 130
    assert len(asked) == 1 and len(asked[0]) == 2  # the two left
    assert "interrupted: 3 of 4 images captioned" in capsys.readouterr().err
    assert len(partial.read_text().splitlines()) == 3


def test_a_run_refused_before_captioning_leaves_no_partial_file(
    model_file, tmp_path, monkeypatch, capsys
):
    """The lock creates the partial file; a run that stops before its first caption (here:
    its settings cannot be written) removes it again."""
    from showattendtell.cli import evaluate_captions

    def unwritable(path, data):
        raise PermissionError(13, "Permission denied")

    no_java_needed(monkeypatch)
    monkeypatch.setattr(evaluate_captions, "write_json_atomic", unwritable)
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=2)
    out = tmp_path / "r.json"
    assert main(flickr8k_argv(model_file, root, "--num-workers", "0", output=out)) == 2
    assert "cannot write" in capsys.readouterr().err
    assert not (tmp_path / "r.json.partial.jsonl").exists()


@needs_java
@pytest.mark.slow
def test_a_resumed_evaluation_scores_attention_on_the_kept_captions(tmp_path, monkeypatch, capsys):
    """With --instances the kept records hold each caption's attention and attended cells, so
    attention correctness covers the captions made before the interruption too; captions kept
    without them cannot be scored and are refused. The bundled hard model names a person in
    these photos (4 counted words), each read from one cell."""
    instances = write_coco_like(tmp_path / "coco", [(40, 30)] * 4)
    extra = ["--num-workers", "0", "--batch-size", "2", "--no-spice", "--beam-size", "1"]
    model = "flickr8k_lite2_hard"
    plain = evaluate_argv("karpathy", tmp_path / "coco", "test", *extra, model=model)
    argv = [*plain, "--instances", str(instances)]

    interrupt_after(monkeypatch, 2)
    assert main([*plain, "--output", str(tmp_path / "a.json")]) == 130
    assert main([*argv, "--output", str(tmp_path / "a.json"), "--resume"]) == 2
    assert "were made with no --instances" in capsys.readouterr().err
    assert main([*argv, "--output", str(tmp_path / "b.json")]) == 130
    capsys.readouterr()
    asked = interrupt_after(monkeypatch, 99)
    assert main([*argv, "--output", str(tmp_path / "b.json"), "--resume"]) == 0
    assert len(asked[0]) == 2
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--output", str(tmp_path / "c.json")]) == 0
    fresh = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ac, fresh_ac = resumed.pop("attention_correctness"), fresh.pop("attention_correctness")
    assert resumed == fresh and ac["images"] == 4 and ac["words"] == fresh_ac["words"] > 0
    # the same words counted, the same figures up to the kept attention's 5 decimals
    per_category = ac.pop("per_category")
    assert per_category.keys() == fresh_ac.pop("per_category").keys()
    assert ac.pop("distribution") == pytest.approx(fresh_ac.pop("distribution"), abs=1e-4)
    assert ac.pop("measured_on") == fresh_ac.pop("measured_on") == "attended locations"
    assert ac == pytest.approx(fresh_ac, abs=1e-4)


def test_an_output_that_is_no_regular_file_is_written_not_replaced(tmp_path):
    """--output /dev/null (or a FIFO) is written as it is: the rename that makes a results
    file whole would replace it, as root /dev/null itself."""
    import os
    import stat
    import threading

    from showattendtell.cli.evaluate_captions import write_json_atomic

    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_json_atomic(fifo, [{"image_id": 1, "caption": "a dog"}])
    reader.join(timeout=10)
    assert json.loads(got[0]) == [{"image_id": 1, "caption": "a dog"}]
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(tmp_path.iterdir()) == [fifo]


def test_stopped_while_scoring_says_where_the_captions_are_and_resume_scores_them(
    model_file, tmp_path, monkeypatch, capsys
):
    """Ctrl-C or SIGTERM while the toolkit scores (minutes of Java): the results file is
    written and the captions kept, the message says where and the command to go on; --resume
    then scores them without captioning a photo again (no "already exists")."""
    import shlex

    from showattendtell.errors import Terminated

    no_java_needed(monkeypatch)
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=3)
    out, partial = tmp_path / "r.json", tmp_path / "r.json.partial.jsonl"
    argv = flickr8k_argv(model_file, root, "--num-workers", "0", output=out)

    def stopped(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr(evaluate_job, "score_captions", stopped)
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert err.endswith(
        f"interrupted while scoring: 3 of 3 images captioned, written to {out} and kept in "
        f"{partial}; score them with:\n  {shlex.join(['sat', *argv, '--resume'])}\n"
    )
    results = json.loads(out.read_text())
    assert len(results) == 3 and partial.exists()

    assert main(argv) == 2  # without --resume the kept captions are not thrown away
    capsys.readouterr()
    asked = interrupt_after(monkeypatch, 99)
    monkeypatch.setattr(evaluate_job, "score_captions", lambda *a, **k: dict.fromkeys(KEYS, 0.5))
    assert main([*argv, "--resume"]) == 0
    resumed = capsys.readouterr()
    assert all(not photos for photos in asked)  # nothing captioned again
    assert json.loads(resumed.out.strip().splitlines()[-1])["CIDEr"] == 0.5
    assert json.loads(out.read_text()) == results
    assert not partial.exists() and not (tmp_path / "r.json.partial.json").exists()


def test_a_disk_that_fills_while_captioning_is_one_line_and_keeps_whole_records(
    model_file, tmp_path, monkeypatch, capsys
):
    """The partial file (what --resume reuses) holds whole records only after the disk filled
    mid-record, and the run says what is kept and how to go on, without a traceback."""
    from helpers.disk import filling

    from showattendtell.cli import evaluate_captions

    no_java_needed(monkeypatch)
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=2, n_dev=4)
    out, partial = tmp_path / "r.json", tmp_path / "r.json.partial.jsonl"
    argv = flickr8k_argv(model_file, root, "--num-workers", "0", "--batch-size", "2", output=out)
    filling(monkeypatch, evaluate_captions, whole=2)  # the partial file's writer
    assert main(argv) == 1
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert err == (
        f"error: cannot write {partial}: No space left on device; 2 of 4 images captioned are "
        "kept there: free some space and run the same command with --resume"
    )
    assert all(line.startswith("INFO: captions: ") for line in progress)  # no traceback
    kept = partial.read_text().splitlines(keepends=True)
    assert len(kept) == 2 and all(json.loads(line)["path"] for line in kept)
    assert not out.exists()
