"""score_captions against pycocoevalcap called directly, on a small hand-made example."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys

import pytest
from helpers.marks import needs_java

from showattendtell.evaluation import metrics
from showattendtell.evaluation.metrics import MetricsError, score_captions

PREDICTIONS = {
    "1": "A man riding a wave on top of a surfboard.",
    "2": "two dogs play in the grass",
    "3": "A plate of food with broccoli and rice",
    "4": "a red bus parked on the side of the road",
}
REFERENCES = {
    "1": [
        "A man riding a wave on top of a surfboard.",
        "A surfer rides a large wave.",
        "Man on a surfboard riding the ocean waves.",
    ],
    "2": [
        "Two dogs are playing in the grass.",
        "A pair of dogs running on a lawn.",
        "Two brown dogs play together outside.",
    ],
    "3": [
        "A plate with rice, broccoli and chicken.",
        "Food on a white plate.",
        "A dish of broccoli, meat and rice on a table.",
    ],
    "4": [
        "A red double decker bus on a city street.",
        "A bus parked by the curb.",
        "The red bus is stopped on the side of the road.",
    ],
}


def _direct() -> dict[str, float]:
    """The toolkit's own pipeline, as its COCOEvalCap.evaluate runs it (minus SPICE)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tok = PTBTokenizer()
    with contextlib.redirect_stdout(io.StringIO()):
        gts = tok.tokenize({k: [{"caption": c} for c in v] for k, v in REFERENCES.items()})
        res = tok.tokenize({k: [{"caption": v}] for k, v in PREDICTIONS.items()})
        out: dict[str, float] = {}
        bleu, _ = Bleu(4).compute_score(gts, res)
        out.update({f"Bleu_{n}": b for n, b in enumerate(bleu, 1)})
        # the toolkit's Meteor object; the wrapper keeps one per process (its Java side loads
        # for 10-30 s), so share it rather than load the paraphrase table twice
        meteor = metrics.meteor_scorer()
        assert isinstance(meteor, Meteor)
        out["METEOR"], _ = meteor.compute_score(gts, res)
        out["ROUGE_L"], _ = Rouge().compute_score(gts, res)
        out["CIDEr"], _ = Cider().compute_score(gts, res)
    return out


@pytest.fixture(scope="module")
def official() -> dict[str, float]:
    return score_captions(PREDICTIONS, REFERENCES, official=True, spice=False)


@needs_java
def test_official_scores_equal_the_toolkit(official):
    direct = _direct()
    assert set(official) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"}
    for k, v in direct.items():
        assert official[k] == pytest.approx(v, abs=1e-9), k
    assert 0.3 < official["Bleu_1"] < 1.0 and official["CIDEr"] > 0.5


@needs_java
def test_python_tokenizer_matches_ptb_on_plain_captions(official):
    fast = score_captions(PREDICTIONS, REFERENCES, official=False)
    assert "METEOR" not in fast
    for k in ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"):
        assert fast[k] == pytest.approx(official[k], abs=1e-9), k


def test_perfect_and_disjoint_captions():
    refs = {
        "a": ["the cat sat on the mat", "a cat is on a mat"],
        "b": ["two birds fly over the sea", "birds flying above water"],
    }
    perfect = score_captions(
        {"a": "the cat sat on the mat", "b": "two birds fly over the sea"}, refs, official=False
    )
    assert perfect["Bleu_4"] == pytest.approx(1.0)
    nothing = score_captions({"a": "zebra xylophone", "b": "quantum yak"}, refs, official=False)
    assert nothing["Bleu_1"] < 1e-6 and nothing["CIDEr"] == pytest.approx(0.0)


def test_without_java_the_error_says_so(monkeypatch):
    monkeypatch.setattr(metrics.shutil, "which", lambda name: None)
    with pytest.raises(MetricsError, match="need Java"):
        score_captions(PREDICTIONS, REFERENCES, official=True)


def test_spice_is_skipped_with_a_notice_when_its_models_are_absent(monkeypatch, caplog):
    monkeypatch.setattr(metrics, "spice_available", lambda: False)
    monkeypatch.setattr(metrics, "java_available", lambda: True)
    # skip the Java scorers: only the notice is under test here
    monkeypatch.setattr(
        metrics,
        "_ptb_tokenize",
        lambda caps: {k: [" ".join(v[0].lower().split())] * len(v) for k, v in caps.items()},
    )

    class FakeMeteor:
        def compute_score(self, gts, res):
            return 0.5, []

    monkeypatch.setattr(metrics, "meteor_scorer", FakeMeteor)
    with caplog.at_level(logging.WARNING):
        scores = score_captions({"1": "a b c"}, {"1": ["a b c"]}, official=True, spice=True)
    assert "SPICE" not in scores and scores["METEOR"] == 0.5
    assert any("SPICE skipped" in r.getMessage() for r in caplog.records)


def test_predictions_without_references_are_refused():
    with pytest.raises(ValueError, match="no references"):
        score_captions({"x": "a cat"}, {"y": ["a cat"]}, official=False)
    with pytest.raises(ValueError, match="no captions"):
        score_captions({}, {}, official=False)


def test_repetition_counts_captions_that_repeat_a_bigram():
    from showattendtell.evaluation.metrics import repetition

    got = repetition(
        {
            "a": "a man sits at a table at a table",
            "b": "a dog runs on the grass",
            "c": "two dogs two cats",
            "d": "a a a",
        }
    )
    # "at a" / "a table" twice in a; "a a" twice in d; c repeats words but no bigram
    assert got == {"repeated_bigram_captions": 0.5, "mean_words": (9 + 6 + 4 + 3) / 4}


class StuckMeteor:
    """pycocoevalcap's Meteor as far as a failure goes: compute_score holds the lock it takes,
    and __del__ takes it again (so a scorer left mid-score hangs the process at exit)."""

    def __init__(self, failure: BaseException):
        import subprocess
        import threading

        self.failure = failure
        self.meteor_p = subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE)
        self.lock = threading.Lock()

    def compute_score(self, gts, res):
        self.lock.acquire()
        raise self.failure

    def __del__(self):
        self.lock.acquire()
        self.meteor_p.stdin.close()
        self.meteor_p.kill()
        self.meteor_p.wait()
        self.lock.release()


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), ValueError("could not convert")])
def test_a_meteor_score_cut_short_stops_java_and_leaves_no_lock_held(monkeypatch, failure):
    """Ctrl-C during `sat evaluate`'s METEOR left it waiting for ever at exit."""
    from showattendtell.evaluation import metrics

    stuck = StuckMeteor(failure)
    monkeypatch.setattr(metrics, "meteor_scorer", lambda: stuck)
    monkeypatch.setattr(metrics.meteor_scorer, "cache_clear", lambda: None, raising=False)
    with pytest.raises(type(failure)):
        metrics.meteor_scores({1: ["a dog"]}, {1: ["a dog"]})
    assert stuck.meteor_p.poll() is not None and not stuck.lock.locked()
    assert stuck.lock.acquire(timeout=1)  # what __del__ does first: it no longer waits
    stuck.lock.release()


def test_the_meteor_scorer_closes_its_pipes_at_exit(tmp_path):
    """pycocoevalcap's scorer closes one of its three pipes when collected; at exit the other
    two made Python say ``ResourceWarning: unclosed file``. A stand-in Java process (cat)."""
    script = tmp_path / "scorer.py"
    script.write_text(
        "import subprocess, threading\n"
        "import pycocoevalcap.meteor.meteor as m\n"
        "class Cat(m.Meteor):\n"
        "    def __init__(self):\n"
        "        pipe = subprocess.PIPE\n"
        "        self.meteor_p = subprocess.Popen(['cat'], stdin=pipe, stdout=pipe, stderr=pipe)\n"
        "        self.lock = threading.Lock()\n"
        "m.Meteor = Cat\n"
        "from showattendtell.evaluation import metrics\n"
        "metrics.meteor_scorer()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ResourceWarning" not in proc.stderr, proc.stderr
