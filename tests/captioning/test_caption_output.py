"""`sat caption --resume` and the output file: a file that is not ours is never changed, and the
only thing a resume may remove is one partial last record."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from helpers.disk import filling
from helpers.photos import write_photos

from showattendtell.captioning.records import (
    Writer,
    check_made_by,
    get_output_format,
    list_output_formats,
    output_format,
    scan_output,
)
from showattendtell.cli.main import main
from showattendtell.outputs import OutputError


@pytest.fixture
def images(tmp_path: Path) -> list[str]:
    """Three photos' names, relative to tmp_path (the tests run there)."""
    return [Path(p).name for p in write_photos(tmp_path, 3, seed=3, name="img{i}.png")]


def caption(tmp_path, monkeypatch, model: Path, *args: str) -> int:
    monkeypatch.chdir(tmp_path)
    return main(["caption", *args, "--model", str(model), "--workers", "0", "--beam-size", "1"])


@pytest.mark.parametrize(
    "name,content",
    [
        ("notes.txt", b"notes\nlast line"),  # a last line without a newline is kept
        ("notes.jsonl", b"notes"),  # one line, no newline: not a partial record
        ("one.jsonl", b'{"a": 1}'),  # JSON, but not a record of ours
        ("two.jsonl", b'{"path": "x.jpg", "caption": "a dog"}\nnot json\n'),
        ("blank.csv", b"\n\n"),
        ("table.csv", b"name,value\nx,1\n"),
        ("jsonl.csv", b'{"path": "x.jpg", "caption": "a dog", "score": -1.0}\n'),
        ("csv.jsonl", b"path,caption,score,log_prob,error,warning\nx.jpg,a dog,-1.0,-1.0,,\n"),
        (
            "partial.csv",
            b"path,caption,score,log_prob,error,warning\nx.jpg,a dog,-1,-1,,\n"
            b"some,thing,that,has,too,many,columns",
        ),
        ("columns.csv", b"path,caption,score,log_prob,error,warning\nx.jpg,a dog\n"),
    ],
)
def test_resume_refuses_a_foreign_file_and_leaves_its_bytes(
    name, content, images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    out = tmp_path / name
    out.write_bytes(content)
    fmt = ["--format", "csv" if name.endswith(".csv") else "jsonl"]
    assert (
        caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", name, *fmt, "--resume") == 2
    )
    assert out.read_bytes() == content
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume:") and "\n" not in err and "left as it was" in err


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_resume_removes_only_a_partial_last_record(
    fmt, images, tiny_model_file, tmp_path, monkeypatch
):
    name = f"out.{fmt}"
    out = tmp_path / name
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images[:2], "-o", name) == 0
    first = out.read_bytes()
    partial = b'{"path": "img2.png", "capt' if fmt == "jsonl" else b'img2.png,"a red squ'
    out.write_bytes(first + partial)  # killed in the middle of writing the third record
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", name, "--resume") == 0
    data = out.read_bytes()
    rest = data[len(first) :]  # what was there is kept as it was; the tail is replaced whole
    assert data.startswith(first) and rest.count(b"\n") == 1 and rest.endswith(b"\n")
    if fmt == "jsonl":
        assert [json.loads(x)["path"] for x in data.decode().splitlines()] == images
    else:
        assert [x.split(",")[0] for x in data.decode().splitlines()[1:]] == images


def test_resume_keeps_a_file_written_without_the_warning_column(
    images, tiny_model_file, tmp_path, monkeypatch
):
    out = tmp_path / "old.csv"
    old = b"path,caption,score,log_prob,error\nimg0.png,a red circle,-1.0,-2.0,\n"
    out.write_bytes(old)
    assert (
        caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "old.csv", "--resume") == 0
    )
    data = out.read_bytes()
    lines = data.decode().splitlines()
    assert data.startswith(old) and len(lines) == 4
    assert all(len(x.split(",")) == 5 for x in lines)  # the file's own layout is kept


def test_resume_refuses_other_attention_options(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "att.jsonl"
    assert (
        caption(
            tmp_path, monkeypatch, tiny_model_file, images[0], "-o", "att.jsonl", "--with-attention"
        )
        == 0
    )
    before = out.read_bytes()
    assert (
        caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "att.jsonl", "--resume") == 2
    )
    assert out.read_bytes() == before
    assert "with --with-attention" in capsys.readouterr().err


def test_csv_records_with_newlines_in_file_names(tmp_path):
    out = tmp_path / "nl.csv"
    good = (
        'path,caption,score,log_prob,error,warning\n"a\nb.jpg",a dog,-1,-1,,\n'
        '"c\n.jpg",a cat,-1,-1,,\n'
    )
    out.write_text(good + '"d\nx.jpg",a b')
    point = scan_output(out, "csv", with_attention=False)
    assert point.done == Counter(["a\nb.jpg", "c\n.jpg"]) and point.keep_bytes == len(good.encode())
    assert out.read_text() == good + '"d\nx.jpg",a b'  # scanning changes nothing


def test_scan_accepts_a_partial_first_record(tmp_path):
    out = tmp_path / "p.jsonl"
    out.write_bytes(b'{"pa')
    assert scan_output(out, "jsonl", False).keep_bytes == 0
    out = tmp_path / "p.csv"
    out.write_bytes(b"path,capt")
    assert scan_output(out, "csv", False).keep_bytes == 0
    out.write_bytes(b"pathology")
    with pytest.raises(OutputError):
        scan_output(out, "csv", False)


def test_unwritable_output_and_overlay_folders(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    for args in (["-o", "/proc/forbidden/x.jsonl"], ["--overlays", "/proc/forbidden/sheets"]):
        assert caption(tmp_path, monkeypatch, tiny_model_file, *images, *args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: cannot create the folder") and "\n" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_full_disk_is_one_line(images, tiny_model_file, tmp_path, monkeypatch, capsys):
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "/dev/full") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot write to /dev/full: No space left on device")
    assert not any("Traceback" in line for line in err)


def test_outputs_are_strict_json(images, tiny_model_file, tmp_path, monkeypatch, capsys):
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "--length-penalty", "nan") == 2
    assert "length penalty" in capsys.readouterr().err
    assert (
        caption(
            tmp_path, monkeypatch, tiny_model_file, *images, "--with-attention", "--beam-size", "3"
        )
        == 0
    )
    for line in capsys.readouterr().out.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON: {c}"))


def test_a_lock_removes_only_its_own_empty_file(tmp_path):
    """The file a lock made goes when nothing was written to it; a file put at the path since
    (the first one removed, as `sat evaluate` removes its partial file) is another run's."""
    pytest.importorskip("fcntl")
    from showattendtell.outputs import OutputLock

    out = tmp_path / "out.jsonl"
    OutputLock(out).release()
    assert not out.exists()
    lock = OutputLock(out)
    out.unlink()
    out.write_bytes(b"")  # another run's file, empty so far
    lock.release()
    assert out.exists()


def test_a_second_run_on_the_same_output_stops_in_one_line(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """While a run holds --output (here: a lock taken as a running `sat caption` takes it), a
    second run on that file, fresh or --resume, exits 2 in one line and leaves it byte for byte."""
    pytest.importorskip("fcntl")
    from showattendtell.outputs import OutputLock

    out = tmp_path / "out.jsonl"
    assert caption(tmp_path, monkeypatch, tiny_model_file, images[0], "-o", "out.jsonl") == 0
    before = out.read_bytes()
    capsys.readouterr()
    held = OutputLock(out)
    try:
        for extra in ([], ["--resume"]):
            assert (
                caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "out.jsonl", *extra)
                == 2
            )
            err = capsys.readouterr().err.strip()
            assert (
                err.startswith(
                    "error: --output out.jsonl is being written by another `sat caption` run"
                )
                and "\n" not in err
            )
            assert out.read_bytes() == before
    finally:
        held.release()
    assert out.read_bytes() == before  # releasing a lock on a file it did not create keeps it
    assert (
        caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "out.jsonl", "--resume") == 0
    )
    assert len(out.read_text().splitlines()) == 3


def test_a_run_that_stops_before_captioning_leaves_no_output_file(
    images, tmp_path, monkeypatch, capsys
):
    """The lock creates the output file; a run that fails before its first record (here: a
    model file that does not exist) removes it again, and a file that was there stays."""
    assert (
        caption(tmp_path, monkeypatch, tmp_path / "none.safetensors", *images, "-o", "new.jsonl")
        == 2
    )
    assert not (tmp_path / "new.jsonl").exists()
    (tmp_path / "old.jsonl").write_bytes(b"")
    assert (
        caption(tmp_path, monkeypatch, tmp_path / "none.safetensors", *images, "-o", "old.jsonl")
        == 2
    )
    assert (tmp_path / "old.jsonl").exists()
    capsys.readouterr()


@pytest.mark.parametrize("content", [b"my notes\n", b'{"path": "img0.png", "caption": "a"}\n'])
def test_an_existing_output_is_refused_without_resume_or_overwrite(
    content, images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """A notes file, or the output of an interrupted run, is never truncated by a run that was
    not told to replace it; --overwrite replaces it, an empty file needs no option."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "out.jsonl") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --output out.jsonl already exists") and "\n" not in err
    assert "--resume" in err and "--overwrite" in err
    assert out.read_bytes() == content
    assert (
        caption(
            tmp_path,
            monkeypatch,
            tiny_model_file,
            *images,
            "-o",
            "out.jsonl",
            "--overwrite",
            "--resume",
        )
        == 2
    )
    assert "give one" in capsys.readouterr().err
    assert out.read_bytes() == content
    assert (
        caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "out.jsonl", "--overwrite")
        == 0
    )
    assert [json.loads(x)["path"] for x in out.read_text().splitlines()] == images
    out.write_bytes(b"")
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "out.jsonl") == 0
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("spelling", ["img1.png", "sub/../img1.png", "link.png"])
def test_an_output_that_is_one_of_the_photos_is_refused_even_with_overwrite(
    spelling, images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """`-o photo.jpg --overwrite` would empty the photo before reading it. (Without --format,
    its suffix is refused first.)"""
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.png").symlink_to(tmp_path / "img1.png")
    photo = (tmp_path / "img1.png").read_bytes()
    for inputs in (images, ["."]):  # the photo given, or found in a folder
        for fmt, message in (([], "the format is taken from"), (["--format", "csv"], "is one of")):
            args = (*inputs, "-o", spelling, *fmt, "--overwrite")
            assert caption(tmp_path, monkeypatch, tiny_model_file, *args) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"error: --output {spelling}") and "\n" not in err
            assert message in err
            assert (tmp_path / "img1.png").read_bytes() == photo


def test_overlay_sheets_replace_no_photo_and_no_file_without_overwrite(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """A sheet is named after its photo (img0.png -> img0.png.png): in the photos' own folder it
    could be another photo, and elsewhere a file of the user's."""
    (tmp_path / "img0.png.png").write_bytes((tmp_path / "img1.png").read_bytes())
    photos = {p.name: p.read_bytes() for p in tmp_path.glob("*.png")}
    for extra in ([], ["--overwrite"]):
        assert caption(tmp_path, monkeypatch, tiny_model_file, ".", "--overlays", ".", *extra) == 2
        err = capsys.readouterr().err.strip()
        assert "a sheet would replace the photo" in err and "\n" not in err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.png")} == photos

    (tmp_path / "sheets").mkdir()
    mine = tmp_path / "sheets" / "img2.png.png"
    mine.write_bytes(b"my own file")
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "--overlays", "sheets") == 2
    err = capsys.readouterr().err.strip()
    assert "1 of the sheets to write already exist (e.g. img2.png.png)" in err
    assert "--overwrite" in err and "\n" not in err
    assert mine.read_bytes() == b"my own file" and len(list(mine.parent.iterdir())) == 1
    args = (*images, "--overlays", "sheets", "--overwrite")
    assert caption(tmp_path, monkeypatch, tiny_model_file, *args) == 0
    assert mine.read_bytes().startswith(b"\x89PNG") and len(list(mine.parent.iterdir())) == 3


@pytest.mark.parametrize("device", ["gpu", "CPU", "", "mps", "cuda:x"])
def test_an_unknown_device_is_one_usage_line(device, images, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["caption", *images, "--device", device])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"'{device}' is not a device: give auto, cpu, cuda or cuda:N")


def test_too_long_a_file_name_is_one_line(images, tiny_model_file, tmp_path, monkeypatch, capsys):
    long = "x" * 300
    for args in (["-o", f"{long}.jsonl"], ["--overlays", long]):
        assert caption(tmp_path, monkeypatch, tiny_model_file, *images, *args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "too long" in err.lower() and "\n" not in err


def test_output_dash_is_standard_output(images, tiny_model_file, tmp_path, monkeypatch, capsys):
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "-") == 0
    assert [json.loads(x)["path"] for x in capsys.readouterr().out.splitlines()] == images
    assert not (tmp_path / "-").exists()


def test_one_name_for_output_and_overlays_is_one_usage_line(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    args = (*images, "-o", "sheets", "--overlays", "./sheets")
    assert caption(tmp_path, monkeypatch, tiny_model_file, *args) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: -o is a file and --overlays a folder: give them different names"
    assert not (tmp_path / "sheets").exists()


def test_hard_mode_for_a_soft_model_is_a_warning(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "--hard-mode", "sample") == 0
    err = capsys.readouterr().err
    assert "warning: --hard-mode is for hard-attention models;" in err
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images) == 0
    assert "--hard-mode" not in capsys.readouterr().err


def test_resume_tells_apart_two_names_that_print_alike(
    images, tiny_model_file, tmp_path, monkeypatch
):
    """A byte that is not UTF-8 is recorded as its escape, \\xNN: beside a name that holds
    those four characters, both print alike. Records are in input order, so the first of them
    is done when the file holds one such record, and the other is captioned."""
    odd = os.path.join(os.fsencode(tmp_path), b"bad\xfe.png")
    with open(odd, "wb") as f:
        f.write((tmp_path / "img1.png").read_bytes())
    (tmp_path / "bad\\xfe.png").write_bytes((tmp_path / "img2.png").read_bytes())
    alike = sorted(
        os.fsdecode(n) for n in os.listdir(os.fsencode(tmp_path)) if n.startswith(b"bad")
    )
    assert caption(tmp_path, monkeypatch, tiny_model_file, alike[0], "-o", "out.jsonl") == 0
    args = (*alike, "-o", "out.jsonl", "--resume")
    assert caption(tmp_path, monkeypatch, tiny_model_file, *args) == 0
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["path"] for r in records] == ["bad\\xfe.png"] * 2
    assert (
        records[0]["caption"] != records[1]["caption"] or records[0]["score"] != records[1]["score"]
    )
    assert caption(tmp_path, monkeypatch, tiny_model_file, *args) == 0  # nothing left to do
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


DECODING = {  # the tests' tiny model at --beam-size 1: its stored settings for the rest
    "beam_size": 1,
    "max_length": 8,
    "length_penalty": 0.0,
    "no_repeat_ngram": 0,
    "min_length": 0,
    "precision": "32",
    "decode_on": "cpu",
}


def made_by(model_file: Path) -> dict:
    """What a record of `sat caption --model MODEL_FILE --beam-size 1` says made it."""
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()
    return {"model": model_file.stem, "model_sha256": digest, "decoding": DECODING}


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_resume_adds_no_captions_of_another_model_or_other_options(
    fmt, images, tiny_model_file, tiny_hard_model_file, tmp_path, monkeypatch, capsys
):
    """Every caption record says what made it (model, decoding options, precision), and
    --resume refuses to mix: one line, exit 2, the file left as it was. Options are compared
    as used, so the same ones spelt otherwise (a stored value given, --hard-mode for a soft
    model, which ignores it) continue it."""
    name = f"out.{fmt}"
    out = tmp_path / name
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images[:2], "-o", name) == 0
    assert scan_output(out, fmt, False).made_by == [made_by(tiny_model_file)]
    before = out.read_bytes()
    capsys.readouterr()
    soft = ("--model", str(tiny_model_file))
    for args, theirs, ours in (
        (
            ("--model", str(tiny_hard_model_file), "--beam-size", "1"),
            "model tiny",
            "model tiny_hard",
        ),
        ((*soft, "--beam-size", "2"), "model tiny, --beam-size 1", "model tiny, --beam-size 2"),
        (soft, "model tiny, --beam-size 1", "model tiny, --beam-size 3"),  # the stored beam
        (
            (*soft, "--beam-size", "1", "--precision", "bf16"),
            "model tiny, --precision 32",
            "model tiny, --precision bf16",
        ),
    ):
        rc = main(["caption", *images, "-o", name, "--resume", "--workers", "0", *args])
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: --resume: {name} holds captions made with {theirs}; this run would add "
            f"captions made with {ours}: give the same --model and decoding options to continue "
            "it, or write a new file (another --output, or --overwrite instead of --resume)"
        )
        assert out.read_bytes() == before
    same = (*soft, "--beam-size", "1", "--max-length", "8", "--hard-mode", "sample")
    assert main(["caption", *images, "-o", name, "--resume", "--workers", "0", *same]) == 0
    assert out.read_bytes().startswith(before)
    point = scan_output(out, fmt, False)
    want = [made_by(tiny_model_file)]
    assert point.made_by == want and point.unmarked == 0 and sum(point.done.values()) == 3


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_resume_continues_a_file_that_does_not_say_what_made_it(
    fmt, images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """A file written before records said what made them: one warning, then on as before."""
    name = f"old.{fmt}"
    out = tmp_path / name
    if fmt == "jsonl":
        old = (
            b'{"path": "img0.png", "caption": "a red circle", "score": -1.0, "log_prob": -1.0, '
            b'"words": ["a", "red", "circle"], "familiarity": null}\n'
        )
    else:
        old = b"path,caption,score,log_prob,error,warning,familiarity\nimg0.png,a circle,-1,-1,,,\n"
    out.write_bytes(old)
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", name, "--resume") == 0
    err = capsys.readouterr().err
    warning = (
        f"warning: --resume: {name} was written by an older `sat caption`: 1 caption in it "
        "does not say which model and decoding options made it; continuing it, so make sure "
        "they were this run's\n"
    )
    assert err.count("warning:") == 1 and warning in err
    data = out.read_bytes()
    new = data[len(old) :].decode().splitlines()
    assert data.startswith(old) and len(new) == 2
    if fmt == "jsonl":  # the new records say it
        want = made_by(tiny_model_file)
        assert [{k: json.loads(x)[k] for k in want} for x in new] == [want] * 2
    else:  # the file's own layout is kept
        assert [len(row) for row in csv.reader(new)] == [7, 7]


def test_resume_compares_the_decoding_options_both_name():
    ours = {"model": "m", "model_sha256": "ab" * 32, "decoding": {"beam_size": 3, "new": 1}}
    older = {"model": "m", "decoding": {"beam_size": 3}}  # from before "new" and the digest
    check_made_by(Path("o.jsonl"), [older], ours)
    mixed = [older, {"model": "m", "decoding": {"beam_size": 1}}]  # e.g. two files joined
    with pytest.raises(OutputError, match="made with model m, --beam-size 1; this run"):
        check_made_by(Path("o.jsonl"), mixed, ours)
    gpu = {**ours, "decoding": {**ours["decoding"], "decode_on": "gpu"}}
    with pytest.raises(OutputError, match="made with model m, --decode-on gpu; this run"):
        check_made_by(
            Path("o.jsonl"), [gpu], {**ours, "decoding": {**gpu["decoding"], "decode_on": "cpu"}}
        )


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_resume_tells_two_model_files_of_one_name_apart(
    fmt, images, tiny_model_file, tiny_hard_model_file, tmp_path, monkeypatch, capsys
):
    """Two trainings exported under one name (runs/a/best.safetensors, runs/b/...): the
    records carry the file's SHA-256, and --resume with the other file is refused."""
    other = tmp_path / "other" / tiny_model_file.name
    other.parent.mkdir()
    shutil.copy(tiny_hard_model_file, other)  # another model, the same name
    name = f"out.{fmt}"
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images[:2], "-o", name) == 0
    before = (tmp_path / name).read_bytes()
    capsys.readouterr()
    assert caption(tmp_path, monkeypatch, other, *images, "-o", name, "--resume") == 2
    ours, theirs = (
        hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in (other, tiny_model_file)
    )
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: --resume: {name} holds captions made with model tiny (file SHA-256 {theirs}...); "
        f"this run would add captions made with model tiny (file SHA-256 {ours}...): "
    )
    assert (tmp_path / name).read_bytes() == before


@pytest.mark.parametrize(
    "name, given, message",
    [
        ("x.csv.gz", [], "`sat caption` writes no compressed files; write x.csv and compress it"),
        ("x.csv.gz", ["--format", "csv"], "writes no compressed files; write x.csv and"),
        ("x.jsonl.bz2", [], "writes no compressed files; write x.jsonl and"),
        (
            "x.txt",
            [],
            "the format is taken from the suffix, .jsonl or .csv, not .txt; rename it, or give "
            "--format jsonl or --format csv",
        ),
        ("x.JSON", [], "not .json;"),
    ],
)
def test_an_output_suffix_that_names_no_format_is_refused(
    name, given, message, images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    """`-o x.csv.gz` wrote an uncompressed JSON Lines file."""
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", name, *given) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --output {name}: ") and message in err and "\n" not in err
    assert not (tmp_path / name).exists()


def test_the_output_format_follows_the_suffix_or_format():
    assert output_format("x.CSV", None) == "csv" and output_format("a.b.jsonl", None) == "jsonl"
    assert output_format("x.txt", "csv") == "csv"  # --format names it: any name
    assert output_format("captions", None) == output_format("/dev/null", None) == "jsonl"
    assert output_format(None, None) == "jsonl"  # standard output
    with pytest.raises(OutputError, match="--format must be one of jsonl, csv, not 'xml'"):
        output_format("x.jsonl", "xml")


def test_resume_continues_a_csv_written_before_the_sha256_column(
    images, tiny_model_file, tmp_path, monkeypatch
):
    """A CSV with the model and decoding columns but no model_sha256 (an earlier version's):
    compared by name and options, continued in its own layout."""
    out = tmp_path / "old.csv"
    decoding = {k: v for k, v in DECODING.items() if k != "decode_on"}  # not recorded then
    header = "path,caption,score,log_prob,error,warning,familiarity,model,decoding\n"
    row = [images[0], "a circle", "-1", "-1", "", "", "", "tiny", json.dumps(decoding)]
    with out.open("w", newline="") as f:
        f.write(header)
        csv.writer(f, lineterminator="\n").writerow(row)
    old = out.read_bytes()
    assert (
        caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", "old.csv", "--resume") == 0
    )
    data = out.read_bytes()
    new = list(csv.reader(data[len(old) :].decode().splitlines()))
    assert data.startswith(old) and len(new) == len(images) - 1
    assert {len(r) for r in new} == {9} and {r[7] for r in new} == {"tiny"}


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_disk_full_mid_record_leaves_only_whole_records(fmt, tmp_path, monkeypatch):
    """Any reader of the file, not only --resume, finds whole records: the one the disk cut
    is taken back out before the error is reported."""
    from showattendtell.captioning import records
    from showattendtell.captioning.records import Writer

    path = tmp_path / f"out.{fmt}"
    path.write_text("")
    filling(monkeypatch, records, whole=1)
    writer = Writer(fmt, False, records.open_output(path, None))
    writer.write_line("first whole record\n")
    with pytest.raises(OSError) as e:
        writer.write_line("a second record, longer than the room that is left\n")
    assert e.value.errno == errno.ENOSPC
    writer.stream.close()
    assert path.read_text() == "first whole record\n"


def test_sat_caption_on_a_disk_that_fills_keeps_whole_records(
    images, tiny_model_file, tmp_path, monkeypatch, capsys
):
    from showattendtell.cli import caption_job as caption_command

    out = tmp_path / "out.jsonl"
    filling(monkeypatch, caption_command, whole=2)
    assert caption(tmp_path, monkeypatch, tiny_model_file, *images, "-o", str(out)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: cannot write to {out}: No space left on device")
    assert "--resume" in err[-1] and not any("Traceback" in line for line in err)
    kept = out.read_text().splitlines(keepends=True)
    assert len(kept) == 2 and all(json.loads(line)["path"] for line in kept)
    assert all(line.endswith("\n") for line in kept)


@pytest.mark.parametrize("fmt", list_output_formats())
def test_every_registered_output_format_is_written_and_read_back(fmt, tmp_path):
    """The registry's entry is the format: its suffix picks it, the Writer writes its header
    and lines, and its scanner (--resume) reads back every record and what made it, and cuts
    only a partial last record."""
    import numpy as np

    from showattendtell.captioning.captioner import CaptionResult
    from showattendtell.captioning.pipeline import Record

    spec = get_output_format(fmt)
    assert output_format(f"out{spec.suffix}", None) == fmt == output_format("out", fmt)
    result = CaptionResult("a red circle", ["a", "red", "circle"], -1.5, -1.5,
                           np.full((3, 2, 2), 0.25), None, [("a red circle", -1.5)])  # fmt: skip
    made = {"model": "tiny", "decoding": {"beam_size": 1, "min_length": 2}}
    out = tmp_path / f"out{spec.suffix}"
    with open(out, "wb") as stream:
        writer = Writer(fmt, False, stream, made_by=made)
        writer.header()
        writer.write(Record("a.png", result))
        writer.write(Record("b, c.png", error="cannot decode"))
        whole = out.stat().st_size
        writer.write(Record("d.png", result))
    out.write_bytes(out.read_bytes()[: whole + 5])  # a kill in the middle of the last record
    point = scan_output(out, fmt, False)
    assert point.done == Counter({"a.png": 1, "b, c.png": 1}) and point.keep_bytes == whole
    assert point.made_by == [made] and point.unmarked == 0
    with pytest.raises(OutputError, match="is not a `sat caption`"):
        scan_output(out, [f for f in list_output_formats() if f != fmt][0], False)


def test_an_unknown_format_lists_the_registered_ones():
    with pytest.raises(OutputError) as e:
        output_format("out", "xml")
    assert all(f in str(e.value) for f in list_output_formats())
