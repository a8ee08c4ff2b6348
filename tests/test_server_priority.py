"""Small requests are served ahead of queued large ones; large ones are sliced to fill batches."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine

from support import dev_ngrams

TOL = 1e-5


@pytest.fixture(scope="module")
def dev_ids(tiny_lm: Any) -> np.ndarray:
    """The n-grams (T, order) of the first 60 real dev sentences, as the model sees them."""
    ids = dev_ngrams(tiny_lm, 0, 60)
    assert len(ids) >= 800
    return ids


class RecordingScorer:
    """The real scorer; records each batch's size and holds the first batch until the gate opens."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sizes: list[int] = []

    def score(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        self.entered.set()
        self.gate.wait(10)
        self.sizes.append(len(ids))
        return self.scorer.score(ids, normalized)  # type: ignore[no-any-return]


def _run(tiny_lm: Any, dev_ids: np.ndarray, priority: int) -> tuple[list[str], list[int], dict[str, np.ndarray]]:
    """A 1-n-gram request holds the worker; then a 640-n-gram request and a 1-n-gram request
    are queued, in that order. Returns the order in which they finished, the batch sizes and
    the answers."""
    engine = Engine(tiny_lm, ServerConfig(model="(in-process)", max_batch_ngrams=64, priority_ngrams=priority,
                                          max_delay_us=0))
    rec = RecordingScorer(engine.scorer)
    engine.scorer = rec  # type: ignore[assignment]
    done: list[str] = []
    futures: dict[str, Future[np.ndarray]] = {}
    try:
        futures["first"] = engine.submit_ngrams(dev_ids[:1])
        assert rec.entered.wait(10)
        futures["large"] = engine.submit_ngrams(dev_ids[:640])
        futures["small"] = engine.submit_ngrams(dev_ids[700:701])
        def finished(name: str) -> Any:
            return lambda _: done.append(name)

        for name in ("large", "small"):
            futures[name].add_done_callback(finished(name))
        rec.gate.set()
        answers = {name: f.result(30) for name, f in futures.items()}
    finally:
        rec.gate.set()
        engine.shutdown()
    return done, rec.sizes, answers


def test_small_request_is_served_before_queued_large_one_and_batches_stay_full(
        tiny_lm: Any, dev_ids: np.ndarray) -> None:
    done, sizes, answers = _run(tiny_lm, dev_ids, priority=8)
    assert done == ["small", "large"]
    # The small request and the first 63 rows of the large one share the second batch; the
    # large one is sliced so that every batch is full, its last row goes alone.
    assert sizes == [1] + [64] * 10 + [1]
    np.testing.assert_allclose(answers["large"], tiny_lm.score_ngrams(dev_ids[:640]), atol=TOL, rtol=0)
    np.testing.assert_allclose(answers["small"], tiny_lm.score_ngrams(dev_ids[700:701]), atol=TOL, rtol=0)
    np.testing.assert_allclose(answers["first"], tiny_lm.score_ngrams(dev_ids[:1]), atol=TOL, rtol=0)


def test_without_priority_the_queue_is_first_come_first_served(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    done, sizes, answers = _run(tiny_lm, dev_ids, priority=0)
    assert done == ["large", "small"]
    assert sizes == [1] + [64] * 10 + [1]
    np.testing.assert_allclose(answers["large"], tiny_lm.score_ngrams(dev_ids[:640]), atol=TOL, rtol=0)


def test_split_parts_keep_their_order_with_a_batch_limit_that_does_not_divide(
        tiny_lm: Any, dev_ids: np.ndarray) -> None:
    """Small requests interleaved with two large ones: every answer in its own order."""
    engine = Engine(tiny_lm, ServerConfig(model="(in-process)", max_batch_ngrams=50, priority_ngrams=3))
    try:
        futures = []
        for k in range(6):
            futures.append((dev_ids[k * 130 : k * 130 + 127], engine.submit_ngrams(dev_ids[k * 130 : k * 130 + 127])))
            futures.append((dev_ids[k : k + 3], engine.submit_ngrams(dev_ids[k : k + 3])))
        for rows, future in futures:
            np.testing.assert_allclose(future.result(30), tiny_lm.score_ngrams(rows), atol=TOL, rtol=0)
    finally:
        engine.shutdown()


def test_priority_ngrams_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="priority_ngrams"):
        ServerConfig(model="m", priority_ngrams=-1)
