"""Attention correctness (`sat evaluate --instances`): word -> COCO category map, cell coverage at
the mask's resolution, per-word scores and their aggregation, the instances file's checks, and
the command end to end on the COCO photos in ../shared."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.data import COCO_SUBSET, SHARED, needs_coco_subset
from helpers.evaluate import evaluate_argv
from helpers.marks import needs_java

from showattendtell.cli.main import main
from showattendtell.evaluation.attention_correctness import (
    BIGRAM_TO_CATEGORY,
    COCO_CATEGORIES,
    WORD_TO_CATEGORY,
    AttentionCorrectness,
    CocoInstances,
    InstancesError,
    category_words,
    cell_coverage,
    location_attention,
    score_results,
    word_correctness,
)

COCO_TRAIN_MINI = SHARED / "data" / "coco2017_train_mini"
TRAIN_INSTANCES = COCO_TRAIN_MINI / "annotations" / "instances_train2017.json"
needs_train_mini = pytest.mark.skipif(
    not TRAIN_INSTANCES.is_file(),
    reason=f"COCO train2017 mini set not found at {COCO_TRAIN_MINI}",
)
VAL_INSTANCES = COCO_SUBSET / "annotations" / "instances_val2017.json"
KEYS = ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"]


# -- cell coverage and per-word scores ---------------------------------------------------------


def one_hot(g: int, *cells: tuple[int, int]) -> np.ndarray:
    a = np.zeros((g, g))
    for r, c in cells:
        a[r, c] = 1.0 / len(cells)
    return a


def test_attention_all_on_the_mask_scores_one():
    mask = np.zeros((90, 90), bool)
    mask[30:60, 30:60] = True  # exactly cells (3..5, 3..5) of a 9x9 grid
    cov = cell_coverage(mask, 9)
    assert cov[3:6, 3:6] == pytest.approx(np.ones((3, 3)))
    assert cov.sum() == pytest.approx(9.0)
    c, u = word_correctness(one_hot(9, (4, 4)), cov)
    assert (c, u) == (pytest.approx(1.0), pytest.approx(9 / 81))
    c, _ = word_correctness(one_hot(9, (3, 3), (5, 5), (3, 5)), cov)
    assert c == pytest.approx(1.0)
    c, _ = word_correctness(one_hot(9, (0, 0)), cov)  # all off the mask
    assert c == 0.0


def test_uniform_attention_scores_the_masks_area_share():
    rng = np.random.default_rng(0)
    mask = rng.random((37, 53)) < 0.3  # cell edges fall inside pixels: 37/9, 53/9
    cov = cell_coverage(mask, 9)
    c, u = word_correctness(np.full((9, 9), 1 / 81), cov)
    assert c == pytest.approx(u, abs=1e-12)
    assert u == pytest.approx(mask.mean(), abs=1e-12)  # the exact area share, no cell rounding


def test_a_half_covered_cell_counts_half():
    mask = np.zeros((4, 4), bool)
    mask[0:2, 0:1] = True  # the left half of cell (0, 0) of a 2x2 grid
    cov = cell_coverage(mask, 2)
    assert cov == pytest.approx(np.array([[0.5, 0.0], [0.0, 0.0]]))
    assert word_correctness(one_hot(2, (0, 0)), cov)[0] == pytest.approx(0.5)
    # a pixel cut by a cell edge is shared: columns [0, 1.5) and [1.5, 3) of a 3-pixel row
    mask = np.zeros((2, 3), bool)
    mask[:, 1] = True
    assert cell_coverage(mask, 2) == pytest.approx(np.full((2, 2), 0.5 / 1.5))
    # rows are y, columns x: a mask on the bottom-left quarter covers cell (1, 0) only
    mask = np.zeros((6, 8), bool)
    mask[3:, :4] = True
    assert cell_coverage(mask, 2) == pytest.approx(np.array([[0.0, 0.0], [1.0, 0.0]]))


def split(caption: str) -> list[str]:
    return caption.split()


# -- the word map -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("word", "category"),
    [
        ("man", "person"),
        ("men", "person"),
        ("women", "person"),
        ("children", "person"),
        ("people", "person"),
        ("kids", "person"),
        ("skiers", "person"),
        ("surfer", "person"),
        ("players", "person"),
        ("ladies", "person"),
        ("puppy", "dog"),
        ("puppies", "dog"),
        ("dogs", "dog"),
        ("bike", "bicycle"),
        ("bikes", "bicycle"),
        ("bicycle", "bicycle"),
        ("motorbike", "motorcycle"),
        ("motorcycles", "motorcycle"),
        ("plane", "airplane"),
        ("jets", "airplane"),
        ("buses", "bus"),
        ("benches", "bench"),
        ("knives", "knife"),
        ("mice", "mouse"),
        ("sheep", "sheep"),
        ("skis", "skis"),
        ("sofa", "couch"),
        ("racquet", "tennis racket"),
        ("phone", "cell phone"),
        ("table", "dining table"),
    ],
)
def test_plurals_and_synonyms_map_to_their_category(word, category):
    assert WORD_TO_CATEGORY[word] == category
    assert category_words(["a", word.upper()]) == [(1, category)]  # compared in lower case


def test_two_word_names_are_scored_on_their_head_word():
    words = split("a hot dog and two dogs near teddy bears on a dirt bike at the bus stop")
    assert category_words(words) == [
        (2, "hot dog"),
        (5, "dog"),
        (8, "teddy bear"),
        (12, "motorcycle"),
    ]  # "bus stop" names nothing
    assert category_words(["a", "stop", "sign"]) == [(2, "stop sign")]
    assert category_words(["two", "wine", "glasses"]) == [(2, "wine glass")]
    assert category_words(["a", "bear"]) == [(1, "bear")]


def test_ambiguous_and_unknown_words_are_not_mapped():
    for word in (
        "orange",
        "glass",
        "glasses",
        "board",
        "sign",
        "light",
        "tree",
        "grass",
        "ski",
        "water",
        "the",
    ):
        assert word not in WORD_TO_CATEGORY, word
    assert category_words(split("a boy in an orange shirt near a tree")) == [(1, "person")]


def test_the_map_names_only_coco_categories():
    assert len(COCO_CATEGORIES) == 80
    assert (
        set(WORD_TO_CATEGORY.values()) | {c for c in BIGRAM_TO_CATEGORY.values() if c}
        <= COCO_CATEGORIES
    )
    if VAL_INSTANCES.is_file():
        official = {c["name"] for c in json.loads(VAL_INSTANCES.read_text())["categories"]}
        assert official == COCO_CATEGORIES


# -- an instances file and the aggregation ------------------------------------------------------


def rectangle(ann_id, category_id, x, y, w, h):
    """A COCO annotation on image 1: a w x h rectangle at (x, y), as a polygon."""
    return {
        "id": ann_id,
        "image_id": 1,
        "category_id": category_id,
        "iscrowd": 0,
        "area": float(w * h),
        "bbox": [x, y, w, h],
        "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]],
    }


def write_instances(path, images=((1, 40, 20),), anns=None, categories=None):
    """A COCO instances file: image 1 is 40 x 20 with a dog on its left half (a polygon) and a
    person on its right quarter; categories person, dog, cat."""
    categories = categories or [
        {"id": 1, "name": "person"},
        {"id": 18, "name": "dog"},
        {"id": 17, "name": "cat"},
    ]
    if anns is None:
        anns = [rectangle(10, 18, 0, 0, 20, 20), rectangle(11, 1, 30, 0, 10, 20)]  # dog, person
    data = {
        "images": [
            {"id": i, "width": w, "height": h, "file_name": f"{i:012d}.jpg"} for i, w, h in images
        ],
        "annotations": anns,
        "categories": categories,
    }
    path.write_text(json.dumps(data))
    return path


def test_only_words_naming_a_category_of_the_photo_count(tmp_path):
    instances = CocoInstances(write_instances(tmp_path / "instances.json"))
    assert instances.categories_in(1) == {"dog", "person"}
    dog = instances.mask(1, "dog")
    assert dog.shape == (20, 40) and dog[:, :20].mean() > 0.9 and not dog[:, 21:].any()
    acc = AttentionCorrectness(instances)
    words = split("a dog and a cat near a tree with a man")
    att = np.zeros((len(words), 2, 2))
    att[:, 0, 0] = 1.0  # every word looks at the top-left quarter: on the dog
    scored = acc.add(1, words, att)
    assert [(i, c) for i, c, _, _ in scored] == [(1, "dog"), (10, "person")]  # no cat, no tree
    (_, _, c_dog, u_dog), (_, _, c_man, u_man) = scored
    assert c_dog == pytest.approx(dog[:10, :20].mean()) and u_dog == pytest.approx(dog.mean())
    assert c_man == 0.0 and u_man == pytest.approx(instances.mask(1, "person").mean())
    acc.add(999, ["a", "dog"], np.full((2, 2, 2), 0.25))  # not in the instances file: skipped
    summary = acc.summary()
    assert summary["words"] == 2 and summary["images"] == 1 and summary["skipped_images"] == 1
    assert set(summary["per_category"]) == {"dog", "person"}  # no "cat": absent, not zero
    assert summary["per_category"]["person"]["ratio"] == 0.0
    json.dumps(summary, allow_nan=False)


def test_aggregation_is_a_ratio_of_means_over_word_occurrences(tmp_path):
    instances = CocoInstances(write_instances(tmp_path / "instances.json"))
    acc = AttentionCorrectness(instances)
    pairs = [(0.5, 0.1), (0.1, 0.5), (0.3, 0.3)]
    for c, u in pairs:
        acc.total.add(c, u)
        acc.per_category["dog"].add(c, u)
    s = acc.summary()
    assert (s["words"], s["correctness"], s["uniform"], s["ratio"]) == (3, 0.3, 0.3, 1.0)
    # (a mean of per-word ratios would be (5 + 0.2 + 1) / 3 = 2.07)
    empty = AttentionCorrectness(instances).summary()
    assert empty == {
        "words": 0,
        "images": 0,
        "skipped_images": 0,
        "correctness": None,
        "uniform": None,
        "ratio": None,
        "per_category": {},
    }


def test_hard_attention_from_one_location_is_scored_on_that_cell(tmp_path):
    """Decoded from one location per word (argmax / sample), all of a word's attention is on the
    cell it read: scored on that cell, with the distribution's numbers alongside."""
    instances = CocoInstances(write_instances(tmp_path / "instances.json"))
    words = ["a", "dog", "and", "a", "man"]
    att = np.full((5, 2, 2), 0.25)  # the distribution: uniform
    locations = [(1, 1), (0, 0), (0, 1), (0, 1), (1, 0)]  # "dog" read the dog, "man" did not
    assert location_attention(locations, 2)[1].tolist() == [[1, 0], [0, 0]]
    hard = score_results(instances, [(1, words, att, locations, None)])
    dog = instances.mask(1, "dog")
    assert hard["measured_on"] == "attended locations" and hard["words"] == 2
    assert hard["per_category"]["dog"]["correctness"] == pytest.approx(dog[:10, :20].mean())
    assert hard["per_category"]["person"]["correctness"] == 0.0
    assert hard["distribution"]["ratio"] == pytest.approx(1.0, abs=1e-5)
    soft = score_results(instances, [(1, words, att, None, None)])
    assert soft["measured_on"] == "attention weights" and "distribution" not in soft
    assert soft["ratio"] == pytest.approx(1.0, abs=1e-5)


def test_uniform_attention_has_ratio_one_on_real_masks(tmp_path):
    instances = CocoInstances(write_instances(tmp_path / "instances.json"))
    acc = AttentionCorrectness(instances)
    words = ["dogs", "people", "man"]
    acc.add(1, words, np.full((3, 9, 9), 1 / 81))
    s = acc.summary()
    assert s["words"] == 3 and s["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert s["per_category"]["dog"]["uniform"] == pytest.approx(
        instances.mask(1, "dog").mean(), abs=1e-6
    )


def test_masks_turn_with_the_photos_exif_orientation(tmp_path):
    from PIL import Image

    from showattendtell.images.files import open_image

    # stored 40 x 20, the dog on the left half; EXIF 6: shown turned a quarter clockwise
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "000000000001.jpg"
    Image.fromarray(pixels).save(path, exif=exif, quality=100)
    shown = np.asarray(open_image(path).convert("L")) > 127
    instances = CocoInstances(write_instances(tmp_path / "instances.json"))
    mask = instances.mask(1, "dog", path)
    assert mask.shape == shown.shape == (40, 20)
    assert (mask == shown).mean() > 0.95  # (JPEG edges aside) the mask is where the model sees it


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "not found"),
        ("{not json", "is not a JSON file"),
        ('{"images": [], "annotations": [{"image_id": 1, "caption": "a dog"}]}', "captions file"),
        ("[1, 2]", "not a COCO instances file"),
        (
            '{"images": [{"id": 1, "width": 4, "height": 4}],'
            ' "categories": [{"id": 1, "name": "dog"}],'
            ' "annotations": [{"id": 5, "image_id": 1, "category_id": 7, "segmentation": []}]}',
            "unknown image or category",
        ),
        ('{"images": [{"id": 1}], "categories": [], "annotations": []}', "lacks or mistypes"),
    ],
)
def test_bad_instances_files_are_one_line_usage_errors(tmp_path, content, match):
    path = tmp_path / "instances.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InstancesError, match=match) as e:
        CocoInstances(path)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


# -- sat evaluate --instances, end to end ------------------------------------------------------


def run_evaluate(capsys, dataset, root, split, instances, *extra, output=None):
    """`sat evaluate` at beam 1 without SPICE, measuring attention against ``instances``:
    the exit code and what was captured."""
    options = ["--instances", str(instances), "--num-workers", "0", "--beam-size", "1"]
    argv = evaluate_argv(dataset, root, split, *options, "--no-spice", *extra, output=output)
    return main(argv), capsys.readouterr()


def check_summary(ac: dict, n_images: int, measured_on: str = "attention weights") -> None:
    assert list(ac) == [
        "measured_on",
        "words",
        "images",
        "skipped_images",
        "correctness",
        "uniform",
        "ratio",
        "per_category",
        *(["distribution"] if measured_on == "attended locations" else []),
    ]
    assert ac["measured_on"] == measured_on
    assert ac["images"] + ac["skipped_images"] == n_images
    assert ac["words"] == sum(c["words"] for c in ac["per_category"].values())
    assert ac["per_category"] and ac["per_category"].keys() <= COCO_CATEGORIES
    for s in [ac, *ac["per_category"].values()]:
        assert 0.0 <= s["correctness"] <= 1.0 and 0.0 < s["uniform"] <= 1.0
        assert s["ratio"] == pytest.approx(s["correctness"] / s["uniform"], rel=1e-4)
    counts = [c["words"] for c in ac["per_category"].values()]
    assert counts == sorted(counts, reverse=True) and all(counts)


@needs_java
@needs_coco_subset
@pytest.mark.slow
def test_evaluate_reports_attention_correctness_on_the_val_subset(tmp_path, capsys):
    # the bundled default model at beam 1 on the first 8 photos (5 of them have masks)
    out = tmp_path / "r.json"
    rc, captured = run_evaluate(
        capsys, "coco", COCO_SUBSET, "val", VAL_INSTANCES, "--limit", "8", output=out
    )
    assert rc == 0, captured.err
    last = captured.out.strip().splitlines()[-1]
    scores = json.loads(last)  # strict JSON: json.loads would take NaN, so check the text too
    assert "NaN" not in last and "Infinity" not in last
    assert list(scores) == [
        *KEYS,
        "repeated_bigram_captions",
        "mean_words",
        "attention_correctness",
    ]  # the metric keys, unchanged
    check_summary(scores["attention_correctness"], 8)
    assert scores["attention_correctness"]["skipped_images"] == 3
    assert "attention correctness:" in captured.err
    assert len(json.loads(out.read_text())) == 8  # all 8 still captioned


@needs_java
@needs_train_mini
def test_evaluate_attention_correctness_on_the_train_mini_set(tmp_path, capsys):
    mini = ("coco", COCO_TRAIN_MINI, "train", TRAIN_INSTANCES, "--limit", "4")
    rc, captured = run_evaluate(capsys, *mini, output=tmp_path / "r.json")
    assert rc == 0, captured.err
    ac = json.loads(captured.out.strip().splitlines()[-1])["attention_correctness"]
    check_summary(ac, 4)
    assert ac["skipped_images"] == 0  # every photo of the mini set has masks
    # the hard model decoded from its single most likely location: scored on that cell
    hard_model = ("--model", "flickr8k_lite2_hard", "--hard-mode", "argmax")
    rc, captured = run_evaluate(capsys, *mini, *hard_model, output=tmp_path / "h.json")
    assert rc == 0, captured.err
    hard = json.loads(captured.out.strip().splitlines()[-1])["attention_correctness"]
    check_summary(hard, 4, "attended locations")
    assert list(hard["distribution"]) == ["correctness", "uniform", "ratio"]
    assert "(attended locations)" in captured.err


def one_line_error(rc, captured, match):
    assert rc == 2 and captured.out == "" and "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == captured.err.strip().splitlines()[-1], captured.err
    assert match in errors[0], errors[0]


@needs_java
@needs_coco_subset
@pytest.mark.parametrize(
    ("instances", "match"),
    [
        ("{tmp}/missing.json", "not found"),
        (str(COCO_SUBSET / "annotations" / "captions_val2017.json"), "captions file"),
        (str(TRAIN_INSTANCES), "annotates none of the"),
    ],
)
def test_bad_instances_are_one_line_errors_before_captioning(tmp_path, capsys, instances, match):
    if "train2017" in instances and not COCO_TRAIN_MINI.is_dir():
        pytest.skip(f"COCO train2017 mini set not found at {COCO_TRAIN_MINI}")
    instances = instances.replace("{tmp}", str(tmp_path))
    rc, captured = run_evaluate(
        capsys, "coco", COCO_SUBSET, "val", instances, output=tmp_path / "r.json"
    )
    one_line_error(rc, captured, match)
    assert not (tmp_path / "r.json").exists()


def test_instances_with_flickr8k_is_a_usage_error(synthetic_flickr, tmp_path, capsys):
    rc, captured = run_evaluate(capsys, "flickr8k", synthetic_flickr, "dev", tmp_path / "i.json")
    one_line_error(rc, captured, "--instances needs COCO photos")


@needs_java
def test_instances_with_a_karpathy_flickr_split_is_a_usage_error(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "a.jpg")
    (tmp_path / "dataset_flickr8k.json").write_text(
        json.dumps(
            {"images": [{"filename": "a.jpg", "split": "test", "sentences": [{"raw": "a dog"}]}]}
        )
    )
    instances = write_instances(tmp_path / "i.json")
    rc, captured = run_evaluate(capsys, "karpathy", tmp_path, None, instances)
    one_line_error(rc, captured, "have no COCO ids")
