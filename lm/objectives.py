"""Training objectives: class-factored NCE, exact class-factored MLE, full softmax.

NCE (Gutmann & Hyvärinen 2010; Mnih & Teh 2012) with the normalisers fixed at zero, so the
trained model's unnormalised scores approximate log-probabilities (self-normalisation).
For the class-factored output each factor gets its own NCE term (Baltescu & Blunsom 2015):

    class term: data c = class(w), k noise classes from the class unigram q(c)
    word term:  data w,            k noise words from q(w | c), the unigram inside c

    term = -log σ(Δ(x)) - Σ_j log σ(-Δ(x_j)),   Δ(x) = s(x) - log(k · q(x))

with s the unnormalised log score (s_c(h) or s_w(h)). For the softmax output the word
term alone runs with noise from the word unigram.

For the (differentiated) softmax outputs (Chen, Grangier & Auli 2016, §2):

    sampling    target sampling (Jean et al. 2015): one set of k words per batch drawn
                from the unigram q; each row's softmax runs over the batch's targets and
                that set, every candidate's score corrected by -log q(w) (importance
                sampling of the normaliser).
    weaknorm    -s_y(h) on every row, plus (log Z(h) + α (log Z(h))²) / γ on a random
                fraction γ of the rows (an unbiased estimate of the cross-entropy plus a
                self-normalisation penalty, computed on γ of the rows only).
    weaknormsq  -s_y(h) on every row plus α (log Z(h))² / γ on the fraction γ (Andreas &
                Klein 2015's weak normalisation: the likelihood is never normalised, the
                penalty alone keeps log Z near 0; its fixed point has log Z ≈ 1/(2α)).

``mle`` is the exact cross-entropy of whatever output the model has (class, softmax,
differentiated softmax, tree).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .model import NeuralLM
from .outputs.base import SoftmaxFamily
from .outputs.class_factored import ClassOutput
from .vocab import BOS_ID

OBJECTIVES = ("nce", "mle", "softmax", "sampling", "weaknorm", "weaknormsq")


class NoiseDistribution:
    """Unigram noise for NCE: over classes, and over words inside each class (or over all
    words for the softmax output). ``<s>`` has zero noise probability."""

    def __init__(self, unigram_counts: np.ndarray, word_class: np.ndarray | None, device: torch.device) -> None:
        counts = np.asarray(unigram_counts, dtype=np.float64).copy()
        counts[BOS_ID] = 0.0
        if counts.sum() <= 0:
            raise ValueError("noise distribution needs positive unigram counts")
        V = counts.size
        self.device = device
        if word_class is None:
            self.num_classes = 0
            q = counts / counts.sum()
            self.log_q_word = torch.from_numpy(np.log(np.maximum(q, 1e-30))).to(device)  # (V,) log q(w)
            self._word_probs = torch.from_numpy(q).to(device)
            self.log_q_class = torch.zeros(0, dtype=torch.float64, device=device)
            return
        wc = np.asarray(word_class, dtype=np.int64)
        K = int(wc.max()) + 1
        self.num_classes = K
        mass = np.bincount(wc, weights=counts, minlength=K)  # (K,)
        q_class = mass / mass.sum()
        q_in = np.where(mass[wc] > 0, counts / np.maximum(mass[wc], 1e-300), 0.0)  # (V,) q(w|c)
        self.log_q_class = torch.from_numpy(np.log(np.maximum(q_class, 1e-30))).to(device)  # (K,)
        self.log_q_word = torch.from_numpy(np.log(np.maximum(q_in, 1e-30))).to(device)  # (V,)
        self._class_probs = torch.from_numpy(q_class).to(device)
        # Sampling inside a class: words sorted by class; key = class + cumulative q(w|c)
        # (strictly inside (c, c+1], exactly c+1 at the class's last word), so a key
        # c + u with u in (0, 1] lands on a word of class c by binary search.
        order = np.argsort(wc, kind="stable")
        cls_sorted = wc[order]
        cum = np.zeros(V, dtype=np.float64)
        offsets = np.concatenate([[0], np.cumsum(np.bincount(wc, minlength=K))])
        for c in range(K):
            a, b = offsets[c], offsets[c + 1]
            seg = np.cumsum(q_in[order[a:b]])
            if seg.size and seg[-1] > 0:
                seg = seg / seg[-1]
                seg[-1] = 1.0
            cum[a:b] = seg
        self._keys = torch.from_numpy(cls_sorted + cum).to(device)  # (V,) float64, sorted
        self._order = torch.from_numpy(order).to(device)

    def sample_classes(self, n: int, k: int, generator: torch.Generator) -> Tensor:
        """(n, k) class ids drawn from q(c)."""
        flat = torch.multinomial(self._class_probs, n * k, replacement=True, generator=generator)
        return flat.view(n, k)

    def sample_words_in_class(self, cls: Tensor, k: int, generator: torch.Generator) -> Tensor:
        """(n, k) word ids, row i drawn from q(w | cls[i])."""
        u = 1.0 - torch.rand(cls.shape[0], k, dtype=torch.float64, generator=generator, device=self.device)
        keys = cls.to(torch.float64).unsqueeze(1) + u  # (n, k) in (c, c+1]
        idx = torch.searchsorted(self._keys, keys)  # (n, k) positions in class-sorted order
        return self._order[idx.clamp_(max=self._order.numel() - 1)]

    def sample_words(self, n: int, k: int, generator: torch.Generator) -> Tensor:
        """(n, k) word ids drawn from the word unigram (softmax output)."""
        flat = torch.multinomial(self._word_probs, n * k, replacement=True, generator=generator)
        return flat.view(n, k)

    def sample(self, model: NeuralLM, target: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor | None, Tensor]:
        """Noise for a batch: (noise classes (n, k) or None for softmax, noise words (n, k))."""
        n = target.shape[0]
        if not isinstance(model.output, ClassOutput):
            return None, self.sample_words(n, k, generator)
        cls = model.output.word_class[target]
        return self.sample_classes(n, k, generator), self.sample_words_in_class(cls, k, generator)


#: α of the self-normalising objectives when not given.
DEFAULT_NORM_WEIGHT = {"weaknorm": 0.1, "weaknormsq": 1.0}


def _nce_term(data_score: Tensor, noise_score: Tensor, log_q_data: Tensor, log_q_noise: Tensor, k: int) -> Tensor:
    """Per-example NCE loss: data (n,), noise (n, k) scores and noise log-probabilities."""
    log_k = math.log(k)
    delta_data = data_score - (log_q_data.to(data_score.dtype) + log_k)  # (n,)
    delta_noise = noise_score - (log_q_noise.to(noise_score.dtype) + log_k)  # (n, k)
    return -F.logsigmoid(delta_data) - F.logsigmoid(-delta_noise).sum(dim=1)


def nce_loss(
    model: NeuralLM,
    ctx: Tensor,
    target: Tensor,
    noise: NoiseDistribution,
    noise_classes: Tensor | None,
    noise_words: Tensor,
) -> Tensor:
    """Mean NCE loss of a batch with given noise samples (see the module docstring)."""
    k = noise_words.shape[1]
    out = model.output
    r = model.encode(ctx)  # (n, E)
    # The data and the noise are scored in one call per factor: (n, 1 + k), data first (one
    # gather and one sparse gradient per table instead of two to be added).
    words = torch.cat([target.unsqueeze(1), noise_words], dim=1)
    word_scores = out.word_score(r, words, ctx) if isinstance(out, ClassOutput) else out.score(r, words, ctx)
    word_term = _nce_term(
        word_scores[:, 0],  # (n,)
        word_scores[:, 1:],  # (n, k)
        noise.log_q_word[target],
        noise.log_q_word[noise_words],
        k,
    )
    if not isinstance(out, ClassOutput):
        return word_term.mean()
    if noise_classes is None:
        raise ValueError("the class output needs noise classes")
    cls = out.word_class[target]
    class_scores = out.class_score(r, torch.cat([cls.unsqueeze(1), noise_classes], dim=1), ctx)
    class_term = _nce_term(
        class_scores[:, 0],
        class_scores[:, 1:],
        noise.log_q_class[cls],
        noise.log_q_class[noise_classes],
        noise_classes.shape[1],
    )
    return (class_term + word_term).mean()


def _softmax_family(model: NeuralLM) -> "SoftmaxFamily":
    if not isinstance(model.output, SoftmaxFamily):
        raise ValueError(f"this objective needs a softmax-like output, not {model.config.output!r}")
    return model.output


def mle_loss(model: NeuralLM, ctx: Tensor, target: Tensor) -> Tensor:
    """Mean exact cross-entropy (class-factored or full softmax, as the model's output)."""
    return -model.log_prob(ctx, target).mean()


def sampling_loss(model: NeuralLM, ctx: Tensor, target: Tensor, noise: NoiseDistribution, samples: Tensor) -> Tensor:
    """Mean target-sampling loss with a given shared sample (k,) of words."""
    out = _softmax_family(model)
    r = model.encode(ctx)  # (n, E)
    cand = torch.unique(torch.cat([target, samples]))  # (C,) sorted
    pos = torch.searchsorted(cand, target)  # (n,) each target's column
    logits = out.logits_of(r, cand) - noise.log_q_word[cand].to(r.dtype)  # (n, C)
    return F.cross_entropy(logits, pos)


def weaknorm_loss(model: NeuralLM, ctx: Tensor, target: Tensor, rows: Tensor, gamma: float, alpha: float,
                  squared_only: bool) -> Tensor:
    """Mean Weaknorm (``squared_only`` False) or WeaknormSQ loss; ``rows`` (m,) are the
    rows whose normaliser is computed, drawn with probability ``gamma``."""
    out = _softmax_family(model)
    r = model.encode(ctx)  # (n, E)
    loss = -out.score(r, target).mean()
    if rows.numel():
        log_z = torch.logsumexp(out.logits(r[rows]), dim=-1)  # (m,)
        term = alpha * log_z * log_z if squared_only else log_z + alpha * log_z * log_z
        loss = loss + term.sum() / (gamma * target.shape[0])
    return loss


def batch_loss(
    objective: str,
    model: NeuralLM,
    ctx: Tensor,
    target: Tensor,
    noise: NoiseDistribution | None = None,
    k: int = 10,
    generator: torch.Generator | None = None,
    *,
    norm_fraction: float = 0.1,
    norm_weight: float | None = None,
) -> Tensor:
    """The training loss of one batch for ``objective`` (nce and sampling draw their own
    noise, weaknorm(sq) its rows). ``norm_fraction`` is γ, ``norm_weight`` α (None: the
    default of the objective, see DEFAULT_NORM_WEIGHT)."""
    if objective in ("nce", "sampling"):
        if noise is None or generator is None:
            raise ValueError(f"{objective} needs a noise distribution and a generator")
        if objective == "sampling":
            return sampling_loss(model, ctx, target, noise, noise.sample_words(1, k, generator).view(-1))
        noise_classes, noise_words = noise.sample(model, target, k, generator)
        return nce_loss(model, ctx, target, noise, noise_classes, noise_words)
    if objective in ("weaknorm", "weaknormsq"):
        if generator is None:
            raise ValueError(f"{objective} needs a generator")
        u = torch.rand(target.shape[0], generator=generator, device=generator.device)
        rows = (u < norm_fraction).nonzero().squeeze(1).to(target.device)
        alpha = DEFAULT_NORM_WEIGHT[objective] if norm_weight is None else norm_weight
        return weaknorm_loss(model, ctx, target, rows, norm_fraction, alpha, objective == "weaknormsq")
    if objective in ("mle", "softmax"):
        return mle_loss(model, ctx, target)
    raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
