"""Captions of another language than English are scored on their tokenizer's own tokens, without
Java and without the English-only METEOR and SPICE."""

from __future__ import annotations

import pytest

from showattendtell.evaluation import metrics
from showattendtell.evaluation.metrics import repetition, score_captions, skipped_metrics

JA_REFERENCES = {"a": ["赤い丸と青い四角。", "赤い丸、青い四角"], "b": ["緑の丸と黄色い四角"]}


@pytest.fixture
def no_java(monkeypatch):
    monkeypatch.setattr(metrics.shutil, "which", lambda name: None)


def test_japanese_is_scored_on_characters_without_java_or_meteor(no_java):
    exact = {"a": "赤い丸と青い四角", "b": "緑の丸と黄色い四角"}
    scores = score_captions(exact, JA_REFERENCES, official=True, tokenizer="unicode")
    assert scores["Bleu_4"] == pytest.approx(1.0) and scores["ROUGE_L"] == pytest.approx(1.0)
    assert "METEOR" not in scores and "SPICE" not in scores
    assert set(scores) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"}
    # the same characters in another order: every character matches, few character pairs do;
    # PTB would see each caption as one unknown word and score nothing
    swapped = {"a": "青い丸と赤い四角", "b": "黄色い丸と緑の四角"}
    chars = score_captions(swapped, JA_REFERENCES, official=False, tokenizer="unicode")
    words = score_captions(swapped, JA_REFERENCES, official=False)
    assert chars["Bleu_1"] == pytest.approx(1.0) and chars["Bleu_4"] < 0.7
    assert words["Bleu_1"] < 1e-6


def test_german_is_scored_on_its_words():
    refs = {"a": ["Ein grüner Kreis über einem Quadrat."]}
    scores = score_captions({"a": "ein grüner kreis über einem quadrat"}, refs, tokenizer="unicode")
    assert scores["Bleu_4"] == pytest.approx(1.0)


def test_the_skipped_metrics_are_said_in_one_line():
    assert skipped_metrics("ptb") is None
    line = skipped_metrics("unicode")
    assert "METEOR" in line and "English-only" in line and "\n" not in line


def test_repetition_counts_the_tokenizer_s_tokens():
    got = repetition({"a": "赤い赤い丸", "b": "青い丸"}, "unicode")
    assert got == {"repeated_bigram_captions": 0.5, "mean_words": 4.0}
    assert repetition({"a": "赤い赤い丸"})["mean_words"] == 1.0  # PTB: words between spaces
