"""The class-factored output layer (Goodman 2001; Mikolov et al. 2011; OxLM, Baltescu &
Blunsom 2015): the word's class, then the word within its class, with OxLM's direct n-gram
features; and its read-only CPU inference tables (:class:`ClassTables`)."""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import cpu
from ..dedup import BatchPlan
from ...wire.ngrams import HASH_CTX as HASH_CTX, HASH_KEY as HASH_KEY, HASH_MOD as HASH_MOD  # re-exported
from ...wire.ngrams import HASH_OUT as HASH_OUT, HASH_SEED as HASH_SEED, NO_HASH as NO_HASH  # re-exported
from ...wire.ngrams import no_word_id
from ..vocab import BOS_ID
from .base import CHUNK_FLOATS, MAX_CHUNK_ROWS, OutputLayer, bos_mask, checks_no_word, expand_rows

# Direct n-gram features (OxLM, Baltescu, Blunsom & Hoang 2014; the maximum-entropy features of
# Mikolov's RNNME): for every suffix of the context of length 0..feature_order-1 one hashed
# weight per (suffix, class) added to the class score and one per (suffix, word) added to the
# word score. The hash's constants are the wire contract's (nlmserve.wire.ngrams, whose
# suffix_hashes and feature_slots are the numpy twins of context_hashes and ngram_feature_index).
#: NCE's class scores: with m classes per row, one GEMM over all K classes while
#: K <= this * m. Forward and backward, 512 rows, width 512, m = 11, one thread: the GEMM
#: takes 2.0 / 3.5 / 6.3 / 12.0 ms at K = 100 / 189 / 350 / 700, gathering and multiplying
#: the m class vectors 8–11 ms at every K (crossover near K = 450).
GEMM_CLASSES_PER_SCORE = 40



def context_hashes(ctx: Tensor, no_word: int | None = None) -> Tensor:
    """ctx (N, L-1) word ids, oldest first → (N, L) int64 hashes of the context suffixes of
    length 0, 1, …, L-1 (the newest words). A suffix that holds ``no_word`` (the id of a word
    that is not known, ``nlmserve.wire.ngrams``) gets NO_HASH: it has no feature."""
    N, n1 = ctx.shape
    h = torch.full((N,), HASH_SEED, dtype=torch.int64, device=ctx.device)
    out = [h]
    for length in range(1, n1 + 1):
        h = (h * HASH_CTX + ctx[:, n1 - length].long() + 1) % HASH_MOD
        out.append(h)
    hashes = torch.stack(out, dim=1)
    if no_word is not None and n1:
        unknown = torch.cumsum((ctx == no_word).flip(1).long(), dim=1) > 0  # (N, L-1): suffix 1.. holds one
        hashes[:, 1:] = hashes[:, 1:].masked_fill(unknown, NO_HASH)
    return hashes


def ngram_feature_index(h: Tensor, y: Tensor, size: int) -> Tensor:
    """Table slots of the features (suffix, y): h (N, L) suffix hashes, y (N, ...) class or
    word ids → (N, ..., L)."""
    hh = h.view(h.shape[0], *([1] * (y.dim() - 1)), h.shape[1])
    return ((hh * HASH_KEY + y.long().unsqueeze(-1) * HASH_OUT) % HASH_MOD) % size


class ClassOutput(OutputLayer):
    """Class-factored output: the word's class, then the word within its class::

        log P(w | h) = s_c(h) - log Σ_c' exp s_c'(h)  +  s_w(h) - log Σ_{w' ∈ c} exp s_w'(h)
        s_c(h) = S_c · r + b_c [+ Σ_l f_class(suffix_l(h), c)]        c = class(w)
        s_w(h) = R_w · r + b_w [+ Σ_l f_word(suffix_l(h), w)]

    S (K, E), b_c (K,), R (V, E), b_w (V,); the bracketed sums are the direct n-gram features
    (hashed tables, :func:`ngram_feature_index`) over the context's newest suffixes. NCE
    trains s_c + s_w to be log P itself (self-normalised, Baltescu & Blunsom 2015); the exact
    score subtracts two normalisers: one GEMM over the K classes, and per class present one
    product with its |c| words (``in_class_method="padded"`` gathers every row's class padded
    to the largest instead; kept for the benchmark: an (N, largest class, E) tensor, slower on
    frequency-binned classes whose rare-word class is large). A class holding only ``<s>``
    is masked like ``<s>``."""

    kind = "class"
    word_mask: Tensor  # (V,) 0, -inf for <s>
    word_class: Tensor  # (V,) class of each word
    class_order: Tensor  # (V,) word ids sorted by class
    class_offsets: Tensor  # (K+1,) class c is class_order[offsets[c]:offsets[c+1]]
    class_mask: Tensor  # (K,) 0, -inf for a class holding only <s>
    class_words_padded: Tensor  # (K, M) class words, padded with V
    ngram_class: nn.Parameter | None  # (ngram_class_table, 1) hashed (suffix, class) weights
    ngram_word: nn.Parameter | None  # (ngram_word_table, 1) hashed (suffix, word) weights

    def __init__(self, vocab_size: int, width: int, num_classes: int, word_class: np.ndarray, *,
                 ngram_class_table: int = 0, ngram_word_table: int = 0, feature_order: int = 0) -> None:
        super().__init__()
        V, E, K = vocab_size, width, num_classes
        wc = np.array(word_class, dtype=np.int64)  # a writable copy
        if wc.shape != (V,) or wc.min() < 0 or wc.max() >= K:
            raise ValueError(f"word_class must be (V,)={V} ids in [0, {K})")
        sizes = np.bincount(wc, minlength=K)
        if (sizes == 0).any():
            raise ValueError(f"empty word classes: {np.flatnonzero(sizes == 0)[:5].tolist()}")
        self.vocab_size, self.num_classes, self.feature_order = V, K, feature_order
        self.word_embed = nn.Parameter(torch.empty(V, E))  # R_w
        self.word_bias = nn.Parameter(torch.zeros(V))  # b_w
        self.class_embed = nn.Parameter(torch.empty(K, E))  # S_c
        self.class_bias = nn.Parameter(torch.zeros(K))  # b_c
        order = np.argsort(wc, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.register_buffer("word_mask", bos_mask(V), persistent=False)
        self.register_buffer("word_class", torch.from_numpy(wc), persistent=False)
        self.register_buffer("class_order", torch.from_numpy(order), persistent=False)
        self.register_buffer("class_offsets", torch.from_numpy(offsets), persistent=False)
        self.offsets: list[int] = offsets.tolist()
        class_mask = torch.zeros(K)
        class_mask[wc[BOS_ID]] = -math.inf if sizes[wc[BOS_ID]] == 1 else 0.0
        self.register_buffer("class_mask", class_mask, persistent=False)
        # Padded layout (K, M): class c's words, then V (a padding row) up to M.
        M = int(sizes.max())
        padded = np.full((K, M), V, dtype=np.int64)
        pos = np.arange(V) - offsets[wc[order]]
        padded[wc[order], pos] = order
        self.register_buffer("class_words_padded", torch.from_numpy(padded), persistent=False)
        #: Sparse gradients for the n-gram feature tables (AdaGrad: a batch touches few slots).
        self.feature_sparse = False
        self.ngram_class = nn.Parameter(torch.zeros(ngram_class_table, 1)) if ngram_class_table else None
        self.ngram_word = nn.Parameter(torch.zeros(ngram_word_table, 1)) if ngram_word_table else None

    # ------------------------------------------------------------------ set-up
    def reset_parameters(self, std: float, context: Any = None) -> None:
        """Gaussian word vectors, then ``context()`` (the network's context weights), then
        Gaussian class vectors: the order a seed's random numbers have always been drawn in."""
        nn.init.normal_(self.word_embed, std=std)
        if context is not None:
            context()
        with torch.no_grad():
            self.word_bias.zero_()
            for table in (self.ngram_class, self.ngram_word):
                if table is not None:
                    table.zero_()
        nn.init.normal_(self.class_embed, std=std)
        with torch.no_grad():
            self.class_bias.zero_()

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """class bias = log P(c), word bias = log P(w | c) of the add-one unigram."""
        counts = np.asarray(unigram_counts, dtype=np.float64) + 1.0
        counts[BOS_ID] = 0.0
        wc = self.word_class.cpu().numpy()
        mass = np.bincount(wc, weights=counts, minlength=self.num_classes)
        class_logp = np.log(np.maximum(mass, 1e-30) / mass.sum())
        word_logp = np.log(np.maximum(counts, 1e-30) / np.maximum(mass[wc], 1e-30))
        with torch.no_grad():
            self.class_bias.copy_(torch.from_numpy(class_logp))
            self.word_bias.copy_(torch.from_numpy(word_logp))

    def sparse_parameters(self) -> list[Tensor]:
        out: list[Tensor] = [self.word_embed] if self.sparse else []
        if self.feature_sparse:
            out.extend(t for t in (self.ngram_class, self.ngram_word) if t is not None)
        return out

    @property
    def has_features(self) -> bool:
        return self.ngram_class is not None or self.ngram_word is not None

    def feature_tables(self) -> list[nn.Parameter]:
        """The hashed n-gram feature tables the model has."""
        return [t for t in (self.ngram_class, self.ngram_word) if t is not None]

    # ------------------------------------------------------------------ direct n-gram features
    def hashes(self, ctx: Tensor | None) -> Tensor | None:
        """The suffix hashes (N, feature_order) of the context ids ctx (N, order-1) (None
        without features)."""
        if not self.has_features:
            return None
        if ctx is None:
            raise ValueError("a model with direct n-gram features scores with the context ids beside r")
        return context_hashes(ctx[:, ctx.shape[1] - (self.feature_order - 1):], no_word=no_word_id(self.word_class.numel()))

    def _feature(self, table: nn.Parameter | None, h: Tensor | None, y: Tensor) -> Tensor | None:
        """Σ over the context suffixes of the hashed weights of (suffix, y) → y.shape (a
        suffix hashed NO_HASH adds nothing)."""
        if table is None or h is None:
            return None
        idx = ngram_feature_index(h, y, table.shape[0])  # (N, ..., L)
        w = F.embedding(idx, table, sparse=self.feature_sparse).squeeze(-1)
        if checks_no_word(h, self.training) and bool((h == NO_HASH).any()):
            w = w.masked_fill((h == NO_HASH).view(h.shape[0], *([1] * (y.dim() - 1)), h.shape[1]), 0.0)
        return w.sum(-1)

    # ------------------------------------------------------------------ the two factors
    def classes_of(self, word: Tensor) -> Tensor:
        return self.word_class[word]

    def class_logits(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """All class scores s_c(h): (N, E) @ (E, K) → (N, K)."""
        s = r @ self.class_embed.t() + self.class_bias + self.class_mask
        all_classes = torch.arange(self.num_classes, device=r.device).expand(r.shape[0], -1)
        f = self._feature(self.ngram_class, self.hashes(ctx), all_classes)
        return s if f is None else s + f

    def class_score(self, r: Tensor, cls: Tensor, ctx: Tensor | None = None) -> Tensor:
        """s_c(h) of one class per row (any shape of ``cls`` with leading N) → cls.shape."""
        per_row = cls[0].numel() if cls.dim() > 1 else 1
        if per_row > 1 and self.num_classes <= GEMM_CLASSES_PER_SCORE * per_row:
            # Several classes per row (NCE's data and noise classes): all K products in one
            # GEMM, then each row's columns; cheaper than gathering (N, m, E) class vectors.
            dot = (r @ self.class_embed.t()).gather(1, cls.reshape(r.shape[0], -1)).view(cls.shape)
        else:
            dot = (expand_rows(r, cls) * self.class_embed[cls]).sum(-1)
        s = dot + self.class_bias[cls] + self.class_mask[cls]
        f = self._feature(self.ngram_class, self.hashes(ctx), cls)
        return s if f is None else s + f

    def word_score(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """s_w(h) of one word per row (any shape of ``word`` with leading N) → word.shape."""
        emb = F.embedding(word, self.word_embed, sparse=self.sparse)  # (N, ..., E)
        s = (emb * expand_rows(r, word)).sum(-1) + self.word_bias[word] + self.word_mask[word]
        f = self._feature(self.ngram_word, self.hashes(ctx), word)
        return s if f is None else s + f

    def word_logits(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """All word scores s_w(h): (N, E) @ (E, V) → (N, V), ``<s>`` at -inf."""
        s = r @ self.word_embed.t() + self.word_bias + self.word_mask
        all_words = torch.arange(self.vocab_size, device=r.device).expand(r.shape[0], -1)
        f = self._feature(self.ngram_word, self.hashes(ctx), all_words)
        return s if f is None else s + f

    def class_log_normalizer(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """log Σ_c exp s_c(h) → (N,)."""
        return torch.logsumexp(self.class_logits(r, ctx), dim=-1)

    def in_class_log_normalizer(self, r: Tensor, cls: Tensor, ctx: Tensor | None = None,
                                method: str = "grouped") -> Tensor:
        """log Σ_{w ∈ cls} exp s_w(h) → (N,)."""
        if method == "padded":
            return self._in_class_padded(r, cls, ctx)
        if method != "grouped":
            raise ValueError(f"unknown in-class method {method!r}")
        return self._in_class_grouped(r, cls, ctx)

    def _in_class_grouped(self, r: Tensor, cls: Tensor, ctx: Tensor | None) -> Tensor:
        h = self.hashes(ctx)
        perm = torch.argsort(cls, stable=True)  # rows sorted by class
        classes, counts = torch.unique_consecutive(cls[perm], return_counts=True)
        present = classes.tolist()
        offsets = self.offsets
        sizes = [offsets[c + 1] - offsets[c] for c in present]
        # The words of the classes present, class after class: one gather (one sparse or
        # dense scatter in backward) instead of one per class.
        words = torch.cat([self.class_order[offsets[c] : offsets[c + 1]] for c in present])  # (ΣS_c,)
        emb = F.embedding(words, self.word_embed, sparse=self.sparse)  # (ΣS_c, E)
        bias = self.word_bias[words] + self.word_mask[words]  # (ΣS_c,)
        r_groups = torch.split(r[perm], counts.tolist())  # per class: (n_c, E)
        emb_groups = torch.split(emb, sizes)  # per class: (S_c, E)
        bias_groups = torch.split(bias, sizes)  # per class: (S_c,)
        if h is None or self.ngram_word is None:
            pieces = [
                torch.logsumexp(rg @ eg.t() + bg, dim=-1)  # (n_c, E) @ (E, S_c) → (n_c, S_c) → (n_c,)
                for rg, eg, bg in zip(r_groups, emb_groups, bias_groups)
            ]
        else:  # plus the word features of every word of the class: (n_c, S_c, L) lookups
            h_groups = torch.split(h[perm], counts.tolist())  # per class: (n_c, L)
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

    def _in_class_padded(self, r: Tensor, cls: Tensor, ctx: Tensor | None) -> Tensor:
        words = self.class_words_padded[cls]  # (N, M), V marks padding
        pad = words == self.vocab_size
        logits = self.word_score(r, words.masked_fill(pad, 0), ctx)  # (N, M)
        return torch.logsumexp(logits.masked_fill(pad, -math.inf), dim=-1)

    # ------------------------------------------------------------------ the layer's answers
    def score(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """s_c(h) + s_w(h)."""
        return self.class_score(r, self.word_class[word], ctx) + self.word_score(r, word, ctx)

    def log_normalizer(self, r: Tensor, word: Tensor, ctx: Tensor | None = None) -> Tensor:
        """The class normaliser plus the in-class normaliser of the word's class."""
        return self.class_log_normalizer(r, ctx) + self.in_class_log_normalizer(r, self.word_class[word], ctx)

    def log_prob(self, r: Tensor, word: Tensor, ctx: Tensor | None = None, *, normalized: bool = True) -> Tensor:
        """score - class normaliser - in-class normaliser, subtracted in that order (float
        rounding: the values every model file's validation perplexity was computed with)."""
        s = self.score(r, word, ctx)
        if not normalized:
            return s
        return s - self.class_log_normalizer(r, ctx) - self.in_class_log_normalizer(r, self.word_class[word], ctx)

    def full_log_probs(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        class_logp = torch.log_softmax(self.class_logits(r, ctx), dim=-1)  # (N, K)
        word_logits = self.word_logits(r, ctx)  # (N, V)
        out = torch.empty_like(word_logits)
        offsets = self.offsets
        for c in range(self.num_classes):
            words = self.class_order[offsets[c] : offsets[c + 1]]
            in_class = torch.log_softmax(word_logits[:, words], dim=-1)  # (N, S_c)
            out[:, words] = class_logp[:, c : c + 1] + in_class
        out[:, BOS_ID] = -math.inf  # also when <s> is alone in its class (0/0 above)
        return out

    # ------------------------------------------------------------------ exact scoring in chunks
    def _feature_factor(self) -> int:
        """Exact scoring with word features holds (rows, class, feature_order) int64 slots and floats."""
        return 3 * self.feature_order if self.ngram_word is not None else 1

    def row_width(self) -> int:
        """Every row in the largest class (see :meth:`scoring_bounds`)."""
        return max(b - a for a, b in zip(self.offsets, self.offsets[1:])) * self._feature_factor()

    def scoring_bounds(self, targets: np.ndarray, budget: int = CHUNK_FLOATS, max_rows: int = MAX_CHUNK_ROWS,
                       counted: np.ndarray | None = None) -> Iterator[tuple[int, int]]:
        """Chunks whose targets' class widths sum to at most ``budget`` (one row at least).
        ``counted`` (N,) bool: the rows whose width counts (None: all); a scorer that
        normalises once per (context, class) pair counts the first row of each pair.

        The in-class normaliser materialises (rows of class c) × |c| scores per class
        present, so the sum over the rows actually scored bounds the largest score matrix;
        :meth:`scoring_chunk` assumes every row is in the largest class, which at V ≥ 100k
        (a 58,333-word rare-word class) means chunks of a few hundred rows."""
        n = int(targets.shape[0])
        sizes = np.diff(np.asarray(self.offsets))  # (K,)
        widths = sizes[self.word_class.cpu().numpy()[np.asarray(targets, dtype=np.int64)]] * self._feature_factor()
        if counted is not None:
            widths = np.where(counted, widths, 0)
        cum = np.concatenate([[0], np.cumsum(widths)])  # cum[i]: widths of the first i rows
        i = 0
        while i < n:
            end = int(np.searchsorted(cum, cum[i] + budget, side="right")) - 1  # widths of i..end-1 ≤ budget
            end = min(max(end, i + 1), i + max_rows, n)
            yield i, end
            i = end

    # ------------------------------------------------------------------ fast inference
    def output_rows(self) -> tuple[Tensor, Tensor]:
        """s_c(h) + s_w(h) = (S_k + R_w)·r + (b_k + b_w) for k the class of w, besides the
        direct n-gram features: one row per word (V, E) and one bias per word (V,), so a
        row's unnormalised score is one dot product (plus the features' weights)."""
        cls = self.word_class
        rows = (self.word_embed + self.class_embed[cls]).detach().contiguous()
        bias = (self.word_bias + self.word_mask + self.class_bias[cls] + self.class_mask[cls]).detach().contiguous()
        return rows, bias

    def inference_tables(self) -> "ClassTables":
        """Read-only CPU copies of this layer for inference (no features)."""
        return ClassTables(self)


class ClassTables:
    """Read-only copies of a :class:`ClassOutput` for CPU inference: the output word
    embeddings and biases sorted by class (each class a contiguous slice, so the in-class
    normaliser needs no gather), one output row per word for the unnormalised score, and
    numpy views for the tiny-batch path. The caller rebuilds them when a parameter changes."""

    def __init__(self, out: ClassOutput) -> None:
        with torch.no_grad():
            order = out.class_order
            self.sorted_embed = out.word_embed.detach()[order].contiguous()  # (V, E)
            self.sorted_bias = (out.word_bias + out.word_mask).detach()[order].contiguous()  # (V,)
            self.offsets: list[int] = list(out.offsets)
            self.np_class_start = np.array(self.offsets[:-1], dtype=np.int64)  # (K,)
            self.np_class_size = np.diff(np.array(self.offsets, dtype=np.int64))  # (K,)
            self.class_bias = (out.class_bias + out.class_mask).detach().clone()  # (K,)
            self.class_embed_t = out.class_embed.detach().t()  # (E, K)
            self.np_class_embed_t = np.ascontiguousarray(self.class_embed_t.numpy())  # (E, K)
            self.np_class_bias = self.class_bias.numpy()
            self.np_word_class = out.word_class.numpy()
            self.np_sorted_embed = self.sorted_embed.numpy()
            self.np_sorted_bias = self.sorted_bias.numpy()
            self.out_embed, self.out_bias = out.output_rows()  # (V, E), (V,): s_c + s_w per word
            self.np_out_embed = self.out_embed.numpy()
            self.np_out_bias = self.out_bias.numpy()

    # -------------------------------------------------------------- torch, any batch size
    def raw(self, r: Tensor, row_context: Tensor, target: Tensor) -> Tensor:
        """s_c + s_w of each row → (R,): r (U, E) of the distinct contexts, the context
        (into r) and the target of each row. Row-wise products: a row's score does not
        depend on the rows batched with it."""
        # index_select and an in-place product: advanced indexing and a third (R, E)
        # temporary cost about four times as much on the CPU.
        rows = self.out_embed.index_select(0, target)  # (R, E)
        return rows.mul_(r.index_select(0, row_context)).sum(-1) + self.out_bias.index_select(0, target)

    def in_class(self, r: Tensor, cls: Tensor) -> Tensor:
        """log Σ_{w ∈ cls} exp s_w(h) → (N,).

        Rows of one-word classes: that word's score, one row-wise product for all of them.
        Other classes: one addmm per class present on its contiguous slice, then log Σ exp
        without the max shift (two passes over the block instead of four); a row whose sum
        overflows or underflows float32 is recomputed with the shift."""
        cls_np = cls.numpy()
        out = torch.empty(r.shape[0], dtype=r.dtype)
        single = self.np_class_size[cls_np] == 1
        emb, bias, offsets = self.sorted_embed, self.sorted_bias, self.offsets
        if single.any():
            rows = torch.from_numpy(np.flatnonzero(single))
            first = torch.from_numpy(self.np_class_start[cls_np[single]])
            out[rows] = (r[rows] * emb[first]).sum(-1) + bias[first]
            if single.all():
                return out
            multi = np.flatnonzero(~single)
        else:
            multi = np.arange(len(cls_np))
        perm = multi[np.argsort(cls_np[multi], kind="stable")]  # rows sorted by class
        sorted_cls = cls_np[perm]
        classes, counts = np.unique(sorted_cls, return_counts=True)
        rs = r[torch.from_numpy(perm)]
        sums = torch.empty(len(perm), dtype=r.dtype)
        start = 0
        for c, n in zip(classes.tolist(), counts.tolist()):
            a, b = offsets[c], offsets[c + 1]
            logits = torch.addmm(bias[a:b], rs[start : start + n], emb[a:b].t())  # (n_c, S_c)
            torch.sum(logits.exp_(), dim=1, out=sums[start : start + n])
            start += n
        sums.log_()
        bad = ~torch.isfinite(sums) | (sums < cpu.LOG_SUM_FLOOR)
        if bool(bad.any()):  # rare: scores beyond exp's float32 range
            for i in bad.nonzero().squeeze(1).tolist():
                a, b = offsets[int(sorted_cls[i])], offsets[int(sorted_cls[i]) + 1]
                sums[i] = torch.logsumexp(torch.mv(emb[a:b], rs[i]) + bias[a:b], dim=0)
        out[torch.from_numpy(perm)] = sums
        return out

    def class_norm(self, r: Tensor) -> Tensor:
        """log Σ_c exp s_c(h) → (N,): one fused GEMM (N, E) @ (E, K) plus the class biases."""
        return torch.logsumexp(torch.addmm(self.class_bias, r, self.class_embed_t), dim=1)

    # -------------------------------------------------------------- numpy, tiny batches
    def log_prob_numpy(self, plan: BatchPlan, r: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The rows of ``plan`` (``plan_batch`` of the batch) scored in numpy from r (U, E),
        the vectors of its distinct contexts, and the batch's targets → float32 (N,)."""
        rr, t = r[plan.row_context], target[plan.rows]  # (R, E), (R,)
        raw = np.einsum("ne,ne->n", rr, self.np_out_embed[t]) + self.np_out_bias[t]  # (R,) s_c + s_w
        if not plan.norm.size:
            return plan.compose(raw, NO_SCORES, NO_SCORES)
        class_logits = cpu.mm(r[plan.norm_contexts], self.np_class_embed_t) + self.np_class_bias  # (C, K)
        in_class = np.empty(plan.pair_class.size, dtype=np.float32)  # (P,)
        offsets = self.offsets
        for p, (u, k) in enumerate(zip(plan.pair_context.tolist(), plan.pair_class.tolist())):
            a, b = offsets[k], offsets[k + 1]
            in_class[p] = cpu.logsumexp(cpu.mv(self.np_sorted_embed[a:b], r[u]) + self.np_sorted_bias[a:b])
        return plan.compose(raw, cpu.logsumexp_rows(class_logits), in_class)


#: No normalisers (a plan with no rows to normalise).
NO_SCORES = np.zeros(0, dtype=np.float32)
