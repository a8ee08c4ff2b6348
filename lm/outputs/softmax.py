"""The full softmax output layer (the baseline)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import SoftmaxFamily, bos_mask, expand_rows


class SoftmaxOutput(SoftmaxFamily):
    """The full softmax: s_w(h) = R_w · r + b_w with R (V, E), b_w (V,)."""

    kind = "softmax"

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.word_embed = nn.Parameter(torch.empty(vocab_size, width))  # R_w
        self.word_bias = nn.Parameter(torch.zeros(vocab_size))  # b_w
        self.register_buffer("word_mask", bos_mask(vocab_size), persistent=False)

    def reset_parameters(self, std: float, context: Any = None) -> None:
        """Gaussian word vectors, then ``context()`` (the draw order of a seed)."""
        nn.init.normal_(self.word_embed, std=std)
        if context is not None:
            context()
        with torch.no_grad():
            self.word_bias.zero_()

    def _bias(self) -> Tensor:
        return self.word_bias

    def sparse_parameters(self) -> list[Tensor]:
        return [self.word_embed] if self.sparse else []

    def score(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        emb = F.embedding(word, self.word_embed, sparse=self.sparse)  # (N, ..., E)
        return (emb * expand_rows(r, word)).sum(-1) + self.word_bias[word] + self.word_mask[word]

    def logits(self, r: Tensor) -> Tensor:
        return r @ self.word_embed.t() + self.word_bias + self.word_mask  # (N, E) @ (E, V)

    def logits_of(self, r: Tensor, words: Tensor) -> Tensor:
        emb = F.embedding(words, self.word_embed, sparse=self.sparse)  # (C, E)
        return r @ emb.t() + self.word_bias[words] + self.word_mask[words]
