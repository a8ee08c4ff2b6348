"""Training: corpus → ids → classes → minibatch NCE / MLE / softmax → model file.

Minibatches are drawn from a shuffled permutation of all token positions of the
memory-mapped id file (a fresh permutation per epoch, derived from the seed and the epoch
number). Validation perplexity (exact, normalised) is computed every ``valid_every`` steps
and at the end of each epoch; when it does not improve the learning rate is halved, and
after ``patience`` validations without improvement training stops. The best model (lowest
validation perplexity) is what the model file holds.

Checkpoints (``MODEL.ckpt``, written atomically every ``checkpoint_every`` steps) hold the
model, the optimiser, the noise generator's state, the epoch and the position in the
epoch's permutation, the best model so far and the schedule's state, so ``resume=True``
continues exactly where the checkpoint was taken: with ``threads=1`` an interrupted and
resumed run ends at the same parameters as an uninterrupted one.

The data (vocabulary, id files, classes, the epoch's permutation) is ``lm.data``'s, the
optimisers ``lm.optim``'s; this module holds the config, the trainer's loop and :func:`train`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn

import numpy as np
import torch

from ..common.errors import InputError
from .checkpoint import TrainingLog, load_checkpoint, load_optimizer_state, save_checkpoint, write_learning_curve
from .corpus import CorpusIds
from .data import TrainingData, batches, permutation, prepare_data
from .distributed import array_digest, init_distributed, peer_lost
from .fused import FusedNCE, unavailable_reason
from .hogwild import HogwildPool
from .config import ModelConfig
from .model import NeuralLM
from .model_file import save_model
from .objectives import OBJECTIVES, NoiseDistribution, batch_loss
from .optim import make_optimizer, set_lr
from .recipe import AVERAGE_EVERY
from .strategies import SPARSE_OUTPUT_OBJECTIVES, build_tree, model_output, output_fields, resolve_output
from .trees import Tree
from ..common.perplexity import from_ln as perplexity_of
from ..common.progress import progress

log = logging.getLogger(__name__)

#: ``TrainConfig.step``: how a minibatch is trained.
STEPS = ("auto", "torch", "fused")


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``nlmserve train`` takes (CLI flags of the same names).

    Fields:
        train, valid, out: training text, validation text (None: no schedule, no early
            stopping, the last model is kept), model file to write.
        order, dim, context, hidden, activation: the network (see ModelConfig).
        classes: number of word classes (None: ``default_num_classes(V)``).
        class_file: a wcluster ``paths`` file with the classes (overrides class_method).
        class_method: ``frequency`` (Mikolov binning), ``frequency-sqrt`` (binning on square
            roots of counts: narrower rare-word classes, for V of 100k and more) or ``brown``
            (exchange algorithm).
        objective: ``nce`` | ``mle`` (exact class-factored) | ``softmax`` (full softmax
            output and loss, the baseline).
        noise_samples: k for NCE.
        epochs: passes over the training data; max_minutes: wall-time budget (None: none),
            after which training stops cleanly and the best model is written.
        max_steps: stop after this many optimiser steps (None: no limit).
        lowercase, min_count, max_vocab: vocabulary and text handling.
        max_train_lines: use only the first N lines of the training text.
        threads: torch intra-op threads (per process); seed: every random choice derives from it.
        distributed: data-parallel under torchrun (lm/distributed.py). With the torch step
            ``batch_size`` is the global batch, split across the processes, whose gradients
            are averaged every step; with the fused step each process takes a minibatch of
            ``batch_size`` of its own per round (one per Hogwild worker with ``workers``) and
            the processes' parameters are averaged every ``average_every`` steps (local SGD).
        average_every: with ``distributed`` and the fused step, average the processes'
            parameters and AdaGrad accumulators every this many steps (a step is one
            process's minibatch, as with ``workers``).
        dense_grads: dense embedding gradients even with AdaGrad (sparse is the default).
        step: ``auto``: the fused CPU step (``nlmserve.lm.fused``) where it applies (NCE,
            class output, diagonal context, AdaGrad, CPU), the torch step
            elsewhere; ``torch``: the torch step always (the reference); ``fused``: the
            fused step, an error where it does not apply.
        resume: continue from ``out + ".ckpt"`` when it exists.
        batch_size, lr, optimizer (adagrad | adam): the optimiser.
        lr_decay: factor applied to the learning rate on a validation plateau.
        min_improvement: a validation that lowers the perplexity by less than this fraction
            counts as a plateau for the learning rate (the model is still kept, and
            patience is not charged); 0: only no improvement at all does. RNNLM-style
            schedules use a few tenths of a percent.
        lr_schedule: ``plateau``: the rate changes only on validation plateaus. ``linear``:
            besides, every step uses the rate times the fraction of the budget left, so it
            falls linearly to 0 at the end of the run (budget: ``max_minutes`` counted from
            the start of the run, else ``max_steps``, else ``epochs``; the first to run out).
            A resumed run has spent the training time its checkpoint holds.
        patience: validations without improvement before stopping.
        valid_every: validate every N steps (0: at the end of each epoch only).
        checkpoint_every: write ``out.ckpt`` every N steps (0: never).
        checkpoint_share: the most of the wall time checkpoints may take: after one that
            took t seconds, the checkpoint points of the next t / checkpoint_share seconds
            are passed over; the last, where training stops, always writes (a width-768
            model with n-gram features writes 1.2 GB in about 3.5 s, every 30 s at 1,000
            steps); 0: write at every point.
        log_every: append a JSONL record every N steps.
        progress: a tqdm bar when stderr is a terminal, else a log line every 30 s
            (nlmserve.common.progress); learning_curve: write ``out.curve.png``.
        workdir: where id files go (None: ``out + ".work"``).
        ngram_class_table, ngram_word_table: sizes of the hashed direct n-gram feature
            tables for the class and the word scores (0: none; class output only).
        ngram_order: longest n-gram with a direct feature (0: ``order``).
        output: the output strategy (nlmserve.lm.strategies; None: from the objective).
        tree_eps: ε of the adaptive-eps tree; tree_pretrain_steps: steps of the
            random-tree model whose context vectors the feature-based trees split.
        norm_fraction, norm_weight: γ and α of weaknorm / weaknormsq (None: their default).
        dropout: probability of zeroing each unit of the context vector while training
            (inverted dropout; 0: none). A regulariser for several epochs over small data.
        recipe: what ``nlmserve train`` chose for the flags it was not given (nlmserve.lm.recipe;
            "" when it chose nothing); recorded in the model file with the rest.
        workers: processes that train one model together on the CPU, lock-free (Hogwild!,
            lm/hogwild.py): each round takes ``workers`` minibatches of ``batch_size``, one
            per process, and every process applies its own update to the shared parameters.
            With ``distributed`` and the fused step, each rank is such a group of workers
            (a round: ranks × workers minibatches), and the ranks average their copies.
    """

    train: str
    out: str
    valid: str | None = None
    order: int = 5
    dim: int = 128
    context: str = "diagonal"
    hidden: int = 0
    activation: str = "none"
    classes: int | None = None
    class_file: str | None = None
    class_method: str = "frequency"
    objective: str = "nce"
    noise_samples: int = 10
    epochs: int = 10
    max_minutes: float | None = None
    max_steps: int | None = None
    lowercase: bool = False
    min_count: int = 1
    max_vocab: int | None = None
    max_train_lines: int | None = None
    threads: int = 2
    distributed: bool = False
    average_every: int = AVERAGE_EVERY
    dense_grads: bool = False
    step: str = "auto"
    seed: int = 1
    resume: bool = False
    batch_size: int = 512
    lr: float = 0.1
    optimizer: str = "adagrad"
    lr_decay: float = 0.5
    min_improvement: float = 0.0
    lr_schedule: str = "plateau"
    patience: int = 3
    valid_every: int = 0
    checkpoint_every: int = 1000
    checkpoint_share: float = 0.02
    log_every: int = 100
    progress: bool = True
    learning_curve: bool = True
    workdir: str | None = None
    ngram_class_table: int = 0
    ngram_word_table: int = 0
    ngram_order: int = 0
    output: str | None = None
    tree_eps: float = 0.25
    tree_pretrain_steps: int = 2000
    norm_fraction: float = 0.1
    norm_weight: float | None = None
    dropout: float = 0.0
    workers: int = 1
    recipe: str = ""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        resolve_output(self.objective, self.output)
        if not 0 < self.norm_fraction <= 1 or self.tree_pretrain_steps < 1 or not 0 <= self.tree_eps < 0.5:
            raise ValueError("norm_fraction must lie in (0, 1], tree_pretrain_steps >= 1, tree_eps in [0, 0.5)")
        if self.optimizer not in ("adagrad", "adam"):
            raise ValueError(f"optimizer must be adagrad or adam, got {self.optimizer!r}")
        if self.class_method not in ("frequency", "frequency-sqrt", "brown"):
            raise ValueError(f"class_method must be frequency, frequency-sqrt or brown, got {self.class_method!r}")
        if not 0.0 <= self.min_improvement < 1.0:
            raise ValueError(f"min_improvement must lie in [0, 1), got {self.min_improvement}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.average_every < 1:
            raise ValueError(f"average_every must be >= 1, got {self.average_every}")
        if self.step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {self.step!r}")
        if self.lr_schedule not in ("plateau", "linear"):
            raise ValueError(f"lr_schedule must be plateau or linear, got {self.lr_schedule!r}")
        if self.workers > 1 and self.distributed and (self.step == "torch" or self.objective != "nce"
                                                      or self.optimizer != "adagrad" or self.dense_grads):
            raise ValueError("workers > 1 with distributed needs the fused step (NCE, AdaGrad, sparse gradients; "
                             "not step torch): the torch step's processes average their gradients every step")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.batch_size < 1 or self.lr <= 0 or self.noise_samples < 1 or self.epochs < 1:
            raise ValueError("batch_size, lr, noise_samples and epochs must be positive")
        if self.ngram_class_table < 0 or self.ngram_word_table < 0:
            raise ValueError("n-gram feature table sizes must be >= 0")
        if not 0 <= self.ngram_order <= self.order:
            raise ValueError(f"ngram_order must be between 0 (the model's order) and order = {self.order}, "
                             f"got {self.ngram_order}")
        if self.ngram_order and not (self.ngram_class_table or self.ngram_word_table):
            raise ValueError("--ngram-order needs the direct n-gram features (--ngram-features)")
        if (self.ngram_class_table or self.ngram_word_table) and self.resolved_output != "class":
            raise ValueError("direct n-gram features need the class output (objective nce or mle)")

    @property
    def resolved_output(self) -> str:
        return resolve_output(self.objective, self.output)

    @property
    def checkpoint_path(self) -> str:
        return self.out + ".ckpt"

    @property
    def log_path(self) -> str:
        return self.out + ".log.jsonl"

    @property
    def curve_path(self) -> str:
        return self.out + ".curve.png"


@dataclass
class TrainResult:
    """What a run produced: the final network (last step, not necessarily the best),
    the best validation perplexity, steps, tokens and whether it stopped early."""

    model: NeuralLM
    best_valid_ppl: float | None
    steps: int
    tokens: int
    stopped: str
    model_path: str
    rank: int = 0


@dataclass
class _State:
    """The mutable training state that a checkpoint saves."""

    epoch: int = 0
    pos: int = 0  # next index into this epoch's permutation
    step: int = 0
    tokens: int = 0
    lr: float = 0.0
    best_ppl: float = math.inf
    bad_validations: int = 0
    elapsed: float = 0.0
    budget_spent: float = 0.0  # --max-minutes' seconds used, set-up included (at the checkpoint)
    done: bool = False
    stopped: str = ""
    last_valid_step: int = -1


def model_config(cfg: TrainConfig, data: TrainingData, tree: Tree | None = None) -> ModelConfig:
    out = cfg.resolved_output
    width = cfg.hidden if cfg.hidden > 0 else cfg.dim
    return ModelConfig(
        vocab_size=len(data.vocab),
        order=cfg.order,
        dim=cfg.dim,
        context=cfg.context,
        hidden=cfg.hidden,
        activation=cfg.activation,
        output=model_output(out),
        num_classes=data.classes.num_classes if data.classes is not None else 0,
        ngram_class_table=cfg.ngram_class_table,
        ngram_word_table=cfg.ngram_word_table,
        ngram_order=cfg.ngram_order,
        **output_fields(out, len(data.vocab), width, tree),  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------- evaluation


def scoring_spans(model: NeuralLM, corpus: CorpusIds, span: range, budget: int = 1 << 24,
                  max_rows: int = 8192) -> Iterator[range]:
    """Consecutive chunks of ``span`` for exact scoring, each holding at most ``max_rows``
    positions whose targets' class widths sum to at most ``budget`` (one row at least).

    The class-factored normaliser materialises (rows of class c) × |c| scores per class
    present, so that sum bounds the largest score matrix by the rows actually scored;
    ``OutputLayer.scoring_chunk()`` assumes every row is in the largest class, which at V ≥ 100k
    (a 58,333-word rare-word class) made chunks of 287 rows and validation 3.9× slower.
    """
    targets = np.asarray(corpus.ids[span.start : span.stop])
    for a, b in model.output.scoring_bounds(targets, budget, max_rows):
        yield range(span.start + a, span.start + b)


def corpus_log_likelihood(model: NeuralLM, corpus: CorpusIds, order: int, device: torch.device,
                          span: range | None = None, budget: int = 1 << 24) -> tuple[float, int]:
    """Σ ln P over every token of ``corpus`` (``</s>`` included; or the positions of
    ``span``) and the token count; chunks of :func:`scoring_spans`."""
    total = 0.0
    was_training = model.training
    span = span if span is not None else range(corpus.num_tokens)
    model.eval()
    with torch.inference_mode():
        for part in scoring_spans(model, corpus, span, budget):
            pos = np.arange(part.start, part.stop)
            ctx, tgt = corpus.examples(pos, order)
            lp = model.log_prob(torch.from_numpy(ctx).to(device), torch.from_numpy(tgt).to(device))
            total += float(lp.double().sum())
    model.train(was_training)
    return total, len(span)


def perplexity(model: NeuralLM, corpus: CorpusIds, order: int, device: torch.device) -> float:
    ll, n = corpus_log_likelihood(model, corpus, order, device)
    return perplexity_of(ll, n)


# ---------------------------------------------------------------------------- the loop


class _Interrupted(Exception):
    """Raised inside the loop by the test hook that imitates a kill."""


class _Trainer:
    """One training run: set-up (or resume), the step loop, validation, the outputs."""

    def __init__(self, cfg: TrainConfig, interrupt_after_step: int | None) -> None:
        self.cfg = cfg
        self.interrupt_after_step = interrupt_after_step
        self.t_start = time.monotonic()
        self.next_checkpoint = 0.0  # time.monotonic() from which a checkpoint point writes
        torch.set_num_threads(max(1, cfg.threads))
        self.dist = init_distributed(cfg.distributed)
        self.device = self.dist.device
        with self.dist.main_first():  # rank 0 writes the id files, the others reuse them
            self.data = data = prepare_data(cfg)
        deadline = self.t_start + cfg.max_minutes * 60.0 if cfg.max_minutes else None
        self.tree = self.dist.from_main(
            lambda: build_tree(cfg, cfg.resolved_output, data.train, data.unigram, self.device, deadline))
        tree_arrays = None if self.tree is None else np.concatenate(
            [self.tree.code_word.ravel(), self.tree.code_nodes.ravel(), self.tree.code_bits.ravel().astype(np.int32)])
        self.dist.check_same("vocabulary, word classes and tree", data.vocab.sha256() + array_digest(
            data.classes.word_class if data.classes is not None else None) + array_digest(tree_arrays))
        self.mconf = model_config(cfg, data, self.tree)
        self.word_class = data.classes.word_class if data.classes is not None else None
        torch.manual_seed(cfg.seed)
        self.model = NeuralLM(self.mconf, self.word_class, self.tree)
        self.model.init_biases(data.unigram)
        # A batch touches few context rows, and with NCE few output rows: sparse AdaGrad
        # updates only those (MLE and softmax touch most output rows: dense is faster there).
        adagrad = cfg.optimizer == "adagrad" and not cfg.dense_grads and self.dist.sparse_grads_ok
        sparse_out = cfg.objective in SPARSE_OUTPUT_OBJECTIVES or self.mconf.output == "tree"
        # A batch touches few slots of the n-gram tables: sparse too.
        self.model.set_sparse_grads(output=adagrad and sparse_out, context=adagrad, features=adagrad)
        if adagrad:
            torch.sparse.check_sparse_tensor_invariants.disable()  # type: ignore[no-untyped-call]  # opt out explicitly (and quietly)
        self.model.to(self.device).train()
        self.opt = make_optimizer(self.model, cfg.optimizer, cfg.lr, cfg.workers)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(self.dist.rank_seed(cfg.seed))
        self.model.dropout, self.model.dropout_gen = cfg.dropout, self.gen
        self.noise = NoiseDistribution(data.unigram, self.word_class, self.device)
        self.state = _State(lr=cfg.lr)
        self.best: dict[str, torch.Tensor] | None = None
        resumed = cfg.resume and os.path.exists(cfg.checkpoint_path)
        if resumed:
            self._resume()
        set_lr(self.opt, self.state.lr)
        self.step_ran, self.step_reason = "torch", ""
        self.fused = self._fused_step()
        # the torch step averages gradients every step; the fused step trains each process's
        # copy and averages the copies every average_every steps (lm/distributed.py)
        self.averaging = self.fused is not None and self.dist.enabled
        if self.averaging:
            self.dist.start_averaging(self.model, self.opt)
        else:
            self.dist.wrap(self.model)
        self.averaged_at = self.state.step
        self.average_seconds = 0.0  # this invocation's time in averages (the log's end record)
        if cfg.workers > 1 and self.dist.enabled and not self.averaging:
            raise InputError("--workers > 1 with --distributed needs the fused step (NCE, the class output, "
                             f"AdaGrad, the CPU): this run trains by the torch step ({self.step_reason}), whose "
                             "processes average their gradients every step")
        # processes that each take a minibatch of a round: the Hogwild workers of every
        # averaging rank (rank r takes the round's minibatches r*workers .. r*workers+workers-1)
        self.round_parts = (self.dist.world_size if self.averaging else 1) * cfg.workers
        self.log = TrainingLog(cfg.log_path, append=resumed, enabled=self.dist.is_main)
        self.digests: list[str] | None = None
        if not resumed:
            self.log.write(event="start", config=dataclasses.asdict(cfg), model=self.mconf.to_json(),
                           vocab_size=len(data.vocab), train_tokens=data.train.num_tokens, step=0, tokens=0,
                           step_ran=self.step_ran, step_reason=self.step_reason,
                           prepare_s=round(time.monotonic() - self.t_start, 3))
        else:  # the resumed steps may run another step than the first ones did
            self.log.write(event="resume", step=self.state.step, tokens=self.state.tokens,
                           step_ran=self.step_ran, step_reason=self.step_reason)
        self.stopped = self.state.stopped or "epochs"
        self.loss_sum, self.loss_n = 0.0, 0
        if cfg.workers > 1 and self.device.type != "cpu":
            raise InputError("--workers > 1 trains on the CPU cores; on a GPU use one process", str(self.device))
        self.pool: HogwildPool | None = None
        self.taken = 1  # minibatches of the last round

    def _resume(self) -> None:
        cfg = self.cfg
        ck = load_checkpoint(cfg.checkpoint_path)
        if ck["vocab_sha256"] != self.data.vocab.sha256() or ck["model_config"] != self.mconf.to_json():
            raise InputError("checkpoint was made with another vocabulary or model shape", cfg.checkpoint_path)
        self.model.load_state_dict(ck["model"])
        load_optimizer_state(self.model, self.opt, ck)
        self.dist.restore_generator(self.gen, ck, cfg.seed, int(ck["state"]["step"]))
        self.state = _State(**ck["state"])
        self.best = ck["best"]
        if self.state.stopped in ("max steps", "max minutes"):  # a budget, not convergence: go on
            self.state.done, self.state.stopped = False, ""
        # --max-minutes is the run's budget, not this invocation's: the training time the
        # checkpoint holds is spent (the deadline and the linear rate go on from there)
        self.t_start -= self.state.budget_spent or self.state.elapsed  # older checkpoints: the loop's time
        log.info("resumed from %s at step %d (epoch %d, position %d)",
                 cfg.checkpoint_path, self.state.step, self.state.epoch, self.state.pos)

    def _fused_step(self) -> FusedNCE | None:
        """The fused step when ``cfg.step`` asks for it and it applies to this run. Sets
        ``step_ran`` (``fused`` or ``torch``) and ``step_reason`` (why that step), which the
        log's start record and the model file carry."""
        cfg = self.cfg
        if cfg.step == "torch":
            self.step_ran, self.step_reason = "torch", "--step torch"
            return None
        why = unavailable_reason(cfg.objective, self.model, cfg.optimizer, self.device)
        if cfg.dense_grads:
            why = why or "--dense-grads"
        if why is not None:
            if cfg.step == "fused":
                raise InputError(f"--step fused does not apply: {why}")
            self.step_ran, self.step_reason = "torch", f"--step auto and the fused step does not apply: {why}"
            if cfg.objective == "nce" and self.device.type == "cpu":
                log.info("training with the torch step: %s", why)
            return None
        self.step_ran, self.step_reason = "fused", f"--step {cfg.step}" + (" and it applies" if cfg.step == "auto" else "")
        log.info("training with the fused CPU step (nlmserve.lm.fused)")
        return FusedNCE(self.model, self.opt, self.noise)

    def average(self) -> None:
        """With periodic averaging, make the processes' copies one (once per step: a
        validation and a checkpoint at the same step average once)."""
        if self.averaging and self.averaged_at != self.state.step:
            started = time.monotonic()
            self.dist.average()
            self.averaged_at = self.state.step
            self.average_seconds += time.monotonic() - started

    def checkpoint(self) -> None:
        self.average()
        self.state.budget_spent = time.monotonic() - self.t_start
        gens = self.dist.gather_generators(self.gen)  # rank 0 only writes
        if gens is not None:
            started = time.monotonic()
            save_checkpoint(self.cfg.checkpoint_path, self.model, self.opt, self.gen, dataclasses.asdict(self.state),
                            self.best, dataclasses.asdict(self.cfg), self.data.vocab.sha256(),
                            extra={"rank_generators": gens, "world_size": self.dist.world_size})
            took = time.monotonic() - started
            if self.cfg.checkpoint_share > 0:
                self.next_checkpoint = started + took + took / self.cfg.checkpoint_share

    def validate(self) -> None:
        """Validation perplexity; keeps the best model, decays the rate on no improvement."""
        state, cfg = self.state, self.cfg
        if self.data.valid is None:
            return
        self.average()
        valid = self.data.valid  # split across ranks, summed: the same number everywhere
        part = corpus_log_likelihood(self.model, valid, self.mconf.order, self.device,
                                     valid.shard(self.dist.rank, self.dist.world_size))
        ll, n = self.dist.sum(*part)
        ppl = perplexity_of(ll, n)
        if math.isinf(ppl):
            log.warning("step %d: validation perplexity overflows (mean -ln p %.3g): the model diverges; "
                        "the learning rate is lowered (start lower with --lr)", state.step, -ll / n)
        state.last_valid_step = state.step
        improved = ppl < state.best_ppl - 1e-9
        # a plateau for the rate: no gain, or one below the min_improvement bar (that model is kept)
        plateau = not improved or ppl > state.best_ppl * (1.0 - cfg.min_improvement)
        if improved:
            state.best_ppl = ppl
            state.bad_validations = 0
            self.best = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        else:
            state.bad_validations += 1
            if state.bad_validations >= cfg.patience:
                self.stop("early stopping")
        if plateau:
            state.lr *= cfg.lr_decay
            set_lr(self.opt, state.lr)
        self.log.write(step=state.step, tokens=state.tokens, valid_ppl=ppl, lr=state.lr,
                       best_ppl=state.best_ppl, elapsed=round(state.elapsed, 3))
        log.info("step %d: valid ppl %.2f (best %.2f), lr %.4g", state.step, ppl, state.best_ppl, state.lr)

    def stop(self, why: str) -> None:
        self.state.done, self.stopped = True, why

    def update(self, positions: np.ndarray, gen: torch.Generator, lr: float | None = None) -> float:
        """Forward, backward and the optimiser's update for the examples predicting
        ``positions`` (noise and dropout from ``gen``) → the loss. Hogwild helpers run it
        on their own minibatches with their own generator and the round's rate."""
        if lr is not None:
            set_lr(self.opt, lr)
        if self.fused is not None:
            return self.fused_update(positions, gen)
        self.model.dropout_gen = gen
        mine, weight = self.dist.local_batch(positions)  # this process's share (all of it alone)
        ctx_np, tgt_np = self.data.train.examples(np.sort(mine), self.mconf.order)
        ctx = torch.from_numpy(ctx_np).to(self.device)
        tgt = torch.from_numpy(tgt_np).to(self.device)
        self.opt.zero_grad(set_to_none=True)
        loss = self.dist.forward(lambda: batch_loss(
            self.cfg.objective, self.model, ctx, tgt, self.noise, self.cfg.noise_samples, gen,
            norm_fraction=self.cfg.norm_fraction, norm_weight=self.cfg.norm_weight))
        (loss * weight).backward()  # type: ignore[no-untyped-call]
        self.dist.reduce_sparse()
        self.opt.step()
        return float(loss.detach())

    def fused_update(self, positions: np.ndarray, gen: torch.Generator) -> float:
        """:meth:`update` by the fused step: the same examples and arithmetic as the torch
        step; the noise and the dropout mask drawn by the step from one seed drawn from
        ``gen`` (so a checkpoint's generator state still fixes them)."""
        assert self.fused is not None
        ctx, tgt = self.data.train.examples(np.sort(positions), self.mconf.order)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        return self.fused.step(ctx, tgt, None, None, None, self.model.dropout, k=self.cfg.noise_samples, seed=seed)

    def rate(self) -> float:
        """The learning rate of the next step: the plateau-decayed rate, times the fraction
        of the budget left under ``--lr-schedule linear``."""
        cfg, state = self.cfg, self.state
        if cfg.lr_schedule != "linear":
            return state.lr
        done = state.step / (cfg.epochs * math.ceil(self.data.train.num_tokens / cfg.batch_size))
        if cfg.max_steps is not None:
            done = max(done, state.step / cfg.max_steps)
        if cfg.max_minutes:
            done = max(done, (time.monotonic() - self.t_start) / (cfg.max_minutes * 60.0))
        return state.lr * max(0.0, 1.0 - done)

    def step(self, positions: np.ndarray, next_pos: int, elapsed_before: float, t_loop: float) -> None:
        """One round: one optimiser step on the examples predicting ``positions`` (with
        Hogwild helpers, one minibatch of ``batch_size`` per process, at once)."""
        state, bs = self.state, self.cfg.batch_size
        parts = [positions[i : i + bs] for i in range(0, len(positions), bs)]
        lr = self.rate()
        # this process's minibatches of the round: the first is its own, the rest its Hogwild
        # helpers'; an averaging rank has none in a short last round
        first = self.dist.rank * self.cfg.workers if self.averaging else 0
        mine = parts[first : first + self.cfg.workers]
        if self.pool is not None:
            self.pool.submit(mine[1:], lr, state.step)
        losses = [self.update(mine[0], self.gen, lr)] if mine else []
        if self.pool is not None:
            losses += self.pool.collect(max(0, len(mine) - 1))
        self.taken = len(parts)
        state.step += len(parts)
        state.pos = next_pos
        state.tokens += len(positions)
        state.elapsed = elapsed_before + time.monotonic() - t_loop
        for lv in losses:
            if not math.isfinite(lv):
                raise FloatingPointError(f"training loss became {lv} at step {state.step}; lower --lr")
        self.loss_sum += sum(losses)
        self.loss_n += len(losses)

    def _every(self, n: int) -> bool:
        """Whether the last round crossed a multiple of ``n`` steps (a round may take several)."""
        return n > 0 and self.state.step // n > (self.state.step - self.taken) // n

    def after_step(self, bar: Any, deadline: float | None) -> None:
        """Logging, validation, budgets and checkpoints after a step."""
        state, cfg = self.state, self.cfg
        if self._every(cfg.log_every):
            tps = state.tokens / max(state.elapsed, 1e-9)
            loss = self.loss_sum / max(self.loss_n, 1)  # a rank may have had no minibatch since (a short round)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
            self.log.write(step=state.step, tokens=state.tokens, loss=loss, lr=self.rate(),
                           elapsed=round(state.elapsed, 3), tokens_per_s=round(tps, 1))
            self.loss_sum, self.loss_n = 0.0, 0
        bar.update(self.taken)  # after the postfix, so a log line carries this step's loss
        if self._every(cfg.average_every):
            self.average()
        if self._every(cfg.valid_every):
            self.validate()
        if cfg.max_steps is not None and state.step >= cfg.max_steps:
            self.stop("max steps")
        if deadline is not None and self.dist.any(time.monotonic() >= deadline):
            self.stop("max minutes")
        # where training stops, train() writes the last checkpoint; rank 0 writes and times
        # the checkpoints, so its clock decides for every rank
        if self._every(cfg.checkpoint_every) and not state.done and self.dist.any(
                self.dist.is_main and time.monotonic() >= self.next_checkpoint):
            self.checkpoint()
        if self.interrupt_after_step is not None and state.step >= self.interrupt_after_step:
            raise _Interrupted

    def loop(self) -> None:
        """Epochs of shuffled minibatches until a stopping rule fires."""
        state, cfg = self.state, self.cfg
        N = self.data.train.num_tokens
        steps_per_epoch = math.ceil(N / cfg.batch_size)
        elapsed_before, t_loop = state.elapsed, time.monotonic()
        deadline = self.t_start + cfg.max_minutes * 60.0 if cfg.max_minutes else None
        if deadline is not None and self.dist.any(time.monotonic() >= deadline):
            self.stop("max minutes")  # resumed with no time left
        if cfg.workers > 1 and self.pool is None:  # after a resume: the restored tensors are shared
            # each rank's helpers draw their own noise (rank 0's: those of one process)
            self.pool = HogwildPool(self.model, self.opt, self.update, cfg.workers, self.dist.rank_seed(cfg.seed),
                                    max(1, cfg.threads))
        done_steps = state.epoch * steps_per_epoch + math.ceil(state.pos / cfg.batch_size)
        total = steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        with progress(total=total, initial=done_steps, unit="step", desc="train",
                      enabled=cfg.progress and self.dist.is_main, logger=log) as bar:
            while state.epoch < cfg.epochs and not state.done:
                perm = permutation(cfg.seed, state.epoch, N)
                for next_pos, positions in batches(perm, state.pos, cfg.batch_size * self.round_parts):
                    if cfg.max_steps is not None and state.step >= cfg.max_steps:
                        self.stop("max steps")
                        break
                    self.step(positions, next_pos, elapsed_before, t_loop)
                    self.after_step(bar, deadline)
                    if state.done:
                        break
                if not state.done:
                    state.epoch += 1
                    state.pos = 0
                    if not cfg.valid_every:
                        self.validate()

    def finish(self) -> TrainResult:
        """Write the best model (the last one without validation text), the log's last
        record and the learning curve."""
        cfg, state, data = self.cfg, self.state, self.data
        final = self.model
        if self.best is not None:
            final = NeuralLM(self.mconf, self.word_class, self.tree)
            final.load_state_dict(self.best)
        best_ppl = None if math.isinf(state.best_ppl) else state.best_ppl
        # What the model file records is what made the weights, and nothing of the machine
        # or the clock (the wall time is in the log's end record), so that the same training
        # on another machine or in another clone writes the same bytes, hence the same hash.
        training_meta: dict[str, Any] = {
            "train": cfg.train,
            "valid": cfg.valid,
            "objective": cfg.objective,
            "steps": state.step,
            "tokens_seen": state.tokens,
            "epochs_completed": state.epoch,
            "valid_perplexity": best_ppl,
            "stopped": self.stopped,
            "step_ran": self.step_ran,
            "step_reason": self.step_reason,
            "train_config": dataclasses.asdict(cfg),
            "torch": torch.__version__,
        }
        rank = self.dist.rank
        if self.dist.is_main:
            save_model(cfg.out, final, data.vocab, data.classes, objective=cfg.objective, lowercase=cfg.lowercase,
                       training=training_meta, unigram_counts=data.unigram)
        dist: dict[str, Any] = {"world_size": self.dist.world_size, "rank_param_sha256": self.digests} \
            if self.dist.enabled else {}
        if self.averaging:
            dist.update(average_every=cfg.average_every, average_s=round(self.average_seconds, 3))
        self.log.write(event="end", step=state.step, tokens=state.tokens, best_ppl=best_ppl,
                       stopped=self.stopped, elapsed=round(state.elapsed, 3), **dist)
        self.log.close()
        if cfg.learning_curve and self.dist.is_main:
            write_learning_curve(cfg.log_path, cfg.curve_path)
        log.info("stopped (%s) after %d steps, %d tokens; best valid ppl %s; wrote %s",
                 self.stopped, state.step, state.tokens, best_ppl, cfg.out)
        return TrainResult(self.model, best_ppl, state.step, state.tokens, self.stopped, cfg.out, rank)


def train(cfg: TrainConfig, *, _interrupt_after_step: int | None = None) -> TrainResult:
    """Train as ``cfg`` says and write the model file; returns the final state.

    Ctrl-C stops cleanly (``nlmserve train`` maps SIGTERM to it): the best model so far is
    written (no final validation or checkpoint: the last periodic checkpoint stays valid for
    ``resume``). The result's ``stopped`` is then ``"interrupted"``. ``_interrupt_after_step`` (tests) stops dead right
    after that step, as a kill would (no final validation, no model file, no final
    checkpoint).
    """
    trainer = _Trainer(cfg, _interrupt_after_step)

    def lost_or_raise(exc: RuntimeError) -> NoReturn:
        lost = peer_lost(exc, trainer.dist.rank, cfg.checkpoint_path) if trainer.dist.enabled else None
        if lost is None:
            raise exc
        raise lost from exc

    ended = False
    try:
        result = _run(trainer)
        ended = True
    except RuntimeError as exc:
        lost_or_raise(exc)
    finally:
        if trainer.pool is not None:
            trainer.pool.close()
        if not ended:
            trainer.dist.close(together=False)
    # The ranks leave together. A run stopped by torchrun (SIGTERM, as Ctrl-C) because another
    # rank died ends here too, and its barrier then fails: the same one line as above.
    try:
        trainer.dist.close(together=True)
    except RuntimeError as exc:
        lost_or_raise(exc)
    return result


def _run(trainer: _Trainer) -> TrainResult:
    cfg = trainer.cfg
    try:
        trainer.loop()
    except _Interrupted:
        trainer.log.close()
        s = trainer.state
        return TrainResult(trainer.model, None, s.step, s.tokens, "interrupted", cfg.out)
    except KeyboardInterrupt:
        log.warning("interrupted at step %d: writing the best model so far", trainer.state.step)
        trainer.stopped = "interrupted"
        return trainer.finish()
    if trainer.data.valid is not None and trainer.state.last_valid_step != trainer.state.step:
        why = trainer.stopped
        trainer.validate()  # the best model may be this one; the reason to stop stays
        trainer.stopped = why
    trainer.state.done = True
    trainer.state.stopped = trainer.stopped
    if cfg.checkpoint_every:
        trainer.checkpoint()
    if trainer.dist.enabled:  # every rank must hold the same parameters
        trainer.average()
        trainer.digests = trainer.dist.param_digests(trainer.model)
        if len(set(trainer.digests)) != 1:
            log.error("the ranks' parameters differ: %s", trainer.digests)
    return trainer.finish()


__all__ = ["TrainConfig", "TrainResult", "train", "model_config", "perplexity", "load_checkpoint"]
