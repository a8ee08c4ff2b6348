"""lm.corpus: reading texts, the memory-mapped id file and n-gram examples."""

from __future__ import annotations

import gzip
import json
import lzma
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nlmserve.common.errors import CorpusError
from nlmserve.lm.corpus import CorpusIds, count_words, read_sentences
from nlmserve.lm.vocab import BOS_ID, EOS_ID, UNK_ID, Vocabulary


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- reading


def test_bad_bytes_error_names_file_and_line(tmp_path: Path) -> None:
    p = _write(tmp_path / "bad.txt", b"a b c\n\nd e\nf \xff g\nh\n")
    it = read_sentences(p)
    assert next(it) == ["a", "b", "c"]  # streamed: lines before the bad one come out first
    assert next(it) == ["d", "e"]
    with pytest.raises(CorpusError) as exc:
        next(it)
    assert f"{p}:4:" in str(exc.value) and exc.value.line == 4 and exc.value.path == str(p)


def test_bad_bytes_in_xz_error_names_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.xz"
    with lzma.open(p, "wb") as f:
        f.write(b"ok line\n" * 5 + b"\xc3\x28 broken\n")
    with pytest.raises(CorpusError, match=r"bad\.xz:6:"):
        count_words(p)


def test_truncated_compressed_file_is_named(tmp_path: Path) -> None:
    whole = gzip.compress(b"the house\n" * 2000)
    p = _write(tmp_path / "cut.gz", whole[: len(whole) // 2])
    with pytest.raises(CorpusError, match="cut.gz"):
        count_words(p)


def test_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    p = _write(tmp_path / "bom.txt", "\ufeffthe house\nthe\n".encode())
    assert list(read_sentences(p)) == [["the", "house"], ["the"]]


def test_missing_file_is_named(tmp_path: Path, vocab: Vocabulary) -> None:
    p = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match="nope.txt"):
        list(read_sentences(p))
    with pytest.raises(CorpusError, match="nope.txt"):
        CorpusIds.encode(p, vocab, tmp_path / "x.ids")


def test_empty_input_is_an_error(tmp_path: Path, vocab: Vocabulary) -> None:
    p = _write(tmp_path / "empty.txt", b"\n  \n\t\n")
    assert list(read_sentences(p)) == []
    with pytest.raises(CorpusError, match="empty"):
        count_words(p)
    with pytest.raises(CorpusError, match="empty"):
        CorpusIds.encode(p, vocab, tmp_path / "e.ids")
    assert not (tmp_path / "e.ids").exists() and not (tmp_path / "e.ids.json").exists()


def test_plain_gz_xz_read_alike_and_lowercase(tmp_path: Path, train_small_path: Path) -> None:
    data = train_small_path.read_bytes()[:200_000]
    data = data[: data.rindex(b"\n") + 1]
    plain = _write(tmp_path / "t.txt", data)
    with gzip.open(tmp_path / "t.gz", "wb") as f:
        f.write(data)
    with lzma.open(tmp_path / "t.xz", "wb") as f:
        f.write(data)
    expected = [line.split() for line in data.decode("utf-8").splitlines() if line.split()]
    for p in (plain, tmp_path / "t.gz", tmp_path / "t.xz"):
        assert list(read_sentences(p)) == expected
    mixed = _write(tmp_path / "m.txt", "The ÉU  said\r\n".encode())
    assert list(read_sentences(mixed, lowercase=True)) == [["the", "éu", "said"]]
    assert list(read_sentences(mixed)) == [["The", "ÉU", "said"]]


def test_count_words_matches_counter(train_small_path: Path) -> None:
    counts, n = count_words(train_small_path)
    lines = [l.split() for l in train_small_path.read_text(encoding="utf-8").splitlines()]
    assert n == sum(1 for l in lines if l) == 3000
    assert counts == Counter(t for l in lines for t in l)


# ----------------------------------------------------------------------------- id file


def test_round_trip_text_ids_words(corpus: CorpusIds, vocab: Vocabulary, train_small_path: Path) -> None:
    sentences = list(read_sentences(train_small_path))
    ids = np.asarray(corpus.ids)
    assert ids.dtype == np.uint32 and isinstance(corpus.ids, np.memmap)
    ends = np.flatnonzero(ids == EOS_ID)
    assert ends.size == corpus.num_sentences == len(sentences)
    assert corpus.num_tokens == ids.size == sum(len(s) + 1 for s in sentences)
    expected_oov = sum(1 for s in sentences for t in s if t not in vocab)
    assert corpus.num_oov == expected_oov > 0
    starts = np.concatenate([[0], ends[:-1] + 1])
    for s, (a, b) in enumerate(zip(starts, ends)):
        words = vocab.decode(ids[a:b])
        assert words == [t if t in vocab else "<unk>" for t in sentences[s]]
    assert BOS_ID not in ids


def test_literal_specials_in_text_are_unknown(tmp_path: Path) -> None:
    v = Vocabulary(["a", "b"])
    p = _write(tmp_path / "s.txt", b"a <s> b </s>\n<unk> b\n")
    c = CorpusIds.encode(p, v, tmp_path / "s.ids")
    assert list(c.ids) == [3, UNK_ID, 4, UNK_ID, EOS_ID, UNK_ID, 4, EOS_ID]
    assert (c.num_sentences, c.num_tokens, c.num_oov) == (2, 8, 3)


def test_encode_reuses_up_to_date_file_and_redoes_stale(tmp_path: Path, vocab: Vocabulary) -> None:
    src = _write(tmp_path / "t.txt", b"the european parliament\nthe commission\n")
    out = tmp_path / "ids" / "t.ids"
    first = CorpusIds.encode(src, vocab, out)
    meta = json.loads((tmp_path / "ids" / "t.ids.json").read_text())
    assert meta["vocab_sha256"] == vocab.sha256() and meta["num_tokens"] == 7
    mtime = out.stat().st_mtime_ns
    again = CorpusIds.encode(src, vocab, out)
    assert out.stat().st_mtime_ns == mtime and again.num_tokens == first.num_tokens
    # another vocabulary → re-encoded with other ids
    small = Vocabulary(["the"])
    other = CorpusIds.encode(src, small, out)
    assert list(other.ids) == [3, 0, 0, EOS_ID, 3, 0, EOS_ID]
    # the source changes (size and mtime) → re-encoded
    _write(src, b"the commission\n")
    os.utime(src, ns=(1_000_000_000, 1_000_000_000))
    assert CorpusIds.encode(src, small, out).num_tokens == 3
    # lowercasing is part of what the ids were made from
    _write(src, b"THE Commission\n")
    assert list(CorpusIds.encode(src, small, out).ids) == [0, 0, EOS_ID]
    assert list(CorpusIds.encode(src, small, out, lowercase=True).ids) == [3, 0, EOS_ID]
    assert sorted(p.name for p in out.parent.iterdir()) == ["t.ids", "t.ids.json"]  # no temporaries left


def test_open_rejects_truncated_file(tmp_path: Path, vocab: Vocabulary) -> None:
    src = _write(tmp_path / "t.txt", b"the european parliament\n")
    out = tmp_path / "t.ids"
    CorpusIds.encode(src, vocab, out)
    out.write_bytes(out.read_bytes()[:-4])
    with pytest.raises(CorpusError, match="t.ids"):
        CorpusIds.open(out)
    assert CorpusIds.encode(src, vocab, out).num_tokens == 4  # a damaged file is re-encoded
    (tmp_path / "t.ids.json").unlink()
    with pytest.raises(CorpusError, match="sidecar"):
        CorpusIds.open(out)


# ----------------------------------------------------------------------------- examples


def _slow_examples(ids: np.ndarray, positions: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference: walk left from each position until order-1 words or a sentence start."""
    ctxs, tgts = [], []
    for p in positions:
        ctx = []
        q = int(p) - 1
        while len(ctx) < order - 1:
            if q < 0 or ids[q] == EOS_ID:
                break
            ctx.append(int(ids[q]))
            q -= 1
        ctx = [BOS_ID] * (order - 1 - len(ctx)) + ctx[::-1]
        ctxs.append(ctx)
        tgts.append(int(ids[p]))
    return np.array(ctxs, dtype=np.int64).reshape(len(positions), order - 1), np.array(tgts, dtype=np.int64)


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5, 7])
def test_examples_match_slow_reference(corpus: CorpusIds, order: int) -> None:
    ids = np.asarray(corpus.ids)
    rng = np.random.default_rng(order)
    ends = np.flatnonzero(ids == EOS_ID)
    # random positions plus every kind of boundary: corpus start, sentence starts and the
    # word after them, </s> positions, the last token
    positions = np.concatenate([
        rng.integers(0, corpus.num_tokens, 3000),
        [0, 1, 2, corpus.num_tokens - 1],
        ends[:200] + 1, ends[:200] + 2, ends[:200],
    ])
    positions = positions[positions < corpus.num_tokens]
    ctx, tgt = corpus.examples(positions, order)
    ref_ctx, ref_tgt = _slow_examples(ids, positions, order)
    assert ctx.dtype == np.int64 and tgt.dtype == np.int64
    assert ctx.shape == (positions.size, order - 1)
    np.testing.assert_array_equal(tgt, ref_tgt)
    np.testing.assert_array_equal(ctx, ref_ctx)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(["a", "b", "c", "zz"]), min_size=1, max_size=6), min_size=1, max_size=8),
    st.integers(1, 7),
)
def test_examples_on_random_sentences(tmp_path_factory: pytest.TempPathFactory, sentences: list[list[str]], order: int) -> None:
    tmp = tmp_path_factory.mktemp("h")
    text = tmp / "s.txt"
    text.write_text("".join(" ".join(s) + "\n" for s in sentences), encoding="utf-8")
    corpus = CorpusIds.encode(text, Vocabulary(["a", "b", "c"]), tmp / "s.ids")
    ids = np.asarray(corpus.ids)
    everywhere = np.arange(corpus.num_tokens)
    ctx, tgt = corpus.examples(everywhere, order)
    ref_ctx, ref_tgt = _slow_examples(ids, everywhere, order)
    np.testing.assert_array_equal(ctx, ref_ctx)
    np.testing.assert_array_equal(tgt, ref_tgt)


def test_examples_golden_tiny(tmp_path: Path) -> None:
    v = Vocabulary(["a", "b", "c"])  # a=3 b=4 c=5
    p = _write(tmp_path / "g.txt", b"a b c\nc\nb a\n")
    c = CorpusIds.encode(p, v, tmp_path / "g.ids")
    assert list(c.ids) == [3, 4, 5, 2, 5, 2, 4, 3, 2]
    ctx, tgt = c.examples(np.array([0, 3, 4, 5, 7]), 3)
    assert ctx.tolist() == [[1, 1], [4, 5], [1, 1], [1, 5], [1, 4]]
    assert tgt.tolist() == [3, 2, 5, 2, 3]
    with pytest.raises(IndexError):
        c.examples(np.array([9]), 3)


# ----------------------------------------------------------------------------- statistics


def test_unigram_and_bigram_counts(corpus: CorpusIds, vocab: Vocabulary) -> None:
    ids = np.asarray(corpus.ids).astype(np.int64)
    uni = corpus.unigram_counts(len(vocab))
    assert uni.dtype == np.int64 and uni.shape == (len(vocab),)
    assert uni.tolist() == np.bincount(ids, minlength=len(vocab)).tolist()
    assert uni[EOS_ID] == corpus.num_sentences and uni[BOS_ID] == 0
    left, right, count = corpus.bigram_counts(len(vocab))
    ref: Counter[tuple[int, int]] = Counter()
    prev = BOS_ID
    for w in ids.tolist():
        ref[(prev, w)] += 1
        prev = BOS_ID if w == EOS_ID else w
    assert dict(zip(zip(left.tolist(), right.tolist()), count.tolist())) == ref
    assert np.all(np.diff(left * len(vocab) + right) > 0)  # sorted, unique
    assert count.sum() == corpus.num_tokens and not np.any(right == BOS_ID) and not np.any(left == EOS_ID)


def test_bigram_counts_across_chunks(corpus: CorpusIds, vocab: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    import nlmserve.lm.corpus as corpus_module

    whole = corpus.bigram_counts(len(vocab))
    monkeypatch.setattr(corpus_module, "_COUNT_CHUNK", 997)  # chunk borders inside sentences
    chunked = corpus.bigram_counts(len(vocab))
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(corpus.unigram_counts(len(vocab)), np.bincount(corpus.ids, minlength=len(vocab)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_shards_cover_positions_once(corpus: CorpusIds, world_size: int) -> None:
    shards = [corpus.shard(r, world_size) for r in range(world_size)]
    assert shards[0].start == 0 and shards[-1].stop == corpus.num_tokens
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        corpus.shard(world_size, world_size)
