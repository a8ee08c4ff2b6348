"""The tree output layer: a binary tree over the words (Morin & Bengio 2005; Mnih & Hinton 2008)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..trees import Tree, node_log_odds
from .base import OutputLayer


class TreeOutput(OutputLayer):
    """A binary tree over the words, node vectors q_n (K, E) and biases b_n (K,)::

        log P(w | h) = log Σ_{codes of w} Π_{(n, bit) on the code} σ(±(r · q_n + b_n))

    ``+`` where the code goes left at node n, ``-`` where it goes right. Normalised by
    construction: the leaves' probabilities sum to one, so the score *is* the
    log-probability (normaliser 0) and costs one dot product per node on the path (≈ log2 V)."""

    kind = "tree"
    legacy_prefix = "tree_out."
    word_codes: Tensor  # (V, M) the codes of each word, padded with -1 (M: most codes of a word)
    code_nodes: Tensor  # (C, L) path nodes, padding 0
    code_sign: Tensor  # (C, L) +1 left, -1 right, 0 padding

    def __init__(self, tree: Tree, vocab_size: int, width: int) -> None:
        super().__init__()
        tree.validate(vocab_size)
        self.tree = tree
        self.width = width
        self.node_embed = nn.Parameter(torch.empty(tree.num_nodes, width))
        self.node_bias = nn.Parameter(torch.zeros(tree.num_nodes))
        n_codes = np.bincount(tree.code_word, minlength=vocab_size)
        M = int(n_codes.max())
        word_codes = np.full((vocab_size, M), -1, dtype=np.int64)
        order = np.argsort(tree.code_word, kind="stable")
        starts = np.concatenate([[0], np.cumsum(n_codes)])[:-1]
        slot = np.arange(order.size) - starts[tree.code_word[order]]
        word_codes[tree.code_word[order], slot] = order
        sign = np.where(tree.code_bits == 1, 1.0, -1.0) * (tree.code_nodes >= 0)
        self.register_buffer("word_codes", torch.from_numpy(word_codes), persistent=False)
        self.register_buffer("code_nodes", torch.from_numpy(np.maximum(tree.code_nodes, 0).astype(np.int64)),
                             persistent=False)
        self.register_buffer("code_sign", torch.from_numpy(sign.astype(np.float32)), persistent=False)

    def reset_parameters(self, std: float, context: Any = None) -> None:
        nn.init.normal_(self.node_embed, std=std)
        with torch.no_grad():
            self.node_bias.zero_()
        if context is not None:
            context()

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """Node biases that, with zero node vectors, give the add-one unigram."""
        with torch.no_grad():
            self.node_bias.copy_(torch.from_numpy(node_log_odds(self.tree, unigram_counts)))

    def sparse_parameters(self) -> list[Tensor]:
        return [self.node_embed] if self.sparse else []

    def score(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """log P(word | h): r (N, E), word (N, ...) → word.shape (``<s>``: -inf)."""
        codes = self.word_codes[word]  # (N, ..., M)
        valid = codes >= 0
        safe = codes.clamp(min=0)
        nodes = self.code_nodes[safe]  # (N, ..., M, L)
        sign = self.code_sign[safe]  # (N, ..., M, L)
        q = F.embedding(nodes, self.node_embed, sparse=self.sparse)  # (N, ..., M, L, E)
        N, E = r.shape
        dots = torch.bmm(q.reshape(N, -1, E), r.unsqueeze(2))  # (N, ...·M·L, E) @ (N, E, 1)
        x = dots.view(nodes.shape) + self.node_bias[nodes]  # (N, ..., M, L)
        per_code = (F.logsigmoid(sign * x) * sign.abs()).sum(-1)  # (N, ..., M)
        per_code = per_code.masked_fill(~valid, -math.inf)
        if per_code.shape[-1] == 1:
            return per_code.squeeze(-1)
        return torch.logsumexp(per_code, dim=-1)

    def log_normalizer(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        return r.new_zeros(r.shape[0])

    def log_prob(self, r: Tensor, word: Tensor, ctx: Tensor | None = None, *, normalized: bool = True) -> Tensor:
        """The score (normalised by construction), for ``word`` of any shape with leading N."""
        return self.score(r, word, ctx)

    def full_log_probs(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """Every node's score by one matrix product, then each code's path gathered from it."""
        x = torch.addmm(self.node_bias, r, self.node_embed.t())  # (N, K)
        gathered = x[:, self.code_nodes]  # (N, C, L)
        per_code = (F.logsigmoid(self.code_sign * gathered) * self.code_sign.abs()).sum(-1)  # (N, C)
        V, M = self.word_codes.shape
        out = r.new_full((r.shape[0], V), -math.inf)
        for j in range(M):
            idx = self.word_codes[:, j]
            has = (idx >= 0).nonzero().squeeze(1)
            out[:, has] = torch.logaddexp(out[:, has], per_code[:, idx[has]])
        return out

    def row_width(self) -> int:
        """score's (rows, depth, E) gather."""
        return self.tree.depth * self.width
