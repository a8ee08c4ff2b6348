"""Vocabulary: fixed special ids, deterministic frequency order, encoding, hashing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from nlmserve.lm.vocab import BOS_ID, EOS_ID, UNK_ID, Vocabulary


def test_special_ids_are_fixed() -> None:
    v = Vocabulary(["the", "</s>", "cat", "<unk>"])
    assert (UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert v.words == ["<unk>", "<s>", "</s>", "the", "cat"]
    assert [v.id(w) for w in ("<unk>", "<s>", "</s>", "the", "cat")] == [0, 1, 2, 3, 4]
    assert len(v) == 5


def test_unknown_words_map_to_unk() -> None:
    v = Vocabulary(["the"])
    assert v.id("dog") == UNK_ID
    assert "dog" not in v and "the" in v
    assert v.encode(["the", "dog", "</s>"]).tolist() == [3, 0, 2]
    assert v.encode(["the"]).dtype == np.uint32
    assert v.encode([]).shape == (0,)


def test_build_sorts_by_frequency_then_word() -> None:
    counts = Counter({"b": 3, "a": 3, "c": 5, "d": 1, "e": 2})
    v = Vocabulary.build(counts)
    assert v.words[3:] == ["c", "a", "b", "e", "d"]
    assert Vocabulary.build(counts, min_count=2).words[3:] == ["c", "a", "b", "e"]
    assert Vocabulary.build(counts, max_vocab=5).words[3:] == ["c", "a"]


def test_build_is_deterministic_and_hash_identifies_mapping() -> None:
    counts = Counter("the cat sat on the mat the end".split())
    v1 = Vocabulary.build(counts)
    v2 = Vocabulary.build(Counter(dict(reversed(list(counts.items())))))
    assert v1 == v2 and v1.sha256() == v2.sha256()
    assert Vocabulary(["x", "y"]).sha256() != Vocabulary(["y", "x"]).sha256()


def test_word_out_of_range_and_duplicates() -> None:
    v = Vocabulary(["a"])
    assert v.word(3) == "a"
    with pytest.raises(IndexError):
        v.word(4)
    with pytest.raises(ValueError, match="duplicate"):
        Vocabulary(["a", "b", "a"])
    with pytest.raises(ValueError):
        Vocabulary.build(Counter(a=1), min_count=0)
