"""Prometheus metrics: one dedicated registry per server, every name prefixed ``nlmserve_``.

The registry is created once with the server (never the process-global default registry,
so several servers in one process, as in the tests, do not collide) and exported on
``--metrics-port`` at ``/metrics``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest,
                               start_http_server)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..common.memory import heap_now

log = logging.getLogger(__name__)

#: The reasons of ``nlmserve_refused_total`` (server/gate.py says what each one is).
REFUSAL_REASONS = ("unauthenticated", "max_concurrent_rpcs", "max_rpcs_per_connection", "max_rpcs_per_client",
                   "max_health_watches", "max_health_watches_per_connection", "first_message_timeout",
                   "calls_awaiting_message", "stream_write_timeout")

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)


class HeapCollector(Collector):
    """``nlmserve_heap_bytes``, read from malloc at each scrape (``common.memory.heap_now``):
    ``state="in_use"`` grows with memory held, ``state="free"`` is what malloc keeps for
    reuse; resident memory (``nlmserve_process_resident_memory_bytes``) that grows while in
    use stays level is freed memory whose pages the system has not had back. On jemalloc,
    free is its resident pages not in use. Nothing where there is neither jemalloc nor glibc
    ``mallinfo2``."""

    def collect(self) -> Any:
        heap = heap_now()
        if heap is None:
            return
        family = GaugeMetricFamily("nlmserve_heap_bytes", "malloc's heap, by state: in use, or free and kept",
                                   labels=["state"])
        family.add_metric(["in_use"], heap[0])
        family.add_metric(["free"], heap[1])
        yield family


class ServerMetrics:
    """All metrics of one server; thread-safe (prometheus_client objects are)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "nlmserve_requests", "RPCs finished, by method (unknown: one the server does not serve) and gRPC "
            "status code", ["rpc", "code"], registry=r
        )
        self.ngrams_scored = Counter("nlmserve_ngrams_scored", "N-grams (and sentence tokens) scored", registry=r)
        self.batch_size = Histogram(
            "nlmserve_batch_size_ngrams", "N-grams per forward pass (after micro-batching)",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.batch_requests = Histogram(
            "nlmserve_batch_requests", "Request parts merged into one forward pass",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.queue_delay = Histogram(
            "nlmserve_queue_delay_seconds", "Time a request part waited in the queue",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.inference_time = Histogram(
            "nlmserve_inference_seconds", "Time of one batched forward pass (caches included)",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.request_latency = Histogram(
            "nlmserve_request_latency_seconds", "Server-side latency of scoring RPCs", ["rpc"],
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.cache_hits = Counter("nlmserve_cache_hits", "Cache hits, by cache", ["cache"], registry=r)
        self.cache_misses = Counter("nlmserve_cache_misses", "Cache misses, by cache", ["cache"], registry=r)
        self.cache_entries = Gauge("nlmserve_cache_entries", "Entries held, by cache", ["cache"], registry=r)
        self.in_flight = Gauge("nlmserve_in_flight_requests", "RPCs being served", registry=r)
        self.queue_depth = Gauge("nlmserve_queue_depth_ngrams", "N-grams waiting in the batching queue", registry=r)
        self.rejected = Counter(
            "nlmserve_rejected_ngrams", "N-grams refused because the queue was full", registry=r
        )
        self.model_info = Gauge(
            "nlmserve_model_info", "The served model (value 1)",
            ["model_hash", "order", "device", "objective", "output_type", "vocab_size"], registry=r,
        )
        self.reloads = Counter(
            "nlmserve_model_reloads", "Model reloads (SIGHUP or Admin/ReloadModel), by result", ["result"],
            registry=r,
        )
        for result in ("ok", "error"):
            self.reloads.labels(result=result)
        self.refused = Counter(
            "nlmserve_refused", "Calls a limit refused or cut (server/gate.py), by reason", ["reason"], registry=r
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason=reason)
        ProcessCollector(namespace="nlmserve", registry=r)  # nlmserve_process_resident_memory_bytes, CPU, files
        r.register(HeapCollector())
        for cache in ("ngram", "context", "in_class"):
            self.cache_hits.labels(cache=cache)
            self.cache_misses.labels(cache=cache)
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self.port: int | None = None

    def set_model(self, **labels: str) -> None:
        self.model_info.labels(**labels).set(1)

    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns the bound port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http, self._http_thread = server, thread
        self.port = int(server.server_address[1])
        log.info("metrics on http://%s:%s/metrics", host, self.port)
        return self.port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def render(self) -> bytes:
        """The text exposition of every metric (what ``/metrics`` returns)."""
        return generate_latest(self.registry)
