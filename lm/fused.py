"""The fused CPU training step of class-factored NCE: forward, backward and AdaGrad in one
pass over a minibatch, in place on the model's torch parameters and the optimiser's state.

What it computes is :func:`nlmserve.lm.objectives.nce_loss` followed by ``backward()`` and
the AdaGrad step of ``nlmserve.lm.train`` (the torch step, which stays the reference this
one is tested against, and the path for every other objective, output and a GPU; under
``--distributed`` the processes average their copies every few steps, lm/distributed.py). Per example (word2vec's and OxLM's loop, ``src/lbl/factored_weights.cc``)::

    h = Σ_j C_j ⊙ Q[w_j]            r = drop(act(h))                 (E,)
    for x in (w, noise words):  s = R_x · r + b_x + Σ_l F_w[slot(l, x)]
                                g = (σ(s - log k q(x|c)) - [x = w]) / B
                                dr += g R_x;  ∇R_x += g r;  ∇b_x += g;  ∇F_w[slot] += g
    the same for (c, noise classes) with S, b_c, F_c and q(c)
    dh = dr ⊙ drop' ⊙ act'(h);  ∇Q[w_j] += C_j ⊙ dh;  ∇C_j += Q[w_j] ⊙ dh

then, for every row the minibatch touched (and no other), AdaGrad:
``a += g²; p -= lr g / (sqrt(max(a, g²)) + eps)``. The ``max`` is the Hogwild guard of
``optim.HogwildAdagrad`` (a no-op in one process, where ``a >= g²``), so the same step serves
``--workers`` processes sharing the parameters. Gradients are summed per touched row in
buffers found through a row → buffer map (reset after the update), never sorted: the
torch step's sparse gradients are coalesced (sorted) before every update.

Why numba: the step is a few dozen lines of loops over rows, which numba compiles to
vectorised machine code at first use (cached on disk afterwards), from a pip wheel with no
compiler on the user's machine and no build step in ``pip install``; without it (not
installed, or ``NLMSERVE_FUSED=0``) training takes the torch step, slower but the same
arithmetic.

The kernel's contract: it takes a few named structures, not a list of arrays. ``Params``
holds the parameters, ``Sums`` their AdaGrad accumulators under the same field names (a
parameter is updated with the accumulator of its own name, never one next to it in a
list); ``Batch`` the minibatch's ids, ``Fixed`` the masks and noise log-probabilities,
``Buffers`` the gradient buffers, ``Settings`` the scalars. It indexes tables by ids with
no bounds check (numba checks none): :meth:`FusedNCE.step` checks the minibatch's ids
once, before the kernel runs (context and target words and given noise words in
[0, V), given noise classes in [0, K); ValueError naming the array and the id), and
``FusedNCE`` the tables the step draws its own noise from when it is made. The n-gram
feature slots are hashes reduced modulo their table's size, in range for ids in range.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, NamedTuple, TypeVar, cast

import numpy as np
import torch
from torch import Tensor

from .model import NeuralLM
from .objectives import NoiseDistribution
from .outputs.class_factored import HASH_CTX, HASH_KEY, HASH_MOD, HASH_OUT, HASH_SEED, ClassOutput

log = logging.getLogger(__name__)

numba: Any
try:  # numba is a dependency; a broken or missing install falls back to the torch step
    import numba
    from numba import njit
except ImportError:  # pragma: no cover
    numba = None

#: Activations by code (the kernel's ``act``).
ACTIVATION_CODES = {"none": 0, "relu": 1, "tanh": 2}


def unavailable_reason(objective: str, model: NeuralLM, optimizer: str, device: torch.device) -> str | None:
    """Why the fused step cannot train this run (None: it can)."""
    cfg = model.config
    if os.environ.get("NLMSERVE_FUSED", "1") == "0":
        return "NLMSERVE_FUSED=0"
    if numba is None:
        return "numba is not installed"
    if objective != "nce":
        return f"objective {objective} (the fused step is NCE's)"
    if not isinstance(model.output, ClassOutput):
        return f"output {cfg.output} (the fused step is the class-factored output's)"
    if cfg.context != "diagonal" or cfg.hidden:
        return "a full-matrix context or a hidden layer"
    if optimizer != "adagrad":
        return f"optimizer {optimizer}"
    if device.type != "cpu":
        return f"device {device.type}"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "parameters that are not float32"
    return None


def _np(t: Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (written in place)."""
    return t.detach().numpy()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- the kernel's arguments
# NamedTuples of arrays, which numba takes as they are. The feature tables are flat, a
# one-element placeholder where the model has none.


class Params(NamedTuple):
    """The trained parameters: float32 views of the model's tensors, written in place."""
    Q: np.ndarray   # (V, D) context word embeddings         model.embed.weight
    C: np.ndarray   # (n-1, D) context position weights      model.ctx_weight
    R: np.ndarray   # (V, E) output word embeddings          output.word_embed
    bw: np.ndarray  # (V,) word biases                       output.word_bias
    S: np.ndarray   # (K, E) class embeddings                output.class_embed
    bc: np.ndarray  # (K,) class biases                      output.class_bias
    Fc: np.ndarray  # class n-gram feature table, flat       output.ngram_class
    Fw: np.ndarray  # word n-gram feature table, flat        output.ngram_word


class Sums(NamedTuple):
    """The AdaGrad accumulators (the optimiser's ``sum`` state) of :class:`Params`, under the
    same names and in the same shapes: the kernel updates ``params.X`` with ``sums.X``. A
    type of its own, so that the two passed the wrong way round fail the type check."""
    Q: np.ndarray
    C: np.ndarray
    R: np.ndarray
    bw: np.ndarray
    S: np.ndarray
    bc: np.ndarray
    Fc: np.ndarray
    Fw: np.ndarray


assert Sums._fields == Params._fields


class Batch(NamedTuple):
    """One minibatch of B examples, its ids checked in range by :meth:`FusedNCE.step`."""
    ctx: np.ndarray      # (B, n-1) int64 context word ids
    words: np.ndarray    # (B, 1+k) int64: the data word, then its k noise words
    classes: np.ndarray  # (B, 1+k) int64: the data word's class, then k noise classes
    keep: np.ndarray     # (B, E) uint8 dropout mask; (1, 1) and unread without dropout


class Fixed(NamedTuple):
    """What the step reads and never changes: the output's masks (-inf on the words and
    classes never predicted, <s>'s) and the noise's log-probabilities."""
    word_mask: np.ndarray    # (V,)
    class_mask: np.ndarray   # (K,)
    log_q_word: np.ndarray   # (V,) log q(w | class of w)
    log_q_class: np.ndarray  # (K,) log q(c)


class Rows(NamedTuple):
    """Gradient buffers of one table: row → buffer index (``where``, -1: none), the rows
    touched (``rows``) and their summed gradients (``grad``, one row each, and ``bias``,
    the row's bias gradient where it has one)."""
    where: np.ndarray  # (table rows,) int32
    rows: np.ndarray   # (most rows touched,) int64
    grad: np.ndarray   # (most rows touched, width) float32
    bias: np.ndarray   # (most rows touched,) float32


def _rows(table_rows: int, max_touched: int, width: int) -> Rows:
    return Rows(np.full(table_rows, -1, dtype=np.int32), np.zeros(max_touched, dtype=np.int64),
                np.zeros((max_touched, width), dtype=np.float32), np.zeros(max_touched, dtype=np.float32))


class Buffers(NamedTuple):
    """The step's gradients and scratch, sized for a minibatch (zero or unset between steps)."""
    q: Rows               # context embeddings Q
    w: Rows               # output words R and bw
    c: Rows               # classes S and bc
    fc_grad: np.ndarray   # the class feature table's gradient, in its shape
    fc_rows: np.ndarray   # the slots it lists (a slot may be listed twice)
    fw_grad: np.ndarray   # the same for the word feature table
    fw_rows: np.ndarray
    ctx_grad: np.ndarray  # (n-1, D) the context weights' gradient
    scratch: np.ndarray   # (4, max(E, D)): h, r, dr
    hashes: np.ndarray    # (L,) context suffix hashes of one example
    slots: np.ndarray     # (L,) its feature slots of one word


class Settings(NamedTuple):
    """The step's scalars."""
    act: int                 # ACTIVATION_CODES
    L: int                   # the feature order (suffix lengths 0 .. L-1)
    has_fc: bool             # a class feature table
    has_fw: bool             # a word feature table
    drop: bool               # dropout, by batch.keep
    keep_prob: np.float32    # 1 - the dropout rate
    log_k: float             # log of the noise samples per example
    lr: np.float32
    eps: np.float32


def _check_ids(name: str, ids: np.ndarray, limit: int, what: str) -> None:
    """ValueError unless every id of ``ids`` lies in [0, limit): the kernel reads tables at
    these ids with no bounds check."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        raise ValueError(f"fused step: {name} holds id {low if low < 0 else high}, outside [0, {limit}) ({what})")


class FusedNCE:
    """The fused step for ``model`` trained by ``opt`` (``torch.optim.Adagrad`` or one of
    ``nlmserve.lm.optim``'s subclasses, whose state layout is Adagrad's). The views of the
    parameters and accumulators are made again whenever their memory moved, so a model moved
    to shared memory (``--workers``) or an optimiser state loaded from a checkpoint after
    this object was made is still the one trained."""

    def __init__(self, model: NeuralLM, opt: torch.optim.Optimizer, noise: NoiseDistribution) -> None:
        out = model.output
        if not isinstance(out, ClassOutput):
            raise TypeError("the fused step needs the class output")
        self.model, self.out, self.opt = model, out, opt
        cfg = model.config
        self.V, self.K, self.n1 = cfg.vocab_size, cfg.num_classes, cfg.order - 1
        self.act = ACTIVATION_CODES[cfg.activation]
        self.feature_order = out.feature_order if out.has_features else 0
        if self.feature_order > self.n1 + 1:
            raise ValueError(f"fused step: feature order {self.feature_order} beyond the model's order {cfg.order}")
        self.fixed = Fixed(_np(out.word_mask).copy(), _np(out.class_mask).copy(),
                           noise.log_q_word.float().cpu().numpy(), noise.log_q_class.float().cpu().numpy())
        # the noise as lm.objectives.NoiseDistribution samples it: classes by their
        # cumulative probabilities, words by the keys class + cumulative q(w | class)
        cum = np.cumsum(noise._class_probs.cpu().numpy())
        self.class_cum = cum / cum[-1]
        self.word_keys = noise._keys.cpu().numpy()
        self.word_order = noise._order.cpu().numpy().astype(np.int64)
        self.word_class = _np(out.word_class).astype(np.int64)
        # the step's own draws index by these: checked here once, not per minibatch
        _check_ids("the class map", self.word_class, self.K, "the classes")
        _check_ids("the noise's word order", self.word_order, self.V, "the vocabulary")
        if (self.class_cum.shape[0], self.fixed.log_q_word.shape[0], self.fixed.log_q_class.shape[0],
                self.word_class.shape[0]) != (self.K, self.V, self.K, self.V):
            raise ValueError("fused step: the noise distribution's sizes are not the model's vocabulary and classes")
        self.groups = {id(p): g for g in opt.param_groups for p in g["params"]}
        # the tensors in Params' order (None: no such feature table)
        self.tensors = [model.embed.weight, model.ctx_weight, out.word_embed, out.word_bias, out.class_embed,
                        out.class_bias, out.ngram_class, out.ngram_word]
        self._views: tuple[tuple[int, ...], Params, Sums] | None = None
        self._buffers: tuple[int, int, int] | None = None

    def _ensure_buffers(self, B: int, m: int) -> None:
        """Buffers for minibatches of B examples with m (data + noise) words per example."""
        if self._buffers == (B, m, self.feature_order):
            return
        cfg, out = self.model.config, self.out
        V, K, E, n1, L = cfg.vocab_size, cfg.num_classes, cfg.out_dim, cfg.order - 1, self.feature_order
        # the feature tables' gradients in the tables' shape (zero between steps) and the slots listed
        (fc_grad, fc_rows), (fw_grad, fw_rows) = (
            (np.zeros(t.shape[0] if t is not None else 1, dtype=np.float32),
             np.zeros(B * m * L if t is not None else 1, dtype=np.int64)) for t in (out.ngram_class, out.ngram_word))
        self.buffers = Buffers(q=_rows(V, B * n1, cfg.dim), w=_rows(V, B * m, E), c=_rows(K, min(K, B * m), E),
                               fc_grad=fc_grad, fc_rows=fc_rows, fw_grad=fw_grad, fw_rows=fw_rows,
                               ctx_grad=np.zeros((n1, cfg.dim), dtype=np.float32),
                               scratch=np.zeros((4, max(E, cfg.dim)), dtype=np.float32),
                               hashes=np.zeros(max(1, L), dtype=np.int64), slots=np.zeros(max(1, L), dtype=np.int64))
        self._buffers = (B, m, L)

    def _tables(self) -> tuple[Params, Sums]:
        """The parameters and their accumulators as the kernel takes them; counts the step in
        each accumulator's state, as the torch step does (the state a checkpoint holds). Made
        again only when a tensor's memory moved (shared, loaded)."""
        states = [self.opt.state[p] if p is not None else None for p in self.tensors]
        for st in states:
            if st is not None:
                st["step"] += 1
        key = tuple(t.data_ptr() if t is not None else 0 for t in self.tensors) + tuple(
            st["sum"].data_ptr() if st is not None else 0 for st in states)
        if self._views is None or self._views[0] != key:
            none = np.zeros(1, dtype=np.float32)

            def view(t: Tensor | None, i: int) -> np.ndarray:  # the feature tables (the last two) flat
                return none if t is None else _np(t).reshape(-1) if i >= 6 else _np(t)

            params = Params(*(view(t, i) for i, t in enumerate(self.tensors)))
            sums = Sums(*(view(st["sum"] if st is not None else None, i) for i, st in enumerate(states)))
            if any(a.shape != b.shape for a, b in zip(params, sums)):
                raise ValueError("fused step: an AdaGrad accumulator's shape is not its parameter's")
            self._views = (key, params, sums)
        return self._views[1], self._views[2]

    def step(self, ctx: np.ndarray, target: np.ndarray, noise_classes: np.ndarray | None,
             noise_words: np.ndarray | None, keep: np.ndarray | None, dropout: float, *, k: int = 0,
             seed: int = 0) -> float:
        """One minibatch: ctx (B, order-1) and target (B,) int64, the noise (B, k) of each
        factor and the dropout mask (B, E) bool (None: no dropout) with its rate → the mean
        NCE loss before the update (what the torch step returns). With the noise None, the
        step draws k noise classes and words per example and, with ``dropout`` > 0, the
        mask, from numba's generator seeded with ``seed``: the same distributions as
        NoiseDistribution's, other draws, several times faster. Ids out of range (a word
        not in [0, V), a class not in [0, K)) are a ValueError, raised before anything changes."""
        model, out = self.model, self.out
        B = target.shape[0]
        k = noise_words.shape[1] if noise_words is not None else k
        if k < 1:
            raise ValueError("the fused step needs k >= 1 noise samples")
        if ctx.shape != (B, self.n1):
            raise ValueError(f"fused step: ctx of shape {ctx.shape}, not ({B}, {self.n1})")
        _check_ids("ctx", ctx, self.V, "the vocabulary")
        _check_ids("target", target, self.V, "the vocabulary")
        self._ensure_buffers(B, k + 1)
        words = np.empty((B, k + 1), dtype=np.int64)
        words[:, 0] = target
        classes = np.empty((B, k + 1), dtype=np.int64)
        classes[:, 0] = self.word_class[target]
        if noise_words is None or noise_classes is None:
            if dropout > 0.0:
                keep = np.empty((B, model.config.out_dim), dtype=np.bool_)
            _draw(seed, classes, words, self.class_cum, self.word_keys, self.word_order,
                  keep.view(np.uint8) if keep is not None else np.zeros((1, 1), dtype=np.uint8), dropout)
        else:
            _check_ids("noise_words", noise_words, self.V, "the vocabulary")
            _check_ids("noise_classes", noise_classes, self.K, "the classes")
            words[:, 1:] = noise_words
            classes[:, 1:] = noise_classes
        drop = keep is not None and dropout > 0.0
        if drop and keep is not None and keep.shape != (B, model.config.out_dim):
            raise ValueError(f"fused step: keep of shape {keep.shape}, not ({B}, {model.config.out_dim})")
        keep_u8 = keep.view(np.uint8) if drop and keep is not None else np.zeros((1, 1), dtype=np.uint8)
        params, sums = self._tables()
        group = self.groups[id(self.tensors[0])]
        settings = Settings(act=self.act, L=self.feature_order, has_fc=out.ngram_class is not None,
                            has_fw=out.ngram_word is not None, drop=drop, keep_prob=np.float32(1.0 - dropout),
                            log_k=math.log(k), lr=np.float32(float(group["lr"])), eps=np.float32(float(group["eps"])))
        batch = Batch(np.ascontiguousarray(ctx, dtype=np.int64), words, classes, keep_u8)
        return float(_nce_step(batch, params, sums, self.fixed, self.buffers, settings))


# ---------------------------------------------------------------------------- the kernel
# Written for numba (nopython mode): plain loops over float32 rows, which it vectorises.


_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(inline: bool = False) -> Callable[[_F], _F]:
    """numba's njit (compiled once, cached on disk), or the function as it is without numba.
    ``error_model="numpy"``: a division by zero gives inf as in numpy instead of raising,
    without which no loop with a division (AdaGrad's) is vectorised."""
    if numba is None:  # pragma: no cover
        return lambda f: f
    if inline:
        return cast(Callable[[_F], _F], njit(inline="always", cache=True, fastmath=True, error_model="numpy"))
    return cast(Callable[[_F], _F], njit(cache=True, fastmath=True, error_model="numpy", nogil=True))


@_jit(inline=True)
def _softplus(x: float) -> float:
    """log(1 + e^x), stable: -log σ(-x)."""
    return x + math.log1p(math.exp(-x)) if x > 0.0 else math.log1p(math.exp(x))


@_jit(inline=True)
def _sigmoid(x: float) -> float:
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@_jit(inline=True)
def _take(where: np.ndarray, rows: np.ndarray, n: int, row: int, grad: np.ndarray) -> tuple[int, int]:
    """Buffer index of ``row``, a zeroed new one when the minibatch first touches it → (index, n)."""
    i = where[row]
    if i >= 0:
        return i, n
    where[row] = n
    rows[n] = row
    grad[n, :] = 0.0
    return n, n + 1


@_jit(inline=True)
def _suffix_hashes(ctx: np.ndarray, i: int, L: int, hashes: np.ndarray) -> None:
    """Hashes of the L context suffixes (lengths 0 .. L-1) of example i, each times
    HASH_KEY mod HASH_MOD (``outputs.class_factored.context_hashes``, the first half of a slot)."""
    n1 = ctx.shape[1]
    h = HASH_SEED
    for length in range(L):
        if length > 0:
            h = (h * HASH_CTX + ctx[i, n1 - length] + 1) % HASH_MOD
        hashes[length] = (h * HASH_KEY) % HASH_MOD


@_jit(inline=True)
def _slot(hashed: int, y: int, size: int) -> int:
    """Table slot of (suffix, y) (``outputs.class_factored.ngram_feature_index``: the same slot, as
    ((a + b) mod M) equals ((a mod M) + b) mod M; a power-of-two size takes the low bits)."""
    x = (hashed + y * HASH_OUT) % HASH_MOD
    return x & (size - 1) if (size & (size - 1)) == 0 else x % size


@_jit(inline=True)
def _factor(i: int, ids: np.ndarray, r: np.ndarray, dr: np.ndarray, W: np.ndarray, b: np.ndarray,
            mask: np.ndarray, log_q: np.ndarray, log_k: float, inv_b: float, buf: Rows, n: int,
            has_f: bool, F: np.ndarray, hashes: np.ndarray, L: int, slots: np.ndarray,
            fgrad: np.ndarray, frows: np.ndarray, fn: int) -> tuple[float, int, int]:
    """One factor's NCE term for example i (the data ids[i, 0], the noise the rest of the row):
    its loss; its gradients into the buffers and into dr → (loss, n, fn)."""
    E = r.shape[0]
    where, rows, grad, bias_grad = buf
    loss = 0.0
    for m in range(ids.shape[1]):
        x = ids[i, m]
        wx = W[x]  # (E,) row views: the loops below are vectorised
        s = np.float32(0.0)
        for d in range(E):
            s += wx[d] * r[d]
        s += b[x] + mask[x]
        if has_f:
            for length in range(L):
                slot = _slot(hashes[length], x, F.shape[0])
                slots[length] = slot
                s += F[slot]
        delta = s - (log_q[x] + log_k)
        if m == 0:
            loss += _softplus(-delta)
            g = np.float32((_sigmoid(delta) - 1.0) * inv_b)
        else:
            loss += _softplus(delta)
            g = np.float32(_sigmoid(delta) * inv_b)
        j, n2 = _take(where, rows, n, x, grad)
        if n2 != n:
            bias_grad[j] = 0.0
            n = n2
        gj = grad[j]
        for d in range(E):
            dr[d] += g * wx[d]
            gj[d] += g * r[d]
        bias_grad[j] += g
        if has_f:  # fgrad is the table's shape: no map, a slot met again may be listed twice
            for length in range(L):
                slot = slots[length]
                if fgrad[slot] == 0.0:
                    frows[fn] = slot
                    fn += 1
                fgrad[slot] += g
    return loss, n, fn


@_jit(inline=True)
def _adagrad_rows(P: np.ndarray, A: np.ndarray, buf: Rows, n: int, lr: np.float32, eps: np.float32) -> None:
    """AdaGrad on the n touched rows of P (2-D) with its accumulator A; their map entries reset."""
    where, rows, grad = buf.where, buf.rows, buf.grad
    for i in range(n):
        row = rows[i]
        p, acc, gi = P[row], A[row], grad[i]
        for d in range(P.shape[1]):
            g = gi[d]
            a = acc[d] + g * g
            acc[d] = a
            p[d] -= lr * g / (math.sqrt(max(a, g * g)) + eps)
        where[row] = -1


@_jit(inline=True)
def _adagrad_elems(P: np.ndarray, A: np.ndarray, buf: Rows, n: int, lr: np.float32, eps: np.float32) -> None:
    """AdaGrad on the n touched elements of P (1-D), gradients ``buf.bias`` (the biases of the
    rows :func:`_adagrad_rows` updates, which resets the map)."""
    rows, grad = buf.rows, buf.bias
    for i in range(n):
        row = rows[i]
        g = grad[i]
        a = A[row] + g * g
        A[row] = a
        P[row] -= lr * g / (math.sqrt(max(a, g * g)) + eps)


@_jit(inline=True)
def _adagrad_slots(P: np.ndarray, A: np.ndarray, grad: np.ndarray, rows: np.ndarray, n: int, lr: np.float32,
                   eps: np.float32) -> None:
    """AdaGrad on the listed slots of a feature table (1-D), gradients grad in the table's
    shape, zeroed as they are used (a slot listed twice is updated once)."""
    for i in range(n):
        slot = rows[i]
        g = grad[slot]
        if g != 0.0:
            grad[slot] = 0.0
            a = A[slot] + g * g
            A[slot] = a
            P[slot] -= lr * g / (math.sqrt(max(a, g * g)) + eps)


@_jit(inline=True)
def _splitmix64(state: np.uint64) -> tuple[np.uint64, np.uint64]:
    """SplitMix64 (Steele, Lea & Flood 2014): → (next state, 64 random bits)."""
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


@_jit()
def _draw(seed: int, classes: np.ndarray, words: np.ndarray, class_cum: np.ndarray, word_keys: np.ndarray,
          word_order: np.ndarray, keep: np.ndarray, dropout: float) -> None:
    """The noise of every example into columns 1.. of classes and words (column 0: the data),
    and the dropout mask into keep (B, E) when dropout > 0: classes from q(c) (class_cum,
    their cumulative probabilities), words from q(w | class of the data word) by the keys
    class + cumulative q(w | c), in (c, c+1] (``NoiseDistribution.sample_words_in_class``).
    A unit is kept when 16 random bits are at least dropout · 2^16 (the rate to 1/65,536)."""
    np.random.seed(seed)
    B, m = words.shape
    last = word_order.shape[0] - 1
    K = class_cum.shape[0]
    for i in range(B):
        c = classes[i, 0]
        for j in range(1, m):
            classes[i, j] = min(np.searchsorted(class_cum, np.random.random(), side="right"), K - 1)
            idx = np.searchsorted(word_keys, c + (1.0 - np.random.random()))
            words[i, j] = word_order[min(idx, last)]
    if dropout > 0.0:  # 16 random bits a unit, four units a draw
        state = np.uint64(np.random.randint(0, 2**62))
        threshold = np.uint64(min(round(dropout * 65536.0), 65536))
        flat = keep.reshape(-1)
        for start in range(0, flat.shape[0], 4):
            state, bits = _splitmix64(state)
            for q in range(min(4, flat.shape[0] - start)):
                flat[start + q] = ((bits >> np.uint64(16 * q)) & np.uint64(0xFFFF)) >= threshold


@_jit()
def _nce_step(batch: Batch, params: Params, sums: Sums, fixed: Fixed, buf: Buffers, s: Settings) -> float:
    """The whole step (the module docstring); → the mean loss of the minibatch. Reads the
    tables at the ids of ``batch`` with no bounds check: the caller has checked them
    (:meth:`FusedNCE.step`), and sized ``buf`` for the minibatch."""
    ctx, words, classes, keep = batch
    Q, C, R, bw, S, bc, Fc, Fw = params
    drop, keep_prob, act, L, has_fc, has_fw = s.drop, s.keep_prob, s.act, s.L, s.has_fc, s.has_fw
    lr, eps = s.lr, s.eps
    q_where, q_rows, q_grad = buf.q.where, buf.q.rows, buf.q.grad
    ctx_grad, hashes, slots = buf.ctx_grad, buf.hashes, buf.slots
    B, n1 = ctx.shape
    D = Q.shape[1]
    inv_b = 1.0 / B
    h, r, dr = buf.scratch[0], buf.scratch[1], buf.scratch[2]
    nq = nw = nc = nfc = nfw = 0
    ctx_grad[:, :] = 0.0
    loss = 0.0
    for i in range(B):
        # the context vector: h = Σ_j C_j ⊙ Q[w_j], r = drop(act(h))
        h[:] = 0.0
        for j in range(n1):
            cj, qw = C[j], Q[ctx[i, j]]
            for d in range(D):
                h[d] += cj[d] * qw[d]
        for d in range(D):
            x = h[d]
            if act == 1:
                x = max(x, np.float32(0.0))
            elif act == 2:
                x = np.float32(math.tanh(x))
            if drop:
                x = x * np.float32(keep[i, d]) / keep_prob
            r[d] = x
            dr[d] = 0.0
        if has_fc or has_fw:
            _suffix_hashes(ctx, i, L, hashes)
        lw, nw, nfw = _factor(i, words, r, dr, R, bw, fixed.word_mask, fixed.log_q_word, s.log_k, inv_b, buf.w, nw,
                              has_fw, Fw, hashes, L, slots, buf.fw_grad, buf.fw_rows, nfw)
        lc, nc, nfc = _factor(i, classes, r, dr, S, bc, fixed.class_mask, fixed.log_q_class, s.log_k, inv_b, buf.c,
                              nc, has_fc, Fc, hashes, L, slots, buf.fc_grad, buf.fc_rows, nfc)
        loss += lw + lc
        # back through the dropout and the activation: dh, kept in dr
        for d in range(D):
            g = dr[d]
            if drop:
                g = g * np.float32(keep[i, d]) / keep_prob
            if act == 1:
                g = g if h[d] > 0.0 else np.float32(0.0)
            elif act == 2:
                t = np.float32(math.tanh(h[d]))
                g = g * (np.float32(1.0) - t * t)
            dr[d] = g
        for j in range(n1):
            w = ctx[i, j]
            q, nq = _take(q_where, q_rows, nq, w, q_grad)
            gq, gc, cj, qw = q_grad[q], ctx_grad[j], C[j], Q[w]
            for d in range(D):
                gq[d] += cj[d] * dr[d]
                gc[d] += qw[d] * dr[d]
    # AdaGrad on the rows the minibatch touched (the context weights whole: all are touched)
    _adagrad_rows(Q, sums.Q, buf.q, nq, lr, eps)
    for j in range(n1):
        cj, acc, gc = C[j], sums.C[j], ctx_grad[j]
        for d in range(D):
            g = gc[d]
            a = acc[d] + g * g
            acc[d] = a
            cj[d] -= lr * g / (math.sqrt(max(a, g * g)) + eps)
    _adagrad_elems(bw, sums.bw, buf.w, nw, lr, eps)
    _adagrad_rows(R, sums.R, buf.w, nw, lr, eps)
    _adagrad_elems(bc, sums.bc, buf.c, nc, lr, eps)
    _adagrad_rows(S, sums.S, buf.c, nc, lr, eps)
    if has_fc:
        _adagrad_slots(Fc, sums.Fc, buf.fc_grad, buf.fc_rows, nfc, lr, eps)
    if has_fw:
        _adagrad_slots(Fw, sums.Fw, buf.fw_grad, buf.fw_rows, nfw, lr, eps)
    return loss * inv_b
