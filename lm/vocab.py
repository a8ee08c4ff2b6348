"""The vocabulary: words <-> ids with fixed special ids (as KenLM).

``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2 (defined with the other n-gram rules in
``nlmserve.wire.ngrams``, re-exported here); the other words follow in the order given (for
:meth:`Vocabulary.build`: by decreasing frequency, ties broken by the word itself, so the
same counts always give the same ids).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..wire.ngrams import BOS, BOS_ID, EOS, EOS_ID, UNK, UNK_ID

SPECIALS = (UNK, BOS, EOS)

__all__ = ["BOS", "BOS_ID", "EOS", "EOS_ID", "SPECIALS", "UNK", "UNK_ID", "Vocabulary"]


class Vocabulary:
    """An immutable word list; ``id(word)`` maps unknown words to ``<unk>``.

    ``words`` may or may not start with the three special tokens: they are put first
    (in their fixed order) and not repeated. Duplicate words are an error.
    """

    __slots__ = ("_words", "_index")

    def __init__(self, words: Iterable[str]) -> None:
        given = [w for w in words if w not in SPECIALS]
        self._words: list[str] = list(SPECIALS) + given
        self._index: dict[str, int] = {w: i for i, w in enumerate(self._words)}
        if len(self._index) != len(self._words):
            dups = sorted(w for w, c in Counter(self._words).items() if c > 1)
            raise ValueError(f"duplicate words in vocabulary: {dups[:5]!r}")

    @classmethod
    def build(
        cls, counts: Mapping[str, int] | Counter[str], *, min_count: int = 1, max_vocab: int | None = None
    ) -> "Vocabulary":
        """Words with ``count >= min_count``, most frequent first (ties: by word).

        ``max_vocab`` bounds the size *including* the three special tokens.
        """
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        kept = [(w, c) for w, c in counts.items() if c >= min_count and w not in SPECIALS]
        kept.sort(key=lambda wc: (-wc[1], wc[0]))
        if max_vocab is not None:
            if max_vocab < len(SPECIALS) + 1:
                raise ValueError(f"max_vocab must be at least {len(SPECIALS) + 1}, got {max_vocab}")
            kept = kept[: max_vocab - len(SPECIALS)]
        return cls(w for w, _ in kept)

    def __len__(self) -> int:
        return len(self._words)

    def __contains__(self, word: object) -> bool:
        return word in self._index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self._words == other._words

    def __hash__(self) -> int:
        return hash(self.sha256())

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} words)"

    @property
    def words(self) -> list[str]:
        """All words in id order (a copy)."""
        return list(self._words)

    @property
    def index(self) -> Mapping[str, int]:
        """word → id (a read-only view)."""
        return MappingProxyType(self._index)

    def id(self, word: str) -> int:
        """The id of ``word``; ``UNK_ID`` when it is not in the vocabulary."""
        return self._index.get(word, UNK_ID)

    def word(self, i: int) -> str:
        """The word of id ``i`` (IndexError when out of range)."""
        if not 0 <= i < len(self._words):
            raise IndexError(f"word id {i} out of range [0, {len(self._words)})")
        return self._words[i]

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        """Ids of ``tokens`` as a uint32 array (unknown words → ``<unk>``)."""
        get = self._index.get
        return np.fromiter((get(t, UNK_ID) for t in tokens), dtype=np.uint32, count=len(tokens))

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.word(int(i)) for i in ids]

    def sha256(self) -> str:
        """Hex digest of the word list (one word per line, UTF-8): identifies the id mapping."""
        return hashlib.sha256("\n".join(self._words).encode("utf-8")).hexdigest()
