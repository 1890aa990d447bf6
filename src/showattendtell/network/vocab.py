"""Caption tokenisation and the word <-> index vocabulary saved with every model."""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# The special tokens' indices, the same in every vocabulary (the search and the losses use them),
# and their words at those indices.
PAD, START, END, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<start>", "<end>", "<unk>")

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


@functools.cache
def _treebank():
    """nltk's Treebank tokenizer (it needs no downloaded data, unlike word_tokenize), made on
    first use: importing nltk takes a noticeable part of `sat caption`'s start-up, which
    never tokenizes."""
    from nltk.tokenize import TreebankWordTokenizer

    return TreebankWordTokenizer()


def tokenize(caption: str) -> list[str]:
    """Lower-case Penn-Treebank tokens with punctuation stripped, as the COCO toolkit does."""
    tokens = _treebank().tokenize(caption.lower().replace("\n", " "))
    return [t for t in tokens if t not in PUNCTUATION and not all(c in ".-" for c in t)]


class Vocabulary:
    """Maps words to indices; indices 0..3 are <pad> <start> <end> <unk>."""

    def __init__(self, words: Iterable[str]):
        self.itos: list[str] = list(words)
        if tuple(self.itos[:4]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("a vocabulary must not repeat words")

    pad = property(lambda self: PAD)
    start = property(lambda self: START)
    end = property(lambda self: END)
    unk = property(lambda self: UNK)

    def __len__(self) -> int:
        return len(self.itos)

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 5) -> Vocabulary:
        """Words seen at least ``min_count`` times, most frequent first (ties alphabetical)."""
        counts = Counter(tok for c in captions for tok in tokenize(c))
        words = sorted(
            (w for w, n in counts.items() if n >= min_count and w not in SPECIALS),
            key=lambda w: (-counts[w], w),
        )
        return cls([*SPECIALS, *words])

    def encode(self, caption: str) -> list[int]:
        """``<start> w1 .. wn <end>`` as indices; unknown words map to ``<unk>``."""
        return [self.start, *(self.stoi.get(t, self.unk) for t in tokenize(caption)), self.end]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words up to the first ``<end>``, specials dropped."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.end:
                break
            if i >= len(SPECIALS):
                words.append(self.itos[i])
            elif i == self.unk:
                words.append(SPECIALS[UNK])
        return words

    def to_json(self) -> str:
        return json.dumps(self.itos, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Vocabulary:
        return cls(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
