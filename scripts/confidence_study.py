"""How well each signal, and the confidence that combines them (confidence.py), tells good
captions from bad ones; and the fits a model's confidence is scored by.

    python scripts/confidence_study.py --flickr8k ../shared/data/flickr8k \\
        --coco ../shared/data/coco2017_val_subset:val \\
        --coco ../shared/data/coco2017_train_mini:train --cache runs/confidence \\
        --save runs/confidence/fits.json

A model (default: the bundled default, at its stored decoding) captions the Flickr8k dev photos
and the COCO photos once; each photo's caption, familiarity and signals (confidence.FEATURES)
are cached under --cache, every few batches, so a second run (or one after an interruption)
only computes the numbers. A caption is "bad" when its per-image CIDEr-D (pycocoevalcap, the
document frequencies of its own set, PTB-tokenised when Java is there) is below --bad (0.3).

Printed, on cross-validated predictions (5 folds by photo, all sets pooled: every photo is
scored by a regression that never saw it): the AUROC for a bad caption of each signal alone (a
one-feature logistic regression, so the sign is learnt too), of all of them together and of the
features a forward selection keeps (each added while it raises the cross-validated AUROC by
0.003 or more; chosen on the same folds, so slightly optimistic), on each set and on all; a
calibration table (confidence bins: photos, mean confidence, share good); and the warning, at
the threshold chosen on those predictions: the lowest whose warning reaches half of the bad
captions, its precision and recall. The fits (of the features selected from all signals, and
from those without the two that need a consensus index) are then made on all photos; --save
writes them as JSON (`sat export MODEL OUT --confidence FILE` stores them in a model file),
--bundled into bundled/confidence.json under the model's name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from showattendtell.captioning.captioner import Captioner, load_model
from showattendtell.data.datasets import CaptionedImage, load_split
from showattendtell.search import confidence
from showattendtell.search.confidence import ConfidenceFit, ConfidenceFits

sys.path.insert(0, str(Path(__file__).parent))
from familiarity_study import (  # noqa: E402
    _save,
    auroc,
    fit_logistic,
    per_image_cider,
    study_parser,
)

FOLDS = 5
RECALL_GOAL = 0.5  # the warning reaches at least this share of the bad captions ...
PRECISION_GOAL = 0.7  # ... and, the goal, this share of the warned captions are bad (printed:
# met or missed; the bundled soft model misses it, the hard one meets it)
MIN_GAIN = 0.003  # forward selection stops when the next feature adds less CV AUROC
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # the calibration table's confidence bins
NO_INDEX = tuple(f for f in confidence.FEATURES if f not in confidence.INDEX_FEATURES)
# the signals of the first fits (the bundled models' until the others were added): the study
# prints what selecting among these alone gives on the same photos, for comparison
FIRST_FEATURES = (
    "log_prob_per_word",
    "min_word_log_prob",
    "beam_agreement",
    "beam_share",
    "attention_entropy",
    "words",
    "consensus",
    "typicality",
)


# --------------------------------------------------------------------------- captioning


def caption_set(
    captioner: Captioner, images: list[CaptionedImage], cache: Path, batch_size: int
) -> dict[str, np.ndarray]:
    """Each photo's caption, familiarity and signals, from the cache file as far as it holds
    these photos, the rest computed (and cached every few batches)."""
    ids = [im.image_id for im in images]
    done: dict[str, list] = {}
    if cache.is_file():
        data = dict(np.load(cache, allow_pickle=False))
        m = min(len(data["ids"]), len(ids))
        if data["ids"].tolist()[:m] == ids[:m]:  # a run over these photos, or more, or fewer
            done = {k: list(v[:m]) for k, v in data.items() if k != "ids"}
    n = len(done.get("captions", []))
    for lo in range(n, len(images), batch_size):
        batch = torch.stack([captioner.preprocess(im.path) for im in images[lo : lo + batch_size]])
        for r in captioner.caption_annotations(captioner.encode(batch)):
            row = {"captions": r.caption, "familiarity": np.nan, **r.signals}
            if r.familiarity is not None:
                row["familiarity"] = r.familiarity
            for k, v in row.items():
                done.setdefault(k, []).append(v)
        n = len(done["captions"])
        if n == len(images) or (lo // batch_size) % 4 == 3:
            _save(
                cache, {"ids": np.asarray(ids[:n]), **{k: np.asarray(v) for k, v in done.items()}}
            )
        print(f"  {cache.stem}: {n}/{len(images)}", flush=True)
    return {"ids": np.asarray(ids), **{k: np.asarray(v) for k, v in done.items()}}


def evaluation_sets(
    captioner: Captioner, args: argparse.Namespace, sets: dict[str, list[CaptionedImage]]
) -> dict[str, dict[str, np.ndarray]]:
    """Each set's captions, signals and per-image CIDEr-D, and "all": the sets pooled. The
    cache files are named by the model, its decoding and the signals' definition (this
    module's FEATURES), so a change of any captions again."""
    settings = json.dumps([captioner.decoding.to_dict(), confidence.FEATURES]).encode()
    tag = f"{captioner.name}-{hashlib.sha1(settings).hexdigest()[:8]}"
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, images in sets.items():
        if not images:
            continue
        cache = args.cache / f"{tag}-{name.replace(' ', '_')}.npz"
        data = caption_set(captioner, images, cache, args.batch_size)
        cider_cache = cache.with_suffix(".cider.npy")
        if cider_cache.is_file() and len(np.load(cider_cache)) == len(images):
            data["cider"] = np.load(cider_cache)
        else:
            refs = [im.captions for im in images]
            data["cider"] = per_image_cider(data["captions"].tolist(), refs)
            np.save(cider_cache, data["cider"])
        data["set"] = np.full(len(images), name)
        out[name] = data
    keys = set.intersection(*(set(d) for d in out.values()))
    out["all"] = {k: np.concatenate([d[k] for d in out.values()]) for k in sorted(keys)}
    return out


# --------------------------------------------------------------------------- statistics


def standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mu, sd = x.mean(0), x.std(0)
    return mu, np.where(sd > 1e-12, sd, 1.0)


def fit(x: np.ndarray, good: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, scale, weights with the bias first) of P(good) on standardised ``x``."""
    mu, sd = standardise(x)
    return mu, sd, fit_logistic((x - mu) / sd, good.astype(float), l2=1.0)


def predict(model: tuple[np.ndarray, np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    mu, sd, w = model
    return 1.0 / (1.0 + np.exp(-(w[0] + ((x - mu) / sd) @ w[1:])))


def folds_of(ids: np.ndarray, folds: int) -> np.ndarray:
    """Each photo's fold, from its id: one photo's captions never straddle two folds, and a
    photo keeps its fold however the sets are ordered."""
    return np.array([int(hashlib.sha1(str(i).encode()).hexdigest(), 16) % folds for i in ids])


def cross_validated(x: np.ndarray, good: np.ndarray, fold: np.ndarray) -> np.ndarray:
    """Each photo's P(good) from a regression fitted on the other folds."""
    out = np.empty(len(good))
    for f in np.unique(fold):
        test = fold == f
        out[test] = predict(fit(x[~test], good[~test]), x[test])
    return out


def features(data: dict[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray:
    return np.stack([data[n].astype(np.float64) for n in names], 1)


def forward_selection(
    data: dict[str, np.ndarray],
    candidates: tuple[str, ...],
    good: np.ndarray,
    bad: np.ndarray,
    fold: np.ndarray,
) -> tuple[tuple[str, ...], list[str]]:
    """The features, added one at a time, each the one that raises the cross-validated AUROC
    most, while it rises by ``MIN_GAIN`` or more (at least one): fewer, steadier weights than
    all of them (they are correlated: the log-probabilities, the beams' agreement). Returns
    them and the path ("+feature AUROC" each)."""
    chosen: list[str] = []
    best, path = 0.5, []
    while len(chosen) < len(candidates):
        scores = {
            f: auroc(bad, -cross_validated(features(data, (*chosen, f)), good, fold))
            for f in candidates
            if f not in chosen
        }
        f = max(scores, key=scores.get)
        if chosen and scores[f] < best + MIN_GAIN:  # the first is kept whatever it scores
            break
        chosen.append(f)
        best = scores[f]
        path.append(f"+{f} {best:.3f}")
    return tuple(chosen), path


def choose_threshold(conf: np.ndarray, bad: np.ndarray) -> float:
    """The lowest confidence threshold whose warning (confidence below it) reaches
    ``RECALL_GOAL`` of the bad captions: the most precise warning that does."""
    order = np.sort(np.unique(conf))
    for t in np.append(order[1:], 1.0):
        if (bad & (conf < t)).sum() >= RECALL_GOAL * bad.sum():
            return float(t)
    return 1.0


def compare_first(
    pooled: dict[str, np.ndarray], good: np.ndarray, bad: np.ndarray, fold: np.ndarray
) -> None:
    """Print what the forward selection among ``FIRST_FEATURES`` alone (those this model
    has) gives on the same photos and folds: its AUROC and its warning's precision at the
    recall goal, against which the selection among all signals is to be read."""
    names = tuple(f for f in FIRST_FEATURES if f in pooled)
    chosen, path = forward_selection(pooled, names, good, bad, fold)
    conf = cross_validated(features(pooled, chosen), good, fold)
    t = choose_threshold(conf, bad)
    print(f"\nthe first signals alone: {', '.join(path)}")
    print(f"  AUROC {auroc(bad, -conf):.3f}; warned below {t:.3f}: " + warning_cells(conf, bad, t))


def warning_cells(conf: np.ndarray, bad: np.ndarray, t: float) -> str:
    warned = conf < t
    precision = (bad & warned).sum() / max(warned.sum(), 1)
    recall = (bad & warned).sum() / max(bad.sum(), 1)
    return f"{warned.mean():6.1%} warned  precision {precision:.2f}  recall {recall:.2f}"


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = study_parser(__doc__, Path("runs/confidence"), flickr8k_required=False)
    p.add_argument("--coco-photos", type=int, default=None, metavar="N", help="first N COCO")
    p.add_argument("--folds", type=int, default=FOLDS)
    p.add_argument("--save", type=Path, default=None, help="write the fits (JSON) here")
    p.add_argument(
        "--bundled",
        action="store_true",
        help="write the fits into bundled/confidence.json under the model's name",
    )
    return p


def report(
    sets: dict[str, dict[str, np.ndarray]], args: argparse.Namespace, with_index: bool
) -> ConfidenceFits:
    """Print the study's tables; return the fits made on all photos."""
    pooled = sets["all"]
    good = pooled["cider"] >= args.bad
    bad = ~good
    fold = folds_of(pooled["ids"], args.folds)
    names = [n for n in sets if n != "all"]
    spans = {n: pooled["set"] == n for n in names}
    spans["all"] = np.ones(len(good), bool)

    print(f"\nper-image CIDEr-D (x1; idf of each set); bad: < {args.bad}")
    for n, m in spans.items():
        c = pooled["cider"][m]
        share = np.mean(c < args.bad)
        print(f"  {n:13s} photos {m.sum():5d}  mean {c.mean():.3f}  bad {share:.1%}")

    groups = {"with the index": confidence.FEATURES, "without the index": NO_INDEX}
    if not with_index:
        groups = {"without the index": NO_INDEX}
    compare_first(pooled, good, bad, fold)
    rows: dict[str, np.ndarray] = {}
    for f in groups[next(iter(groups))]:
        rows[f] = cross_validated(features(pooled, (f,)), good, fold)
    chosen: dict[str, tuple[str, ...]] = {}
    for label, names_ in groups.items():
        rows[f"all of them, {label}"] = cross_validated(features(pooled, names_), good, fold)
        chosen[label], path = forward_selection(pooled, names_, good, bad, fold)
        print(f"\nforward selection, {label} (CV AUROC, all photos): " + ", ".join(path))
        rows[f"confidence, {label}"] = cross_validated(features(pooled, chosen[label]), good, fold)
    print(f"\nAUROC for a bad caption, {args.folds}-fold cross-validated by photo; 0.5 is chance")
    print(f"  {'predictor':34s}" + "".join(f"{n:>14s}" for n in spans))
    for label, conf in rows.items():
        cells = "".join(f"{auroc(bad[m], -conf[m]):14.3f}" for m in spans.values())
        print(f"  {label:34s}{cells}")

    fits = []
    for label, names_ in chosen.items():
        conf = rows[f"confidence, {label}"]
        t = choose_threshold(conf, bad)
        print(f"\n{label}: calibration (cross-validated confidence; share of captions good)")
        for lo, hi in zip(BINS[:-1], BINS[1:], strict=True):
            m = (conf >= lo) & ((conf < hi) if hi < 1 else (conf <= hi))
            share = f"{good[m].mean():.2f}" if m.any() else "  - "
            mean = f"{conf[m].mean():.2f}" if m.any() else "  - "
            print(f"  {lo:.1f}-{hi:.1f}: {m.sum():5d} photos, mean {mean}, good {share}")
        print(f"  the warning below {t:.3f} (reaches {RECALL_GOAL:.0%} of the bad captions):")
        for n, m in spans.items():
            print(f"    {n:13s} " + warning_cells(conf[m], bad[m], t))
        warned = conf < t
        precision = (bad & warned).sum() / max(warned.sum(), 1)
        met = "met" if precision >= PRECISION_GOAL else "missed"
        print(f"  the precision goal of {PRECISION_GOAL} at that recall: {met}")
        mu, sd, w = fit(features(pooled, names_), good)
        fits.append(
            ConfidenceFit(
                features=tuple(names_),
                mean=tuple(round(float(x), 6) for x in mu),
                scale=tuple(round(float(x), 6) for x in sd),
                weights=tuple(round(float(x), 6) for x in w[1:]),
                bias=round(float(w[0]), 6),
                warn_below=round(t, 4),
            )
        )
        terms = ", ".join(f"{f} {x:+.3f}" for f, x in zip(names_, w[1:], strict=True))
        print(f"  fit on all photos: bias {w[0]:.3f}; {terms}")
    about = (
        f"scripts/confidence_study.py: {len(good)} photos ({', '.join(names)}), bad = per-image "
        f"CIDEr-D < {args.bad}"
    )
    return ConfidenceFits(tuple(fits), about)


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if args.flickr8k is None and not args.coco:
        p.error("give --flickr8k DIR, --coco DIR:SPLIT or both")
    captioner = load_model(args.model, args.device)
    print(f"model {captioner.name}, decoding {captioner.decoding.to_dict()}")
    images: dict[str, list[CaptionedImage]] = {}
    if args.coco:
        roots = [(Path(s.rsplit(":", 1)[0]), s.rsplit(":", 1)[1]) for s in args.coco]
        coco = [im for root, split in roots for im in load_split("coco", root, split).images]
        images["COCO"] = coco[: args.coco_photos]
    if args.flickr8k is not None:
        images["flickr8k dev"] = load_split("flickr8k", args.flickr8k, "dev").images[
            : args.dev_photos
        ]
    sets = evaluation_sets(captioner, args, images)
    fits = report(sets, args, with_index=captioner.model.consensus is not None)
    if args.save is not None:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(json.loads(fits.to_json()), indent=1) + "\n")
        print(f"\nwrote {args.save}")
    if args.bundled:
        path = confidence.BUNDLED_FITS
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[captioner.name] = json.loads(fits.to_json())
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"\nwrote {captioner.name}'s fits into {path}")


if __name__ == "__main__":
    main()
