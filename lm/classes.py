"""Word classes for the class-factored output ``P(w | h) = P(c(w) | h) · P(w | c(w), h)``.

Three ways to get a partition of the vocabulary into ``K`` non-empty classes:

* :func:`frequency_binning` — Mikolov et al. (2011): words by decreasing frequency, cut
  into ``K`` runs of about equal unigram mass (optionally of ``sqrt`` mass).
* :func:`brown_clusters` — the exchange algorithm (Kneser & Ney 1993; Martin, Liermann &
  Ney 1998) maximising the class-bigram log-likelihood of the training text, started from
  frequency binning.
* :func:`load_wcluster` — a file in Percy Liang's ``wcluster`` ``paths`` format
  (``bits<TAB>word<TAB>count``), the format OxLM's ``--class-file`` reads;
  :func:`save_wcluster` writes it.

``<s>`` belongs to a class like every id (the model gives it probability 0). See
docs/classes.md for the objective, the costs and the default number of classes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..common.errors import CorpusError, InputError, ModelFileError
from .vocab import Vocabulary

if TYPE_CHECKING:
    from .corpus import CorpusIds

logger = logging.getLogger(__name__)

METHODS = ("frequency", "brown", "file")


@dataclass(frozen=True, eq=False)
class WordClasses:
    """A partition of the word ids ``0..V-1`` into classes ``0..K-1``, none of them empty.

    Fields:
        word_class: int64 array (V,): the class of each word id (stored read-only).
        method: how the partition was made: ``"frequency"``, ``"brown"`` or ``"file"``.

    Derived (computed once): ``num_classes`` K, ``class_sizes`` (K,), ``order`` (V,) the
    word ids sorted by class (stable, so by id inside a class), ``offsets`` (K+1,) with
    ``order[offsets[c]:offsets[c+1]]`` the words of class ``c``, and ``pos_in_class`` (V,)
    the index of each word inside its class.
    """

    word_class: np.ndarray
    method: str

    def __post_init__(self) -> None:
        raw = np.asarray(self.word_class)
        if raw.size and not np.issubdtype(raw.dtype, np.integer):
            raise ValueError(f"word_class must hold integers, got {raw.dtype}")
        wc = np.array(raw, dtype=np.int64, copy=True)
        if wc.ndim != 1 or wc.size == 0:
            raise ValueError(f"word_class must be a non-empty 1-D array, got shape {wc.shape}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if wc.min() < 0:
            raise ValueError(f"negative class id {int(wc.min())}")
        sizes = np.bincount(wc)
        empty = np.flatnonzero(sizes == 0)
        if empty.size:
            raise ValueError(f"classes must be 0..K-1 and non-empty; class {int(empty[0])} is empty")
        wc.setflags(write=False)
        object.__setattr__(self, "word_class", wc)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WordClasses):
            return NotImplemented
        return self.method == other.method and np.array_equal(self.word_class, other.word_class)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WordClasses({self.vocab_size} words, {self.num_classes} classes, method={self.method!r})"

    @property
    def vocab_size(self) -> int:
        return int(self.word_class.size)

    @cached_property
    def num_classes(self) -> int:
        return int(self.word_class.max()) + 1

    @cached_property
    def class_sizes(self) -> np.ndarray:
        return _readonly(np.bincount(self.word_class, minlength=self.num_classes).astype(np.int64))

    @cached_property
    def order(self) -> np.ndarray:
        return _readonly(np.argsort(self.word_class, kind="stable").astype(np.int64))

    @cached_property
    def offsets(self) -> np.ndarray:
        return _readonly(np.concatenate([[0], np.cumsum(self.class_sizes)]).astype(np.int64))

    @cached_property
    def pos_in_class(self) -> np.ndarray:
        pos = np.empty(self.vocab_size, dtype=np.int64)
        pos[self.order] = np.arange(self.vocab_size) - self.offsets[self.word_class[self.order]]
        return _readonly(pos)

    def words_of(self, c: int) -> np.ndarray:
        """The word ids of class ``c`` (increasing)."""
        return self.order[self.offsets[c] : self.offsets[c + 1]]

    def sha256(self) -> str:
        """Hex digest of the class of every word id (identifies the partition)."""
        return hashlib.sha256(self.word_class.astype("<i8").tobytes()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """Plain lists and numbers, for the self-describing model file."""
        return {
            "method": self.method,
            "num_classes": self.num_classes,
            "word_class": [int(c) for c in self.word_class],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, vocab_size: int | None = None) -> "WordClasses":
        """Rebuild from :meth:`to_json`; anything but a partition of ``0..V-1`` is a ModelFileError."""
        try:
            method = d["method"]
            raw = d["word_class"]
            num_classes = d.get("num_classes")
        except (KeyError, TypeError) as exc:
            raise ModelFileError(f"word classes: missing field {exc}") from exc
        if not isinstance(raw, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in raw):
            raise ModelFileError("word classes: word_class must be a list of integers")
        if vocab_size is not None and len(raw) != vocab_size:
            raise ModelFileError(f"word classes: {len(raw)} entries for a vocabulary of {vocab_size}")
        try:
            classes = cls(np.array(raw, dtype=np.int64), method)
        except (ValueError, OverflowError) as exc:
            raise ModelFileError(f"word classes are not a partition: {exc}") from exc
        if num_classes is not None and num_classes != classes.num_classes:
            raise ModelFileError(f"word classes: num_classes {num_classes} but {classes.num_classes} classes used")
        return classes


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def default_num_classes(vocab_size: int) -> int:
    """The default number of classes: ``round(sqrt(V))``, at least 1 and at most V.

    ``sqrt(V)`` minimises the output cost ``K + V/K`` of one normalised prediction. Measured
    against ``3·sqrt(V)`` by experiments/classes.py (docs/classes.md, "Number of classes"): within
    about 1 % of its perplexity at 60 % of its output cost.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return max(1, min(vocab_size, round(math.sqrt(vocab_size))))


# ----------------------------------------------------------------------------- frequency


def frequency_binning(counts: np.ndarray, num_classes: int, *, sqrt: bool = False) -> WordClasses:
    """Mikolov et al.'s frequency classes with exactly ``num_classes`` non-empty classes.

    Words are sorted by decreasing count (ties by id). The i-th word of that order goes to
    class ``floor(K · m_i / M)`` where ``m_i`` is the mass of the words before it and ``M``
    the total (``sqrt=True``: masses are square roots of counts), except that the class
    number never jumps by more than one from one word to the next and rises early enough to
    fill all K classes. So frequent words get classes of their own and the rare tail shares
    a few large classes of about the same total mass.
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    V = c.size
    K = int(num_classes)
    if not 1 <= K <= V:
        raise ValueError(f"num_classes must be in [1, {V}] for {V} words, got {num_classes}")
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    mass = np.sqrt(c) if sqrt else c
    order = np.argsort(-mass, kind="stable")
    total = float(mass.sum())
    before = np.concatenate([[0.0], np.cumsum(mass[order])[:-1]])
    target = (np.floor(K * before / total) if total > 0 else np.zeros(V)).astype(np.int64)
    assigned = np.empty(V, dtype=np.int64)
    cls = 0
    for i in range(V):
        # never skip a class; never fall so far behind that the remaining words cannot fill K.
        cls = max(min(int(target[i]), cls + 1, K - 1), K - (V - i)) if i else 0
        assigned[i] = cls
    word_class = np.empty(V, dtype=np.int64)
    word_class[order] = assigned
    return WordClasses(word_class, "frequency")


# ----------------------------------------------------------------------------- exchange


def _xlogx(x: np.ndarray) -> np.ndarray:
    """x·log x with 0·log 0 = 0, for non-negative integer-valued floats."""
    out: np.ndarray = x * np.log(np.maximum(x, 1.0))
    return out


def class_bigram_log_likelihood(
    left: np.ndarray, right: np.ndarray, count: np.ndarray, word_class: np.ndarray
) -> float:
    """Natural-log likelihood of the bigrams under ``P(c(v)|c(u)) · P(v|c(v))`` (ML estimates).

    ``(left, right, count)`` are sparse bigram counts (as :meth:`CorpusIds.bigram_counts`).
    Equals ``Σ N(c,d) log N(c,d) − Σ_c N(c,·) log N(c,·) − Σ_d N(·,d) log N(·,d)
    + Σ_v N(·,v) log N(·,v)``.
    """
    wc = np.asarray(word_class, dtype=np.int64)
    K = int(wc.max()) + 1
    V = wc.size
    cnt = np.asarray(count, dtype=np.float64)
    cl, cr = wc[left], wc[right]
    m = np.bincount(cl * K + cr, weights=cnt, minlength=K * K)
    n_left = np.bincount(cl, weights=cnt, minlength=K)
    n_right = np.bincount(cr, weights=cnt, minlength=K)
    n_word = np.bincount(right, weights=cnt, minlength=V)
    return float(_xlogx(m).sum() - _xlogx(n_left).sum() - _xlogx(n_right).sum() + _xlogx(n_word).sum())


@dataclass(frozen=True)
class ExchangeConfig:
    """Settings of the exchange algorithm.

    Fields:
        max_iterations: passes over the vocabulary at most (each pass tries every word once).
        tolerance: stop when a pass raises the log-likelihood by less than this many nats
            per bigram token.
        seed: orders words of equal frequency (the only randomness; same seed, same result).
    """

    max_iterations: int = 10
    tolerance: float = 1e-4
    seed: int = 0


def exchange(
    left: np.ndarray,
    right: np.ndarray,
    count: np.ndarray,
    init: np.ndarray,
    config: ExchangeConfig = ExchangeConfig(),
) -> np.ndarray:
    """Improve the partition ``init`` (V,) by moving single words between classes.

    Each pass visits the words by decreasing frequency (ties in an order drawn from
    ``config.seed``), takes the word out of its class and puts it into the class that gives
    the highest class-bigram log-likelihood, unless the word is alone in its class (no class
    may become empty). Returns the new ``word_class`` (V,) int64; the likelihood never drops.
    """
    state = _ExchangeState(left, right, count, init)
    if state.total <= 0:
        return state.wc
    tie = np.random.default_rng(config.seed).permutation(state.V)
    visit = np.lexsort((tie, -state.freq))
    visit = visit[state.freq[visit] > 0]
    ll = class_bigram_log_likelihood(left, right, count, state.wc)
    logger.info("exchange: %d words, %d classes, %d bigram types; start log-lik/token %.5f",
                state.V, state.K, np.size(left), ll / state.total)
    for it in range(1, config.max_iterations + 1):
        t0 = time.perf_counter()
        gained, moved = 0.0, 0
        for w in visit:
            gain = state.best_move(int(w))
            if gain > 0.0:
                gained += gain
                moved += 1
        ll += gained
        logger.info("exchange pass %d: moved %d words, log-lik/token %.5f (+%.5f), %.1f s",
                    it, moved, ll / state.total, gained / state.total, time.perf_counter() - t0)
        if moved == 0 or gained / state.total < config.tolerance:
            break
    return state.wc


class _ExchangeState:
    """Class-bigram counts of a partition, kept up to date while single words move.

    ``m`` (K, K) counts class bigrams, ``f_m`` = xlogx(m); ``n_left`` / ``n_right`` (K,)
    count bigram tokens whose left / right word is in each class. Moving word w touches
    only row and column of its old and new class.
    """

    def __init__(self, left: np.ndarray, right: np.ndarray, count: np.ndarray, init: np.ndarray) -> None:
        self.wc = np.array(init, dtype=np.int64)
        V = self.V = self.wc.size
        K = self.K = int(self.wc.max()) + 1
        left = np.asarray(left, dtype=np.int64)
        right = np.asarray(right, dtype=np.int64)
        cnt = np.asarray(count, dtype=np.float64)
        if left.shape != right.shape or left.shape != cnt.shape:
            raise ValueError("left, right and count must have the same length")
        if left.size and (min(left.min(), right.min()) < 0 or max(left.max(), right.max()) >= V):
            raise ValueError(f"bigram word ids must lie in [0, {V}) (the length of init)")
        self.total = float(cnt.sum())
        self_pair = left == right
        self.self_count = np.bincount(left[self_pair], weights=cnt[self_pair], minlength=V)  # (V,)
        self.n_as_left = np.bincount(left, weights=cnt, minlength=V)  # (V,) bigrams with w on the left
        self.n_as_right = np.bincount(right, weights=cnt, minlength=V)
        self.freq = self.n_as_left + self.n_as_right
        other = ~self_pair
        # CSR of right neighbours (w, v), v != w, and of left neighbours (u, w), u != w.
        self.r_nb, self.r_cnt, self.r_ptr = _csr(left[other], right[other], cnt[other], V)
        self.l_nb, self.l_cnt, self.l_ptr = _csr(right[other], left[other], cnt[other], V)
        wc = self.wc
        self.m = np.bincount(wc[left] * K + wc[right], weights=cnt, minlength=K * K).reshape(K, K)
        self.f_m = _xlogx(self.m)
        self.n_left = np.bincount(wc, weights=self.n_as_left, minlength=K)
        self.n_right = np.bincount(wc, weights=self.n_as_right, minlength=K)
        self.sizes = np.bincount(wc, minlength=K)

    def _neighbour_classes(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(r, l) (K,): counts of (w, v) with v in class k, and of (u, w) with u in class k."""
        a, b = self.r_ptr[w], self.r_ptr[w + 1]
        r = np.bincount(self.wc[self.r_nb[a:b]], weights=self.r_cnt[a:b], minlength=self.K)
        a, b = self.l_ptr[w], self.l_ptr[w + 1]
        lv = np.bincount(self.wc[self.l_nb[a:b]], weights=self.l_cnt[a:b], minlength=self.K)
        return r, lv

    def _update(self, w: int, k: int, r: np.ndarray, lv: np.ndarray, dr: np.ndarray, dl: np.ndarray,
                sign: float) -> None:
        """Add (sign=+1) or remove (-1) word w's bigrams to / from class k."""
        m, f_m = self.m, self.f_m
        m[k, dr] += sign * r[dr]
        m[dl, k] += sign * lv[dl]
        m[k, k] += sign * self.self_count[w]
        f_m[k, :] = _xlogx(m[k, :])
        f_m[:, k] = _xlogx(m[:, k])
        self.n_left[k] += sign * self.n_as_left[w]
        self.n_right[k] += sign * self.n_as_right[w]

    def _gains(self, w: int, r: np.ndarray, lv: np.ndarray, dr: np.ndarray, dl: np.ndarray) -> np.ndarray:
        """(K,) change of the log-likelihood if w (now in no class) joined class k.

        ``dr`` / ``dl``: the classes where ``r`` / ``lv`` are non-zero.
        """
        m, f_m = self.m, self.f_m
        s, nl, nr = self.self_count[w], self.n_as_left[w], self.n_as_right[w]
        gain: np.ndarray = (_xlogx(m[:, dr] + r[dr]) - f_m[:, dr]).sum(axis=1)  # row k gets r: (K, a) → (K,)
        gain += (_xlogx(m[dl, :] + lv[dl, None]) - f_m[dl, :]).sum(axis=0)  # column k gets l: (b, K) → (K,)
        diag, f_diag = np.diagonal(m), np.diagonal(f_m)
        # the (k, k) cell gets r[k] + l[k] + s at once, not r[k] and l[k] separately
        gain += _xlogx(diag + r + lv + s) - _xlogx(diag + r) - _xlogx(diag + lv) + f_diag
        gain -= _xlogx(self.n_left + nl) - _xlogx(self.n_left) + _xlogx(self.n_right + nr) - _xlogx(self.n_right)
        return gain

    def best_move(self, w: int) -> float:
        """Move w to its best class (staying on ties); return the log-likelihood gained."""
        c = int(self.wc[w])
        if self.sizes[c] == 1:
            return 0.0
        r, lv = self._neighbour_classes(w)
        dr, dl = np.flatnonzero(r), np.flatnonzero(lv)
        self._update(w, c, r, lv, dr, dl, -1.0)
        gain = self._gains(w, r, lv, dr, dl)
        best = int(np.argmax(gain))
        if gain[best] <= gain[c] + 1e-9 * (1.0 + abs(gain[c])):
            best = c
        self._update(w, best, r, lv, dr, dl, 1.0)
        if best == c:
            return 0.0
        self.sizes[c] -= 1
        self.sizes[best] += 1
        self.wc[w] = best
        return float(gain[best] - gain[c])


def _csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries grouped by row: (cols, vals, ptr) with row i at ``ptr[i]:ptr[i+1]``."""
    order = np.argsort(rows, kind="stable")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).astype(np.int64)
    return cols[order], vals[order], ptr


def brown_clusters(
    corpus: "CorpusIds",
    vocab_size: int,
    num_classes: int,
    *,
    iterations: int = 10,
    tolerance: float = 1e-4,
    seed: int = 0,
) -> WordClasses:
    """Exchange-algorithm classes of a training corpus, started from frequency binning.

    Maximises the class-bigram log-likelihood of the corpus' within-sentence bigrams
    (``<s> w1``, ..., ``wn </s>``); see :func:`exchange` and docs/classes.md.
    """
    t0 = time.perf_counter()
    left, right, count = corpus.bigram_counts(vocab_size)
    unigrams = corpus.unigram_counts(vocab_size)
    init = frequency_binning(unigrams, num_classes)
    config = ExchangeConfig(max_iterations=iterations, tolerance=tolerance, seed=seed)
    wc = exchange(left, right, count, init.word_class, config)
    logger.info("brown clusters: %d words into %d classes in %.1f s", vocab_size, num_classes, time.perf_counter() - t0)
    return WordClasses(wc, "brown")


# ----------------------------------------------------------------------------- wcluster files

_BITS = re.compile(r"[01]+")


def load_wcluster(path: str | os.PathLike[str], vocab: Vocabulary) -> WordClasses:
    """Classes from a wcluster ``paths`` file: ``bits<TAB>word<TAB>count`` per line.

    Each distinct bit string is a class, numbered in order of first appearance. Words of
    the file that are not in ``vocab`` are ignored (a class left without vocabulary words
    is dropped); vocabulary words missing from the file (often ``<unk>``, ``<s>``,
    ``</s>``) go together into one extra, last class. A malformed line or a word listed
    twice is an InputError naming the file and line.
    """
    p = Path(path)
    class_of_bits: dict[str, int] = {}
    word_class = np.full(len(vocab), -1, dtype=np.int64)
    seen: dict[str, int] = {}
    try:
        f = open(p, "rb")
    except FileNotFoundError as exc:
        raise CorpusError("no such file", str(p)) from exc
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise InputError("not UTF-8", str(p), lineno) from exc
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 3:
                raise InputError(f"expected bits<TAB>word<TAB>count, got {len(fields)} field(s)", str(p), lineno)
            bits, word, count = fields
            if not _BITS.fullmatch(bits):
                raise InputError(f"bit string {bits!r} is not made of 0 and 1", str(p), lineno)
            if not word or word != word.strip():
                raise InputError(f"bad word {word!r}", str(p), lineno)
            if not count.isdigit():
                raise InputError(f"count {count!r} is not a non-negative integer", str(p), lineno)
            if word in seen:
                raise InputError(f"word {word!r} already listed on line {seen[word]}", str(p), lineno)
            seen[word] = lineno
            if word not in vocab:
                continue
            cls = class_of_bits.setdefault(bits, len(class_of_bits))
            word_class[vocab.id(word)] = cls
    missing = word_class < 0
    if missing.all():
        raise InputError("no word of the vocabulary is in this class file", str(p))
    if missing.any():
        word_class[missing] = len(class_of_bits)
        logger.info("class file %s: %d vocabulary words missing, put into one extra class", p, int(missing.sum()))
    # renumber densely (classes whose words all fell outside the vocabulary disappear)
    used, dense = np.unique(word_class, return_inverse=True)
    return WordClasses(dense.astype(np.int64), "file")


def save_wcluster(
    path: str | os.PathLike[str], classes: WordClasses, vocab: Vocabulary, counts: np.ndarray | None = None
) -> None:
    """Write ``classes`` as a wcluster ``paths`` file that :func:`load_wcluster` reads back.

    Bits are the class id in binary, zero-padded to a fixed width; words are listed class
    by class, most frequent first (``counts`` (V,), zeros when not given).
    """
    V = len(vocab)
    if classes.vocab_size != V:
        raise ValueError(f"classes cover {classes.vocab_size} words, the vocabulary has {V}")
    cnt = np.zeros(V, dtype=np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
    width = max(1, (classes.num_classes - 1).bit_length())
    words = vocab.words
    order = np.lexsort((np.arange(V), -cnt, classes.word_class))
    p = Path(path)
    tmp = p.with_name(f"{p.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for w in order:
            f.write(f"{int(classes.word_class[w]):0{width}b}\t{words[w]}\t{int(cnt[w])}\n")
    os.replace(tmp, p)
