"""Ensembles (`--model A+B`): several decoders searched as one model over one encoder's grids."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from helpers.photos import write_photos

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.catalog import ModelNotFound, resolve_models
from showattendtell.cli.main import main
from showattendtell.ensemble import EnsembleError, EnsembleModel
from showattendtell.model_file import read_model, save_model
from showattendtell.network.vocab import Vocabulary


def test_an_ensemble_of_a_model_with_itself_is_that_model(tiny_model_file, tmp_path):
    """Mean probabilities of identical members are the member's: same captions, same scores."""
    paths = write_photos(tmp_path, 4, seed=3)
    alone = load_model(tiny_model_file, "cpu")
    twice = load_model(f"{tiny_model_file}+{tiny_model_file}", "cpu")
    assert twice.name == "tiny+tiny" and isinstance(twice.model, EnsembleModel)
    for beam in (1, 3):
        a, b = alone.caption(paths, beam_size=beam), twice.caption(paths, beam_size=beam)
        assert [r.caption for r in a] == [r.caption for r in b]
        assert [r.score for r in a] == pytest.approx([r.score for r in b], abs=1e-4)
        assert np.allclose(a[0].attention, b[0].attention, atol=1e-6)


def test_ensemble_step_averages_the_members_probabilities_and_maps(
    tiny_model_file, tiny_hard_model_file, tmp_path
):
    captioner = load_model(f"{tiny_model_file}+{tiny_hard_model_file}", "cpu")
    soft, _, _ = read_model(tiny_model_file)
    hard, _, _ = read_model(tiny_hard_model_file)
    assert captioner.attention_type == "hard"  # --hard-mode reaches the hard member
    paths = write_photos(tmp_path, 3, seed=3)
    grids = soft.encoder(torch.stack([captioner.preprocess(p) for p in paths]))
    words = torch.tensor([1, 1, 1])
    with torch.no_grad():
        step = captioner.model.decoder.step(words, captioner.model.decoder.start(grids), "argmax")
        s = soft.decoder.step(words, soft.decoder.start(grids), "argmax")
        h = hard.decoder.step(words, hard.decoder.start(grids), "argmax")
    expected = torch.log((s.log_probs.exp() + h.log_probs.exp()) / 2)
    assert torch.allclose(step.log_probs, expected, atol=1e-5)
    assert torch.allclose(step.alpha, (s.alpha + h.alpha) / 2, atol=1e-6)
    assert step.location is None and h.location is not None  # no one attended cell
    results = captioner.caption(paths, beam_size=3)
    assert all(r.locations is None and math.isfinite(r.score) for r in results)
    assert all(np.allclose(r.attention.sum(axis=(1, 2)), 1, atol=1e-4) for r in results)


def test_members_must_share_the_vocabulary_and_encoder(tiny_model_file, tmp_path):
    model, decoding, _ = read_model(tiny_model_file)
    other_vocab, _, _ = read_model(tiny_model_file)
    other_vocab.vocab = Vocabulary([*model.vocab.itos[:4], "zebra", *model.vocab.itos[5:]])
    with pytest.raises(EnsembleError, match="another vocabulary"):
        EnsembleModel([model, other_vocab], ["a", "b"])
    other_encoder, _, _ = read_model(tiny_model_file)
    with torch.no_grad():
        next(other_encoder.encoder.parameters()).add_(0.5)
    save_model(other_encoder, tmp_path / "other.safetensors", decoding)
    with pytest.raises(EnsembleError, match="other has another encoder than tiny"):
        load_model(f"{tiny_model_file}+{tmp_path / 'other.safetensors'}", "cpu")
    with pytest.raises(EnsembleError, match="cannot be interpolated"):
        EnsembleModel([model, model]).interpolate_(model, 0.5)


def test_resolve_models_reads_a_plus_b(tiny_model_file, tmp_path):
    assert resolve_models(tiny_model_file) == [tiny_model_file]
    assert resolve_models(f"{tiny_model_file}+{tiny_model_file}") == [tiny_model_file] * 2
    assert [p.stem for p in resolve_models("flickr8k_lite2_soft+flickr8k_lite2_hard")] == [
        "flickr8k_lite2_soft",
        "flickr8k_lite2_hard",
    ]
    plus = tmp_path / "a+b.safetensors"  # an existing file is that file, "+" or not
    shutil.copy(tiny_model_file, plus)
    assert resolve_models(plus) == [plus]
    with pytest.raises(ModelNotFound, match="an ensemble is MODEL\\+MODEL"):
        resolve_models(f"{tiny_model_file}+")
    with pytest.raises(ModelNotFound, match="no_such_model"):
        resolve_models(f"{tiny_model_file}+no_such_model")


def test_sat_caption_with_an_ensemble(tiny_model_file, tiny_hard_model_file, tmp_path, capsys):
    paths = write_photos(tmp_path, 2, seed=3)
    spec = f"{tiny_model_file}+{tiny_hard_model_file}"
    assert main(["caption", *paths, "--model", spec, "--with-attention"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    expected = [r.caption for r in load_model(spec, "cpu").caption(paths)]
    assert [x["caption"] for x in lines] == expected and "locations" not in lines[0]
    other, decoding, _ = read_model(tiny_model_file)
    other.vocab = Vocabulary([*other.vocab.itos[:4], "zebra", *other.vocab.itos[5:]])
    save_model(other, tmp_path / "zebra.safetensors", decoding)
    assert (
        main(["caption", *paths, "--model", f"{tiny_model_file}+{tmp_path / 'zebra.safetensors'}"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "another vocabulary" in err and "\n" not in err
