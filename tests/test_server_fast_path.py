"""The CPU fast path the server scores with (``LanguageModel.score_prepared``) equals the network.

The reference is ``NeuralLM.log_prob``, the plain torch forward pass. Batch sizes on both
sides of the numpy/torch switch (``TINY_ROWS``), mixed normalised and raw rows, a model with
full context matrices, a hidden layer and tanh, and weights changed in place after loading.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from nlmserve.lm.config import ModelConfig
from nlmserve.lm.model import NeuralLM
from nlmserve.lm.scoring import TINY_ROWS
from nlmserve.wire.ngrams import canonical_rows

from support import dev_ngrams

TOL = 1e-5


@pytest.fixture(scope="module")
def rows(tiny_lm: Any) -> np.ndarray:
    """Canonical n-gram rows (T, order) of 30 real dev sentences."""
    return canonical_rows(dev_ngrams(tiny_lm, 0, 30), tiny_lm.order, len(tiny_lm.vocab))


def reference(lm: Any, rows: np.ndarray, normalized: bool) -> np.ndarray:
    with torch.inference_mode():
        ctx, target = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, -1].copy())
        return lm.net.log_prob(ctx, target, normalized=normalized).numpy()  # type: ignore[no-any-return]


def check(lm: Any, rows: np.ndarray) -> None:
    norm, raw = reference(lm, rows, True), reference(lm, rows, False)
    for n in (1, 2, TINY_ROWS, TINY_ROWS + 1, 200, len(rows)):
        got = lm.score_prepared(rows[:n, :-1], rows[:n, -1], np.ones(n, dtype=bool))
        np.testing.assert_allclose(got, norm[:n], atol=TOL, rtol=0, err_msg=f"batch {n}")
        mixed = np.arange(n) % 3 == 1
        got = lm.score_prepared(rows[:n, :-1], rows[:n, -1], mixed)
        np.testing.assert_allclose(got, np.where(mixed, norm[:n], raw[:n]), atol=TOL, rtol=0, err_msg=f"mixed {n}")


def test_fast_path_equals_the_network(tiny_lm: Any, rows: np.ndarray) -> None:
    assert len(rows) > 300
    check(tiny_lm, rows)
    # Real probabilities: the full distribution of a context sums to one.
    with torch.inference_mode():
        full = tiny_lm.net.full_log_probs(torch.from_numpy(rows[:3, :-1].copy())).exp().sum(-1)
    np.testing.assert_allclose(full.numpy(), 1.0, atol=1e-4)


def test_fast_path_with_full_context_hidden_layer_and_tanh(tiny_lm: Any, rows: np.ndarray) -> None:
    cfg = tiny_lm.config
    other = ModelConfig(vocab_size=cfg.vocab_size, order=cfg.order, dim=cfg.dim, context="full", hidden=12,
                        activation="tanh", output="class", num_classes=cfg.num_classes)
    torch.manual_seed(3)
    lm = copy.copy(tiny_lm)
    lm.net = NeuralLM(other, tiny_lm.classes.word_class).eval()
    lm.config = other
    lm._fast = None
    check(lm, rows)


def test_tables_follow_weights_changed_in_place(tiny_lm: Any, rows: np.ndarray) -> None:
    lm = copy.copy(tiny_lm)
    lm.net = copy.deepcopy(tiny_lm.net)
    lm._fast = None
    before = lm.score_prepared(rows[:50, :-1], rows[:50, -1], np.ones(50, dtype=bool))
    with torch.no_grad():
        lm.net.output.word_embed.mul_(1.5)
        lm.net.embed.weight.add_(0.01)
    after = lm.score_prepared(rows[:50, :-1], rows[:50, -1], np.ones(50, dtype=bool))
    assert np.abs(after - before).max() > 1e-3
    check(lm, rows)


def test_scores_beyond_exp_range_fall_back_to_the_shifted_sum(tiny_lm: Any, rows: np.ndarray) -> None:
    """Word scores of several hundred nats overflow exp in float32: those rows are recomputed."""
    lm = copy.copy(tiny_lm)
    lm.net = copy.deepcopy(tiny_lm.net)
    lm._fast = None
    with torch.no_grad():
        lm.net.output.word_bias.add_(150.0)  # every in-class sum overflows without the shift
        lm.net.output.word_embed.mul_(40.0)
    want = reference(lm, rows, True)
    assert np.isfinite(want).all()
    for n in (TINY_ROWS + 1, len(rows)):
        got = lm.score_prepared(rows[:n, :-1], rows[:n, -1], np.ones(n, dtype=bool))
        np.testing.assert_allclose(got, want[:n], rtol=1e-5, atol=1e-4)
