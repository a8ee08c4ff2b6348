"""The optimisers of training: AdaGrad with a fast update of the hashed n-gram feature
tables (:class:`HashedAdagrad`), AdaGrad for lock-free processes (:class:`HogwildAdagrad`,
``--workers``), and the choice between them, torch's AdaGrad and Adam."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from .model import NeuralLM
from .outputs.class_factored import ClassOutput


def _gradients(opt: torch.optim.Optimizer,
               groups: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """(group, parameter, gradient, state) of every parameter of ``groups`` that has a
    gradient, its AdaGrad step count advanced."""
    for group in groups:
        for p in group["params"]:
            if p.grad is not None:
                state = opt.state[p]
                state["step"] += 1
                yield group, p, p.grad, state


class HashedAdagrad(torch.optim.Adagrad):
    """AdaGrad whose param groups marked ``hashed`` (the n-gram feature tables, sparse
    gradients with many repeated slots) are updated by one unique + index_add per table:
    the same update as ``torch.optim.Adagrad`` (lr_decay 0) on the coalesced gradient,
    several times faster than its generic sparse path for these tables. The state layout
    (``sum``, ``step``) is Adagrad's, so checkpoints resume either way."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        hashed = [group for group in self.param_groups if group.get("hashed")]
        for group, p, g, state in _gradients(self, hashed):
            if g.is_sparse:
                idx, val = g._indices()[0], g._values().reshape(-1)
            else:  # dense gradient: the slots it touches
                flat = g.reshape(-1)
                idx = torch.nonzero(flat).squeeze(1)
                val = flat[idx]
            slots, inverse = torch.unique(idx, return_inverse=True)
            gsum = torch.zeros(slots.numel(), dtype=val.dtype, device=val.device).index_add_(0, inverse, val)
            acc = state["sum"].view(-1)
            acc.index_add_(0, slots, gsum * gsum)
            upd = gsum / (acc[slots].sqrt() + group["eps"])
            p.view(-1).index_add_(0, slots, upd, alpha=-group["lr"])
            p.grad = None  # done: the generic step below skips it
        return super().step(closure)


class HogwildAdagrad(torch.optim.Adagrad):
    """AdaGrad for lock-free training by several processes (``--workers``, lm/hogwild.py).

    The update of every parameter is ``g / sqrt(max(sum, g²))``, where ``sum`` is the shared
    accumulator after this process added ``g²``. In one process ``sum >= g²`` always, so this is
    AdaGrad's own update; under Hogwild another process's read-modify-write of the same
    accumulator element can lose this process's ``g²`` (both read, both write), and with a
    young accumulator the plain update ``g / sqrt(sum)`` is then unbounded: a frequent word's
    row or a context weight takes a step of hundreds of times the rate, and training
    diverges within the first hundred steps. With the guard no element ever moves by more
    than the rate in one update. Sparse gradients (embedding rows, the hashed n-gram tables)
    touch only their rows; the state layout (``sum``, ``step``) is Adagrad's, so checkpoints
    resume with either class."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        for group, p, g, state in _gradients(self, self.param_groups):
            lr, eps = group["lr"], group["eps"]
            acc = state["sum"]
            if g.is_sparse:
                g = g.coalesce()
                idx, val = g._indices()[0], g._values()  # (n,), (n, ...) one row each
                sq = val * val
                acc.index_add_(0, idx, sq)
                den = torch.maximum(acc[idx], sq).sqrt_().add_(eps)
                p.index_add_(0, idx, val / den, alpha=-lr)
            else:
                sq = g * g
                acc.add_(sq)
                den = torch.maximum(acc, sq).sqrt_().add_(eps)
                p.addcdiv_(g, den, value=-lr)
        return None


def make_optimizer(model: NeuralLM, optimizer: str, lr: float, workers: int = 1) -> torch.optim.Optimizer:
    """``optimizer`` (``"adagrad"`` or ``"adam"``) over ``model``'s parameters at rate ``lr``:
    HogwildAdagrad for ``workers`` > 1 processes, HashedAdagrad with the feature tables."""
    if optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if workers > 1:  # lock-free processes: an update bounded by the rate (see HogwildAdagrad)
        return HogwildAdagrad(model.parameters(), lr=lr)
    tables = model.output.feature_tables() if isinstance(model.output, ClassOutput) else []
    if not tables:
        return torch.optim.Adagrad(model.parameters(), lr=lr)
    ids = {id(p) for p in tables}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups: list[dict[str, Any]] = [{"params": rest}, {"params": tables, "hashed": True}]
    return HashedAdagrad(groups, lr=lr)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every param group of ``opt`` (the schedule halves it)."""
    for group in opt.param_groups:
        group["lr"] = lr
