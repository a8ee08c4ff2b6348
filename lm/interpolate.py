"""Linear interpolation with a Kneser-Ney n-gram model read by KenLM (Chen, Grangier &
Auli 2016 report neural + KN this way):

    P(w | h) = λ · P_nlm(w | h) + (1 - λ) · P_KN(w | h)

per token, ``</s>`` included, every sentence started with ``<s>`` on both sides. λ is
given, or tuned on a development text to maximise its likelihood (the log-likelihood of
a two-component mixture is concave in λ, so a ternary search finds the optimum).

OOVs: each model scores a token it does not know with its own ``<unk>`` probability, as
KenLM's ``query`` does (the neural model maps it to ``<unk>``, KenLM to its ``<unk>``
entry). Perplexity *including* OOVs mixes those; *excluding* OOVs drops every token that
either model counts as OOV, so the interpolated, the neural and the KN numbers excluding
OOVs cover the same tokens. Trained on the same text with ``--min-count 1`` both models
have the same vocabulary and the two OOV sets coincide.

The ``kenlm`` Python module (PyPI ``kenlm``) reads ARPA and KenLM binary files.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..common.errors import InputError
from ..common.kenlm_file import load_kenlm
from .corpus import read_sentences
from .scoring import LanguageModel
from ..wire.logbase import LN10
from ..common.perplexity import from_log10

SENTENCES_PER_BATCH = 512


@dataclass(frozen=True)
class TokenScores:
    """Per-token log10 probabilities of a text under both models, and each one's OOV flags."""

    nlm: np.ndarray
    kn: np.ndarray
    oov_nlm: np.ndarray
    oov_kn: np.ndarray

    @property
    def in_both(self) -> np.ndarray:
        both: np.ndarray = ~(self.oov_nlm | self.oov_kn)
        return both


@dataclass(frozen=True)
class InterpolationResult:
    """Fields: ``weight`` λ of the neural model, perplexities (incl. and excl. OOVs) of the
    mix, of the neural model and of KN alone on the same tokens, token and OOV counts
    (``oov``: tokens OOV to either model), and whether λ was tuned."""

    weight: float
    tuned: bool
    perplexity: float
    perplexity_excl_oov: float
    nlm_perplexity: float
    nlm_perplexity_excl_oov: float
    kn_perplexity: float
    kn_perplexity_excl_oov: float
    tokens: int
    oov: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_kn(path: str | os.PathLike[str]) -> Any:
    """A ``kenlm.Model`` (ARPA or binary); InputError naming the file when it cannot be read."""
    return load_kenlm(path)


def score_text(lm: LanguageModel, kn: Any, text: str | os.PathLike[str], *, lowercase: bool = False) -> TokenScores:
    """Both models' per-token log10 probabilities over every non-empty line of ``text``."""
    lower = lowercase or lm.lowercase
    nlm: list[np.ndarray] = []
    kn_lp: list[float] = []
    oov_nlm: list[np.ndarray] = []
    oov_kn: list[bool] = []
    batch: list[list[str]] = []

    def flush() -> None:
        ids, oov, _, _ = lm.sentence_ngrams(batch)
        nlm.append(lm.score_ngrams(ids, log10=True).astype(np.float64))
        oov_nlm.append(oov)
        for words in batch:
            for prob, _, is_oov in kn.full_scores(" ".join(words), bos=True, eos=True):
                kn_lp.append(prob)
                oov_kn.append(bool(is_oov))
        batch.clear()

    for words in read_sentences(text, lowercase=lower):
        batch.append(words)
        if len(batch) >= SENTENCES_PER_BATCH:
            flush()
    if batch:
        flush()
    a = np.concatenate(nlm) if nlm else np.empty(0)
    if a.size == 0:
        raise InputError("nothing to score", str(text))
    if a.size != len(kn_lp):
        raise InputError(f"the two models saw {a.size} and {len(kn_lp)} tokens", str(text))
    return TokenScores(a, np.array(kn_lp), np.concatenate(oov_nlm), np.array(oov_kn, dtype=bool))


def mix_log10(nlm: np.ndarray, kn: np.ndarray, weight: float) -> np.ndarray:
    """log10(λ 10^nlm + (1-λ) 10^kn) per token, computed in the log domain."""
    if weight <= 0.0:
        return kn.copy()
    if weight >= 1.0:
        return nlm.copy()
    ln = np.logaddexp(math.log(weight) + nlm * LN10, math.log1p(-weight) + kn * LN10)
    return ln / LN10


def tune_weight(scores: TokenScores, iterations: int = 60) -> float:
    """λ in [0, 1] maximising the mix's log-likelihood (ternary search; concave in λ)."""
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if mix_log10(scores.nlm, scores.kn, a).sum() < mix_log10(scores.nlm, scores.kn, b).sum():
            lo = a
        else:
            hi = b
    return (lo + hi) / 2


def _ppl(log10: np.ndarray) -> float:
    return from_log10(float(log10.sum()), log10.size)


def interpolate(lm: LanguageModel, kn_path: str | os.PathLike[str], text: str | os.PathLike[str], *,
                weight: float | None = None, tune_text: str | os.PathLike[str] | None = None,
                lowercase: bool = False) -> InterpolationResult:
    """Perplexity of the mix on ``text``; λ = ``weight``, or tuned on ``tune_text``."""
    if (weight is None) == (tune_text is None):
        raise ValueError("give exactly one of weight and tune_text")
    kn = load_kn(kn_path)
    if weight is None:
        assert tune_text is not None
        weight = tune_weight(score_text(lm, kn, tune_text, lowercase=lowercase))
    elif not 0.0 <= weight <= 1.0:
        raise ValueError(f"the interpolation weight must lie in [0, 1], got {weight}")
    s = score_text(lm, kn, text, lowercase=lowercase)
    mix = mix_log10(s.nlm, s.kn, weight)
    keep = s.in_both
    return InterpolationResult(
        weight=weight, tuned=tune_text is not None,
        perplexity=_ppl(mix), perplexity_excl_oov=_ppl(mix[keep]),
        nlm_perplexity=_ppl(s.nlm), nlm_perplexity_excl_oov=_ppl(s.nlm[keep]),
        kn_perplexity=_ppl(s.kn), kn_perplexity_excl_oov=_ppl(s.kn[keep]),
        tokens=int(s.nlm.size), oov=int((~keep).sum()),
    )


def format_interpolation(r: InterpolationResult) -> str:
    how = "tuned" if r.tuned else "given"
    return "\n".join([
        f"Interpolation weight (neural, {how}):\t{r.weight:.4f}",
        f"Interpolated perplexity including OOVs:\t{r.perplexity:.4f}",
        f"Interpolated perplexity excluding OOVs:\t{r.perplexity_excl_oov:.4f}",
        f"Neural alone:\t{r.nlm_perplexity:.4f} ({r.nlm_perplexity_excl_oov:.4f} excluding OOVs)",
        f"Kneser-Ney alone:\t{r.kn_perplexity:.4f} ({r.kn_perplexity_excl_oov:.4f} excluding OOVs)",
        f"Tokens:\t{r.tokens}\nOOVs (either model):\t{r.oov}",
    ])
