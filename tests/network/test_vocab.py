import pytest

from showattendtell.network.vocab import SPECIALS, Vocabulary, tokenize


def test_tokenize_lowercases_and_strips_punctuation_like_coco():
    assert tokenize("A dog's ball, on the GRASS .") == [
        "a",
        "dog",
        "'s",
        "ball",
        "on",
        "the",
        "grass",
    ]
    assert tokenize("Two men -- playing...") == ["two", "men", "playing"]


def test_build_respects_min_count_and_specials():
    v = Vocabulary.build(["a dog runs", "a dog sits", "a cat"], min_count=2)
    assert v.itos[:4] == list(SPECIALS)
    assert v.itos[4:] == ["a", "dog"]
    assert v.encode("A dog flies.") == [v.start, v.stoi["a"], v.stoi["dog"], v.unk, v.end]
    assert v.decode([v.stoi["a"], v.stoi["dog"], v.end, v.stoi["a"]]) == ["a", "dog"]


def test_json_round_trip_and_validation(tmp_path):
    v = Vocabulary.build(["a b c", "a b"], min_count=1)
    v.save(tmp_path / "v.json")
    assert Vocabulary.load(tmp_path / "v.json").itos == v.itos
    with pytest.raises(ValueError):
        Vocabulary(["a", "b"])
