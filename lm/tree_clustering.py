"""Mnih & Hinton (2008)'s feature-based trees: recursive splits of the words' mean
predicted context vectors by a two-component Gaussian mixture.

Each word is represented by the mean of the context vectors r(h) that a model (trained on
a random tree) predicts in the contexts where the word occurs. A set of words is split
by fitting a mixture of two spherical Gaussians by EM and reading off each word's
responsibility p (of the first component):

    BALANCED       sort by p, the first half goes left: a balanced tree.
    ADAPTIVE       left if p >= 1/2 (balanced where a side would be empty).
    ADAPTIVE(ε)    left if p > 1/2 - ε, right if p < 1/2 + ε: the words in between go to
                   both sides and get several codes (at most ``max_codes`` each); where
                   a side would keep every word, the ADAPTIVE rule is used instead.

Sets of one word are leaves; a set of two is split without a mixture. Departure from the
paper: codes are kept no longer than twice a balanced tree's depth (sets that would not
fit are split in balanced halves), which bounds the cost of a prediction.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np

from .trees import Tree, tree_from_children

log = logging.getLogger(__name__)

RULES = ("balanced", "adaptive", "adaptive-eps")


def two_gaussians(x: np.ndarray, rng: np.random.Generator, iters: int = 12, tol: float = 1e-3) -> np.ndarray:
    """EM for a mixture of two spherical Gaussians on x (n, D) → (n,) responsibility of
    the first component. Initialised at a random point and the point farthest from it;
    stops after ``iters`` iterations or when no responsibility moves by ``tol``."""
    n, D = x.shape
    sq = (x * x).sum(1)  # (n,)

    def dist2(means: np.ndarray) -> np.ndarray:  # (n, 2) squared distances, by one product
        d2: np.ndarray = np.maximum(sq[:, None] - 2.0 * (x @ means.T) + (means * means).sum(1)[None], 0.0)
        return d2

    i = int(rng.integers(n))
    j = int(np.argmax(dist2(x[i : i + 1])[:, 0]))
    means = np.stack([x[i], x[j]])  # (2, D)
    var = np.full(2, max(float(x.var(axis=0).sum()) / D, 1e-8))  # (2,) per-dimension variance
    weights = np.array([0.5, 0.5])
    resp = np.full(n, 0.5)
    for _ in range(iters):
        logp = np.log(weights) - 0.5 * D * np.log(var) - dist2(means) / (2 * var)  # (n, 2) up to a constant
        logp -= logp.max(axis=1, keepdims=True)
        p = np.exp(logp)
        p /= p.sum(axis=1, keepdims=True)
        moved = float(np.abs(p[:, 0] - resp).max())
        resp = p[:, 0]
        mass = p.sum(0) + 1e-12  # (2,)
        weights = np.maximum(mass / n, 1e-12)
        means = (p.T @ x) / mass[:, None]
        var = np.maximum((p * dist2(means)).sum(0) / (mass * D), 1e-8)
        if moved < tol:
            break
    return resp


def _split(subset: np.ndarray, resp: np.ndarray, rule: str, eps: float, copies: np.ndarray,
           max_codes: int) -> tuple[np.ndarray, np.ndarray]:
    """The two children of ``subset`` under ``rule``; both are non-empty and smaller."""
    n = subset.size
    if not np.isfinite(resp).all():
        resp = np.linspace(1.0, 0.0, n)
    if rule == "adaptive-eps":
        in_left = resp > 0.5 - eps
        in_right = resp < 0.5 + eps
        both = in_left & in_right
        capped = both & (copies[subset] >= max_codes)
        in_left[capped] = resp[capped] >= 0.5
        in_right[capped] = ~in_left[capped]
        if 0 < in_left.sum() < n and 0 < in_right.sum() < n:
            copies[subset[in_left & in_right]] += 1
            return subset[in_left], subset[in_right]
        rule = "adaptive"
    if rule == "adaptive":
        left = resp >= 0.5
        if 0 < left.sum() < n:
            return subset[left], subset[~left]
    order = np.argsort(-resp, kind="stable")
    half = (n + 1) // 2
    return subset[order[:half]], subset[order[half:]]


def cluster_tree(features: np.ndarray, words: np.ndarray, rule: str, *, eps: float = 0.25, seed: int = 1,
                 max_codes: int = 4, max_depth: int | None = None) -> Tree:
    """The tree over ``words`` (ids) by recursive two-Gaussian splits of ``features``
    (V, D) rows (indexed by word id) under ``rule`` (one of RULES). No code is longer than
    ``max_depth`` (None: twice a balanced tree's depth): a set that could not otherwise
    fit in the remaining depth is split in balanced halves."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"eps must lie in [0, 0.5), got {eps}")
    if words.size < 2:
        raise ValueError("a tree needs at least two words")
    rng = np.random.default_rng(seed)
    x = np.asarray(features, dtype=np.float64)
    copies = np.ones(x.shape[0], dtype=np.int64)
    left: list[int] = []
    right: list[int] = []
    if max_depth is None:
        max_depth = 2 * int(np.ceil(np.log2(words.size)))
    queue: deque[tuple[np.ndarray, int, int, int]] = deque([(np.asarray(words), -1, 0, 0)])
    while queue:
        subset, parent, side, depth = queue.popleft()
        if subset.size == 1:
            ref = -int(subset[0]) - 1
        else:
            ref = len(left)
            left.append(0)
            right.append(0)
            if subset.size == 2:
                a, b = subset[:1], subset[1:]
            else:
                # Below max_depth the remaining words are split in balanced halves.
                here = rule if depth < max_depth - int(np.ceil(np.log2(subset.size))) else "balanced"
                a, b = _split(subset, two_gaussians(x[subset], rng), here, eps, copies, max_codes)
            queue.append((a, ref, 1, depth + 1))
            queue.append((b, ref, 0, depth + 1))
        if parent >= 0:
            (left if side == 1 else right)[parent] = ref
    method = rule
    tree = tree_from_children(np.array(left), np.array(right), method)
    log.info("%s tree: %d words, %d codes, %d nodes, depth %d, mean code length %.2f", rule, words.size,
             tree.num_codes, tree.num_nodes, tree.depth, float(tree.code_lengths().mean()))
    return tree


def mean_context_vectors(r_sum: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per-word mean of the summed context vectors; words never seen get the overall mean."""
    out = np.empty_like(r_sum)
    seen = count > 0
    out[seen] = r_sum[seen] / count[seen, None]
    overall: Any = r_sum[seen].sum(0) / max(count[seen].sum(), 1)
    out[~seen] = overall
    return out
