"""The seam between lm/ and server/: what the server needs of a loaded model.

``nlmserve.lm.scoring.LanguageModel`` is the model that satisfies it; the server's engine
and caches are typed with :class:`ScoringModel` only, so a test can hand them any object
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


class ScoringModel(Protocol):
    """A model the server can serve: its description, batch scoring, and the pieces of the
    per-context normaliser cache (natural log throughout; ids are canonical rows of
    ``nlmserve.lm.ngrams`` where the docstring says so)."""

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

    def score_prepared(self, ctx: np.ndarray, target: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        """ln scores of canonical rows split as ctx (N, order-1) and target (N,); ``normalized``
        (N,) bool per row (False: the unnormalised score). No validation."""
        ...

    # ------------------------------------------------------------------ cache pieces (torch, on device)
    def prepare_contexts(self, ids: npt.ArrayLike | Tensor) -> tuple[Tensor, Tensor]:
        """(N, n) ids → (ctx LongTensor (N, order-1), target LongTensor (N,)), canonical."""
        ...

    def encode_contexts(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) → r (N, E), the context vectors. The pieces below take r and,
        beside it, the same rows' context ids (read by direct n-gram features only)."""
        ...

    def class_log_normalizer(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """(N,) log Σ_c exp s_c(h); zeros without classes."""
        ...

    def in_class_log_normalizer(self, r: Tensor, cls: Tensor, ctx: Tensor | None = None) -> Tensor:
        """(N,) log Σ_{w ∈ cls} exp s_w(h); the output's whole normaliser without classes."""
        ...

    def raw_score(self, r: Tensor, target: Tensor, ctx: Tensor | None = None) -> Tensor:
        """(N,) unnormalised score: log p = raw - class_lognorm - in_class_lognorm."""
        ...

    def word_classes(self, target: Tensor) -> Tensor:
        """(N,) class of each target (zeros without classes)."""
        ...

    def scoring_tables(self) -> ScoringTables:
        """The self-normalised score as tables (``nlmserve.lm.scoring.ScoringTables``);
        UnsupportedModelError when the model has none."""
        ...
