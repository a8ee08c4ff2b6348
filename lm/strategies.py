"""The output strategies ``nlmserve train`` offers, and what training needs to set them up.

``--output`` names what the model predicts with:

    class         class-factored softmax (Goodman 2001), classes as --class-method says
    softmax       the full softmax
    dsoftmax      differentiated softmax (Chen et al. 2016), frequency bands of widths
    huffman       binary tree of Huffman codes of the unigram counts (Mikolov et al. 2013)
    random        random balanced binary tree (the control of Mnih & Hinton 2008)
    balanced, adaptive, adaptive-eps
                  Mnih & Hinton's feature-based trees: a model is first trained on a
                  random tree, then the words' mean predicted context vectors are split
                  recursively by a two-Gaussian mixture (nlmserve.lm.tree_clustering)

``--objective`` names how it is trained: ``nce``, ``mle``, ``softmax`` (the full softmax's
cross-entropy, as before), ``sampling``, ``weaknorm``, ``weaknormsq``
(nlmserve.lm.objectives). Not every pair makes sense; :data:`ALLOWED` lists those that do.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .config import ModelConfig
from .model import NeuralLM
from .outputs.banded import default_bands
from .tree_clustering import cluster_tree, mean_context_vectors
from .trees import TREE_METHODS, Tree, huffman_tree, random_tree, tree_words

if TYPE_CHECKING:
    from .corpus import CorpusIds

log = logging.getLogger(__name__)


class TreeSettings(Protocol):
    """What building a tree reads of the training's settings (``train.TrainConfig`` has
    them; named here so that this module, which ``train`` imports, imports no ``train``)."""

    @property
    def seed(self) -> int: ...
    @property
    def order(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def context(self) -> str: ...
    @property
    def hidden(self) -> int: ...
    @property
    def activation(self) -> str: ...
    @property
    def lr(self) -> float: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def tree_eps(self) -> float: ...
    @property
    def tree_pretrain_steps(self) -> int: ...

OUTPUT_CHOICES = ("class", "softmax", "dsoftmax", *TREE_METHODS)
_SOFTMAX_OBJECTIVES = ("mle", "softmax", "sampling", "weaknorm", "weaknormsq", "nce")
#: output → the objectives it can be trained with.
ALLOWED: dict[str, tuple[str, ...]] = {
    "class": ("nce", "mle"),
    "softmax": _SOFTMAX_OBJECTIVES,
    "dsoftmax": _SOFTMAX_OBJECTIVES,
    **{m: ("mle",) for m in TREE_METHODS},
}
#: Objectives whose gradient touches few output rows per batch (sparse AdaGrad updates).
SPARSE_OUTPUT_OBJECTIVES = ("nce", "sampling")
#: Rows of training data whose contexts give the words' mean context vectors.
FEATURE_ROWS = 400_000


def resolve_output(objective: str, output: str | None) -> str:
    """The output a run uses: as given, else ``softmax`` for the objectives that need a
    softmax (softmax, sampling, weaknorm, weaknormsq), else ``class``. ValueError for a
    pair that cannot be trained."""
    if output is None:
        output = "softmax" if objective in ("softmax", "sampling", "weaknorm", "weaknormsq") else "class"
    if output not in ALLOWED:
        raise ValueError(f"output must be one of {OUTPUT_CHOICES}, got {output!r}")
    if objective not in ALLOWED[output]:
        raise ValueError(f"objective {objective!r} cannot train the {output} output (use one of {ALLOWED[output]})")
    return output


def model_output(output: str) -> str:
    """The ModelConfig output type of a strategy (every tree is ``tree``)."""
    return "tree" if output in TREE_METHODS else output


def output_fields(output: str, vocab_size: int, width: int, tree: Tree | None) -> dict[str, object]:
    """The ModelConfig fields of the output beyond its type."""
    if output == "dsoftmax":
        sizes, dims = default_bands(vocab_size, width)
        return {"band_sizes": sizes, "band_dims": dims}
    if tree is not None:
        return {"tree_nodes": tree.num_nodes, "tree_method": tree.method}
    return {}


def build_tree(cfg: TreeSettings, output: str, train_ids: "CorpusIds", unigram: np.ndarray,
               device: torch.device, deadline: float | None) -> Tree | None:
    """The output tree of a tree strategy (None for the others). The feature-based trees
    first train a random-tree model for ``cfg.tree_pretrain_steps`` steps (or until a
    third of the time to ``deadline``)."""
    V = unigram.shape[0]
    if output == "huffman":
        return huffman_tree(unigram)
    if output == "random":
        return random_tree(V, cfg.seed)
    if output not in ("balanced", "adaptive", "adaptive-eps"):
        return None
    until = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / 3
    features = pretrain_features(cfg, train_ids, unigram, device, until)
    return cluster_tree(features, tree_words(V), output, eps=cfg.tree_eps, seed=cfg.seed)


def pretrain_features(cfg: TreeSettings, train_ids: "CorpusIds", unigram: np.ndarray, device: torch.device,
                      until: float | None) -> np.ndarray:
    """Train a random-tree model briefly, then each word's mean predicted context vector
    over (up to FEATURE_ROWS) training positions → (V, E)."""
    V = unigram.shape[0]
    tree = random_tree(V, cfg.seed)
    mconf = ModelConfig(vocab_size=V, order=cfg.order, dim=cfg.dim, context=cfg.context, hidden=cfg.hidden,
                        activation=cfg.activation, output="tree", tree_nodes=tree.num_nodes, tree_method="random")
    torch.manual_seed(cfg.seed)
    model = NeuralLM(mconf, tree=tree)
    model.init_biases(unigram)
    model.set_sparse_grads(output=True, context=True)
    # as training does (AdaGrad, sparse)
    torch.sparse.check_sparse_tensor_invariants.disable()  # type: ignore[no-untyped-call]
    model.to(device).train()
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg.lr)
    rng = np.random.default_rng([cfg.seed, 17])
    N = train_ids.num_tokens
    step = 0
    for step in range(1, cfg.tree_pretrain_steps + 1):
        pos = np.sort(rng.integers(0, N, size=cfg.batch_size))
        ctx, tgt = train_ids.examples(pos, cfg.order)
        opt.zero_grad(set_to_none=True)
        loss = -model.log_prob(torch.from_numpy(ctx).to(device), torch.from_numpy(tgt).to(device)).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if until is not None and time.monotonic() >= until:
            break
    log.info("random-tree model for the word features: %d steps, last loss %.3f", step, float(loss.detach()))
    model.eval()
    E = mconf.out_dim
    r_sum = torch.zeros(V, E, dtype=torch.float64, device=device)
    count = torch.zeros(V, dtype=torch.float64, device=device)
    positions = np.arange(N) if N <= FEATURE_ROWS else np.sort(rng.choice(N, FEATURE_ROWS, replace=False))
    with torch.inference_mode():
        for start in range(0, positions.size, 8192):
            ctx, tgt = train_ids.examples(positions[start : start + 8192], cfg.order)
            t = torch.from_numpy(tgt).to(device)
            r = model.encode(torch.from_numpy(ctx).to(device)).double()
            r_sum.index_add_(0, t, r)
            count.index_add_(0, t, torch.ones_like(t, dtype=torch.float64))
    feats = mean_context_vectors(r_sum.cpu().numpy(), count.cpu().numpy())
    if not math.isfinite(float(feats.sum())):
        raise FloatingPointError("the random-tree model's context vectors are not finite; lower --lr")
    return feats
