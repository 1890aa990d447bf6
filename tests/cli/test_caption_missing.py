"""`sat caption`: work that cannot be done is said, counted and reflected in the exit status,
never left out without a word (unreadable folders, overlay sheets not written, repeats)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from helpers.disk import refuse_listing
from helpers.photos import photos

from showattendtell.cli import caption_job
from showattendtell.cli.main import main


def quick_run(model: Path) -> list[str]:
    return ["--model", str(model), "--workers", "0", "--beam-size", "1"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch) -> Path:
    """tree/a.jpg and tree/locked/b.jpg, with tree/locked unreadable."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "tree"
    (root / "locked").mkdir(parents=True)
    src = photos(2)
    shutil.copy(src[0], root / "a.jpg")
    shutil.copy(src[1], root / "locked" / "b.jpg")
    refuse_listing(monkeypatch, root / "locked")
    return root


def test_an_unreadable_sub_folder_is_named_counted_and_fails_the_run(
    tree, tiny_model_file, tmp_path, capsys
):
    rc = main(["caption", "tree", "-r", "-o", "out.jsonl", *quick_run(tiny_model_file)])
    assert rc == 1
    assert [r["path"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["tree/a.jpg"]
    err = capsys.readouterr().err
    assert "warning: cannot read the folder tree/locked (permission denied)" in err
    assert "captioned 1; failed 0; 1 folder could not be read" in err


def test_an_unreadable_folder_given_is_one_line_exit_2(tree, tiny_model_file, capsys):
    for recursive in ([], ["-r"]):
        assert main(["caption", "tree/locked", *recursive, *quick_run(tiny_model_file)]) == 2
        err = capsys.readouterr().err
        assert err == "error: cannot read the folder tree/locked: permission denied\n"


def test_overlay_sheets_not_written_are_failures(tiny_model_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for p in photos(2):
        shutil.copy(p, tmp_path / p.name)
    names = sorted(p.name for p in photos(2))

    def disk_full(path, rec):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(caption_job, "write_overlay", disk_full)
    argv = ["caption", *names, "-o", "out.jsonl", "--overlays", "sheets"]
    assert main([*argv, *quick_run(tiny_model_file)]) == 1
    assert all(r["caption"] for r in read_jsonl(tmp_path / "out.jsonl"))  # captions kept
    err = capsys.readouterr().err
    assert "captioned 2; failed 0; no overlay sheet for 2 (their captions are written)" in err
    assert f"  {names[0]}: no overlay sheet: No space left on device" in err


def test_each_path_given_gets_its_record(tiny_model_file, tmp_path, monkeypatch, capsys):
    """Repeats are captioned as typed, one record per argument, not merged."""
    monkeypatch.chdir(tmp_path)
    name = photos(1)[0].name
    shutil.copy(photos(1)[0], tmp_path / name)
    given = [name, f"./{name}", name, str(tmp_path / name)]
    assert main(["caption", *given, "-o", "out.jsonl", *quick_run(tiny_model_file)]) == 0
    records = read_jsonl(tmp_path / "out.jsonl")
    assert [r["path"] for r in records] == [str(Path(p)) for p in given]  # ./ dropped
    assert len({r["caption"] for r in records}) == 1
    capsys.readouterr()
    argv = ["caption", *given, "-o", "out.jsonl", "--resume", *quick_run(tiny_model_file)]
    assert main(argv) == 0
    assert "nothing to do: all 4 images" in capsys.readouterr().err


@pytest.mark.parametrize("sub_folder, hinted", [(False, False), (True, True)])
def test_recursive_is_suggested_only_where_there_are_sub_folders(
    sub_folder, hinted, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a photo\n")
    if sub_folder:
        (tmp_path / "notes" / "more").mkdir()
    assert main(["caption", "notes"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: no image files found in notes")
    assert ("--recursive" in err) == hinted


def test_an_image_piped_to_dash_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """`cat photo.jpg | sat caption -`: - reads paths; the bytes are not printed as a name."""
    import io
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(photos(1)[0].read_bytes())))
    assert main(["caption", "-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: standard input holds image data, but - reads file paths")
    assert err.count("\n") == 1


def test_an_unknown_option_prints_caption_s_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["caption", "photo.jpg", "--no-such-option"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sat caption ")
    assert err.strip().endswith("sat caption: error: unrecognized arguments: --no-such-option")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--device", "cuda"], "error: --device cuda was asked for, but no CUDA GPU is available"),
        (["-o", "{notes}/sub/out.jsonl"], "error: cannot create the folder for --output"),
        (["--overlays", "{notes}/sheets"], "error: cannot create the folder for --overlays"),
    ],
)
def test_usage_errors_that_need_no_model_come_before_the_imports(
    argv, said, tmp_path, monkeypatch, capsys
):
    """Said by cli/caption.py's checks, before the job (and torch) is imported: in a
    fraction of a second, not the seconds torch's import takes."""
    from showattendtell.cli import common

    def job(args):
        raise AssertionError("the job started: the check came after the imports")

    monkeypatch.setattr(caption_job, "run", job)
    monkeypatch.setattr(common, "no_gpu_driver", lambda: True)  # as on a machine without one
    notes = tmp_path / "notes"
    notes.write_text("a file where a folder would be made\n")
    argv = [a.format(notes=notes) for a in argv]
    assert main(["caption", str(notes), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1
