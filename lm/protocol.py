"""The seam between lm/ and server/: what the server needs of a loaded model.

``nlmserve.lm.scoring.LanguageModel`` is the model that satisfies it; the server's engine
is typed with :class:`ScoringModel` only, so a test can hand it any object
with these members. docs/architecture.md describes each piece.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from .vocab import Vocabulary

if TYPE_CHECKING:
    from .scoring import ScoringTables


class RowScorer(Protocol):
    """Scores canonical rows with caches of its own (``nlmserve.lm.cache.Scorer``)."""

    def score(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        """ids (N, order) canonical rows, normalized (N,) bool per row → ln scores (N,) float32."""
        ...

    def stats(self) -> dict[str, tuple[int, int, int]]:
        """cache name → (hits, misses, entries)."""
        ...


class ScoringModel(Protocol):
    """A model the server can serve: its description, scoring (batch, and through caches)
    and its scoring tables (natural log throughout; ids are canonical rows of
    ``nlmserve.wire.ngrams`` where the docstring says so)."""

    # ------------------------------------------------------------------ description
    @property
    def order(self) -> int: ...
    @property
    def vocab(self) -> Vocabulary: ...
    @property
    def model_hash(self) -> str: ...
    @property
    def format_version(self) -> int: ...
    @property
    def objective(self) -> str: ...
    @property
    def output_type(self) -> str: ...
    @property
    def num_classes(self) -> int: ...
    @property
    def self_normalized(self) -> bool: ...
    @property
    def lowercase(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...

    # ------------------------------------------------------------------ scoring
    def score_ngrams(self, ids: npt.ArrayLike | Tensor, *, normalized: bool = True,
                     log10: bool = False) -> np.ndarray:
        """log P(last | rest) of (N, n) id rows, validated → float32 (N,)."""
        ...

    def cached_scorer(self, ngram_cache_size: int, context_cache_size: int) -> RowScorer:
        """A scorer of canonical rows with an n-gram cache and the per-context normaliser
        cache of these sizes (0: none), for one batching thread (``nlmserve.lm.cache``)."""
        ...

    def scoring_tables(self) -> ScoringTables:
        """The self-normalised score as tables (``nlmserve.lm.scoring.ScoringTables``);
        UnsupportedModelError when the model has none."""
        ...
