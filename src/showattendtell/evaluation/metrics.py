"""Caption metrics with the official COCO caption toolkit (pycocoevalcap).

``official=True`` is what papers report: the Stanford PTB tokenizer, BLEU-1..4, METEOR, ROUGE-L,
CIDEr-D (and SPICE when its Stanford CoreNLP models are installed); it needs Java.
``official=False`` (validation during training) tokenises in Python the same way (lower case,
punctuation removed) and computes the Java-free metrics: BLEU-1..4, ROUGE-L and CIDEr-D.

A model of another tokenizer than English PTB (``--data.tokenizer unicode``: tokenizers.py) is
scored on that tokenizer's own tokens (for Japanese, characters), without Java: BLEU-1..4,
ROUGE-L and CIDEr-D. METEOR and SPICE are English-only (WordNet synonyms, English stems and
parses) and are left out, which ``skipped_metrics`` says in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from showattendtell.errors import UserError
from showattendtell.network.tokenizers import DEFAULT_TOKENIZER, get_tokenizer

log = logging.getLogger(__name__)


class MetricsError(UserError, RuntimeError):
    """The official scorer cannot run here; the message says what to install."""


def java_available() -> bool:
    return shutil.which("java") is not None


def require_java(what: str, otherwise: str = "and try again") -> None:
    """Raise MetricsError "WHAT: install a Java runtime (...) OTHERWISE" when there is no Java."""
    if not java_available():
        raise MetricsError(
            f"{what}: install a Java runtime (e.g. `apt-get install "
            f"default-jre-headless`) {otherwise}"
        )


def spice_available() -> bool:
    """SPICE needs Stanford CoreNLP 3.6.0 and its models jar next to spice-1.0.jar.

    pycocoevalcap would otherwise try to download them (about 1 GB) in the middle of scoring.
    """
    import pycocoevalcap.spice.spice as spice

    lib = Path(spice.__file__).parent / "lib"
    return all((lib / f"stanford-corenlp-3.6.0{s}.jar").is_file() for s in ("", "-models"))


@functools.lru_cache(maxsize=1)
def meteor_scorer():
    """One METEOR scorer per process: its Java side spends 10-30 s loading the paraphrase table,
    so repeated official scoring (several splits, tests) pays that once. Stopped at exit."""
    from pycocoevalcap.meteor.meteor import Meteor

    scorer = Meteor()
    atexit.register(stop_meteor, scorer)
    return scorer


def stop_meteor(scorer) -> None:
    """Stop the scorer's Java process and close its three pipes (again harmless). Why:
    pycocoevalcap's ``__del__`` closes only stdin, so the other two were left to the collector
    at exit, which said ``ResourceWarning: unclosed file <_io.BufferedReader ...>``."""
    proc = scorer.meteor_p
    with contextlib.suppress(OSError):  # a pipe to a process that is gone
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def meteor_scores(gts: dict, res: dict) -> tuple[float, list[float]]:
    """METEOR's ``compute_score``; after any failure, Ctrl-C included, its Java process is
    stopped and the scorer dropped (the next call starts a new one). pycocoevalcap's scorer
    holds a lock while it scores and its ``__del__`` takes that lock again: a scorer left in
    the middle of a score would hang the process when it is collected, at exit at the latest."""
    scorer = meteor_scorer()
    try:
        return scorer.compute_score(gts, res)
    except BaseException:
        meteor_scorer.cache_clear()
        stop_meteor(scorer)
        if scorer.lock.locked():
            scorer.lock.release()
        raise


def _ptb_tokenize(captions: dict[str, list[str]]) -> dict[str, list[str]]:
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    return PTBTokenizer().tokenize({k: [{"caption": c} for c in v] for k, v in captions.items()})


# The scores validation logs (as val/KEY), by the toolkit's names; `sat train --run.monitor`
# picks the best checkpoint by one of them.
VALIDATION_SCORES = {"bleu1": "Bleu_1", "bleu4": "Bleu_4", "rouge_l": "ROUGE_L", "cider": "CIDEr"}


def skipped_metrics(tokenizer: str) -> str | None:
    """The line that says which metrics ``score_captions`` leaves out for captions of
    ``tokenizer``, and why (None: none)."""
    if get_tokenizer(tokenizer).english:
        return None
    return (
        f"METEOR and SPICE skipped: they are English-only; BLEU, ROUGE-L and CIDEr-D are "
        f"computed on the {tokenizer} tokenizer's tokens"
    )


def score_captions(
    predictions: dict[str, str],
    references: dict[str, list[str]],
    official: bool = True,
    spice: bool = True,
    tokenizer: str = DEFAULT_TOKENIZER,
) -> dict[str, float]:
    """Corpus-level scores of one predicted caption per image against its references.

    ``tokenizer``: the model's (its vocabulary's). For one that is not English PTB, captions
    are scored on its tokens with the Java-free metrics, ``official`` or not."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    missing = [k for k in predictions if k not in references]
    if missing:
        raise ValueError(f"{len(missing)} predictions have no references (e.g. {missing[0]!r})")
    if not predictions:
        raise ValueError("no captions to score")
    keys = list(predictions)
    split = get_tokenizer(tokenizer)
    if not split.english:
        official = False
    if official:
        require_java("the official COCO metrics (PTB tokenizer, METEOR) need Java")
        res = _ptb_tokenize({k: [predictions[k]] for k in keys})
        gts = _ptb_tokenize({k: references[k] for k in keys})
    else:
        res = {k: [" ".join(split.tokenize(predictions[k]))] for k in keys}
        gts = {k: [" ".join(split.tokenize(r)) for r in references[k]] for k in keys}

    # each scorer's compute_score, with the name(s) of what it returns
    scorers: list[tuple[Callable, list[str] | str]] = [
        (Bleu(4).compute_score, ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"]),
        (Rouge().compute_score, "ROUGE_L"),
        (Cider().compute_score, "CIDEr"),
    ]
    if official:
        scorers.insert(1, (meteor_scores, "METEOR"))
        if spice and spice_available():
            from pycocoevalcap.spice.spice import Spice

            scorers.append((Spice().compute_score, "SPICE"))
        elif spice:
            log.warning(
                "SPICE skipped: its Stanford CoreNLP models are not installed "
                "(pycocoevalcap/spice/get_stanford_models.py downloads them)"
            )
    scores: dict[str, float] = {}
    for compute, names in scorers:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the scorers print their progress
                value, _ = compute(gts, res)
        except (subprocess.CalledProcessError, OSError) as e:
            if names != "SPICE":
                raise MetricsError(f"the COCO caption toolkit failed computing {names}: {e}") from e
            log.warning("SPICE skipped: its Java scorer failed (%s)", e)
            continue
        if isinstance(names, list):
            scores.update(zip(names, map(float, value), strict=True))
        else:
            scores[names] = float(value)
    return scores


def repetition(captions: dict[str, str], tokenizer: str = DEFAULT_TOKENIZER) -> dict[str, float]:
    """How often captions repeat themselves ("at a table at a table"): the share of captions in
    which some word bigram occurs twice, and the mean caption length in words: the tokens of
    ``tokenizer`` (the model's), which for English are the words separated by spaces."""
    split = get_tokenizer(tokenizer)
    repeated, words = 0, 0
    for caption in captions.values():
        w = caption.split() if split.english else split.tokenize(caption)
        bigrams = list(zip(w, w[1:], strict=False))
        repeated += len(set(bigrams)) < len(bigrams)
        words += len(w)
    n = max(len(captions), 1)
    return {"repeated_bigram_captions": repeated / n, "mean_words": words / n}


class CiderDReward:
    """Per-caption CIDEr-D with the idf of a whole training set: the self-critical reward.

    pycocoevalcap's CiderScorer takes its document frequencies from the references it scores
    together; self-critical training scores one batch at a time, where that idf would be noise,
    so (as in Rennie et al. 2017) the frequencies and the log corpus size are those of every
    training image's references. The n-gram arithmetic is pycocoevalcap's own. ``references``:
    for each training image, its captions tokenised as `tokenize` does, joined by spaces.
    """

    def __init__(self, references: list[list[str]]):
        import numpy as np
        from pycocoevalcap.cider.cider_scorer import CiderScorer

        class _FrozenIdf(dict):
            def __missing__(self, ngram):  # unseen n-grams: df 0 (the scorer reads max(1, df))
                return 0.0

        class _CorpusIdfScorer(CiderScorer):
            # compute_cider sets ref_len = log(#references scored): keep the corpus's instead
            ref_len = property(lambda self: corpus_ref_len, lambda self, value: None)

        corpus = CiderScorer()
        for refs in references:
            corpus.cook_append(None, refs)
        corpus.compute_doc_freq()
        corpus_ref_len = float(np.log(float(len(references))))
        self._idf = _FrozenIdf(corpus.document_frequency)
        self._scorer_class = _CorpusIdfScorer

    def __call__(self, candidates: list[str], references: list[list[str]]) -> list[float]:
        """CIDEr-D of each candidate against its own references (x10, as the toolkit reports)."""
        scorer = self._scorer_class()
        scorer.document_frequency = self._idf
        for cand, refs in zip(candidates, references, strict=True):
            scorer.cook_append(cand, refs)
        return [float(s) for s in scorer.compute_cider()]


class MeteorReward:
    """Per-caption METEOR (the official Java scorer, one process per training run): a reward term
    for self-critical training. CIDEr-D alone rewards a few rare, correct n-grams and drifts to
    short captions; METEOR's recall-weighted unigram matching (with stems and synonyms) pulls
    back toward captions that say all the references say."""

    def __init__(self):
        require_java("a METEOR reward needs Java", otherwise="or set its weight to 0")

    def __call__(self, candidates: list[str], references: list[list[str]]) -> list[float]:
        gts = {i: refs for i, refs in enumerate(references)}
        res = {i: [cand] for i, cand in enumerate(candidates)}
        try:
            _, scores = meteor_scores(gts, res)
        except (OSError, ValueError) as e:
            raise MetricsError(f"the METEOR scorer failed: {e}") from e
        return [float(s) for s in scores]
