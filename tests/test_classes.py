"""lm.classes: frequency binning, the exchange algorithm, wcluster files, serialisation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nlmserve.common.errors import InputError, ModelFileError
from nlmserve.lm.classes import (
    ExchangeConfig,
    WordClasses,
    brown_clusters,
    class_bigram_log_likelihood,
    default_num_classes,
    exchange,
    frequency_binning,
    load_wcluster,
    save_wcluster,
)
from nlmserve.lm.corpus import CorpusIds
from nlmserve.lm.vocab import BOS_ID, Vocabulary


def assert_partition(wc: WordClasses, vocab_size: int, num_classes: int) -> None:
    """Every word id in exactly one class, classes 0..K-1, none empty, derived views agree."""
    assert wc.word_class.shape == (vocab_size,) and wc.word_class.dtype == np.int64
    assert wc.num_classes == num_classes
    assert sorted(wc.order.tolist()) == list(range(vocab_size))
    assert np.all(wc.class_sizes > 0) and wc.class_sizes.sum() == vocab_size
    for c in range(num_classes):
        members = wc.order[wc.offsets[c] : wc.offsets[c + 1]]
        assert np.all(wc.word_class[members] == c)
        assert wc.pos_in_class[members].tolist() == list(range(members.size))
    if vocab_size > BOS_ID:
        assert 0 <= wc.word_class[BOS_ID] < num_classes


# ----------------------------------------------------------------------------- the dataclass


def test_derived_views_golden() -> None:
    wc = WordClasses(np.array([2, 0, 2, 1, 1, 2]), "frequency")
    assert wc.num_classes == 3
    assert wc.class_sizes.tolist() == [1, 2, 3]
    assert wc.order.tolist() == [1, 3, 4, 0, 2, 5]
    assert wc.offsets.tolist() == [0, 1, 3, 6]
    assert wc.pos_in_class.tolist() == [0, 0, 1, 0, 1, 2]
    assert wc.words_of(2).tolist() == [0, 2, 5]
    with pytest.raises(ValueError):
        wc.word_class[0] = 1  # read-only


@pytest.mark.parametrize("bad", [[0, 2, 2], [1, 1], [-1, 0], [], [0.0, 1.5]])
def test_constructor_rejects_non_partitions(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        WordClasses(np.array(bad), "brown")


def test_json_round_trip_and_validation() -> None:
    wc = WordClasses(np.array([2, 0, 2, 1, 1, 2]), "brown")
    d = wc.to_json()
    assert d == {"method": "brown", "num_classes": 3, "word_class": [2, 0, 2, 1, 1, 2]}
    back = WordClasses.from_json(d, vocab_size=6)
    assert back == wc and back.sha256() == wc.sha256()
    bad_docs = [
        {"method": "brown", "num_classes": 3, "word_class": [2, 0, 2, 2, 2, 2]},  # class 1 empty
        {"method": "brown", "word_class": [0, 1, 1.5]},
        {"method": "nonsense", "word_class": [0, 1]},
        {"word_class": [0, 1]},
        {"method": "brown", "num_classes": 4, "word_class": [0, 1, 2]},
        {"method": "brown", "word_class": "012"},
    ]
    for doc in bad_docs:
        with pytest.raises(ModelFileError):
            WordClasses.from_json(doc)
    with pytest.raises(ModelFileError, match="vocabulary of 7"):
        WordClasses.from_json(d, vocab_size=7)


def test_default_num_classes() -> None:
    assert default_num_classes(1) == 1
    assert default_num_classes(10_000) == 100
    assert default_num_classes(20_834) == round(math.sqrt(20_834)) == 144
    assert default_num_classes(3) == 2


# ----------------------------------------------------------------------------- frequency binning


def test_frequency_binning_golden() -> None:
    # ids 0..5 with counts; by decreasing count: 1(6) 4(3) 3(2) 0(1) 2(1) 5(1), total 14.
    # mass before each: 0 6 9 11 12 13 → floor(3·m/14) = 0 1 1 2 2 2
    wc = frequency_binning(np.array([1, 6, 1, 2, 3, 1]), 3)
    assert wc.word_class.tolist() == [2, 0, 2, 1, 1, 2]
    assert wc.method == "frequency"
    masses = np.bincount(wc.word_class, weights=[1, 6, 1, 2, 3, 1])
    assert masses.tolist() == [6, 5, 3]


def test_frequency_binning_sqrt_golden() -> None:
    counts = np.array([16, 4, 4, 1])
    # sqrt masses 4 2 2 1 (total 9): before 0 4 6 8 → floor(2·m/9) = 0 0 1 1
    assert frequency_binning(counts, 2, sqrt=True).word_class.tolist() == [0, 0, 1, 1]
    # plain masses (total 25): before 0 16 20 24 → 0 1 1 1
    assert frequency_binning(counts, 2).word_class.tolist() == [0, 1, 1, 1]


def test_frequency_binning_fills_every_class() -> None:
    # one dominant word would leave classes empty in a plain mass cut
    assert frequency_binning(np.array([100, 1, 1, 1]), 4).word_class.tolist() == [0, 1, 2, 3]
    assert frequency_binning(np.zeros(5), 3).word_class.tolist() == [0, 0, 0, 1, 2]
    with pytest.raises(ValueError):
        frequency_binning(np.ones(3), 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=60), st.data())
def test_frequency_binning_partition_property(counts: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(counts)))
    wc = frequency_binning(np.array(counts), k)
    assert_partition(wc, len(counts), k)
    order = np.argsort(-np.array(counts), kind="stable")
    steps = np.diff(wc.word_class[order])
    assert np.all((steps == 0) | (steps == 1))  # contiguous runs in frequency order


def test_frequency_binning_balances_mass_on_real_counts(corpus: CorpusIds, vocab: Vocabulary) -> None:
    counts = corpus.unigram_counts(len(vocab))
    k = 40
    wc = frequency_binning(counts, k)
    assert_partition(wc, len(vocab), k)
    mass = np.bincount(wc.word_class, weights=counts, minlength=k)
    biggest_word = np.zeros(k)
    np.maximum.at(biggest_word, wc.word_class, counts)
    # a class exceeds its share 1/K only by its last word (which crossed the cut)
    share = counts.sum() / k
    assert np.all(mass - biggest_word <= share + 1e-9)
    # the tail classes of rare words hold about one share each
    multi = wc.class_sizes > 1
    assert np.all(mass[multi][:-1] >= 0.5 * share)


# ----------------------------------------------------------------------------- exchange


def test_class_bigram_log_likelihood_golden() -> None:
    # sentences "a b" and "b a" (a=3, b=4): bigrams <s>a a b b</s> <s>b b a a</s>
    left = np.array([1, 1, 3, 3, 4, 4])
    right = np.array([3, 4, 2, 4, 2, 3])
    count = np.ones(6)
    one_class = np.zeros(5, dtype=np.int64)
    # one class: P(v|u) = P(v) over right words {a, b, </s>}, each 2/6
    assert class_bigram_log_likelihood(left, right, count, one_class) == pytest.approx(6 * math.log(1 / 3))
    # c0 = {a, b}, c1 = {<unk>, <s>, </s>}: c1→c0 twice (P=1), c0→c0 twice and c0→c1 twice
    # (P=1/2 each); inside c0 a and b have 2 of 4 right-tokens each, </s> is alone in c1
    two = np.array([1, 1, 1, 0, 0])
    expected = 2 * math.log(1 * 0.5) + 2 * math.log(0.5 * 0.5) + 2 * math.log(0.5 * 1)
    assert class_bigram_log_likelihood(left, right, count, two) == pytest.approx(expected)


def _brute_best_gain(left: np.ndarray, right: np.ndarray, count: np.ndarray, wc: np.ndarray) -> float:
    """The largest log-likelihood gain of moving one word to another class (no class emptied)."""
    base = class_bigram_log_likelihood(left, right, count, wc)
    k = int(wc.max()) + 1
    sizes = np.bincount(wc, minlength=k)
    best = 0.0
    for w in range(wc.size):
        if sizes[wc[w]] == 1:
            continue
        for c in range(k):
            if c != wc[w]:
                moved = wc.copy()
                moved[w] = c
                best = max(best, class_bigram_log_likelihood(left, right, count, moved) - base)
    return best


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_exchange_reaches_a_local_optimum_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = int(rng.integers(4, 12))
    k = int(rng.integers(2, v))
    pairs = rng.integers(0, v, size=(int(rng.integers(5, 60)), 2))
    keys, count = np.unique(pairs[:, 0] * v + pairs[:, 1], return_counts=True)
    left, right = keys // v, keys % v
    init = frequency_binning(np.bincount(pairs.ravel(), minlength=v), k).word_class
    wc = exchange(left, right, count, init, ExchangeConfig(max_iterations=200, tolerance=0.0))
    assert_partition(WordClasses(wc, "brown"), v, k)
    before = class_bigram_log_likelihood(left, right, count, init)
    after = class_bigram_log_likelihood(left, right, count, wc)
    assert after >= before - 1e-9
    assert _brute_best_gain(left, right, count, wc) < 1e-6


def test_brown_clusters_improve_likelihood_on_real_data(corpus: CorpusIds, vocab: Vocabulary) -> None:
    k = default_num_classes(len(vocab))
    left, right, count = corpus.bigram_counts(len(vocab))
    init = frequency_binning(corpus.unigram_counts(len(vocab)), k)
    wc = brown_clusters(corpus, len(vocab), k, iterations=4, seed=3)
    assert wc.method == "brown"
    assert_partition(wc, len(vocab), k)
    ll0 = class_bigram_log_likelihood(left, right, count, init.word_class)
    ll1 = class_bigram_log_likelihood(left, right, count, wc.word_class)
    # a large, strict improvement per token (frequency bins ignore context entirely)
    assert (ll1 - ll0) / count.sum() > 0.2
    again = brown_clusters(corpus, len(vocab), k, iterations=4, seed=3)
    assert again == wc
    # words that share contexts end up together: months, say
    months = [vocab.id(m) for m in ("january", "february", "march", "april", "may", "june") if m in vocab]
    assert len(months) >= 3
    assert np.bincount(wc.word_class[months]).max() >= 2


# ----------------------------------------------------------------------------- wcluster files


def test_wcluster_round_trip(tmp_path: Path, corpus: CorpusIds, vocab: Vocabulary) -> None:
    counts = corpus.unigram_counts(len(vocab))
    wc = frequency_binning(counts, 37)
    path = tmp_path / "paths"
    save_wcluster(path, wc, vocab, counts)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(vocab)
    assert lines[0] == f"000000\tthe\t{counts[vocab.id('the')]}"  # 37 classes: 6 bits, most frequent first
    back = load_wcluster(path, vocab)
    assert back.method == "file"
    np.testing.assert_array_equal(back.word_class, wc.word_class)


def test_wcluster_missing_and_foreign_words(tmp_path: Path) -> None:
    vocab = Vocabulary(["the", "a", "house", "home", "cat"])  # ids 3..7
    path = tmp_path / "paths"
    path.write_text(
        "0\tthe\t10\n0\ta\t8\n0\tan\t3\n"  # 'an' is not in the vocabulary: ignored
        "10\thouse\t4\n10\thome\t2\n"
        "110\tzebra\t1\n"  # a class with no vocabulary word disappears
        "111\t<s>\t5\n",
        encoding="utf-8",
    )
    wc = load_wcluster(path, vocab)
    # classes in order of first appearance; <unk>, </s> and 'cat' go to one extra class
    assert wc.word_class.tolist() == [3, 2, 3, 0, 0, 1, 1, 3]
    assert wc.num_classes == 4


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("01\thouse", "field"),
        ("01 house 3", "field"),
        ("0a\thouse\t3", "bit string"),
        ("\thouse\t3", "bit string"),
        ("01\thouse\tmany", "count"),
        ("01\tthe\t3", "already listed"),
    ],
)
def test_wcluster_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    vocab = Vocabulary(["the", "house"])
    path = tmp_path / "paths"
    path.write_text(f"00\tthe\t5\n\n{bad_line}\n", encoding="utf-8")
    with pytest.raises(InputError, match=message) as exc:
        load_wcluster(path, vocab)
    assert f"{path}:3:" in str(exc.value)


@pytest.mark.parametrize("num_classes", [1, 2, 8])
def test_brown_clusters_degenerate_sizes(tmp_path: Path, num_classes: int) -> None:
    vocab = Vocabulary(["a", "b", "c", "d", "e"])  # V = 8
    text = tmp_path / "t.txt"
    text.write_text("a b c\nd e a\nb\na a a\n", encoding="utf-8")
    corpus = CorpusIds.encode(text, vocab, tmp_path / "t.ids")
    wc = brown_clusters(corpus, len(vocab), num_classes)
    assert_partition(wc, len(vocab), num_classes)
    if num_classes == len(vocab):  # every word alone: nothing can move
        assert wc.word_class.tolist() == frequency_binning(corpus.unigram_counts(len(vocab)), 8).word_class.tolist()
