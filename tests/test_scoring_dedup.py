"""A batch's shared work is done once (``nlmserve.lm.dedup``) and changes no score.

Decoder-like batches (a few contexts, many targets each, targets of one class, identical
rows, mixed normalised and unnormalised rows) score what each row scores alone through the
same API, within 1e-5: on the numpy tiny path, the CPU tables' torch path, the
device-agnostic torch path, the server's context cache, and models with direct n-gram
features, full context and a hidden layer, one-word classes, softmax and tree outputs. The
plan's counts are checked by hand, and two rows of one context and class are shown to
compute one normaliser.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

import nlmserve.lm.cpu as cpu
import nlmserve.lm.scoring as scoring
from nlmserve.lm import dedup
from nlmserve.lm.dedup import distinct_rows, plan_batch
from nlmserve.lm.config import ModelConfig
from nlmserve.lm.model import NeuralLM
from nlmserve.wire.ngrams import BOS_ID, canonical_rows
from nlmserve.lm.scoring import TINY_ROWS
from nlmserve.lm.trees import huffman_tree
from nlmserve.lm.cache import Scorer

TOL = 1e-5


# ---------------------------------------------------------------------- the plan by hand
def test_distinct_rows_by_hand() -> None:
    cols = np.array([[3, 1], [0, 9], [3, 1], [0, 2], [3, 1]])
    some, of = distinct_rows(cols)
    assert cols[some].tolist() == [[0, 2], [0, 9], [3, 1]]  # lexicographic
    assert of.tolist() == [2, 1, 2, 0, 2]
    e_some, e_of = distinct_rows(np.zeros((0, 3), dtype=np.int64))
    assert e_some.size == 0 and e_of.size == 0


@pytest.mark.parametrize("high", [2, 40_000, 1 << 30, 1 << 62])  # the widest need ranks to fit 64 bits
def test_distinct_rows_are_exact(high: int) -> None:
    rng = np.random.default_rng(high % 1000)
    base = rng.integers(0, high, size=(300, 4), dtype=np.int64)
    cols = base[rng.integers(0, 300, size=2000)]  # many repeats
    cols[::7, 2] = cols[::7, 2] ^ 1  # rows differing in one low bit of one column
    some, of = distinct_rows(cols)
    want = np.unique(cols, axis=0)
    assert cols[some].tolist() == want.tolist()
    assert (cols[some][of] == cols).all()


def test_plan_counts_by_hand() -> None:
    # rows: (7 8 → 20), (7 8 → 21), (7 8 → 20) again, (9 4 → 20); 20 and 21 in class 5
    ctx = np.array([[7, 8], [7, 8], [7, 8], [9, 4]])
    target = np.array([20, 21, 20, 20])
    cls = np.array([5, 5, 5, 5])
    plan = plan_batch(ctx, target, cls, np.ones(4, dtype=bool))
    assert (plan.contexts.size, plan.rows.size, plan.norm_contexts.size, plan.pair_class.size) == (2, 3, 2, 2)
    assert plan.row_of[0] == plan.row_of[2] != plan.row_of[1]
    assert plan.pair_of[0] == plan.pair_of[1] == plan.pair_of[2] != plan.pair_of[3]
    # only rows 0 and 2 normalised: one context, one pair
    plan = plan_batch(ctx, target, cls, np.array([True, False, True, False]))
    assert plan.norm.tolist() == [0, 2]
    assert (plan.norm_contexts.size, plan.pair_class.size) == (1, 1)
    assert plan.norm_context_of.tolist() == [0, 0] and plan.pair_of.tolist() == [0, 0]
    assert target[plan.rows].tolist() == [20, 21, 20]  # distinct rows: (7 8 20), (7 8 21), (9 4 20)
    raw = np.array([-1.0, -2.0, -3.0], dtype=np.float32)
    got = plan.compose(raw, np.array([0.5]), np.array([0.25]))
    assert got.tolist() == [-1.75, -2.0, -1.75, -3.0]
    none = plan_batch(ctx, target, cls, np.zeros(4, dtype=bool))
    assert none.norm.size == 0 and none.pair_class.size == 0


def test_small_batches_are_planned_as_large_ones() -> None:
    # The dictionary planner of small batches finds the same sets as the sorting one (which
    # lists them in another order): same sizes, and every row maps to its own context,
    # row and (context, class) pair.
    rng = np.random.default_rng(3)
    for n in [1, 2, 5, 17, dedup.SMALL_BATCH]:
        for _ in range(20):
            ctx = rng.integers(0, 3, size=(n, 2))
            target = rng.integers(0, 4, size=n)
            cls = target % 2
            normalized = rng.random(n) < 0.7
            small = dedup._plan_small(ctx, target, cls, normalized)
            large = dedup._plan_sorted(ctx, target, cls, normalized)
            for plan in (small, large):
                assert (ctx[plan.contexts][plan.row_context][plan.row_of] == ctx).all()
                assert (target[plan.rows][plan.row_of] == target).all()
                assert plan.norm.tolist() == np.flatnonzero(normalized).tolist()
                norm_ctx = ctx[plan.contexts][plan.norm_contexts][plan.norm_context_of]
                assert (norm_ctx == ctx[plan.norm]).all()
                assert (ctx[plan.contexts][plan.pair_context][plan.pair_of] == ctx[plan.norm]).all()
                assert (plan.pair_class[plan.pair_of] == cls[plan.norm]).all()
            sizes = [(p.contexts.size, p.rows.size, p.norm_contexts.size, p.pair_class.size) for p in (small, large)]
            assert sizes[0] == sizes[1]


# ---------------------------------------------------------------------- decoder-like batches
def decoder_batch(lm: Any, hypotheses: int, targets: int, seed: int) -> np.ndarray:
    """Canonical rows: for each of ``hypotheses`` contexts, ``targets`` targets, some of one
    class, some repeated (as a decoder's expansions of one hypothesis)."""
    rng = np.random.default_rng(seed)
    V = len(lm.vocab)
    words = np.array([w for w in range(V) if w != BOS_ID])
    ctx = rng.choice(words, size=(hypotheses, lm.order - 1))
    ctx[0, :2] = BOS_ID  # a sentence start among them
    cls = lm._classes(words)
    rows: list[list[int]] = []
    for h in range(hypotheses):
        pick = rng.choice(words, size=targets)
        same = words[cls == cls[pick[0]]]
        pick[: targets // 3] = rng.choice(same, size=targets // 3)  # a third from one class
        pick[-2:] = pick[:2]  # repeated rows
        rows.extend(list(ctx[h]) + [w] for w in pick)
    out = np.array(rows, dtype=np.int64)
    return canonical_rows(out[rng.permutation(len(out))], lm.order, V)


def row_by_row(lm: Any, rows: np.ndarray, normalized: np.ndarray) -> np.ndarray:
    return np.array([lm.score_prepared(rows[i : i + 1, :-1], rows[i : i + 1, -1], normalized[i : i + 1])[0]
                     for i in range(len(rows))], dtype=np.float32)


def reference(lm: Any, rows: np.ndarray, normalized: np.ndarray) -> np.ndarray:
    """The network's own forward pass, row by row in one batch (no dedup)."""
    with torch.inference_mode():
        ctx, target = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, -1].copy())
        norm = lm.net.log_prob(ctx, target, normalized=True).numpy()
        raw = lm.net.log_prob(ctx, target, normalized=False).numpy()
    return np.where(normalized, norm, raw)  # type: ignore[no-any-return]


def check_batches(lm: Any, sizes: tuple[tuple[int, int], ...] = ((2, 5), (3, 11), (6, 40))) -> None:
    """Each batch size (hypotheses, targets), all normalised, none, and mixed, equals row by
    row and the network."""
    for seed, (h, t) in enumerate(sizes):
        rows = decoder_batch(lm, h, t, seed)
        n = len(rows)
        for normalized in (np.ones(n, dtype=bool), np.zeros(n, dtype=bool), np.arange(n) % 3 == 1):
            got = lm.score_prepared(rows[:, :-1], rows[:, -1], normalized)
            assert got.dtype == np.float32 and got.shape == (n,)
            np.testing.assert_allclose(got, row_by_row(lm, rows, normalized), atol=TOL, rtol=0,
                                       err_msg=f"{h}x{t}, {normalized.sum()} normalised")
            np.testing.assert_allclose(got, reference(lm, rows, normalized), atol=TOL, rtol=0)


def with_net(lm: Any, net: NeuralLM, **attrs: Any) -> Any:
    out = copy.copy(lm)
    out.net, out.config, out._fast = net.eval(), net.config, None
    for k, v in attrs.items():
        setattr(out, k, v)
    return out


def test_batch_sizes_cover_both_paths(tiny_lm: Any) -> None:
    assert len(decoder_batch(tiny_lm, 2, 5, 0)) <= TINY_ROWS < len(decoder_batch(tiny_lm, 3, 11, 1))


def test_tables_paths_equal_row_by_row(tiny_lm: Any) -> None:
    assert tiny_lm._tables() is not None
    check_batches(tiny_lm)


def test_device_agnostic_path_equals_row_by_row(tiny_lm: Any) -> None:
    lm = with_net(tiny_lm, tiny_lm.net, cpu_tables=False)
    assert lm._tables() is None
    check_batches(lm)


def test_full_context_hidden_layer_and_one_word_classes(tiny_lm: Any) -> None:
    cfg = tiny_lm.config
    wc = tiny_lm.classes.word_class.copy()
    for j, w in enumerate((3, 5, 8)):  # three words in classes of their own
        wc[w] = cfg.num_classes + j
    wc = np.unique(wc, return_inverse=True)[1]  # classes left empty dropped
    singles = [int(w) for w in range(len(wc)) if (wc == wc[w]).sum() == 1]
    assert singles
    other = ModelConfig(vocab_size=cfg.vocab_size, order=cfg.order, dim=cfg.dim, context="full", hidden=12,
                        activation="tanh", output="class", num_classes=int(wc.max()) + 1)
    torch.manual_seed(3)
    lm = with_net(tiny_lm, NeuralLM(other, wc))
    check_batches(lm)
    rows = decoder_batch(lm, 4, 12, 9)
    rows[:, -1][:20] = singles[0]  # one-word class targets, in one batch with others
    norm = np.ones(len(rows), dtype=bool)
    np.testing.assert_allclose(lm.score_prepared(rows[:, :-1], rows[:, -1], norm), reference(lm, rows, norm),
                               atol=TOL, rtol=0)


def test_scores_beyond_exp_range_with_shared_contexts(tiny_lm: Any) -> None:
    lm = with_net(tiny_lm, copy.deepcopy(tiny_lm.net))
    with torch.no_grad():
        lm.net.output.word_bias.add_(150.0)  # every in-class sum overflows without the shift
        lm.net.output.word_embed.mul_(40.0)
    for h, t in ((2, 5), (5, 30)):
        rows = decoder_batch(lm, h, t, h)
        norm = np.ones(len(rows), dtype=bool)
        got = lm.score_prepared(rows[:, :-1], rows[:, -1], norm)
        np.testing.assert_allclose(got, reference(lm, rows, norm), rtol=1e-5, atol=1e-4)


def test_direct_ngram_features(tiny_lm: Any) -> None:
    cfg = tiny_lm.config
    feat = ModelConfig(vocab_size=cfg.vocab_size, order=cfg.order, dim=cfg.dim, num_classes=cfg.num_classes,
                       ngram_class_table=101, ngram_word_table=211)
    torch.manual_seed(4)
    net = NeuralLM(feat, tiny_lm.classes.word_class)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    lm = with_net(tiny_lm, net)
    assert lm._tables() is None
    check_batches(lm)


@pytest.mark.parametrize("output", ["softmax", "tree"])
def test_softmax_and_tree_outputs(tiny_lm: Any, output: str) -> None:
    cfg = tiny_lm.config
    V = cfg.vocab_size
    extra: dict[str, Any] = {}
    tree = None
    if output == "tree":
        tree = huffman_tree(np.arange(V)[::-1] * 3 + 1)
        extra = {"tree_nodes": tree.num_nodes, "tree_method": tree.method}
    torch.manual_seed(5)
    net = NeuralLM(ModelConfig(vocab_size=V, order=cfg.order, dim=cfg.dim, output=output, **extra), tree=tree)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    lm = with_net(tiny_lm, net)
    check_batches(lm, ((2, 5), (3, 14)))


# ---------------------------------------------------------------------- normalisers computed once
def one_context_one_class(lm: Any, n: int) -> np.ndarray:
    """n rows of one context whose targets are all in one class (of at least two words)."""
    wc = lm.classes.word_class.copy()
    wc[BOS_ID] = -1
    k = int(np.flatnonzero(np.bincount(wc[wc >= 0]) >= 2)[0])
    words = np.flatnonzero(wc == k)[:2].tolist()
    the = lm.vocab.id("the")
    return canonical_rows(np.array([[the, words[i % 2]] for i in range(n)]), lm.order, len(lm.vocab))


@pytest.mark.parametrize("n", [3, TINY_ROWS + 8])  # two targets of one class, one repeated
def test_one_context_and_class_share_the_normalisers(tiny_lm: Any, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = one_context_one_class(tiny_lm, n)
    norm = np.ones(n, dtype=bool)
    plan = plan_batch(rows[:, :-1], rows[:, -1], tiny_lm._classes(rows[:, -1]), norm)
    assert (plan.contexts.size, plan.rows.size, plan.norm_contexts.size, plan.pair_class.size) == (1, 2, 1, 1)
    want = row_by_row(tiny_lm, rows, norm)
    calls: list[tuple[str, int]] = []
    lm = copy.copy(tiny_lm)
    real_mv, real_in, real_cn = cpu.mv, lm.in_class_log_normalizer, lm.class_log_normalizer

    def mv(a: np.ndarray, x: np.ndarray) -> np.ndarray:
        calls.append(("numpy in-class", 1))
        return real_mv(a, x)

    def in_class(r: torch.Tensor, cls: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(("in-class", r.shape[0]))
        return real_in(r, cls, ctx)

    def class_norm(r: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(("class", r.shape[0]))
        return real_cn(r, ctx)

    monkeypatch.setattr(cpu, "mv", mv)
    monkeypatch.setattr(lm, "in_class_log_normalizer", in_class)
    monkeypatch.setattr(lm, "class_log_normalizer", class_norm)
    got = lm.score_prepared(rows[:, :-1], rows[:, -1], norm)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert got[0] == got[2] and got[0] != got[1]
    if n <= TINY_ROWS:
        assert calls == [("numpy in-class", 1)]
    else:
        assert calls == [("class", 1), ("in-class", 1)]


# ---------------------------------------------------------------------- score_ngrams and the server cache
def test_score_ngrams_chunks_and_repeats(tiny_lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = decoder_batch(tiny_lm, 7, 30, 11)
    ids = np.concatenate([rows, rows[::3]])  # repeated rows across the input
    for normalized in (True, False):
        flags = np.full(len(ids), normalized)
        want = row_by_row(tiny_lm, ids, flags)
        np.testing.assert_allclose(tiny_lm.score_ngrams(ids, normalized=normalized), want, atol=TOL, rtol=0)
        monkeypatch.setattr(scoring, "CHUNK", 13)  # contexts straddle chunk boundaries
        np.testing.assert_allclose(tiny_lm.score_ngrams(ids, normalized=normalized), want, atol=TOL, rtol=0)
        monkeypatch.undo()


def test_scoring_bounds_count_each_pair_once(tiny_lm: Any) -> None:
    rows = one_context_one_class(tiny_lm, 50)
    first = tiny_lm._first_of_pairs(rows)
    assert first.sum() == 1
    width = int(np.bincount(tiny_lm.classes.word_class)[tiny_lm.classes.word_class[rows[0, -1]]])
    assert list(tiny_lm.net.output.scoring_bounds(rows[:, -1], budget=width * 10, max_rows=1000)) == [
        (a, a + 10) for a in range(0, 50, 10)]
    assert list(tiny_lm.net.output.scoring_bounds(rows[:, -1], budget=width * 10, max_rows=1000, counted=first)) == [(0, 50)]


def test_context_cache_counts_pairs_and_equals_direct(tiny_lm: Any) -> None:
    rows = one_context_one_class(tiny_lm, 6)
    norm = np.ones(6, dtype=bool)
    cached = Scorer(tiny_lm, 0, 16)
    first = cached.score(rows, norm)
    assert (cached.in_class_hits, cached.in_class_misses) == (0, 1)
    second = cached.score(rows, norm)
    assert (cached.in_class_hits, cached.in_class_misses) == (1, 1)
    assert cached.context_cache.hits == 1 and cached.context_cache.misses == 1
    direct = Scorer(tiny_lm, 0, 0).score(rows, norm)
    np.testing.assert_allclose(first, direct, atol=TOL, rtol=0)
    np.testing.assert_allclose(second, direct, atol=TOL, rtol=0)
    # decoder-like batches, mixed flags, a small cache that evicts
    cached = Scorer(tiny_lm, 0, 4)
    for seed in range(3):
        rows = decoder_batch(tiny_lm, 6, 25, seed)
        mixed = np.arange(len(rows)) % 4 != 0
        want = row_by_row(tiny_lm, rows, mixed)
        np.testing.assert_allclose(cached.score(rows, mixed), want, atol=TOL, rtol=0)
        np.testing.assert_allclose(cached.score(rows, mixed), want, atol=TOL, rtol=0)


def test_unnormalised_scores_do_not_depend_on_the_batch(tiny_lm: Any) -> None:
    """s_c + s_w of a row is the same number whatever rows share its batch (torch path)."""
    rows = decoder_batch(tiny_lm, 6, 40, 21)
    other = decoder_batch(tiny_lm, 5, 30, 22)
    n = 50
    alone = tiny_lm.score_prepared(rows[:n, :-1], rows[:n, -1], np.zeros(n, dtype=bool))
    mixed = np.concatenate([other, rows[:n], other[:7]])
    flags = np.arange(len(mixed)) % 2 == 0  # normalised rows around them too
    flags[len(other) : len(other) + n] = False
    got = tiny_lm.score_prepared(mixed[:, :-1], mixed[:, -1], flags)[len(other) : len(other) + n]
    assert got.tolist() == alone.tolist()
