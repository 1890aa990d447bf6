"""`sat caption`: real photos mixed with bad files, formats, usage errors, kill and resume."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.photos import photos
from helpers.processes import start_sat, wait_for_records
from PIL import Image

from showattendtell.captioning.overlays import overlay_names
from showattendtell.captioning.records import scan_output
from showattendtell.cli.main import main


def quick_run(model: Path) -> list[str]:
    """`sat caption` options for the quickest run in this process: no loader workers, greedy."""
    return ["--model", str(model), "--workers", "0", "--beam-size", "1"]


def slow_run(model: Path, workers: int = 1) -> list[str]:
    """`sat caption` options for a run slow enough to stop midway: one photo a batch, greedy,
    overlay sheets."""
    return [
        "--model",
        str(model),
        "--workers",
        str(workers),
        "--batch-size",
        "1",
        "--beam-size",
        "1",
        "--overlays",
        "sheets",
    ]


def read_jsonl(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "the last line is truncated"
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    """Real photos in every supported format, nested folders, and files that are not images."""
    root = tmp_path / "photos"
    (root / "nested" / "deeper").mkdir(parents=True)
    src = photos(6)
    for p in src[:3]:
        shutil.copy(p, root / p.name)
    shutil.copy(src[3], root / "nested" / src[3].name)
    shutil.copy(src[4], root / "nested" / "deeper" / src[4].name)
    im = Image.open(src[5]).convert("RGB")
    im.save(root / "as.png")
    im.save(root / "as.webp")
    im.save(root / "nested" / "as.bmp")
    im.save(root / "nested" / "as.tiff")
    frames = [im.convert("P"), Image.new("RGB", im.size, (0, 0, 0)).convert("P")]
    frames[0].save(root / "animated.gif", save_all=True, append_images=frames[1:], duration=100)
    (root / "notes.jpg").write_text("this is not a JPEG\n")
    (root / "empty.jpg").write_bytes(b"")
    data = src[0].read_bytes()
    (root / "nested" / "truncated.jpg").write_bytes(data[: len(data) // 3])
    (root / "README.txt").write_text("not an image suffix: not listed\n")
    return root


BAD = {"photos/notes.jpg", "photos/empty.jpg", "photos/nested/truncated.jpg"}


def test_mixed_folder_recursive_jsonl(mixed_folder, tiny_model_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "captions.jsonl"
    rc = main(
        [
            "caption",
            "photos",
            "--recursive",
            "--output",
            str(out),
            "--model",
            str(tiny_model_file),
            "--workers",
            "2",
            "--batch-size",
            "4",
            "--beam-size",
            "3",
        ]
    )
    assert rc == 1  # some files failed
    records = read_jsonl(out)
    paths = [r["path"] for r in records]
    expected = sorted(
        str(p.relative_to(tmp_path))
        for p in mixed_folder.rglob("*")
        if p.is_file() and p.suffix != ".txt"
    )
    assert paths == expected  # input order, each once, paths as found under what was typed
    assert len(paths) == 13
    for r in records:
        if r["path"] in BAD:
            assert set(r) == {"path", "error"} and r["error"]
        else:
            assert "error" not in r
            assert isinstance(r["caption"], str) and r["caption"]
            assert r["caption"] == " ".join(r["words"])
            assert isinstance(r["score"], float) and r["score"] <= 0
    err = capsys.readouterr().err
    assert "captioned 10; failed 3" in err
    assert "photos/empty.jpg: the file is empty" in err
    assert "photos/notes.jpg: not an image file" in err
    assert "photos/nested/truncated.jpg: the image data is corrupt" in err

    # batched beam search over the folder gives what captioning each image alone gives
    from showattendtell.captioning.captioner import load_model

    captioner = load_model(tiny_model_file, "cpu")
    by_path = {r["path"]: r for r in records}
    for name in ("photos/as.png", "photos/nested/deeper/" + photos(5)[4].name):
        alone = captioner.caption([tmp_path / name], beam_size=3)[0]
        assert by_path[name]["caption"] == alone.caption
        assert by_path[name]["score"] == pytest.approx(alone.score, abs=1e-3)

    # without --recursive only the top folder
    rc = main(["caption", "photos", "-o", str(out), "--overwrite", *quick_run(tiny_model_file)])
    assert rc == 1
    assert [r["path"] for r in read_jsonl(out)] == [p for p in expected if p.count("/") == 1]


def test_csv_attention_and_overlays(tiny_model_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = photos(3)
    for p in src:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # header only
    args = [p.name for p in src] + ["broken.png"]
    rc = main(
        [
            "caption",
            *args,
            "-o",
            "out.csv",
            "--with-attention",
            "--overlays",
            "sheets",
            "--model",
            str(tiny_model_file),
            "--workers",
            "1",
            "--batch-size",
            "2",
        ]
    )
    assert rc == 1
    with open("out.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == args  # CSV chosen from the suffix; order as given
    grid = 2  # the tiny model's 64 px input gives a 2x2 grid
    for r in rows[:3]:
        words = r["caption"].split()
        att = np.array(json.loads(r["attention"]))
        assert att.shape == (len(words), grid, grid)
        np.testing.assert_allclose(att.sum(axis=(1, 2)), 1.0, atol=1e-3)  # soft attention
        assert float(r["score"]) <= 0 and r["error"] == ""
    assert rows[3]["caption"] == rows[3]["score"] == "" and rows[3]["error"]
    sheets = sorted(p.name for p in (tmp_path / "sheets").iterdir())
    assert sheets == sorted(f"{a}.png" for a in args[:3])
    for name in sheets:
        with Image.open(tmp_path / "sheets" / name) as im:
            assert im.format == "PNG" and im.width >= 200 and im.height >= 200


def test_stdout_jsonl_exit_0_and_exif(tiny_model_file, tmp_path, monkeypatch, capsys):
    """All captioned: exit 0, JSONL on stdout, and EXIF orientation applied before captioning."""
    monkeypatch.chdir(tmp_path)
    im = Image.open(photos(1)[0]).convert("RGB")
    im.save("upright.jpg", quality=95)
    # stored rotated, with EXIF orientation 6 ("rotate 90 clockwise to display"): same picture
    exif = Image.Exif()
    exif[0x0112] = 6
    im.transpose(Image.Transpose.ROTATE_90).save("rotated.jpg", quality=95, exif=exif)
    args = ["upright.jpg", "rotated.jpg", "--with-attention", *quick_run(tiny_model_file)]
    rc = main(["caption", *args])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    up, rot = (json.loads(x) for x in lines)
    assert (up["path"], rot["path"]) == ("upright.jpg", "rotated.jpg")
    assert rot["caption"] == up["caption"]
    np.testing.assert_allclose(rot["attention"], up["attention"], atol=0.05)


def test_hard_attention_output_has_locations(tiny_hard_model_file, tmp_path, monkeypatch, capsys):
    """Hard attention: one chosen (row, col) cell per word, in the grid, in JSONL and in CSV;
    with --hard-mode argmax the attention map of a word peaks at its location."""
    monkeypatch.chdir(tmp_path)
    src = photos(2)
    args = [
        "caption",
        *map(str, src),
        "--with-attention",
        "--model",
        str(tiny_hard_model_file),
        "--workers",
        "0",
        "--beam-size",
        "2",
        "--hard-mode",
        "argmax",
    ]
    assert main(args) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert main([*args, "-o", "out.csv"]) == 0
    with open("out.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    grid = 2
    for r, c in zip(rows, csv_rows, strict=True):
        n = len(r["words"])
        att = np.array(r["attention"])
        assert att.shape == (n, grid, grid) and len(r["locations"]) == n
        for (row, col), a in zip(r["locations"], att, strict=True):
            assert 0 <= row < grid and 0 <= col < grid
            assert a[row, col] == pytest.approx(a.max())
        assert json.loads(c["locations"]) == r["locations"] and c["caption"] == r["caption"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing_folder"], "no such file or folder: missing_folder"),
        (["."], "no image files found"),
        ([".", "--format", "xml"], "--format must be one of jsonl, csv"),
        ([".", "--resume"], "--resume needs --output"),
        ([".", "--batch-size", "0"], "--batch-size must be at least 1"),
        ([".", "--lanes", "0"], "--lanes must be at least 1"),
    ],
)
def test_usage_errors_exit_2(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["caption", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    with pytest.raises(SystemExit) as e:
        main(["caption", ".", "--no-such-option"])
    assert e.value.code == 2


def test_resume_drops_truncated_line(tiny_model_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    names = []
    for p in photos(4):
        shutil.copy(p, tmp_path / p.name)
        names.append(p.name)
    out = tmp_path / "out.jsonl"
    model = quick_run(tiny_model_file)
    assert main(["caption", *names[:2], "-o", "out.jsonl", *model]) == 0
    first = out.read_text()
    with open(out, "a") as f:  # as if killed in the middle of writing the third line
        f.write('{"path": "' + names[2] + '", "capt')
    point = scan_output(out, "jsonl", with_attention=False)
    assert point.done == Counter(names[:2]) and point.keep_bytes == len(first.encode())
    assert main(["caption", *names, "-o", "out.jsonl", "--resume", *model]) == 0
    records = read_jsonl(out)
    assert [r["path"] for r in records] == names
    assert out.read_text().startswith(first)  # what was there is kept as it was
    assert "skipped 2 already in out.jsonl" in capsys.readouterr().err
    assert main(["caption", *names, "-o", "out.jsonl", "--resume", *model]) == 0  # nothing to do
    assert len(read_jsonl(out)) == 4
    out.write_text("not json\n")
    assert main(["caption", *names, "-o", "out.jsonl", "--resume", *model]) == 2


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return start_sat(["caption", *args], cwd, start_new_session=True)


@pytest.mark.slow
def test_interrupt_kill_and_resume(tiny_model_file, tmp_path, monkeypatch):
    """Killed (SIGKILL), then interrupted (Ctrl-C), then resumed: every image exactly once."""
    folder = tmp_path / "many"
    (folder / "sub").mkdir(parents=True)
    all_photos = photos(24)
    for i, p in enumerate(all_photos):
        shutil.copy(p, (folder / "sub" if i % 3 == 0 else folder) / p.name)
    out = tmp_path / "out.jsonl"
    # one image a batch and the overlay sheets keep the run slow enough to stop it midway
    args = ["many", "-r", "-o", "out.jsonl", *slow_run(tiny_model_file)]

    proc = _start(args, tmp_path)
    wait_for_records(out, 3, proc, timeout=240)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    after_kill = read_jsonl(out)
    assert 3 <= len(after_kill) < 24

    proc = _start([*args, "--resume"], tmp_path)
    wait_for_records(out, len(after_kill) + 3, proc, timeout=240)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    after_int = read_jsonl(out)
    assert after_int[: len(after_kill)] == after_kill
    assert len(after_kill) + 3 <= len(after_int) < 24

    monkeypatch.chdir(tmp_path)
    assert main(["caption", *args, "--resume"]) == 0
    records = read_jsonl(out)
    paths = [r["path"] for r in records]
    assert len(paths) == len(set(paths)) == 24
    assert set(paths) == {str(p.relative_to(tmp_path)) for p in folder.rglob("*.jpg")}
    assert all(r["caption"] for r in records)
    # an overlay is written before its line: a killed run's extra one is overwritten, not doubled
    assert len(list((tmp_path / "sheets").iterdir())) == 24


@pytest.mark.slow
def test_a_second_process_on_the_same_output_is_refused(
    tiny_model_file, tmp_path, monkeypatch, capsys
):
    """Two `sat caption` processes given one --output: the second stops in one line while the
    first goes on, and the file ends with every image once (not both writers' records)."""
    folder = tmp_path / "few"
    folder.mkdir()
    for p in photos(8):
        shutil.copy(p, folder / p.name)
    out = tmp_path / "out.jsonl"
    args = ["few", "-o", "out.jsonl", *slow_run(tiny_model_file, workers=0)]
    proc = _start(args, tmp_path)
    try:
        wait_for_records(out, 1, proc, timeout=240)
        monkeypatch.chdir(tmp_path)
        for extra in ([], ["--resume"]):
            assert main(["caption", *args, *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert "is being written by another `sat caption` run" in err and "\n" not in err
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    paths = [r["path"] for r in read_jsonl(out)]
    assert sorted(paths) == sorted(f"few/{p.name}" for p in photos(8))


@pytest.mark.slow
def test_sigterm_says_how_to_resume(tiny_model_file, tmp_path, monkeypatch):
    """`kill PID` (a scheduler's preemption) stops the run as Ctrl-C does, exit 143, and the
    printed command finishes it; --overwrite is left out of it (it would start again)."""
    import shlex

    folder = tmp_path / "many"
    folder.mkdir()
    for p in photos(12):
        shutil.copy(p, folder / p.name)
    out = tmp_path / "out.jsonl"
    out.write_text("old results\n")
    args = ["many", "-o", "out.jsonl", "--overwrite", *slow_run(tiny_model_file)]
    proc = _start(args, tmp_path)
    try:
        wait_for_records(out, 3, proc, timeout=240)
        os.kill(proc.pid, signal.SIGTERM)  # the process only, as `kill PID` does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "interrupted with" in err and "Traceback" not in err
    command = err.split("resume with:\n", 1)[1].strip().splitlines()[0]
    argv = shlex.split(command)
    assert argv[:2] == ["sat", "caption"] and argv[-1] == "--resume"
    assert "--overwrite" not in argv
    first = read_jsonl(out)
    assert 3 <= len(first) < 12
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    paths = [r["path"] for r in read_jsonl(out)]
    assert paths[: len(first)] == [r["path"] for r in first]
    assert sorted(paths) == sorted(f"many/{p.name}" for p in photos(12))


def test_paths_from_standard_input_and_urls(tiny_model_file, tmp_path, monkeypatch, capsys):
    """`-` reads paths, one per line; a listed file that is gone gets an error record (a typed
    one is a usage error); a web address is refused in one line before any work."""
    import io

    monkeypatch.chdir(tmp_path)
    names = []
    for p in photos(2):
        shutil.copy(p, tmp_path / p.name)
        names.append(p.name)
    listed = f"{names[0]}\n\n{names[1]}\r\ngone.jpg\n".encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(listed)))
    model = quick_run(tiny_model_file)
    assert main(["caption", "-", "-o", "out.jsonl", *model]) == 1
    records = read_jsonl(tmp_path / "out.jsonl")
    assert [r["path"] for r in records] == [*names, "gone.jpg"]
    assert records[2]["error"] == "no such file"
    capsys.readouterr()
    for url in ("https://example.com/dog.jpg", "http://example.com/a.png"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(url.encode())))
        for argv in ([url], ["-"]):
            assert main(["caption", *argv, *model]) == 2
            err = capsys.readouterr().err.strip()
            assert err == (
                f"error: {url} is a web address: download it first (e.g. curl -O "
                "URL), then caption the file"
            )
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    assert main(["caption", "-", *model]) == 2
    assert "no image paths on standard input" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_file_names_that_are_not_utf8(fmt, tiny_model_file, tmp_path, monkeypatch, capsys):
    """Linux file names are bytes: one that is not UTF-8 is recorded in the escaped form
    (each such byte as the text \\xNN), so the output stays UTF-8 and strict JSON, and
    --resume recognises it (nothing captioned twice)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "photos"
    folder.mkdir()
    raw = b"caf\xe9 \xff.jpg"
    shutil.copy(photos(1)[0], folder / os.fsdecode(raw))
    assert raw in os.listdir(os.fsencode(folder))
    shutil.copy(photos(2)[1], folder / "plain.jpg")
    out = f"out.{fmt}"
    model = quick_run(tiny_model_file)
    assert main(["caption", "photos", "-o", out, *model]) == 0
    text = (tmp_path / out).read_bytes().decode("utf-8")  # strict: valid UTF-8
    if fmt == "jsonl":
        rows = [json.loads(line) for line in text.splitlines()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    assert sorted(r["path"] for r in rows) == ["photos/caf\\xe9 \\xff.jpg", "photos/plain.jpg"]
    assert all(r["caption"] for r in rows)
    capsys.readouterr()
    assert main(["caption", "photos", "-o", out, "--resume", *model]) == 0
    assert "nothing to do: all 2 images" in capsys.readouterr().err
    assert main(["caption", "photos", *model, "--format", fmt]) == 0  # standard output too
    out_text = capsys.readouterr().out
    assert "caf\\\\xe9 \\\\xff.jpg" in out_text or "caf\\xe9 \\xff.jpg" in out_text


def test_a_folder_of_phone_photos_and_other_files(tiny_model_file, tmp_path, monkeypatch, capsys):
    """HEIC photos are captioned like JPEGs; the files a folder scan leaves out are counted."""
    pillow_heif = pytest.importorskip("pillow_heif")
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "phone"
    folder.mkdir()
    src = photos(2)
    shutil.copy(src[0], folder / "a.jpg")
    with Image.open(src[1]) as im:
        pillow_heif.from_pillow(im.convert("RGB")).save(folder / "b.heic", quality=90)
    (folder / "notes.txt").write_text("not a photo\n")
    (folder / "scan.pdf").write_bytes(b"%PDF-1.4\n")
    assert main(["caption", "phone", "-o", "out.jsonl", *quick_run(tiny_model_file)]) == 0
    records = read_jsonl(tmp_path / "out.jsonl")
    assert [r["path"] for r in records] == ["phone/a.jpg", "phone/b.heic"]
    assert all(r["caption"] and "error" not in r for r in records)
    err = capsys.readouterr().err
    assert "warning: phone: skipped 2 files not named as images (.pdf: 1, .txt: 1)" in err


def test_sheets_are_named_after_the_file():
    """Folders are added only where file names clash (also by case only)."""
    names = overlay_names(
        [
            "/home/me/pictures/x.jpg",
            "2023/a.jpg",
            "2024/a.jpg",
            "trip/2023/b.jpg",
            "home/2023/b.jpg",
            "c.jpg",
            "C.JPG",
            "./c.jpg",
        ]
    )
    assert list(names.values()) == [
        "x.jpg.png",
        "2023__a.jpg.png",
        "2024__a.jpg.png",
        "trip__2023__b.jpg.png",
        "home__2023__b.jpg.png",
        "c.jpg.png",
        "C.JPG-2.png",
        "c.jpg-3.png",
    ]


@pytest.mark.parametrize(
    ("device", "photos", "extra", "expected"),
    [
        ("auto", 1, {}, "cpu"),
        ("auto", 32, {}, "cpu"),
        ("auto", 33, {}, "auto"),  # resolved to the GPU by load_model
        ("cuda", 1, {}, "cuda"),
        ("auto", 1, {"decode_on": "gpu"}, "auto"),
        ("auto", 1, {"precision": "16"}, "auto"),
    ],
)
def test_a_few_photos_are_captioned_on_the_cpu_of_a_gpu_machine(
    device, photos, extra, expected, monkeypatch, capsys
):
    """--device auto: starting a GPU takes seconds, more than a few photos take on the CPU."""
    import argparse

    import torch

    from showattendtell.captioning.distributed import Processes
    from showattendtell.cli import caption_job as caption

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(device=device, decode_on="cpu", precision="32")
    vars(args).update(extra)
    assert caption._device(args, photos, Processes(1, 1, "cpu")) == expected
    said = capsys.readouterr().err
    assert ("on the CPU" in said) == (expected == "cpu" and device == "auto")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert caption._device(args, photos, Processes(1, 1, "cpu")) == device


@pytest.mark.parametrize("argv", [["-dash.jpg"], ["x.jpg", "-dash.jpg"], ["x.jpg", "-rose.jpg"]])
def test_a_photo_whose_name_starts_with_a_dash(
    argv, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """argparse takes `-dash.jpg` for an unknown option (and `-rose.jpg` for -r -o se.jpg): the
    error says what to type instead, and both ways it says work."""
    monkeypatch.chdir(tmp_path)
    for name in ("x.jpg", "-dash.jpg", "-rose.jpg"):
        shutil.copy(photos(1)[0], tmp_path / name)
    with pytest.raises(SystemExit) as stop:
        main(["caption", *argv, *quick_run(tiny_model_file)])
    assert stop.value.code == 2
    name = argv[-1]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"sat caption: error: {name} is read as an option; for a file whose name starts with -, "
        f"write ./{name}, or put -- before it (after the options): sat caption -- {name}"
    )
    for paths in (["--", name], [f"./{name}"]):
        assert main(["caption", *quick_run(tiny_model_file), *paths]) == 0
        [record] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert record["path"] == name and record["caption"]  # as found: Path drops "./"
