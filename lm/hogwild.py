"""Lock-free parallel training on the CPU cores of one machine (Hogwild!, Recht et al. 2011).

The model's parameters and the optimiser's accumulators live in shared memory; ``workers``
processes (the trainer and ``workers - 1`` forked helpers) each take their own minibatch of
a round, compute its loss and gradient, and apply their update to the shared tensors
without locks. A batch touches few rows of the embedding and n-gram tables, so updates
seldom collide (the premise of Hogwild!), and the rows they do share (frequent words,
the dense context weights and biases) receive every update, in some order.

Why processes and not threads: the fused step (``nlmserve.lm.fused``, the default's) is one
single-threaded loop per minibatch, and the torch step is many small operations that a
second torch thread does not make faster (experiments/results.md, "Training": 1 thread 50.5k
tokens/s, 2 threads 47.2k). Two independent steps at once do use two cores; each process
runs either step on the shared tensors. Unlike ``--distributed`` there is no all-reduce and no replicated
optimiser update: each update is applied once, by the process that computed it.

The trainer process keeps everything else (validation, schedule, checkpoints, logging):
between rounds the helpers wait, so a checkpoint or a validation sees a still model. The
order in which concurrent updates land is not fixed, so two runs with the same seed agree
only statistically, and a resumed run continues from the checkpoint but not bit for bit.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import signal
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing as mp

log = logging.getLogger(__name__)

#: step_fn(positions, generator, lr) → loss of that minibatch (after its update).
StepFn = Callable[[np.ndarray, torch.Generator, float], float]


def share_training_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Move the parameters, buffers and optimiser state tensors into shared memory (in place:
    the optimiser's references stay valid)."""
    model.share_memory()
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.share_memory_()  # type: ignore[no-untyped-call]


def worker_seed(seed: int, worker: int, step: int) -> int:
    """The noise/dropout seed of helper ``worker`` for the round starting at ``step``."""
    return int(np.random.SeedSequence([seed, worker, step]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _serve(conn: mpc.Connection, step_fn: StepFn, worker: int, seed: int, threads: int) -> None:
    # Ctrl-C and SIGTERM reach the whole process group: the trainer handles them and stops
    # its helpers (a helper whose trainer died sees the pipe close)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    gen = torch.Generator()
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if msg is None:
            return
        positions, lr, step = msg
        gen.manual_seed(worker_seed(seed, worker, step))
        try:
            conn.send(("ok", step_fn(positions, gen, lr)))
        except Exception as e:  # reported to the trainer, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class HogwildPool:
    """``workers - 1`` forked helper processes that each run ``step_fn`` on a minibatch per
    round. Create it after the model and optimiser exist (and after a resume): it shares
    their tensors, then forks."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, step_fn: StepFn, workers: int,
                 seed: int, threads: int) -> None:
        if workers < 2:
            raise ValueError("a Hogwild pool needs at least 2 workers")
        share_training_state(model, opt)
        ctx = mp.get_context("fork")  # the helpers inherit the shared tensors and the data
        self.conns: list[mpc.Connection] = []
        self.procs: list[Any] = []
        for w in range(1, workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, step_fn, w, seed, threads), daemon=True,
                            name=f"nlmserve-hogwild-{w}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        log.info("Hogwild training: %d processes share the parameters", workers)

    @property
    def helpers(self) -> int:
        return len(self.conns)

    def submit(self, batches: list[np.ndarray], lr: float, step: int) -> None:
        """Start one minibatch on each helper (``len(batches) <= helpers``)."""
        for conn, positions in zip(self.conns, batches):
            conn.send((positions, lr, step))

    def collect(self, n: int) -> list[float]:
        """The losses of the last ``n`` submitted minibatches; a helper's error is raised here."""
        losses = []
        for conn, p in zip(self.conns[:n], self.procs[:n]):
            try:
                status, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"Hogwild helper {p.name} died (exit code {p.exitcode})") from None
            if status != "ok":
                raise RuntimeError(f"Hogwild helper {p.name} failed: {value}")
            losses.append(float(value))
        return losses

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []
