"""What the output layers share: :class:`OutputLayer`, what every layer answers, and
:class:`SoftmaxFamily`, a score per word normalised over all V words (``SoftmaxOutput``,
``BandedOutput``)::

    score(r, word, ctx)           unnormalised score of each row's word(s) (N, ...): what NCE
                                  trains and a self-normalised model serves
    log_normalizer(r, word, ctx)  (N,) what the exact log-probability subtracts from it
    log_prob(r, word, ctx)        score - log_normalizer (``normalized=False``: score)
    full_log_probs(r, ctx)        the whole distribution (N, V)

``<s>`` is never predicted: its score is -inf in every layer (:func:`bos_mask`), so the
distribution over the other V-1 words sums to one.

Parameter names: the model file stores the network's state dict, written before the layers
were modules of their own; each layer's ``legacy_prefix`` is the prefix its parameters had
then (``NeuralLM`` maps both ways), so every model file reads as before.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from ..vocab import BOS_ID

#: Rows per chunk of exact scoring: at most this many ...
MAX_CHUNK_ROWS = 8192
#: ... whose widest score matrix holds about this many floats.
CHUNK_FLOATS = 1 << 24


def bos_mask(vocab_size: int) -> Tensor:
    """(V,) 0, and -inf for ``<s>`` (never predicted)."""
    mask = torch.zeros(vocab_size)
    mask[BOS_ID] = -math.inf
    return mask


def expand_rows(r: Tensor, y: Tensor) -> Tensor:
    """r (N, E) viewed as (N, 1, …, 1, E) to meet y (N, …)'s embeddings."""
    return r.reshape(r.shape[0], *([1] * (y.dim() - 1)), r.shape[1])


def checks_no_word(t: Tensor, training: bool) -> bool:
    """Whether to look for the no-word in ``t`` (ids or hashes) before using it: always but
    when training on a GPU, where the check would wait for the device at every step and the
    training data never holds it."""
    return not (training and t.is_cuda)


class OutputLayer(nn.Module):
    """What the network needs of an output strategy (the module docstring's list)."""

    #: ``ModelConfig.output`` of the layer.
    kind = ""
    #: Prefix of the layer's parameters in the state dict of model files (see the module docstring).
    legacy_prefix = ""

    def __init__(self) -> None:
        super().__init__()
        #: Sparse gradients for the output embeddings (AdaGrad): only the rows a batch touches.
        self.sparse = False

    # ------------------------------------------------------------------ set-up
    def reset_parameters(self, std: float, context: Any = None) -> None:
        """Fresh parameters; ``context()`` (the network's context weights) is called where a
        seed's random numbers have always been drawn for them: after the output word
        vectors, before the class vectors."""
        raise NotImplementedError

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """Biases from the add-one unigram (``<s>`` gets no mass), so that with zero vectors
        the layer predicts the unigram."""
        raise NotImplementedError

    def sparse_parameters(self) -> list[Tensor]:
        """The parameters whose gradients are sparse with the current switches."""
        return []

    # ------------------------------------------------------------------ scores
    def score(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """Unnormalised score of ``word`` (N, …) for each row of r (N, E) → word.shape."""
        raise NotImplementedError

    def log_normalizer(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """(N,) what the log-probability of ``word`` (N,) subtracts from its score."""
        raise NotImplementedError

    def log_prob(self, r: Tensor, word: Tensor, ctx: Tensor | None = None, *, normalized: bool = True) -> Tensor:
        """log P(word | h) → (N,) (``normalized=False``: the score alone)."""
        s = self.score(r, word, ctx)
        return s - self.log_normalizer(r, word, ctx) if normalized else s

    def full_log_probs(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """The whole distribution log P(· | h) → (N, V) (``<s>`` at -inf)."""
        raise NotImplementedError

    def classes_of(self, word: Tensor) -> Tensor:
        """Class of each word (zeros for the layers without classes)."""
        return torch.zeros_like(word)

    # ------------------------------------------------------------------ exact scoring in chunks
    def row_width(self) -> int:
        """Floats per row of exact scoring's widest intermediate."""
        raise NotImplementedError

    def scoring_chunk(self, budget: int = CHUNK_FLOATS) -> int:
        """Rows per chunk for exact scoring: the widest intermediate holds about ``budget``
        floats, between 64 and MAX_CHUNK_ROWS rows."""
        return int(min(MAX_CHUNK_ROWS, max(64, budget // max(self.row_width(), 1))))

    def scoring_bounds(self, targets: np.ndarray, budget: int = CHUNK_FLOATS, max_rows: int = MAX_CHUNK_ROWS,
                       counted: np.ndarray | None = None) -> Iterator[tuple[int, int]]:
        """Consecutive (start, end) chunks of ``targets`` (N,) for exact scoring, each of at
        most ``max_rows`` rows and about ``budget`` floats (``counted``: see ClassOutput)."""
        n = int(targets.shape[0])
        chunk = min(max_rows, self.scoring_chunk(budget))
        yield from ((a, min(a + chunk, n)) for a in range(0, n, chunk))



class SoftmaxFamily(OutputLayer):
    """A score per word normalised over all V words::

        log P(w | h) = s_w(h) - log Σ_w' exp s_w'(h)

    Subclasses give :meth:`score`, :meth:`logits` (all words) and :meth:`logits_of` (the
    same candidate words for every row: target sampling); the bias b_w is theirs."""

    word_mask: Tensor  # (V,) 0, -inf for <s>

    def logits(self, r: Tensor) -> Tensor:
        """All word scores (N, V), ``<s>`` at -inf."""
        raise NotImplementedError

    def logits_of(self, r: Tensor, words: Tensor) -> Tensor:
        """Scores of the words (C,) for every row → (N, C)."""
        raise NotImplementedError

    def _bias(self) -> Tensor:
        raise NotImplementedError

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """b_w = log P(w) of the add-one unigram."""
        counts = np.asarray(unigram_counts, dtype=np.float64) + 1.0
        counts[BOS_ID] = 0.0
        with torch.no_grad():
            self._bias().copy_(torch.from_numpy(np.log(np.maximum(counts, 1e-30) / counts.sum())))

    def log_normalizer(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """log Σ_w exp s_w(h) (one (N, V) product)."""
        return torch.logsumexp(self.logits(r), dim=-1)

    def full_log_probs(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        return torch.log_softmax(self.logits(r), dim=-1)

    def row_width(self) -> int:
        return int(self.word_mask.numel())
