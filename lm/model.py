"""The neural n-gram language model: a log-bilinear context and one output layer.

Context (Mnih & Hinton 2007; OxLM, Baltescu & Blunsom 2015)::

    r = act( W_h · Σ_j C_j ⊙ q(w_j) + b_h )       # hidden layer optional (hidden=0: none)

with ``q`` the context word embeddings (V, D) and ``C_j`` one weight per context position,
a vector (``context="diagonal"``, the log-bilinear default) or a D×D matrix (``"full"``).

The output layer turns r into scores: class-factored (``output="class"``), a full softmax,
the differentiated softmax (``"dsoftmax"``) or a binary tree, one class and module each in
:mod:`nlmserve.lm.outputs` (``NeuralLM.output``), which gets r and, beside it, the context
ids (the direct n-gram features read them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .config import ModelConfig
from .outputs.banded import BandedOutput
from .outputs.base import OutputLayer, checks_no_word
from .outputs.class_factored import ClassOutput
from .outputs.softmax import SoftmaxOutput
from .outputs.tree import TreeOutput
from ..wire.ngrams import no_word_id
from .trees import Tree



def activate(r: Tensor, activation: str) -> Tensor:
    """The context vector's nonlinearity (``ModelConfig.activation``: tanh, relu or
    none), the one every encoder applies (the network, the CPU inference tables, the
    scoring tables' reference)."""
    if activation == "tanh":
        return torch.tanh(r)
    if activation == "relu":
        return torch.relu(r)
    return r


def make_output(config: ModelConfig, word_class: np.ndarray | None = None, tree: Tree | None = None) -> OutputLayer:
    """The output layer of ``config`` (``word_class`` (V,) for the class output, ``tree`` for the tree)."""
    V, E = config.vocab_size, config.out_dim
    if config.output == "class":
        if word_class is None:
            raise ValueError("the class output needs word_class")
        return ClassOutput(V, E, config.num_classes, word_class, ngram_class_table=config.ngram_class_table,
                           ngram_word_table=config.ngram_word_table, feature_order=config.feature_order)
    if config.output == "softmax":
        return SoftmaxOutput(V, E)
    if config.output == "dsoftmax":
        return BandedOutput(config.band_sizes, config.band_dims)
    if tree is None or tree.num_nodes != config.tree_nodes:
        raise ValueError(f"the tree output needs a tree of {config.tree_nodes} internal nodes")
    return TreeOutput(tree, V, E)


class NeuralLM(nn.Module):
    """The network: the context encoder and ``output`` (``nlmserve.lm.outputs``).
    ``word_class`` (V,) is required for the class output, ``tree`` for the tree output.

    The state dict keeps the output layer's parameters under their names in model files
    (``OutputLayer.legacy_prefix``), so every model file loads."""

    def __init__(self, config: ModelConfig, word_class: np.ndarray | None = None, tree: Tree | None = None) -> None:
        super().__init__()
        self.config = config
        V, D, n1 = config.vocab_size, config.dim, config.order - 1
        self.embed = nn.Embedding(V, D)  # q(w): context word vectors
        if config.context == "diagonal":
            self.ctx_weight = nn.Parameter(torch.empty(n1, D))  # C_j as vectors
        else:
            self.ctx_weight = nn.Parameter(torch.empty(n1, D, D))  # C_j as matrices (out, in)
        self.hidden = nn.Linear(D, config.hidden) if config.hidden > 0 else None
        self.output = make_output(config, word_class, tree)
        # Dropout on the context vector while training (0: none); masks drawn from
        # ``dropout_gen`` (the trainer's generator, so a resumed run draws the same masks).
        self.dropout = 0.0
        self.dropout_gen: torch.Generator | None = None
        self.register_state_dict_post_hook(_file_names)
        self.register_load_state_dict_pre_hook(_module_names)
        self.reset_parameters()

    # ------------------------------------------------------------------ set-up
    def reset_parameters(self, std: float = 0.1) -> None:
        """Gaussian embeddings; context weights near 1/(n-1) (identity for ``full``)."""
        nn.init.normal_(self.embed.weight, std=std)
        self.output.reset_parameters(std, context=lambda: self._reset_context(std))

    def _reset_context(self, std: float) -> None:
        n1 = self.config.order - 1
        with torch.no_grad():
            if self.config.context == "diagonal":
                self.ctx_weight.normal_(1.0 / n1, std)
            else:
                eye = torch.eye(self.config.dim).expand(n1, -1, -1)
                self.ctx_weight.copy_(eye / n1 + torch.randn_like(self.ctx_weight) * std / self.config.dim**0.5)

    def init_biases(self, unigram_counts: np.ndarray) -> None:
        """The output biases from add-one log unigram frequencies (``<s>`` gets no mass)."""
        self.output.init_biases(unigram_counts)

    def set_sparse_grads(self, output: bool, context: bool | None = None, features: bool | None = None) -> None:
        """Sparse gradients (AdaGrad only) for the output embeddings, the context embeddings
        (``context`` None: as ``output``) and the direct n-gram feature tables (None: unchanged)."""
        self.output.sparse = output
        self.embed.sparse = output if context is None else context
        if features is not None and isinstance(self.output, ClassOutput):
            self.output.feature_sparse = features

    def sparse_parameters(self) -> list[Tensor]:
        """The parameters whose gradients are sparse with the current switches."""
        return ([self.embed.weight] if self.embed.sparse else []) + self.output.sparse_parameters()

    def file_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in model files, parameter) in ``parameters()`` order."""
        head, legacy = "output.", self.output.legacy_prefix
        return [(legacy + n[len(head):] if n.startswith(head) else n, p) for n, p in self.named_parameters()]

    # ------------------------------------------------------------------ context
    def encode(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) word ids, oldest first → r (N, E): ``finish(context_sum(ctx))``.
        The id vocab_size (a word that is not known, ``nlmserve.wire.ngrams``) adds nothing;
        training data never has it."""
        return self.finish(self.context_sum(ctx))

    def context_sum(self, ctx: Tensor) -> Tensor:
        """Σ_j C_j q(w_j) → (N, D): the context words' vectors through their positions'
        weights (``diagonal``: C_j ⊙ q(w_j)). Inference computes the diagonal sum from
        per-position tables instead (``nlmserve.lm.scoring.position_sum``), the same sum."""
        no_word = no_word_id(self.embed.num_embeddings)
        if checks_no_word(ctx, self.training) and bool((ctx >= no_word).any()):
            known = ctx < no_word
            q: Tensor = self.embed(ctx.masked_fill(~known, 0)) * known.unsqueeze(-1)
        else:
            q = self.embed(ctx)  # (N, n-1, D)
        if self.config.context == "diagonal":
            return (q * self.ctx_weight).sum(dim=1)  # (N, n-1, D) * (n-1, D) → sum over j → (N, D)
        return torch.einsum("njd,jed->ne", q, self.ctx_weight)  # Σ_j C_j q_j → (N, D)

    def finish(self, s: Tensor) -> Tensor:
        """The context sum (N, D) → r (N, E): the hidden layer if any, the activation, and
        while training the dropout mask."""
        r = s if self.hidden is None else self.hidden(s)  # (N, H)
        r = activate(r, self.config.activation)
        if self.training and self.dropout > 0.0:
            keep = torch.rand(r.shape, generator=self.dropout_gen, device=r.device) >= self.dropout
            r = r * keep / (1.0 - self.dropout)
        return r

    # ------------------------------------------------------------------ probabilities
    def log_prob(self, ctx: Tensor, target: Tensor, *, normalized: bool = True) -> Tensor:
        """log P(target | ctx) in natural log → (N,). Unnormalised: the output's score."""
        return self.output.log_prob(self.encode(ctx), target, ctx, normalized=normalized)

    def full_log_probs(self, ctx: Tensor) -> Tensor:
        """The whole distribution log P(· | ctx) → (N, V) (``<s>`` at -inf). For tests and
        small vocabularies."""
        return self.output.full_log_probs(self.encode(ctx), ctx)


def _file_names(module: NeuralLM, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: ``output.X`` → its name in model files (legacy_prefix + X), in
    the order model files list them: the class and softmax layers' parameters were the
    network's own (after its context weights, before the children's), the others a last child."""
    head, legacy = prefix + "output.", prefix + module.output.legacy_prefix
    own_names = {prefix + n for n, _ in module.named_parameters(recurse=False)}
    items = list(state.items())
    others = [(k, v) for k, v in items if not k.startswith(prefix)]
    mine = [(k, v) for k, v in items if k.startswith(prefix)]
    own = [(k, v) for k, v in mine if k in own_names]
    outs = [(legacy + k[len(head):], v) for k, v in mine if k.startswith(head)]
    kids = [(k, v) for k, v in mine if k not in own_names and not k.startswith(head)]
    state.clear()
    state.update(others + own + (outs + kids if not module.output.legacy_prefix else kids + outs))


def _module_names(module: NeuralLM, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: the names in model files → ``output.X`` (every key of this
    network that is not ``output.…`` and belongs to none of its own parameters and children)."""
    legacy = module.output.legacy_prefix
    own = {n for n, _ in module.named_parameters(recurse=False)}
    own |= {n for n, m in module.named_children() if m is not module.output}
    for k in list(state):
        name = k[len(prefix):]
        if k.startswith(prefix) and name.startswith(legacy) and name.split(".")[0] not in own | {"output"}:
            state[prefix + "output." + name[len(legacy):]] = state.pop(k)
