"""The inference engine: owns the model on its device and micro-batches requests.

Callers (the gRPC event loop, or any thread) hand in id arrays and get futures; one worker
thread takes queued request parts, merges them up to ``max_batch_ngrams`` n-grams (waiting at most
``max_delay_us`` for requests known to be on their way), scores them in one forward pass
under ``torch.inference_mode``, and scatters the results back in order. Requests larger
than the batch limit are split into parts. Requests of at most ``priority_ngrams`` n-grams
have a queue of their own that goes first; the rows left in a batch are filled with a slice
of the oldest large request. The queue is bounded (``max_queue_ngrams``):
a request that does not fit raises ``OverloadedError`` at once. Parts whose deadline has
passed while queued are dropped and their request fails with ``RequestExpiredError``.

Hot reload: ``prepare`` checks and wraps a newly loaded model off the serving path, ``swap``
makes it the served one. Each queued part is pinned to the model state it was submitted
against, a batch only merges parts of one state, and the answer names that state's hash.

Interface, all that the servicers call: ``submit_ngrams``/``score_ngrams``, ``submit_sentences``/
``score_sentences``, ``check_health``, ``shutdown``; a list in, a list of the same length
out, same order, with the batching done here and not request by request.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Sequence, TypeVar

import numpy as np
import torch

from ..common.errors import (EngineStoppedError, ModelFileError, OverloadedError, RequestExpiredError,
                             UnsupportedModelError)
from ..wire.ngrams import BOS_ID, EOS_ID, canonical_rows, check_sentences, sentence_windows
from ..lm.protocol import RowScorer, ScoringModel
from ..lm.tables_file import FlatTables
from ..wire.logbase import ln_to_log10
from .config import ServerConfig
from .files import read_model, shown_path
from .metrics import ServerMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SentenceResult:
    """Per-token scores of one sentence (tokens, then ``</s>`` when eos)."""

    log_probs: np.ndarray  # float32 (T,)
    ngram_lengths: np.ndarray  # uint32 (T,)
    total: float  # sum of log_probs in float64


class _Request:
    """One caller's request: its output array, the parts still to score, and its future."""

    __slots__ = ("out", "remaining", "log10", "future")

    def __init__(self, n: int, parts: int, log10: bool) -> None:
        self.out = np.empty(n, dtype=np.float32)
        self.remaining = parts
        self.log10 = log10
        self.future: Future[np.ndarray] = Future()


@dataclass
class _Part:
    request: _Request
    ids: np.ndarray  # (n, order) int64, normalised
    offset: int
    normalized: bool
    deadline: float | None  # time.monotonic()
    enqueued: float
    state: "ModelState"  # the model that scores this part


def load_model(config: ServerConfig, path: str | None = None, reload_dir: str | None = None) -> ScoringModel:
    """The model file ``path`` (default ``config.model``) loaded on the configured device,
    read through one open of the path (server/files.py ``read_model``; ``reload_dir``: a
    caller's path, which must lie in that folder, no symlink followed below it).
    ModelFileError naming the file when it is not a regular file of at most
    ``max_model_bytes`` and of the size its header gives, or does not load."""
    from ..lm.scoring import LanguageModel

    path = config.model if path is None else path
    lm = LanguageModel(read_model(path, config.max_model_bytes, reload_dir), device=config.device,
                       cpu_tables=config.cpu_tables)
    log.info("loaded %s: order %s, %s words, device %s, hash %s",
             shown_path(path), lm.order, len(lm.vocab), lm.device, lm.model_hash)
    return lm


def export_cache_stats(metrics: ServerMetrics, state: "ModelState") -> None:
    """``state``'s cache counts into ``metrics``: the counters by what is new since the last
    export (they only go up), the entries as they are."""
    for name, (hits, misses, entries) in state.scorer.stats().items():
        last_h, last_m = state.exported.get(name, (0, 0))
        if hits > last_h:
            metrics.cache_hits.labels(cache=name).inc(hits - last_h)
        if misses > last_m:
            metrics.cache_misses.labels(cache=name).inc(misses - last_m)
        state.exported[name] = (hits, misses)
        metrics.cache_entries.labels(cache=name).set(entries)


class ModelState:
    """One served model and what serving it needs: a scorer with caches of its own, and its
    word index. Every queued part is pinned to the state it was submitted against, so a
    batch is always scored by one model and a reload never changes a request half-way."""

    def __init__(self, lm: ScoringModel, config: ServerConfig) -> None:
        self.lm = lm
        self.model_hash = lm.model_hash
        self.order = lm.order
        self.vocab_size = len(lm.vocab)
        self.self_normalized = lm.self_normalized
        self.lowercase = lm.lowercase
        self.words = lm.vocab.words
        self.index: dict[str, int] = {w: i for i, w in enumerate(self.words)}
        self.scorer: RowScorer = lm.cached_scorer(config.ngram_cache_size, config.context_cache_size)
        self.exported: dict[str, tuple[int, int]] = {}  # the caches' counts last sent to the metrics
        self._tables: FlatTables | str | None = None  # the tables, or why there are none
        self._tables_lock = threading.Lock()

    def scoring_tables(self) -> FlatTables:
        """The model's scoring tables as GetScoringTables streams them, made on the first
        call and kept with the model (a reload makes a new state); UnsupportedModelError
        when the model has none."""
        with self._tables_lock:
            if self._tables is None:
                try:
                    self._tables = FlatTables.of(self.lm.scoring_tables())
                except UnsupportedModelError as e:
                    self._tables = str(e)
            if isinstance(self._tables, str):
                raise UnsupportedModelError(self._tables)
            return self._tables


class Engine:
    """One model at a time, one batching worker. Thread-safe; ``submit_*`` return futures,
    ``score_*`` block; ``swap`` replaces the model between batches (hot reload)."""

    def __init__(self, lm: ScoringModel, config: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self._state = ModelState(lm, config)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Part] = collections.deque()  # large requests' parts
        self._small: collections.deque[_Part] = collections.deque()  # requests <= priority_ngrams
        self._queued_ngrams = 0
        self._arriving = 0
        self._busy = False  # a forward pass is running
        self._last_batch_requests = 1
        self._stopping = False
        self._healthy = True
        self._torch_threads = config.torch_threads or torch.get_num_threads()
        self._worker = threading.Thread(target=self._run, name="nlmserve-batcher", daemon=True)
        self._worker.start()
        if metrics is not None:
            self.attach_metrics(metrics)

    # The served model (the newest state; queued parts keep the state they were submitted with).
    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def lm(self) -> ScoringModel:
        return self._state.lm

    @property
    def order(self) -> int:
        return self._state.order

    @property
    def vocab_size(self) -> int:
        return self._state.vocab_size

    @property
    def self_normalized(self) -> bool:
        return self._state.self_normalized

    @property
    def scorer(self) -> RowScorer:
        return self._state.scorer

    @scorer.setter
    def scorer(self, scorer: RowScorer) -> None:
        self._state.scorer = scorer

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        """Report to ``metrics`` from now on (and publish the model-info gauge there)."""
        self.metrics = metrics
        self._publish_model(metrics, self._state)

    def _publish_model(self, metrics: ServerMetrics, state: ModelState) -> None:
        lm = state.lm
        metrics.model_info.clear()
        metrics.set_model(
            model_hash=state.model_hash, order=str(state.order), device=str(lm.device),
            objective=lm.objective, output_type=lm.output_type, vocab_size=str(state.vocab_size),
        )

    def prepare(self, lm: ScoringModel) -> ModelState:
        """Check that ``lm`` can replace the served model and build its state (off the serving path).

        The vocabulary, its lowercasing and the order must be those of the served model
        (clients pack ids with the vocabulary they fetched once); a few real n-grams must
        score to finite values. Raises ModelFileError otherwise.
        """
        cur = self._state
        if lm.order != cur.order:
            raise ModelFileError(f"order {lm.order} differs from the served model's {cur.order}")
        if lm.lowercase != cur.lowercase or lm.vocab.words != cur.words:
            raise ModelFileError("vocabulary differs from the served model's (restart the server to change it)")
        probe = np.full((4, cur.order), BOS_ID, dtype=np.int64)
        probe[:, -1] = np.arange(4) % max(cur.vocab_size, 1)
        probe[:, -1][probe[:, -1] == BOS_ID] = EOS_ID
        with torch.inference_mode():
            values = np.asarray(lm.score_ngrams(probe))
        if values.shape != (4,) or not np.isfinite(values).all():
            raise ModelFileError(f"the model scores non-finite values on a probe: {values.tolist()}")
        return ModelState(lm, self.config)

    def swap(self, state: ModelState) -> None:
        """Serve ``state`` from now on: parts submitted later use it (with its empty caches);
        parts already queued finish with the model they were submitted to."""
        with self._cond:
            old, self._state = self._state, state
        if self.metrics is not None:
            self._publish_model(self.metrics, state)
            for cache in ("ngram", "context", "in_class"):
                self.metrics.cache_entries.labels(cache=cache).set(0)
        log.info("model swapped: %s -> %s", old.model_hash, state.model_hash)

    @classmethod
    def load(cls, config: ServerConfig, metrics: ServerMetrics | None = None) -> "Engine":
        """Load the model file named in ``config`` on its device (ModelFileError if unreadable)."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        return cls(load_model(config), config, metrics)

    # -------------------------------------------------------------- public API
    def submit_ngrams(self, ids: np.ndarray, *, normalized: bool = True, log10: bool = False,
                      timeout: float | None = None, state: ModelState | None = None) -> Future[np.ndarray]:
        """Queue n-gram rows (N, n), 1 <= n <= order; the future gets float32 (N,), ln or log10.

        Raises at once InvalidRequestError (bad ids), OverloadedError (queue full) or
        EngineStoppedError. ``normalized=False`` gives the unnormalised score when the model
        is self-normalised, the exact normalised value otherwise. ``timeout``: seconds after
        which a part still queued is dropped (the future gets RequestExpiredError). ``state``:
        the model to score with (default: the served one; callers that mapped words with a
        state's vocabulary pass that state, and name its ``model_hash`` in their answer).
        """
        state = self._state if state is None else state
        with self._cond:
            self._arriving += 1
        try:
            rows = canonical_rows(ids, state.order, state.vocab_size)
        except BaseException:
            with self._cond:
                self._arriving -= 1
            raise
        return self._submit(rows, normalized or not state.self_normalized, log10, timeout, state)

    def try_score_now(self, ids: np.ndarray, *, normalized: bool = True, log10: bool = False,
                      state: ModelState | None = None) -> np.ndarray | None:
        """Score a small request in the calling thread when the engine is idle (nothing
        queued, no forward pass running, nobody on the way in), else None (then submit it).

        A lone client's request then costs no hand-over to the batching thread and back. The
        engine is marked busy meanwhile, so the batching thread (and its caches) wait for it,
        and a batch of the same rows scores the same values. Raises InvalidRequestError for
        bad ids, as :meth:`submit_ngrams` does.
        """
        state = self._state if state is None else state
        rows = canonical_rows(ids, state.order, state.vocab_size)
        with self._cond:
            if (self._busy or self._small or self._queue or self._arriving or self._stopping
                    or state is not self._state):
                return None
            self._busy = True
        try:
            n = rows.shape[0]
            norm = np.full(n, normalized or not state.self_normalized)
            t0 = time.perf_counter()
            with torch.inference_mode():
                scores = np.array(state.scorer.score(rows, norm), dtype=np.float32)
            m = self.metrics
            if m is not None:
                m.batch_size.observe(n)
                m.batch_requests.observe(1)
                m.inference_time.observe(time.perf_counter() - t0)
                m.ngrams_scored.inc(n)
                m.queue_delay.observe(0.0)
                export_cache_stats(m, state)
            if log10:
                ln_to_log10(scores)
            return scores
        finally:
            with self._cond:
                self._busy = False
                if self._small or self._queue or self._stopping:  # else the batching thread has nothing to do
                    self._cond.notify()

    def score_ngrams(self, ids: np.ndarray, *, normalized: bool = True, log10: bool = False,
                     timeout: float | None = None) -> np.ndarray:
        """Blocking :meth:`submit_ngrams`."""
        future = self.submit_ngrams(ids, normalized=normalized, log10=log10, timeout=timeout)
        return _wait(future, timeout)

    def submit_sentences(self, sentences: Sequence[np.ndarray], *, bos: bool = True, eos: bool = True,
                         normalized: bool = True, log10: bool = False, timeout: float | None = None,
                         state: ModelState | None = None) -> Future[list[SentenceResult]]:
        """Queue id sentences (``</s>`` appended when eos); the future gets one result per sentence."""
        state = self._state if state is None else state
        check_sentences(sentences, state.vocab_size)
        rows, lengths, counts = sentence_windows(sentences, state.order, bos=bos, eos=eos)
        inner = self.submit_ngrams(rows, normalized=normalized, log10=log10, timeout=timeout, state=state)
        outer: Future[list[SentenceResult]] = Future()

        def split(done: Future[np.ndarray]) -> None:
            error = done.exception()
            if error is not None:
                outer.set_exception(error)
                return
            scores = done.result()
            results, start = [], 0
            for t in counts.tolist():
                lp = scores[start : start + t]
                results.append(SentenceResult(lp, lengths[start : start + t], float(lp.astype(np.float64).sum())))
                start += t
            outer.set_result(results)

        inner.add_done_callback(split)
        return outer

    def score_sentences(self, sentences: Sequence[np.ndarray], *, bos: bool = True, eos: bool = True,
                        normalized: bool = True, log10: bool = False,
                        timeout: float | None = None) -> list[SentenceResult]:
        """Blocking :meth:`submit_sentences`."""
        future = self.submit_sentences(sentences, bos=bos, eos=eos, normalized=normalized, log10=log10,
                                       timeout=timeout)
        return _wait(future, timeout)

    def check_health(self) -> bool:
        """True while the worker runs and the model answers."""
        return self._healthy and self._worker.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the worker after the queued parts; later calls raise EngineStoppedError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._worker.join(timeout)
        log.info("engine stopped")

    def queue_depth(self) -> int:
        return self._queued_ngrams

    # -------------------------------------------------------------- queueing
    def _submit(self, rows: np.ndarray, normalized: bool, log10: bool, timeout: float | None,
                state: ModelState) -> Future[np.ndarray]:
        n = rows.shape[0]
        step = self.config.max_batch_ngrams
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        nparts = max(1, math.ceil(n / step))
        request = _Request(n, nparts, log10)
        parts = [_Part(request, rows[i : i + step], i, normalized, deadline, now, state)
                 for i in range(0, max(n, 1), step)]
        with self._cond:
            self._arriving -= 1
            if self._stopping:
                raise EngineStoppedError("the server is shutting down")
            if n == 0:
                request.future.set_result(request.out)
                return request.future
            if self._queued_ngrams + n > self.config.max_queue_ngrams:
                if self.metrics is not None:
                    self.metrics.rejected.inc(n)
                raise OverloadedError(
                    f"queue full: {self._queued_ngrams} n-grams waiting, limit {self.config.max_queue_ngrams}"
                )
            (self._small if n <= self.config.priority_ngrams else self._queue).extend(parts)
            self._queued_ngrams += n
            self._set_depth()
            self._cond.notify()
        return request.future

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._queued_ngrams)

    def _take_batch(self) -> list[_Part] | None:
        """Block until work is queued; gather a batch (None when stopping and drained).

        Small requests (``priority_ngrams``) come first: a batch starts with the oldest small
        part if there is one, takes every small part that fits, then fills the rest with the
        oldest large parts, splitting the last one so that the batch is full. A small request
        therefore waits for at most the forward pass in progress, never for a queue of large
        ones, and large requests still get every row the small ones leave free."""
        limit = self.config.max_batch_ngrams
        delay = self.config.max_delay_us / 1e6
        small, large = self._small, self._queue
        with self._cond:
            while not (small or large) or self._busy:
                if self._stopping and not (small or large):
                    return None
                self._cond.wait()
            self._busy = True
            batch = [(small or large).popleft()]
            state = batch[0].state
            size = batch[0].ids.shape[0]
            wait_until = time.monotonic() + delay
            while size < limit:
                if small and small[0].state is state and size + small[0].ids.shape[0] <= limit:
                    part = small.popleft()
                elif large and large[0].state is state:  # a batch is scored by one model
                    part = large[0]
                    room = limit - size
                    if part.ids.shape[0] <= room:
                        large.popleft()
                    else:  # the rows that fit now, the rest stays first in line
                        head = _Part(part.request, part.ids[:room], part.offset, part.normalized, part.deadline,
                                     part.enqueued, part.state)
                        part.ids, part.offset = part.ids[room:], part.offset + room
                        part.request.remaining += 1
                        part = head
                elif small or large:
                    break  # the next part belongs to another model state, or does not fit
                else:
                    # Wait for more only while callers are known to be on their way, or
                    # while fewer requests joined than in the last batch (clients that were
                    # answered together tend to come back together); never past max_delay_us.
                    expecting = self._arriving > 0 or len(batch) < self._last_batch_requests
                    remaining = wait_until - time.monotonic()
                    if not expecting or remaining <= 0 or self._stopping:
                        break
                    self._cond.wait(remaining)
                    continue
                batch.append(part)
                size += part.ids.shape[0]
            self._queued_ngrams -= size
            self._last_batch_requests = len(batch)
            self._set_depth()
        return batch

    # -------------------------------------------------------------- worker
    def _run(self) -> None:
        # OpenMP thread counts are per thread: set it in the thread that runs the forward passes.
        torch.set_num_threads(self._torch_threads)
        torch.set_grad_enabled(False)
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._process(batch)
            finally:
                with self._cond:
                    self._busy = False

    def _process(self, batch: list[_Part]) -> None:
        try:
            self._forward(batch)
        except Exception as e:  # a bug or a device failure: fail these requests, keep serving
            log.exception("batch of %s parts failed", len(batch))
            for part in batch:
                self._finish(part, e)

    def _forward(self, batch: list[_Part]) -> None:
        now = time.monotonic()
        live = []
        for part in batch:
            if part.deadline is not None and now > part.deadline:
                self._finish(part, RequestExpiredError("deadline passed while queued"))
            elif not part.request.future.done():
                live.append(part)
        if not live:
            return
        ids = np.concatenate([p.ids for p in live]) if len(live) > 1 else live[0].ids
        norm = np.concatenate([np.full(p.ids.shape[0], p.normalized) for p in live])
        t0 = time.perf_counter()
        with torch.inference_mode():
            scores = live[0].state.scorer.score(ids, norm)
        elapsed = time.perf_counter() - t0
        m = self.metrics
        if m is not None:  # before the answers go out, so a client that got one sees its batch counted
            m.batch_size.observe(ids.shape[0])
            m.batch_requests.observe(len(live))
            m.inference_time.observe(elapsed)
            m.ngrams_scored.inc(ids.shape[0])
            for part in live:
                m.queue_delay.observe(now - part.enqueued)
            export_cache_stats(m, live[0].state)
        start = 0
        for part in live:
            n = part.ids.shape[0]
            part.request.out[part.offset : part.offset + n] = scores[start : start + n]
            start += n
            self._finish(part, None)

    @staticmethod
    def _finish(part: _Part, error: BaseException | None) -> None:
        request = part.request
        try:
            if request.future.done():  # failed earlier, or cancelled by the caller
                return
            if error is not None:
                request.future.set_exception(error)
                return
            request.remaining -= 1
            if request.remaining <= 0:
                if request.log10:
                    ln_to_log10(request.out)
                request.future.set_result(request.out)
        except InvalidStateError:  # cancelled in between
            pass


def _wait(future: Future[T], timeout: float | None) -> T:
    """The result, or RequestExpiredError when it does not come within ``timeout`` (+1 s slack)."""
    try:
        return future.result(None if timeout is None else timeout + 1.0)
    except FutureTimeoutError as e:
        raise RequestExpiredError(f"not scored within {timeout:.3f} s") from e
