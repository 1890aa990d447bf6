"""Your own photos and captions in your own language, end to end: `sat train` on a folder of 12
photos with German (captions.csv, a split column; features cached by `sat features`) or Japanese
(captions.jsonl, a split ratio) captions and --data.tokenizer unicode, then `sat export` (a model
file, and an ONNX folder), `sat caption` and `sat evaluate`."""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import regex
from synthetic import make_example

from showattendtell.cli.main import main
from showattendtell.data.datasets import load_split
from showattendtell.model_file import read_model
from showattendtell.network.tokenizers import unicode_tokenize

ROOT = Path(__file__).resolve().parents[2]

DE_COLOUR = {"red": "rot", "green": "grün", "blue": "blau", "yellow": "gelb"}
DE_SHAPE = {"circle": ("Kreis", "er"), "square": ("Quadrat", "es")}  # noun, adjective ending
JA = {
    "red": "赤い",
    "green": "緑の",
    "blue": "青い",
    "yellow": "黄色い",
    "circle": "丸",
    "square": "四角",
}


def _german(colour: str, shape: str) -> str:
    noun, ending = DE_SHAPE[shape]
    return f"{DE_COLOUR[colour]}{ending} {noun}"


def _captions(english: str, language: str) -> list[str]:
    """Two captions of a synthetic photo ("red circle blue square") in ``language``."""
    c1, s1, c2, s2 = english.split()
    if language == "de":
        first, second = _german(c1, s1), _german(c2, s2)
        return [f"Ein {first} und ein {second}.", f"Links ein {first}, rechts ein {second}"]
    first, second = JA[c1] + JA[s1], JA[c2] + JA[s2]
    return [f"{first}と{second}。", f"{first}、{second}"]


def _own_folder(root: Path, language: str) -> list[str]:
    """12 synthetic photos and their captions: German in captions.csv with a split column
    (8 train, 2 val, 2 test), Japanese in captions.jsonl without one (a split ratio)."""
    rng = np.random.default_rng(7)
    (root / "fotos").mkdir(parents=True)
    rows = []
    for i in range(12):
        img, english, _ = make_example(rng)
        name = f"fotos/{i:02d}.png"
        img.save(root / name)
        split = "train" if i < 8 else "val" if i < 10 else "test"
        rows.append((name, _captions(english, language), split))
    if language == "de":
        with open(root / "captions.csv", "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["image", "caption", "split"])
            out.writerows((name, c, split) for name, caps, split in rows for c in caps)
    else:
        with open(root / "captions.jsonl", "w", encoding="utf-8") as f:
            for name, caps, _ in rows:
                f.write(json.dumps({"image": name, "caption": caps}, ensure_ascii=False) + "\n")
    return [name for name, _, _ in rows]


@dataclass(frozen=True)
class Trained:
    """A model trained by `sat train` on an own folder and exported to a model file."""

    language: str
    root: Path  # the runs' working folder
    data: Path
    photos: list[str]
    model: Path
    split: list[str]  # `sat evaluate`'s split options for this folder


@pytest.fixture(scope="module", params=["de", "ja"])
def trained(request, tmp_path_factory) -> Trained:
    """The German and the Japanese model, each trained once for every test of this module."""
    language = request.param
    root = tmp_path_factory.mktemp(f"own_{language}")
    data = root / "data"
    photos = _own_folder(data, language)
    split = [] if language == "de" else ["--split-ratio", "0.5"]
    old = os.getcwd()
    os.chdir(root)
    try:
        train = ["train", "--config", str(ROOT / "configs" / "tiny.yaml")]
        train += ["--data.dataset", "captions", "--data.root", str(data)]
        train += ["--data.tokenizer", "unicode", "--trainer.max_epochs", "4"]
        train += ["--run.dir", "runs/own", "--data.val_split", "val"]
        if split:
            train += ["--data.split_ratio", "0.5"]
        else:  # German: the encoder's features cached first by `sat features`, then trained on
            train += ["--data.feature_cache", "cache"]
            assert main(["features", *train[1:]]) == 0
            assert any((root / "cache").rglob("shard-*.npy"))
        assert main(train) == 0
        model = root / f"{language}.safetensors"
        assert main(["export", "runs/own/checkpoints/last.ckpt", str(model)]) == 0
    finally:
        os.chdir(old)
    return Trained(language, root, data, photos, model, split)


def _assert_written_as_the_language(records: list[dict], vocab, language: str) -> None:
    """The words are the vocabulary's, joined as the language writes them."""
    assert records and all(r["words"] for r in records)
    for r in records:
        assert set(r["words"]) <= set(vocab.itos[4:])
        if language == "de":
            assert r["caption"] == " ".join(r["words"])
        else:
            assert r["caption"] == "".join(r["words"])
            assert regex.fullmatch(r"[\p{scx=Han}\p{scx=Hiragana}\p{scx=Katakana}]+", r["caption"])


@pytest.mark.slow
def test_train_export_caption_and_evaluate_in_german_and_japanese(trained, capsys, monkeypatch):
    language, data, model = trained.language, trained.data, trained.model
    monkeypatch.chdir(trained.root)
    capsys.readouterr()
    # at least 3 words: a few steps of training may end a caption at once
    caption = ["caption", *(str(data / p) for p in trained.photos[:4]), "--model", str(model)]
    assert main([*caption, "--min-length", "3"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    evaluate = ["evaluate", "--model", str(model), "--dataset", "captions"]
    evaluate += ["--root", str(data), "--split", "test", "--output", "results.json"]
    assert main([*evaluate, *trained.split]) == 0
    out, err = capsys.readouterr()

    vocab = read_model(model)[0].vocab
    assert vocab.tokenizer == "unicode"
    assert len(records) == 4
    _assert_written_as_the_language(records, vocab, language)
    # the vocabulary is the training captions' tokens: German words, Japanese characters
    train = load_split("captions", data, "train", None if language == "de" else 0.5)
    tokens = {t for im in train.images for c in im.captions for t in unicode_tokenize(c)}
    assert set(vocab.itos[4:]) == tokens
    assert ("kreis" in tokens or "quadrat" in tokens) if language == "de" else "丸" in tokens

    scores = json.loads(out.strip().splitlines()[-1])
    assert scores["tokenizer"] == "unicode" and "METEOR" not in scores
    assert 0.0 <= scores["Bleu_1"] <= 1.0 and scores["CIDEr"] >= 0.0
    assert "METEOR and SPICE skipped" in err
    results = json.loads((trained.root / "results.json").read_text(encoding="utf-8"))
    expected_test = 2 if language == "de" else 3  # the split column's 2; half of 6 for 0.5
    assert len(results) == expected_test


@pytest.mark.slow
def test_an_onnx_export_keeps_the_tokenizer_and_captions_as_the_model_file(trained, capsys):
    """`sat export --format onnx` of the German and the Japanese model: the folder reads back
    with the unicode tokenizer, and `sat caption` with it gives the model file's captions
    (greedy), joined as the language writes them."""
    pytest.importorskip("onnx", reason='the [onnx] extra: pip install "showattendtell[onnx]"')
    pytest.importorskip(
        "onnxruntime", reason='the [onnx] extra: pip install "showattendtell[onnx]"'
    )
    from showattendtell.captioning.onnx_model import read_onnx_folder

    folder = trained.root / f"{trained.language}_onnx"
    assert main(["export", str(trained.model), str(folder), "--format", "onnx"]) == 0
    assert read_onnx_folder(folder)[0].vocab.tokenizer == "unicode"
    photos = [str(trained.data / p) for p in trained.photos]
    capsys.readouterr()
    by = {}
    for name, model in (("torch", trained.model), ("onnx", folder)):
        args = ["caption", *photos, "--model", str(model), "--format", "jsonl"]
        assert main([*args, "--beam-size", "1", "--min-length", "3"]) == 0
        by[name] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(by["onnx"]) == len(photos)
    assert [r["caption"] for r in by["onnx"]] == [r["caption"] for r in by["torch"]]
    assert [r["words"] for r in by["onnx"]] == [r["words"] for r in by["torch"]]
    _assert_written_as_the_language(
        by["onnx"], read_model(trained.model)[0].vocab, trained.language
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--data.tokenizer", "mecab"], "--data.tokenizer: unknown tokenizer 'mecab': choose one"),
        (["--data.split_ratio", "1.5"], "--data.split_ratio 1.5: must be between 0 and 1"),
        (["--data.root", "{empty}"], "no captions.csv or captions.jsonl in .*image,caption"),
        (
            ["--data.dataset", "flickr8k", "--data.split_ratio", "0.5"],
            "flickr8k names its own splits",
        ),
    ],
)
def test_bad_own_data_settings_are_one_line_before_any_work(tmp_path, capsys, args, match):
    data = tmp_path / "data"
    _own_folder(data, "de")
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty") for a in args]
    train = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.dataset"]
    train += ["captions", "--data.root", str(data), "--run.dir", str(tmp_path / "run"), *args]
    assert main(train) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert re.search(match, err) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_evaluate_takes_a_split_ratio_for_the_captions_format_only(tmp_path, capsys):
    data = tmp_path / "data"
    _own_folder(data, "de")
    evaluate = ["evaluate", "--dataset", "flickr8k", "--root", str(data), "--split-ratio", "0.5"]
    assert main(evaluate) == 2
    assert "flickr8k names its own splits" in capsys.readouterr().err
