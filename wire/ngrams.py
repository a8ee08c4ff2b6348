"""The n-gram rules of the wire contract, in one place for every Python room.

Special ids, fixed as in KenLM: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2.

An n-gram lists word ids oldest first, the predicted word last, 1 <= n <= order. Its
canonical row has ``order`` ids: left-padded with ``<s>``, and everything left of the newest
``<s>`` in the context set to ``<s>`` (a sentence start resets the history), so
``<s> <s> the`` ≡ ``<s> the`` ≡ ``the``. ``<s>`` is never predicted.

The id ``vocab_size`` (one past the vocabulary, :func:`no_word_id`) stands, in a context,
for a word that is not known: the history before a phrase that a decoder scores before it
knows what precedes it. It adds nothing to the context (no row, no direct feature of a
suffix that holds it), so such a row is the model's estimate from the words that are known,
as a lower-order n-gram is KenLM's. Like ``<s>``, everything left of the newest no-word is
no-word; it is never predicted.

    canonical_rows(ids, order, vocab_size)      # validate (N, n) ids → (N, order) int64
    sentence_windows(sentences, order, bos=, eos=)  # every n-gram of id sentences
    sentence_rows(sentences, index, order, lowercase=)  # the same of word sentences, with OOV flags
    pack_ngrams(ngrams, index, order, lowercase=)   # word n-grams → padded id rows + OOV

Only numpy is imported here (never torch): the client and the Moses tooling use these rules
too (proto/contract/canonical_ngrams.tsv has the cases the C++ client passes as well).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sequence

import numpy as np
import numpy.typing as npt

from ..common.errors import InvalidRequestError

UNK = "<unk>"
BOS = "<s>"
EOS = "</s>"
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2

# The direct n-gram features' hash (proto/nlmserve/v1/lm.proto, ScoringTablesChunk; cases in
# proto/contract/feature_hashes.tsv): the hash of a context's suffix of length l is
# h_0 = HASH_SEED, h_l = (h_{l-1} * HASH_CTX + w_{-l} + 1) mod HASH_MOD over its newest words,
# and a feature's slot in a table of ``size`` is ((h * HASH_KEY + y * HASH_OUT) mod HASH_MOD)
# mod size. All arithmetic stays below 2^63 in int64: hashes < 2^31, multipliers < 2^31, ids < 2^24.
HASH_MOD = (1 << 31) - 1  # the Mersenne prime 2^31 - 1
HASH_SEED = 1_000_003  # hash of the empty suffix
HASH_CTX = 1_299_709
HASH_KEY = 1_640_531_527
HASH_OUT = 805_306_457
NO_HASH = -1  # a suffix that holds a word that is not known: no feature

#: The ``kind`` of each InvalidRequestError these rules raise.
EMPTY, TOO_LONG, OUT_OF_RANGE, BOS_TARGET, BOS_IN_SENTENCE = (
    "empty", "too-long", "out-of-range", "bos-target", "bos-in-sentence")


def _too_long(n: int, order: int, index: int) -> InvalidRequestError:
    return InvalidRequestError(f"n-gram of {n} words is longer than the model order {order}", index=index,
                               kind=TOO_LONG)


def no_word_id(vocab_size: int) -> int:
    """The context id of a word that is not known (see the module's text): ``vocab_size``."""
    return vocab_size


def canonical_rows(ids: npt.ArrayLike, order: int, vocab_size: int) -> np.ndarray:
    """Validate n-gram rows (N, n) and bring them to the canonical (N, order) int64 form.

    Raises InvalidRequestError (with ``index`` the first offending row and ``kind``) for an
    array that is not 2-D or not of integers, an empty n-gram, one longer than ``order``,
    an id outside ``[0, vocab_size)`` (``vocab_size`` itself, the no-word, is allowed in the
    context) and ``<s>`` as the predicted word, checked in that order. No rows give an
    empty (0, order) array whatever their width.
    """
    arr = np.asarray(ids)
    if arr.ndim != 2:
        raise InvalidRequestError(f"n-grams must be a 2-D array (N, n), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"n-gram ids must be integers, got {arr.dtype}")
    n_rows, n = arr.shape
    if n_rows == 0:
        return np.empty((0, order), dtype=np.int64)
    if n == 0:
        raise InvalidRequestError("empty n-gram", index=0, kind=EMPTY)
    if n > order:
        raise _too_long(n, order, 0)
    a = arr.astype(np.int64, copy=False)
    out_of_range = (a < 0) | (a > vocab_size)
    out_of_range[:, -1] |= a[:, -1] == vocab_size
    bad = np.flatnonzero(out_of_range.any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(f"word id out of range [0, {vocab_size}): {a[i].tolist()}", index=i,
                                  kind=OUT_OF_RANGE)
    bos_target = np.flatnonzero(a[:, -1] == BOS_ID)
    if bos_target.size:
        raise InvalidRequestError("<s> cannot be the predicted word", index=int(bos_target[0]), kind=BOS_TARGET)
    out = np.full((n_rows, order), BOS_ID, dtype=np.int64)
    out[:, order - n :] = a
    ctx = out[:, :-1]  # a view: the assignment below changes ``out``
    # Everything left of the newest <s> becomes <s>: reverse cumulative OR of is-<s>; and
    # the same for the no-word, whichever of the two is newer.
    marker = np.where(ctx == BOS_ID, BOS_ID, np.where(ctx == vocab_size, vocab_size, -1))
    newest = np.maximum.accumulate(np.where(marker >= 0, np.arange(ctx.shape[1]), -1), axis=1)[:, -1:]
    if (newest >= 0).any():
        cols = np.arange(ctx.shape[1])
        fill = np.take_along_axis(marker, np.maximum(newest, 0), axis=1)  # (N, 1)
        ctx[:] = np.where(cols < newest, fill, ctx)
    return out


def check_sentences(sentences: Sequence[npt.ArrayLike], vocab_size: int) -> None:
    """InvalidRequestError naming the first id sentence with an id outside ``[0, vocab_size)``
    or with ``<s>`` (which would be predicted)."""
    for i, s in enumerate(sentences):
        a = np.asarray(s)
        if not a.size:
            continue
        if a.min() < 0 or a.max() >= vocab_size:
            raise InvalidRequestError(f"word id out of range [0, {vocab_size})", index=i, kind=OUT_OF_RANGE)
        if (a == BOS_ID).any():
            raise InvalidRequestError("<s> inside a sentence cannot be predicted", index=i, kind=BOS_IN_SENTENCE)


def sentence_windows(sentences: Sequence[npt.ArrayLike], order: int, *, bos: bool = True,
                     eos: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every n-gram of id sentences → (rows (T, order) int64, n-gram lengths (T,) uint32,
    tokens per sentence (S,) int64), the sentences' rows one after the other.

    Token i (``</s>`` last when ``eos``) is predicted from the ``order - 1`` ids before it,
    after ``order - 1`` ``<s>``; the rows are canonical when the sentences hold no ``<s>``
    (:func:`check_sentences`). The n-gram length counts the words used, ``<s>`` included when
    ``bos`` (KenLM's full_scores); ``bos=False`` changes only the lengths (the first word's
    is 1), since a short context is padded with ``<s>`` either way.
    """
    toks = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sentences]
    counts = np.array([t.size + int(eos) for t in toks], dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.empty((0, order), dtype=np.int64), np.empty(0, dtype=np.uint32), counts
    # One flat history: per sentence order-1 <s>, its tokens, </s>; window k of a sentence
    # starts k ids after the sentence's own padding starts.
    pad = np.full(order - 1, BOS_ID, dtype=np.int64)
    end = [np.array([EOS_ID], dtype=np.int64)] if eos else []
    flat = np.concatenate([part for t in toks for part in (pad, t, *end)])
    starts = np.cumsum(counts + order - 1) - (counts + order - 1)  # where each sentence's padding starts
    owner = np.repeat(np.arange(len(toks)), counts)
    first_row = np.cumsum(counts) - counts
    pos = np.arange(total) - first_row[owner]  # token index within its sentence
    windows = np.lib.stride_tricks.sliding_window_view(flat, order)
    rows = windows[starts[owner] + pos]
    lengths = np.minimum(pos + 1 + int(bos), order).astype(np.uint32)
    return rows, lengths, counts


def sentence_rows(sentences: Sequence[Sequence[str]], index: Mapping[str, int], order: int, *, lowercase: bool,
                  bos: bool = True, eos: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All n-grams of tokenised ``sentences`` → (rows (T, order), oov (T,), n-gram lengths (T,),
    sentence of each row (T,)) (:func:`sentence_windows` of :func:`word_ids`; a row's OOV flag is
    its predicted word's, ``</s>`` never one). Words are lowercased first when ``lowercase`` (the
    model was trained on lowercased text). InvalidRequestError names a sentence that holds ``<s>``."""
    toks = [[w.lower() for w in words] if lowercase else list(words) for words in sentences]
    ids = [word_ids(t, index, lowercase=False) for t in toks]
    check_sentences(ids, len(index))
    rows, lens, counts = sentence_windows(ids, order, bos=bos, eos=eos)
    oov = np.array([flag for t in toks for flag in [w not in index for w in t] + [False] * int(eos)], dtype=bool)
    return rows, oov, lens, np.repeat(np.arange(len(sentences), dtype=np.int64), counts)


def suffix_hashes(ctx: np.ndarray, no_word: int | None = None) -> np.ndarray:
    """ctx (N, L-1) word ids, oldest first → (N, L) int64 hashes of the context's suffixes of
    length 0, 1, …, L-1 (the newest words); a suffix that holds ``no_word`` gets NO_HASH (the
    numpy twin of ``nlmserve.lm.outputs.class_factored.context_hashes``)."""
    ctx = np.asarray(ctx, dtype=np.int64)
    n, n1 = ctx.shape
    out = np.empty((n, n1 + 1), dtype=np.int64)
    out[:, 0] = HASH_SEED
    for length in range(1, n1 + 1):
        out[:, length] = (out[:, length - 1] * HASH_CTX + ctx[:, n1 - length] + 1) % HASH_MOD
    if no_word is not None and n1:
        unknown = np.cumsum(ctx[:, ::-1] == no_word, axis=1) > 0  # (N, L-1): suffix 1.. holds one
        out[:, 1:][unknown] = NO_HASH
    return out


def feature_slots(h: np.ndarray, y: np.ndarray, size: int) -> np.ndarray:
    """Table slots of the features (suffix, y): h (N, L) suffix hashes, y (N,) class or word
    ids → (N, L) (the numpy twin of ``nlmserve.lm.outputs.class_factored.ngram_feature_index``)."""
    return ((h * HASH_KEY + np.asarray(y, dtype=np.int64)[:, None] * HASH_OUT) % HASH_MOD) % size  # type: ignore[no-any-return]


class Ngrams(Protocol):
    """What :func:`pack_ngrams` reads: how many n-grams, then each one's words once, in
    order (a list, or a view that makes each n-gram as it is read)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence[str]]: ...


def pack_ngrams(ngrams: Ngrams, index: Mapping[str, int], order: int, *, lowercase: bool,
                dtype: npt.DTypeLike = np.int64, unk_id: int = UNK_ID,
                bos_id: int = BOS_ID) -> tuple[np.ndarray, np.ndarray]:
    """Word n-grams → (ids (N, order) left-padded with ``<s>``, oov (N,) bool).

    Words are lowercased first when ``lowercase`` (the model was trained lowercased);
    unknown words map to ``<unk>``; an n-gram's OOV flag is its predicted word's.
    InvalidRequestError names an empty n-gram or one longer than ``order``.
    """
    get = index.get
    ids = np.full((len(ngrams), order), bos_id, dtype=dtype)
    oov = np.zeros(len(ngrams), dtype=bool)
    for i, ng in enumerate(ngrams):
        k = len(ng)
        if k == 0:
            raise InvalidRequestError("empty n-gram", index=i, kind=EMPTY)
        if k > order:
            raise _too_long(k, order, i)
        row = [get(w.lower() if lowercase else w, unk_id) for w in ng]
        ids[i, order - k :] = row
        oov[i] = row[-1] == unk_id
    return ids, oov


def word_ids(words: Sequence[str], index: Mapping[str, int], *, lowercase: bool,
             dtype: npt.DTypeLike = np.int64) -> np.ndarray:
    """Ids of a tokenised sentence (lowercased first when ``lowercase``; unknown → ``<unk>``)."""
    get = index.get
    return np.fromiter((get(w.lower() if lowercase else w, UNK_ID) for w in words), dtype=dtype, count=len(words))
