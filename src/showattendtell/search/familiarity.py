"""Familiarity: how much a photo looks like the photos the model learnt from, calibrated to 0..1.

A captioning model can only describe what its training photos showed: on a photo unlike all of
them (a bear, a kitchen, a plate of donuts for a model that saw 6,000 Flickr8k photos of people
and dogs) it still writes a fluent caption, usually a wrong one. It cannot know the right
caption, but it can tell that the photo is unfamiliar:

    similarity(x)  = the mean cosine between x's pooled grid and its k nearest training photos'
    familiarity(x) = the fraction of training photos whose own similarity (to their k nearest
                     *other* training photos) is at most similarity(x)

The training photos' pooled grids are the consensus index's (consensus.py), which travels in the
model file; so a model with an index has a familiarity and a model without one has none. The
calibration needs no held-out data: the index's own photos, each scored leave-one-out against
the rest, are what "in domain" looks like. A photo as typical as the median training photo scores
about 0.5; one less similar to its neighbours than every training photo is to its own scores 0.
``NEIGHBOURS`` (k = 1: the single nearest training photo) separated bad captions from good ones
best of k = 1..60.

A model with confidence fits of its own (the bundled models; confidence.py) is warned by its
confidence, which combines familiarity's typicality with more of what the model knows; the rule
below warns the results of a model scored by another model's fits, and is the confidence
study's baseline.

The warning does not use familiarity alone: on in-domain photos the caption's own mean
log-probability per word tells bad captions better, on unfamiliar photos familiarity does, and a
logistic regression on both beats either (scripts/familiarity_study.py; the model card has the
numbers). So the result is warned when

    P(bad caption) = sigmoid(b0 + b1 * typicality + b2 * mean log-probability per word)

exceeds ``RISK_THRESHOLD``, where typicality = (similarity - the calibration's median) / its
interquartile range: the similarity on the index's own scale, so that it carries over to an
encoder whose cosines sit elsewhere, and without familiarity's ties at 0 far out of domain.
``COEFFICIENTS`` were fitted by scripts/familiarity_study.py on the bundled soft model at its
stored decoding (Flickr8k dev and COCO photos pooled, "bad" = per-image CIDEr under 0.3). Other
models share the typicality scale and, through the vocabulary, the log-probability scale only
approximately: a model much more or less confident than the bundled one is warned more or less
often. The warning says why: the photo is unlike the training photos (familiarity under
``UNFAMILIAR``), and/or the model is unsure of its words (a mean log-probability per word under
``TYPICAL_LOG_PROB``, the dev photos' median, or the photo is familiar).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from showattendtell.search.consensus import ConsensusIndex

NEIGHBOURS = 1  # k nearest training photos averaged (scripts/familiarity_study.py)
# P(bad) = sigmoid(bias + typicality * w1 + mean log-prob per word * w2): fitted by
# scripts/familiarity_study.py on the bundled soft model at its stored decoding (1,120 photos:
# Flickr8k dev and COCO pooled); other models share these scales approximately
COEFFICIENTS = (-3.5415, -0.4150, -4.2210)  # bias, typicality, mean log-probability per word
RISK_THRESHOLD = 0.65  # P(bad) above this: the result is warned (study: 7.4 % of dev, 60 % COCO)
UNFAMILIAR = 0.05  # familiarity below this: the warning says the photo is unlike the training
TYPICAL_LOG_PROB = -0.72  # median mean log-prob per word on Flickr8k dev: below, "unsure"
UNLIKE = "the photo is unlike the training photos"  # the reasons a warning gives
UNSURE = "the model is unsure of its words"
WARNING = f"{UNLIKE}; the caption may be wrong"
UNSURE_WARNING = f"{UNSURE}; the caption may be wrong"
BOTH_WARNING = f"{UNLIKE} and {UNSURE}; the caption may be wrong"
CALIBRATION_PHOTOS = 2000  # at most this many index photos calibrate (evenly spaced): enough
# for a stable scale, few enough for a quick start
_CHUNK = 500  # calibration rows scored at once: a (500, N) similarity matrix


class Familiarity:
    """Familiarity scores against one consensus index (see the module's docstring).

    The calibration (each calibrating photo's leave-one-out similarity, sorted) is computed on
    first use, once, under a lock: the service's worker threads may ask at the same time.
    """

    def __init__(
        self,
        index: ConsensusIndex,
        neighbours: int = NEIGHBOURS,
        threshold: float = RISK_THRESHOLD,
        coefficients: tuple[float, float, float] = COEFFICIENTS,
    ):
        n = len(index.references)
        if n < 2:
            raise ValueError(f"familiarity needs an index of at least 2 photos, not {n}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the warning's risk threshold must be in [0, 1], not {threshold}")
        self.index = index
        self.neighbours = max(1, min(neighbours, n - 1))  # leave-one-out leaves n - 1
        self.threshold = threshold
        self.coefficients = coefficients
        self._reference: np.ndarray | None = None
        self._lock = threading.Lock()

    def similarity(self, embeddings: torch.Tensor) -> np.ndarray:
        """Pooled grids (B, D) -> (B,) mean cosine to their ``neighbours`` nearest index photos."""
        rows = self.index.embeddings  # (N, D), unit rows
        queries = F.normalize(embeddings.float().to(rows.device), dim=1)
        top = (queries @ rows.T).topk(self.neighbours, dim=1).values
        return top.mean(1).cpu().double().numpy()

    def reference(self) -> np.ndarray:
        """The calibrating photos' similarities to their nearest *other* index photos, sorted."""
        with self._lock:
            if self._reference is None:
                self._reference = self._calibrate()
        return self._reference

    def _calibrate(self) -> np.ndarray:
        rows = self.index.embeddings
        n = len(rows)
        picks = np.unique(np.linspace(0, n - 1, min(n, CALIBRATION_PHOTOS)).round().astype(int))
        out = []
        for lo in range(0, len(picks), _CHUNK):
            chosen = torch.as_tensor(picks[lo : lo + _CHUNK], device=rows.device)
            sims = rows[chosen] @ rows.T  # (c, N)
            sims[torch.arange(len(chosen), device=rows.device), chosen] = -torch.inf  # not itself
            out.append(sims.topk(self.neighbours, dim=1).values.mean(1))
        return np.sort(torch.cat(out).double().cpu().numpy())

    def calibrate(self, similarity: np.ndarray) -> np.ndarray:
        """Similarities -> familiarity in [0, 1]: the empirical CDF of the reference."""
        ref = self.reference()
        return np.searchsorted(ref, np.asarray(similarity, np.float64), side="right") / len(ref)

    def score(self, embeddings: torch.Tensor) -> np.ndarray:
        """Pooled grids (B, D) -> (B,) familiarity in [0, 1]."""
        return self.calibrate(self.similarity(embeddings))

    def typicality(self, similarity: np.ndarray) -> np.ndarray:
        """Similarities on the index's own scale: (s - the calibration's median) / its
        interquartile range (0: as similar as the median training photo to its neighbour)."""
        q25, median, q75 = np.quantile(self.reference(), [0.25, 0.5, 0.75])
        return (np.asarray(similarity, np.float64) - median) / max(q75 - q25, 1e-12)

    def risk(self, similarity: np.ndarray, log_prob_per_word: np.ndarray) -> np.ndarray:
        """P(a bad caption) from the similarity and the caption's mean log-probability per word
        (``COEFFICIENTS``). A NaN log-probability counts as typical, -inf as unsure."""
        lp = np.asarray(log_prob_per_word, np.float64)
        lp = np.nan_to_num(lp, nan=TYPICAL_LOG_PROB, neginf=-1e3, posinf=0.0)
        b0, b1, b2 = self.coefficients
        return 1.0 / (1.0 + np.exp(-(b0 + b1 * self.typicality(similarity) + b2 * lp)))

    def warning(
        self, familiarity: float | None, risk: float | None, log_prob_per_word: float | None
    ) -> str | None:
        """The result's warning when ``risk`` exceeds the threshold, saying why; else None."""
        if familiarity is None or risk is None or not risk > self.threshold:
            return None
        unlike = familiarity < UNFAMILIAR
        unsure = not unlike or not (
            log_prob_per_word is not None and log_prob_per_word >= TYPICAL_LOG_PROB
        )
        return BOTH_WARNING if unlike and unsure else WARNING if unlike else UNSURE_WARNING


def log_prob_per_word(log_prob: float, words: int) -> float:
    """A caption's mean log-probability per word, ``<end>`` counted as a word (as scored)."""
    return float(log_prob) / (words + 1)


_SCORERS: weakref.WeakKeyDictionary[ConsensusIndex, Familiarity] = weakref.WeakKeyDictionary()
_SCORERS_LOCK = threading.Lock()


def for_index(index: ConsensusIndex | None) -> Familiarity | None:
    """The Familiarity of a model's index (None: no index), made once per index so that its
    calibration is computed once however many captioners share the model."""
    if index is None:
        return None
    with _SCORERS_LOCK:
        scorer = _SCORERS.get(index)
        if scorer is None:
            scorer = _SCORERS[index] = Familiarity(index)
    return scorer
