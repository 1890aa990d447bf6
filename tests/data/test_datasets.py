"""Dataset readers on the real files in ../shared and on small folders in each published format."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from helpers.data import COCO_SUBSET, FLICKR8K, needs_coco_subset, needs_flickr8k

from showattendtell.data.datasets import (
    DatasetError,
    MissingImagesError,
    SplitError,
    check_split_name,
    folder_hint,
    get_dataset,
    list_datasets,
    load_split,
    split_names,
)


@needs_coco_subset
def test_coco_val_subset_gives_the_40_present_images_and_counts_the_rest(caplog):
    with caplog.at_level(logging.WARNING):
        split = load_split("coco", COCO_SUBSET, "val")
    files = {p.name for p in (COCO_SUBSET / "images").glob("*.jpg")}
    assert len(files) == 40
    assert {im.path.name for im in split.images} == files
    assert len(split.images) == 40 and split.num_captions == 200
    assert all(len(im.captions) == 5 for im in split.images)
    assert all(
        im.image_id == str(im.coco_id) and int(im.path.stem) == im.coco_id for im in split.images
    )
    assert len(split.missing) == 4960 and split.num_annotated == 5000
    assert split.missing_captions == 25014 - 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "4960" in warnings[0] and "24814" in warnings[0]


@needs_coco_subset
def test_coco_test_split_needs_karpathy():
    with pytest.raises(DatasetError, match="dataset_coco.json"):
        load_split("coco", COCO_SUBSET, "test")


@needs_flickr8k
def test_flickr8k_official_split_sizes():
    sizes = {}
    for name in ("train", "dev", "test"):
        split = load_split("flickr8k", FLICKR8K, name)
        sizes[name] = split.num_annotated
        assert all(len(im.captions) == 5 for im in split.images)
    assert sizes == {"train": 6000, "dev": 1000, "test": 1000}
    train = load_split("flickr8k", FLICKR8K, "train")
    assert len(train.images) == 6000 and train.num_captions == 30000
    assert not {im.image_id for im in train.images} & {
        im.image_id for im in load_split("flickr8k", FLICKR8K, "dev").images
    }


@needs_flickr8k
def test_flickr8k_withheld_test_images_are_counted_and_refused():
    split = load_split("flickr8k", FLICKR8K, "test")
    assert split.images == [] and len(split.missing) == 1000
    assert split.missing_captions == 5000
    with pytest.raises(MissingImagesError) as e:
        split.require_images()
    assert str(FLICKR8K / "images") in str(e.value) and "1000 missing" in str(e.value)


def test_flickr8k_missing_files_are_skipped_with_one_warning(synthetic_flickr, tmp_path, caplog):
    root = tmp_path / "f8k"
    shutil.copytree(synthetic_flickr, root)
    gone = sorted((root / "images").glob("*.jpg"))[:3]
    for p in gone:
        p.unlink()
    with caplog.at_level(logging.WARNING):
        split = load_split("flickr8k", root, "train")
    assert len(split.images) == 21 and sorted(split.missing) == gone
    assert sum("skipped 3 of 24" in r.getMessage() for r in caplog.records) == 1


def _karpathy_json(synthetic_flickr, root, name="dataset_flickr8k.json"):
    train = (synthetic_flickr / "Flickr_8k.trainImages.txt").read_text().split()
    dev = (synthetic_flickr / "Flickr_8k.devImages.txt").read_text().split()
    images = [
        {
            "filename": n,
            "split": "train" if n in train else "val",
            "sentences": [{"raw": f"caption {k} of {n}", "tokens": []} for k in range(5)],
        }
        for n in train + dev
    ]
    images[0]["split"] = "test"
    images.append({"filename": "absent.jpg", "split": "test", "sentences": [{"raw": "gone"}]})
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(json.dumps({"dataset": "flickr8k", "images": images}))


def test_karpathy_format(synthetic_flickr, tmp_path):
    root = tmp_path / "flickr8k"
    shutil.copytree(synthetic_flickr / "images", root / "Flicker8k_Dataset")
    _karpathy_json(synthetic_flickr, root)
    train, val, test = (load_split("karpathy", root, s) for s in ("train", "val", "test"))
    assert (len(train.images), len(val.images), len(test.images)) == (23, 8, 1)
    assert [p.name for p in test.missing] == ["absent.jpg"]
    assert train.images[0].captions[0].startswith("caption 0 of ")
    assert train.images[0].image_id == train.images[0].path.name  # Flickr: the file name


def test_karpathy_picks_the_json_named_like_the_folder(synthetic_flickr, tmp_path):
    root = tmp_path / "flickr8k"
    shutil.copytree(synthetic_flickr / "images", root / "images")
    _karpathy_json(synthetic_flickr, root / "caption_datasets")
    (root / "caption_datasets" / "dataset_coco.json").write_text('{"images": []}')
    assert len(load_split("karpathy", root, "val").images) == 8
    other = tmp_path / "elsewhere"
    shutil.copytree(root, other)
    with pytest.raises(DatasetError, match="several Karpathy split files"):
        load_split("karpathy", other, "val")


def test_karpathy_coco_split_finds_the_2017_files_of_its_2014_names(tmp_path):
    """dataset_coco.json names the 2014 files (val2014/COCO_val2014_<id>.jpg); the 2017 folders
    hold the same photos as <12-digit id>.jpg, in train2017/ or val2017/ whatever the 2014 one."""
    for folder, cocoid in (("train2017", 9), ("val2017", 139), ("val2014", 42)):
        (tmp_path / folder).mkdir(exist_ok=True)
        name = f"COCO_val2014_{cocoid:012d}.jpg" if folder == "val2014" else f"{cocoid:012d}.jpg"
        (tmp_path / folder / name).write_bytes(b"")
    images = [
        {
            "filepath": "val2014",
            "filename": f"COCO_val2014_{i:012d}.jpg",
            "cocoid": i,
            "split": "test",
            "sentences": [{"raw": "a photo", "tokens": ["a", "photo"]}],
        }
        for i in (9, 139, 42, 7)
    ]
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"dataset": "coco", "images": images}))
    test = load_split("coco", tmp_path, "test")
    assert [str(im.path.relative_to(tmp_path)) for im in test.images] == [
        "train2017/000000000009.jpg",
        "val2017/000000000139.jpg",
        "val2014/COCO_val2014_000000000042.jpg",
    ]
    assert [im.coco_id for im in test.images] == [9, 139, 42] and len(test.missing) == 1


@pytest.mark.parametrize(
    ("dataset", "split", "match"),
    [
        ("flickr30k", "train", "unknown dataset"),
        ("flickr8k", "validation", "splits"),
        ("karpathy", "train", "no dataset_"),
        ("coco", "val", "sat data coco"),
    ],
)
def test_bad_requests_are_one_line_errors(tmp_path, dataset, split, match):
    with pytest.raises(DatasetError, match=match) as e:
        load_split(dataset, tmp_path, split)
    assert "\n" not in str(e.value)


def test_missing_root(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_split("flickr8k", tmp_path / "nope", "train")


def _flickr_copy(synthetic_flickr, tmp_path):
    root = tmp_path / "f8k"
    root.mkdir()
    for f in synthetic_flickr.iterdir():  # the images by link: only the text files change
        (root / f.name).symlink_to(f) if f.is_dir() else shutil.copy(f, root / f.name)
    return root


def test_flickr8k_malformed_token_lines_are_skipped_with_one_warning(
    synthetic_flickr, tmp_path, caplog
):
    root = _flickr_copy(synthetic_flickr, tmp_path)
    token = root / "Flickr8k.token.txt"
    lines = token.read_text().splitlines()
    name = lines[0].split("#")[0]
    bad = [f"{name}#9\tcaption\textra", f"{name}#x\t", f"{name}#5\t  ", f"{name} no tab"]
    token.write_text("\n".join(lines[:2] + bad + lines[2:]) + "\n")
    with caplog.at_level(logging.WARNING):
        split = load_split("flickr8k", root, "train")
    im = next(im for im in split.images if im.image_id == name)
    assert len(im.captions) == 5 and all(c.strip() and "\t" not in c for c in im.captions)
    warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 4 malformed lines" in warnings[0]
    assert "first: line 3" in warnings[0] and str(token) in warnings[0]


def test_flickr8k_token_file_not_utf8(synthetic_flickr, tmp_path):
    root = _flickr_copy(synthetic_flickr, tmp_path)
    token = root / "Flickr8k.token.txt"
    token.write_bytes(token.read_bytes().replace(b"\n", b"\n\xff caf\xe9\n", 1))
    with pytest.raises(DatasetError, match=r"Flickr8k.token.txt is not UTF-8 .*line 2") as e:
        load_split("flickr8k", root, "train")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "is not JSON"),
        ("[]", "not a Karpathy split file"),
        ('{"images": 5}', "not a Karpathy split file"),
        ('{"images": [{"filename": "a.jpg", "sentences": []}]}', r"images\[0\] has no str 'split'"),
        ('{"images": [{"filename": "a.jpg", "split": "train", "sentences": [{}]}]}', "'raw'"),
        ('{"images": [7]}', r"images\[0\] is a int"),
    ],
)
def test_a_damaged_karpathy_json_is_one_dataset_error(tmp_path, content, match):
    (tmp_path / "dataset_flickr8k.json").write_text(content)
    with pytest.raises(DatasetError, match=match) as e:
        load_split("karpathy", tmp_path, "train")
    assert "dataset_flickr8k.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "content",
    [
        '{"images": 5}',
        "{not json",
        "[]",
        '{"images": [{"id": 1}], "annotations": [{"image_id": 1}]}',
        b'{"images": [], "info": "\xff"}',
    ],
)
def test_a_damaged_coco_caption_file_is_one_dataset_error(tmp_path, content):
    ann = tmp_path / "annotations" / "captions_val2014.json"
    ann.parent.mkdir()
    ann.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DatasetError, match="is not a COCO caption file") as e:
        load_split("coco", tmp_path, "val")
    assert "captions_val2014.json" in str(e.value) and "\n" not in str(e.value)


def _registry_folder(dataset: str, synthetic_flickr, root):
    """A small folder of ``dataset``'s format made from the synthetic Flickr8k photos."""
    if dataset == "flickr8k":
        shutil.copytree(synthetic_flickr, root)
    elif dataset == "karpathy":
        shutil.copytree(synthetic_flickr / "images", root / "images")
        _karpathy_json(synthetic_flickr, root)
    elif dataset == "captions":  # a folder of photos and a captions.csv naming no split
        shutil.copytree(synthetic_flickr / "images", root / "images")
        names = sorted(p.name for p in (root / "images").iterdir())
        rows = [f"{name},a photo {i}" for i, name in enumerate(names)]
        (root / "captions.csv").write_text("image,caption\n" + "\n".join(rows) + "\n")
    else:  # coco: the official caption files, read by pycocotools
        pytest.importorskip("pycocotools")
        (root / "annotations").mkdir(parents=True)
        names = sorted(p.name for p in (synthetic_flickr / "images").iterdir())
        for split, part in (("train", names[:4]), ("val", names[4:6])):
            (root / f"{split}2014").mkdir()
            images, anns = [], []
            for i, name in enumerate(part, 1):
                shutil.copy(synthetic_flickr / "images" / name, root / f"{split}2014" / name)
                images.append({"id": i, "file_name": name, "width": 64, "height": 64})
                anns.append({"id": i, "image_id": i, "caption": f"a photo {i}"})
            data = {"images": images, "annotations": anns}
            (root / "annotations" / f"captions_{split}2014.json").write_text(json.dumps(data))
    return root


@pytest.mark.parametrize("dataset", list_datasets())
def test_every_registered_dataset_reads_the_splits_its_entry_names(
    dataset, synthetic_flickr, tmp_path
):
    """The registry's entry is the dataset: each split name it gives for a folder of its
    format loads, a name it does not give is a one-line usage error listing them, and the
    folder hint says what the folder holds."""
    fmt = get_dataset(dataset)
    root = _registry_folder(dataset, synthetic_flickr, tmp_path / dataset)
    names = split_names(dataset, root)
    assert names
    for name in names:
        split = load_split(dataset, root, name)
        assert all(im.path.is_file() and im.captions for im in split.images)
    assert any(load_split(dataset, root, name).images for name in names)
    with pytest.raises(SplitError) as e:
        check_split_name("--split", dataset, root, "no-such-split")
    assert all(n in str(e.value) for n in names) and "\n" not in str(e.value)
    assert folder_hint(dataset, root).startswith(fmt.folder)


def test_an_unknown_dataset_lists_the_registered_ones(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_split("flickr30k", tmp_path, "train")
    assert all(name in str(e.value) for name in list_datasets())
