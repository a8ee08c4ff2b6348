"""The differentiated softmax output layer (Chen, Grangier & Auli 2016) and its default bands."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import SoftmaxFamily, bos_mask


class BandedOutput(SoftmaxFamily):
    """Differentiated softmax (Chen, Grangier & Auli 2016): the words, sorted by frequency,
    fall into bands; band b holds words [start_b, start_b + size_b) (ids are frequency ranks)
    with embeddings of width d_b that meet their own slice of r (the slices partition r)::

        s_w(h) = r[a_b : a_b + d_b] · R_w + b_w        (w in band b)

    so the frequent words get wide embeddings and the many rare words narrow ones: the
    normaliser costs Σ_b |band b| · d_b multiply-adds instead of V · E."""

    kind = "dsoftmax"
    legacy_prefix = "band_out."
    band_of: Tensor  # (V,) band of each word

    def __init__(self, sizes: tuple[int, ...], dims: tuple[int, ...]) -> None:
        super().__init__()
        self.sizes, self.dims = tuple(sizes), tuple(dims)
        self.starts = [0, *np.cumsum(sizes).tolist()]
        self.cols = [0, *np.cumsum(dims).tolist()]
        self.embeds = nn.ParameterList([nn.Parameter(torch.empty(s, d)) for s, d in zip(sizes, dims)])
        V = self.starts[-1]
        self.bias = nn.Parameter(torch.zeros(V))
        self.register_buffer("word_mask", bos_mask(V), persistent=False)
        band_of = np.repeat(np.arange(len(sizes)), sizes)
        self.register_buffer("band_of", torch.from_numpy(band_of), persistent=False)

    def reset_parameters(self, std: float, context: Any = None) -> None:
        for e in self.embeds:
            nn.init.normal_(e, std=std)
        with torch.no_grad():
            self.bias.zero_()
        if context is not None:
            context()

    def _bias(self) -> Tensor:
        return self.bias

    def sparse_parameters(self) -> list[Tensor]:
        return list(self.embeds) if self.sparse else []

    def score(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """s_w(h): r (N, E), word (N, ...) → word.shape."""
        rows = torch.arange(r.shape[0], device=r.device).reshape(-1, *([1] * (word.dim() - 1))).expand_as(word)
        band = self.band_of[word]
        out = r.new_zeros(word.shape)
        for b, emb in enumerate(self.embeds):
            m = band == b
            if not bool(m.any()):
                continue
            w = word[m] - self.starts[b]  # (n_b,)
            e = F.embedding(w, emb, sparse=self.sparse)  # (n_b, d_b)
            out[m] = (r[rows[m], self.cols[b] : self.cols[b + 1]] * e).sum(-1)
        return out + self.bias[word] + self.word_mask[word]

    def logits_of(self, r: Tensor, words: Tensor) -> Tensor:
        out = r.new_zeros(r.shape[0], words.shape[0])
        band = self.band_of[words]
        for b, emb in enumerate(self.embeds):
            cols = (band == b).nonzero().squeeze(1)
            if cols.numel() == 0:
                continue
            e = F.embedding(words[cols] - self.starts[b], emb, sparse=self.sparse)  # (C_b, d_b)
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
