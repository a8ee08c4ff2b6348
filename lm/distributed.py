"""Data-parallel training under ``torchrun`` (``nlmserve train --distributed``).

``torchrun --nproc-per-node N -m nlmserve train --distributed ...`` starts N copies of the
same training command; each reads torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins one process group: gloo on the
CPU, NCCL on GPUs (rank r uses ``cuda:LOCAL_RANK``).

What is split and what is shared:

* **Batches.** ``--batch-size`` is the *global* batch: every step takes the next
  ``batch_size`` positions of the epoch's seeded permutation (the same on every rank) and
  rank r reads its ``1/N`` share of them from the memory-mapped id file
  (:meth:`Distributed.local_batch`). Each rank's loss is weighted by its share, so the
  averaged gradient is the gradient of the mean loss over the global batch: the same
  update as one process with that batch size, and the same learning-rate behaviour.
* **Gradients.** Dense gradients are averaged by ``DistributedDataParallel``. The sparse
  gradients of AdaGrad training (embedding rows a batch touches, n-gram feature slots) are
  averaged by ``torch.distributed.all_reduce`` on the sparse tensors (gloo); DDP itself
  only handles the sparse gradients of ``nn.Embedding`` modules, not those of parameters
  indexed by ``F.embedding``. NCCL has no sparse all-reduce: on GPUs training uses dense
  gradients (``--dense-grads`` forces them on the CPU too).
* **Decisions.** Validation text is split across ranks and its log-likelihood summed
  (:meth:`Distributed.sum`), so every rank sees the same perplexity and takes the same
  learning-rate and early-stopping decisions; the wall-time budget is agreed each step
  (:meth:`Distributed.any`). Only rank 0 writes the log, the checkpoint, the model file
  and the progress bar.
* **The fused step** (NCE, class output, AdaGrad on the CPU: ``nlmserve.lm.fused``) trains
  by periodic model averaging instead (local SGD): each round gives every rank a minibatch
  of its own (``--batch-size`` per process, as Hogwild workers take theirs; with
  ``--workers W`` each rank is W Hogwild workers on one shared copy, taking W minibatches
  a round), each rank applies its own updates to its own copy with no collective, and every ``--average-every``
  steps (and before every validation, checkpoint and the end) :meth:`Distributed.average`
  makes the copies one: the mean of the parameters and of the AdaGrad accumulators.
* **Progress** in a checkpoint is world-size independent (epoch, position in the epoch's
  permutation, steps, tokens): a run resumes with another number of processes. The NCE
  noise generators of all ranks are saved; a rank that has none in the checkpoint (more
  ranks than before) is seeded from (seed, rank, step).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from ..common.errors import InputError, NlmserveError
from .model import NeuralLM

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a collective may wait: the other ranks wait at a barrier while rank 0 counts and
# encodes the corpus (about 0.7M tokens/s on one core here: ~25 minutes for 1 billion tokens),
# longer than NCCL's default of 10 minutes. torchrun stops every rank when one fails.
SETUP_TIMEOUT = datetime.timedelta(hours=3)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class _Call(nn.Module):
    """What DDP wraps: the parameters whose gradients it averages (``params``); its
    forward runs the loss closure it is given, so the model's own methods compute the
    loss (DDP only needs its forward to be called before each backward)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)

    def forward(self, fn: Callable[[], Tensor]) -> Tensor:
        return fn()


@dataclass
class Distributed:
    """The process group seen from one rank (world_size 1 and no group: one process)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    backend: str = ""
    ddp: nn.Module | None = None
    sparse_params: list[Tensor] = field(default_factory=list)
    averaged: list[Tensor] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or bool(self.backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sparse_grads_ok(self) -> bool:
        """Whether sparse gradients can be averaged (not with NCCL)."""
        return self.backend != "nccl"

    # ------------------------------------------------------------------ set-up
    def rank_seed(self, seed: int, step: int = 0) -> int:
        """Rank 0 keeps ``seed`` (one process and rank 0 draw the same noise); the others
        derive theirs from (seed, rank, step)."""
        if self.rank == 0 and step == 0:
            return seed
        return int(np.random.SeedSequence([seed, self.rank, step]).generate_state(1)[0])

    def from_main(self, make: Callable[[], T]) -> T:
        """``make()`` run on rank 0 only, its result sent to every rank (a tree fitted with a
        time budget may differ between runs: one rank fits it for all)."""
        if not self.enabled:
            return make()
        box: list[Any] = [make() if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (it writes the id files), then the others (they reuse them)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def check_same(self, what: str, value: str) -> None:
        """Raise when ``value`` differs between ranks (e.g. vocabulary hashes)."""
        if not self.enabled:
            return
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        if len(set(values)) != 1:
            raise InputError(f"the ranks disagree on the {what}: {values}")

    def wrap(self, model: NeuralLM) -> None:
        """Average gradients from now on: DDP for the dense ones, sparse all-reduce for
        parameters trained with sparse gradients (``NeuralLM.sparse_parameters``)."""
        if not self.enabled:
            return
        sparse_ids = {id(p) for p in model.sparse_parameters()}
        self.sparse_params = [p for p in model.parameters() if id(p) in sparse_ids]
        dense = [p for p in model.parameters() if id(p) not in sparse_ids and p.requires_grad]
        for p in self.sparse_params:  # DDP broadcasts the dense ones
            torch.distributed.broadcast(p.data, 0)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(_Call(dense), device_ids=ids)

    def start_averaging(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Periodic model averaging (the fused step's way, module docstring): every rank
        takes rank 0's parameters and AdaGrad accumulators (``opt.state[p]["sum"]``), and
        :meth:`average` makes the ranks' copies one again from then on."""
        if not self.enabled:
            return
        params = list(model.parameters())
        self.averaged = [p.data for p in params]
        self.averaged += [opt.state[p]["sum"] for p in params if "sum" in opt.state.get(p, {})]
        for t in self.averaged:
            torch.distributed.broadcast(t, 0)

    def average(self) -> None:
        """Make every rank's copy the same, the mean of the ranks' parameters and AdaGrad
        accumulators, in place (the fused step's views of them stay valid). Every rank calls
        it at the same step.

        Chosen by measurement (docs/training-scale.md, "Several processes on CPU hosts"): adding
        every rank's change since the last average instead (Hogwild's rule, N steps stale)
        matched one process's perplexity when averaging every 8 steps but diverged from 128,
        where averaging becomes cheap enough to pay; the accumulators' sum of every rank's
        increments (the sums one process would hold) ended further from one process than
        their mean, which keeps each rank's rates as high as its own tokens make them."""
        n = self.world_size
        for t in self.averaged:
            torch.distributed.all_reduce(t)
            t.div_(n)

    # ------------------------------------------------------------------ each step
    def local_batch(self, positions: np.ndarray) -> tuple[np.ndarray, float]:
        """This rank's share of a global batch and the weight of its mean loss.

        Shares differ in size by at most one; the weight ``n_local · N / n_global`` makes
        the average over ranks of the weighted means the mean over the global batch. A
        rank whose share is empty (a last batch smaller than the world) computes the loss
        of one position with weight 0, so that every rank takes part in the reduction.
        """
        if not self.enabled:
            return positions, 1.0
        share = np.array_split(positions, self.world_size)[self.rank]
        if share.size == 0:
            return positions[:1], 0.0
        return share, share.size * self.world_size / positions.size

    def forward(self, loss_fn: Callable[[], Tensor]) -> Tensor:
        """The loss of ``loss_fn`` computed so that its backward averages the gradients."""
        if self.ddp is None:
            return loss_fn()
        return self.ddp(loss_fn)  # type: ignore[no-any-return]

    def reduce_sparse(self) -> None:
        """Average the sparse gradients (after backward, before the optimiser's step)."""
        for p in self.sparse_params:
            g = p.grad
            if g is None:  # no rows touched here: an empty sparse gradient still takes part
                g = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=p.device),
                                            torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device), p.shape)
            torch.distributed.all_reduce(g)
            p.grad = g / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def sum(self, *values: float) -> list[float]:
        """Sums over ranks (float64), identical on every rank."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return [float(x) for x in t.tolist()]

    # ------------------------------------------------------------------ checkpoints and the end
    def gather_generators(self, gen: torch.Generator) -> list[Tensor] | None:
        """Every rank's noise-generator state, on rank 0 (None elsewhere)."""
        state = gen.get_state()
        if not self.enabled:
            return [state]
        out: list[Any] = [None] * self.world_size if self.is_main else []
        torch.distributed.gather_object(state, out if self.is_main else None, dst=0)
        return out if self.is_main else None

    def restore_generator(self, gen: torch.Generator, ck: dict[str, Any], seed: int, step: int) -> None:
        saved = ck.get("rank_generators") or [ck["generator"]]
        if self.rank < len(saved):
            gen.set_state(saved[self.rank])
        else:
            gen.manual_seed(self.rank_seed(seed, step))
            log.info("rank %d: no noise generator in the checkpoint, seeded afresh", self.rank)

    def param_digests(self, model: nn.Module) -> list[str]:
        """The SHA-256 of every rank's parameters (all ranks must hold the same)."""
        mine = state_digest(model.state_dict())
        if not self.enabled:
            return [mine]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, mine)
        return [str(x) for x in out]

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def close(self, *, together: bool = True) -> None:
        """Leave the process group. ``together`` (a run that ended normally): every rank
        first waits for the others at a barrier, so that no rank tears down its side of
        the group (gloo's connections, DDP's reducer) while another still writes or
        gathers; a rank leaving early could abort at exit. After an error the rank leaves
        at once (the others fail on their next collective)."""
        if not (self.enabled and torch.distributed.is_initialized()):
            return
        if together:
            torch.distributed.barrier()
        self.ddp = None  # DDP's reducer goes before the group it uses
        torch.distributed.destroy_process_group()


def state_digest(state: dict[str, Tensor]) -> str:
    """SHA-256 of the tensors of a state dict, in name order (bit-exact comparison)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def array_digest(a: np.ndarray | None) -> str:
    """SHA-256 of an array's bytes ("" for None)."""
    return "" if a is None else hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def peer_lost(exc: BaseException, rank: int, checkpoint: str) -> NlmserveError | None:
    """The one-line error for a collective that failed because another process of the run
    is gone (killed, out of memory, its host lost), or None when ``exc`` is something else.
    torchrun then stops every rank and names the one that failed first."""
    text = str(exc)
    if not (isinstance(exc, getattr(torch.distributed, "DistError", ())) or "gloo" in text or "NCCL" in text):
        return None
    detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "] " in detail:  # gloo prefixes the source file and line, and adds advice after a full stop
        detail = detail.split("] ", 1)[1]
    detail = detail.split(". ", 1)[0].rstrip(".")
    then = (f"{checkpoint} holds the last checkpoint: run the same command with --resume"
            if os.path.exists(checkpoint) else "no checkpoint was written yet: run the same command again")
    return NlmserveError(f"rank {rank}: another process of this run stopped, so training cannot go on ({detail}); "
                         f"torchrun names it below; {then}")


def init_distributed(enabled: bool) -> Distributed:
    """Join torchrun's process group (``enabled``), or describe the single process."""
    if not enabled:
        return Distributed()
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise InputError(
            "--distributed needs the environment torchrun sets (missing: " + ", ".join(missing)
            + "); start it as: torchrun --nproc-per-node N -m nlmserve train --distributed ...")
    rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    torch.distributed.init_process_group(backend, rank=rank, world_size=world, timeout=SETUP_TIMEOUT)
    if rank != 0:  # the log is rank 0's; the others say only what goes wrong
        logging.getLogger("nlmserve").setLevel(logging.WARNING)
    log.info("rank %d of %d (%s, %s)", rank, world, backend, device)
    return Distributed(rank=rank, world_size=world, device=device, backend=backend)


__all__ = ["Distributed", "init_distributed", "peer_lost", "state_digest", "array_digest", "TORCHRUN_VARS"]
