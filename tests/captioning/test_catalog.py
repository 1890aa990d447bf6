"""Models by name: --model NAME for bundled models and $SAT_MODEL, and `sat models`."""

from __future__ import annotations

import json

import pytest
from helpers.photos import write_photos

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.catalog import ModelNotFound, bundled_models, resolve_model
from showattendtell.cli.main import main
from showattendtell.search.options import DECODING_OPTIONS


def test_bundled_models_are_named_by_their_stem():
    names = [p.stem for p in bundled_models()]
    assert names[:2] == ["flickr8k_lite2_soft", "flickr8k_lite2_hard"]
    for p in bundled_models():
        assert resolve_model(p.stem) == p and resolve_model(p.name) == p
    assert load_model("flickr8k_lite2_hard", device="cpu").attention_type == "hard"


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch, tiny_model_file):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flickr8k_lite2_hard").write_bytes(tiny_model_file.read_bytes())
    assert resolve_model("flickr8k_lite2_hard").resolve() == tmp_path / "flickr8k_lite2_hard"


def test_unknown_names_and_folders_are_one_line_usage_errors(tmp_path, capsys):
    (img,) = write_photos(tmp_path, 1, seed=0, name="x.png")
    assert main(["caption", str(img), "--model", "no_such_model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model no_such_model: no such file") and "\n" not in err
    assert "flickr8k_lite2_hard" in err  # says which names exist
    assert main(["caption", str(img), "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a folder" in err and "\n" not in err
    with pytest.raises(ModelNotFound):
        load_model(tmp_path)


def test_caption_with_a_bundled_model_name(tmp_path, capsys):
    (img,) = write_photos(tmp_path, 1, seed=0, name="x.png")
    assert (
        main(
            [
                "caption",
                str(img),
                "--model",
                "flickr8k_lite2_hard",
                "--beam-size",
                "1",
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["caption"]


def test_sat_models_lists_bundled_and_env_models(tiny_hard_model_file, monkeypatch, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "flickr8k_lite2_soft (default)",
        "flickr8k_lite2_hard",
        "efficientnet_lite2",
        "260 px",
        "9x9x1280",
        "words",
        "beam size 5",
        "hard-attention mode argmax",
        "reranking consensus",
        "; consensus index of 6000 photos",
    ):
        assert expected in out, expected
    soft, hard = (line for line in out.splitlines() if line.startswith("flickr8k_lite2"))
    for opt in DECODING_OPTIONS.values():  # every option of the table, by its label
        assert opt.label in hard, opt.label
    assert "hard-attention mode" not in soft  # a soft model does not use it
    monkeypatch.setenv("SAT_MODEL", str(tiny_hard_model_file))
    assert main(["models", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["name"] == tiny_hard_model_file.stem and rows[0]["default"]
    assert rows[0]["attention"] == "hard" and rows[0]["grid"] == 2
    assert rows[0]["decoding"]["beam_size"] == 3 and rows[0]["vocab_size"] > 4
    assert {r["name"] for r in rows[1:]} == {"flickr8k_lite2_soft", "flickr8k_lite2_hard"}
    assert load_model(tiny_hard_model_file.stem).attention_type == "hard"  # $SAT_MODEL by name


def test_a_missing_sat_model_file_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("SAT_MODEL", str(tmp_path / "gone.safetensors"))
    with pytest.raises(ModelNotFound, match=r"\$SAT_MODEL is .*gone.safetensors"):
        load_model(None)


@pytest.mark.parametrize("kind", ["text", "photo"])
def test_a_sat_model_that_is_no_model_file_is_said_to_come_from_it(
    kind, tmp_path, monkeypatch, capsys
):
    """With no --model, the line names $SAT_MODEL as well as the file: the user typed no model
    and would look for the mistake in the command line. A --model given needs no $SAT_MODEL."""
    (img,) = write_photos(tmp_path, 1, seed=0, name="x.png")
    bad = tmp_path / "notes.txt"
    bad.write_text("a model? no\n")
    bad = bad if kind == "text" else img
    what = "a text file" if kind == "text" else "an image"
    monkeypatch.setenv("SAT_MODEL", str(bad))
    line = (
        f"$SAT_MODEL: {bad} is {what}, not a model file: point it at a model file, "
        "give a bundled model's name, or unset it"
    )
    assert main(["caption", str(img)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {line}"
    # `sat models` warns, as for a missing file, and lists the models there are
    assert main(["models", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"warning: {line}"
    assert [json.loads(x)["name"] for x in out.splitlines()] == [p.stem for p in bundled_models()]
    given = bundled_models()[-1]
    assert resolve_model(str(given)) == given and resolve_model(given.stem) == given
    monkeypatch.setenv("SAT_MODEL", str(tmp_path))
    assert main(["caption", str(img)]) == 2
    assert capsys.readouterr().err.startswith(f"error: $SAT_MODEL is {tmp_path}, a folder: ")


def test_sat_model_may_name_a_bundled_model(monkeypatch):
    """As --model does: SAT_MODEL=flickr8k_lite2_hard makes the hard model the default."""
    from showattendtell.captioning.catalog import BUNDLED_DIR, default_model_path, named_models

    monkeypatch.setenv("SAT_MODEL", "flickr8k_lite2_hard")
    assert default_model_path() == BUNDLED_DIR / "flickr8k_lite2_hard.safetensors"
    assert list(named_models())[0] == "flickr8k_lite2_hard"
    monkeypatch.setenv("SAT_MODEL", "flickr8k_lite2_none")
    with pytest.raises(ModelNotFound, match="give a bundled model's name, or unset it"):
        default_model_path()
