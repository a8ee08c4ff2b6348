"""The in-process scoring API that the server calls (docs/architecture.md).

    lm = LanguageModel.load("model.nlm")
    lm.score_ngrams(np.array([[the_id, cat_id]]))          # natural log, shape (N,)
    lm.score_sentences([["the", "cat"]], log10=True)        # KenLM full_scores semantics

An n-gram lists ids oldest first, the predicted word last, 1 <= n <= order. Contexts are
normalised: left-padded with ``<s>``, and everything left of the newest ``<s>`` becomes
``<s>`` (a sentence start resets the history), so ``<s> <s> the`` ≡ ``<s> the`` ≡ ``the``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor

from nlmserve.lm.dedup import BatchPlan, distinct_rows, plan_batch
from nlmserve.lm.model import ModelConfig, NeuralLM
from nlmserve.lm.model_file import FORMAT_VERSION, ModelFile, read_model_file
from nlmserve.lm.ngrams import BOS_ID, EOS_ID, UNK_ID, canonical_rows, check_sentences, sentence_windows, word_ids
from nlmserve.lm.objectives import SELF_NORMALIZING
from nlmserve.lm.vocab import Vocabulary
from nlmserve.errors import UnsupportedModelError
from nlmserve.logbase import LOG10_E

log = logging.getLogger(__name__)

CHUNK = 4096


@dataclass(frozen=True)
class SentenceScores:
    """Per-token scores of one sentence (KenLM ``full_scores``), plus ``</s>`` when eos.

    Fields:
        token_log_probs: float32 (T,), in the base asked for.
        oov: bool (T,), the word was not in the vocabulary (scored as ``<unk>``).
        ngram_lengths: uint32 (T,), min(order, tokens available including ``<s>``).
        total: the sum of ``token_log_probs``, accumulated in float64.
    """

    token_log_probs: np.ndarray
    oov: np.ndarray
    ngram_lengths: np.ndarray
    total: float


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


#: Set (to anything but "" or "0") to turn the CPU inference tables off by default.
NO_CPU_TABLES_ENV = "NLMSERVE_NO_CPU_TABLES"


def cpu_tables_default() -> bool:
    """The CPU tables are on unless ``NLMSERVE_NO_CPU_TABLES`` is set."""
    return os.environ.get(NO_CPU_TABLES_ENV, "") in ("", "0")


class LanguageModel:
    """A loaded model: vocabulary, classes, network on ``device``, batch scoring.

    ``cpu_tables``: on the CPU, a class-output model scores with read-only tables of its
    weights (numpy for tiny batches, class-sorted torch tensors otherwise, see
    ``_InferenceTables``); False scores with the network's own device-agnostic torch code,
    as on a GPU (the same values within float rounding). None: on unless the environment
    variable ``NLMSERVE_NO_CPU_TABLES`` is set.
    """

    def __init__(self, model_file: ModelFile, device: str | torch.device | None = None, *,
                 cpu_tables: bool | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.cpu_tables = cpu_tables_default() if cpu_tables is None else cpu_tables
        counts = model_file.tensors.get("unigram_counts")
        self._unigram_counts = np.array(counts) if counts is not None else None
        self.net: NeuralLM = model_file.build_model().to(self.device).eval()
        # The header without the raw tensors (they are views of the whole file's bytes).
        self.model_file = dataclasses.replace(model_file, tensors={})
        self.config: ModelConfig = model_file.config
        self.vocab: Vocabulary = model_file.vocab
        self.classes = model_file.classes
        self.model_hash: str = model_file.sha256
        self.format_version: int = model_file.format_version
        self.objective: str = model_file.objective
        self.lowercase: bool = model_file.lowercase
        self.training: dict[str, Any] = model_file.training
        self._fast: _InferenceTables | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: str | torch.device | None = None, *,
             cpu_tables: bool | None = None) -> "LanguageModel":
        """Read and verify ``path`` (ModelFileError on any problem) and move it to ``device``
        (None: cuda if available, else cpu)."""
        return cls(read_model_file(path), device, cpu_tables=cpu_tables)

    # ------------------------------------------------------------------ properties
    @property
    def order(self) -> int:
        return self.config.order

    @property
    def output_type(self) -> str:
        return self.config.output

    @property
    def self_normalized(self) -> bool:
        """Unnormalised scores approximate log-probabilities: NCE with fixed normalisers,
        the self-normalising objectives (weaknorm, weaknormsq), and the tree output (whose
        score is the log-probability itself)."""
        return self.objective in SELF_NORMALIZING or self.config.output == "tree"

    @property
    def num_classes(self) -> int:
        return self.config.num_classes

    @property
    def unigram_counts(self) -> np.ndarray | None:
        """Training unigram counts (V,) when the file has them."""
        return self._unigram_counts

    def __repr__(self) -> str:
        return (
            f"LanguageModel(order={self.order}, V={len(self.vocab)}, output={self.output_type}, "
            f"objective={self.objective}, hash={self.model_hash[:12]}, device={self.device}"
            + ("" if self.cpu_tables else ", cpu_tables=False") + ")"
        )

    # ------------------------------------------------------------------ pieces for the server
    def canonical_rows(self, ids: npt.ArrayLike | Tensor) -> np.ndarray:
        """Validate (N, n) ids (numpy or torch) and bring them to the canonical (N, order)
        int64 form (``nlmserve.lm.ngrams.canonical_rows``: InvalidRequestError names the row)."""
        arr = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else ids
        return canonical_rows(arr, self.order, len(self.vocab))

    def prepare_contexts(self, ids: npt.ArrayLike | Tensor) -> tuple[Tensor, Tensor]:
        """Validate (N, n) ids and normalise their contexts → (ctx (N, order-1), target (N,))
        as LongTensors on ``self.device``."""
        rows = self.canonical_rows(ids)
        return (
            torch.from_numpy(np.ascontiguousarray(rows[:, :-1])).to(self.device),
            torch.from_numpy(np.ascontiguousarray(rows[:, -1])).to(self.device),
        )

    def encode_contexts(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) → r (N, E)."""
        with torch.inference_mode():
            tables = self._tables()
            return self.net.encode(ctx) if tables is None else tables.encode(ctx)

    def class_log_normalizer(self, r: Tensor) -> Tensor:
        """log Σ_c exp s_c(h) → (N,); zeros for the softmax output."""
        with torch.inference_mode():
            tables = self._tables()
            if tables is not None and r.dtype == torch.float32 and r.device.type == "cpu":
                return tables.class_norm(r)
            return self.net.class_log_normalizer(r)

    def in_class_log_normalizer(self, r: Tensor, cls: Tensor) -> Tensor:
        """log Σ_{w ∈ cls} exp s_w(h) → (N,); the full-softmax log Z for the softmax output
        (``cls`` ignored)."""
        with torch.inference_mode():
            tables = self._tables()
            if tables is not None and r.dtype == torch.float32 and r.device.type == "cpu":
                return tables.in_class(r, cls)
            return self.net.in_class_log_normalizer(r, cls)

    def _tables(self) -> "_InferenceTables | None":
        """The CPU inference tables of a class-output model (None on other devices, for
        the softmax output, with direct n-gram features or without ``cpu_tables``), rebuilt
        when a parameter was changed in place."""
        if (not self.cpu_tables or self.device.type != "cpu" or self.config.output != "class"
                or self.config.has_ngram_features):
            return None
        if self._fast is None or self._fast.versions != _versions(self.net):
            self._fast = _InferenceTables(self.net)
        return self._fast

    def score_prepared(self, ctx: np.ndarray, target: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        """Natural-log scores of rows whose contexts are already normalised (``prepare_contexts``
        as numpy: ctx (N, order-1), target (N,), valid ids); ``normalized`` (N,) bool per row
        (False: s_c + s_w). No validation: the caller (the server) has done it.

        The batch's distinct work is done once (``nlmserve.lm.dedup``): r and the class
        normaliser per distinct context, the in-class normaliser per distinct (context, class
        of the target), s_c + s_w per distinct row; rows not ``normalized`` skip both
        normalisers."""
        ctx = np.asarray(ctx, dtype=np.int64)
        target = np.asarray(target, dtype=np.int64)
        with torch.inference_mode():
            tables = self._tables()
            if tables is None:
                return self._score_plan(plan_batch(ctx, target, self._classes(target), normalized), ctx, target)
            plan = plan_batch(ctx, target, tables.np_word_class[target], normalized)
            if ctx.shape[0] <= TINY_ROWS:
                return tables.log_prob_numpy(plan, ctx, target)
            return self._score_plan(plan, ctx, target, tables)

    def _score_plan(self, plan: BatchPlan, ctx: np.ndarray, target: np.ndarray,
                    tables: "_InferenceTables | None" = None) -> np.ndarray:
        """The rows of ``plan`` (``plan_batch`` of ``ctx``, ``target``) scored with the torch
        pieces: r per distinct context, s_c + s_w per distinct row (row-wise products, so a
        row's unnormalised score does not depend on the rows batched with it), the class
        normaliser per context and the in-class normaliser per (context, class) pair of the
        rows to normalise → float32 (N,)."""
        with torch.inference_mode():
            contexts = self._on_device(ctx[plan.contexts])
            row_context, row_target = self._on_device(plan.row_context), self._on_device(target[plan.rows])
            if tables is not None:  # the CPU tables (``score_prepared``): one dot product per row
                r = tables.encode(contexts)  # (U, E)
                raw = _numpy(tables.raw(r, row_context, row_target))  # (R,)
            else:
                r = self.encode_contexts(contexts)
                class_score, word_score = self.raw_scores(r[row_context], row_target)
                raw = _numpy(class_score + word_score)  # (R,)
            if not plan.norm.size:
                return plan.compose(raw, _NO_SCORES, _NO_SCORES)
            norm_r = r[self._on_device(plan.norm_contexts)]  # (C, E)
            pair_r = r[self._on_device(plan.pair_context)]  # (P, E)
            class_norm = self.class_log_normalizer(norm_r)  # (C,)
            in_class = self.in_class_log_normalizer(pair_r, self._on_device(plan.pair_class))  # (P,)
            return plan.compose(raw, _numpy(class_norm), _numpy(in_class))

    def _on_device(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def _classes(self, target: np.ndarray) -> np.ndarray:
        """Class id of each target (N,) as numpy (zeros for the outputs without classes)."""
        if self.config.output != "class":
            return np.zeros(target.shape, dtype=np.int64)
        return self.net.word_class[self._on_device(target)].cpu().numpy()

    def word_classes(self, target: Tensor) -> Tensor:
        """Class id of each target (zeros for the outputs without classes)."""
        if self.config.output != "class":
            return torch.zeros_like(target)
        return self.net.word_class[target]

    def raw_scores(self, r: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """(class_score (N,), word_score (N,)); class_score is 0 without classes.
        log p = class_score - class_lognorm + word_score - in_class_lognorm (both
        normalisers are 0 for the tree output, the whole log-probability is word_score)."""
        with torch.inference_mode():
            word = self.net.word_score(r, target)
            if self.config.output != "class":
                return torch.zeros_like(word), word
            return self.net.class_score(r, self.net.word_class[target]), word

    def scoring_tables(self) -> ScoringTables:
        """The self-normalised score as tables (:class:`ScoringTables`). Raises
        UnsupportedModelError, saying why, for a model they cannot describe: one that is not
        self-normalised, has no class output, a context other than the diagonal one, a
        hidden layer or direct n-gram features."""
        cfg = self.config
        why = ("the model is not self-normalised (trained with NCE)" if not self.self_normalized
               else f"the output layer is {cfg.output!r}, not 'class'" if cfg.output != "class"
               else f"the context is {cfg.context!r}, not 'diagonal'" if cfg.context != "diagonal"
               else "the model has a hidden layer" if cfg.hidden
               else "the model has direct n-gram features" if cfg.has_ngram_features
               else None)
        if why is not None:
            raise UnsupportedModelError(f"no scoring tables: {why}")
        with torch.inference_mode():
            out_embed, out_bias = _output_rows(self.net)
            position = _position_tables(self.net).reshape(cfg.order - 1, cfg.vocab_size, cfg.dim)
            return ScoringTables(_numpy(position), _numpy(out_embed), _numpy(out_bias), cfg.activation)

    # ------------------------------------------------------------------ batch scoring
    def score_ngrams(self, ids: npt.ArrayLike | Tensor, *, normalized: bool = True, log10: bool = False) -> np.ndarray:
        """log P(last | rest) for each row of an (N, n) id array → float32 (N,).

        ``normalized=False`` returns the unnormalised score when the model is
        self-normalised (NCE); other models always return normalised values.

        Identical rows are scored once. The distinct rows, in lexicographic order (so rows of
        one context are neighbours and share its work), go to :meth:`score_prepared` in chunks
        sized by the (context, class) pairs they normalise (``NeuralLM.scoring_bounds``).
        """
        arr = self.canonical_rows(ids)
        some, row_of = distinct_rows(arr)
        rows = arr[some]  # (R, order)
        out = np.empty(rows.shape[0], dtype=np.float32)
        use_raw = not normalized and self.self_normalized
        if use_raw:
            bounds: Iterable[tuple[int, int]] = ((a, min(a + CHUNK, len(rows))) for a in range(0, len(rows), CHUNK))
        else:
            bounds = self.net.scoring_bounds(rows[:, -1], max_rows=CHUNK, counted=self._first_of_pairs(rows))
        with torch.inference_mode():
            for start, end in bounds:
                chunk = rows[start:end]
                out[start:end] = self.score_prepared(chunk[:, :-1], chunk[:, -1], np.full(end - start, not use_raw))
        out = out[row_of]
        if log10:
            out *= np.float32(LOG10_E)
        return out  # type: ignore[no-any-return]

    def _first_of_pairs(self, rows: np.ndarray) -> np.ndarray | None:
        """(N,) bool: the first of the canonical ``rows`` of each (context, class of the
        target) pair, whose in-class normaliser is computed (None without classes)."""
        if self.config.output != "class" or not len(rows):
            return None
        plan = plan_batch(rows[:, :-1], rows[:, -1], self._classes(rows[:, -1]), np.ones(len(rows), dtype=bool))
        first = np.zeros(len(rows), dtype=bool)
        first[plan.norm[np.unique(plan.pair_of, return_index=True)[1]]] = True
        return first

    def sentence_ngrams(
        self, sentences: Sequence[Sequence[str]], *, bos: bool = True, eos: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """All n-grams of ``sentences`` → (ids (T, order), oov (T,), ngram_len (T,), sentence
        index (T,)) (``nlmserve.lm.ngrams.sentence_windows``). Words are lowercased first when
        the model was trained lowercased."""
        index = self.vocab.index
        toks = [[w.lower() for w in words] if self.lowercase else list(words) for words in sentences]
        ids = [word_ids(t, index, lowercase=False) for t in toks]
        check_sentences(ids, len(self.vocab))
        rows, lens, counts = sentence_windows(ids, self.order, bos=bos, eos=eos)
        oov = np.array([flag for t in toks for flag in [w not in index for w in t] + [False] * int(eos)], dtype=bool)
        return rows, oov, lens, np.repeat(np.arange(len(sentences), dtype=np.int64), counts)

    def score_sentences(
        self,
        sentences: Sequence[Sequence[str]],
        *,
        bos: bool = True,
        eos: bool = True,
        normalized: bool = True,
        log10: bool = False,
    ) -> list[SentenceScores]:
        """Per-token log-probabilities of tokenised sentences (KenLM ``full_scores``).

        ``bos=False`` only changes the reported n-gram lengths: a context shorter than
        order-1 is left-padded with ``<s>`` in this model, so the probabilities are those
        of a sentence start either way.
        """
        ids, oov, lens, owner = self.sentence_ngrams(sentences, bos=bos, eos=eos)
        scores = self.score_ngrams(ids, normalized=normalized, log10=log10) if len(ids) else np.empty(0, np.float32)
        bounds = np.searchsorted(owner, np.arange(len(sentences) + 1))
        out = []
        for i in range(len(sentences)):
            a, b = bounds[i], bounds[i + 1]
            lp = scores[a:b]
            out.append(SentenceScores(lp, oov[a:b], lens[a:b], float(lp.astype(np.float64).sum())))
        return out


# ---------------------------------------------------------------------- inference fast path
#: Batches up to this many rows are scored with numpy on the CPU (torch's fixed cost of some
#: thirty small operations, ~10 µs each, plus a few per class present, dominates there:
#: measured on a 20,000-word, 141-class model, numpy takes 0.92 ms for 20 rows against 1.44,
#: 1.39 for 32 against 1.77, and the two meet near 48).
TINY_ROWS = 32
#: A log Σ exp computed without the max shift below this is recomputed with it (the sum
#: was near float32's smallest normal numbers).
LOG_SUM_FLOOR = -60.0
#: Elements of one numpy matrix-vector product in the tiny path's in-class normaliser: below
#: the size at which numpy's OpenBLAS splits a product over threads of its own (measured
#: between 256k and 512k elements), so every slice runs on the calling thread.
MV_ELEMENTS = 1 << 18
#: Largest size of the per-position context tables of a diagonal-context model (bytes).
ENCODE_TABLE_BYTES = 512 << 20


def _output_rows(net: NeuralLM) -> tuple[Tensor, Tensor]:
    """s_c(h) + s_w(h) = (c_k + q_w)·r + (b_k + b_w) for k the class of w: one row per word
    (V, E) and one bias per word (V,), so a row's unnormalised score is one dot product."""
    cls = net.word_class
    out_embed = (net.word_embed + net.class_embed[cls]).detach().contiguous()
    out_bias = (net.word_bias + net.word_mask + net.class_bias[cls] + net.class_mask[cls]).detach().contiguous()
    return out_embed, out_bias


def _position_tables(net: NeuralLM) -> Tensor:
    """The diagonal context as tables: q(w) ⊙ c_j for each context position j, stacked
    ((n-1)·V, D), so r = Σ_j table_j[w_j] (Devlin et al. 2014's precomputation)."""
    emb, cw = net.embed.weight.detach(), net.ctx_weight.detach()
    return torch.cat([emb * cw[j] for j in range(net.config.order - 1)])


@dataclass(frozen=True)
class ScoringTables:
    """The self-normalised score of a class-output model with the diagonal context, as
    tables a client can evaluate without the model (the wire's ``ScoringTablesChunk``,
    the Moses feature's ``scoring=local``). For a canonical row w_1 .. w_{n-1} w_n::

        r = act(Σ_j position[j, w_j])        position (n-1, V, D)
        s = r · output[w_n] + bias[w_n]      output (V, D), bias (V,); natural log

    which is ``score_ngrams(rows, normalized=False)`` to float rounding.
    """

    position: np.ndarray
    output: np.ndarray
    bias: np.ndarray
    activation: str

    def flat(self) -> np.ndarray:
        """The three tables as the one float32 array the wire streams: position, output, bias."""
        return np.concatenate([self.position.reshape(-1), self.output.reshape(-1), self.bias])

    def score(self, rows: npt.ArrayLike) -> np.ndarray:
        """The formula above for canonical rows (N, n) → float32 (N,) (the reference the
        C++ evaluation is tested against)."""
        rows = np.asarray(rows, dtype=np.int64)
        n1 = self.position.shape[0]
        r = self.position[np.arange(n1), rows[:, :n1]].sum(axis=1)  # (N, D)
        if self.activation == "tanh":
            r = np.tanh(r)
        elif self.activation == "relu":
            r = np.maximum(r, 0)
        t = rows[:, n1]
        return (np.einsum("nd,nd->n", r, self.output[t]) + self.bias[t]).astype(np.float32)  # type: ignore[no-any-return]


def _versions(net: NeuralLM) -> tuple[int, ...]:
    return tuple(p._version for p in net.parameters())


class _InferenceTables:
    """Read-only copies for CPU inference of a class-output model, rebuilt whenever a
    parameter changes in place: the output word embeddings and biases sorted by class (each
    class is a contiguous slice, so the in-class normaliser needs no gather), and numpy
    views of every weight for the tiny-batch path."""

    def __init__(self, net: NeuralLM) -> None:
        self.versions = _versions(net)
        cfg = net.config
        with torch.no_grad():
            order = net.class_order
            self.sorted_embed = net.word_embed.detach()[order].contiguous()  # (V, E)
            self.sorted_bias = (net.word_bias + net.word_mask).detach()[order].contiguous()  # (V,)
            self.offsets: list[int] = list(net._offsets)
            self.np_class_start = np.array(self.offsets[:-1], dtype=np.int64)  # (K,)
            self.np_class_size = np.diff(np.array(self.offsets, dtype=np.int64))  # (K,)
            self.class_bias = (net.class_bias + net.class_mask).detach().clone()  # (K,)
            self.class_embed_t = net.class_embed.detach().t()  # (E, K)
            self.np_embed = net.embed.weight.detach().numpy()
            w = net.ctx_weight.detach().numpy()
            n1, d = cfg.order - 1, cfg.dim
            # full context: r_e = Σ_j Σ_d W[j, e, d] q[j, d] = q.reshape(n1*D) @ Wf
            self.np_ctx = w if cfg.context == "diagonal" else np.ascontiguousarray(
                w.transpose(0, 2, 1).reshape(n1 * d, d))
            self.np_hidden_w = None if net.hidden is None else np.ascontiguousarray(net.hidden.weight.detach().numpy().T)
            self.np_hidden_b = None if net.hidden is None else net.hidden.bias.detach().numpy()
            self.np_word_embed = net.word_embed.detach().numpy()
            self.np_word_bias = (net.word_bias + net.word_mask).detach().numpy()
            self.np_class_embed = net.class_embed.detach().numpy()  # (K, E)
            self.np_class_embed_t = np.ascontiguousarray(self.np_class_embed.T)  # (E, K)
            self.np_class_bias = (net.class_bias + net.class_mask).detach().numpy()
            self.np_word_class = net.word_class.numpy()
            self.np_sorted_embed = self.sorted_embed.numpy()
            self.np_sorted_bias = self.sorted_bias.numpy()
            self.out_embed, self.out_bias = _output_rows(net)  # (V, E), (V,): s_c + s_w per word
            self.np_out_embed = self.out_embed.numpy()
            self.np_out_bias = self.out_bias.numpy()
        self.context = cfg.context
        self.activation = cfg.activation
        self.hidden = net.hidden
        # Diagonal context: one table per position, q(w) * c_j, stacked (n-1 x V, D), so that
        # r = Σ_j c_j ⊙ q(w_j) is one fused gather-and-sum (embedding_bag) with no (N, n-1, D)
        # intermediate; kept when it fits in ENCODE_TABLE_BYTES.
        self.position_tables: Tensor | None = None
        if cfg.context == "diagonal" and (cfg.order - 1) * cfg.vocab_size * cfg.dim * 4 <= ENCODE_TABLE_BYTES:
            with torch.no_grad():
                self.position_tables = _position_tables(net)
                self.position_shift = torch.arange(cfg.order - 1) * cfg.vocab_size
        self.net = net

    def encode(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) → r (N, E), as ``NeuralLM.encode``."""
        if self.position_tables is None:
            return self.net.encode(ctx)
        r = F.embedding_bag(ctx + self.position_shift, self.position_tables, mode="sum")
        if self.hidden is not None:
            r = self.hidden(r)
        if self.activation == "tanh":
            r = torch.tanh(r)
        elif self.activation == "relu":
            r = torch.relu(r)
        return r

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
        bad = ~torch.isfinite(sums) | (sums < LOG_SUM_FLOOR)
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
    def log_prob_numpy(self, plan: BatchPlan, ctx: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The rows of ``plan`` (``plan_batch`` of ``ctx``, ``target``) as
        ``LanguageModel._score_plan`` scores them, in numpy → float32 (N,)."""
        r = self._encode_numpy(ctx[plan.contexts])  # (U, E)
        rr, t = r[plan.row_context], target[plan.rows]  # (R, E), (R,)
        raw = np.einsum("ne,ne->n", rr, self.np_out_embed[t]) + self.np_out_bias[t]  # (R,) s_c + s_w
        if not plan.norm.size:
            return plan.compose(raw, _NO_SCORES, _NO_SCORES)
        class_logits = _mm(r[plan.norm_contexts], self.np_class_embed_t) + self.np_class_bias  # (C, K)
        in_class = np.empty(plan.pair_class.size, dtype=np.float32)  # (P,)
        offsets = self.offsets
        for p, (u, k) in enumerate(zip(plan.pair_context.tolist(), plan.pair_class.tolist())):
            a, b = offsets[k], offsets[k + 1]
            in_class[p] = _logsumexp(_mv(self.np_sorted_embed[a:b], r[u]) + self.np_sorted_bias[a:b])
        return plan.compose(raw, _logsumexp_rows(class_logits), in_class)

    def _encode_numpy(self, ctx: np.ndarray) -> np.ndarray:
        """ctx (U, order-1) → r (U, E), as ``NeuralLM.encode``."""
        q = self.np_embed[ctx]  # (U, n-1, D)
        if self.context == "diagonal":
            r: np.ndarray = (q * self.np_ctx).sum(axis=1)
        else:
            r = _mm(q.reshape(q.shape[0], -1), self.np_ctx)
        if self.np_hidden_w is not None:
            r = _mm(r, self.np_hidden_w) + self.np_hidden_b
        if self.activation == "tanh":
            r = np.tanh(r)
        elif self.activation == "relu":
            r = np.maximum(r, 0)
        return r


_NO_SCORES = np.zeros(0, dtype=np.float32)


def _numpy(t: Tensor) -> np.ndarray:
    return t.float().cpu().numpy()


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b through torch: its BLAS runs on the threads torch was given, where numpy's
    would start a pool of its own on every core (10-1000x slower on a busy machine)."""
    return torch.mm(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(b)).numpy()


def _mv(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """a @ x for a (S, D) float32 block, in slices of at most MV_ELEMENTS: numpy's BLAS runs
    each slice on the calling thread (it starts its own thread pool only for larger products,
    see :func:`_mm`), and its matrix-vector product streams the block faster than torch.mv
    (measured on one thread, 7,942 x 256: 135-139 µs against 206-215 µs)."""
    rows = max(1, MV_ELEMENTS // max(1, a.shape[1]))
    if a.shape[0] <= rows:
        return a @ x  # type: ignore[no-any-return]
    out = np.empty(a.shape[0], dtype=np.result_type(a, x))
    for s in range(0, a.shape[0], rows):
        np.dot(a[s : s + rows], x, out=out[s : s + rows])
    return out


def _logsumexp(x: np.ndarray) -> np.floating[Any]:
    m = x.max()
    return m + np.log(np.exp(x - m).sum())  # type: ignore[no-any-return]


def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """log Σ exp of each row of x (N, K) → (N,), as :func:`_logsumexp` row by row."""
    m = x.max(axis=1)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=1))  # type: ignore[no-any-return]


__all__ = ["LanguageModel", "ScoringTables", "SentenceScores", "FORMAT_VERSION", "UNK_ID", "BOS_ID", "EOS_ID"]
