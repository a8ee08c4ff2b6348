"""LRU caches and the scorer that uses them.

Two caches, both touched only by the engine's single batching thread (no locks):

- n-gram cache: canonical id row (``order`` ids, ``<s>``-padded) and mode (normalised or
  not) → natural-log score.
- context cache (OxLM's per-context normaliser cache): context ids → the context vector r,
  the class log-normaliser, and the in-class log-normalisers of the classes asked so far.

Rows come canonical (``nlmserve.lm.ngrams.canonical_rows``). Without the context cache the
model scores them as they are (``score_prepared``); with it, the score is composed from the
model's pieces (``encode_contexts``, ``class_log_normalizer``, ``in_class_log_normalizer``,
``raw_scores``), so a hit returns what the uncached path computes up to float rounding.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, TypeVar

import numpy as np
import torch

from nlmserve.lm.protocol import ScoringModel
from nlmserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """A bounded least-recently-used map with hit and miss counters (size 0: always misses)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> None:
        if self.capacity <= 0:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()


@dataclass
class ContextEntry:
    """What the context cache keeps for one context."""

    r: torch.Tensor  # (E,) context vector
    class_lognorm: float  # log Σ_c exp s_c(h); 0 for a softmax output
    in_class: dict[int, float] = field(default_factory=dict)  # class → log Σ_{w∈c} exp s_w(h)


def row_keys(ids: np.ndarray) -> list[bytes]:
    """One bytes key per row of a 2-D integer array."""
    a = np.ascontiguousarray(ids, dtype=np.int32)
    keys: Any = a.view(np.dtype((np.void, a.dtype.itemsize * a.shape[1]))).ravel().tolist()
    return keys  # type: ignore[no-any-return]


class Scorer:
    """Scores normalised n-gram rows (N, order) with both caches; natural log, float32."""

    def __init__(self, lm: ScoringModel, ngram_cache_size: int, context_cache_size: int,
                 metrics: ServerMetrics | None = None) -> None:
        self.lm = lm
        self.metrics = metrics
        self.ngram_cache: dict[bool, LRUCache[bytes, float]] = {
            True: LRUCache(ngram_cache_size), False: LRUCache(ngram_cache_size)
        }
        self.context_cache: LRUCache[bytes, ContextEntry] = LRUCache(context_cache_size)
        self.in_class_hits = 0
        self.in_class_misses = 0
        self._exported: dict[str, tuple[int, int]] = {}

    # -------------------------------------------------------------- public
    def score(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        """ids (N, order) normalised rows; normalized (N,) bool per row → ln scores (N,)."""
        n = ids.shape[0]
        out = np.empty(n, dtype=np.float32)
        todo = np.arange(n)
        keys: list[bytes] = []
        if self.ngram_cache[True].capacity > 0:
            keys = row_keys(ids)
            todo_list = []
            for i, (key, norm) in enumerate(zip(keys, normalized.tolist())):
                hit = self.ngram_cache[norm].get(key)
                if hit is None:
                    todo_list.append(i)
                else:
                    out[i] = hit
            todo = np.asarray(todo_list, dtype=np.int64)
        if todo.size:
            sub = ids[todo]
            sub_norm = normalized[todo]
            if self.context_cache.capacity > 0:
                scores = self._score_context_cached(sub, sub_norm)
            else:
                scores = self._score_direct(sub, sub_norm)
            out[todo] = scores
            if keys:
                norms = sub_norm.tolist()
                for j, i in enumerate(todo.tolist()):
                    self.ngram_cache[norms[j]].put(keys[i], float(scores[j]))
        self._export()
        return out

    def stats(self) -> dict[str, tuple[int, int, int]]:
        """cache name → (hits, misses, entries)."""
        ng = self.ngram_cache
        return {
            "ngram": (ng[True].hits + ng[False].hits, ng[True].misses + ng[False].misses,
                      len(ng[True]) + len(ng[False])),
            "context": (self.context_cache.hits, self.context_cache.misses, len(self.context_cache)),
            "in_class": (self.in_class_hits, self.in_class_misses, 0),
        }

    # -------------------------------------------------------------- paths
    def _score_direct(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        """The uncached path: the model scores the canonical rows as they are."""
        return np.asarray(self.lm.score_prepared(ids[:, :-1], ids[:, -1], normalized), dtype=np.float32)

    def _score_context_cached(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        lm = self.lm
        ctx, target = lm.prepare_contexts(ids)
        ctx_np = ctx.cpu().numpy()
        keys = row_keys(ctx_np)
        # Unique contexts of this batch, in first-seen order.
        slot: dict[bytes, int] = {}
        inverse = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            inverse[i] = slot.setdefault(key, len(slot))
        ukeys = list(slot)
        first = np.empty(len(ukeys), dtype=np.int64)
        first[inverse[::-1]] = np.arange(len(keys) - 1, -1, -1)  # first row of each context
        entries: list[ContextEntry | None] = [self.context_cache.get(k) for k in ukeys]
        missing = [u for u, e in enumerate(entries) if e is None]
        if missing:
            rows = torch.from_numpy(first[missing]).to(ctx.device)
            r_new = lm.encode_contexts(ctx[rows])
            cln_new = lm.class_log_normalizer(r_new).float().cpu().tolist()
            for j, u in enumerate(missing):
                entry = ContextEntry(r=r_new[j].clone(), class_lognorm=cln_new[j])
                entries[u] = entry
                self.context_cache.put(ukeys[u], entry)
        ready = [e for e in entries if e is not None]
        R = torch.stack([e.r for e in ready])  # (U, E)
        inv_t = torch.from_numpy(inverse).to(R.device)
        r = R[inv_t]  # (N, E)
        class_score, word_score = lm.raw_scores(r, target)
        score = (class_score + word_score).float().cpu().numpy()
        norm_rows = np.flatnonzero(normalized)
        if norm_rows.size:
            score[norm_rows] -= self._normalizers(ready, inverse[norm_rows], target[norm_rows])
        return score

    def _normalizers(self, entries: list[ContextEntry], ctx_of_row: np.ndarray, target: torch.Tensor) -> np.ndarray:
        """class + in-class log-normaliser of each row, from and into the context entries."""
        cls = self._classes(target).cpu().numpy()
        need: dict[tuple[int, int], int] = {}
        for u, c in zip(ctx_of_row.tolist(), cls.tolist()):
            if c in entries[u].in_class:
                self.in_class_hits += 1
            elif (u, c) not in need:
                self.in_class_misses += 1
                need[(u, c)] = len(need)
        if need:
            pairs = list(need)
            R = torch.stack([entries[u].r for u, _ in pairs])
            C = torch.tensor([c for _, c in pairs], dtype=torch.long, device=R.device)
            values = self.lm.in_class_log_normalizer(R, C).float().cpu().tolist()
            for (u, c), v in zip(pairs, values):
                entries[u].in_class[c] = v
        return np.array(
            [entries[u].class_lognorm + entries[u].in_class[c] for u, c in zip(ctx_of_row.tolist(), cls.tolist())],
            dtype=np.float32,
        )

    def _classes(self, target: torch.Tensor) -> torch.Tensor:
        return self.lm.word_classes(target)

    def _export(self) -> None:
        m = self.metrics
        if m is None:
            return
        for name, (hits, misses, entries) in self.stats().items():
            # Counters only go up: add what is new since the last export.
            last_h, last_m = self._exported.get(name, (0, 0))
            if hits > last_h:
                m.cache_hits.labels(cache=name).inc(hits - last_h)
            if misses > last_m:
                m.cache_misses.labels(cache=name).inc(misses - last_m)
            self._exported[name] = (hits, misses)
            m.cache_entries.labels(cache=name).set(entries)
