"""Rerank n-best lists with a set of weights: the 1-best of each sentence under ``w · f``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from nlmserve.errors import InputError
from nlmserve.moses_plugin.mert import group_arrays
from nlmserve.moses_plugin.nbest import ReadStats, iter_sentences
from nlmserve.moses_plugin.weights import Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RerankResult:
    """One line per sentence id from 0 to the largest id (empty where the list has none)."""

    hyps: list[str]
    missing: list[int]
    bad_lines: int


def rerank(path: str, weights: Weights, *, skip_bad: bool = False, n_sentences: int | None = None) -> RerankResult:
    """The highest-scoring hypothesis per sentence (the first one on ties, as Moses' order).

    Weights of features the list does not have are ignored; a list feature without a
    weight is an error (no silent zero). ``n_sentences`` pads the output to that many lines.
    """
    best: dict[int, str] = {}
    stats = ReadStats()
    cached: tuple[tuple[tuple[str, int], ...], np.ndarray] | None = None
    for group in iter_sentences(path, skip_bad=skip_bad, stats=stats):
        layout = group[0].layout()
        if cached is None or cached[0] != layout:
            try:
                w = np.asarray(weights.for_layout(layout).flat(), dtype=np.float64)
            except InputError as exc:
                raise InputError(f"{exc} (weights vs the features of line {group[0].line_no})", path) from exc
            cached = (layout, w)
        scores = group_arrays(group, layout, path) @ cached[1]
        sent = group[0].sent_id
        if sent in best:
            raise InputError(f"sentence {sent} appears in two separate runs of lines", path, group[0].line_no)
        best[sent] = group[int(np.argmax(scores))].hyp
    count = max(best, default=-1) + 1
    if n_sentences is not None:
        if count > n_sentences:
            raise InputError(f"has sentence ids up to {count - 1}, more than the {n_sentences} expected", path)
        count = n_sentences
    missing = [i for i in range(count) if i not in best]
    if missing:
        log.warning("%s: no hypotheses for %d sentences (e.g. %s); writing empty lines", path, len(missing), missing[:5])
    return RerankResult([best.get(i, "") for i in range(count)], missing, stats.bad_lines)


def first_best(path: str, *, skip_bad: bool = False) -> list[str]:
    """The list's own 1-best (its first hypothesis per sentence)."""
    best: dict[int, str] = {}
    for group in iter_sentences(path, skip_bad=skip_bad):
        best.setdefault(group[0].sent_id, group[0].hyp)
    return [best.get(i, "") for i in range(max(best, default=-1) + 1)]
