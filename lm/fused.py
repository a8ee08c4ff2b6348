"""The fused CPU training step of class-factored NCE: forward, backward and AdaGrad in one
pass over a minibatch, in place on the model's torch parameters and the optimiser's state.

What it computes is :func:`nlmserve.lm.objectives.nce_loss` followed by ``backward()`` and
the AdaGrad step of ``nlmserve.lm.train`` (the torch step, which stays the reference this
one is tested against, and the path for every other objective, output, ``--distributed``
and a GPU). Per example (word2vec's and OxLM's loop, ``src/lbl/factored_weights.cc``)::

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
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

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


def unavailable_reason(objective: str, model: NeuralLM, optimizer: str, device: torch.device,
                       distributed: bool) -> str | None:
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
    if distributed:
        return "--distributed"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "parameters that are not float32"
    return None


def _np(t: Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (written in place)."""
    return t.detach().numpy()  # type: ignore[no-any-return]


class _Rows:
    """Gradient buffers of one table: row → buffer index (``where``, -1: none), the rows
    touched (``rows``) and their summed gradients (``grad``, one row of ``width`` each)."""

    def __init__(self, table_rows: int, max_touched: int, width: int) -> None:
        self.where = np.full(table_rows, -1, dtype=np.int32)
        self.rows = np.zeros(max_touched, dtype=np.int64)
        self.grad = np.zeros((max_touched, width), dtype=np.float32)
        self.bias = np.zeros(max_touched, dtype=np.float32)  # the row's bias gradient, where it has one


class FusedNCE:
    """The fused step for ``model`` trained by ``opt`` (``torch.optim.Adagrad`` or one of
    ``nlmserve.lm.train``'s subclasses, whose state layout is Adagrad's). Views of the
    parameters are taken at every step, so a model moved to shared memory (``--workers``)
    or loaded from a checkpoint after this object was made is still the one trained."""

    def __init__(self, model: NeuralLM, opt: torch.optim.Optimizer, noise: NoiseDistribution) -> None:
        out = model.output
        if not isinstance(out, ClassOutput):
            raise TypeError("the fused step needs the class output")
        self.model, self.out, self.opt = model, out, opt
        cfg = model.config
        self.act = ACTIVATION_CODES[cfg.activation]
        self.feature_order = out.feature_order if out.has_features else 0
        self.log_q_class = noise.log_q_class.float().cpu().numpy()
        self.log_q_word = noise.log_q_word.float().cpu().numpy()
        # the noise as lm.objectives.NoiseDistribution samples it: classes by their
        # cumulative probabilities, words by the keys class + cumulative q(w | class)
        cum = np.cumsum(noise._class_probs.cpu().numpy())
        self.class_cum = cum / cum[-1]
        self.word_keys = noise._keys.cpu().numpy()
        self.word_order = noise._order.cpu().numpy().astype(np.int64)
        self.word_mask = _np(out.word_mask).copy()
        self.class_mask = _np(out.class_mask).copy()
        self.word_class = _np(out.word_class).astype(np.int64)
        self.groups = {id(p): g for g in opt.param_groups for p in g["params"]}
        self._buffers: tuple[int, int, int] | None = None

    def _ensure_buffers(self, B: int, m: int) -> None:
        """Buffers for minibatches of B examples with m (data + noise) words per example."""
        if self._buffers == (B, m, self.feature_order):
            return
        cfg, out = self.model.config, self.out
        V, K, E, n1, L = cfg.vocab_size, cfg.num_classes, cfg.out_dim, cfg.order - 1, self.feature_order
        self.ctx_rows = _Rows(V, B * n1, cfg.dim)
        self.word_rows = _Rows(V, B * m, E)
        self.class_rows = _Rows(K, min(K, B * m), E)
        # the feature tables' gradients in the tables' shape (zero between steps) and the slots listed
        self.features = [(np.zeros(t.shape[0] if t is not None else 1, dtype=np.float32),
                          np.zeros(B * m * L if t is not None else 1, dtype=np.int64))
                         for t in (out.ngram_class, out.ngram_word)]
        self.ctx_grad = np.zeros((n1, cfg.dim), dtype=np.float32)
        self.scratch = np.zeros((4, max(E, cfg.dim)), dtype=np.float32)
        self.hashes = np.zeros(max(1, L), dtype=np.int64)
        self.slots = np.zeros(max(1, L), dtype=np.int64)
        self._buffers = (B, m, L)

    def _state(self, p: Tensor) -> np.ndarray:
        st = self.opt.state[p]
        st["step"] += 1  # as the torch step counts its updates (the state a checkpoint holds)
        return _np(st["sum"])

    def step(self, ctx: np.ndarray, target: np.ndarray, noise_classes: np.ndarray | None,
             noise_words: np.ndarray | None, keep: np.ndarray | None, dropout: float, *, k: int = 0,
             seed: int = 0) -> float:
        """One minibatch: ctx (B, order-1) and target (B,) int64, the noise (B, k) of each
        factor and the dropout mask (B, E) bool (None: no dropout) with its rate → the mean
        NCE loss before the update (what the torch step returns). With the noise None, the
        step draws k noise classes and words per example and, with ``dropout`` > 0, the
        mask, from numba's generator seeded with ``seed``: the same distributions as
        NoiseDistribution's, other draws, several times faster."""
        model, out = self.model, self.out
        B = target.shape[0]
        k = noise_words.shape[1] if noise_words is not None else k
        if k < 1:
            raise ValueError("the fused step needs k >= 1 noise samples")
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
            words[:, 1:] = noise_words
            classes[:, 1:] = noise_classes
        params = [model.embed.weight, model.ctx_weight, out.word_embed, out.word_bias, out.class_embed,
                  out.class_bias]
        lr = float(self.groups[id(params[0])]["lr"])
        eps = float(self.groups[id(params[0])]["eps"])
        Q, C, R, bw, S, bc = (_np(p) for p in params)
        aQ, aC, aR, abw, aS, abc = (self._state(p) for p in params)
        empty = np.zeros(1, dtype=np.float32)
        Fc = Fw = aFc = aFw = empty
        if out.ngram_class is not None:
            Fc, aFc = _np(out.ngram_class).reshape(-1), self._state(out.ngram_class).reshape(-1)
        if out.ngram_word is not None:
            Fw, aFw = _np(out.ngram_word).reshape(-1), self._state(out.ngram_word).reshape(-1)
        drop = keep is not None and dropout > 0.0
        keep_u8 = keep.view(np.uint8) if drop and keep is not None else np.zeros((1, 1), dtype=np.uint8)
        cr, wr, sr = self.ctx_rows, self.word_rows, self.class_rows
        (fc_grad, fc_rows), (fw_grad, fw_rows) = self.features
        loss = _nce_step(
            np.ascontiguousarray(ctx, dtype=np.int64), words, classes, keep_u8, drop, np.float32(1.0 - dropout),
            self.act, math.log(k), self.feature_order, out.ngram_class is not None, out.ngram_word is not None,
            Q, C, R, bw, S, bc, Fc, Fw, self.word_mask, self.class_mask, self.log_q_word, self.log_q_class,
            aQ, aC, aR, abw, aS, abc, aFc, aFw, np.float32(lr), np.float32(eps),
            cr.where, cr.rows, cr.grad, wr.where, wr.rows, wr.grad, wr.bias, sr.where, sr.rows, sr.grad, sr.bias,
            fc_grad, fc_rows, fw_grad, fw_rows, self.ctx_grad, self.scratch, self.hashes, self.slots)
        return float(loss)


# ---------------------------------------------------------------------------- the kernel
# Written for numba (nopython mode): plain loops over float32 rows, which it vectorises.


def _jit(inline: bool = False) -> Any:
    """numba's njit (compiled once, cached on disk), or the function as it is without numba.
    ``error_model="numpy"``: a division by zero gives inf as in numpy instead of raising,
    without which no loop with a division (AdaGrad's) is vectorised."""
    if numba is None:  # pragma: no cover
        return lambda f: f
    if inline:
        return njit(inline="always", cache=True, fastmath=True, error_model="numpy")
    return njit(cache=True, fastmath=True, error_model="numpy", nogil=True)


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
            mask: np.ndarray, log_q: np.ndarray, log_k: float, inv_b: float,
            where: np.ndarray, rows: np.ndarray, grad: np.ndarray, bias_grad: np.ndarray, n: int,
            has_f: bool, F: np.ndarray, hashes: np.ndarray, L: int, slots: np.ndarray,
            fgrad: np.ndarray, frows: np.ndarray, fn: int) -> tuple[float, int, int]:
    """One factor's NCE term for example i (the data ids[i, 0], the noise the rest of the row):
    its loss; its gradients into the buffers and into dr → (loss, n, fn)."""
    E = r.shape[0]
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
def _adagrad_rows(P: np.ndarray, A: np.ndarray, where: np.ndarray, rows: np.ndarray, grad: np.ndarray,
                  n: int, lr: float, eps: float) -> None:
    """AdaGrad on the n touched rows of P (2-D) with its accumulator A; their map entries reset."""
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
def _adagrad_elems(P: np.ndarray, A: np.ndarray, rows: np.ndarray, grad: np.ndarray,
                   n: int, lr: float, eps: float) -> None:
    """AdaGrad on the n touched elements of P (1-D), gradients grad (n,) (the biases of the
    rows :func:`_adagrad_rows` updates, which resets the map)."""
    for i in range(n):
        row = rows[i]
        g = grad[i]
        a = A[row] + g * g
        A[row] = a
        P[row] -= lr * g / (math.sqrt(max(a, g * g)) + eps)


@_jit(inline=True)
def _adagrad_slots(P: np.ndarray, A: np.ndarray, grad: np.ndarray, rows: np.ndarray, n: int, lr: float,
                   eps: float) -> None:
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
def _nce_step(ctx, words, classes, keep, drop, keep_prob, act, log_k, L, has_fc, has_fw,  # type: ignore[no-untyped-def]
              Q, C, R, bw, S, bc, Fc, Fw, wmask, cmask, log_q_word, log_q_class,
              aQ, aC, aR, abw, aS, abc, aFc, aFw, lr, eps,
              q_where, q_rows, q_grad, w_where, w_rows, w_grad, w_bias, c_where, c_rows, c_grad, c_bias,
              fc_grad, fc_rows, fw_grad, fw_rows, ctx_grad, scratch, hashes, slots):
    """The whole step (the module docstring); → the mean loss of the minibatch."""
    B, n1 = ctx.shape
    D = Q.shape[1]
    inv_b = 1.0 / B
    h, r, dr = scratch[0], scratch[1], scratch[2]
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
        lw, nw, nfw = _factor(i, words, r, dr, R, bw, wmask, log_q_word, log_k, inv_b, w_where, w_rows, w_grad,
                              w_bias, nw, has_fw, Fw, hashes, L, slots, fw_grad, fw_rows, nfw)
        lc, nc, nfc = _factor(i, classes, r, dr, S, bc, cmask, log_q_class, log_k, inv_b, c_where, c_rows, c_grad,
                              c_bias, nc, has_fc, Fc, hashes, L, slots, fc_grad, fc_rows, nfc)
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
    _adagrad_rows(Q, aQ, q_where, q_rows, q_grad, nq, lr, eps)
    for j in range(n1):
        cj, acc, gc = C[j], aC[j], ctx_grad[j]
        for d in range(D):
            g = gc[d]
            a = acc[d] + g * g
            acc[d] = a
            cj[d] -= lr * g / (math.sqrt(max(a, g * g)) + eps)
    _adagrad_elems(bw, abw, w_rows, w_bias, nw, lr, eps)
    _adagrad_rows(R, aR, w_where, w_rows, w_grad, nw, lr, eps)
    _adagrad_elems(bc, abc, c_rows, c_bias, nc, lr, eps)
    _adagrad_rows(S, aS, c_where, c_rows, c_grad, nc, lr, eps)
    if has_fc:
        _adagrad_slots(Fc, aFc, fc_grad, fc_rows, nfc, lr, eps)
    if has_fw:
        _adagrad_slots(Fw, aFw, fw_grad, fw_rows, nfw, lr, eps)
    return loss * inv_b
