"""The neural n-gram language model: log-bilinear context, class-factored or softmax output.

Context (Mnih & Hinton 2007; OxLM, Baltescu & Blunsom 2015)::

    r = act( W_h · Σ_j C_j ⊙ q(w_j) + b_h )       # hidden layer optional (hidden=0: none)

with ``q`` the context word embeddings (V, D) and ``C_j`` one weight per context position,
a vector (``context="diagonal"``, the log-bilinear default) or a D×D matrix (``"full"``).

Output, class-factored (``output="class"``, Goodman 2001; Mikolov et al. 2011)::

    log P(w | h) = s_c(h) - log Σ_c' exp s_c'(h)  +  s_w(h) - log Σ_{w' ∈ c} exp s_w'(h)
    s_c(h) = S_c · r + b_c          s_w(h) = R_w · r + b_w          c = class(w)

or a full softmax (``output="softmax"``): ``log P(w | h) = s_w(h) - log Σ_w' exp s_w'(h)``,
or a binary tree over the words (``output="tree"``) or the differentiated softmax
(``output="dsoftmax"``), both in :mod:`nlmserve.lm.outputs`.

``<s>`` is never predicted: its score is masked to -inf, so the distribution over the
other V-1 words sums to one. The exact in-class normaliser groups the rows of a batch by
class (one small matmul per class present); ``in_class_method="padded"`` gathers every
row's class padded to the largest class instead (kept for the benchmark: it materialises
an (N, max class size, D) tensor and is slower on frequency-binned classes whose rare-word
class is large).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nlmserve.lm.outputs import BandedOutput, TreeOutput
from nlmserve.lm.trees import Tree
from nlmserve.lm.vocab import BOS_ID

CONTEXT_TYPES = ("diagonal", "full")
ACTIVATIONS = ("none", "tanh", "relu")
OUTPUT_TYPES = ("class", "softmax", "tree", "dsoftmax")
#: Outputs whose word scores are a full softmax's logits (normaliser: log Σ over all words).
SOFTMAX_LIKE = ("softmax", "dsoftmax")

# Direct n-gram features (OxLM, Baltescu, Blunsom & Hoang 2014; the maximum-entropy features of
# Mikolov's RNNME): for every suffix of the context of length 0..order-1 one hashed weight per
# (suffix, class) added to the class score and one per (suffix, word) added to the word score.
# All arithmetic stays below 2^63 in int64: hashes < 2^31, multipliers < 2^31, ids < 2^24.
HASH_MOD = (1 << 31) - 1  # the Mersenne prime 2^31 - 1
HASH_SEED = 1_000_003  # hash of the empty suffix
HASH_CTX = 1_299_709  # suffix hash: h_l = (h_{l-1} * HASH_CTX + w_{-l} + 1) mod HASH_MOD
HASH_KEY = 1_640_531_527  # slot: ((h_l * HASH_KEY + y * HASH_OUT) mod HASH_MOD) mod size
HASH_OUT = 805_306_457
#: NCE's class scores: with m classes per row, one GEMM over all K classes while
#: K <= this * m. Forward and backward, 512 rows, width 512, m = 11, one thread: the GEMM
#: takes 2.0 / 3.5 / 6.3 / 12.0 ms at K = 100 / 189 / 350 / 700, gathering and multiplying
#: the m class vectors 8–11 ms at every K (crossover near K = 450).
GEMM_CLASSES_PER_SCORE = 40


def context_hashes(ctx: Tensor) -> Tensor:
    """ctx (N, order-1) word ids, oldest first → (N, order) int64 hashes of the context
    suffixes of length 0, 1, …, order-1 (the newest words)."""
    N, n1 = ctx.shape
    h = torch.full((N,), HASH_SEED, dtype=torch.int64, device=ctx.device)
    out = [h]
    for length in range(1, n1 + 1):
        h = (h * HASH_CTX + ctx[:, n1 - length].long() + 1) % HASH_MOD
        out.append(h)
    return torch.stack(out, dim=1)


def ngram_feature_index(h: Tensor, y: Tensor, size: int) -> Tensor:
    """Table slots of the features (suffix, y): h (N, L) suffix hashes, y (N, ...) class or
    word ids → (N, ..., L)."""
    hh = h.view(h.shape[0], *([1] * (y.dim() - 1)), h.shape[1])
    return ((hh * HASH_KEY + y.long().unsqueeze(-1) * HASH_OUT) % HASH_MOD) % size


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the network (everything needed to rebuild it from a model file).

    Fields:
        vocab_size: V, including ``<unk>``, ``<s>``, ``</s>``.
        order: n of the n-gram model; the context holds ``order - 1`` words.
        dim: D, width of the word embeddings (context and output side).
        context: ``"diagonal"`` (one D-vector per context position, log-bilinear) or
            ``"full"`` (one D×D matrix per position).
        hidden: width of an optional hidden layer after the context sum (0: none).
        activation: ``"none"``, ``"tanh"`` or ``"relu"``, applied to the context vector
            (after the hidden layer when there is one).
        output: ``"class"`` (P(c|h)·P(w|c,h)) or ``"softmax"`` (the full-softmax baseline).
        num_classes: K for the class output (0 for softmax).
        ngram_class_table: size of the hashed direct n-gram feature table for the class
            scores (0: no class features). See :func:`ngram_feature_index`.
        ngram_word_table: size of the hashed direct n-gram feature table for the word
            scores (0: no word features).
        ngram_order: longest n-gram (predicted word included) with a direct feature; 0: the
            model's order. A model with a long context (order 10) keeps its features at
            5-grams, where they generalise, instead of memorising the training text's long n-grams.
        tree_nodes: internal nodes of the output tree (``output="tree"``; the tree itself
            is stored in the model file), tree_method how it was built.
        band_sizes, band_dims: words per frequency band and their embedding widths
            (``output="dsoftmax"``; sizes sum to V, widths to the context width).
    """

    vocab_size: int
    order: int = 5
    dim: int = 128
    context: str = "diagonal"
    hidden: int = 0
    activation: str = "none"
    output: str = "class"
    num_classes: int = 0
    ngram_class_table: int = 0
    ngram_word_table: int = 0
    ngram_order: int = 0
    tree_nodes: int = 0
    tree_method: str = ""
    band_sizes: tuple[int, ...] = ()
    band_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {self.vocab_size}")
        if self.order < 2:
            raise ValueError(f"order must be >= 2, got {self.order}")
        if self.dim < 1 or self.hidden < 0:
            raise ValueError(f"dim must be >= 1 and hidden >= 0, got {self.dim}, {self.hidden}")
        if self.context not in CONTEXT_TYPES:
            raise ValueError(f"context must be one of {CONTEXT_TYPES}, got {self.context!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.output not in OUTPUT_TYPES:
            raise ValueError(f"output must be one of {OUTPUT_TYPES}, got {self.output!r}")
        if self.output == "class" and not 1 <= self.num_classes <= self.vocab_size:
            raise ValueError(f"class output needs 1 <= num_classes <= vocab_size, got {self.num_classes}")
        if self.ngram_class_table < 0 or self.ngram_word_table < 0:
            raise ValueError("n-gram feature table sizes must be >= 0")
        if not 0 <= self.ngram_order <= self.order:
            raise ValueError(f"ngram_order must be between 0 (the model's order) and order = {self.order}, "
                             f"got {self.ngram_order}")
        if self.has_ngram_features and self.output != "class":
            raise ValueError("direct n-gram features need the class output")
        if self.has_ngram_features and self.vocab_size >= 1 << 24:
            raise ValueError("direct n-gram features need vocab_size < 2^24")
        if self.output == "tree" and self.tree_nodes < 1:
            raise ValueError("the tree output needs tree_nodes >= 1")
        if self.output == "dsoftmax" and (
            sum(self.band_sizes) != self.vocab_size or sum(self.band_dims) != self.out_dim
            or len(self.band_sizes) != len(self.band_dims) or min(self.band_dims, default=0) < 1
        ):
            raise ValueError(f"dsoftmax bands {self.band_sizes} x {self.band_dims} must cover V={self.vocab_size} "
                             f"words and the width {self.out_dim}")

    @property
    def feature_order(self) -> int:
        """Context suffixes with a direct feature: lengths 0 .. feature_order - 1."""
        return self.ngram_order or self.order

    @property
    def has_ngram_features(self) -> bool:
        return self.ngram_class_table > 0 or self.ngram_word_table > 0

    @property
    def out_dim(self) -> int:
        """Width of the context vector r that meets the output embeddings."""
        return self.hidden if self.hidden > 0 else self.dim

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON; the tree, band and ngram_order fields only when set, so a class
        or softmax model's header reads as before (older readers load it)."""
        d = dataclasses.asdict(self)
        for name in _LATER_FIELDS:
            if d[name] == _DEFAULTS[name]:
                del d[name]
            elif isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        d = {k: tuple(int(x) for x in v) if k in ("band_sizes", "band_dims") else v for k, v in d.items()}
        return cls(**d)


_LATER_FIELDS = ("tree_nodes", "tree_method", "band_sizes", "band_dims", "ngram_order")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


class NeuralLM(nn.Module):
    """The network. ``word_class`` (V,) is required for the class output."""

    # Buffers (not saved: rebuilt from the word classes).
    word_mask: Tensor  # (V,) 0, -inf for <s>
    word_class: Tensor  # (V,) class of each word
    class_order: Tensor  # (V,) word ids sorted by class
    class_offsets: Tensor  # (K+1,) class c is class_order[offsets[c]:offsets[c+1]]
    class_mask: Tensor  # (K,) 0, -inf for a class holding only <s>
    class_words_padded: Tensor  # (K, M) class words, padded with V
    ngram_class: nn.Parameter | None  # (ngram_class_table, 1) hashed (suffix, class) weights
    ngram_word: nn.Parameter | None  # (ngram_word_table, 1) hashed (suffix, word) weights

    tree_out: TreeOutput | None
    band_out: BandedOutput | None

    def __init__(self, config: ModelConfig, word_class: np.ndarray | None = None, tree: Tree | None = None) -> None:
        super().__init__()
        self.config = config
        # Sparse gradients for the output word embeddings (training with AdaGrad): only the
        # rows a batch touches are updated. Off by default (dense gradients everywhere);
        # the context embeddings' switch is ``self.embed.sparse``.
        self.sparse_grads = False
        self._offsets: list[int] = []
        V, D, n1 = config.vocab_size, config.dim, config.order - 1
        self.embed = nn.Embedding(V, D)  # q(w): context word vectors
        if config.context == "diagonal":
            self.ctx_weight = nn.Parameter(torch.empty(n1, D))  # C_j as vectors
        else:
            self.ctx_weight = nn.Parameter(torch.empty(n1, D, D))  # C_j as matrices (out, in)
        self.hidden = nn.Linear(D, config.hidden) if config.hidden > 0 else None
        E = config.out_dim
        # <s> is never predicted: -inf added to its score everywhere.
        word_mask = torch.zeros(V)
        word_mask[BOS_ID] = -math.inf
        self.register_buffer("word_mask", word_mask, persistent=False)
        self.tree_out = self.band_out = None
        if config.output == "tree":
            if tree is None or tree.num_nodes != config.tree_nodes:
                raise ValueError(f"the tree output needs a tree of {config.tree_nodes} internal nodes")
            self.tree_out = TreeOutput(tree, V, E)
        elif config.output == "dsoftmax":
            self.band_out = BandedOutput(config.band_sizes, config.band_dims, word_mask)
        else:
            self.word_embed = nn.Parameter(torch.empty(V, E))  # R_w
            self.word_bias = nn.Parameter(torch.zeros(V))  # b_w
        if config.output == "class":
            if word_class is None:
                raise ValueError("the class output needs word_class")
            wc = np.array(word_class, dtype=np.int64)  # a writable copy
            K = config.num_classes
            if wc.shape != (V,) or wc.min() < 0 or wc.max() >= K:
                raise ValueError(f"word_class must be (V,)={V} ids in [0, {K})")
            sizes = np.bincount(wc, minlength=K)
            if (sizes == 0).any():
                raise ValueError(f"empty word classes: {np.flatnonzero(sizes == 0)[:5].tolist()}")
            order = np.argsort(wc, kind="stable")
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            self.class_embed = nn.Parameter(torch.empty(K, E))  # S_c
            self.class_bias = nn.Parameter(torch.zeros(K))  # b_c
            self.register_buffer("word_class", torch.from_numpy(wc), persistent=False)
            self.register_buffer("class_order", torch.from_numpy(order), persistent=False)
            self.register_buffer("class_offsets", torch.from_numpy(offsets), persistent=False)
            self._offsets = offsets.tolist()
            # A class holding only <s> can never be predicted.
            class_mask = torch.zeros(K)
            class_mask[wc[BOS_ID]] = -math.inf if sizes[wc[BOS_ID]] == 1 else 0.0
            self.register_buffer("class_mask", class_mask, persistent=False)
            # Padded layout (K, M): class c's words, then V (a padding row) up to M.
            M = int(sizes.max())
            padded = np.full((K, M), V, dtype=np.int64)
            pos = np.arange(V) - offsets[wc[order]]
            padded[wc[order], pos] = order
            self.register_buffer("class_words_padded", torch.from_numpy(padded), persistent=False)
        # Direct n-gram features; their gradients are sparse when ``feature_sparse`` (AdaGrad).
        self.feature_sparse = False
        # Dropout on the context vector while training (0: none); masks drawn from
        # ``dropout_gen`` (the trainer's generator, so a resumed run draws the same masks).
        self.dropout = 0.0
        self.dropout_gen: torch.Generator | None = None
        self.ngram_class = nn.Parameter(torch.zeros(config.ngram_class_table, 1)) if config.ngram_class_table else None
        self.ngram_word = nn.Parameter(torch.zeros(config.ngram_word_table, 1)) if config.ngram_word_table else None
        self.reset_parameters()

    # ------------------------------------------------------------------ set-up
    def reset_parameters(self, std: float = 0.1) -> None:
        """Gaussian embeddings; context weights near 1/(n-1) (identity for ``full``)."""
        n1 = self.config.order - 1
        nn.init.normal_(self.embed.weight, std=std)
        for out in (self.tree_out, self.band_out):
            if out is not None:
                out.reset_parameters(std)
        if self.config.output in ("class", "softmax"):
            nn.init.normal_(self.word_embed, std=std)
        with torch.no_grad():
            if self.config.context == "diagonal":
                self.ctx_weight.normal_(1.0 / n1, std)
            else:
                eye = torch.eye(self.config.dim).expand(n1, -1, -1)
                self.ctx_weight.copy_(eye / n1 + torch.randn_like(self.ctx_weight) * std / self.config.dim**0.5)
            if self.config.output in ("class", "softmax"):
                self.word_bias.zero_()
            for table in (self.ngram_class, self.ngram_word):
                if table is not None:
                    table.zero_()
            if self.config.output == "class":
                nn.init.normal_(self.class_embed, std=std)
                self.class_bias.zero_()

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """Biases from add-one log unigram frequencies: class bias = log P(c), word bias
        = log P(w|c) (softmax output: log P(w)). ``<s>`` gets no mass."""
        counts = np.asarray(unigram_counts, dtype=np.float64) + 1.0
        counts[BOS_ID] = 0.0
        if self.tree_out is not None:
            self.tree_out.init_biases(unigram_counts)
            return
        with torch.no_grad():
            if self.config.output in SOFTMAX_LIKE:
                logp = np.log(np.maximum(counts, 1e-30) / counts.sum())
                bias = self.band_out.bias if self.band_out is not None else self.word_bias
                bias.copy_(torch.from_numpy(logp))
                return
            wc = self.word_class.cpu().numpy()
            mass = np.bincount(wc, weights=counts, minlength=self.config.num_classes)
            class_logp = np.log(np.maximum(mass, 1e-30) / mass.sum())
            word_logp = np.log(np.maximum(counts, 1e-30) / np.maximum(mass[wc], 1e-30))
            self.class_bias.copy_(torch.from_numpy(class_logp))
            self.word_bias.copy_(torch.from_numpy(word_logp))

    # ------------------------------------------------------------------ context
    def set_sparse_grads(self, output: bool, context: bool | None = None) -> None:
        """Sparse gradients (AdaGrad only) for the output word embeddings and for the
        context embeddings (``context`` None: as ``output``)."""
        self.sparse_grads = output
        self.embed.sparse = output if context is None else context

    def encode(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) word ids, oldest first → r (N, E); with direct n-gram features
        r (N, E + feature_order-1): the newest context ids follow as floats (exact below 2^24), so every
        output method below gets the context from r alone (the server caches r per context)."""
        q: Tensor = self.embed(ctx)  # (N, n-1, D)
        if self.config.context == "diagonal":
            r = (q * self.ctx_weight).sum(dim=1)  # (N, n-1, D) * (n-1, D) → sum over j → (N, D)
        else:
            r = torch.einsum("njd,jed->ne", q, self.ctx_weight)  # Σ_j C_j q_j → (N, D)
        if self.hidden is not None:
            r = self.hidden(r)  # (N, H)
        if self.config.activation == "tanh":
            r = torch.tanh(r)
        elif self.config.activation == "relu":
            r = torch.relu(r)
        if self.training and self.dropout > 0.0:
            keep = torch.rand(r.shape, generator=self.dropout_gen, device=r.device) >= self.dropout
            r = r * keep / (1.0 - self.dropout)
        if self.config.has_ngram_features:  # the newest feature_order-1 words
            newest = ctx[:, ctx.shape[1] - (self.config.feature_order - 1):]
            r = torch.cat([r, newest.to(r.dtype)], dim=1)
        return r

    # ------------------------------------------------------------------ direct n-gram features
    def split_context(self, r: Tensor) -> tuple[Tensor, Tensor | None]:
        """r from :meth:`encode` → (the context vector (N, E), suffix hashes (N, feature_order)
        or None without n-gram features)."""
        if not self.config.has_ngram_features:
            return r, None
        E = self.config.out_dim
        ctx = r[:, E:].detach().round().long()
        return r[:, :E], context_hashes(ctx)

    def _feature(self, table: nn.Parameter | None, h: Tensor | None, y: Tensor) -> Tensor | None:
        """Σ over the context suffixes of the hashed weights of (suffix, y) → y.shape."""
        if table is None or h is None:
            return None
        idx = ngram_feature_index(h, y, table.shape[0])  # (N, ..., L)
        return F.embedding(idx, table, sparse=self.feature_sparse).squeeze(-1).sum(-1)

    # ------------------------------------------------------------------ output scores
    def class_logits(self, r: Tensor) -> Tensor:
        """All class scores s_c(h): (N, E) @ (E, K) → (N, K)."""
        r, h = self.split_context(r)
        s = r @ self.class_embed.t() + self.class_bias + self.class_mask
        all_classes = torch.arange(self.config.num_classes, device=r.device).expand(r.shape[0], -1)
        f = self._feature(self.ngram_class, h, all_classes)
        return s if f is None else s + f

    def class_score(self, r: Tensor, cls: Tensor) -> Tensor:
        """s_c(h) of one class per row (any shape of ``cls`` with leading N) → cls.shape."""
        r, h = self.split_context(r)
        per_row = cls[0].numel() if cls.dim() > 1 else 1
        if per_row > 1 and self.config.num_classes <= GEMM_CLASSES_PER_SCORE * per_row:
            # Several classes per row (NCE's data and noise classes): all K products in one
            # GEMM, then each row's columns; cheaper than gathering (N, m, E) class vectors.
            dot = (r @ self.class_embed.t()).gather(1, cls.reshape(r.shape[0], -1)).view(cls.shape)
        else:
            rr = r.reshape(r.shape[0], *([1] * (cls.dim() - 1)), r.shape[1])  # (N, 1.., E)
            dot = (rr * self.class_embed[cls]).sum(-1)
        s = dot + self.class_bias[cls] + self.class_mask[cls]
        f = self._feature(self.ngram_class, h, cls)
        return s if f is None else s + f

    def word_score(self, r: Tensor, word: Tensor) -> Tensor:
        """s_w(h) of one word per row (any shape of ``word`` with leading N): → word.shape.
        For the tree output: log P(w | h) itself."""
        if self.tree_out is not None:
            return self.tree_out.log_prob(r, word, self.sparse_grads)
        if self.band_out is not None:
            return self.band_out.score(r, word, self.sparse_grads)
        r, h = self.split_context(r)
        emb = F.embedding(word, self.word_embed, sparse=self.sparse_grads)  # (N, ..., E)
        rr = r.reshape(r.shape[0], *([1] * (word.dim() - 1)), r.shape[1])  # (N, 1.., E)
        s = (emb * rr).sum(-1) + self.word_bias[word] + self.word_mask[word]
        f = self._feature(self.ngram_word, h, word)
        return s if f is None else s + f

    def word_logits(self, r: Tensor) -> Tensor:
        """All word scores: (N, E) @ (E, V) → (N, V), ``<s>`` at -inf (the tree output:
        all log-probabilities)."""
        if self.tree_out is not None:
            return self.tree_out.all_log_probs(r)
        if self.band_out is not None:
            return self.band_out.logits(r)
        r, h = self.split_context(r)
        s = r @ self.word_embed.t() + self.word_bias + self.word_mask
        all_words = torch.arange(self.config.vocab_size, device=r.device).expand(r.shape[0], -1)
        f = self._feature(self.ngram_word, h, all_words)
        return s if f is None else s + f

    def candidate_logits(self, r: Tensor, words: Tensor) -> Tensor:
        """Scores of the same words (C,) for every row: (N, E) @ (E, C) → (N, C)
        (softmax and differentiated softmax outputs: target sampling)."""
        if self.band_out is not None:
            return self.band_out.logits_of(r, words, self.sparse_grads)
        if self.config.output != "softmax":
            raise ValueError(f"candidate scores need a softmax-like output, not {self.config.output!r}")
        r, _ = self.split_context(r)
        emb = F.embedding(words, self.word_embed, sparse=self.sparse_grads)  # (C, E)
        return r @ emb.t() + self.word_bias[words] + self.word_mask[words]

    def class_log_normalizer(self, r: Tensor) -> Tensor:
        """log Σ_c exp s_c(h) → (N,); zeros for the other outputs."""
        if self.config.output != "class":
            return r.new_zeros(r.shape[0])
        return torch.logsumexp(self.class_logits(r), dim=-1)

    def in_class_log_normalizer(self, r: Tensor, cls: Tensor, method: str = "grouped") -> Tensor:
        """log Σ_{w ∈ cls} exp s_w(h) → (N,); the full-softmax log Z for the (differentiated)
        softmax output; zeros for the tree output (normalised by construction)."""
        if self.config.output == "tree":
            return r.new_zeros(r.shape[0])
        if self.config.output in SOFTMAX_LIKE:
            return torch.logsumexp(self.word_logits(r), dim=-1)
        if method == "padded":
            return self._in_class_padded(r, cls)
        if method != "grouped":
            raise ValueError(f"unknown in-class method {method!r}")
        return self._in_class_grouped(r, cls)

    def _in_class_grouped(self, r: Tensor, cls: Tensor) -> Tensor:
        r, h = self.split_context(r)
        perm = torch.argsort(cls, stable=True)  # rows sorted by class
        classes, counts = torch.unique_consecutive(cls[perm], return_counts=True)
        present = classes.tolist()
        offsets = self._offsets
        sizes = [offsets[c + 1] - offsets[c] for c in present]
        # The words of the classes present, class after class: one gather (one sparse or
        # dense scatter in backward) instead of one per class.
        words = torch.cat([self.class_order[offsets[c] : offsets[c + 1]] for c in present])  # (ΣS_c,)
        emb = F.embedding(words, self.word_embed, sparse=self.sparse_grads)  # (ΣS_c, E)
        bias = self.word_bias[words] + self.word_mask[words]  # (ΣS_c,)
        r_groups = torch.split(r[perm], counts.tolist())  # per class: (n_c, E)
        emb_groups = torch.split(emb, sizes)  # per class: (S_c, E)
        bias_groups = torch.split(bias, sizes)  # per class: (S_c,)
        if h is None or self.ngram_word is None:
            pieces = [
                torch.logsumexp(rg @ eg.t() + bg, dim=-1)  # (n_c, E) @ (E, S_c) → (n_c, S_c) → (n_c,)
                for rg, eg, bg in zip(r_groups, emb_groups, bias_groups)
            ]
        else:  # plus the word features of every word of the class: (n_c, S_c, order) lookups
            h_groups = torch.split(h[perm], counts.tolist())  # per class: (n_c, order)
            word_groups = torch.split(words, sizes)  # per class: (S_c,)
            # The slots of every group in one lookup, so that the table gets one sparse
            # gradient (one per group would be added one after the other: quadratic).
            h_rows = torch.cat([hg.repeat_interleave(wg.numel(), dim=0) for hg, wg in zip(h_groups, word_groups)])
            y_rows = torch.cat([wg.repeat(hg.shape[0]) for hg, wg in zip(h_groups, word_groups)])
            feats = self._feature(self.ngram_word, h_rows, y_rows)  # (Σ n_c S_c,)
            assert feats is not None
            f_groups = torch.split(feats, [n * sz for n, sz in zip(counts.tolist(), sizes)])
            pieces = [torch.logsumexp(rg @ eg.t() + bg + fg.view(rg.shape[0], -1), dim=-1)  # (n_c, S_c) → (n_c,)
                      for rg, eg, bg, fg in zip(r_groups, emb_groups, bias_groups, f_groups)]
        sorted_norm = torch.cat(pieces)  # (N,) in class-sorted order
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return sorted_norm[inverse]

    def _in_class_padded(self, r: Tensor, cls: Tensor) -> Tensor:
        words = self.class_words_padded[cls]  # (N, M), V marks padding
        pad = words == self.config.vocab_size
        safe = words.masked_fill(pad, 0)
        logits = self.word_score(r, safe)  # (N, M)
        logits = logits.masked_fill(pad, -math.inf)
        return torch.logsumexp(logits, dim=-1)

    def scoring_chunk(self, budget: int = 1 << 24) -> int:
        """Rows per chunk for exact scoring: bounded so that the widest score matrix
        (N × V for softmax, N × largest class for the class output) holds ~``budget``
        floats, between 64 and 8192 rows."""
        if self.config.output in SOFTMAX_LIKE:
            width = self.config.vocab_size
        elif self.tree_out is not None:
            width = self.tree_out.tree.depth * self.config.out_dim  # log_prob's (rows, L, E) gather
        else:
            width = max(b - a for a, b in zip(self._offsets, self._offsets[1:]))
            if self.ngram_word is not None:  # (rows, width, feature_order) int64 slots and floats
                width *= 3 * self.config.feature_order
        return int(min(8192, max(64, budget // max(width, 1))))

    def scoring_bounds(self, targets: np.ndarray, budget: int = 1 << 24, max_rows: int = 8192,
                       counted: np.ndarray | None = None) -> Iterator[tuple[int, int]]:
        """Consecutive (start, end) chunks of ``targets`` (N,) for exact scoring, each of at
        most ``max_rows`` rows whose targets' class widths sum to at most ``budget`` (one row
        at least). ``counted`` (N,) bool: the rows whose width counts (None: all); a scorer
        that normalises once per (context, class) pair counts the first row of each pair.

        The class-factored normaliser materialises (rows of class c) × |c| scores per class
        present, so the sum over the rows actually scored bounds the largest score matrix;
        :meth:`scoring_chunk` assumes every row is in the largest class, which at V ≥ 100k
        (a 58,333-word rare-word class) means chunks of a few hundred rows."""
        n = int(targets.shape[0])
        if self.config.output != "class":
            chunk = min(max_rows, self.scoring_chunk(budget))
            yield from ((a, min(a + chunk, n)) for a in range(0, n, chunk))
            return
        sizes = np.diff(np.asarray(self._offsets))  # (K,)
        widths = sizes[self.word_class.cpu().numpy()[np.asarray(targets, dtype=np.int64)]]  # (N,)
        if self.ngram_word is not None:  # (rows, width, feature_order) int64 slots and floats
            widths = widths * 3 * self.config.feature_order
        if counted is not None:
            widths = np.where(counted, widths, 0)
        cum = np.concatenate([[0], np.cumsum(widths)])  # cum[i]: widths of the first i rows
        i = 0
        while i < n:
            end = int(np.searchsorted(cum, cum[i] + budget, side="right")) - 1  # widths of i..end-1 ≤ budget
            end = min(max(end, i + 1), i + max_rows, n)
            yield i, end
            i = end

    # ------------------------------------------------------------------ probabilities
    def log_prob(self, ctx: Tensor, target: Tensor, *, normalized: bool = True) -> Tensor:
        """log P(target | ctx) in natural log → (N,). Unnormalised: s_c + s_w (or s_w)."""
        r = self.encode(ctx)
        return self.log_prob_from_r(r, target, normalized=normalized)

    def log_prob_from_r(self, r: Tensor, target: Tensor, *, normalized: bool = True) -> Tensor:
        if self.config.output == "tree":
            return self.word_score(r, target)  # normalised by construction
        if self.config.output in SOFTMAX_LIKE:
            score = self.word_score(r, target)
            return score - self.in_class_log_normalizer(r, target) if normalized else score
        cls = self.word_class[target]
        score = self.class_score(r, cls) + self.word_score(r, target)
        if not normalized:
            return score
        return score - self.class_log_normalizer(r) - self.in_class_log_normalizer(r, cls)

    def full_log_probs(self, ctx: Tensor) -> Tensor:
        """The whole distribution log P(· | ctx) → (N, V) (``<s>`` at -inf). For tests and
        small vocabularies."""
        r = self.encode(ctx)
        if self.config.output == "tree":
            return self.word_logits(r)
        if self.config.output in SOFTMAX_LIKE:
            return torch.log_softmax(self.word_logits(r), dim=-1)
        class_logp = torch.log_softmax(self.class_logits(r), dim=-1)  # (N, K)
        word_logits = self.word_logits(r)  # (N, V)
        out = torch.empty_like(word_logits)
        offsets = self._offsets
        for c in range(self.config.num_classes):
            words = self.class_order[offsets[c] : offsets[c + 1]]
            in_class = torch.log_softmax(word_logits[:, words], dim=-1)  # (N, S_c)
            out[:, words] = class_logp[:, c : c + 1] + in_class
        out[:, BOS_ID] = -math.inf  # also when <s> is alone in its class (0/0 above)
        return out
