"""A Kneser-Ney model read in-process by KenLM, as a scorer for ``nlmserve rescore``.

Moses systems often carry more than one language model (a large general one and a
small in-domain one). ``nlmserve rescore --kenlm FILE --feature-name KN1`` adds such a
model's sentence log-probability to an n-best list with the same machinery as the neural
feature (streaming, one score per distinct n-gram, atomic output, checkpoints and
resume, ``--lowercase``, ``--skip-bad``), so the two can be tuned together or compared.

The value is the one Moses' ``KENLM`` feature computes for a whole sentence:
``ln 10 ·`` KenLM's ``score(hyp, bos=True, eos=True)``, i.e. the natural-log probability of
every word and ``</s>`` after ``<s>``, unknown words at the model's ``<unk>`` probability.
Each n-gram row of the rescoring loop (left-padded with ``<s>``) is scored as
``P(w | context)`` with the context started at its newest ``<s>``
(``BeginSentenceWrite``) or, without one, from the null context; KenLM's state keeps what
the model can use of the context, so the sum over a hypothesis's rows equals the
sentence score up to float rounding.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..common.errors import InputError
from ..common.kenlm_file import load_kenlm
from ..wire.ngrams import BOS, BOS_ID, EOS, EOS_ID, UNK, UNK_ID
from ..wire.logbase import log10_to_ln
from .nbest import file_sha256
from .rescore import SourceInfo, SourceScores, log10_flag


class _GrowingVocabulary(dict[str, int]):
    """Word → id, assigning the next id to a word on its first lookup.

    KenLM maps words it does not know to its own ``<unk>``, so the rescoring loop must
    pass every word through as itself rather than collapse them to one unknown id.
    """

    def __init__(self, words: list[str]) -> None:
        super().__init__((w, i) for i, w in enumerate(words))
        self.words = words

    def get(self, word: str, default: Any = None) -> int:  # type: ignore[override]
        found = super().get(word)
        if found is None:
            found = len(self.words)
            self.words.append(word)
            self[word] = found
        return found


class KenlmScorer:
    """A ``moses_plugin.rescore.ScoreSource`` (``order``, ``info.model_hash``,
    ``vocabulary``, ``score_ids``, ``close``) answered by a local KenLM model."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._model = load_kenlm(path)
        import kenlm  # present: load_kenlm has just used it

        self._state_type = kenlm.State
        self._words = [""] * 3  # the rescoring loop's fixed ids, then every word as it comes
        self._words[UNK_ID], self._words[BOS_ID], self._words[EOS_ID] = UNK, BOS, EOS
        self._vocab = _GrowingVocabulary(self._words)
        self.info = SourceInfo(model_hash=file_sha256(path), path=str(path))

    @property
    def order(self) -> int:
        return int(self._model.order)

    def vocabulary(self) -> dict[str, int]:
        return self._vocab

    def score_ids(self, ids: np.ndarray, log_base: str = "ln", normalized: bool = True) -> SourceScores:
        """Conditional log-probability of the last word of each row given the others.

        ``log_base`` is ``"ln"`` or ``"log10"``; ``normalized`` is accepted for the
        client's signature (KenLM's probabilities are normalised).
        """
        log10 = log10_flag(log_base)
        rows = np.asarray(ids)
        if rows.ndim != 2 or rows.shape[1] < 1:
            raise InputError(f"n-gram ids must be a (rows, n) array, got shape {rows.shape}")
        model, words = self._model, self._words
        state, other = self._state_type(), self._state_type()
        out = np.empty(len(rows), dtype=np.float64)
        for i, row in enumerate(rows.tolist()):
            start = 0
            for j in range(len(row) - 2, -1, -1):
                if row[j] == BOS_ID:
                    start = j + 1
                    break
            if start:
                model.BeginSentenceWrite(state)
            else:
                model.NullContextWrite(state)
            for word_id in row[start:-1]:
                model.BaseScore(state, words[word_id], other)
                state, other = other, state
            out[i] = model.BaseScore(state, words[row[-1]], other)
        if not log10:
            log10_to_ln(out)
        return SourceScores(out)

    def close(self) -> None:
        """Nothing to release (the model is freed with the object)."""
