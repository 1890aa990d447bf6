"""Label where the people are in every photo of a dataset, for attention supervision.

ImageNet has no person class, so the captioner's frozen encoder knows little about where people
are, and the attention of words like "man" or "girls" lands on them barely more often than
uniform attention does. This script runs MediaPipe's offline person segmenters (their models
ship inside the ``mediapipe`` wheel: nothing is downloaded) over each photo once, and stores for
each photo the share of each encoder grid cell that the person mask covers. Training reads the
file (``data.person_masks``) and pulls the attention of person words toward those cells
(``model.objective.grounding``).

Environment. MediaPipe's ``solutions`` API exists up to 0.10.21 and needs numpy < 2, so the
labeller runs in an environment of its own, with the project installed without its dependencies
(only numpy is needed from it: the file writer and the cell geometry)::

    python -m venv .venv-masks
    .venv-masks/bin/pip install -r scripts/requirements-person-masks.txt
    .venv-masks/bin/pip install --no-deps -e .

Commands::

    # every Flickr8k train and dev photo (run once per dataset; 9 = EfficientNet-Lite2's grid)
    .venv-masks/bin/python scripts/label_person_masks.py label --dataset flickr8k \\
        --root ../shared/data/flickr8k --splits train dev --grid 9 --out cache/person_masks_9.npz
    # quality against COCO's person masks (pixel and cell level), printed as JSON
    .venv-masks/bin/python scripts/label_person_masks.py check \\
        --images ../shared/data/coco2017_train_mini/images \\
        --instances ../shared/data/coco2017_train_mini/annotations/instances_train2017.json

Output format: ``showattendtell.data.person_masks`` (an ``.npz`` of the image ids, a
(N, g, g) uint8 array of round(255 x covered share) per cell, and a JSON string of how it was
made; no pickle). Cell geometry is the captioner's: the photo is squashed to a square (aspect not
kept), so the cells divide the whole photo into g x g equal rectangles whatever its size, and a
mask computed on the photo at any resolution gives the same shares.

The mask: ``--method selfie`` (the default) is the selfie segmenter's general model (a 256 x 256
input, many people at once); ``pose`` is the pose model's segmentation (one person, the most
prominent); ``union`` takes the larger of the two probabilities per pixel. A pixel belongs to
the mask where the probability is at least ``--threshold``. ``check`` reports each method's
agreement with COCO's person masks, so the choice is measured (see its output's keys).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from showattendtell.data.datasets import DatasetError, list_datasets, load_split
from showattendtell.data.person_masks import write_person_masks
from showattendtell.evaluation.attention_correctness import cell_coverage

METHODS = ("selfie", "pose", "union")


class Segmenter:
    """Photo (H, W, 3) uint8 RGB -> person probability (H, W) float32 in [0, 1]."""

    def __init__(self, method: str):
        import mediapipe as mp  # only in the labelling environment

        self.method = method
        self.selfie = self.pose = None
        if method in ("selfie", "union"):
            self.selfie = mp.solutions.selfie_segmentation.SelfieSegmentation(model_selection=0)
        if method in ("pose", "union"):
            self.pose = mp.solutions.pose.Pose(
                static_image_mode=True, model_complexity=1, enable_segmentation=True
            )

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        prob = np.zeros(rgb.shape[:2], dtype=np.float32)
        if self.selfie is not None:
            prob = np.maximum(prob, self.selfie.process(rgb).segmentation_mask)
        if self.pose is not None:
            found = self.pose.process(rgb).segmentation_mask
            if found is not None:  # None: no person detected
                prob = np.maximum(prob, found)
        return prob


def read_photo(path: Path) -> np.ndarray:
    """The photo as the captioner decodes it: EXIF orientation applied, 8-bit RGB."""
    with Image.open(path) as img:
        return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


def label(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"error: {out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    images = []
    for split in args.splits:
        try:
            found = load_split(args.dataset, args.root, split)
            found.require_images()
        except DatasetError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        images += found.images
    seen: dict[str, Path] = {im.image_id: im.path for im in images}  # splits may share photos
    segment = Segmenter(args.method)
    ids, maps, start = [], [], time.monotonic()
    for n, (image_id, path) in enumerate(seen.items(), 1):
        mask = segment(read_photo(path)) >= args.threshold
        ids.append(image_id)
        maps.append(cell_coverage(mask, args.grid))
        if n % 500 == 0 or n == len(seen):
            print(
                f"{n}/{len(seen)} photos, {n / (time.monotonic() - start):.1f}/s", file=sys.stderr
            )
    coverage = np.stack(maps) if maps else np.zeros((0, args.grid, args.grid))
    write_person_masks(
        out,
        ids,
        coverage,
        {
            "dataset": args.dataset,
            "splits": list(args.splits),
            "method": args.method,
            "threshold": args.threshold,
            "segmenter": "mediapipe " + _mediapipe_version(),
        },
    )
    with_person = int((coverage.reshape(len(ids), -1).max(1) > 0).sum()) if ids else 0
    print(
        json.dumps(
            {
                "out": str(out),
                "photos": len(ids),
                "with_person": with_person,
                "mean_area": float(coverage.mean()) if ids else None,
            }
        )
    )
    return 0


def _mediapipe_version() -> str:
    import mediapipe as mp

    return mp.__version__


def _ratio(target: np.ndarray, truth: np.ndarray) -> float:
    """Attention correctness's ratio for one word if its attention were ``target`` normalised
    (``attention_correctness.word_correctness``); nan for an empty target."""
    total = target.sum()
    if total <= 0 or truth.mean() <= 0:
        return float("nan")
    return float((target / total * truth).sum() / truth.mean())


def check(args: argparse.Namespace) -> int:
    """Agreement of each method with COCO's person masks, over the photos of ``--instances``."""
    from showattendtell.evaluation.attention_correctness import CocoInstances, InstancesError

    try:
        instances = CocoInstances(args.instances)
    except InstancesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    photos = [
        (i, Path(args.images) / instances.coco.imgs[i]["file_name"])
        for i in sorted(instances.image_ids)
    ]
    photos = [(i, p) for i, p in photos if p.is_file()]
    if not photos:
        print(f"error: none of the photos of {args.instances} is in {args.images}", file=sys.stderr)
        return 2
    report = {
        "photos": len(photos),
        "with_person": sum("person" in instances.categories_in(i) for i, _ in photos),
    }
    for method in args.methods:
        report[method] = _agreement(
            instances, photos, Segmenter(method), args.grid, args.threshold, args.sharpness
        )
    print(json.dumps(report, indent=1))
    return 0


def _agreement(
    instances,
    photos: Iterable[tuple[int, Path]],
    segment: Segmenter,
    grid: int,
    threshold: float,
    sharpness: Iterable[float],
) -> dict:
    pix = {"iou": [], "precision": [], "recall": []}
    cell = {"iou": [], "precision": [], "recall": []}
    ratio_num = {s: 0.0 for s in sharpness}
    ratio_den, false_area, missed = 0.0, [], 0
    for image_id, path in photos:
        pred = segment(read_photo(path)) >= threshold
        pred_cov = cell_coverage(pred, grid)
        if "person" not in instances.categories_in(image_id):
            false_area.append(float(pred.mean()))
            continue
        truth = instances.mask(image_id, "person", path) > 0
        if truth.shape != pred.shape:  # the instances file's size; the photo's may differ
            pred = np.asarray(Image.fromarray(pred).resize(truth.shape[::-1], Image.NEAREST))
        inter, union = float((pred & truth).sum()), float((pred | truth).sum())
        pix["iou"].append(inter / union if union else 1.0)
        pix["precision"].append(inter / pred.sum() if pred.any() else float("nan"))
        pix["recall"].append(inter / truth.sum())
        truth_cov = cell_coverage(truth, grid)
        both = np.minimum(pred_cov, truth_cov).sum()
        cell["iou"].append(float(both / np.maximum(pred_cov, truth_cov).sum()))
        cell["precision"].append(float(both / pred_cov.sum()) if pred.any() else float("nan"))
        cell["recall"].append(float(both / truth_cov.sum()))
        missed += not pred.any()
        # as attention correctness aggregates words: sum of correctness over sum of uniform
        for s in ratio_num:
            if pred.any():
                target = pred_cov**s
                ratio_num[s] += float((target / target.sum() * truth_cov).sum())
            else:
                ratio_num[s] += float(truth_cov.mean())  # uniform attention where none found
        ratio_den += float(truth_cov.mean())

    def mean(xs: list[float]) -> float | None:
        xs = [x for x in xs if x == x]
        return round(float(np.mean(xs)), 4) if xs else None

    return {
        "pixel": {k: mean(v) for k, v in pix.items()},
        "cell": {k: mean(v) for k, v in cell.items()},
        "person_photos_without_mask": missed,
        "target_ratio": {
            f"coverage^{s:g}": round(n / ratio_den, 3) if ratio_den else None
            for s, n in ratio_num.items()
        },
        "no_person_photos_mean_mask_area": mean(false_area),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lab = sub.add_parser("label", help="write the person-mask coverage of a dataset's photos")
    lab.add_argument("--dataset", choices=list_datasets(), default="flickr8k")
    lab.add_argument("--root", required=True, help="the dataset folder")
    lab.add_argument("--splits", nargs="+", default=["train", "dev"])
    lab.add_argument("--out", required=True, help="the .npz file to write")
    lab.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    lab.add_argument("--method", choices=METHODS, default="selfie")
    chk = sub.add_parser("check", help="compare the masks with COCO's person masks")
    chk.add_argument("--images", required=True, help="folder of the photos")
    chk.add_argument("--instances", required=True, help="COCO instances_*.json")
    chk.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    chk.add_argument(
        "--sharpness",
        nargs="+",
        type=float,
        default=[1.0, 2.0],
        help="exponents p of the targets coverage^p whose ratio is reported",
    )
    for p in (lab, chk):
        p.add_argument(
            "--grid",
            type=int,
            default=9,
            help="the encoder's grid (9: EfficientNet-Lite2 at 260 px)",
        )
        p.add_argument(
            "--threshold",
            type=float,
            default=0.5,
            help="a pixel is a person's where the probability is at least this",
        )
    args = parser.parse_args(argv)
    if args.grid < 1 or not 0 < args.threshold <= 1:
        parser.error("--grid must be >= 1 and --threshold in (0, 1]")
    return label(args) if args.command == "label" else check(args)


if __name__ == "__main__":
    sys.exit(main())
