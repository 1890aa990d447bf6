"""Readers for the caption datasets in their published formats, and for your own (a folder of
photos and a captions file: own_captions.py).

Every reader returns the split as a list of ``CaptionedImage`` whose files exist; annotations
whose image file is missing are skipped and counted (one summary warning, never a crash).

Each format is one ``DatasetFormat`` entry in a registry (``register_dataset``, ``get_dataset``,
``list_datasets``): its reader, its split names and what its folder holds. ``--dataset``'s
choices, the split checks and the folder hints all read the registry.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from showattendtell.data.own_captions import (
    CSV_NAME,
    HOW,
    JSONL_NAME,
    captions_split_names,
    load_own_captions,
)
from showattendtell.data.splits import (  # noqa: F401 - the readers' types, used from here
    CaptionedImage,
    DatasetError,
    MissingImagesError,
    Split,
    SplitError,
    finish_split,
    read_text,
)
from showattendtell.registry import Registry

log = logging.getLogger(__name__)


# -- Flickr8k, original release ---------------------------------------------------------------

FLICKR8K_SPLITS = {
    "train": "trainImages",
    "dev": "devImages",
    "val": "devImages",
    "test": "testImages",
}


def _find_flickr_images(root: Path) -> Path:
    for d in (root / "images", root / "Flicker8k_Dataset", root / "Flickr8k_Dataset", root):
        if d.is_dir() and any(d.glob("*.jpg")):
            return d
    return root / "images"


def load_flickr8k(root: str | Path, split: str) -> Split:
    """``Flickr8k.token.txt`` + ``Flickr_8k.{train,dev,test}Images.txt`` (the original release)."""
    root = Path(root)
    if split not in FLICKR8K_SPLITS:
        raise DatasetError(f"Flickr8k has splits {sorted(FLICKR8K_SPLITS)}, not {split!r}")
    token_file = root / "Flickr8k.token.txt"
    split_file = root / f"Flickr_8k.{FLICKR8K_SPLITS[split]}.txt"
    for f in (token_file, split_file):
        if not f.is_file():
            raise DatasetError(f"{f} not found: see data/README.md for the Flickr8k layout")
    captions = _read_flickr_tokens(token_file)
    names = [n.strip() for n in read_text(split_file).splitlines() if n.strip()]
    image_dir = _find_flickr_images(root)
    items = [CaptionedImage(n, image_dir / n, captions[n]) for n in names if captions.get(n)]
    return finish_split(f"flickr8k/{split}", items, image_dir)


_TOKEN_LINE = re.compile(r"(?P<name>[^\t]+)#\d+\t(?P<caption>[^\t]*)")


def _read_flickr_tokens(token_file: Path) -> dict[str, list[str]]:
    """Image name -> captions from ``<name>#<n><TAB><caption>`` lines. Any other line (no tab,
    a field more, no caption number) or an empty caption is skipped: a reference that is
    not a caption would distort training and BLEU; one warning says how many and where."""
    captions: dict[str, list[str]] = defaultdict(list)
    bad: list[int] = []
    for number, line in enumerate(read_text(token_file).splitlines(), 1):
        m = _TOKEN_LINE.fullmatch(line.rstrip("\r"))
        if m and m["caption"].strip():
            captions[m["name"].strip()].append(m["caption"].strip())
        elif line.strip():
            bad.append(number)
    if bad:
        log.warning(
            "%s: skipped %d malformed lines (not <image>#<n><TAB><caption>; first: line %d)",
            token_file,
            len(bad),
            bad[0],
        )
    return captions


# -- Karpathy's dataset_{flickr8k,flickr30k,coco}.json ------------------------------------------

KARPATHY_SPLITS = {
    "train": ("train",),
    "train+restval": ("train", "restval"),
    "restval": ("restval",),
    "val": ("val",),
    "dev": ("val",),
    "test": ("test",),
}


def _find_karpathy_json(root: Path) -> Path | None:
    """``dataset_*.json`` in root or in the ``caption_datasets/`` folder `sat data` unpacks."""
    found = sorted(root.glob("dataset_*.json"))
    found = found or sorted(root.glob("caption_datasets/dataset_*.json"))
    if len(found) > 1:  # caption_datasets.zip has all three: take the one the folder is named after
        named = [f for f in found if f.stem.removeprefix("dataset_") in root.resolve().name.lower()]
        found = named if len(named) == 1 else found
    if len(found) > 1:
        raise DatasetError(
            f"several Karpathy split files in {root} ({', '.join(f.name for f in found)}): "
            "keep the one of this dataset"
        )
    return found[0] if found else None


def load_karpathy(
    root: str | Path,
    split: str,
    json_file: str | Path | None = None,
    image_dir: str | Path | None = None,
) -> Split:
    """Karpathy's split files: ``images[*].{filepath?, filename, split, sentences[*].raw}``."""
    root = Path(root)
    json_path = Path(json_file) if json_file else _find_karpathy_json(root)
    if json_path is None or not json_path.is_file():
        raise DatasetError(f"no dataset_*.json (Karpathy split) in {root}")
    if split not in KARPATHY_SPLITS:
        raise DatasetError(f"Karpathy splits are {sorted(KARPATHY_SPLITS)}, not {split!r}")
    wanted = KARPATHY_SPLITS[split]
    entries = _karpathy_entries(json_path)
    base = Path(image_dir) if image_dir else root
    items = []
    for im in entries:
        if im["split"] not in wanted:
            continue
        path = _karpathy_image_path(base, im)
        key = str(im.get("cocoid", im["filename"]))
        caps = [s["raw"].strip() for s in im["sentences"]]
        items.append(CaptionedImage(key, path, caps, im.get("cocoid")))
    return finish_split(f"{json_path.name}/{split}", items, base)


def _karpathy_entries(json_path: Path) -> list[dict]:
    """The ``images`` of a Karpathy split file, each checked for the fields the reader uses,
    so a damaged or foreign file is one DatasetError naming the first bad entry."""
    try:
        data = json.loads(read_text(json_path))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{json_path} is not JSON ({e}): re-download it") from None
    entries = data.get("images") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise DatasetError(
            f"{json_path} is not a Karpathy split file (no list under 'images'): "
            "use dataset_flickr8k.json, dataset_flickr30k.json or dataset_coco.json"
        )
    for i, im in enumerate(entries):
        problem = _karpathy_entry_problem(im)
        if problem:
            raise DatasetError(f"{json_path}: images[{i}] {problem}: re-download the file")
    return entries


def _karpathy_entry_problem(im: object) -> str | None:
    if not isinstance(im, dict):
        return f"is a {type(im).__name__}, not an object"
    for name, kind in (("split", str), ("filename", str), ("sentences", list)):
        if not isinstance(im.get(name), kind):
            return f"has no {kind.__name__} {name!r}"
    if not all(isinstance(s, dict) and isinstance(s.get("raw"), str) for s in im["sentences"]):
        return "has a sentence without a 'raw' string"
    if "filepath" in im and not isinstance(im["filepath"], str):
        return "has a 'filepath' that is not a string"
    if "cocoid" in im and not isinstance(im["cocoid"], int):
        return "has a 'cocoid' that is not an integer"
    return None


_FLICKR_IMAGE_DIRS = (
    "Flicker8k_Dataset",
    "Flickr8k_Dataset",
    "flickr30k-images",
    "flickr30k_images",
)


def _karpathy_image_path(base: Path, im: dict) -> Path:
    candidates = [
        base / im.get("filepath", "") / im["filename"],
        base / "images" / im["filename"],
        base / im["filename"],
        *(base / d / im["filename"] for d in _FLICKR_IMAGE_DIRS),
    ]
    if "filepath" in im:
        candidates.insert(1, base / "images" / im["filepath"] / im["filename"])
    if "cocoid" in im:  # dataset_coco.json names 2014 files; the 2017 folders hold the same photos
        candidates += [base / d / f"{im['cocoid']:012d}.jpg" for d in ("train2017", "val2017")]
    return next((p for p in candidates if p.is_file()), candidates[0])


# -- COCO, official caption files (pycocotools) ------------------------------------------------


def coco_annotation_file(root: Path, split: str) -> Path:
    for year in ("2014", "2017"):
        f = root / "annotations" / f"captions_{split}{year}.json"
        if f.is_file():
            return f
    raise DatasetError(
        f"no annotations/captions_{split}2014.json or captions_{split}2017.json under {root}: "
        f"run `sat data coco --root {root}` to download COCO"
    )


def load_coco(root: str | Path, split: str) -> Split:
    """COCO captions. With Karpathy's ``dataset_coco.json`` in root, its train/restval/val/test
    split; otherwise the official train/val files read with pycocotools."""
    root = Path(root)
    karpathy = next(
        (
            f
            for f in (root / "dataset_coco.json", root / "caption_datasets" / "dataset_coco.json")
            if f.is_file()
        ),
        None,
    )
    if karpathy is not None:
        return load_karpathy(root, split, karpathy)
    if split not in ("train", "val"):
        raise DatasetError(
            f"split {split!r} needs Karpathy's dataset_coco.json in {root}; "
            "the official COCO files have train and val"
        )
    from pycocotools.coco import COCO

    ann_file = coco_annotation_file(root, split)
    try:
        coco = _quiet_coco(COCO, ann_file)
    except _MALFORMED as e:
        raise _coco_error(ann_file, e) from None
    year = ann_file.stem[-4:]
    image_dir = next(
        (
            d
            for d in (root / f"{split}{year}", root / "images" / f"{split}{year}", root / "images")
            if d.is_dir()
        ),
        root / f"{split}{year}",
    )
    try:
        items = _coco_items(coco, image_dir)
    except _MALFORMED as e:
        raise _coco_error(ann_file, e) from None
    return finish_split(f"coco/{ann_file.name}", items, image_dir)


# what pycocotools and the reader raise on a file that is not a COCO caption file
_MALFORMED = (ValueError, TypeError, KeyError, AttributeError, AssertionError, IndexError)


def _coco_error(ann_file: Path, e: Exception) -> DatasetError:
    return DatasetError(
        f"{ann_file} is not a COCO caption file ({type(e).__name__}: {e}): re-download it "
        f"with `sat data coco --root {ann_file.parent.parent}`"
    )


def _coco_items(coco, image_dir: Path) -> list[CaptionedImage]:
    items = []
    for img_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(img_id)[0]
        caps = [a["caption"].strip() for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id))]
        items.append(CaptionedImage(str(img_id), image_dir / info["file_name"], caps, img_id))
    return items


def _quiet_coco(COCO, ann_file: Path):
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        return COCO(str(ann_file))


# -- the registry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetFormat:
    """One caption dataset format, as data: a new format is one ``register_dataset`` call."""

    name: str  # the --dataset value
    load: Callable[[Path, str], Split]  # (folder, split name) -> the split
    split_names: Callable[[Path], list[str]]  # the split names it takes in a folder (aliases too)
    folder: str  # what its folder holds (data/README.md), said when a folder option is wrong
    download: str = ""  # the command that downloads it into {root}, if `sat data` does
    describe: Callable[[Path], str] | None = None  # how a split error names it (default: name)
    split_hint: Callable[[Path, list[str]], str] | None = None  # why a split is not there
    # whether ``load`` takes ``split_ratio`` (a format whose file may name no splits)
    takes_split_ratio: bool = False


_DATASETS: Registry[DatasetFormat] = Registry(
    "dataset",
    lambda name, names: DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(names)}"),
)
register_dataset = _DATASETS.register
get_dataset = _DATASETS.find  # the format, or a DatasetError listing the registered ones


def list_datasets() -> list[str]:
    return list(_DATASETS)


def load_split(
    dataset: str, root: str | Path, split: str, split_ratio: float | None = None
) -> Split:
    """The split ``split`` of the dataset ``dataset`` (a registered format) in ``root``;
    ``split_ratio`` (the training share) for a format whose files may name no splits."""
    fmt = get_dataset(dataset)
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset folder {root} does not exist: see data/README.md")
    if split_ratio is None:
        return fmt.load(root, split)
    check_split_ratio_taken(dataset)
    return fmt.load(root, split, split_ratio=split_ratio)


def check_split_ratio_taken(dataset: str, option: str = "--data.split_ratio") -> None:
    """A split ratio for a dataset whose files name its splits is a usage error."""
    if not get_dataset(dataset).takes_split_ratio:
        takers = [n for n, f in _DATASETS.items() if f.takes_split_ratio]
        raise SplitError(
            f"{option}: {dataset} names its own splits; a split ratio is for "
            f"{' and '.join(takers)} (drop the option)"
        )


def check_split_name(option: str, dataset: str, root: str | Path, split: str) -> None:
    """A split (``option``: --split, or `sat export`'s --consensus-split) that the dataset in
    the folder ``root`` does not have is a usage error naming the splits there are, said before
    anything is read (`sat export`: before the checkpoint)."""
    fmt, root = get_dataset(dataset), Path(root)
    names = fmt.split_names(root)
    if root.is_dir() and split not in names:
        shown = fmt.describe(root) if fmt.describe else fmt.name
        hint = fmt.split_hint(root, names) if fmt.split_hint else ""
        raise SplitError(f"{option} {split}: the splits of {shown} are {', '.join(names)}{hint}")


def split_names(dataset: str, root: Path) -> list[str]:
    """The --split names load_split takes for ``dataset`` in ``root`` (aliases included)."""
    return get_dataset(dataset).split_names(Path(root))


def folder_hint(dataset: str | None, root: str | Path) -> str:
    """What the folder of ``dataset`` holds and, where `sat data` downloads it, the command."""
    fmt = _DATASETS.get(str(dataset))
    if fmt is None:
        return "the dataset's folder (see data/README.md)"
    return fmt.folder + (
        f"; `{fmt.download.format(root=root)}` downloads it" if fmt.download else ""
    )


def _has_karpathy_coco(root: Path) -> bool:
    """Where load_coco looks for Karpathy's dataset_coco.json."""
    return any(
        (root / f).is_file() for f in ("dataset_coco.json", "caption_datasets/dataset_coco.json")
    )


def _coco_splits(root: Path) -> list[str]:
    """Karpathy's split names with dataset_coco.json; the official train and val without."""
    return list(KARPATHY_SPLITS) if _has_karpathy_coco(root) else ["train", "val"]


def _coco_shown(root: Path) -> str:
    return "dataset_coco.json" if _has_karpathy_coco(root) else "the official COCO files"


def _coco_hint(root: Path, names: list[str]) -> str:
    if "test" in names:
        return ""
    return f" (test and restval need Karpathy's dataset_coco.json in {root})"


register_dataset(
    DatasetFormat(
        "flickr8k",
        load_flickr8k,
        lambda root: list(FLICKR8K_SPLITS),
        "the Flickr8k folder (Flickr8k.token.txt, Flickr_8k.*Images.txt and images/; "
        "see data/README.md)",
    )
)
register_dataset(
    DatasetFormat(
        "karpathy",
        load_karpathy,
        lambda root: list(KARPATHY_SPLITS),
        "the folder of Karpathy's dataset_*.json and its photos (see data/README.md)",
        describe=lambda root: "Karpathy's split files",
    )
)
register_dataset(
    DatasetFormat(
        "coco",
        load_coco,
        _coco_splits,
        "the COCO folder (annotations/captions_*.json and the photo folders, or Karpathy's "
        "dataset_coco.json)",
        download="sat data coco --root {root}",
        describe=_coco_shown,
        split_hint=_coco_hint,
    )
)
register_dataset(
    DatasetFormat(
        "captions",
        load_own_captions,
        captions_split_names,
        f"a folder of photos and their {CSV_NAME} (columns image,caption and optionally split) "
        f"or {JSONL_NAME} ({HOW})",
        describe=lambda root: "the captions file",
        takes_split_ratio=True,
    )
)
