"""BLEU from sacrebleu's sufficient statistics, Moses' 9-statistic layout, significance.

Statistics first, scores second: every hypothesis' n-gram statistics are computed once
with sacrebleu's own counting (``BLEU._cache_references`` / ``_compute_segment_statistics``,
the pieces ``_extract_corpus_statistics`` is made of) and BLEU is assembled from summed
statistics with ``BLEU._compute_score_from_stats``. Nothing here re-implements BLEU.

sacrebleu's per-segment layout is ``[hyp_len, ref_len, c1..c4, t1..t4]``; Moses'
extractor writes ``c1 t1 c2 t2 c3 t3 c4 t4 ref_len`` (``SCORES_TXT`` with 9 columns).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, cast

import numpy as np
from sacrebleu.metrics.bleu import BLEU, BLEUScore

from ..common.errors import InputError
from .nbest import read_lines

log = logging.getLogger(__name__)

N_STATS = 10  # sacrebleu layout with max_ngram_order 4
MOSES_N_STATS = 9


@dataclass(frozen=True)
class BleuConfig:
    """How BLEU is computed (one setting for tuning and for reporting).

    Fields:
        lowercase: compare lowercased text (sacrebleu ``lowercase``; signature ``case:lc``).
        tokenize: sacrebleu tokenizer; ``none`` because Moses n-best lists and references
            are already tokenised (as ``multi-bleu.perl`` and Moses' BleuScorer count).
        smooth_method: sacrebleu smoothing (``exp`` is its corpus default).
    """

    lowercase: bool = False
    tokenize: str = "none"
    smooth_method: str = "exp"

    def metric(self) -> BLEU:
        return BLEU(lowercase=self.lowercase, tokenize=self.tokenize, smooth_method=self.smooth_method, force=True)


def read_references(paths: Sequence[str], n_sentences: int | None = None) -> list[list[str]]:
    """Reference streams (one list of lines per file), all of the same length."""
    streams = [read_lines(path) for path in paths]
    if not streams:
        raise InputError("at least one reference file is needed")
    for path, stream in zip(paths, streams):
        if len(stream) != len(streams[0]):
            raise InputError(f"has {len(stream)} lines but {paths[0]} has {len(streams[0])}", path)
        if n_sentences is not None and len(stream) < n_sentences:
            raise InputError(f"has {len(stream)} lines, fewer than the {n_sentences} sentences needed", path)
    return streams


class SentenceStats:
    """Per-sentence cached reference n-grams, giving BLEU statistics of any hypothesis."""

    def __init__(self, config: BleuConfig, references: Sequence[Sequence[str]]) -> None:
        self.config = config
        self.metric = config.metric()
        # A list of {'ref_ngrams', 'ref_lens'} dicts, one per sentence (sacrebleu's cache).
        self._refs: list[dict[str, Any]] = self.metric._cache_references(references)

    def __len__(self) -> int:
        return len(self._refs)

    def stats(self, sent: int, hyps: Sequence[str]) -> np.ndarray:
        """(len(hyps), 10) int64 statistics of hypotheses of sentence ``sent`` (sacrebleu layout)."""
        if not 0 <= sent < len(self._refs):
            raise InputError(f"sentence id {sent} has no reference (there are {len(self._refs)})")
        ref = self._refs[sent]
        rows = [self.metric._compute_segment_statistics(self.metric._preprocess_segment(h), ref) for h in hyps]
        return np.asarray(rows, dtype=np.int64).reshape(len(hyps), N_STATS)

    def score(self, stats: np.ndarray) -> BLEUScore:
        return score_from_stats(self.metric, stats)


def score_from_stats(metric: BLEU, summed: np.ndarray) -> BLEUScore:
    """BLEU of summed statistics (sacrebleu layout), by sacrebleu."""
    return metric._compute_score_from_stats([int(x) for x in summed])


def to_moses(stats: np.ndarray) -> np.ndarray:
    """sacrebleu layout (…, 10) → Moses BleuScorer layout (…, 9): c1 t1 … c4 t4 ref_len."""
    out = np.empty(stats.shape[:-1] + (MOSES_N_STATS,), dtype=stats.dtype)
    out[..., 0:8:2] = stats[..., 2:6]
    out[..., 1:8:2] = stats[..., 6:10]
    out[..., 8] = stats[..., 1]
    return out


def from_moses(stats: np.ndarray) -> np.ndarray:
    """Moses layout (…, 9) → sacrebleu layout (…, 10); the hypothesis length is t1."""
    out = np.empty(stats.shape[:-1] + (N_STATS,), dtype=stats.dtype)
    out[..., 0] = stats[..., 1]
    out[..., 1] = stats[..., 8]
    out[..., 2:6] = stats[..., 0:8:2]
    out[..., 6:10] = stats[..., 1:8:2]
    return out


def corpus_bleu(hyps: Sequence[str], references: Sequence[Sequence[str]], config: BleuConfig) -> tuple[BLEUScore, str]:
    """sacrebleu's corpus BLEU of ``hyps`` and its signature string."""
    for stream in references:
        if len(stream) != len(hyps):
            raise InputError(f"{len(hyps)} hypotheses but {len(stream)} reference lines")
    metric = config.metric()
    score = metric.corpus_score(list(hyps), [list(r) for r in references])
    return score, metric.get_signature().format()


@dataclass(frozen=True)
class PairedResult:
    """Paired bootstrap resampling of a system against a baseline (sacrebleu's ``bs`` test).

    Fields: BLEU of each, the system's mean and 95% half-interval over resamples, the
    p-value of the difference, sacrebleu's signature (with seed and sample count).
    """

    baseline_bleu: float
    system_bleu: float
    system_mean: float
    system_ci: float
    p_value: float
    n_samples: int
    signature: str


def paired_bootstrap(
    baseline: Sequence[str],
    system: Sequence[str],
    references: Sequence[Sequence[str]],
    config: BleuConfig,
    n_samples: int = 1000,
) -> PairedResult:
    """sacrebleu's paired bootstrap resampling (Koehn 2004) of ``system`` vs ``baseline``.

    The resampling seed is sacrebleu's (``SACREBLEU_SEED``, default 12345), so runs repeat.
    """
    from sacrebleu.significance import PairedTest, Result

    if len(baseline) != len(system):
        raise InputError(f"baseline has {len(baseline)} lines but the system has {len(system)}")
    metric = config.metric()
    test = PairedTest(
        [("baseline", list(baseline)), ("system", list(system))],
        {"BLEU": metric},
        [list(r) for r in references],
        test_type="bs",
        n_samples=n_samples,
    )
    signatures, scores = test()
    base_result = cast(Result, scores["BLEU"][0])
    sys_result = cast(Result, scores["BLEU"][1])
    p_value = float(sys_result.p_value) if sys_result.p_value is not None else float("nan")
    if list(baseline) == list(system):
        # sacrebleu's statistic is |Δ| minus its mean: for identical outputs every sample
        # is 0 and it reports the smallest p, 1/(n+1). No difference means p = 1.
        p_value = 1.0
    return PairedResult(
        baseline_bleu=float(base_result.score),
        system_bleu=float(sys_result.score),
        system_mean=float(sys_result.mean if sys_result.mean is not None else sys_result.score),
        system_ci=float(sys_result.ci if sys_result.ci is not None else 0.0),
        p_value=p_value,
        n_samples=n_samples,
        signature=signatures["BLEU"].format(),
    )


def weights_digest(weights: Mapping[str, Sequence[float]]) -> str:
    """A short stable digest of a set of weights (for signatures)."""
    payload = json.dumps({k: [float(v) for v in vs] for k, vs in weights.items()}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


def full_signature(bleu_signature: str, weights: Mapping[str, Sequence[float]] | None = None, model_hash: str | None = None) -> str:
    """sacrebleu's signature extended with the weights digest and the model hash."""
    parts = [bleu_signature]
    if weights is not None:
        parts.append(f"weights:{weights_digest(weights)}")
    if model_hash is not None:
        parts.append(f"model:{model_hash}")
    return "|".join(parts)
