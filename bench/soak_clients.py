"""The soak's authorised clients (bench/soak.py): replicated ``LMClient`` threads shaped
like decoders and rescorers, one that reconnects every second, and a strict one that never
retries; every answer checked against the in-process score of the model it names, what the
client retried counted by code."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

log = logging.getLogger("bench.soak")

#: The authorised clients' token (one client to the servers' per-client share).
TOKEN = "soak-token-0123456789"
TOLERANCE = 1e-5  # natural log


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    wrong: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    retried: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def add(self, other: "Tally") -> None:
        self.sent += other.sent
        self.answered += other.answered
        self.wrong += other.wrong
        self.failed += other.failed
        self.retried += other.retried
        self.latencies += other.latencies

    def summary(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies) * 1000.0
        return {"sent": self.sent, "answered": self.answered, "wrong": self.wrong, "failed": dict(self.failed),
                "retried": dict(self.retried),
                "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
                "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None}


def _counting_retry() -> Any:
    """The client's retry policy, counting what it retries (what a client that retries hides)."""
    from nlmserve.client.core import RetryPolicy

    @dataclass(frozen=True)
    class CountingRetry(RetryPolicy):
        seen: Counter[str] = field(default_factory=Counter, compare=False)

        def should_retry(self, error: Any, attempt: int) -> bool:
            retry = super().should_retry(error, attempt)
            if retry:
                self.seen[error.code().name] += 1
            return retry

    return CountingRetry()


class Load:
    """The authorised clients' switch: they wait while it is paused; ``pause`` returns once
    none has a request in flight (at most 60 s)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self._busy = 0
        self._lock = threading.Lock()

    def pause(self) -> None:
        self.go.clear()
        deadline = time.monotonic() + 60
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.05)

    def resume(self) -> None:
        self.go.set()

    def request(self, stop: threading.Event) -> Iterator[bool]:
        """Yields once per request while not stopped, counted as in flight until the next."""
        while True:
            while not self.go.wait(0.2):
                if stop.is_set():
                    return
            if stop.is_set():
                return
            with self._lock:
                self._busy += 1
            try:
                yield True
            finally:
                with self._lock:
                    self._busy -= 1


def _check(tally: Tally, kind: str, got: Any, model_hash: str, start: int, n: int,
           expected: dict[str, np.ndarray], began: float) -> None:
    tally.latencies.append(time.perf_counter() - began)
    want = expected.get(model_hash)
    got = np.asarray(got)
    if want is None or got.shape != (n,) or not np.all(np.abs(got - want[start : start + n]) <= TOLERANCE):
        tally.wrong += 1
        log.error("%s: a wrong answer from model %s", kind, model_hash)
    else:
        tally.answered += 1


def _failed(tally: Tally, kind: str, e: Exception) -> None:
    code = getattr(e, "code", None)
    name = code() if callable(code) else code
    tally.failed[type(e).__name__ + (f"({name.name})" if name is not None else "")] += 1
    log.warning("%s request failed: %s", kind, e)


def authorised(kind: str, targets: list[str], ids: np.ndarray, expected: dict[str, np.ndarray],
               sizes: tuple[int, int], load: Load, stop: threading.Event, seed: int, tally: Tally) -> None:
    """A replicated ``LMClient`` scoring back to back; ``reconnecting`` builds a new one
    every second."""
    from nlmserve.client import LMClient

    rng = np.random.default_rng(seed)
    client: Any = None
    opened = 0.0
    try:
        for _ in load.request(stop):
            if client is None or (kind == "reconnecting" and time.monotonic() - opened >= 1.0):
                if client is not None:
                    tally.retried += client.retry.seen
                    client.close()
                client = LMClient(targets, token=TOKEN, timeout=60, allow_mixed_models=True,
                                  retry_policy=_counting_retry())
                opened = time.monotonic()
            n = int(rng.integers(sizes[0], sizes[1] + 1))
            start = int(rng.integers(0, len(ids) - n))
            tally.sent += 1
            began = time.perf_counter()
            try:
                got = client.score_ids(ids[start : start + n], log_base="ln")
            except Exception as e:  # every failure is counted by its class (and gRPC code)
                _failed(tally, kind, e)
                continue
            _check(tally, kind, got.log_probs, got.model_hash, start, n, expected, began)
            if kind != "rescoring":
                time.sleep(0.002)
    finally:
        if client is not None:
            tally.retried += client.retry.seen
            client.close()


def strict(target: str, ids: np.ndarray, expected: dict[str, np.ndarray], load: Load, stop: threading.Event,
           seed: int, tally: Tally) -> None:
    """Plain gRPC ScoreNgrams calls of 1-50 n-grams to one replica, never retried: what a
    client other than the project's sees."""
    import grpc

    from nlmserve.proto import lm_pb2, lm_pb2_grpc

    rng = np.random.default_rng(seed)
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(target) as channel:
        stub = lm_pb2_grpc.LanguageModelStub(channel)
        for _ in load.request(stop):
            n = int(rng.integers(1, 51))
            start = int(rng.integers(0, len(ids) - n))
            rows = np.ascontiguousarray(ids[start : start + n], dtype="<u4")
            tally.sent += 1
            began = time.perf_counter()
            try:
                answer = stub.ScoreNgrams(lm_pb2.ScoreNgramsRequest(packed_ids=rows.tobytes(),
                                                                    packed_order=rows.shape[1], log_base=lm_pb2.LN),
                                          metadata=metadata, timeout=60)
            except grpc.RpcError as e:
                _failed(tally, "strict", e)
                continue
            _check(tally, "strict", list(answer.log_probs), answer.model_hash, start, n, expected, began)
            time.sleep(0.01)
