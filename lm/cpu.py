"""Arithmetic of the CPU inference tables (``nlmserve.lm.scoring`` for the context side,
``nlmserve.lm.outputs.class_factored`` for the output side): products on the threads torch was given, and
log Σ exp in numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

#: A log Σ exp computed without the max shift below this is recomputed with it (the sum
#: was near float32's smallest normal numbers).
LOG_SUM_FLOOR = -60.0
#: Elements of one numpy matrix-vector product in the tiny path's in-class normaliser: below
#: the size at which numpy's OpenBLAS splits a product over threads of its own (measured
#: between 256k and 512k elements), so every slice runs on the calling thread.
MV_ELEMENTS = 1 << 18


def to_numpy(t: Tensor) -> np.ndarray:
    """float32 numpy copy (or view) of a tensor on any device."""
    return t.float().cpu().numpy()


def mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b through torch: its BLAS runs on the threads torch was given, where numpy's
    would start a pool of its own on every core (10-1000x slower on a busy machine)."""
    return torch.mm(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(b)).numpy()


def mv(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """a @ x for a (S, D) float32 block, in slices of at most MV_ELEMENTS: numpy's BLAS runs
    each slice on the calling thread (it starts its own thread pool only for larger products,
    see :func:`mm`), and its matrix-vector product streams the block faster than torch.mv
    (measured on one thread, 7,942 x 256: 135-139 µs against 206-215 µs)."""
    rows = max(1, MV_ELEMENTS // max(1, a.shape[1]))
    if a.shape[0] <= rows:
        return a @ x  # type: ignore[no-any-return]
    out = np.empty(a.shape[0], dtype=np.result_type(a, x))
    for s in range(0, a.shape[0], rows):
        np.dot(a[s : s + rows], x, out=out[s : s + rows])
    return out


def logsumexp(x: np.ndarray) -> np.floating[Any]:
    m = x.max()
    return m + np.log(np.exp(x - m).sum())  # type: ignore[no-any-return]


def logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """log Σ exp of each row of x (N, K) → (N,), as :func:`logsumexp` row by row."""
    m = x.max(axis=1)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=1))  # type: ignore[no-any-return]
