"""Confidence (confidence.py): the fits and where they are stored (model files, the bundled
models' JSON, `sat export --confidence`), the score in every result, its sense (a caption forced
to be bad scores lower), `sat caption --min-confidence` and the study script."""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.photos import write_photos
from helpers.scripts import load_script

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.catalog import bundled_models
from showattendtell.cli.main import main
from showattendtell.model_file import ModelFileError, read_model, save_model
from showattendtell.search import confidence
from showattendtell.search.confidence import (
    FEATURES,
    INDEX_FEATURES,
    ConfidenceFit,
    ConfidenceFitError,
    ConfidenceFits,
)
from showattendtell.search.decoding import Hypothesis, generate
from showattendtell.search.familiarity import UNSURE_WARNING

NO_INDEX = tuple(f for f in FEATURES if f not in INDEX_FEATURES)


def a_fit(features=NO_INDEX, bias: float = 0.0, warn_below: float = 0.5) -> ConfidenceFit:
    n = len(features)
    return ConfidenceFit(
        features=tuple(features),
        mean=(0.0,) * n,
        scale=(1.0,) * n,
        weights=tuple(0.1 * (i + 1) for i in range(n)),
        bias=bias,
        warn_below=warn_below,
    )


def test_fits_round_trip_as_json_and_damage_is_refused():
    fits = ConfidenceFits((a_fit(FEATURES), a_fit()), "made by a test")
    again = ConfidenceFits.from_json(fits.to_json())
    assert again == fits
    assert fits.for_features(NO_INDEX) is fits.fits[1]  # no index: the second
    assert fits.for_features(FEATURES) is fits.fits[0]
    with pytest.raises(ConfidenceFitError):
        fits.for_features(("words",))
    good = json.loads(fits.to_json())
    for damage in (
        lambda d: d.update(version=99),
        lambda d: d["fits"][0].update(features=["shoe size"] * len(FEATURES)),
        lambda d: d["fits"][0].update(bias=float("nan")),
        lambda d: d["fits"][0].update(scale=[0.0] * len(FEATURES)),
        lambda d: d["fits"][0].update(weights=[1.0]),
        lambda d: d["fits"][0].update(warn_below=2.0),
        lambda d: d["fits"][0].pop("mean"),
        lambda d: d.update(fits=[]),
    ):
        d = json.loads(json.dumps(good))
        damage(d)
        with pytest.raises(ConfidenceFitError):
            ConfidenceFits.from_json(json.dumps(d))
    with pytest.raises(ConfidenceFitError):
        ConfidenceFits.from_json("{not json")


def test_the_confidence_is_a_probability_that_rises_with_each_weighted_feature():
    fit = a_fit()
    signals = {f: np.linspace(-50, 50, 11) for f in NO_INDEX}
    p = fit.confidence(signals)
    assert p.shape == (11,) and np.all((p >= 0) & (p <= 1)) and np.all(np.diff(p) >= 0)
    assert fit.confidence({f: np.zeros(1) for f in NO_INDEX})[0] == pytest.approx(0.5)


def test_the_bundled_models_carry_fits_of_their_own():
    """Each bundled model has its fits in bundled/confidence.json (their files stay as they
    are in git); one that uses the index first, then one for a model without an index;
    the default model's fits score model files without fits of their own."""
    for path in bundled_models():
        fits = confidence.bundled_fits(path)
        assert fits is not None, path.name
        assert set(fits.fits[0].features) & set(INDEX_FEATURES)  # the index helps
        assert set(fits.for_features(NO_INDEX).features) <= set(NO_INDEX)
        assert 0.0 < fits.fits[0].warn_below < 1.0
    assert confidence.default_fits() == confidence.bundled_fits(bundled_models()[0])
    assert confidence.bundled_fits(Path("elsewhere") / bundled_models()[0].name) is None


def test_the_fit_round_trips_through_a_model_file(tiny_model_file, tmp_path):
    model, decoding, _ = read_model(tiny_model_file)
    assert model.confidence is None  # not a bundled model, and saved without one
    fits = ConfidenceFits((a_fit(bias=0.25),), "a test")
    model.confidence = fits
    path = save_model(model, tmp_path / "with.safetensors", decoding)
    again, _, _ = read_model(path)
    assert again.confidence == fits
    assert load_model(path, "cpu").confidence_fits == fits

    class Damaged:
        def to_json(self) -> str:
            return '{"version": 1, "fits": [{"features": ["log_prob_per_word"]}]}'

    model.confidence = Damaged()
    bad = save_model(model, tmp_path / "damaged.safetensors", decoding)
    with pytest.raises(ModelFileError, match="damaged confidence fit"):
        read_model(bad)


def test_export_stores_the_fits_it_is_given(tiny_model_file, tmp_path, capsys):
    fits = ConfidenceFits((a_fit(bias=-0.5, warn_below=0.3),), "a test")
    (tmp_path / "fits.json").write_text(fits.to_json())
    out = tmp_path / "out.safetensors"
    args = ["export", str(tiny_model_file), str(out), "--confidence"]
    assert main([*args, str(tmp_path / "fits.json")]) == 0
    assert read_model(out)[0].confidence == fits
    # re-exported without --confidence: the fits it has are kept
    again = tmp_path / "again.safetensors"
    assert main(["export", str(out), str(again)]) == 0
    assert read_model(again)[0].confidence == fits
    (tmp_path / "other.json").write_text('{"something": "else"}')
    capsys.readouterr()
    assert main([*args, str(tmp_path / "other.json"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--confidence" in err[0] and "Traceback" not in err[0]


def test_every_result_carries_a_confidence_and_its_own_fit_warns(tiny_model_file, tmp_path):
    photos = write_photos(tmp_path, 3, seed=11)
    captioner = load_model(tiny_model_file, "cpu")
    assert not captioner.own_fits and captioner.confidence_fits == confidence.default_fits()
    results = captioner.caption(photos)
    for r in results:
        assert 0.0 <= r.confidence <= 1.0
        assert r.to_dict()["confidence"] == round(r.confidence, 4)
        assert set(r.signals) == set(NO_INDEX)  # no index: no consensus, no typicality
        assert r.warning is None  # a model scored by another's fits: familiarity's rule
    # fits of its own: the warning follows them
    captioner.own_fits = True
    captioner.confidence_fits = ConfidenceFits((a_fit(bias=30.0),))
    assert [r.warning for r in captioner.caption(photos)] == [None] * 3
    captioner.confidence_fits = ConfidenceFits((a_fit(bias=-30.0),))
    low = captioner.caption(photos)
    assert all(r.confidence < 1e-6 and r.warning == UNSURE_WARNING for r in low)
    captioner.confidence_fits = None  # no fit at all (no bundled fits installed)
    r = captioner.caption(photos[:1])[0]
    assert r.confidence is None and r.to_dict()["confidence"] is None


def test_a_caption_forced_to_be_bad_scores_lower(tiny_model_file, tmp_path):
    """The model's own caption against one as long with its words in another order and a
    colour the model did not say: the shipped default fit gives it less
    confidence (the signals are computed as in inference, from the decoder's own
    probabilities of the words)."""
    photos = write_photos(tmp_path, 2, seed=12)
    captioner = load_model(tiny_model_file, "cpu")
    grids = captioner.encode(torch.stack([captioner.preprocess(p) for p in photos]))
    cfg = captioner.decoding
    model = captioner.model
    fit = confidence.default_fits().for_features(NO_INDEX)
    for b, hyps in enumerate(model.generate(grids, cfg)):
        best = hyps[0]
        said = set(model.words(best))
        other = next(
            w for w in ("red", "green", "blue", "yellow") if w in model.vocab.stoi and w not in said
        )
        forced = [*reversed(best.tokens)]  # the same length, another order, a wrong colour
        forced[0] = model.vocab.stoi[other]
        grid = grids[b : b + 1]
        scored = []
        for tokens in (best.tokens, forced):
            lp = confidence.word_log_probs(model.decoder, grid, [tokens], cfg.hard_mode)[0]
            alphas = best.alphas[:1].expand(len(tokens), -1)
            hyp = Hypothesis(list(tokens), float(lp.sum()), float(lp.sum()), alphas, None)
            caption = " ".join(model.vocab.itos[t] for t in tokens)
            signals = confidence.signals(model.decoder, grid, [[hyp]], [[caption]], "argmax")
            scored.append(float(fit.confidence(signals)[0]))
        assert scored[1] < scored[0], (model.words(best), scored)


def test_word_log_probs_sum_to_the_searchs_log_probability(tiny_model_file, tmp_path):
    photos = write_photos(tmp_path, 3, seed=13)
    captioner = load_model(tiny_model_file, "cpu")
    grids = captioner.encode(torch.stack([captioner.preprocess(p) for p in photos]))
    hyps = [h[0] for h in captioner.model.generate(grids, captioner.decoding)]
    per_word = confidence.word_log_probs(
        captioner.model.decoder, grids, [h.tokens for h in hyps], "argmax"
    )
    for h, lp in zip(hyps, per_word, strict=True):
        assert len(lp) == len(h.tokens) + 1 and lp.sum() == pytest.approx(h.log_prob, abs=1e-4)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_the_search_keeps_each_words_log_prob_as_the_second_pass_computes_it(
    attention, tiny_model_file, tiny_hard_model_file, tmp_path
):
    """Every search (greedy and beam, shrinking and fixed-shape) keeps each word's log p, the
    numbers a teacher-forced pass over its captions computes: the confidence's signals from
    them are the signals from that second pass."""
    model_file = tiny_model_file if attention == "soft" else tiny_hard_model_file
    captioner = load_model(model_file, "cpu")
    photos = write_photos(tmp_path, 4, seed=21)
    grids = captioner.encode(torch.stack([captioner.preprocess(p) for p in photos]))
    decoder = captioner.model.decoder
    for beam_size in (1, 3):
        config = dataclasses.replace(captioner.decoding, beam_size=beam_size, min_length=2)
        for strategy in ("shrink", "fixed"):
            search = generate(decoder, grids, config, strategy)
            flat = [h for hyps in search for h in hyps]
            rows = torch.cat(
                [grids[b : b + 1].expand(len(h), -1, -1) for b, h in enumerate(search)]
            )
            again = confidence.word_log_probs(decoder, rows, [h.tokens for h in flat], "argmax")
            for h, lp in zip(flat, again, strict=True):
                assert h.word_log_probs is not None and len(h.word_log_probs) == len(h.tokens) + 1
                np.testing.assert_allclose(h.word_log_probs, lp, atol=1e-5)
                assert sum(h.word_log_probs) == pytest.approx(h.log_prob, abs=1e-4)
            captions = [[" ".join(map(str, h.tokens)) for h in hyps] for hyps in search]
            kept = confidence.signals(decoder, grids, search, captions, "argmax")
            second = [
                [dataclasses.replace(h, word_log_probs=None) for h in hyps] for hyps in search
            ]
            recomputed = confidence.signals(decoder, grids, second, captions, "argmax")
            assert kept.keys() == recomputed.keys()
            for name in kept:
                np.testing.assert_allclose(kept[name], recomputed[name], atol=1e-5, err_msg=name)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_min_confidence_sends_low_captions_to_a_file_beside_and_resumes(
    tiny_model_file, tmp_path, capsys
):
    photos = write_photos(tmp_path, 4, seed=14)
    base = ["caption", "--model", str(tiny_model_file), "--workers", "0"]
    everything = tmp_path / "all.jsonl"
    assert main([*base, *photos, "-o", str(everything)]) == 0
    conf = {r["path"]: r["confidence"] for r in _records(everything)}
    cut = float(np.median(list(conf.values())))
    if min(conf.values()) == cut:  # all alike: everything goes to the low file
        cut = 1.0
    out, low = tmp_path / "out.jsonl", tmp_path / "out.low.jsonl"
    assert main([*base, *photos[:3], "-o", str(out), "--min-confidence", str(cut)]) == 0
    assert "captions below --min-confidence" in capsys.readouterr().err
    assert all(r["confidence"] >= cut for r in _records(out))
    assert all(r["confidence"] < cut for r in _records(low))
    assert sorted(r["path"] for r in _records(out) + _records(low)) == sorted(photos[:3])
    # resumed: only the fourth photo is captioned, into the file its confidence says
    assert main([*base, *photos, "-o", str(out), "--min-confidence", str(cut), "--resume"]) == 0
    paths = [r["path"] for r in _records(out) + _records(low)]
    assert sorted(paths) == sorted(photos)
    last = photos[3]
    assert (last in [r["path"] for r in _records(low)]) == (conf[last] < cut)
    # resumed without --min-confidence: refused (the low file's photos would be done again)
    if low.stat().st_size:
        capsys.readouterr()
        assert main([*base, *photos, "-o", str(out), "--resume"]) == 2
        assert "give its --min-confidence again" in capsys.readouterr().err
    # bad values and no --output: one line each
    assert main([*base, photos[0], "--min-confidence", "1.5"]) == 2
    assert main([*base, photos[0], "--min-confidence", "0.5"]) == 2
    # CSV: both files get a header and the confidence column
    out_csv = tmp_path / "out.csv"
    assert main([*base, *photos[:2], "-o", str(out_csv), "--min-confidence", "1"]) == 0
    rows = list(csv.DictReader((tmp_path / "out.low.csv").open(encoding="utf-8")))
    kept = list(csv.DictReader(out_csv.open(encoding="utf-8")))
    assert sorted(r["path"] for r in rows + kept) == sorted(photos[:2])
    assert all(0 <= float(r["confidence"]) < 1 for r in rows)
    assert out_csv.read_text().splitlines()[0] == (tmp_path / "out.low.csv").read_text().split()[0]


def test_the_study_runs_end_to_end_and_reuses_its_cache(
    tiny_model_file, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    """The script's main() in this process, twice: the second run reads the captions and
    signals from the cache; --save writes fits that a model file can store."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.setattr(sys, "argv", ["scripts/confidence_study.py"])
    study, threads = load_script("confidence_study"), torch.get_num_threads()
    argv = [
        "--model",
        str(tiny_model_file),
        "--flickr8k",
        str(synthetic_flickr),
        "--cache",
        str(tmp_path / "cache"),
        "--device",
        "cpu",
        "--save",
        str(tmp_path / "fits.json"),
    ]
    capsys.readouterr()
    try:
        study.main(argv)
        first = capsys.readouterr().out
        study.main(argv)
        again = capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert "AUROC for a bad caption" in first and "calibration" in first
    assert "flickr8k dev  photos     8" in first and "the warning below" in first
    assert "the precision goal of 0.7 at that recall: " in first
    assert "the first signals alone: +" in first  # what the signals added since bring
    numbers = [line for line in first.splitlines() if "flickr8k_dev: " not in line]
    assert again.splitlines() == numbers  # the same numbers, from the cache
    assert "flickr8k_dev: " not in again
    fits = ConfidenceFits.from_json((tmp_path / "fits.json").read_text())
    assert len(fits.fits) == 1 and fits.fits[0].applies(NO_INDEX)  # the tiny model has no index
    assert dataclasses.asdict(fits.fits[0])["warn_below"] <= 1.0
