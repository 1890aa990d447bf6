"""Confidence: the probability, 0..1, that a caption is good, from what the model knows of it.

A caption counts as bad when its per-image CIDEr-D against the photo's own references is below
0.3. No single signal tells bad captions well (familiarity alone ranks them with an AUROC of
0.65, the caption's mean log-probability per word 0.71), so the confidence combines several in a
logistic regression:

    P(good) = sigmoid(bias + sum_i weight_i * (feature_i - mean_i) / scale_i)

with the features (``signals``):

- ``log_prob_per_word``: the caption's log-probability over its words, ``<end>`` counted
- ``min_word_log_prob``: the log-probability of its least likely word (``<end>`` counted)
- ``end_log_prob``: the log-probability of its ``<end>`` (how sure the model is it is complete)
- ``word_log_prob_spread``: the standard deviation of its words' log-probabilities
- ``beam_agreement``: how much the beam's other captions share its words (unigram F1, mean)
- ``beam_share``: its share of the finished beams' probability (softmax of their log-probs)
- ``attention_entropy``: the attention's mean entropy over its words, over log(locations)
- ``attention_peak``: the attention's mean largest weight over its words
- ``attention_coverage``: the entropy of its words' summed attention, over log(locations)
- ``repeated_words``: the share of its words that repeat an earlier word of it
- ``words``: its length
- ``consensus``: its CIDEr-D against the captions of the nearest training photos (consensus.py)
- ``beam_consensus``: the mean consensus of the beam's finished captions (it among them)
- ``typicality``: how like the training photos the photo is (familiarity.py)

The last three need the model's consensus index. The signals come from what the search kept
(each word's log-probability, the attention maps, the beam's captions and consensus scores):
the confidence costs no second pass of the decoder over the captions (``word_log_probs``, that
pass, remains for hypotheses made without them). A ``ConfidenceFit`` is one regression; a model
carries a list of them (``ConfidenceFits``), and a photo is scored by the first whose features
the model has (a model without an index uses one fitted without those three). The fits are made by
scripts/confidence_study.py on photos with references and are stored in the model file's
metadata (model_file.py); a model file without them is scored by the bundled default model's
fits (``DEFAULT_FITS``), whose scales other models share only approximately, as familiarity's
calibration does. The bundled model files carry their fits beside them in
``bundled/confidence.json`` (rewriting a 40 MB file in git for a few numbers would keep both
versions in the history forever).

A result is warned when its confidence is below the fit's ``warn_below``: the lowest confidence
that warns at least half of the bad captions (on cross-validated predictions). At that recall of
0.5 the study measured a precision of 0.63 for the bundled soft model and 0.74 for the hard one
(the model card). The warning says why, as familiarity's did: the photo is unlike
the training photos (familiarity under familiarity.UNFAMILIAR), or else the model is unsure of
its words.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from showattendtell.network.vocab import END, START
from showattendtell.search import familiarity

FORMAT_VERSION = 1
FEATURES = (
    "log_prob_per_word",
    "min_word_log_prob",
    "end_log_prob",
    "word_log_prob_spread",
    "beam_agreement",
    "beam_share",
    "attention_entropy",
    "attention_peak",
    "attention_coverage",
    "repeated_words",
    "words",
    "consensus",
    "beam_consensus",
    "typicality",
)
INDEX_FEATURES = (
    "consensus",
    "beam_consensus",
    "typicality",
)  # only a model with a consensus index has these
BUNDLED_FITS = Path(__file__).parents[1] / "bundled" / "confidence.json"
DEFAULT_MODEL = "flickr8k_lite2_soft"  # whose fits score a model file that carries none
_FLOOR = -30.0  # a -inf log-probability (a banned word forced in) counts as this


class ConfidenceFitError(ValueError):
    """A stored fit that cannot be used (damaged metadata, unknown features)."""


@dataclass(frozen=True)
class ConfidenceFit:
    """One logistic regression of "the caption is good" on standardised features."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    warn_below: float  # confidence under this: the result is warned

    def __post_init__(self) -> None:
        n = len(self.features)
        unknown = sorted(set(self.features) - set(FEATURES))
        if not n or unknown:
            raise ConfidenceFitError(f"a confidence fit needs known features, not {unknown}")
        if not (len(self.mean) == len(self.scale) == len(self.weights) == n):
            raise ConfidenceFitError(f"a confidence fit of {n} features needs {n} of each number")
        numbers = (*self.mean, *self.scale, *self.weights, self.bias, self.warn_below)
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers):
            raise ConfidenceFitError("a confidence fit's numbers must be finite")
        if min(self.scale) <= 0 or not 0.0 <= self.warn_below <= 1.0:
            raise ConfidenceFitError("a confidence fit needs scales > 0 and warn_below in [0, 1]")

    def applies(self, available: Sequence[str]) -> bool:
        return set(self.features) <= set(available)

    def confidence(self, signals: Mapping[str, np.ndarray]) -> np.ndarray:
        """P(good) of each caption from its ``signals`` (feature -> (B,) array)."""
        x = np.stack([np.asarray(signals[f], np.float64) for f in self.features], 1)
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        logit = self.bias + z @ np.asarray(self.weights)
        return 1.0 / (1.0 + np.exp(-np.clip(logit, -60, 60)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> ConfidenceFit:
        try:
            return cls(
                features=tuple(str(f) for f in d["features"]),
                mean=tuple(float(x) for x in d["mean"]),
                scale=tuple(float(x) for x in d["scale"]),
                weights=tuple(float(x) for x in d["weights"]),
                bias=float(d["bias"]),
                warn_below=float(d["warn_below"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfidenceFitError):
                raise
            raise ConfidenceFitError(f"a damaged confidence fit ({e!r})") from None


@dataclass(frozen=True)
class ConfidenceFits:
    """A model's fits, the one with the most features first; ``about``: how they were made."""

    fits: tuple[ConfidenceFit, ...]
    about: str = ""

    def __post_init__(self) -> None:
        if not self.fits:
            raise ConfidenceFitError("no confidence fit")

    def for_features(self, available: Sequence[str]) -> ConfidenceFit:
        """The first fit that needs only ``available`` features."""
        for fit in self.fits:
            if fit.applies(available):
                return fit
        raise ConfidenceFitError(f"no confidence fit uses only {sorted(available)}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "about": self.about,
                "fits": [f.to_dict() for f in self.fits],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ConfidenceFits:
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ConfidenceFitError(f"a damaged confidence fit ({e})") from None
        if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
            raise ConfidenceFitError("a confidence fit of another version: upgrade the package")
        if not isinstance(d.get("fits"), list):
            raise ConfidenceFitError("a damaged confidence fit (no list of fits)")
        return cls(tuple(ConfidenceFit.from_dict(f) for f in d["fits"]), str(d.get("about", "")))


@functools.cache
def _bundled() -> dict[str, ConfidenceFits]:
    """The bundled models' fits, by file stem (read once)."""
    if not BUNDLED_FITS.is_file():
        return {}
    data = json.loads(BUNDLED_FITS.read_text())
    return {name: ConfidenceFits.from_json(json.dumps(fits)) for name, fits in data.items()}


def bundled_fits(path: str | Path) -> ConfidenceFits | None:
    """The fits of a bundled model file (None: ``path`` is not one of them)."""
    path = Path(path)
    if path.parent.resolve() != BUNDLED_FITS.parent.resolve():
        return None
    return _bundled().get(path.stem)


def default_fits() -> ConfidenceFits | None:
    """The fits that score a model file without its own: the bundled default model's."""
    return _bundled().get(DEFAULT_MODEL)


# --------------------------------------------------------------------------- the signals


@torch.inference_mode()
def word_log_probs(
    decoder, annotations: torch.Tensor, captions: Sequence[Sequence[int]], hard_mode: str
) -> list[np.ndarray]:
    """Each caption's per-word log-probabilities, ``<end>`` last, by feeding it to the decoder
    word by word through the search's own two calls (``start``, ``step``): the numbers the
    search summed into its log-probability, for one decoder or an ensemble alike. The search
    keeps them itself (``Hypothesis.word_log_probs``); this pass is for hypotheses without."""
    B = len(captions)
    T = max(len(c) for c in captions) + 1 if B else 0
    out = np.zeros((B, T))
    if not B:
        return []
    device = annotations.device
    targets = torch.full((B, T), END, dtype=torch.long)
    for b, c in enumerate(captions):
        targets[b, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
    targets = targets.to(device)
    state = decoder.start(annotations)
    words = torch.full((B,), START, dtype=torch.long, device=device)
    for t in range(T):
        logp = decoder.step(words, state, hard_mode)
        out[:, t] = logp.log_probs.float().gather(1, targets[:, t : t + 1]).squeeze(1).cpu()
        words, state = targets[:, t], logp.state
    return [out[b, : len(c) + 1] for b, c in enumerate(captions)]


def beam_agreement(best: str, others: Sequence[str]) -> float:
    """The mean unigram F1 between the best caption and each other finished beam (1.0: no
    other beam): captions the beam agrees on are more often right."""
    if not others:
        return 1.0
    mine = Counter(best.split())
    scores = []
    for other in others:
        theirs = Counter(other.split())
        common = sum((mine & theirs).values())
        total = sum(mine.values()) + sum(theirs.values())
        scores.append(2.0 * common / total if total else 1.0)
    return float(np.mean(scores))


def beam_share(log_probs: Sequence[float]) -> float:
    """The best caption's share of the finished beams' probability (first: the best)."""
    lp = np.nan_to_num(np.asarray(log_probs, np.float64), nan=_FLOOR, neginf=_FLOOR)
    w = np.exp(lp - lp.max())
    return float(w[0] / w.sum())


def attention_entropy(alphas: torch.Tensor) -> float:
    """The mean entropy of a caption's attention maps (words, L), over log L (0: each word on
    one location; 1: uniform): a scale that does not depend on the grid's size."""
    if alphas.numel() == 0 or alphas.size(-1) < 2:
        return 0.0
    a = alphas.float().clamp_min(1e-12)
    a = a / a.sum(-1, keepdim=True)
    h = -(a * a.log()).sum(-1).mean()
    return float(h / math.log(alphas.size(-1)))


def attention_peak(alphas: torch.Tensor) -> float:
    """The mean over a caption's words of its attention map's largest weight (1: each word on
    one location): how sharply the model looks, on a scale of the grid's size."""
    if alphas.numel() == 0:
        return 1.0
    a = alphas.float()
    return float((a.max(-1).values / a.sum(-1).clamp_min(1e-12)).mean())


def attention_coverage(alphas: torch.Tensor) -> float:
    """The entropy of a caption's attention summed over its words, over log L (0: every word
    on the same location; 1: the words together look at the whole photo evenly)."""
    if alphas.numel() == 0 or alphas.size(-1) < 2:
        return 0.0
    return attention_entropy(alphas.float().sum(0, keepdim=True))


def repeated_words(tokens: Sequence[int]) -> float:
    """The share of a caption's words that repeat an earlier word of it (a caption going in
    circles, "a dog in a field in a field", is often wrong)."""
    return (len(tokens) - len(set(tokens))) / len(tokens) if tokens else 0.0


def signals(
    decoder,
    annotations: torch.Tensor,
    hypotheses: Sequence[Sequence],
    captions: Sequence[Sequence[str]],
    hard_mode: str,
    index=None,
    typicality: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every feature of each photo's best caption (feature -> (B,) array): ``hypotheses`` as
    the search returns them (best first), ``captions`` their words joined by spaces, in the same
    order; ``index`` (the consensus index) and ``typicality`` (familiarity.py) for a model with
    an index, else the features that need them are left out."""
    best = [hyps[0] for hyps in hypotheses]
    if all(h.word_log_probs is not None for h in best):  # kept by the search: no second pass
        per_word = [np.asarray(h.word_log_probs, np.float64) for h in best]
    else:  # hypotheses made elsewhere (a test's, an older search's): the decoder again
        per_word = word_log_probs(decoder, annotations, [h.tokens for h in best], hard_mode)
    floored = [np.maximum(np.nan_to_num(lp, nan=_FLOOR), _FLOOR) for lp in per_word]
    out = {
        "log_prob_per_word": [finite(h.log_prob) / (len(h.tokens) + 1) for h in best],
        "min_word_log_prob": [float(lp.min()) for lp in floored],
        "end_log_prob": [float(lp[-1]) for lp in floored],
        "word_log_prob_spread": [float(lp.std()) for lp in floored],
        "beam_agreement": [beam_agreement(c[0], c[1:]) for c in captions],
        "beam_share": [beam_share([h.log_prob for h in hyps]) for hyps in hypotheses],
        "attention_entropy": [attention_entropy(h.alphas) for h in best],
        "attention_peak": [attention_peak(h.alphas) for h in best],
        "attention_coverage": [attention_coverage(h.alphas) for h in best],
        "repeated_words": [repeated_words(h.tokens) for h in best],
        "words": [len(h.tokens) for h in best],
    }
    if index is not None and typicality is not None:
        hyps_ = [h for hyps in hypotheses for h in hyps]
        if all(h.consensus is not None for h in hyps_):  # reranked: the search's own scores
            scores = [np.array([h.consensus for h in hyps]) for hyps in hypotheses]
        else:  # each candidate is scored on its own (CIDEr-D against the neighbours' captions)
            pooled = annotations.float().mean(1)  # ConsensusIndex.pool
            scores = index.rerank(pooled, [list(c) for c in captions])
        out["consensus"] = [float(s[0]) for s in scores]
        out["beam_consensus"] = [float(np.mean(s)) for s in scores]
        out["typicality"] = typicality
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def finite(x: float) -> float:
    """A log-probability with -inf (a word no search would emit) and NaN floored."""
    return _FLOOR if not math.isfinite(x) else max(float(x), _FLOOR)


def warning(
    fit: ConfidenceFit, confidence: float, familiarity_: float | None, log_prob_per_word: float
) -> str | None:
    """The result's warning when its confidence is under the fit's ``warn_below``, saying why:
    the photo is unlike the training photos, the model is unsure of its words (a log-probability
    per word under the dev photos' median), or both; unsure when neither stands out."""
    if not confidence < fit.warn_below:
        return None
    unlike = familiarity_ is not None and familiarity_ < familiarity.UNFAMILIAR
    unsure = log_prob_per_word < familiarity.TYPICAL_LOG_PROB
    if unlike:
        return familiarity.BOTH_WARNING if unsure else familiarity.WARNING
    return familiarity.UNSURE_WARNING
