"""Perplexity of a text under a model, reported as KenLM's ``query`` reports it.

Every sentence is scored with ``<s>`` context and ``</s>`` counted as a token. Perplexity
including OOVs is ``10 ** (-Σ log10 p / tokens)`` over all tokens (OOV words are scored as
``<unk>``); excluding OOVs drops the OOV tokens from both the sum and the count. The
per-band table (Chen, Grangier & Auli 2016, §5.4) splits the tokens by how often the word
occurred in the training text (the unigram counts stored in the model file) and gives
each band's share of tokens and its entropy in bits per token.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from .corpus import read_sentences
from .scoring import LanguageModel
from .vocab import EOS_ID
from ..common.errors import CorpusError
from ..common.perplexity import from_log10

# Training-frequency bands: (label, lowest count, highest count); OOV tokens form their own band.
BANDS: tuple[tuple[str, int, float], ...] = (
    ("1", 1, 1),
    ("2-10", 2, 10),
    ("11-100", 11, 100),
    ("101-1000", 101, 1000),
    (">1000", 1001, math.inf),
)
SENTENCES_PER_BATCH = 512


@dataclass(frozen=True)
class Band:
    """One frequency band: label, tokens in it, their share, entropy (bits/token)."""

    label: str
    tokens: int
    share: float
    entropy_bits: float | None


@dataclass(frozen=True)
class EvalResult:
    """Fields: ``perplexity`` (incl. OOVs), ``perplexity_excl_oov``, ``tokens`` (incl.
    ``</s>``), ``oov`` (OOV tokens), ``sentences``, ``log10_prob`` (total),
    ``entropy_bits`` (per token, incl. OOVs), ``bands`` (by training frequency),
    ``model_hash``; for self-normalised (NCE) models ``log_z_mean`` and ``log_z_std``:
    the natural-log normaliser over the text's contexts (unnormalised − normalised score),
    0 for a perfectly self-normalised model."""

    perplexity: float
    perplexity_excl_oov: float
    tokens: int
    oov: int
    sentences: int
    log10_prob: float
    entropy_bits: float
    model_hash: str
    bands: list[Band] = field(default_factory=list)
    log_z_mean: float | None = None
    log_z_std: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _batches(sentences: Iterable[list[str]], size: int) -> Iterator[list[list[str]]]:
    batch: list[list[str]] = []
    for s in sentences:
        batch.append(s)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def evaluate(lm: LanguageModel, text: str | os.PathLike[str], *, lowercase: bool = False) -> EvalResult:
    """Score every line of ``text`` (plain, .gz or .xz); lowercased when asked or when the
    model was trained lowercased."""
    lower = lowercase or lm.lowercase
    counts = lm.unigram_counts
    log10_all: list[np.ndarray] = []
    oov_all: list[np.ndarray] = []
    freq_all: list[np.ndarray] = []
    log_z: list[np.ndarray] = []
    n_sent = 0
    for batch in _batches(read_sentences(text, lowercase=lower), SENTENCES_PER_BATCH):
        n_sent += len(batch)
        ids, oov_b, _, _ = lm.sentence_ngrams(batch)
        log10_all.append(lm.score_ngrams(ids, log10=True).astype(np.float64))
        if lm.self_normalized:
            ln = lm.score_ngrams(ids).astype(np.float64)
            log_z.append(lm.score_ngrams(ids, normalized=False).astype(np.float64) - ln)
        oov_all.append(oov_b)
        if counts is not None:
            target = ids[:, -1]
            f = counts[target].astype(np.int64)
            f[target == EOS_ID] = counts[EOS_ID]
            freq_all.append(f)
    lp = np.concatenate(log10_all) if log10_all else np.empty(0)
    oov = np.concatenate(oov_all) if oov_all else np.empty(0, dtype=bool)
    tokens = int(lp.size)
    if tokens == 0:
        raise CorpusError("empty: no tokens", os.fspath(text))  # as nlmserve train says it
    total = float(lp.sum())
    n_oov = int(oov.sum())
    in_vocab = ~oov
    ppl = from_log10(total, tokens)
    ppl_excl = from_log10(float(lp[in_vocab].sum()), int(in_vocab.sum()))
    bits = -lp / math.log10(2.0)  # -log2 p per token
    bands: list[Band] = []
    if freq_all:
        freq = np.concatenate(freq_all)
        masks = [("OOV", oov)] + [(label, in_vocab & (freq >= lo) & (freq <= hi)) for label, lo, hi in BANDS]
        unseen = in_vocab & (freq == 0)
        if unseen.any():
            masks.insert(1, ("0 (in vocabulary, unseen)", unseen))
        for label, m in masks:
            n = int(m.sum())
            bands.append(Band(label, n, n / tokens, float(bits[m].mean()) if n else None))
    return EvalResult(
        perplexity=ppl,
        perplexity_excl_oov=ppl_excl,
        tokens=tokens,
        oov=n_oov,
        sentences=n_sent,
        log10_prob=total,
        entropy_bits=float(bits.mean()),
        model_hash=lm.model_hash,
        bands=bands,
        log_z_mean=float(np.concatenate(log_z).mean()) if log_z else None,
        log_z_std=float(np.concatenate(log_z).std()) if log_z else None,
    )


def format_report(r: EvalResult) -> str:
    """KenLM ``query``-style summary lines, then the band table."""
    lines = [
        f"Perplexity including OOVs:\t{r.perplexity:.4f}",
        f"Perplexity excluding OOVs:\t{r.perplexity_excl_oov:.4f}",
        f"OOVs:\t{r.oov}",
        f"Tokens:\t{r.tokens}",
        f"Sentences:\t{r.sentences}",
        f"Log10 probability:\t{r.log10_prob:.4f}",
    ]
    if r.log_z_mean is not None:
        lines.append(f"Self-normalisation log Z (ln):\tmean {r.log_z_mean:.4f}, std {r.log_z_std:.4f}")
    if r.bands:
        lines.append("")
        lines.append(f"{'training frequency':<26}{'tokens':>10}{'share':>9}{'bits/token':>12}")
        for b in r.bands:
            ent = f"{b.entropy_bits:.3f}" if b.entropy_bits is not None else "-"
            lines.append(f"{b.label:<26}{b.tokens:>10}{b.share:>9.3f}{ent:>12}")
        lines.append(f"{'all':<26}{r.tokens:>10}{1.0:>9.3f}{r.entropy_bits:>12.3f}")
    return "\n".join(lines)
