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
Below ``THRESHOLD`` the result carries ``WARNING``. ``NEIGHBOURS`` (k = 1: the single nearest
training photo) separated bad captions from good ones best of k = 1..60 on the COCO photos, and
``THRESHOLD`` warns about 1 in 30 Flickr8k dev photos but most COCO photos
(scripts/familiarity_study.py; the model card has the numbers). On in-domain photos the caption's
own log-probability tells bad captions better; familiarity is for photos unlike the training set.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from showattendtell.consensus import ConsensusIndex

NEIGHBOURS = 1  # k nearest training photos averaged (scripts/familiarity_study.py)
THRESHOLD = 0.05  # familiarity below this: the caption gets WARNING
WARNING = "the photo is unlike the training photos; the caption may be wrong"
CALIBRATION_PHOTOS = 2000  # at most this many index photos calibrate (evenly spaced; ~0.5 s)
_CHUNK = 500  # calibration rows scored at once: a (500, N) similarity matrix


class Familiarity:
    """Familiarity scores against one consensus index (see the module's docstring).

    The calibration (each calibrating photo's leave-one-out similarity, sorted) is computed on
    first use, once, under a lock: the service's worker threads may ask at the same time.
    """

    def __init__(
        self, index: ConsensusIndex, neighbours: int = NEIGHBOURS, threshold: float = THRESHOLD
    ):
        n = len(index.references)
        if n < 2:
            raise ValueError(f"familiarity needs an index of at least 2 photos, not {n}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the familiarity threshold must be in [0, 1], not {threshold}")
        self.index = index
        self.neighbours = max(1, min(neighbours, n - 1))  # leave-one-out leaves n - 1
        self.threshold = threshold
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
            chosen = torch.as_tensor(picks[lo : lo + _CHUNK])
            sims = rows[chosen] @ rows.T  # (c, N)
            sims[torch.arange(len(chosen)), chosen] = -torch.inf  # not its own neighbour
            out.append(sims.topk(self.neighbours, dim=1).values.mean(1))
        return np.sort(torch.cat(out).double().numpy())

    def calibrate(self, similarity: np.ndarray) -> np.ndarray:
        """Similarities -> familiarity in [0, 1]: the empirical CDF of the reference."""
        ref = self.reference()
        return np.searchsorted(ref, np.asarray(similarity, np.float64), side="right") / len(ref)

    def score(self, embeddings: torch.Tensor) -> np.ndarray:
        """Pooled grids (B, D) -> (B,) familiarity in [0, 1]."""
        return self.calibrate(self.similarity(embeddings))

    def warning(self, familiarity: float | None) -> str | None:
        """``WARNING`` for a familiarity below the threshold, else None."""
        if familiarity is None or familiarity >= self.threshold:
            return None
        return WARNING


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
