"""The per-context normaliser cache beside the scoring it caches: LRU caches and the scorer
that uses them (``LanguageModel.cached_scorer``; the server's engine scores every batch
through one).

Two caches, both touched only by the engine's single batching thread (no locks):

- n-gram cache: canonical id row (``order`` ids, ``<s>``-padded) and mode (normalised or
  not) → natural-log score.
- context cache (OxLM's per-context normaliser cache): context ids → the context vector r,
  the class log-normaliser, and the in-class log-normalisers of the classes asked so far.

Rows come canonical (``nlmserve.wire.ngrams.canonical_rows``). Without the context cache the
model scores them as they are (``score_prepared``); with it, the batch is planned as
``score_prepared`` plans it (``nlmserve.lm.dedup.plan_batch``: distinct contexts, rows and
(context, class) pairs), each distinct context's r and normalisers come from the cache or
from the model's pieces (``encode_contexts``, ``class_log_normalizer``,
``in_class_log_normalizer``), and the plan composes the scores with ``raw_score``; so a hit
returns what the uncached path computes up to float rounding.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Protocol, TypeVar

import numpy as np
import torch

from .dedup import plan_batch

log = logging.getLogger(__name__)


class CachedModel(Protocol):
    """The model's pieces the scorer computes with (``scoring.LanguageModel`` has them; named
    here so that this module, which ``scoring`` imports, imports no ``scoring``)."""

    device: torch.device

    def score_prepared(self, ctx: np.ndarray, target: np.ndarray, normalized: np.ndarray) -> np.ndarray: ...
    def encode_contexts(self, ctx: torch.Tensor) -> torch.Tensor: ...
    def class_log_normalizer(self, r: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor: ...
    def in_class_log_normalizer(self, r: torch.Tensor, cls: torch.Tensor,
                                ctx: torch.Tensor | None = None) -> torch.Tensor: ...
    def word_classes(self, target: torch.Tensor) -> torch.Tensor: ...
    def raw_score(self, r: torch.Tensor, target: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor: ...

_NO_SCORES = np.zeros(0, dtype=np.float32)

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
    class_lognorm: float | None = None  # log Σ_c exp s_c(h) once asked; 0 for a softmax output
    in_class: dict[int, float] = field(default_factory=dict)  # class → log Σ_{w∈c} exp s_w(h)


def row_keys(ids: np.ndarray) -> list[bytes]:
    """One bytes key per row of a 2-D integer array."""
    a = np.ascontiguousarray(ids, dtype=np.int32)
    keys: Any = a.view(np.dtype((np.void, a.dtype.itemsize * a.shape[1]))).ravel().tolist()
    return keys  # type: ignore[no-any-return]


class Scorer:
    """Scores normalised n-gram rows (N, order) with both caches; natural log, float32."""

    def __init__(self, lm: CachedModel, ngram_cache_size: int, context_cache_size: int) -> None:
        self.lm = lm
        self.ngram_cache: dict[bool, LRUCache[bytes, float]] = {
            True: LRUCache(ngram_cache_size), False: LRUCache(ngram_cache_size)
        }
        self.context_cache: LRUCache[bytes, ContextEntry] = LRUCache(context_cache_size)
        self.in_class_hits = 0
        self.in_class_misses = 0

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
        ctx, target = ids[:, :-1], ids[:, -1]
        target_t = self._tensor(target)
        plan = plan_batch(ctx, target, lm.word_classes(target_t).cpu().numpy(), normalized)
        entries = self._entries(ctx, plan.contexts)  # (U,)
        R = torch.stack([e.r for e in entries])  # (U, E)
        C = self._tensor(ctx[plan.contexts])  # (U, order-1): the ids beside r (direct n-gram features read them)
        row_context = self._tensor(plan.row_context)
        raw = lm.raw_score(R[row_context], target_t[self._tensor(plan.rows)], C[row_context]).float().cpu().numpy()
        if not plan.norm.size:
            return plan.compose(raw, _NO_SCORES, _NO_SCORES)
        norm = plan.norm_contexts.tolist()
        return plan.compose(raw, self._class_norms([entries[u] for u in norm], C[norm]),
                            self._in_class_norms(entries, C, plan.pair_context, plan.pair_class))

    def _entries(self, ctx: np.ndarray, contexts: np.ndarray) -> list[ContextEntry]:
        """The cache entry of each distinct context (rows ``contexts`` of ``ctx``); the
        missing ones are encoded together and cached."""
        keys = row_keys(ctx[contexts])
        found = [self.context_cache.get(k) for k in keys]
        missing = [u for u, e in enumerate(found) if e is None]
        if missing:
            r_new = self.lm.encode_contexts(self._tensor(ctx[contexts[missing]]))
            for j, u in enumerate(missing):
                entry = found[u] = ContextEntry(r=r_new[j].clone())
                self.context_cache.put(keys[u], entry)
        return [e for e in found if e is not None]

    def _class_norms(self, entries: list[ContextEntry], ctx: torch.Tensor) -> np.ndarray:
        """The class log-normaliser of each entry (C,) (context ids ``ctx`` (C, order-1)), the
        missing ones computed together."""
        missing = [i for i, e in enumerate(entries) if e.class_lognorm is None]
        if missing:
            R = torch.stack([entries[i].r for i in missing])
            values = self.lm.class_log_normalizer(R, ctx[missing]).float().cpu().tolist()
            for i, v in zip(missing, values):
                entries[i].class_lognorm = v
        return np.array([e.class_lognorm for e in entries], dtype=np.float32)

    def _in_class_norms(self, entries: list[ContextEntry], ctx: torch.Tensor, pair_context: np.ndarray,
                        pair_class: np.ndarray) -> np.ndarray:
        """The in-class log-normaliser of each distinct (context, class) pair (P,), the
        missing ones computed together (one in-class hit or miss per pair)."""
        out = np.empty(pair_class.size, dtype=np.float32)
        need: list[int] = []
        for p, (u, c) in enumerate(zip(pair_context.tolist(), pair_class.tolist())):
            value = entries[u].in_class.get(c)
            if value is None:
                need.append(p)
            else:
                out[p] = value
        self.in_class_hits += pair_class.size - len(need)
        self.in_class_misses += len(need)
        if need:
            rows = pair_context[need].tolist()
            R = torch.stack([entries[u].r for u in rows])
            values = self.lm.in_class_log_normalizer(R, self._tensor(pair_class[need]), ctx[rows]).float().cpu().numpy()
            out[need] = values
            for p, v in zip(need, values.tolist()):
                entries[int(pair_context[p])].in_class[int(pair_class[p])] = v
        return out

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.lm.device)
