"""``nlmserve.wire.logbase``: log bases, spelled one way per surface and converted here.

The model works in natural log. Internal APIs (``nlmserve.lm``, the server's engine and
its private socket) say ``log10: bool``; the Python client's and the rescorer's public
methods say ``log_base="log10" | "ln"`` (the client's default is log10, as KenLM); the wire
says the proto enum ``LogBase`` (``client.core.log_base_enum`` and the servicer convert
it, each on its side); arrays of scores change base through :func:`ln_to_log10` and
:func:`log10_to_ln`. Only the standard library is imported here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np

LN10 = math.log(10.0)
#: log10 x = ln x * LOG10_E
LOG10_E = 1.0 / LN10

LogBase = Literal["log10", "ln"]
LOG_BASES: tuple[LogBase, ...] = ("log10", "ln")


def is_log10(log_base: str) -> bool:
    """``log_base`` ("log10" or "ln") as the internal ``log10`` flag; ValueError otherwise."""
    if log_base not in LOG_BASES:
        raise ValueError(f"log_base must be 'log10' or 'ln', got {log_base!r}")
    return log_base == "log10"


def ln_to_log10(values: np.ndarray) -> np.ndarray:
    """Natural-log ``values`` as log10, in place, in their own dtype (a float32 array is
    multiplied by log10 e rounded to float32); returns the array."""
    values *= LOG10_E
    return values


def log10_to_ln(values: np.ndarray) -> np.ndarray:
    """log10 ``values`` as natural log, in place, in their own dtype; returns the array."""
    values *= LN10
    return values

