"""``nlmserve.common.perplexity``: perplexity from a sum of log-probabilities, in either base.

    from_log10(total, tokens) = 10 ** (-total / tokens)    (KenLM's ``query`` and ``perplexity``)
    from_ln(total, tokens)    = exp(-total / tokens)       (the trainer's validation)

The callers choose the tokens: KenLM's perplexity *including* OOVs sums every token,
``</s>`` counted; *excluding* OOVs leaves the OOV tokens out of both the sum and the count.
No tokens give NaN; a perplexity beyond the largest float (a diverged model) is ``inf``,
not an error. Only the standard library is imported here (the client uses it).
"""

from __future__ import annotations

import math


def from_log10(total: float, tokens: float) -> float:
    """``10 ** (-total / tokens)`` for ``total`` the log10 probability of ``tokens`` tokens."""
    if not tokens:
        return math.nan
    try:
        return 10.0 ** (-total / tokens)
    except OverflowError:
        return math.inf


def from_ln(total: float, tokens: float) -> float:
    """``exp(-total / tokens)`` for ``total`` the natural-log probability of ``tokens`` tokens."""
    if not tokens:
        return math.nan
    try:
        return math.exp(-total / tokens)
    except OverflowError:
        return math.inf
