"""Attention correctness: does the attention for a word fall on the object the word names?

After Liu et al., "Attention Correctness in Neural Image Captioning" (AAAI 2017), scored on COCO
instance masks by ``sat evaluate --instances instances_<split><year>.json``.

Which words count
-----------------
A generated word counts when it names a COCO category (``WORD_TO_CATEGORY``, or a two-word name
in ``BIGRAM_TO_CATEGORY``) *and* that category has at least one instance in the photo's instance
annotations. Words outside the map, and words whose category is not in the photo, are not
counted. Photos absent from the instances file are skipped (counted as ``skipped_images``); a
photo listed there with no instances is scored (none of its words can count).

Cell geometry
-------------
The captioner resizes the whole photo to a square without keeping its aspect ratio
(``images.preprocess``), so the g x g attention grid covers the whole photo: for a photo of W x H
pixels, cell (r, c) covers the rectangle [c W/g, (c+1) W/g) x [r H/g, (r+1) H/g), pixel (y, x)
being the unit square [x, x+1) x [y, y+1). Nothing is cropped or padded; a photo shown to the
model another way (a centre crop, letterboxing) would need another geometry.

Masks and coverage
------------------
The mask M of a category in a photo is the union of all its instances there (crowd regions
included), each drawn by pycocotools ``COCO.annToMask`` at the annotation's resolution (the
photo's width and height in the instances file), and turned like the photo when the image file
has an EXIF orientation that ``images.open_image`` applies. ``coverage[r, c]`` is the fraction
of cell (r, c)'s area that M covers, computed at the mask's resolution: a pixel that a cell edge
cuts counts toward each cell in proportion to its overlap with it (cell edges need not fall on
pixel edges), so a half-covered cell has coverage 0.5.

Per word (attention alpha_t, shape (g, g), summing to 1):

- correctness_t = sum over cells of alpha_t[r, c] * coverage[r, c], in [0, 1]: the share of the
  attention that lies on the category's masks (the attention map spread evenly over each cell's
  pixels, then summed over the mask's pixels, as Liu et al. sum an upsampled map over a region).
- uniform_t = mean over cells of coverage[r, c]: what uniform attention (1/g^2 per cell) gets.
  Because cut pixels are shared exactly, this equals the mask's area share |M| / (W H), with no
  cell rounding.

For hard attention decoded from one location per word (``--hard-mode argmax`` or ``sample``)
the decoder reads that one cell (z_t = beta_t a_{s_t}), so all of the word's attention is there:
``alpha_t`` is one-hot on ``CaptionResult.locations[t]`` (``location_attention``) and the
summary says ``"measured_on": "attended locations"``, with the same numbers for the
distribution the locations were chosen from under ``"distribution"``. Otherwise (soft attention,
or hard attention with the expected context) ``alpha_t`` is ``CaptionResult.attention[t]``
(``"measured_on": "attention weights"``).

Aggregation
-----------
Over the N counted word occurrences (a word repeated in a caption counts each time):
``correctness`` = mean of correctness_t, ``uniform`` = mean of uniform_t, ``ratio`` =
correctness / uniform (a ratio of means, so a tiny mask's large per-word ratio does not dominate;
1 = no better than uniform attention). ``per_category`` is the same over the occurrences of each
category; categories with no counted word are absent. With no counted word at all the three
numbers are null (strict JSON).
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from showattendtell.errors import UsageError


class InstancesError(UsageError, ValueError):
    """The instances file is missing, is not COCO instance annotations, or is of other images
    (a UserError with exit status 2: the CLI prints one line)."""


# -- words -> COCO categories ------------------------------------------------------------------
#
# Written for this project from the 80 category names of the COCO 2014/2017 instance files (their
# ``name`` field, the values below) and the nouns that COCO and Flickr8k captions use for them
# (the bundled model's vocabulary included). Each category lists singular nouns; the regular
# English plural of each is added by ``_plural`` (+s; +es after s, x, z, ch, sh; consonant + y
# -> ies) and irregular plurals are written out in ``_IRREGULAR_PLURALS`` ("" = no plural form:
# the word is already plural or a mass noun). Words that often mean something else are left out
# on purpose: "orange" (a colour; "oranges" counts), "glass"/"glasses" (spectacles), "board",
# "bag", "sign", "light", "screen", "computer", "pitcher", "shepherd", "ski" (a verb or a modifier
# as in "ski slope"; "skis" counts), "baseball"/"football"/"basketball" (usually the game).
_CATEGORY_WORDS: dict[str, tuple[str, ...]] = {
    "person": (
        "person",
        "man",
        "woman",
        "boy",
        "girl",
        "child",
        "kid",
        "baby",
        "toddler",
        "infant",
        "adult",
        "teenager",
        "teen",
        "youth",
        "lady",
        "guy",
        "gentleman",
        "friend",
        "mother",
        "father",
        "daughter",
        "son",
        "brother",
        "sister",
        "bride",
        "groom",
        "player",
        "skier",
        "surfer",
        "snowboarder",
        "skateboarder",
        "skater",
        "rollerblader",
        "cyclist",
        "bicyclist",
        "biker",
        "motorcyclist",
        "rider",
        "runner",
        "jogger",
        "hiker",
        "climber",
        "swimmer",
        "diver",
        "kayaker",
        "waterskier",
        "wakeboarder",
        "windsurfer",
        "athlete",
        "gymnast",
        "dancer",
        "cheerleader",
        "jockey",
        "cowboy",
        "cowgirl",
        "footballer",
        "goalie",
        "referee",
        "umpire",
        "batter",
        "batsman",
        "baseman",
        "catcher",
        "quarterback",
        "officer",
        "policeman",
        "fireman",
        "firefighter",
        "soldier",
        "worker",
        "vendor",
        "chef",
        "musician",
        "guitarist",
        "drummer",
        "singer",
        "performer",
        "photographer",
        "tourist",
        "student",
        "pedestrian",
        "spectator",
        "onlooker",
        "clown",
        "crowd",
        "audience",
    ),
    "bicycle": ("bicycle", "bike"),
    "car": ("car", "taxi", "suv", "jeep", "sedan", "limousine", "automobile"),
    "motorcycle": ("motorcycle", "motorbike", "moped"),
    "airplane": ("airplane", "plane", "jet", "aircraft", "airliner", "aeroplane", "jetliner"),
    "bus": ("bus",),
    "train": ("train", "locomotive", "tram", "streetcar"),
    "truck": ("truck", "firetruck", "lorry"),
    "boat": (
        "boat",
        "ship",
        "sailboat",
        "rowboat",
        "speedboat",
        "motorboat",
        "canoe",
        "kayak",
        "yacht",
        "ferry",
    ),
    "traffic light": ("stoplight",),
    "fire hydrant": ("hydrant",),
    "stop sign": ("stopsign",),
    "parking meter": ("meter",),
    "bench": ("bench",),
    "bird": (
        "bird",
        "duck",
        "pigeon",
        "seagull",
        "gull",
        "swan",
        "goose",
        "pelican",
        "parrot",
        "owl",
        "eagle",
        "penguin",
    ),
    "cat": ("cat", "kitten", "kitty"),
    "dog": (
        "dog",
        "puppy",
        "pup",
        "greyhound",
        "terrier",
        "poodle",
        "retriever",
        "collie",
        "beagle",
        "dachshund",
        "doberman",
        "pitbull",
        "husky",
        "labrador",
        "dalmatian",
        "hound",
    ),
    "horse": ("horse", "pony", "foal"),
    "sheep": ("sheep", "lamb"),
    "cow": ("cow", "cattle", "bull", "calf", "ox"),
    "elephant": ("elephant",),
    "bear": ("bear",),
    "zebra": ("zebra",),
    "giraffe": ("giraffe",),
    "backpack": ("backpack", "rucksack", "knapsack"),
    "umbrella": ("umbrella", "parasol"),
    "handbag": ("handbag", "purse"),
    "tie": ("tie", "necktie"),
    "suitcase": ("suitcase", "luggage"),
    "frisbee": ("frisbee",),
    "skis": ("skis",),
    "snowboard": ("snowboard",),
    "sports ball": ("ball",),
    "kite": ("kite",),
    "baseball bat": ("bat",),
    "baseball glove": ("glove", "mitt"),
    "skateboard": ("skateboard",),
    "surfboard": ("surfboard",),
    "tennis racket": ("racket", "racquet"),
    "bottle": ("bottle",),
    "wine glass": ("wineglass",),
    "cup": ("cup", "mug"),
    "fork": ("fork",),
    "knife": ("knife",),
    "spoon": ("spoon",),
    "bowl": ("bowl",),
    "banana": ("banana",),
    "apple": ("apple",),
    "sandwich": ("sandwich",),
    "orange": ("oranges",),
    "broccoli": ("broccoli",),
    "carrot": ("carrot",),
    "hot dog": ("hotdog",),
    "pizza": ("pizza",),
    "donut": ("donut", "doughnut"),
    "cake": ("cake", "cupcake"),
    "chair": ("chair",),
    "couch": ("couch", "sofa"),
    "potted plant": ("plant", "houseplant"),
    "bed": ("bed",),
    "dining table": ("table",),
    "toilet": ("toilet",),
    "tv": ("tv", "television", "monitor"),
    "laptop": ("laptop",),
    "mouse": ("mouse",),
    "remote": ("remote",),
    "keyboard": ("keyboard",),
    "cell phone": ("phone", "cellphone", "smartphone", "telephone"),
    "microwave": ("microwave",),
    "oven": ("oven", "stove"),
    "toaster": ("toaster",),
    "sink": ("sink",),
    "refrigerator": ("refrigerator", "fridge"),
    "book": ("book",),
    "clock": ("clock",),
    "vase": ("vase",),
    "scissors": ("scissors",),
    "teddy bear": ("teddy",),
    "hair drier": ("hairdryer", "hairdrier", "blowdryer"),
    "toothbrush": ("toothbrush",),
}

_IRREGULAR_PLURALS = {
    "person": "people",
    "man": "men",
    "woman": "women",
    "child": "children",
    "gentleman": "gentlemen",
    "policeman": "policemen",
    "fireman": "firemen",
    "batsman": "batsmen",
    "baseman": "basemen",
    "goose": "geese",
    "calf": "calves",
    "ox": "oxen",
    "knife": "knives",
    "mouse": "mice",
    "bus": "buses",
    "sheep": "",
    "cattle": "",
    "skis": "",
    "oranges": "",
    "broccoli": "",
    "scissors": "",
    "luggage": "",
    "crowd": "crowds",
    "audience": "audiences",
    "youth": "youths",
}
_EXTRA_PLURALS = {"person": "persons", "bus": "busses"}  # a second accepted plural

# Two-word names, matched before single words. The category is attributed to the second word
# (the head noun), whose attention is scored; the first word is not scored on its own. So "hot
# dog" is a hot dog, not a dog, and "teddy bear" a teddy bear, not a bear; "dirt bike" is a
# motorcycle. None marks a compound that names no category although a word of it would ("bus
# stop", "jet ski"). A single head word alone ("racket", "bat", "phone", "table", "plant",
# "hydrant", "meter", "teddy") also names the category when it is in WORD_TO_CATEGORY above.
_BIGRAMS: dict[tuple[str, str], str | None] = {
    ("hot", "dog"): "hot dog",
    ("teddy", "bear"): "teddy bear",
    ("stuffed", "bear"): "teddy bear",
    ("stuffed", "animal"): "teddy bear",
    ("stop", "sign"): "stop sign",
    ("traffic", "light"): "traffic light",
    ("fire", "hydrant"): "fire hydrant",
    ("parking", "meter"): "parking meter",
    ("wine", "glass"): "wine glass",
    ("cell", "phone"): "cell phone",
    ("mobile", "phone"): "cell phone",
    ("tennis", "racket"): "tennis racket",
    ("tennis", "racquet"): "tennis racket",
    ("baseball", "bat"): "baseball bat",
    ("baseball", "glove"): "baseball glove",
    ("baseball", "mitt"): "baseball glove",
    ("hair", "drier"): "hair drier",
    ("hair", "dryer"): "hair drier",
    ("blow", "dryer"): "hair drier",
    ("dining", "table"): "dining table",
    ("potted", "plant"): "potted plant",
    ("sports", "ball"): "sports ball",
    ("dirt", "bike"): "motorcycle",
    ("motor", "bike"): "motorcycle",
    ("german", "shepherd"): "dog",
    ("train", "car"): "train",
    ("passenger", "jet"): "airplane",
    ("bus", "stop"): None,
    ("train", "station"): None,
    ("train", "track"): None,
    ("jet", "ski"): None,
    ("hot", "tub"): None,
}


def _plural(word: str) -> str:
    if word in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[word]
    if word.endswith("y") and word[-2:-1] not in tuple("aeiou"):
        return word[:-1] + "ies"
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    return word + "s"


def _build_word_map() -> dict[str, str]:
    words: dict[str, str] = {}
    for category, nouns in _CATEGORY_WORDS.items():
        for noun in nouns:
            for form in (noun, _plural(noun), _EXTRA_PLURALS.get(noun, "")):
                if form:
                    assert words.setdefault(form, category) == category, form
    return words


#: caption word (lower case, singular or plural) -> COCO category name
WORD_TO_CATEGORY: dict[str, str] = _build_word_map()

#: (first word, head word) -> COCO category name, or None: the pair names no category
BIGRAM_TO_CATEGORY: dict[tuple[str, str], str | None] = {
    **_BIGRAMS,
    **{(a, _plural(b)): c for (a, b), c in _BIGRAMS.items() if _plural(b)},
}

COCO_CATEGORIES = frozenset(_CATEGORY_WORDS)


def category_words(words: Sequence[str]) -> list[tuple[int, str]]:
    """(index of the word, COCO category) for each word of a caption that names a category.

    Two-word names (``BIGRAM_TO_CATEGORY``) are matched first, left to right, and attributed to
    their second word; then single words (``WORD_TO_CATEGORY``). Words are compared in lower case.
    """
    low = [w.lower() for w in words]
    found, i = [], 0
    while i < len(low):
        if i + 1 < len(low) and (low[i], low[i + 1]) in BIGRAM_TO_CATEGORY:
            category = BIGRAM_TO_CATEGORY[low[i], low[i + 1]]
            if category is not None:
                found.append((i + 1, category))
            i += 2
            continue
        if low[i] in WORD_TO_CATEGORY:
            found.append((i, WORD_TO_CATEGORY[low[i]]))
        i += 1
    return found


# -- cell coverage and per-word scores ---------------------------------------------------------


def _overlap(n_pixels: int, grid: int) -> np.ndarray:
    """(grid, n_pixels): the fraction of cell k's extent [k n/g, (k+1) n/g) that pixel j's
    [j, j+1) fills (a row sums to 1; a pixel cut by a cell edge is shared by both cells)."""
    edges = np.arange(grid + 1, dtype=np.float64) * n_pixels / grid
    left = np.arange(n_pixels, dtype=np.float64)
    overlap = np.minimum(edges[1:, None], left[None, :] + 1) - np.maximum(
        edges[:-1, None], left[None, :]
    )
    return np.clip(overlap, 0.0, None) / (n_pixels / grid)


def cell_coverage(mask: np.ndarray, grid: int) -> np.ndarray:
    """(grid, grid): the fraction of each cell's area that the (H, W) mask covers, with cell
    (r, c) = [c W/g, (c+1) W/g) x [r H/g, (r+1) H/g) of the mask's pixels (the whole photo)."""
    mask = np.asarray(mask)
    if mask.ndim != 2 or min(mask.shape) < 1:
        raise ValueError(f"a mask must be a non-empty 2-D array, not of shape {mask.shape}")
    h, w = mask.shape
    m = (mask > 0).astype(np.float64)
    return np.clip(_overlap(h, grid) @ m @ _overlap(w, grid).T, 0.0, 1.0)


def word_correctness(attention: np.ndarray, coverage: np.ndarray) -> tuple[float, float]:
    """(correctness, uniform) of one word: sum(attention * coverage) and mean(coverage)."""
    attention = np.asarray(attention, dtype=np.float64)
    if attention.shape != coverage.shape:
        raise ValueError(f"attention {attention.shape} and coverage {coverage.shape} differ")
    return float((attention * coverage).sum()), float(coverage.mean())


# -- the instances file ------------------------------------------------------------------------


def _exif_transpose(path: str | Path) -> tuple[object | None, tuple[int, int] | None]:
    """(the PIL transpose that ``images.open_image`` applies to the file through
    ImageOps.exif_transpose, or None; the stored (width, height), or None if unreadable)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            orientation = img.getexif().get(0x0112, 1)
            size = img.size
    except Exception:  # an unreadable header: open_image keeps the pixels as stored
        return None, None
    T = Image.Transpose
    return {
        2: T.FLIP_LEFT_RIGHT,
        3: T.ROTATE_180,
        4: T.FLIP_TOP_BOTTOM,
        5: T.TRANSPOSE,
        6: T.ROTATE_270,
        7: T.TRANSVERSE,
        8: T.ROTATE_90,
    }.get(orientation), size


class CocoInstances:
    """A COCO instances file (``instances_{train,val}{2014,2017}.json``) read with pycocotools.

    ``image_ids`` are the photos it annotates; ``coverage(...)`` gives a category's cell coverage
    in one of them. Raises InstancesError (one line, exit status 2) for a missing file, a file
    that is not COCO instance annotations (a captions file, say), or inconsistent ids.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        data = self._read(self.path)
        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            coco = COCO()
            coco.dataset = data
            coco.createIndex()
        self.coco = coco
        self.image_ids = frozenset(coco.imgs)
        self.category_names = {c["id"]: c["name"] for c in data["categories"]}
        self._present: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for ann in data["annotations"]:
            self._present[ann["image_id"]][self.category_names[ann["category_id"]]].append(ann)
        self._masks: dict[tuple[int, str], np.ndarray] = {}

    @staticmethod
    def _read(path: Path) -> dict:
        if not path.is_file():
            raise InstancesError(
                f"instances file {path} not found (COCO's annotations/instances_<split><year>.json)"
            )
        try:
            with path.open("rb") as f:
                data = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise InstancesError(f"{path} is not a JSON file ({e})") from None
        except OSError as e:
            raise InstancesError(f"cannot read {path}: {e.strerror or e}") from None
        what = f"{path} is not a COCO instances file"
        if not isinstance(data, dict) or not all(
            isinstance(data.get(k), list) for k in ("images", "annotations", "categories")
        ):
            hint = (
                "; it looks like a captions file: give annotations/instances_<split><year>.json"
                if isinstance(data, dict) and "categories" not in data
                else ""
            )
            raise InstancesError(
                f'{what} (it needs "images", "annotations" and "categories" lists){hint}'
            )
        try:
            categories = {c["id"]: str(c["name"]) for c in data["categories"]}
            images = {im["id"]: (int(im["width"]), int(im["height"])) for im in data["images"]}
            for ann in data["annotations"]:
                if ann["category_id"] not in categories or ann["image_id"] not in images:
                    raise InstancesError(
                        f"{what}: annotation {ann.get('id')} names an unknown image or category"
                    )
                if not isinstance(ann["segmentation"], (list, dict)):
                    raise TypeError("segmentation")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, InstancesError):
                raise
            raise InstancesError(f"{what} (an entry lacks or mistypes {e})") from None
        if any(w < 1 or h < 1 for w, h in images.values()):
            raise InstancesError(f"{what}: an image has no width or height")
        return data

    def categories_in(self, image_id: int) -> set[str]:
        return set(self._present.get(image_id, {}))

    def mask(
        self, image_id: int, category: str, image_path: str | Path | None = None
    ) -> np.ndarray:
        """(H, W) bool: the union of the category's instances in the photo, turned like the photo
        when its file has an EXIF orientation (``image_path`` given) and was annotated as stored."""
        key = (image_id, category)
        if key not in self._masks:
            info = self.coco.imgs[image_id]
            m = np.zeros((int(info["height"]), int(info["width"])), dtype=bool)
            for ann in self._present.get(image_id, {}).get(category, []):
                try:
                    with warnings.catch_warnings():  # pycocotools' NumPy 2 copy= notice
                        warnings.simplefilter("ignore", DeprecationWarning)
                        m |= self.coco.annToMask(ann).astype(bool)
                except Exception as e:  # pycocotools raises many kinds
                    raise InstancesError(
                        f"{self.path}: annotation {ann.get('id')} of image "
                        f"{image_id} has an unreadable segmentation ({e})"
                    ) from None
            method, size = _exif_transpose(image_path) if image_path else (None, None)
            if method is not None and size == (m.shape[1], m.shape[0]):
                from PIL import Image

                m = np.asarray(Image.fromarray(m).transpose(method))
            self._masks[key] = m
        return self._masks[key]

    def coverage(
        self, image_id: int, category: str, grid: int, image_path: str | Path | None = None
    ) -> np.ndarray:
        return cell_coverage(self.mask(image_id, category, image_path), grid)

    def forget(self, image_id: int) -> None:
        """Drop an image's cached masks, once its scoring is done."""
        for key in [k for k in self._masks if k[0] == image_id]:
            del self._masks[key]


# -- accumulation ------------------------------------------------------------------------------


@dataclass
class _Sums:
    words: int = 0
    correctness: float = 0.0
    uniform: float = 0.0

    def add(self, correctness: float, uniform: float) -> None:
        self.words += 1
        self.correctness += correctness
        self.uniform += uniform

    def summary(self) -> dict:
        if not self.words:
            return {"words": 0, "correctness": None, "uniform": None, "ratio": None}
        c, u = self.correctness / self.words, self.uniform / self.words
        return {
            "words": self.words,
            "correctness": _finite(c),
            "uniform": _finite(u),
            "ratio": _finite(c / u) if u > 0 else None,
        }


def _finite(x: float, digits: int = 6) -> float | None:
    return round(float(x), digits) if np.isfinite(x) else None


@dataclass
class AttentionCorrectness:
    """Scores captions' attention against an instances file, one photo at a time (``add``)."""

    instances: CocoInstances
    images: int = 0
    skipped_images: int = 0
    total: _Sums = field(default_factory=_Sums)
    per_category: dict[str, _Sums] = field(default_factory=lambda: defaultdict(_Sums))

    def add(
        self,
        image_id: int | None,
        words: Sequence[str],
        attention: np.ndarray,
        image_path: str | Path | None = None,
    ) -> list[tuple[int, str, float, float]]:
        """Score one captioned photo; returns (word index, category, correctness, uniform) of
        each counted word. A photo the instances file does not annotate is counted as skipped.
        Its masks stay cached (another attention of the same photo reuses them) until the
        caller's ``instances.forget(image_id)``."""
        if image_id is None or image_id not in self.instances.image_ids:
            self.skipped_images += 1
            return []
        self.images += 1
        attention = np.asarray(attention)
        if (
            attention.ndim != 3
            or attention.shape[0] != len(words)
            or attention.shape[1] != attention.shape[2]
        ):
            raise ValueError(f"attention of shape {attention.shape} for {len(words)} words")
        present = self.instances.categories_in(image_id)
        scored = []
        for i, category in category_words(words):
            if category not in present:
                continue
            cov = self.instances.coverage(image_id, category, attention.shape[1], image_path)
            c, u = word_correctness(attention[i], cov)
            self.total.add(c, u)
            self.per_category[category].add(c, u)
            scored.append((i, category, c, u))
        return scored

    def summary(self) -> dict:
        """The strict-JSON summary ``sat evaluate`` prints under "attention_correctness"."""
        cats = sorted(self.per_category.items(), key=lambda kv: (-kv[1].words, kv[0]))
        return {
            "words": self.total.words,
            "images": self.images,
            "skipped_images": self.skipped_images,
            **{k: v for k, v in self.total.summary().items() if k != "words"},
            "per_category": {name: s.summary() for name, s in cats if s.words},
        }


def location_attention(locations: Sequence[tuple[int, int]], grid: int) -> np.ndarray:
    """One-hot attention (n_words, g, g) on each word's attended cell (row, col)."""
    out = np.zeros((len(locations), grid, grid), dtype=np.float32)
    for t, (r, c) in enumerate(locations):
        out[t, r, c] = 1.0
    return out


def score_results(
    instances: CocoInstances,
    items: Iterable[
        tuple[
            int | None,
            Sequence[str],
            np.ndarray,
            Sequence[tuple[int, int]] | None,
            str | Path | None,
        ]
    ],
) -> dict:
    """Summary for (COCO id, words, attention (n_words, g, g), the attended (row, col) per word
    or None, image path) of captioned photos: on the attended cells where a location was read
    (hard attention, argmax or sample), else on the attention weights (see the module doc)."""
    weights, attended = AttentionCorrectness(instances), AttentionCorrectness(instances)
    located = False
    for image_id, words, attention, locations, path in items:
        attention = np.asarray(attention)
        if locations is not None:
            located = True
            attended.add(image_id, words, location_attention(locations, attention.shape[1]), path)
        weights.add(image_id, words, attention, path)  # the same masks, cached
        instances.forget(image_id)
    if not located:
        return {"measured_on": "attention weights", **weights.summary()}
    dist = weights.summary()
    return {
        "measured_on": "attended locations",
        **attended.summary(),
        "distribution": {k: dist[k] for k in ("correctness", "uniform", "ratio")},
    }
