"""Scores from a tables file with numpy alone (``nlmserve query --tables``), as KenLM's
``query`` answers from a binary file: no torch, no model file, no server.

    scorer = TablesScorer.open("model.nlt")
    scorer.score_ngrams(np.array([[the_id, cat_id]]))                # natural log, shape (N,)
    scorer.score_sentences([["the", "cat"]], log10=True)             # KenLM full_scores

It computes what the C++ scorer computes (nlmserve_tables.h; the formula is
``nlmserve.lm.scoring.ScoringTables``'): a class output's self-normalised score, which is what
``query --model --unnormalized`` answers, or a tree output's exact log-probability, which is
what ``query --model`` answers; from quantised rows (fp16, int8) within the error bound the
file records (nlmserve.lm.quantize), plus float32 rounding. Words map to ids through the
file's own vocabulary, lowercased first (``str.lower``) when the model was trained lowercased.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import numpy.typing as npt

from .dedup import distinct_rows
from ..wire.ngrams import NO_HASH, canonical_rows, feature_slots, no_word_id, sentence_rows, suffix_hashes
from .quantize import dequantize
from .tables_file import TablesFile, read_tables_file
from ..wire.logbase import ln_to_log10

#: Rows scored at a time (a tree's rows take about log2 V node rows each).
CHUNK = 4096
TREE_CHUNK = 512


@dataclass(frozen=True)
class SentenceScores:
    """Per-token scores of one sentence (KenLM ``full_scores``), ``</s>`` last when eos; the
    one definition, which ``nlmserve.lm.scoring`` (the torch scorer) returns too.

    Fields:
        token_log_probs: float32 (T,), in the base asked for.
        oov: bool (T,), the word was not in the vocabulary (scored as ``<unk>``).
        ngram_lengths: uint32 (T,), min(order, tokens available including ``<s>``).
        total: the sum of ``token_log_probs``, accumulated in float64.
    """

    token_log_probs: np.ndarray
    oov: np.ndarray
    ngram_lengths: np.ndarray
    total: float


class TablesScorer:
    """The scores of a mapped tables file (read-only; any number of threads)."""

    def __init__(self, tables: TablesFile) -> None:
        self.tables = tables
        h = tables.header
        self.order = h.order
        self.vocab_size = h.vocab_size
        self.dim = h.dim
        self.activation = h.activation
        self.lowercase = h.lowercase
        self.model_hash = h.model_hash
        #: True for a tree output (exact log-probabilities), False for a class output's
        #: self-normalised scores.
        self.normalized = h.output == "tree"
        V, outputs = h.vocab_size, h.tree_nodes or h.vocab_size
        rest = tables.rest
        self.bias = rest[:outputs]
        self.feature_order = h.feature_order
        if h.feature_order:
            self.word_class = rest[outputs:outputs + V].astype(np.int64)
            self.ngram_class = rest[outputs + V:outputs + V + h.ngram_class_table]
            self.ngram_word = rest[outputs + V + h.ngram_class_table:outputs + V + h.ngram_class_table
                                   + h.ngram_word_table]
        if h.tree_nodes:
            at = outputs
            self.code_start = rest[at:at + V + 1].astype(np.int64)
            at += V + 1
            self.step_start = rest[at:at + h.tree_codes + 1].astype(np.int64)
            at += h.tree_codes + 1
            self.steps = rest[at:at + h.tree_steps].astype(np.int64)

    @classmethod
    def open(cls, path: str | Path) -> "TablesScorer":
        """Map ``path`` (ModelFileError naming it when it is not a tables file of version 2)."""
        return cls(read_tables_file(path))

    @property
    def index(self) -> dict[str, int]:
        """The vocabulary: word → id."""
        return self.tables.index

    # ------------------------------------------------------------------ rows
    def score_ngrams(self, ids: npt.ArrayLike, *, log10: bool = False) -> np.ndarray:
        """Scores of (N, n) id rows, 1 <= n <= order (validated and made canonical by
        ``nlmserve.wire.ngrams.canonical_rows``: InvalidRequestError names a bad row) →
        float32 (N,), natural log unless ``log10``. Identical rows are scored once."""
        rows = canonical_rows(ids, self.order, self.vocab_size)
        out = self.score_rows(rows)
        return ln_to_log10(out) if log10 else out

    def score_rows(self, rows: np.ndarray) -> np.ndarray:
        """Natural-log scores of canonical rows (N, order) (checked by the caller) → float32 (N,)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return np.empty(0, dtype=np.float32)
        some, row_of = distinct_rows(rows)
        distinct = rows[some]
        out = np.empty(len(distinct), dtype=np.float32)
        chunk = TREE_CHUNK if self.normalized else CHUNK
        for start in range(0, len(distinct), chunk):
            part = distinct[start:start + chunk]
            r = self._context(part[:, :-1])
            out[start:start + chunk] = self._tree(r, part[:, -1]) if self.normalized else self._class(r, part)
        return out[row_of]  # type: ignore[no-any-return]

    def _rows(self, which: str, ids: np.ndarray, position: int = 0) -> np.ndarray:
        """Rows of the position table ``position`` or of the output table as float32 (M, D),
        as the scorers read them."""
        t = self.tables
        if which == "position":
            values = t.position[position][ids]
            scales = None if t.position_scale is None else t.position_scale[position][ids]
        else:
            values = t.output[ids]
            scales = None if t.output_scale is None else t.output_scale[ids]
        return dequantize(values, scales)

    def _context(self, ctx: np.ndarray) -> np.ndarray:
        """r = act(Σ_j position[j][w_j]) (N, D), summed in position order as the C++ scorer
        sums; the no-word (id V) adds nothing."""
        V = self.vocab_size
        r = np.zeros((ctx.shape[0], self.dim), dtype=np.float32)
        for j in range(ctx.shape[1]):
            ids = ctx[:, j]
            known = ids != no_word_id(V)
            if known.all():
                r += self._rows("position", ids, j)
            elif known.any():
                r[known] += self._rows("position", ids[known], j)
        if self.activation == "tanh":
            np.tanh(r, out=r)
        elif self.activation == "relu":
            np.maximum(r, 0, out=r)
        return r

    def _class(self, r: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """s = r · output[w] + bias[w] [+ the direct features' weights] (float32)."""
        w = rows[:, -1]
        s = np.einsum("nd,nd->n", r, self._rows("output", w)) + self.bias[w]
        if self.feature_order:
            n1 = self.order - 1
            h = suffix_hashes(rows[:, n1 - (self.feature_order - 1):n1], no_word=no_word_id(self.vocab_size))
            has = h != NO_HASH
            for table, y in ((self.ngram_class, self.word_class[w]), (self.ngram_word, w)):
                if table.size:
                    s = s + (table[feature_slots(h, y, table.size)] * has).sum(axis=1)
        return s.astype(np.float32)  # type: ignore[no-any-return]

    def _tree(self, r: np.ndarray, target: np.ndarray) -> np.ndarray:
        """log Σ_{codes of w} Π_{(node, bit)} σ(±(r · output[node] + bias[node])), every row's
        codes and steps at once (a word without a code, <s>: -inf)."""
        first, last = self.code_start[target], self.code_start[target + 1]
        n_codes = last - first
        code_row = np.repeat(np.arange(len(target)), n_codes)  # (C,): the row of each code
        codes = first[code_row] + (np.arange(code_row.size) - np.repeat(np.cumsum(n_codes) - n_codes, n_codes))
        a, b = self.step_start[codes], self.step_start[codes + 1]
        step_code = np.repeat(np.arange(codes.size), b - a)  # (S,): the code of each step
        steps = self.steps[a[step_code] + (np.arange(step_code.size) - np.repeat(np.cumsum(b - a) - (b - a), b - a))]
        node, left = steps >> 1, (steps & 1).astype(bool)
        x = (np.einsum("sd,sd->s", r[code_row[step_code]], self._rows("output", node)).astype(np.float64)
             + self.bias[node])
        log_sig = -np.logaddexp(0.0, np.where(left, -x, x))  # log σ(x) to the left, log σ(-x) to the right
        per_code = np.bincount(step_code, weights=log_sig, minlength=codes.size)
        best = np.full(len(target), -np.inf)
        np.maximum.at(best, code_row, per_code)
        sums = np.bincount(code_row, weights=np.exp(per_code - best[code_row]), minlength=len(target))
        with np.errstate(divide="ignore"):
            out = np.where(n_codes > 0, best + np.log(np.where(n_codes > 0, sums, 1.0)), -np.inf)
        return out.astype(np.float32)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ sentences
    def score_sentences(self, sentences: Sequence[Sequence[str]], *, bos: bool = True, eos: bool = True,
                        log10: bool = False) -> list[SentenceScores]:
        """Per-token scores of tokenised sentences (KenLM ``full_scores``; what
        ``LanguageModel.score_sentences`` gives with ``normalized`` False for a class output
        and True for a tree). ``bos=False`` only changes the reported n-gram lengths."""
        rows, oov, lens, owner = sentence_rows(sentences, self.index, self.order, lowercase=self.lowercase,
                                               bos=bos, eos=eos)
        scores = self.score_rows(rows)
        if log10:
            ln_to_log10(scores)
        bounds = np.searchsorted(owner, np.arange(len(sentences) + 1))
        out = []
        for i in range(len(sentences)):
            a, b = bounds[i], bounds[i + 1]
            lp = scores[a:b]
            out.append(SentenceScores(lp, oov[a:b], lens[a:b], float(lp.astype(np.float64).sum())))
        return out
