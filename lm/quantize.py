"""The tables file's quantisations (``nlmserve export-tables --quantize``), as KenLM's
``build_binary -q`` quantises its probabilities: the position and output rows, which are
nearly all of a model's tables, stored smaller, with the largest error it allows stated.

    none   float32, as the model holds them: the scores are the model's (error 0)
    fp16   IEEE half precision (round to nearest; a value below 2^-14 in size becomes 0, so
           the scorers never meet a subnormal): half the bytes
    int8   a signed byte per value and a float32 scale per row (scale = the row's largest
           |value| / 127, value ≈ scale · q): a quarter of the bytes, and 4 more per row

The bias, word classes, direct features' tables and a tree's paths stay float32. int8 keeps a
scale per row rather than KenLM's bins (256 values per table, each the mean of an equal share
of the values sorted): on the demo model's held-out n-grams the bins lost more (the
measurement is in docs/interfaces.md, "The tables file").

The bound (:func:`error_bound`, recorded in the file and stated in nlmserve_tables.h), in
Euclidean norms of rows: with P_j the float32 position tables, P̃_j the rows the scorers
read, A = Σ_j max_w ‖P̃_j[w] − P_j[w]‖ (each table's largest row error) and R a bound on the
context vector's norm (√D after tanh; Σ_j max_w ‖P̃_j[w]‖ with no activation or relu, which
shrinks it): the context sum moves by at most A (the triangle inequality), and so does the
context vector (tanh and relu move no component by more than its input moved). With O the
output rows and ε = Õ − O, a class output's score r̃·Õ + b − (r·O + b) = (r̃ − r)·O + r̃·ε
moves by at most (Cauchy–Schwarz)

    E = max_w (A · ‖O_w‖ + R · ‖ε_w‖)

and a tree's by L · E over its node rows (L: the most steps of a code; log σ and
log-sum-exp move by no more than their arguments). The scores the scorers compute stay
within E of float32's, plus float32's own rounding. It is a worst case (every error aligned
with the row it meets); the errors met on held-out text are far smaller (docs/interfaces.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..common.errors import UnsupportedModelError

#: The quantisations in the order of their codes in the tables file.
QUANTIZATIONS = ("none", "fp16", "int8")
#: The element type of each quantisation's rows.
ELEMENT: dict[str, np.dtype[Any]] = {"none": np.dtype("<f4"), "fp16": np.dtype("<f2"), "int8": np.dtype("i1")}
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14
INT8_MAX = 127
#: Rows quantised at a time (bounds the float64 work arrays).
CHUNK_ROWS = 1 << 14


def code_of(kind: str) -> int:
    """The file's number of a quantisation ("none" 0, "fp16" 1, "int8" 2)."""
    return QUANTIZATIONS.index(kind)


@dataclass(frozen=True)
class QuantizedRows:
    """Rows (R, D) as a quantisation stores them: ``values`` of its element type and, for
    int8, one float32 ``scales`` per row (None otherwise)."""

    values: np.ndarray
    scales: np.ndarray | None


def quantize_rows(rows: np.ndarray, kind: str) -> QuantizedRows:
    """float32 rows (R, D) in ``kind``'s form; UnsupportedModelError for a value fp16 cannot
    hold."""
    rows = np.asarray(rows, dtype=np.float32)
    if kind == "none":
        return QuantizedRows(rows.astype("<f4", copy=False), None)
    if kind == "fp16":
        big = float(np.abs(rows).max(initial=0.0))
        if not big <= FP16_MAX:
            raise UnsupportedModelError(f"the tables hold a value of {big:g}, beyond fp16's {FP16_MAX:g}: "
                                        "use --quantize int8 or none")
        half = rows.astype("<f2")
        half[np.abs(half) < FP16_MIN_NORMAL] = 0  # no subnormals: a scorer may flush them anyway
        return QuantizedRows(half, None)
    if kind == "int8":
        scale = (np.abs(rows).max(axis=1, initial=0.0) / INT8_MAX).astype(np.float32)  # (R,)
        safe = np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint(rows / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
        return QuantizedRows(q, scale)
    raise ValueError(f"unknown quantisation {kind!r}; choose one of {', '.join(QUANTIZATIONS)}")


def dequantize(values: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """The float32 values the scorers read from stored rows (R, D): fp16 widened exactly,
    int8 times its row's scale (one float32 product)."""
    if scales is None:
        return values.astype(np.float32, copy=False)
    out = values.astype(np.float32)
    out *= scales.astype(np.float32, copy=False)[:, None]
    return out


@dataclass
class ErrorMeter:
    """The pieces of :func:`error_bound`, gathered table by table as the rows are quantised.

    ``position_error[j]``: max_w ‖P̃_j[w] − P_j[w]‖, ``position_max[j]``: max_w ‖P̃_j[w]‖;
    ``output_norm`` and ``error_norm``: ‖O_w‖ and ‖Õ_w − O_w‖ of each output row, in order."""

    position_error: list[float]
    position_max: list[float]
    output_norm: list[np.ndarray]
    error_norm: list[np.ndarray]

    @classmethod
    def empty(cls) -> "ErrorMeter":
        return cls([], [], [], [])

    def add_position(self, rows: np.ndarray, stored: QuantizedRows) -> None:
        """One chunk of one position table's rows (call :meth:`next_position` between tables)."""
        read = dequantize(stored.values, stored.scales).astype(np.float64)
        self.position_error[-1] = max(self.position_error[-1], float(_norms(read - rows).max(initial=0.0)))
        self.position_max[-1] = max(self.position_max[-1], float(_norms(read).max(initial=0.0)))

    def next_position(self) -> None:
        self.position_error.append(0.0)
        self.position_max.append(0.0)

    def add_output(self, rows: np.ndarray, stored: QuantizedRows) -> None:
        read = dequantize(stored.values, stored.scales).astype(np.float64)
        self.output_norm.append(_norms(rows.astype(np.float64)))
        self.error_norm.append(_norms(read - rows))

    def bound(self, activation: str, dim: int, code_steps: int = 0) -> float:
        """E (a class output, ``code_steps`` 0) or L · E (a tree whose longest code has
        ``code_steps`` steps), in nats, for rows of ``dim`` values."""
        a = float(sum(self.position_error))
        r = math.sqrt(dim) if activation == "tanh" else float(sum(self.position_max))
        if not self.output_norm:
            return 0.0
        per_row = a * np.concatenate(self.output_norm) + r * np.concatenate(self.error_norm)
        e = float(per_row.max(initial=0.0))
        return e * code_steps if code_steps else e


def _norms(rows: np.ndarray) -> np.ndarray:
    """The Euclidean norm of each row (R, D) → (R,) float64."""
    return np.sqrt(np.einsum("rd,rd->r", rows, rows, dtype=np.float64))


def error_bound(position: np.ndarray, output: np.ndarray, kind: str, activation: str, code_steps: int = 0) -> float:
    """The bound of the module's text for float32 ``position`` (n-1, V, D) and ``output``
    (K, D) stored as ``kind`` (0 for "none")."""
    meter = ErrorMeter.empty()
    for table in position:
        meter.next_position()
        for start in range(0, table.shape[0], CHUNK_ROWS):
            rows = table[start:start + CHUNK_ROWS]
            meter.add_position(rows, quantize_rows(rows, kind))
    for start in range(0, output.shape[0], CHUNK_ROWS):
        rows = output[start:start + CHUNK_ROWS]
        meter.add_output(rows, quantize_rows(rows, kind))
    return meter.bound(activation, output.shape[1], code_steps)
