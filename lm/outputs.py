"""Output layers besides the class-factored one and the full softmax.

Tree-factored output (Morin & Bengio 2005; Mnih & Hinton 2008)::

    log P(w | h) = log Σ_{codes of w} Π_{(n, bit) on the code} σ(±(r · q_n + b_n))

``+`` where the code goes left at node n, ``-`` where it goes right. Normalised by
construction: the leaves' probabilities sum to one, so the unnormalised score *is* the
log-probability and costs one dot product per node on the path (≈ log2 V).

Differentiated softmax (Chen, Grangier & Auli 2016): the words, sorted by frequency, fall
into bands; band b's output embeddings have width d_b and meet their own slice of the
context vector r (the slices partition r)::

    s_w(h) = r[a_b : a_b + d_b] · R_w + b_w        (w in band b)
    log P(w | h) = s_w(h) - log Σ_w' exp s_w'(h)

so the frequent words get wide embeddings and the many rare words narrow ones: the
normaliser costs Σ_b |band b| · d_b multiply-adds instead of V · E.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nlmserve.lm.trees import Tree, node_log_odds


class TreeOutput(nn.Module):
    """Node vectors q_n (K, E) and biases b_n (K,) of a :class:`Tree`."""

    word_codes: Tensor  # (V, M) the codes of each word, padded with -1 (M: most codes of a word)
    code_nodes: Tensor  # (C, L) path nodes, padding 0
    code_sign: Tensor  # (C, L) +1 left, -1 right, 0 padding

    def __init__(self, tree: Tree, vocab_size: int, width: int) -> None:
        super().__init__()
        tree.validate(vocab_size)
        self.tree = tree
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

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.node_embed, std=std)
        with torch.no_grad():
            self.node_bias.zero_()

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """Node biases that, with zero node vectors, give the add-one unigram."""
        with torch.no_grad():
            self.node_bias.copy_(torch.from_numpy(node_log_odds(self.tree, unigram_counts)))

    def log_prob(self, r: Tensor, word: Tensor, sparse: bool = False) -> Tensor:
        """log P(word | h): r (N, E), word (N, ...) → word.shape (``<s>``: -inf)."""
        codes = self.word_codes[word]  # (N, ..., M)
        valid = codes >= 0
        safe = codes.clamp(min=0)
        nodes = self.code_nodes[safe]  # (N, ..., M, L)
        sign = self.code_sign[safe]  # (N, ..., M, L)
        q = F.embedding(nodes, self.node_embed, sparse=sparse)  # (N, ..., M, L, E)
        N, E = r.shape
        dots = torch.bmm(q.reshape(N, -1, E), r.unsqueeze(2))  # (N, ...·M·L, E) @ (N, E, 1)
        x = dots.view(nodes.shape) + self.node_bias[nodes]  # (N, ..., M, L)
        per_code = (F.logsigmoid(sign * x) * sign.abs()).sum(-1)  # (N, ..., M)
        per_code = per_code.masked_fill(~valid, -math.inf)
        if per_code.shape[-1] == 1:
            return per_code.squeeze(-1)
        return torch.logsumexp(per_code, dim=-1)

    def all_log_probs(self, r: Tensor) -> Tensor:
        """The whole distribution (N, V) (``<s>``: -inf): every node's score by one
        matrix product, then each code's path gathered from it."""
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
        """Floats per row of :meth:`all_log_probs`' widest intermediate."""
        return int(self.code_nodes.numel())


class BandedOutput(nn.Module):
    """Differentiated-softmax output embeddings: band b holds words [start_b, start_b +
    size_b) (ids are frequency ranks) with embeddings of width d_b on r's slice b."""

    band_of: Tensor  # (V,) band of each word
    word_mask: Tensor  # (V,) 0, -inf for <s>

    def __init__(self, sizes: tuple[int, ...], dims: tuple[int, ...], word_mask: Tensor) -> None:
        super().__init__()
        self.sizes, self.dims = tuple(sizes), tuple(dims)
        self.starts = [0, *np.cumsum(sizes).tolist()]
        self.cols = [0, *np.cumsum(dims).tolist()]
        self.embeds = nn.ParameterList([nn.Parameter(torch.empty(s, d)) for s, d in zip(sizes, dims)])
        V = self.starts[-1]
        self.bias = nn.Parameter(torch.zeros(V))
        self.register_buffer("word_mask", word_mask.clone(), persistent=False)
        band_of = np.repeat(np.arange(len(sizes)), sizes)
        self.register_buffer("band_of", torch.from_numpy(band_of), persistent=False)

    def reset_parameters(self, std: float) -> None:
        for e in self.embeds:
            nn.init.normal_(e, std=std)
        with torch.no_grad():
            self.bias.zero_()

    def score(self, r: Tensor, word: Tensor, sparse: bool = False) -> Tensor:
        """s_w(h): r (N, E), word (N, ...) → word.shape."""
        rows = torch.arange(r.shape[0], device=r.device).reshape(-1, *([1] * (word.dim() - 1))).expand_as(word)
        band = self.band_of[word]
        out = r.new_zeros(word.shape)
        for b, emb in enumerate(self.embeds):
            m = band == b
            if not bool(m.any()):
                continue
            w = word[m] - self.starts[b]  # (n_b,)
            e = F.embedding(w, emb, sparse=sparse)  # (n_b, d_b)
            out[m] = (r[rows[m], self.cols[b] : self.cols[b + 1]] * e).sum(-1)
        return out + self.bias[word] + self.word_mask[word]

    def logits_of(self, r: Tensor, words: Tensor, sparse: bool = False) -> Tensor:
        """Scores of the words (C,) for every row → (N, C)."""
        out = r.new_zeros(r.shape[0], words.shape[0])
        band = self.band_of[words]
        for b, emb in enumerate(self.embeds):
            cols = (band == b).nonzero().squeeze(1)
            if cols.numel() == 0:
                continue
            e = F.embedding(words[cols] - self.starts[b], emb, sparse=sparse)  # (C_b, d_b)
            out[:, cols] = r[:, self.cols[b] : self.cols[b + 1]] @ e.t()  # (N, d_b) @ (d_b, C_b)
        return out + self.bias[words] + self.word_mask[words]

    def logits(self, r: Tensor) -> Tensor:
        """All scores (N, V): one (N, d_b) @ (d_b, |band b|) product per band."""
        parts = [r[:, self.cols[b] : self.cols[b + 1]] @ emb.t() for b, emb in enumerate(self.embeds)]
        return torch.cat(parts, dim=1) + self.bias + self.word_mask


def default_bands(vocab_size: int, width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Band sizes and widths when none are given: the 2,500 most frequent words at half
    the width, the next 7,500 at a quarter of it, the rest at the remaining quarter (the
    shape of Chen et al.'s 3-band setting, scaled to ``width``); fewer bands for small
    vocabularies."""
    cuts = [c for c in (2500, 10000) if c < vocab_size]
    sizes = [cuts[0]] if cuts else [vocab_size]
    if len(cuts) > 1:
        sizes.append(cuts[1] - cuts[0])
    if sum(sizes) < vocab_size:
        sizes.append(vocab_size - sum(sizes))
    shares = {1: [1.0], 2: [0.75, 0.25], 3: [0.5, 0.25, 0.25]}[len(sizes)]
    dims = [max(1, int(width * s)) for s in shares]
    dims[-1] = width - sum(dims[:-1])
    if min(dims) < 1:
        raise ValueError(f"width {width} is too small for {len(sizes)} bands")
    return tuple(sizes), tuple(dims)
