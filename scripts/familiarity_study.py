"""How well familiarity (familiarity.py) and the warning that combines it with the caption's
log-probability tell good captions from bad ones; how the warning's coefficients, its threshold
and familiarity's k were chosen; and what the model gets wrong on COCO photos.

    python scripts/familiarity_study.py --flickr8k ../shared/data/flickr8k \\
        --coco ../shared/data/coco2017_val_subset:val \\
        --coco ../shared/data/coco2017_train_mini:train --cache runs/familiarity

A model (default: the bundled default, at its stored decoding) captions the Flickr8k dev photos
and the COCO photos once; each photo's caption, its log-probability and its pooled grid are
cached under --cache (captioning 1,000 dev photos at beam 5 takes minutes on a CPU), so a second
run only computes the numbers. Each evaluation set's per-image CIDEr is pycocoevalcap's with the
document frequencies of that set (Flickr8k dev; the COCO photos together), on PTB-tokenised
captions when Java is there. A caption is "bad" when its per-image CIDEr is below --bad (0.3).

Printed: the AUROC of each predictor of a bad caption (low familiarity at several k; the
baseline, a low mean log-probability per word; both in a logistic regression on all photos pooled,
scored by 5-fold cross-validation; and the shipped rule, familiarity.COEFFICIENTS), on each set and
on all photos together; the coefficients the pooled regression fits (what familiarity.COEFFICIENTS
holds); the share of each set warned at several thresholds of P(bad) and the mean per-image CIDEr
of the warned and the other photos, against the baseline warning as many; the calibration of
familiarity on the dev photos; and, on COCO, the words the captions use against the objects the
photos hold (pycocotools instance annotations).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from showattendtell.captioning.captioner import Captioner, load_model
from showattendtell.data.datasets import CaptionedImage, load_split
from showattendtell.network.vocab import tokenize
from showattendtell.search import familiarity
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.familiarity import Familiarity

KS = (1, 5, 10, 30, 60)  # neighbours averaged, compared
THRESHOLDS = (0.01, 0.02, 0.05, 0.1, 0.2)  # familiarity's calibration check
RISK_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75)  # P(bad) thresholds of the warning, compared
FOLDS = 5
# caption words -> the COCO category that holds what they name
WORD_GROUPS = {
    "dog": ({"dog", "dogs", "puppy"}, "dog"),
    "person": (
        {
            "man",
            "men",
            "woman",
            "women",
            "boy",
            "boys",
            "girl",
            "girls",
            "person",
            "people",
            "child",
            "children",
            "kid",
            "kids",
            "player",
            "lady",
            "guy",
        },
        "person",
    ),
    "ball": ({"ball"}, "sports ball"),
    "bike": ({"bike", "bicycle"}, "bicycle"),
}


# --------------------------------------------------------------------------- captioning


def caption_set(
    captioner: Captioner, images: list[CaptionedImage], cache: Path, batch_size: int
) -> dict[str, np.ndarray]:
    """Each photo's caption, mean log-probability per word, familiarity and pooled grid, from
    the cache file as far as it holds these photos, the rest computed (and cached every few
    batches, so that an interrupted run goes on where it stopped)."""
    ids = [im.image_id for im in images]
    keys = ("captions", "log_prob_per_word", "familiarity", "pooled")
    done: dict[str, list] = {k: [] for k in keys}
    if cache.is_file():
        data = dict(np.load(cache, allow_pickle=False))
        m = min(len(data["ids"]), len(ids))
        if data["ids"].tolist()[:m] == ids[:m]:  # a run over these photos, or more, or fewer
            done = {k: list(data[k][:m]) for k in keys}
    for lo in range(len(done["captions"]), len(images), batch_size):
        batch = torch.stack([captioner.preprocess(im.path) for im in images[lo : lo + batch_size]])
        grids = captioner.encode(batch)
        for r, row in zip(
            captioner.caption_annotations(grids),
            ConsensusIndex.pool(grids).cpu().numpy(),
            strict=True,
        ):
            done["captions"].append(r.caption)
            done["log_prob_per_word"].append(r.log_prob / (len(r.words) + 1))  # <end> included
            done["familiarity"].append(np.nan if r.familiarity is None else r.familiarity)
            done["pooled"].append(row)
        n = len(done["captions"])
        if n == len(images) or (lo // batch_size) % 4 == 3:
            _save(
                cache, {"ids": np.asarray(ids[:n]), **{k: np.asarray(v) for k, v in done.items()}}
            )
        print(f"  {cache.stem}: {n}/{len(images)}", flush=True)
    return {"ids": np.asarray(ids), **{k: np.asarray(v) for k, v in done.items()}}


def _save(cache: Path, data: dict[str, np.ndarray]) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, **data)
    tmp.replace(cache)


def per_image_cider(captions: list[str], references: list[list[str]]) -> np.ndarray:
    """pycocoevalcap's CIDEr of each caption, idf from these photos' references (x1, not x100)."""
    from pycocoevalcap.cider.cider import Cider

    keys = [str(i) for i in range(len(captions))]
    if shutil.which("java"):
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        tok = PTBTokenizer()
        with contextlib.redirect_stdout(io.StringIO()):
            res = tok.tokenize({k: [{"caption": c}] for k, c in zip(keys, captions, strict=True)})
            gts = tok.tokenize(
                {
                    k: [{"caption": c} for c in refs]
                    for k, refs in zip(keys, references, strict=True)
                }
            )
    else:
        res = {k: [" ".join(tokenize(c))] for k, c in zip(keys, captions, strict=True)}
        gts = {
            k: [" ".join(tokenize(c)) for c in refs]
            for k, refs in zip(keys, references, strict=True)
        }
    _, scores = Cider().compute_score(gts, res)
    return np.asarray(scores, np.float64)


# --------------------------------------------------------------------------- statistics


def auroc(bad: np.ndarray, risk: np.ndarray) -> float:
    """P(risk of a bad caption > risk of a good one), ties counting half (Mann-Whitney U)."""
    bad = bad.astype(bool)
    order = np.argsort(risk, kind="mergesort")
    ranks = np.empty(len(risk))
    sorted_risk = risk[order]
    i = 0
    while i < len(risk):  # average ranks over ties
        j = i
        while j + 1 < len(risk) and sorted_risk[j + 1] == sorted_risk[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    n_bad, n_good = bad.sum(), (~bad).sum()
    if not n_bad or not n_good:
        return float("nan")
    return float((ranks[bad].sum() - n_bad * (n_bad + 1) / 2) / (n_bad * n_good))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, steps: int = 50) -> np.ndarray:
    """Weights (bias first) of a logistic regression of y on standardised x, by Newton's method."""
    xb = np.hstack([np.ones((len(x), 1)), x])
    w = np.zeros(xb.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-xb @ w))
        grad = xb.T @ (p - y) + l2 * np.r_[0, w[1:]]
        hess = (xb * (p * (1 - p))[:, None]).T @ xb + l2 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return w


def cross_validated_risk(x: np.ndarray, y: np.ndarray, folds: int = FOLDS) -> np.ndarray:
    """Each photo's predicted probability of a bad caption from a model fit on the other folds
    (folds by position mod ``folds``: deterministic, every set in every fold)."""
    risk = np.empty(len(y))
    fold = np.arange(len(y)) % folds
    for f in range(folds):
        train, test = fold != f, fold == f
        mu, sd = x[train].mean(0), x[train].std(0) + 1e-12
        w = fit_logistic((x[train] - mu) / sd, y[train])
        risk[test] = 1 / (1 + np.exp(-(w[0] + ((x[test] - mu) / sd) @ w[1:])))
    return risk


def _warned_cells(sets: dict[str, dict], warned: dict[str, np.ndarray], bad: float) -> str:
    """Per set: share warned, mean per-image CIDEr warned / not warned, share bad of warned."""
    cells = []
    for n, s in sets.items():
        w, cider = warned[n], s["cider"]
        below = cider[w].mean() if w.any() else float("nan")
        above = cider[~w].mean() if (~w).any() else float("nan")
        share = np.mean(cider[w] < bad) if w.any() else float("nan")
        cells.append(f"{n}: {w.mean():5.1%} warned, {below:.3f} / {above:.3f}, {share:.0%} bad")
    return "; ".join(cells)


# --------------------------------------------------------------------------- COCO objects


def coco_objects(roots: list[tuple[Path, str]]) -> dict[str, set[str]]:
    """COCO image id (as the loaders name it) -> the categories its instances hold, for the
    photos that have instance annotations."""
    held: dict[str, set[str]] = {}
    for root, split in roots:
        files = sorted((root / "annotations").glob(f"instances_{split}*.json"))
        for f in files:
            data = json.loads(f.read_text())
            names = {c["id"]: c["name"] for c in data["categories"]}
            for im in data["images"]:
                held.setdefault(str(im["id"]), set())
            for a in data["annotations"]:
                held.setdefault(str(a["image_id"]), set()).add(names[a["category_id"]])
    return held


def words_against_objects(
    ids: list[str], captions: list[str], held: dict[str, set[str]]
) -> list[str]:
    lines = []
    words = [set(re.findall(r"[a-z]+", c.lower())) for c in captions]
    annotated = [i for i, k in enumerate(ids) if k in held]
    lines.append(f"COCO photos captioned: {len(ids)}; with instance annotations: {len(annotated)}")
    for name, (group, category) in WORD_GROUPS.items():
        said = [i for i in range(len(ids)) if words[i] & group]
        said_annotated = [i for i in said if ids[i] in held]
        holding = [i for i in annotated if category in held[ids[i]]]
        right = [i for i in said_annotated if category in held[ids[i]]]
        lines.append(
            f"  {name:7s} said in {len(said)} of {len(ids)} captions; of the "
            f"{len(annotated)} annotated photos: said in {len(said_annotated)}, "
            f"{len(holding)} hold a {category}, said and held {len(right)}, "
            f"held but not said {len(holding) - len(right)}"
        )
    dog_words = WORD_GROUPS["dog"][0]
    wrong = Counter(
        c
        for i in annotated
        if words[i] & dog_words and "dog" not in held[ids[i]]
        for c in held[ids[i]]
    )
    lines.append(
        "  what the photos captioned 'dog' without a dog hold: "
        + ", ".join(f"{c} {n}" for c, n in wrong.most_common(12))
    )
    subjects = Counter(next((w for w in c.split()[1:3] if w.isalpha()), "") for c in captions)
    lines.append(
        "  captions' subjects (2nd/3rd word): "
        + ", ".join(f"{w} {n}" for w, n in subjects.most_common(10))
    )
    top = Counter(c for i in annotated for c in held[ids[i]])
    lines.append(
        "  what the annotated photos hold (photos): "
        + ", ".join(f"{c} {n}" for c, n in top.most_common(12))
    )
    return lines


# --------------------------------------------------------------------------- main


def study_parser(doc: str, cache: Path, flickr8k_required: bool) -> argparse.ArgumentParser:
    """The options this study and confidence_study.py share: the model, the evaluation sets
    (Flickr8k dev, COCO folders), the cache of their captions, what counts as bad, the batch
    size and device. ``doc``: the script's docstring, whose first paragraph is the help's."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model file or name (default: the default)")
    p.add_argument(
        "--flickr8k",
        type=Path,
        required=flickr8k_required,
        default=None,
        help="Flickr8k folder (dev split)",
    )
    p.add_argument(
        "--coco",
        action="append",
        default=[],
        metavar="DIR:SPLIT",
        help="a COCO folder and its split (repeatable): one evaluation set together",
    )
    p.add_argument("--cache", type=Path, default=cache)
    p.add_argument(
        "--dev-photos",
        type=int,
        default=None,
        metavar="N",
        help="only the first N Flickr8k dev photos (in the split file's order)",
    )
    p.add_argument("--bad", type=float, default=0.3, help="per-image CIDEr below this is bad")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="auto")
    return p


def _parser() -> argparse.ArgumentParser:
    """The study's options; a parser of its own so that main can report a model without a
    consensus index as a usage error."""
    return study_parser(__doc__, Path("runs/familiarity"), flickr8k_required=True)


def evaluation_sets(
    captioner: Captioner,
    args: argparse.Namespace,
    dev: list[CaptionedImage],
    coco: list[CaptionedImage],
) -> dict[str, dict]:
    """Each evaluation set's captions, log-probabilities, pooled grids and per-image CIDEr,
    and "all": the sets pooled. The cache files are named by the model and its decoding, so a
    change of either captions again instead of reading another model's captions."""
    settings = json.dumps(captioner.decoding.to_dict(), sort_keys=True).encode()
    tag = f"{captioner.name}-{hashlib.sha1(settings).hexdigest()[:8]}"
    sets: dict[str, dict] = {}
    for name, images in (("COCO", coco), ("flickr8k dev", dev)):
        if not images:
            continue
        data = caption_set(
            captioner, images, args.cache / f"{tag}-{name.replace(' ', '_')}.npz", args.batch_size
        )
        data["cider"] = per_image_cider(data["captions"].tolist(), [im.captions for im in images])
        sets[name] = data
    sets["all"] = {
        k: np.concatenate([s[k] for s in sets.values()])
        for k in ("cider", "log_prob_per_word", "pooled", "familiarity")
    }
    return sets


def report_auroc(
    sets: dict[str, dict], index: ConsensusIndex, bad: float
) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, np.ndarray], Familiarity]:
    """Print each predictor's AUROC for a bad caption and the coefficients the pooled
    regression fits (what familiarity.COEFFICIENTS holds). Adds each set's "similarity" and
    "typicality" at familiarity.NEIGHBOURS; returns familiarity at every k, the shipped
    warning's P(bad) per set and the scorer at familiarity.NEIGHBOURS, which the later
    reports read."""
    print(f"\nAUROC for a bad caption (per-image CIDEr < {bad}); 0.5 is chance")
    header = f"  {'predictor':50s}" + "".join(f"{n:>14s}" for n in sets)
    print(header)
    scorers = {k: Familiarity(index, neighbours=k) for k in KS}
    fam = {
        k: {n: scorers[k].score(torch.from_numpy(s["pooled"])) for n, s in sets.items()} for k in KS
    }
    rows = {f"low familiarity, k = {k}": {n: -fam[k][n] for n in sets} for k in KS}
    rows["low mean log-probability per word (baseline)"] = {
        n: -s["log_prob_per_word"] for n, s in sets.items()
    }
    k0 = familiarity.NEIGHBOURS
    scorer = scorers[k0]
    for s in sets.values():
        s["similarity"] = scorer.similarity(torch.from_numpy(s["pooled"]))
        s["typicality"] = scorer.typicality(s["similarity"])
    # the warning's logistic regression, on all photos pooled; scored per set by 5-fold CV
    pooled = sets["all"]
    x = np.stack([pooled["typicality"], pooled["log_prob_per_word"]], 1)
    y = (pooled["cider"] < bad).astype(float)
    fitted = fit_logistic(x, y)
    cv = cross_validated_risk(x, y)
    edges = np.cumsum([0] + [len(s["cider"]) for n, s in sets.items() if n != "all"])
    combined = {n: cv[edges[i] : edges[i + 1]] for i, n in enumerate(n for n in sets if n != "all")}
    combined["all"] = cv
    rows[f"both, k = {k0} (logistic, {FOLDS}-fold CV, photos pooled)"] = combined
    shipped = {n: scorer.risk(s["similarity"], s["log_prob_per_word"]) for n, s in sets.items()}
    rows["the shipped warning's P(bad) (in sample)"] = shipped
    for label, risks in rows.items():
        print(
            f"  {label:50s}"
            + "".join(f"{auroc(s['cider'] < bad, risks[n]):14.3f}" for n, s in sets.items())
        )
    lp_dev = np.median(sets["flickr8k dev"]["log_prob_per_word"]) if "flickr8k dev" in sets else 0
    print(
        "  logistic regression on all photos pooled (bias, typicality, log-probability per word): "
        f"COEFFICIENTS = ({', '.join(f'{w:.4f}' for w in fitted)}); shipped "
        f"{familiarity.COEFFICIENTS}; dev median log-probability per word {lp_dev:.2f} "
        f"(shipped TYPICAL_LOG_PROB {familiarity.TYPICAL_LOG_PROB})"
    )
    return fam, shipped, scorer


def report_warning(
    sets: dict[str, dict],
    fam: dict[int, dict[str, np.ndarray]],
    shipped: dict[str, np.ndarray],
    scorer: Familiarity,
    bad: float,
) -> None:
    """Print what the shipped warning does at each threshold on P(bad), against the baseline
    and familiarity alone warning as many photos: how familiarity.RISK_THRESHOLD was chosen."""
    k0 = familiarity.NEIGHBOURS
    print(
        "\nthe warning (shipped COEFFICIENTS) at thresholds on P(bad): share warned, mean "
        "per-image CIDEr warned / not warned, share of warned captions that are bad"
    )
    for t in RISK_THRESHOLDS:
        mark = "  <- familiarity.RISK_THRESHOLD" if t == familiarity.RISK_THRESHOLD else ""
        print(
            f"  > {t:<5}  "
            + _warned_cells(sets, {n: r > t for n, r in shipped.items()}, bad)
            + mark
        )
    t = familiarity.RISK_THRESHOLD
    warned = {n: shipped[n] > t for n in sets}
    print("  for comparison, warning as many photos of each set as the shipped rule:")
    for label, risk in (
        ("lowest log-probability per word (baseline)", lambda s: -s["log_prob_per_word"]),
        (f"lowest familiarity (k = {k0})", lambda s: -s["typicality"]),
    ):
        same = {}
        for n, s in sets.items():
            same[n] = np.zeros(len(s["cider"]), bool)
            same[n][np.argsort(-risk(s), kind="stable")[: int(warned[n].sum())]] = True
        print(f"    {label}: " + _warned_cells(sets, same, bad))
    print(
        f"  familiarity alone under {familiarity.UNFAMILIAR}: "
        + _warned_cells(sets, {n: fam[k0][n] < familiarity.UNFAMILIAR for n in sets}, bad)
    )
    why = Counter(
        scorer.warning(float(f), float(r), float(lp))
        for n in sets
        if n != "all"
        for f, r, lp in zip(fam[k0][n], shipped[n], sets[n]["log_prob_per_word"], strict=True)
    )
    print(
        "  warnings given (all photos): "
        + "; ".join(f"{n} x {w!r}" for w, n in why.most_common() if w is not None)
    )


def report_calibration(
    sets: dict[str, dict],
    fam: dict[int, dict[str, np.ndarray]],
    coco: list[CaptionedImage],
    coco_roots: list[tuple[Path, str]],
) -> None:
    """Print how uniform the dev photos' familiarity is (it is a rank among the training
    photos, and dev photos are drawn like them, so it should be), and, on COCO, the caption
    words against the objects the photos hold."""
    k0 = familiarity.NEIGHBOURS
    print("\ncalibration: the dev photos' familiarity should be about uniform on [0, 1]")
    d = fam[k0]["flickr8k dev"]
    print(
        f"  mean {d.mean():.3f}; quartiles {np.quantile(d, [0.25, 0.5, 0.75]).round(3)}; "
        + ", ".join(f"< {t}: {np.mean(d < t):.1%}" for t in THRESHOLDS)
    )
    if "COCO" in sets:
        c = fam[k0]["COCO"]
        print(f"  COCO: mean {c.mean():.3f}; median {np.median(c):.3f}")
        print()
        held = coco_objects(coco_roots)
        ids = [str(im.coco_id if im.coco_id is not None else im.image_id) for im in coco]
        for line in words_against_objects(ids, sets["COCO"]["captions"].tolist(), held):
            print(line)


def main() -> None:
    """Caption the evaluation sets (or read their captions from the cache), then print the
    study's reports in turn, each reading what the ones before it computed."""
    p = _parser()
    args = p.parse_args()

    captioner = load_model(args.model, args.device)
    index = captioner.model.consensus
    if index is None:
        p.error("the model has no consensus index: familiarity needs one")
    print(f"model {captioner.name}, decoding {captioner.decoding.to_dict()}")

    dev = load_split("flickr8k", args.flickr8k, "dev").images[: args.dev_photos]
    coco_roots = [(Path(s.rsplit(":", 1)[0]), s.rsplit(":", 1)[1]) for s in args.coco]
    coco = [im for root, split in coco_roots for im in load_split("coco", root, split).images]
    sets = evaluation_sets(captioner, args, dev, coco)

    print(f"\nper-image CIDEr (pycocoevalcap, x1; idf of each set); bad: < {args.bad}")
    for name, s in sets.items():
        print(
            f"  {name:13s} photos {len(s['cider']):5d}  mean CIDEr {s['cider'].mean():.3f}  "
            f"bad {np.mean(s['cider'] < args.bad):.1%}"
        )

    fam, shipped, scorer = report_auroc(sets, index, args.bad)
    report_warning(sets, fam, shipped, scorer, args.bad)
    report_calibration(sets, fam, coco, coco_roots)


if __name__ == "__main__":
    main()
