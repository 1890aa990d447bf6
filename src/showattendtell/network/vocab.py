"""The word <-> index vocabulary saved with every model, and the tokenizer its words came from.

A vocabulary of the default ``ptb`` tokenizer is stored as a JSON word list (as every model
file before tokenizers were a choice, which therefore load as English PTB); one of another
tokenizer as ``{"tokenizer": NAME, "words": [...]}`` (tokenizers.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from showattendtell.network.tokenizers import (
    DEFAULT_TOKENIZER,
    PUNCTUATION,  # noqa: F401 - where the rest of the package has always found it
    Tokenizer,
    TokenizerError,
    get_tokenizer,
    ptb_tokenize,
)

# The special tokens' indices, the same in every vocabulary (the search and the losses use them),
# and their words at those indices.
PAD, START, END, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<start>", "<end>", "<unk>")


def tokenize(caption: str) -> list[str]:
    """Lower-case Penn-Treebank tokens with punctuation stripped, as the COCO toolkit does (the
    ``ptb`` tokenizer; a Vocabulary tokenises with its own, ``Vocabulary.tokenize``)."""
    return ptb_tokenize(caption)


class Vocabulary:
    """Maps words to indices; indices 0..3 are <pad> <start> <end> <unk>. ``tokenizer``: the
    registered tokenizer (tokenizers.py) that splits captions into its words and joins them."""

    def __init__(self, words: Iterable[str], tokenizer: str = DEFAULT_TOKENIZER):
        self.tokenizer: str = tokenizer
        self._tokenizer: Tokenizer = get_tokenizer(tokenizer)
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
    def build(
        cls, captions: Iterable[str], min_count: int = 5, tokenizer: str = DEFAULT_TOKENIZER
    ) -> Vocabulary:
        """Words seen at least ``min_count`` times, most frequent first (ties alphabetical)."""
        split = get_tokenizer(tokenizer).tokenize
        counts = Counter(tok for c in captions for tok in split(c))
        words = sorted(
            (w for w, n in counts.items() if n >= min_count and w not in SPECIALS),
            key=lambda w: (-counts[w], w),
        )
        return cls([*SPECIALS, *words], tokenizer)

    def tokenize(self, caption: str) -> list[str]:
        """The caption's tokens, as this vocabulary's tokenizer splits it."""
        return self._tokenizer.tokenize(caption)

    def detokenize(self, words: list[str]) -> str:
        """The caption ``words`` make, as the language writes it (spaces or none)."""
        return self._tokenizer.detokenize(list(words))

    @property
    def english(self) -> bool:
        """Whether its tokens are English PTB tokens (the official COCO toolkit applies)."""
        return self._tokenizer.english

    def encode(self, caption: str) -> list[int]:
        """``<start> w1 .. wn <end>`` as indices; unknown words map to ``<unk>``."""
        ids = (self.stoi.get(t, self.unk) for t in self.tokenize(caption))
        return [self.start, *ids, self.end]

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
        """A word list for ``ptb`` (the format every earlier version reads), else an object
        that names the tokenizer."""
        if self.tokenizer == DEFAULT_TOKENIZER:
            return json.dumps(self.itos, ensure_ascii=False)
        return json.dumps({"tokenizer": self.tokenizer, "words": self.itos}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Vocabulary:
        """Either form of ``to_json``; a word list is a ``ptb`` vocabulary. An unknown
        tokenizer is a ValueError (a newer package's model: upgrade)."""
        data = json.loads(text)
        if isinstance(data, list):
            return cls(data)
        if not (isinstance(data, dict) and isinstance(data.get("words"), list)):
            raise ValueError("a vocabulary is a word list or an object with 'words'")
        name = data.get("tokenizer", DEFAULT_TOKENIZER)
        try:
            return cls(data["words"], name)
        except TokenizerError:
            raise ValueError(
                f"its tokenizer {name!r} is not one this showattendtell has: upgrade the package"
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
