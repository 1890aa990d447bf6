"""--data.tokenizer: English PTB as before, a Unicode tokenizer for other languages, and the
vocabulary that names its tokenizer (a word list without one is PTB English)."""

import json

import pytest

from showattendtell.network.tokenizers import (
    TokenizerError,
    get_tokenizer,
    list_tokenizers,
    unicode_detokenize,
    unicode_tokenize,
)
from showattendtell.network.vocab import Vocabulary, tokenize


def test_ptb_is_the_default_and_tokenises_as_before():
    v = Vocabulary.build(["A dog's ball, on the GRASS ."], min_count=1)
    assert v.tokenizer == "ptb" and v.english
    assert v.tokenize("A dog's ball, on the GRASS .") == tokenize("A dog's ball, on the GRASS .")
    assert v.detokenize(["a", "dog", "'s", "ball"]) == "a dog 's ball"


def test_unicode_words_keep_letters_of_any_alphabet_and_drop_punctuation():
    assert unicode_tokenize("Ein grüner Kreis, über DER Straße!") == [
        "ein",
        "grüner",
        "kreis",
        "über",
        "der",
        "straße",
    ]
    # combining marks belong to their word (Devanagari), full-width Latin is normalised (NFKC)
    assert unicode_tokenize("कुत्ता गेंद") == ["कुत्ता", "गेंद"]
    assert unicode_tokenize("ＡＢＣ　犬") == ["abc", "犬"]
    assert unicode_tokenize("Собака бежит.") == ["собака", "бежит"]


def test_unicode_makes_each_character_of_unspaced_scripts_a_token():
    assert unicode_tokenize("赤い丸と青い四角。「ボール」、") == [
        *"赤い丸と青い四角",
        *"ボール",  # the prolonged sound mark counts with katakana
    ]
    assert unicode_tokenize("犬がfrisbeeを追う") == ["犬", "が", "frisbee", "を", "追", "う"]


@pytest.mark.parametrize(
    ("caption", "written"),
    [
        ("赤い丸と 青い四角。", "赤い丸と青い四角"),
        ("Ein grüner Kreis.", "ein grüner kreis"),
        ("犬が frisbee を追う", "犬がfrisbeeを追う"),
        ("สุนัขวิ่ง", "สุนัขวิ่ง"),
    ],
)
def test_unicode_detokenises_as_the_language_writes_and_gives_the_tokens_back(caption, written):
    tokens = unicode_tokenize(caption)
    assert unicode_detokenize(tokens) == written
    assert unicode_tokenize(unicode_detokenize(tokens)) == tokens


def test_an_unknown_tokenizer_is_one_line_naming_the_registered_ones():
    with pytest.raises(TokenizerError) as e:
        get_tokenizer("mecab")
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in list_tokenizers())
    with pytest.raises(TokenizerError):
        Vocabulary.build(["a b"], min_count=1, tokenizer="mecab")


def test_a_vocabulary_stores_its_tokenizer_and_a_word_list_is_ptb(tmp_path):
    ja = Vocabulary.build(["赤い丸", "青い丸"], min_count=1, tokenizer="unicode")
    assert set(ja.itos[4:6]) == {"い", "丸"} and not ja.english  # the most frequent
    assert ja.encode("赤い丸") == [ja.start, *(ja.stoi[c] for c in "赤い丸"), ja.end]
    assert ja.detokenize(ja.decode(ja.encode("青い丸")[1:])) == "青い丸"
    stored = json.loads(ja.to_json())
    assert stored == {"tokenizer": "unicode", "words": ja.itos}
    ja.save(tmp_path / "v.json")
    again = Vocabulary.load(tmp_path / "v.json")
    assert again.tokenizer == "unicode" and again.itos == ja.itos
    # PTB vocabularies keep the word-list format every earlier version reads and writes
    en = Vocabulary.build(["a dog"], min_count=1)
    assert json.loads(en.to_json()) == en.itos
    assert Vocabulary.from_json(json.dumps(en.itos)).tokenizer == "ptb"


def test_a_vocabulary_of_a_tokenizer_this_package_lacks_says_upgrade():
    with pytest.raises(ValueError, match="upgrade"):
        Vocabulary.from_json(json.dumps({"tokenizer": "future", "words": ["<pad>"]}))
    with pytest.raises(ValueError, match="word list"):
        Vocabulary.from_json(json.dumps({"tokenizer": "unicode"}))
