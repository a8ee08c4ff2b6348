"""What the rows of a scoring batch share (numpy only): distinct contexts, distinct rows,
distinct (context, class) pairs.

A decoder's n-grams share contexts massively: every expansion of a hypothesis asks for
words after the same order-1 words, and many of those words are in the same class. The
class-factored log-probability (nlmserve.lm.model)::

    log P(w | h) = s_c(h) + s_w(h) - log Σ_c' exp s_c'(h) - log Σ_{w' ∈ c} exp s_w'(h)

needs the context vector r(h) and the class normaliser once per distinct context, the
in-class normaliser once per distinct (context, class), and the two scores s_c + s_w once
per distinct row. :func:`plan_batch` finds those sets with exact keys (ids packed into
uint64 keys; a key that would outgrow 64 bits is first replaced by its rank, so no two
different rows ever share a key); :meth:`BatchPlan.compose` puts the rows' scores together
from the pieces. ``LanguageModel.score_prepared`` (both its numpy and its torch path) and
the server's context cache use both.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class BatchPlan:
    """The distinct work of a batch of N rows (int64 index arrays).

    Fields:
        contexts: (U,) one row of each distinct context.
        rows: (R,) one row of each distinct row (context and target).
        row_context: (R,) the distinct context (index into ``contexts``) of each distinct row.
        row_of: (N,) the distinct row (index into ``rows``) of each row.
        norm: (M,) the rows to normalise, ascending.
        norm_contexts: (C,) the distinct contexts (into ``contexts``) with a row to normalise.
        norm_context_of: (M,) the position in ``norm_contexts`` of each row of ``norm``.
        pair_context: (P,) the context (into ``contexts``) of each distinct (context, class)
            pair of the rows to normalise.
        pair_class: (P,) the class of each pair.
        pair_of: (M,) the pair of each row of ``norm``.
    """

    contexts: np.ndarray
    rows: np.ndarray
    row_context: np.ndarray
    row_of: np.ndarray
    norm: np.ndarray
    norm_contexts: np.ndarray
    norm_context_of: np.ndarray
    pair_context: np.ndarray
    pair_class: np.ndarray
    pair_of: np.ndarray

    def compose(self, raw: np.ndarray, class_norm: np.ndarray, in_class: np.ndarray) -> np.ndarray:
        """Each row's score → float32 (N,): ``raw`` (R,) s_c + s_w of the distinct rows, and on
        the rows of ``norm`` minus ``class_norm`` (C,) of their context and ``in_class`` (P,)
        of their pair."""
        out: np.ndarray = np.asarray(raw, dtype=np.float32)[self.row_of]  # (N,)
        if self.norm.size:
            cn = np.asarray(class_norm, dtype=np.float32)[self.norm_context_of]  # (M,)
            ic = np.asarray(in_class, dtype=np.float32)[self.pair_of]  # (M,)
            out[self.norm] = out[self.norm] - cn - ic
        return out


def distinct_rows(cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a non-negative integer array (N, m) → (one index of each distinct row
    (U,), the distinct row of each row (N,)); the distinct rows come in lexicographic order.

    The columns are packed into one uint64 key, each in as many bits as its largest value
    needs; when the next column would not fit, the key so far is replaced by its rank among
    the distinct keys (order and equality kept), and so is the column if it still does not."""
    n, m = cols.shape
    if n == 0:
        return _EMPTY, _EMPTY
    if m == 0 or n == 1:
        return np.zeros(1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    key = cols[:, 0].astype(np.uint64)
    used = _bits(key)
    for j in range(1, m):
        col = cols[:, j].astype(np.uint64)
        bits = _bits(col)
        if used + bits > 64:
            key = _rank(key)
            used = _bits(key)
        if used + bits > 64:
            col = _rank(col)
            bits = _bits(col)
        key = (key << np.uint64(bits)) | col
        used += bits
    _, inverse = np.unique(key, return_inverse=True)
    inverse = inverse.reshape(n).astype(np.int64, copy=False)
    some = np.empty(int(inverse.max()) + 1, dtype=np.int64)
    some[inverse] = np.arange(n, dtype=np.int64)  # any row of each: they are equal
    return some, inverse


#: Batches of at most this many rows are planned with dictionaries: numpy's sorts cost more
#: there (timed by hand, one core: numpy's 14 µs for one row and 68 µs for eight, the
#: dictionaries' 3, 14 and 32 µs for 1, 8 and 32 rows, where scoring one row takes ~55 µs).
SMALL_BATCH = 32


def plan_batch(ctx: np.ndarray, target: np.ndarray, cls: np.ndarray, normalized: np.ndarray) -> BatchPlan:
    """The plan of a batch of canonical rows: ctx (N, order-1) and target (N,) ids, cls (N,)
    the class of each target (zeros for the outputs without classes), normalized (N,) bool.
    The distinct contexts, rows and pairs come in order of first appearance up to
    ``SMALL_BATCH`` rows, in lexicographic order beyond."""
    if len(target) <= SMALL_BATCH:
        return _plan_small(np.asarray(ctx), np.asarray(target), np.asarray(cls), np.asarray(normalized))
    return _plan_sorted(ctx, target, cls, normalized)


def _plan_sorted(ctx: np.ndarray, target: np.ndarray, cls: np.ndarray, normalized: np.ndarray) -> BatchPlan:
    """:func:`plan_batch` with numpy's sorts (the distinct sets in lexicographic order)."""
    ctx_idx, ctx_of = distinct_rows(np.asarray(ctx))
    rows, row_of = distinct_rows(np.stack([ctx_of, np.asarray(target, dtype=np.int64)], axis=1))
    norm = np.flatnonzero(normalized)
    if norm.size == 0:
        return BatchPlan(ctx_idx, rows, ctx_of[rows], row_of, norm, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
    nctx, ncls = ctx_of[norm], np.asarray(cls, dtype=np.int64)[norm]
    pairs, pair_of = distinct_rows(np.stack([nctx, ncls], axis=1))
    pair_context = nctx[pairs]  # ascending: the pairs come sorted by context, then class
    first = np.ones(pair_context.size, dtype=bool)
    first[1:] = pair_context[1:] != pair_context[:-1]
    norm_contexts = pair_context[first]
    position = np.empty(ctx_idx.size, dtype=np.int64)
    position[norm_contexts] = np.arange(norm_contexts.size)
    return BatchPlan(ctx_idx, rows, ctx_of[rows], row_of, norm, norm_contexts, position[nctx],
                     pair_context, ncls[pairs], pair_of)


def _plan_small(ctx: np.ndarray, target: np.ndarray, cls: np.ndarray, normalized: np.ndarray) -> BatchPlan:
    """:func:`plan_batch` for a few rows: the same sets, found with dictionaries."""
    if len(target) == 1:  # one row shares nothing (a lone client's request)
        zero = np.zeros(1, dtype=np.int64)
        if not normalized[0]:
            return BatchPlan(zero, zero, zero, zero, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
        return BatchPlan(zero, zero, zero, zero, zero, zero, zero, zero,
                         np.asarray(cls, dtype=np.int64).reshape(1), zero)
    contexts, ctx_of = _first_seen(map(tuple, ctx.tolist()))
    rows, row_of = _first_seen(zip(ctx_of, target.tolist()))
    norm = [i for i, x in enumerate(normalized.tolist()) if x]
    classes = cls.tolist()
    keys = [(ctx_of[i], int(classes[i])) for i in norm]  # (context, class) of each normalised row
    pair_first, pair_of = _first_seen(keys)
    context_first, norm_context_of = _first_seen(u for u, _ in keys)
    pair_context = [keys[j][0] for j in pair_first]
    pair_class = [keys[j][1] for j in pair_first]
    norm_contexts = [keys[j][0] for j in context_first]

    def ints(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return BatchPlan(ints(contexts), ints(rows), ints([ctx_of[i] for i in rows]), ints(row_of), ints(norm),
                     ints(norm_contexts), ints(norm_context_of), ints(pair_context), ints(pair_class),
                     ints(pair_of))


def _first_seen(keys: Iterable[Hashable]) -> tuple[list[int], list[int]]:
    """(the position of each distinct key's first appearance, in order; for every key, the
    index of its distinct key in that list)."""
    first: list[int] = []
    index_of: list[int] = []
    seen: dict[Hashable, int] = {}
    for i, key in enumerate(keys):
        u = seen.setdefault(key, len(first))
        if u == len(first):
            first.append(i)
        index_of.append(u)
    return first, index_of


def _bits(a: np.ndarray) -> int:
    return int(a.max()).bit_length()


def _rank(a: np.ndarray) -> np.ndarray:
    """Each value's rank among the distinct values of ``a`` (uint64)."""
    return np.unique(a, return_inverse=True)[1].reshape(a.shape).astype(np.uint64)
