"""Rerank n-best lists with a set of weights: the 1-best of each sentence under ``w · f``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..common.errors import InputError
from .mert import group_arrays
from .nbest import NbestEntry, ReadStats, iter_sentences
from .weights import Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RerankResult:
    """One line per sentence id from 0 to the largest id (empty where the list has none)."""

    hyps: list[str]
    missing: list[int]
    bad_lines: int


def scored_groups(
    path: str, weights: Weights, *, skip_bad: bool = False, stats: ReadStats | None = None
) -> Iterator[tuple[list[NbestEntry], np.ndarray]]:
    """Each sentence's hypotheses with their model scores ``w · f``.

    Weights of features the list does not have are ignored; a list feature without a
    weight is an error (no silent zero).
    """
    cached: tuple[tuple[tuple[str, int], ...], np.ndarray] | None = None
    for group in iter_sentences(path, skip_bad=skip_bad, stats=stats):
        layout = group[0].layout()
        if cached is None or cached[0] != layout:
            try:
                w = np.asarray(weights.for_layout(layout).flat(), dtype=np.float64)
            except InputError as exc:
                raise InputError(f"{exc} (weights vs the features of line {group[0].line_no})", path) from exc
            cached = (layout, w)
        yield group, group_arrays(group, layout, path) @ cached[1]


def rerank(path: str, weights: Weights, *, skip_bad: bool = False, n_sentences: int | None = None) -> RerankResult:
    """The highest-scoring hypothesis per sentence (the first one on ties, as Moses' order).

    Weights as :func:`scored_groups` takes them. ``n_sentences`` pads the output to that many lines.
    """
    best: dict[int, str] = {}
    stats = ReadStats()
    for group, scores in scored_groups(path, weights, skip_bad=skip_bad, stats=stats):
        # the reader refuses a sentence id below its predecessor's: each id is one run of lines
        best[group[0].sent_id] = group[int(np.argmax(scores))].hyp
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


@dataclass(frozen=True)
class SearchCheck:
    """How often the decoder's 1-best lost, under its own weights, to a hypothesis of the lists.

    Fields:
        sentences: sentences of the decoder's list.
        beaten: those whose 1-best scores lower than some hypothesis of the lists (by more
            than the margin): a search error, since the decoder produced that hypothesis too.
        mean_gap: mean of those differences in model score (0 when none).
    """

    sentences: int
    beaten: int
    mean_gap: float

    @property
    def share(self) -> float:
        """beaten / sentences (0 for an empty list)."""
        return self.beaten / self.sentences if self.sentences else 0.0


def search_check(decoder_list: str, earlier: list[str], weights: Weights, *, margin: float = 1e-3) -> SearchCheck:
    """Whether the decoder found the best hypothesis it could have found, sentence by sentence.

    ``decoder_list``: an n-best list the decoder wrote with ``weights`` (its first entry per
    sentence is the 1-best); ``earlier``: lists of the same sentences from the same system
    (e.g. the earlier iterations of a tuning), rescored with ``weights``. A 1-best beaten by
    more than ``margin`` is a search error (pruning, future costs), not a model error.
    """
    first: dict[int, float] = {}
    best: dict[int, float] = {}
    for i, path in enumerate([decoder_list, *earlier]):
        for group, scores in scored_groups(path, weights):
            sent = group[0].sent_id
            if i == 0:
                first.setdefault(sent, float(scores[0]))
            if sent in first:
                best[sent] = max(best.get(sent, -np.inf), float(scores.max()))
    gaps = [best[s] - first[s] for s in first if best[s] > first[s] + margin]
    return SearchCheck(len(first), len(gaps), float(np.mean(gaps)) if gaps else 0.0)
