"""A neural model file scored in this process, as a source for ``nlmserve rescore --model``.

``nlmserve rescore --model model.nlm`` needs no server: the model is loaded with
``nlmserve.lm.scoring.LanguageModel`` (cuda when available, else cpu) and the rescoring
loop (``moses_plugin.rescore``: streaming, one score per distinct n-gram, checkpoints,
resume, atomic output) asks it for scores as it would ask a server.

The values are the floats a server of the same model sends a lone client (no caches,
the default): the rows of each ``score_ids`` call are made canonical
(``nlmserve.wire.ngrams.canonical_rows``) and scored by ``LanguageModel.score_prepared`` in
passes of ``PASS_ROWS`` rows from the start of the call, as the server's engine splits a
request into forward passes of ``max_batch_ngrams`` (4,096 by default); float32, natural
log, times ``float32(log10 e)`` for log10. The vocabulary is the model's, so unknown
words become ``<unk>`` as through the server; the model hash is the file's, as the server
reports it. So the output file is the same byte for byte on the same device (and thread
count), and a run begun through a server can be resumed here and back.

torch is imported when a ``ModelScorer`` is made, not with this module.
"""

from __future__ import annotations

import os

import numpy as np

from ..wire.logbase import ln_to_log10
from .rescore import SourceInfo, SourceScores, log10_flag

#: Rows per forward pass: ``nlmserve serve``'s default ``max_batch_ngrams``.
PASS_ROWS = 4096


class ModelScorer:
    """A ``moses_plugin.rescore.ScoreSource`` (``order``, ``info.model_hash``,
    ``vocabulary``, ``score_ids``, ``close``) answered by a model file loaded here.

    ``device``: a torch device name; None: cuda when available, else cpu. Raises
    ``ModelFileError`` naming the file when it is not a readable model file.
    """

    def __init__(self, path: str | os.PathLike[str], device: str | None = None) -> None:
        from ..lm.scoring import LanguageModel  # torch: only when a model file is scored here

        self._lm = LanguageModel.load(path, device)
        self._vocab = dict(self._lm.vocab.index)
        self.info = SourceInfo(model_hash=self._lm.model_hash, path=str(path))

    @property
    def order(self) -> int:
        return self._lm.order

    def vocabulary(self) -> dict[str, int]:
        return self._vocab

    def score_ids(self, ids: np.ndarray, log_base: str = "ln", normalized: bool = True) -> SourceScores:
        """Log-probability (float32) of the last id of each row (N, n) given the others.

        ``normalized=False``: the unnormalised score when the model is self-normalised, as
        the server gives it. Bad rows raise ``InvalidRequestError`` naming the row.
        """
        log10 = log10_flag(log_base)
        lm = self._lm
        rows = lm.canonical_rows(ids)  # (N, order) int64
        norm = normalized or not lm.self_normalized
        out = np.empty(len(rows), dtype=np.float32)
        for start in range(0, len(rows), PASS_ROWS):
            part = rows[start : start + PASS_ROWS]
            out[start : start + len(part)] = lm.score_prepared(part[:, :-1], part[:, -1], np.full(len(part), norm))
        if log10:
            ln_to_log10(out)
        return SourceScores(out)

    def close(self) -> None:
        """Nothing to release (the model is freed with the object)."""
