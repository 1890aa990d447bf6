"""The captions dataset format: a folder of photos and a captions.csv or captions.jsonl."""

import json
import logging

import pytest
from PIL import Image

from showattendtell.data.datasets import (
    DatasetError,
    MissingImagesError,
    SplitError,
    check_split_name,
    load_split,
    split_names,
)


def _photos(root, n: int, folder: str = "photos") -> list[str]:
    (root / folder).mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(root / folder / f"{i:02d}.png")
        names.append(f"{folder}/{i:02d}.png")
    return names


def test_csv_with_a_split_column_and_several_captions_a_photo(tmp_path):
    names = _photos(tmp_path, 4)
    rows = ["\ufeffImage,Caption,Split"]  # a byte-order mark and capitals, as spreadsheets write
    for i, name in enumerate(names):
        split = "train" if i < 3 else "val"
        rows += [f'{name},"Ein Hund, der läuft {i}",{split}', f"{name},Ein Kreis {i},{split}"]
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    train = load_split("captions", tmp_path, "train")
    assert [im.image_id for im in train.images] == names[:3]
    assert train.images[0].captions == ["Ein Hund, der läuft 0", "Ein Kreis 0"]
    assert train.images[0].path == tmp_path / names[0]
    # the file names val only: dev is the same split (the training settings' default name)
    assert set(split_names("captions", tmp_path)) == {"train", "val", "dev"}
    assert [im.image_id for im in load_split("captions", tmp_path, "dev").images] == names[3:]
    with pytest.raises(SplitError, match="train, val, dev"):
        check_split_name("--split", "captions", tmp_path, "test")


def test_jsonl_split_by_ratio_is_fixed_by_the_photo_names(tmp_path):
    names = _photos(tmp_path, 12, folder="images")
    lines = [
        json.dumps({"image": name.removeprefix("images/"), "caption": [f"猫 {i}", f"犬 {i}"]})
        for i, name in enumerate(names)
    ]
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert split_names("captions", tmp_path) == ["train", "val", "test", "dev"]
    got = {s: load_split("captions", tmp_path, s) for s in ("train", "val", "test")}
    assert [len(got[s].images) for s in got] == [10, 1, 1]  # 0.8 by default
    assert all(im.path.is_file() and len(im.captions) == 2 for s in got.values() for im in s.images)
    halves = {s: load_split("captions", tmp_path, s, split_ratio=0.5) for s in ("train", "test")}
    assert [len(halves[s].images) for s in halves] == [6, 3]
    # the same photos whatever order the file lists them in
    (tmp_path / "captions.jsonl").write_text("\n".join(reversed(lines)) + "\n", encoding="utf-8")
    again = load_split("captions", tmp_path, "test", split_ratio=0.5)
    assert {im.image_id for im in again.images} == {im.image_id for im in halves["test"].images}


def test_a_missing_photo_is_skipped_with_a_warning_and_none_is_an_error(tmp_path, caplog):
    names = _photos(tmp_path, 2)
    rows = ["image,caption,split", f"{names[0]},a,train", "photos/gone.png,b,train"]
    rows += ["photos/also-gone.png,c,val"]
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        train = load_split("captions", tmp_path, "train")
    assert [im.image_id for im in train.images] == [names[0]]
    assert "skipped 1 of 2" in caplog.text and "the first: photos/gone.png" in caplog.text
    with pytest.raises(MissingImagesError, match="put the image files there") as e:
        load_split("captions", tmp_path, "val").require_images()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("captions.csv", "", "is empty: write a header line image,caption"),
        ("captions.csv", "\n\n", "is empty"),
        ("captions.csv", "photo,text\na.png,x\n", "no 'image' or 'caption' column"),
        ("captions.csv", "image,text\na.png,x\n", "no 'caption' column .*image,caption"),
        ("captions.csv", "image,caption\n", "holds no caption: add a row per caption"),
        ("captions.csv", "image,caption\na.png, \n", "holds no caption"),
        ("captions.csv", "image,caption,split\na.png,x\n", "line 2: 2 fields.*quote a caption"),
        ("captions.csv", "image,caption\n,x\n", "line 2: no image named"),
        ("captions.csv", "image,caption,split\na.png,x,\n", "line 2: no split named"),
        (
            "captions.csv",
            "image,caption,split\na.png,x,train\na.png,y,test\n",
            "line 3: a.png is in split 'test' here and 'train'",
        ),
        ("captions.csv", b"image,caption\na.png,\xff\n", "not UTF-8 text .* line 2"),
        ("captions.jsonl", '{"image": "a.png"}\n', 'line 1: not an object with "image"'),
        ("captions.jsonl", "{oops\n", "line 1: not JSON"),
        ("captions.jsonl", '{"image": "a.png", "caption": 5}\n', '"caption" a string or a list'),
        ("captions.jsonl", '{"image": "a", "caption": "b", "split": 1}\n', '"split" must be'),
    ],
)
def test_a_bad_captions_file_is_one_line_saying_what_to_do(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DatasetError, match=match) as e:
        load_split("captions", tmp_path, "train")
    assert "\n" not in str(e.value)


def test_a_folder_without_or_with_two_captions_files_says_what_to_write(tmp_path):
    with pytest.raises(DatasetError, match="no captions.csv or captions.jsonl") as e:
        load_split("captions", tmp_path, "train")
    assert "image,caption" in str(e.value) and "docs/training.md" in str(e.value)
    (tmp_path / "captions.csv").write_text("image,caption\na.png,x\n")
    (tmp_path / "captions.jsonl").write_text('{"image": "a.png", "caption": "x"}\n')
    with pytest.raises(DatasetError, match="both captions.csv and captions.jsonl"):
        load_split("captions", tmp_path, "train")


def test_split_ratio_is_for_files_without_splits_and_between_0_and_1(tmp_path, synthetic_flickr):
    (tmp_path / "captions.csv").write_text("image,caption,split\na.png,x,train\n")
    with pytest.raises(DatasetError, match="split column and a split ratio"):
        load_split("captions", tmp_path, "train", split_ratio=0.5)
    (tmp_path / "captions.csv").write_text("image,caption\na.png,x\n")
    for bad in (0, 1, 1.5, -0.2):
        with pytest.raises(SplitError, match="between 0 and 1"):
            load_split("captions", tmp_path, "train", split_ratio=bad)
    with pytest.raises(SplitError, match="flickr8k names its own splits"):
        load_split("flickr8k", synthetic_flickr, "train", split_ratio=0.5)


def test_the_datamodule_builds_the_vocabulary_with_its_tokenizer(tmp_path):
    from showattendtell.data.datamodule import CaptionDataModule
    from showattendtell.network.tokenizers import TokenizerError
    from showattendtell.network.vocab import Vocabulary

    names = _photos(tmp_path, 4)
    rows = [json.dumps({"image": n, "caption": "赤い丸と青い四角。"}) for n in names]
    (tmp_path / "captions.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    dm = CaptionDataModule("captions", str(tmp_path), min_word_count=1, tokenizer="unicode")
    assert dm.vocab.tokenizer == "unicode" and set(dm.vocab.itos[4:]) == set("赤い丸と青い四角")
    # a vocabulary file of another tokenizer than the run's is refused, in one line
    dm.vocab.save(tmp_path / "vocab.json")
    ptb = CaptionDataModule("captions", str(tmp_path), vocab_file=str(tmp_path / "vocab.json"))
    with pytest.raises(TokenizerError, match="train with --data.tokenizer unicode"):
        ptb.vocab  # noqa: B018
    Vocabulary(dm.vocab.itos).save(tmp_path / "words.json")  # a plain word list takes the run's
    words = CaptionDataModule(
        "captions", str(tmp_path), vocab_file=str(tmp_path / "words.json"), tokenizer="unicode"
    )
    assert words.vocab.tokenizer == "unicode" and words.vocab.itos == dm.vocab.itos
