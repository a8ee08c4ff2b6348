"""Batch k-best MIRA (Cherry & Foster 2012), as Moses' ``kbmira`` runs it on n-best lists.

The alternative to MERT that mert-moses.pl offers as ``--batch-mira``. Epochs over the
sentences of the tuning lists, in a shuffled order (seeded); per sentence, with the
current weights ``w`` and a background pseudo-corpus ``bg`` of BLEU statistics:

- every hypothesis gets a sentence-level BLEU in context, ``BLEU(bg + s) · |ref(bg + s)|``
  (Chiang et al. 2008: unsmoothed BLEU of the statistics added to the background, scaled
  by its reference length; ``bg`` starts at ones, so nothing is zero);
- hope = argmax(w·f + BLEU), fear = argmax(w·f − BLEU);
- if they differ and hope's BLEU is higher, the margin loss ``ΔBLEU − w·(f_hope − f_fear)``
  gives, when positive, the passive-aggressive step ``w += min(C, loss/‖Δf‖²) · Δf``;
- ``bg ← decay · bg + s_hope`` (or the model's 1-best, ``model_bg``).

The averaged weights (the mean of the start and of the weights after every update so
far) are evaluated after each epoch by corpus BLEU (sacrebleu, from the summed statistics
of each sentence's model 1-best); the best epoch is the result. Unlike kbmira, the start
point competes too (as MERT's does), so the result is never worse on the tuning lists than
the weights it started from: with most weights fixed MIRA can keep pushing the free ones
past any good value. Fixed features (``FeatureRange.active`` False) do not move; bounds are
kept by clipping after each step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..common.errors import InputError
from .bleu import SentenceStats, score_from_stats
from .mert import FeatureRange, MertData, PackedData, prepare
from .weights import Weights

log = logging.getLogger(__name__)

# sacrebleu's statistics layout: [hyp_len, ref_len, c1..c4, t1..t4].
_REF_LEN, _CORRECT, _TOTAL = 1, slice(2, 6), slice(6, 10)


@dataclass(frozen=True)
class MiraConfig:
    """kbmira's settings (its defaults).

    Fields:
        iterations: epochs over the tuning sentences (kbmira ``--iters``, 60).
        c: cap of each step, lower for more regularisation (kbmira ``-C``, 0.01).
        decay: decay of the background pseudo-corpus per update (kbmira ``--decay``, 0.999).
        model_bg: add the model's 1-best to the background instead of the hope (``--model-bg``).
        seed: seed of the sentence order in each epoch.
        normalize: L1-normalise the result, as ``nlmserve tune`` reports MERT's.
    """

    iterations: int = 60
    c: float = 0.01
    decay: float = 0.999
    model_bg: bool = False
    seed: int = 0
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise InputError(f"MIRA iterations must be at least 1, not {self.iterations}")
        if not self.c > 0:
            raise InputError(f"MIRA's C must be positive, not {self.c}")
        if not 0 < self.decay <= 1:
            raise InputError(f"the background decay must be in (0, 1], not {self.decay}")


@dataclass(frozen=True)
class MiraResult:
    """Best averaged weights, their corpus BLEU on the tuning lists, and per-epoch BLEU."""

    weights: Weights
    bleu: float
    start_bleu: float
    epochs: tuple[float, ...]
    updates: int


def background_bleu(stats: np.ndarray, bg: np.ndarray) -> np.ndarray:
    """Sentence-level BLEU of each row of ``stats`` (K, 10) added to ``bg`` (10,), times its
    reference length: kbmira's hope/fear metric (no smoothing; ``bg`` keeps counts positive)."""
    s = stats + bg
    log_precision = (np.log(s[:, _CORRECT]) - np.log(s[:, _TOTAL])).mean(axis=1)
    brevity = np.minimum(0.0, 1.0 - s[:, _REF_LEN] / s[:, 0])
    return np.asarray(np.exp(log_precision + brevity) * s[:, _REF_LEN])


def tune(
    data: MertData,
    scorer: SentenceStats,
    init: Weights,
    ranges: Sequence[FeatureRange] | None = None,
    config: MiraConfig = MiraConfig(),
) -> MiraResult:
    """Batch MIRA from ``init``; the best epoch's averaged weights win, unless none beats
    ``init`` on the tuning lists (then ``init`` is returned)."""
    packed, w, ranges = prepare(data, init, ranges)
    free = np.array([r.active for r in ranges], dtype=np.float64)
    lo = np.array([r.lo for r in ranges])
    hi = np.array([r.hi for r in ranges])
    sizes = packed.mask.sum(axis=1)
    rng = np.random.default_rng(config.seed)
    bg = np.ones(packed.stats.shape[-1])
    total, n_updates = w.copy(), 1
    start_bleu = _corpus_bleu(packed, scorer, w)
    best_w, best_bleu, epochs = w.copy(), start_bleu, []
    for epoch in range(config.iterations):
        losses = 0.0
        for row in rng.permutation(len(sizes)):
            k = sizes[row]
            feats, stats = packed.feats[row, :k], packed.stats[row, :k]
            model = feats @ w
            sbleu = background_bleu(stats, bg)
            hope, fear = int(np.argmax(model + sbleu)), int(np.argmax(model - sbleu))
            if hope == fear or not sbleu[hope] > sbleu[fear]:
                continue
            diff = (feats[hope] - feats[fear]) * free
            loss = sbleu[hope] - sbleu[fear] - float(diff @ w)
            norm = float(diff @ diff)
            if loss > 0 and norm > 0:
                w = np.clip(w + min(config.c, loss / norm) * diff, lo, hi)
                losses += loss
                total += w
                n_updates += 1
            bg = config.decay * bg + stats[int(np.argmax(model)) if config.model_bg else hope]
        average = total / n_updates
        bleu = _corpus_bleu(packed, scorer, average)
        epochs.append(bleu)
        log.debug("MIRA epoch %d: BLEU %.4f of the averaged weights (loss %.1f)", epoch, bleu, losses)
        if bleu > best_bleu:
            best_w, best_bleu = average, bleu
    best = "the start" if best_bleu == start_bleu else f"epoch {epochs.index(best_bleu)}"
    log.info("MIRA: BLEU %.4f at the start, %.4f after %d epochs (best: %s, %d updates)",
             start_bleu, best_bleu, len(epochs), best, n_updates - 1)
    weights = Weights.from_flat(data.layout, best_w.tolist())
    if config.normalize:
        weights = weights.normalized_l1()
    return MiraResult(weights, best_bleu, start_bleu, tuple(epochs), n_updates - 1)


def _corpus_bleu(packed: PackedData, scorer: SentenceStats, w: np.ndarray) -> float:
    return float(score_from_stats(scorer.metric, packed.corpus_stats(w)).score)
