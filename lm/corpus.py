"""Training text → a flat memory-mapped array of word ids.

A corpus is read once (:func:`read_sentences`, streamed, plain / ``.gz`` / ``.xz``) and
converted by :meth:`CorpusIds.encode` into a raw little-endian ``uint32`` file: for each
sentence its word ids followed by ``</s>`` (id 2). Training memory-maps that file
(:meth:`CorpusIds.open`), so a corpus larger than RAM still trains, and draws examples with
:meth:`CorpusIds.examples`, which rebuilds each n-gram context from the flat array: the
context never reaches back over the previous sentence's ``</s>``; positions before the
sentence start read ``<s>`` (the convention of docs/architecture.md).

A JSON sidecar (``<ids file>.json``) records what the ids were made from (vocabulary hash,
source path, size and modification time, lowercasing) and the counts, so an up-to-date id
file is reused instead of re-encoded.

Tokens are separated by whitespace (``str.split()``); empty lines are skipped. Literal
``<s>`` and ``</s>`` tokens in the text cannot be words of a sentence: they are read as
``<unk>`` (and counted as OOV) like any word missing from the vocabulary.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import lzma
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..common.errors import CorpusError
from .vocab import BOS, BOS_ID, EOS, EOS_ID, UNK_ID, Vocabulary

logger = logging.getLogger(__name__)

# Version of the id file + sidecar layout; a different version is re-encoded.
FORMAT_VERSION = 1
# Tokens buffered before a chunk of ids is written (bounded memory while encoding).
_CHUNK_TOKENS = 1 << 20
# Positions per chunk when counting over the memory-mapped ids.
_COUNT_CHUNK = 1 << 24


def _open_binary(path: Path) -> io.BufferedIOBase:
    """Open ``path`` for reading bytes, decompressing ``.gz`` / ``.xz`` by suffix."""
    try:
        if path.suffix == ".gz":
            return gzip.open(path, "rb")
        if path.suffix == ".xz":
            return lzma.open(path, "rb")
        return open(path, "rb")
    except FileNotFoundError as exc:
        raise CorpusError("no such file", str(path)) from exc
    except OSError as exc:
        raise CorpusError(f"cannot open: {exc}", str(path)) from exc


def decode_lines(raw_lines: Iterable[bytes], name: str) -> Iterator[str]:
    """The UTF-8 lines of a byte stream, without terminators, empty ones included.

    A leading byte-order mark is dropped. Bytes that are not UTF-8 or a damaged compressed
    stream raise :class:`CorpusError` naming ``name`` (and the line).
    """
    lineno = 0
    try:
        for raw in raw_lines:
            lineno += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"not UTF-8 (byte {exc.start} of the line: {raw[exc.start:exc.start + 1]!r})",
                    name,
                    lineno,
                ) from exc
            if lineno == 1 and text.startswith("\ufeff"):
                text = text[1:]  # a byte-order mark is not part of the first word
            yield text.rstrip("\r\n")
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise CorpusError(f"damaged or unreadable after line {lineno}: {exc}", name) from exc


def open_text_lines(path: str | os.PathLike[str]) -> Iterator[str]:
    """The lines of a UTF-8 text (plain, .gz, .xz), one at a time; see :func:`decode_lines`."""
    p = Path(path)
    with _open_binary(p) as f:
        yield from decode_lines(f, str(p))


def read_sentences(path: str | os.PathLike[str], *, lowercase: bool = False) -> Iterator[list[str]]:
    """Yield the whitespace tokens of each non-empty line of a UTF-8 text, one line at a time.

    Raises :class:`CorpusError` naming the file (and the line, for bytes that are not UTF-8
    or a damaged compressed stream) when the text cannot be read.
    """
    for text in open_text_lines(path):
        if lowercase:
            text = text.lower()
        tokens = text.split()
        if tokens:
            yield tokens


def count_words(path: str | os.PathLike[str], *, lowercase: bool = False) -> tuple[Counter[str], int]:
    """Word counts and the number of sentences of a text; no tokens at all is a CorpusError."""
    counts: Counter[str] = Counter()
    num_sentences = 0
    for tokens in read_sentences(path, lowercase=lowercase):
        counts.update(tokens)
        num_sentences += 1
    if num_sentences == 0:
        raise CorpusError("empty: no tokens", str(path))
    return counts, num_sentences


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _source_stamp(text_path: Path) -> dict[str, Any]:
    try:
        st = text_path.stat()
    except FileNotFoundError as exc:
        raise CorpusError("no such file", str(text_path)) from exc
    return {"source": str(text_path.resolve()), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


class CorpusIds:
    """A corpus as a flat ``uint32`` id array (memory-mapped), one ``</s>`` after each sentence.

    Attributes: ``path`` (the id file), ``ids`` (``np.memmap`` uint32), ``num_tokens``
    (including the ``</s>`` of every sentence), ``num_sentences``, ``num_oov`` (tokens read
    as ``<unk>``), ``meta`` (the sidecar dictionary).
    """

    def __init__(self, path: Path, ids: np.ndarray, meta: dict[str, Any]) -> None:
        self.path = path
        self.ids = ids
        self.meta = meta
        self.num_tokens = int(meta["num_tokens"])
        self.num_sentences = int(meta["num_sentences"])
        self.num_oov = int(meta["num_oov"])

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"CorpusIds({str(self.path)!r}, {self.num_sentences} sentences, {self.num_tokens} tokens)"

    # ----------------------------------------------------------------- building and opening

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "CorpusIds":
        """Memory-map an id file written by :meth:`encode` (its sidecar must be next to it)."""
        p = Path(path)
        side = _sidecar(p)
        try:
            meta = json.loads(side.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise CorpusError("id file has no sidecar " + side.name, str(p)) from exc
        except (OSError, ValueError) as exc:
            raise CorpusError(f"unreadable sidecar: {exc}", str(side)) from exc
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise CorpusError(f"sidecar is not an id-file description of version {FORMAT_VERSION}", str(side))
        try:
            num_tokens = int(meta["num_tokens"])
            int(meta["num_sentences"]), int(meta["num_oov"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorpusError(f"sidecar lacks counts: {exc}", str(side)) from exc
        try:
            size = p.stat().st_size
        except FileNotFoundError as exc:
            raise CorpusError("no such id file", str(p)) from exc
        if size != 4 * num_tokens or num_tokens == 0:
            raise CorpusError(f"id file has {size} bytes, the sidecar promises {num_tokens} uint32 ids", str(p))
        ids = np.memmap(p, dtype="<u4", mode="r", shape=(num_tokens,))
        return cls(p, ids, meta)

    @classmethod
    def encode(
        cls,
        text_path: str | os.PathLike[str],
        vocab: Vocabulary,
        out_path: str | os.PathLike[str],
        *,
        lowercase: bool = False,
    ) -> "CorpusIds":
        """Convert a text to ids (or reuse ``out_path`` when it is up to date) and open it.

        Up to date means: same format version, vocabulary hash, source path, size and
        modification time, and lowercasing. The file is written in chunks to a temporary
        name and renamed into place, so a crash never leaves a half-written id file behind
        a valid sidecar.
        """
        src, out = Path(text_path), Path(out_path)
        wanted = {
            "format_version": FORMAT_VERSION,
            "vocab_sha256": vocab.sha256(),
            "vocab_size": len(vocab),
            "lowercase": bool(lowercase),
            **_source_stamp(src),
        }
        if _sidecar(out).exists() and out.exists():
            try:
                existing = cls.open(out)
            except CorpusError as exc:
                logger.info("re-encoding %s: %s", out, exc)
            else:
                if all(existing.meta.get(k) == v for k, v in wanted.items()):
                    logger.info("reusing up-to-date id file %s (%d tokens)", out, existing.num_tokens)
                    return existing
                logger.info("re-encoding %s: it was made from another text, vocabulary or setting", out)
        counts = _write_ids(src, vocab, out, lowercase=lowercase)
        meta = {**wanted, **counts}
        side = _sidecar(out)
        side_tmp = side.with_name(f"{side.name}.tmp.{os.getpid()}")
        side_tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(side_tmp, side)
        logger.info(
            "encoded %s → %s: %d sentences, %d tokens, %d OOV",
            src, out, counts["num_sentences"], counts["num_tokens"], counts["num_oov"],
        )
        return cls.open(out)

    # ----------------------------------------------------------------- training examples

    def examples(self, positions: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
        """n-gram examples predicting the tokens at ``positions`` (indices into ``ids``).

        Returns ``contexts`` int64 (B, order-1), oldest word first, and ``targets`` int64
        (B,). A context never crosses the previous sentence's ``</s>``: those slots, and
        slots before the start of the corpus, hold ``<s>``.
        """
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)  # (B,)
        if pos.size and (pos.min() < 0 or pos.max() >= self.num_tokens):
            raise IndexError(f"positions must lie in [0, {self.num_tokens})")
        targets = self.ids[pos].astype(np.int64)  # (B,)
        n = order - 1
        if n == 0:
            return np.empty((pos.size, 0), dtype=np.int64), targets
        offsets = np.arange(-n, 0, dtype=np.int64)  # (n,) oldest first
        idx = pos[:, None] + offsets[None, :]  # (B, n)
        before_start = idx < 0
        ctx = self.ids[np.maximum(idx, 0)].astype(np.int64)  # (B, n)
        # A slot is cut off when it, or any slot to its right, is a </s> or before the corpus.
        stop = (ctx == EOS_ID) | before_start  # (B, n)
        cut = np.logical_or.accumulate(stop[:, ::-1], axis=1)[:, ::-1]
        ctx[cut] = BOS_ID
        return ctx, targets

    # ----------------------------------------------------------------- statistics

    def _chunks(self) -> Iterator[np.ndarray]:
        for start in range(0, self.num_tokens, _COUNT_CHUNK):
            yield np.asarray(self.ids[start : start + _COUNT_CHUNK])

    def unigram_counts(self, vocab_size: int) -> np.ndarray:
        """How often each id occurs (int64, length ``vocab_size``; ``</s>`` once per sentence)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for chunk in self._chunks():
            c = np.bincount(chunk, minlength=vocab_size)
            if c.size > vocab_size:
                raise CorpusError(f"id {int(chunk.max())} is outside a vocabulary of {vocab_size}", str(self.path))
            counts += c
        return counts

    def bigram_counts(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sparse counts of adjacent word pairs within sentences, ``<s>`` before each first word.

        Returns ``(left, right, count)`` int64 arrays sorted by ``(left, right)``; each
        sentence contributes ``<s> w1``, ``w1 w2``, ..., ``wn </s>`` (``</s>`` is never a
        left word, ``<s>`` never a right word).
        """
        V = int(vocab_size)
        keys: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        prev_last = BOS_ID  # the word before the first token: a sentence start
        for chunk in self._chunks():
            if chunk.size and int(chunk.max()) >= V:
                raise CorpusError(f"id {int(chunk.max())} is outside a vocabulary of {V}", str(self.path))
            right = chunk.astype(np.int64)
            left = np.empty_like(right)
            left[0] = prev_last
            left[1:] = right[:-1]
            left[left == EOS_ID] = BOS_ID
            prev_last = BOS_ID if right[-1] == EOS_ID else int(right[-1])
            k, c = np.unique(left * V + right, return_counts=True)
            keys.append(k)
            vals.append(c.astype(np.int64))
            # merge once the pending chunks outweigh the merged counts: memory stays within a
            # small multiple of the number of distinct bigrams, however long the corpus
            if len(keys) > 2 and sum(x.size for x in keys[1:]) > max(keys[0].size, _COUNT_CHUNK):
                merged_key, merged_cnt = _merge_counts(keys, vals)
                keys, vals = [merged_key], [merged_cnt]
        key, cnt = _merge_counts(keys, vals)
        return key // V, key % V, cnt

    def shard(self, rank: int, world_size: int) -> range:
        """The contiguous range of positions data-parallel ``rank`` of ``world_size`` reads.

        The ranges of ranks 0..world_size-1 cover every position once, in order, and their
        lengths differ by at most one.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        n = self.num_tokens
        return range(rank * n // world_size, (rank + 1) * n // world_size)


def _merge_counts(keys: list[np.ndarray], vals: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sum counts of equal keys over several (sorted unique key, count) arrays."""
    key = np.concatenate(keys)
    cnt = np.concatenate(vals)
    if len(keys) > 1:
        key, inverse = np.unique(key, return_inverse=True)
        cnt = np.bincount(inverse, weights=cnt, minlength=key.size).astype(np.int64)
    return key, cnt


def _write_ids(src: Path, vocab: Vocabulary, out: Path, *, lowercase: bool) -> dict[str, int]:
    """Write the ids of ``src`` to ``out`` (via a temporary file); return the counts."""
    index = {w: i for i, w in enumerate(vocab.words)}
    for special in (BOS, EOS):  # not words of a sentence: read as <unk>
        index.pop(special, None)
    get = index.get
    num_sentences = num_tokens = num_oov = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp.{os.getpid()}")
    buf: list[int] = []
    try:
        with open(tmp, "wb") as f:
            for tokens in read_sentences(src, lowercase=lowercase):
                buf.extend([get(t, UNK_ID) for t in tokens])
                buf.append(EOS_ID)
                num_sentences += 1
                if len(buf) >= _CHUNK_TOKENS:
                    arr = np.array(buf, dtype="<u4")
                    num_oov += int(np.count_nonzero(arr == UNK_ID))
                    num_tokens += arr.size
                    arr.tofile(f)
                    buf.clear()
            if buf:
                arr = np.array(buf, dtype="<u4")
                num_oov += int(np.count_nonzero(arr == UNK_ID))
                num_tokens += arr.size
                arr.tofile(f)
        if num_sentences == 0:
            raise CorpusError("empty: no tokens", str(src))
        # Drop the old sidecar first: an old description must never vouch for new ids.
        _sidecar(out).unlink(missing_ok=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"num_sentences": num_sentences, "num_tokens": num_tokens, "num_oov": num_oov}
