"""How captions become tokens and tokens become a caption again: the ``--data.tokenizer`` choice.

A model is trained on one tokenizer's tokens, and its vocabulary (model_file.py) names that
tokenizer, so that captioning joins the words as the language writes them and evaluation scores
on the same tokens:

- ``ptb`` (the default, and what a vocabulary that names none uses): English as the COCO caption
  toolkit tokenises it: lower case, Penn Treebank tokens, punctuation removed. Captions are the
  tokens joined by spaces.
- ``unicode``: for other languages. Text is NFKC-normalised and lower-cased; a token is a run of
  Unicode word characters (letters, marks, digits: ``\\w`` in Unicode), punctuation is dropped.
  Scripts written without spaces between words (Chinese, Japanese kana and kanji, Thai, Lao,
  Khmer, Myanmar, Tibetan) have no word segmentation here: each of their characters is one
  token, and captioning joins such tokens without a space. German, French, Russian, Hindi,
  Korean and other space-separated languages get words.

A new tokenizer is one ``register_tokenizer`` call.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from showattendtell.errors import UsageError
from showattendtell.registry import Registry

DEFAULT_TOKENIZER = "ptb"

# The punctuation tokens the COCO caption toolkit (pycocoevalcap's PTBTokenizer) removes.
PUNCTUATION = {
    "''",
    "'",
    "``",
    "`",
    "-lrb-",
    "-rrb-",
    "-lcb-",
    "-rcb-",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ".",
    "?",
    "!",
    ",",
    ":",
    "-",
    "--",
    "...",
    ";",
    '"',
}


class TokenizerError(UsageError, ValueError):
    """An unknown tokenizer name; the message lists the registered ones."""


@dataclass(frozen=True)
class Tokenizer:
    """One way of splitting captions into tokens and joining them back."""

    name: str  # the --data.tokenizer value, stored in the vocabulary of a model
    tokenize: Callable[[str], list[str]]
    detokenize: Callable[[list[str]], str]
    # English PTB tokens: the official toolkit (its Java PTB tokenizer, METEOR, SPICE) applies
    english: bool = False


_TOKENIZERS: Registry[Tokenizer] = Registry(
    "tokenizer",
    lambda name, names: TokenizerError(
        f"unknown tokenizer {name!r}: choose one of {', '.join(names)}"
    ),
)
register_tokenizer = _TOKENIZERS.register
get_tokenizer = _TOKENIZERS.find  # the tokenizer, or a TokenizerError listing the registered ones


def list_tokenizers() -> list[str]:
    return list(_TOKENIZERS)


# -- ptb: English as the COCO caption toolkit tokenises it ---------------------------------------


@functools.cache
def _treebank():
    """nltk's Treebank tokenizer (it needs no downloaded data, unlike word_tokenize), made on
    first use: importing nltk takes a noticeable part of `sat caption`'s start-up, which
    never tokenizes."""
    from nltk.tokenize import TreebankWordTokenizer

    return TreebankWordTokenizer()


def ptb_tokenize(caption: str) -> list[str]:
    """Lower-case Penn-Treebank tokens with punctuation stripped, as the COCO toolkit does."""
    tokens = _treebank().tokenize(caption.lower().replace("\n", " "))
    return [t for t in tokens if t not in PUNCTUATION and not all(c in ".-" for c in t)]


def join_with_spaces(tokens: list[str]) -> str:
    return " ".join(tokens)


# -- unicode: words of any script; characters of scripts written without spaces ------------------

# Scripts written without spaces between words, by Unicode's script extensions (so that the
# katakana-hiragana prolonged sound mark and the iteration marks count with their scripts).
_UNSPACED = "".join(
    rf"\p{{scx={s}}}"
    for s in ("Han", "Hiragana", "Katakana", "Thai", "Lao", "Khmer", "Myanmar", "Tibetan")
)


@functools.cache
def _patterns():
    """(a token, an unspaced character). The ``regex`` package (nltk's own dependency), not
    ``re``: ``re`` has no Unicode script properties, which would mean tables of code-point
    ranges kept by hand; ``regex`` also counts combining marks as word characters, so words of
    Indic scripts stay whole."""
    import regex

    unspaced = rf"[\w&&[{_UNSPACED}]]"  # their punctuation (。、「」) is no token
    token = regex.compile(rf"{unspaced}|[\w--[{_UNSPACED}]]+", regex.VERSION1)
    return token, regex.compile(unspaced, regex.VERSION1)


def unicode_tokenize(caption: str) -> list[str]:
    """NFKC-normalised, lower-cased runs of word characters; each character of a script
    written without spaces is a token of its own."""
    token, _ = _patterns()
    return token.findall(unicodedata.normalize("NFKC", caption).lower())


def unicode_detokenize(tokens: list[str]) -> str:
    """The tokens joined by spaces, except next to a token of a script written without spaces
    ("犬 が 走る" is written "犬が走る"); ``unicode_tokenize`` gives the tokens back."""
    _, unspaced = _patterns()
    out: list[str] = []
    for tok in tokens:
        if out and not (unspaced.fullmatch(out[-1][-1]) or unspaced.fullmatch(tok[0])):
            out.append(" ")
        out.append(tok)
    return "".join(out)


register_tokenizer(Tokenizer("ptb", ptb_tokenize, join_with_spaces, english=True))
register_tokenizer(Tokenizer("unicode", unicode_tokenize, unicode_detokenize))
