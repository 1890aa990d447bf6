"""Familiarity (familiarity.py): calibration against the index's own photos, the warning that
combines it with the caption's mean log-probability per word, the score in every result (Python,
JSON Lines, CSV) and None for models without an index."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from helpers.photos import write_photos
from helpers.scripts import load_script
from PIL import Image

from showattendtell.captioning.captioner import CaptionResult, load_model
from showattendtell.cli.main import main
from showattendtell.model_file import read_model, save_model
from showattendtell.search import familiarity
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.decoding import DecodingConfig
from showattendtell.search.familiarity import (
    BOTH_WARNING,
    TYPICAL_LOG_PROB,
    UNLIKE,
    UNSURE_WARNING,
    WARNING,
    Familiarity,
)

DIM = 32


def clustered(rng: np.random.Generator, n: int, centres: torch.Tensor) -> torch.Tensor:
    """``n`` embeddings around the given centres (photos of a few kinds of scene)."""
    which = torch.as_tensor(rng.integers(len(centres), size=n))
    noise = torch.as_tensor(rng.standard_normal((n, centres.shape[1])), dtype=torch.float32)
    return centres[which] + 0.35 * noise


@pytest.fixture(scope="module")
def scene():
    rng = np.random.default_rng(0)
    centres = torch.zeros(4, DIM)
    centres[:, :4] = torch.eye(4) * 2.0  # four kinds of photo, in 4 of the 32 dimensions
    index = ConsensusIndex(clustered(rng, 400, centres), [["a caption"]] * 400, neighbours=5)
    return rng, centres, index


def test_new_photos_like_the_training_photos_are_calibrated_uniformly(scene):
    rng, centres, index = scene
    scorer = Familiarity(index, neighbours=5)
    reference = scorer.reference()
    assert len(reference) == 400 and np.all(np.diff(reference) >= 0)
    # photos drawn as the training photos were: their familiarity is about uniform on [0, 1]
    fam = scorer.score(clustered(rng, 2000, centres))
    assert fam.min() >= 0.0 and fam.max() <= 1.0
    assert abs(fam.mean() - 0.5) < 0.06
    assert abs(np.mean(fam < 0.1) - 0.1) < 0.05 and abs(np.mean(fam > 0.9) - 0.1) < 0.05


def _warn(scorer: Familiarity, embeddings: torch.Tensor, per_word: float) -> list[str | None]:
    """The warnings of photos with these embeddings and captions of this log-prob per word."""
    sim = scorer.similarity(embeddings)
    risk = scorer.risk(sim, np.full(len(sim), per_word))
    fam = scorer.calibrate(sim)
    return [scorer.warning(float(f), float(r), per_word) for f, r in zip(fam, risk, strict=True)]


def test_photos_unlike_the_training_photos_score_near_zero_and_are_warned(scene):
    rng, centres, index = scene
    scorer = Familiarity(index, neighbours=5)
    strangers = torch.zeros(50, DIM)
    strangers[:, 4:] = torch.as_tensor(rng.standard_normal((50, DIM - 4)), dtype=torch.float32)
    assert scorer.score(strangers).max() < 0.02
    # a caption as confident as a typical in-domain one: the photo alone is the reason
    assert _warn(scorer, strangers, TYPICAL_LOG_PROB + 0.2) == [WARNING] * 50
    assert _warn(scorer, strangers, -2.0) == [BOTH_WARNING] * 50  # and an unsure caption
    typical = scorer.score(centres)  # the very centre of each kind of photo
    assert typical.min() > 0.9
    assert _warn(scorer, centres, TYPICAL_LOG_PROB) == [None] * 4


def test_the_warning_combines_familiarity_and_the_captions_log_probability(scene):
    rng, centres, index = scene
    scorer = Familiarity(index)
    assert scorer.coefficients == familiarity.COEFFICIENTS
    assert scorer.threshold == familiarity.RISK_THRESHOLD
    _, b1, b2 = familiarity.COEFFICIENTS
    assert b1 < 0 and b2 < 0  # less typical, less probable: more often bad
    in_domain = clustered(rng, 200, centres)
    familiar = in_domain[torch.as_tensor(scorer.score(in_domain) > 0.5)]
    # a familiar photo with a confident caption: no warning; with an unsure one: warned, why
    assert set(_warn(scorer, familiar, -0.4)) == {None}
    assert set(_warn(scorer, familiar, -2.0)) == {UNSURE_WARNING}
    # the risk grows as the caption's log-probability or the photo's similarity falls
    sim = scorer.similarity(in_domain)
    low, high = np.full(200, -1.5), np.full(200, -0.5)
    assert np.all(scorer.risk(sim, low) > scorer.risk(sim, high))
    assert np.all(scorer.risk(sim - 0.1, low) > scorer.risk(sim, low))
    # typicality is the similarity on the calibration's scale: 0 at its median
    median = np.median(scorer.reference())
    assert scorer.typicality(np.array([median]))[0] == pytest.approx(0.0, abs=1e-9)
    # a NaN log-probability counts as typical, -inf as unsure
    assert scorer.risk(sim[:1], [np.nan]) == pytest.approx(scorer.risk(sim[:1], [TYPICAL_LOG_PROB]))
    assert scorer.risk(sim[:1], [-np.inf]) == pytest.approx(1.0)
    assert scorer.warning(None, 0.9, -2.0) is None and scorer.warning(0.5, None, -2.0) is None
    with pytest.raises(ValueError, match="threshold"):
        Familiarity(index, threshold=1.5)


def test_results_are_warned_by_the_combined_rule(tiny_model_file, tmp_path):
    """Inference warns each result from its familiarity and its own caption's log-probability
    per word (familiarity.COEFFICIENTS, swapped here for extreme ones to see both ends)."""
    photos = write_photos(tmp_path, 2, seed=5)
    captioner = load_model(tiny_model_file, "cpu")
    pooled = ConsensusIndex.pool(
        captioner.encode(torch.stack([captioner.preprocess(p) for p in photos]))
    )
    spread = 0.2 * pooled.norm(dim=1).mean() / pooled.shape[1] ** 0.5
    rows = pooled.repeat(10, 1) + spread * torch.randn(20, pooled.shape[1])
    captioner.model.consensus = ConsensusIndex(rows, [["red circle"]] * 20, neighbours=3)
    scorer = familiarity.for_index(captioner.model.consensus)
    sim = scorer.similarity(pooled)
    for r, s in zip(captioner.caption(photos), sim, strict=True):
        per_word = familiarity.log_prob_per_word(r.log_prob, len(r.words))
        risk = float(scorer.risk(np.array([s]), np.array([per_word]))[0])
        assert r.warning == scorer.warning(r.familiarity, risk, per_word)
        assert UNLIKE not in (r.warning or "")  # the photos are in the index
    try:
        scorer.coefficients = (-30.0, 0.0, 0.0)  # P(bad) = 0 whatever the caption
        sure = [r.warning for r in captioner.caption(photos)]
        scorer.coefficients = (0.0, 0.0, -30.0)  # P(bad) = 1 for any caption short of certain
        unsure = [r.warning for r in captioner.caption(photos)]
    finally:
        scorer.coefficients = familiarity.COEFFICIENTS
    assert sure == [None, None] and unsure == [UNSURE_WARNING] * 2


def test_the_calibration_leaves_each_photo_out_and_is_computed_once(scene):
    _, _, index = scene
    two = ConsensusIndex(torch.tensor([[1.0, 0.0], [0.6, 0.8]]), [["a"], ["b"]], neighbours=1)
    scorer = Familiarity(two, neighbours=10)  # at most the other photos: 1
    assert scorer.neighbours == 1
    np.testing.assert_allclose(scorer.reference(), [0.6, 0.6], atol=1e-6)  # not itself (1.0)
    assert scorer.reference() is scorer.reference()
    assert familiarity.for_index(index) is familiarity.for_index(index)
    assert familiarity.for_index(None) is None
    with pytest.raises(ValueError, match="at least 2"):
        Familiarity(ConsensusIndex(torch.ones(1, 2), [["a"]], neighbours=1))


def test_results_carry_the_familiarity_and_none_without_an_index(tiny_model_file, tmp_path):
    photos = write_photos(tmp_path, 3, seed=4)
    captioner = load_model(tiny_model_file, "cpu")
    assert captioner.model.consensus is None
    for r in captioner.caption(photos):
        assert r.familiarity is None and r.warning is None
        assert r.to_dict()["familiarity"] is None and "warning" not in r.to_dict()
    # an index of the training photos: these photos are like them
    grids = captioner.encode(torch.stack([captioner.preprocess(p) for p in photos]))
    pooled = ConsensusIndex.pool(grids)
    dim = pooled.shape[1]
    spread = 0.2 * pooled.norm(dim=1).mean() / dim**0.5  # each index photo ~0.2 from a photo
    like = pooled.repeat(10, 1) + spread * torch.randn(30, dim)
    captioner.model.consensus = ConsensusIndex(like, [["red circle"]] * 30, neighbours=3)
    results = captioner.caption(photos)
    for r in results:
        assert 0.5 < r.familiarity <= 1.0 and UNLIKE not in (r.warning or "")
        assert r.to_dict()["familiarity"] == round(r.familiarity, 4)
    # an index of photos unlike them: the results say so
    unlike = -pooled.repeat(10, 1) + 0.01 * torch.randn(30, dim)
    captioner.model.consensus = ConsensusIndex(unlike, [["red circle"]] * 30, neighbours=3)
    for r in captioner.caption(photos):
        assert r.familiarity == 0.0 and r.warning.startswith(UNLIKE)
        json.dumps(r.to_dict(), allow_nan=False)
    # a tiny photo that is also unfamiliar keeps both warnings
    Image.new("RGB", (1, 1), (255, 0, 0)).save(tmp_path / "pixel.png")
    r = captioner.caption([tmp_path / "pixel.png"])[0]
    assert "1x1" in r.warning and UNLIKE in r.warning


def test_add_warning_keeps_earlier_warnings():
    r = CaptionResult("a", ["a"], -1.0, -1.0, np.zeros((1, 2, 2)), None, [])
    r.add_warning(None)
    assert r.warning is None
    r.add_warning("first")
    r.add_warning("second")
    assert r.warning == "first; second"


def _model_with_an_index_unlike(tiny_model_file, photo: str, out) -> str:
    """The tiny model saved with an index of photos unlike ``photo`` (all of them far away)."""
    model, _, _ = read_model(tiny_model_file)
    captioner = load_model(tiny_model_file, "cpu")
    pooled = ConsensusIndex.pool(captioner.encode(captioner.preprocess(photo)[None]))
    rows = -pooled.repeat(12, 1) + 0.01 * torch.randn(12, pooled.shape[1])
    model.consensus = ConsensusIndex(rows, [["a red circle"]] * 12, neighbours=4)
    return str(save_model(model, out, DecodingConfig(beam_size=2)))


def test_cli_records_carry_familiarity_and_warning(tiny_model_file, tmp_path, capsys):
    photo = write_photos(tmp_path, 1, seed=6)[0]
    indexed = _model_with_an_index_unlike(tiny_model_file, photo, tmp_path / "m.safetensors")
    assert main(["caption", photo, "--model", indexed, "--workers", "0"]) == 0
    captured = capsys.readouterr()
    rec = json.loads(captured.out.strip().splitlines()[-1])
    assert rec["familiarity"] == 0.0 and rec["warning"].startswith(UNLIKE)
    assert f"warning: {photo}: {rec['warning']}" in captured.err
    out = tmp_path / "out.csv"
    assert (
        main(
            [
                "caption",
                photo,
                "--model",
                indexed,
                "--workers",
                "0",
                "-o",
                str(out),
                "--format",
                "csv",
            ]
        )
        == 0
    )
    row = next(csv.DictReader(out.open(encoding="utf-8")))
    assert float(row["familiarity"]) == 0.0 and row["warning"] == rec["warning"]
    # a model without an index: the field is there, empty (null in JSON)
    capsys.readouterr()
    assert main(["caption", photo, "--model", str(tiny_model_file), "--workers", "0"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["familiarity"] is None and "warning" not in rec


def test_resume_keeps_a_csv_file_written_before_the_familiarity_column(tiny_model_file, tmp_path):
    photos = write_photos(tmp_path, 2, seed=7)
    out = tmp_path / "old.csv"
    old = f"path,caption,score,log_prob,error,warning\n{photos[0]},a red circle,-1.0,-2.0,,\n"
    out.write_text(old)
    args = ["caption", *photos, "--model", str(tiny_model_file), "--workers", "0"]
    assert main([*args, "-o", str(out), "--resume"]) == 0
    lines = out.read_text().splitlines()
    assert out.read_text().startswith(old) and len(lines) == 3
    assert lines[2].startswith(photos[1]) and lines[2].count(",") == 5  # the file's own layout


def test_the_studys_auroc_and_logistic_regression():
    study = load_script("familiarity_study")
    rng = np.random.default_rng(3)
    bad = rng.random(300) < 0.4
    risk = rng.normal(size=300) + bad + np.round(rng.random(300))  # with ties
    pairs = [(r_b > r_g) + 0.5 * (r_b == r_g) for r_b in risk[bad] for r_g in risk[~bad]]
    assert study.auroc(bad, risk) == pytest.approx(np.mean(pairs))
    assert study.auroc(bad, -risk) == pytest.approx(1 - np.mean(pairs))
    x = rng.normal(size=(4000, 2))
    y = (rng.random(4000) < 1 / (1 + np.exp(-(0.5 + 2 * x[:, 0] - x[:, 1])))).astype(float)
    np.testing.assert_allclose(study.fit_logistic(x, y), [0.5, 2.0, -1.0], atol=0.2)
    risk = study.cross_validated_risk(x, y)
    assert risk.shape == (4000,) and study.auroc(y, risk) > 0.8


def test_the_study_runs_end_to_end_and_reuses_its_cache(
    tiny_model_file, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    """The script's main() run in this process, twice (a second Python would spend seconds
    importing torch again); argv as the command line gives it."""
    import sys
    from pathlib import Path

    import torch

    indexed = tmp_path / "indexed.safetensors"
    assert (
        main(
            [
                "export",
                str(tiny_model_file),
                str(indexed),
                "--consensus-root",
                str(synthetic_flickr),
                "--consensus-neighbours",
                "5",
            ]
        )
        == 0
    )
    root = Path(__file__).resolve().parents[2]
    argv = [
        "scripts/familiarity_study.py",
        "--model",
        str(indexed),
        "--flickr8k",
        str(synthetic_flickr),
        "--cache",
        str(tmp_path / "cache"),
        "--device",
        "cpu",
    ]
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", argv)
    study, threads = load_script("familiarity_study"), torch.get_num_threads()
    capsys.readouterr()
    try:
        study.main()
        first = capsys.readouterr()
        study.main()
        again = capsys.readouterr()
    finally:
        torch.set_num_threads(threads)
    assert "AUROC for a bad caption" in first.out and "calibration" in first.out
    assert "flickr8k dev  photos     8" in first.out
    numbers = [line for line in first.out.splitlines() if "flickr8k_dev: " not in line]
    assert again.out.splitlines() == numbers  # the same numbers, from the cache
    assert "flickr8k_dev: " in first.out and "flickr8k_dev: " not in again.out  # cached
