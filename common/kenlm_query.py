"""``nlmserve.common.kenlm_query``: KenLM ``query``'s output, for ``nlmserve score`` (through a server)
and ``nlmserve query`` (a model file in this process), which differ only in who scores.

Plain output, one line per sentence, then a summary::

    word=id ngram_length log10prob<TAB>...</s>=2 n log10prob<TAB>Total: T OOV: k
    Perplexity including OOVs:<TAB>P
    Perplexity excluding OOVs:<TAB>P
    OOVs:<TAB>k
    Tokens:<TAB>n

``id`` is the word's id in the model's vocabulary (0, ``<unk>``, for an unknown word, which is
scored as ``<unk>``), ``ngram_length`` the words of history used, ``<s>`` included, capped at
the order. ``--json``: one object per sentence (``tokens`` with word, id, ngram_length,
log_prob (log10), oov; ``total``; ``oov``), then one ``{"summary": {...}}`` object
(``perplexity``, ``perplexity_excl_oov``, ``oov``, ``tokens``: the keys of ``nlmserve eval
--json``, OOVs under ``oov`` everywhere).

Input: UTF-8, one whitespace-tokenised sentence per line (an empty line scores ``</s>``
alone). No input at all, a line that is not UTF-8 or one the model refuses (``<s>`` inside a
sentence) is an ``InputError`` naming the line. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator, Mapping, Protocol, Sequence, TextIO

from .errors import InputError, InvalidRequestError
from .perplexity import from_log10

if TYPE_CHECKING:
    import numpy as np

#: Lines scored in one call of the scoring function.
BATCH_LINES = 1000
STDIN = "<stdin>"


class SentenceScores(Protocol):
    """What a scorer returns per sentence (``client.SentenceScore``, ``lm.scoring.SentenceScores``):
    numpy arrays of log10 probabilities, OOV flags and n-gram lengths, ``</s>`` last, and
    their sum."""

    @property
    def token_log_probs(self) -> np.ndarray: ...  # (T,) float32
    @property
    def oov(self) -> np.ndarray: ...  # (T,) bool
    @property
    def ngram_lengths(self) -> np.ndarray: ...  # (T,) uint32
    @property
    def total(self) -> float: ...


#: Scores of a batch of sentences (whitespace-tokenised strings), one per sentence, log10.
ScoreBatch = Callable[[list[str]], Sequence[SentenceScores]]


@dataclass
class Totals:
    """Sums over every sentence, for the summary lines."""

    log10: float = 0.0
    oov_log10: float = 0.0
    tokens: int = 0
    oovs: int = 0

    def summary(self) -> dict[str, float | int]:
        ppl = from_log10(self.log10, self.tokens)
        ppl_excl = from_log10(self.log10 - self.oov_log10, self.tokens - self.oovs)
        return {"perplexity": ppl, "perplexity_excl_oov": ppl_excl, "oov": self.oovs, "tokens": self.tokens}


def add_input_flags(p: argparse.ArgumentParser) -> None:
    """The output and input flags ``score`` and ``query`` share: ``--json``, ``--lowercase``,
    ``--no-bos``, ``--no-eos``, ``--unnormalized``."""
    p.add_argument("--json", action="store_true", help="one JSON object per sentence, then a summary")
    p.add_argument("--lowercase", action="store_true", help="lowercase the input first")
    p.add_argument("--no-bos", action="store_true", help="do not condition the first word on <s>")
    p.add_argument("--no-eos", action="store_true", help="do not score </s>")
    p.add_argument("--unnormalized", action="store_true",
                   help="the raw scores of a self-normalised model (NCE) instead of log-probabilities")


def read_batches(stream: BinaryIO, lowercase: bool = False, name: str = STDIN) -> Iterator[tuple[int, list[str]]]:
    """(number of the batch's first line, its lines stripped) of ``stream``, ``BATCH_LINES`` at a
    time; lowercased when asked. InputError for a line that is not UTF-8 and for no input."""
    batch: list[str] = []
    first = 1
    number = 0
    for number, raw in enumerate(stream, 1):
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise InputError(f"not UTF-8 ({exc.reason} at byte {exc.start})", name, number) from exc
        batch.append(text.lower() if lowercase else text)
        if len(batch) >= BATCH_LINES:
            yield first, batch
            batch, first = [], number + 1
    if batch:
        yield first, batch
    if number == 0:
        raise InputError("no input: give one sentence per line", name)


def write_scores(stream: BinaryIO, out: TextIO, score: ScoreBatch, vocab: Mapping[str, int], *,
                 model_lowercase: bool, lowercase: bool = False, eos: bool = True, as_json: bool = False,
                 name: str = STDIN) -> Totals:
    """Score ``stream``'s sentences with ``score`` and write KenLM query's lines (or JSON) to
    ``out``, the summary last; returns the totals. ``vocab`` is the model's word → id map
    (``model_lowercase``: the model lowercases words before looking them up); ``lowercase``
    lowercases the input first."""
    totals = Totals()
    for first, batch in read_batches(stream, lowercase, name):
        try:
            scores = score(batch)
        except InvalidRequestError as exc:
            if exc.index is None:
                raise
            reason = str(exc).removeprefix(f"item {exc.index}: ")
            raise InputError(reason, name, first + exc.index) from exc
        for text, s in zip(batch, scores):
            out.write(sentence_line(text, s, vocab, totals, model_lowercase=model_lowercase, eos=eos,
                                    as_json=as_json) + "\n")
    out.write(summary_lines(totals, as_json))
    return totals


def sentence_line(text: str, s: SentenceScores, vocab: Mapping[str, int], totals: Totals, *,
                  model_lowercase: bool, eos: bool, as_json: bool) -> str:
    """One sentence's line (no newline), added to ``totals``."""
    words = text.split() + (["</s>"] if eos else [])
    lp: list[float] = s.token_log_probs.tolist()
    lens: list[int] = s.ngram_lengths.tolist()
    oov: list[bool] = s.oov.tolist()
    ids = [vocab.get(w.lower() if model_lowercase else w, 0) for w in words]
    n_oov = sum(oov)
    totals.log10 += s.total
    totals.oov_log10 += sum(p for p, o in zip(lp, oov) if o)
    totals.tokens += len(words)
    totals.oovs += n_oov
    if as_json:
        tokens = [{"word": w, "id": i, "ngram_length": n, "log_prob": p, "oov": o}
                  for w, i, n, p, o in zip(words, ids, lens, lp, oov)]
        return json.dumps({"tokens": tokens, "total": s.total, "oov": n_oov})
    cells = [f"{w}={i} {n} {p:.6g}" for w, i, n, p in zip(words, ids, lens, lp)]
    return "\t".join(cells + [f"Total: {s.total:.6g} OOV: {n_oov}"])


def summary_lines(totals: Totals, as_json: bool) -> str:
    """The summary: perplexity with and without OOVs, OOVs, tokens (or one JSON object)."""
    summary = totals.summary()
    if as_json:
        return json.dumps({"summary": summary}) + "\n"
    return (f"Perplexity including OOVs:\t{summary['perplexity']:.6g}\n"
            f"Perplexity excluding OOVs:\t{summary['perplexity_excl_oov']:.6g}\n"
            f"OOVs:\t{summary['oov']}\n"
            f"Tokens:\t{summary['tokens']}\n")
