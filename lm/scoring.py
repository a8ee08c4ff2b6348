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
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor

from .dedup import BatchPlan, distinct_rows, plan_batch
from .cpu import to_numpy
from .config import ModelConfig
from .model import NeuralLM, activate
from .model_file import FORMAT_VERSION, ModelFile, read_model_file
from .tables_scorer import SentenceScores  # the one definition, torch-free
from ..wire.ngrams import BOS_ID, EOS_ID, UNK_ID, canonical_rows, no_word_id, sentence_rows
from .outputs.class_factored import NO_HASH, NO_SCORES, ClassOutput, context_hashes, ngram_feature_index
from .outputs.tree import TreeOutput
from .trees import TreePaths
from .vocab import Vocabulary
from ..common.errors import UnsupportedModelError
from ..wire.logbase import ln_to_log10

if TYPE_CHECKING:
    from .cache import Scorer

log = logging.getLogger(__name__)

CHUNK = 4096


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
        """Unnormalised scores approximate log-probabilities (``ModelFile.self_normalized``)."""
        return self.model_file.self_normalized

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
        int64 form (``nlmserve.wire.ngrams.canonical_rows``: InvalidRequestError names the row)."""
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

    def class_log_normalizer(self, r: Tensor, ctx: Tensor | None = None) -> Tensor:
        """log Σ_c exp s_c(h) → (N,) for r (N, E) and, beside it, the context ids (N,
        order-1) (read by direct n-gram features only); zeros without classes."""
        with torch.inference_mode():
            tables = self._tables()
            if tables is not None and r.dtype == torch.float32 and r.device.type == "cpu":
                return tables.out.class_norm(r)
            out = self.net.output
            return out.class_log_normalizer(r, ctx) if isinstance(out, ClassOutput) else r.new_zeros(r.shape[0])

    def in_class_log_normalizer(self, r: Tensor, cls: Tensor, ctx: Tensor | None = None) -> Tensor:
        """log Σ_{w ∈ cls} exp s_w(h) → (N,); without classes the output's whole normaliser
        (the full-softmax log Z, 0 for the tree; ``cls`` ignored)."""
        with torch.inference_mode():
            tables = self._tables()
            if tables is not None and r.dtype == torch.float32 and r.device.type == "cpu":
                return tables.out.in_class(r, cls)
            out = self.net.output
            if isinstance(out, ClassOutput):
                return out.in_class_log_normalizer(r, cls, ctx)
            return out.log_normalizer(r, cls, ctx)

    def _tables(self) -> "_InferenceTables | None":
        """The CPU inference tables of a class-output model (None on other devices, for
        the softmax output, with direct n-gram features or without ``cpu_tables``), rebuilt
        when a parameter was changed in place."""
        if (not self.cpu_tables or self.device.type != "cpu" or not isinstance(self.net.output, ClassOutput)
                or self.config.has_ngram_features):
            return None
        if self._fast is None or self._fast.stale():
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
            plan = plan_batch(ctx, target, tables.out.np_word_class[target], normalized)
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
                raw = to_numpy(tables.out.raw(r, row_context, row_target))  # (R,)
            else:
                r = self.encode_contexts(contexts)
                raw = to_numpy(self.raw_score(r[row_context], row_target, contexts[row_context]))  # (R,)
            if not plan.norm.size:
                return plan.compose(raw, NO_SCORES, NO_SCORES)
            norm, pair = self._on_device(plan.norm_contexts), self._on_device(plan.pair_context)
            # the ids beside r only where the network reads them (the tables never do)
            norm_ctx, pair_ctx = (None, None) if tables is not None else (contexts[norm], contexts[pair])
            class_norm = self.class_log_normalizer(r[norm], norm_ctx)  # (C,)
            in_class = self.in_class_log_normalizer(r[pair], self._on_device(plan.pair_class), pair_ctx)  # (P,)
            return plan.compose(raw, to_numpy(class_norm), to_numpy(in_class))

    def _on_device(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def _classes(self, target: np.ndarray) -> np.ndarray:
        """Class id of each target (N,) as numpy (zeros for the outputs without classes)."""
        return self.net.output.classes_of(self._on_device(target)).cpu().numpy()  # type: ignore[no-any-return]

    def word_classes(self, target: Tensor) -> Tensor:
        """Class id of each target (zeros for the outputs without classes)."""
        return self.net.output.classes_of(target)

    def raw_score(self, r: Tensor, target: Tensor, ctx: Tensor | None = None) -> Tensor:
        """The output's unnormalised score (N,) of each target for r (N, E) and its context
        ids (N, order-1): s_c + s_w for classes, s_w for the softmax family, log P for the
        tree. log p = raw - class_log_normalizer - in_class_log_normalizer."""
        with torch.inference_mode():
            return self.net.output.score(r, target, ctx)

    def cached_scorer(self, ngram_cache_size: int, context_cache_size: int) -> "Scorer":
        """A scorer of canonical rows through an n-gram cache and the per-context normaliser
        cache of these sizes (0: none), for one thread (``nlmserve.lm.cache``)."""
        from .cache import Scorer

        return Scorer(self, ngram_cache_size, context_cache_size)

    def scoring_tables_missing(self) -> str | None:
        """Why :meth:`scoring_tables` cannot describe this model (None: it can): one that is
        not self-normalised, has neither a class nor a tree output, a context other than the
        diagonal one or a hidden layer."""
        cfg = self.config
        return ("the model is not self-normalised (trained with NCE)" if not self.self_normalized
                else f"the output layer is {cfg.output!r}, not 'class' or 'tree'" if cfg.output not in ("class", "tree")
                else f"the context is {cfg.context!r}, not 'diagonal'" if cfg.context != "diagonal"
                else "the model has a hidden layer" if cfg.hidden else None)

    def scoring_tables(self) -> ScoringTables:
        """The self-normalised score as tables (:class:`ScoringTables`). Raises
        UnsupportedModelError, saying why (:meth:`scoring_tables_missing`), for a model they
        cannot describe."""
        cfg = self.config
        why = self.scoring_tables_missing()
        if why is not None:
            raise UnsupportedModelError(f"no scoring tables: {why}")
        with torch.inference_mode():
            out = self.net.output
            position = _position_tables(self.net).reshape(cfg.order - 1, cfg.vocab_size, cfg.dim)
            if isinstance(out, TreeOutput):
                return ScoringTables(to_numpy(position), to_numpy(out.node_embed.detach()),
                                     to_numpy(out.node_bias.detach()), cfg.activation,
                                     tree=out.tree.paths(cfg.vocab_size))
            assert isinstance(out, ClassOutput)
            out_embed, out_bias = out.output_rows()
            ngram_class, ngram_word = (None if t is None else to_numpy(t.detach().reshape(-1))
                                       for t in (out.ngram_class, out.ngram_word))
            return ScoringTables(
                to_numpy(position), to_numpy(out_embed), to_numpy(out_bias), cfg.activation,
                feature_order=cfg.feature_order if out.has_features else 0,
                word_class=out.word_class.cpu().numpy() if out.has_features else None,
                ngram_class=ngram_class, ngram_word=ngram_word)

    # ------------------------------------------------------------------ batch scoring
    def score_ngrams(self, ids: npt.ArrayLike | Tensor, *, normalized: bool = True, log10: bool = False) -> np.ndarray:
        """log P(last | rest) for each row of an (N, n) id array → float32 (N,).

        ``normalized=False`` returns the unnormalised score when the model is
        self-normalised (NCE); other models always return normalised values.

        Identical rows are scored once. The distinct rows, in lexicographic order (so rows of
        one context are neighbours and share its work), go to :meth:`score_prepared` in chunks
        sized by the (context, class) pairs they normalise (``OutputLayer.scoring_bounds``).
        """
        arr = self.canonical_rows(ids)
        some, row_of = distinct_rows(arr)
        rows = arr[some]  # (R, order)
        out = np.empty(rows.shape[0], dtype=np.float32)
        use_raw = not normalized and self.self_normalized
        if use_raw:
            bounds: Iterable[tuple[int, int]] = ((a, min(a + CHUNK, len(rows))) for a in range(0, len(rows), CHUNK))
        else:
            bounds = self.net.output.scoring_bounds(rows[:, -1], max_rows=CHUNK, counted=self._first_of_pairs(rows))
        with torch.inference_mode():
            for start, end in bounds:
                chunk = rows[start:end]
                out[start:end] = self.score_prepared(chunk[:, :-1], chunk[:, -1], np.full(end - start, not use_raw))
        out = out[row_of]
        if log10:
            ln_to_log10(out)
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
        index (T,)) (``nlmserve.wire.ngrams.sentence_windows``). Words are lowercased first when
        the model was trained lowercased."""
        return sentence_rows(sentences, self.vocab.index, self.order, lowercase=self.lowercase, bos=bos, eos=eos)

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
#: Largest size of the per-position context tables of a diagonal-context model (bytes).
ENCODE_TABLE_BYTES = 512 << 20


def _position_tables(net: NeuralLM, no_word_rows: bool = False) -> Tensor:
    """The diagonal context as tables: q(w) ⊙ c_j for each context position j, stacked
    ((n-1)·V, D), so r = Σ_j table_j[w_j] (Devlin et al. 2014's precomputation). With
    ``no_word_rows`` each position's table ends with a zero row for the id V (a word that
    is not known): ((n-1)·(V+1), D)."""
    emb, cw = net.embed.weight.detach(), net.ctx_weight.detach()
    if no_word_rows:
        emb = torch.cat([emb, emb.new_zeros(1, emb.shape[1])])
    return torch.cat([emb * cw[j] for j in range(net.config.order - 1)])


def position_sum(tables: Tensor, ctx: Tensor, shift: Tensor, known: Tensor | None = None) -> Tensor:
    """``NeuralLM.context_sum`` of a diagonal context from its per-position tables
    (``_position_tables``: position j's rows start at ``shift[j]``): Σ_j tables[shift[j] +
    w_j] → (N, D), one fused gather-and-sum with no (N, n-1, D) intermediate. ``known`` (N,
    n-1) bool, where the tables hold no row for a word that is not known: only those
    positions add."""
    if known is None:
        return F.embedding_bag(ctx + shift, tables, mode="sum")
    return F.embedding_bag(ctx.masked_fill(~known, 0) + shift, tables, mode="sum",
                           per_sample_weights=known.to(tables.dtype))


def position_sum_numpy(tables: np.ndarray, ctx: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """:func:`position_sum` (no ``known``: tables with a zero row for the no-word) of a
    tiny batch in numpy, the same sum in the same order: the tiny path's scoring has no
    other torch operation, and one there costs more than its own time (measured on the
    serving benchmark's model, a single row scored 40-80 µs slower with the sum in torch)."""
    return tables[ctx + shift].sum(axis=1)  # type: ignore[no-any-return]


#: Whole numbers up to 2^24 are exact in float32 (the tables' integer fields).
FLOAT_EXACT = 1 << 24


@dataclass(frozen=True)
class ScoringTables:
    """The self-normalised score of a class-output model, or the log-probability of a
    tree-output model, with the diagonal context, as tables a client can evaluate without
    the model (the wire's ``ScoringTablesChunk``, the Moses feature's ``scoring=local``).
    For a canonical row w_1 .. w_{n-1} w_n::

        r = act(Σ_j position[j, w_j])        position (n-1, V, D)
        s = r · output[w_n] + bias[w_n]      output (V, D), bias (V,); natural log
          [+ Σ_l ngram_class[slot(h_l, class[w_n])] + Σ_l ngram_word[slot(h_l, w_n)]]

    which is ``score_ngrams(rows, normalized=False)`` to float rounding. A context id V (a
    word that is not known, ``nlmserve.wire.ngrams``) has no position row and no suffix that
    holds it a feature. The bracketed sums
    are a model's direct n-gram features (``feature_order`` > 0): h_l for the context's
    newest suffixes of length 0 .. feature_order-1 and the slots as
    ``nlmserve.lm.outputs.class_factored.context_hashes`` and ``ngram_feature_index`` make them; a table
    of size 0 adds nothing.

    With ``tree`` (a tree output), ``output`` holds the K node vectors and ``bias`` the
    node biases, and the score is the exact log-probability, a sum over the word's codes
    of products along each code's path (``nlmserve.lm.outputs.tree.TreeOutput``)::

        s = log Σ_{codes of w_n} Π_{(node, bit) on the code} σ(±(r · output[node] + bias[node]))

    ``+`` where the code goes left (bit 1), which is ``score_ngrams(rows)`` (normalised) to
    float rounding; about log2 V dot products per row instead of a normaliser's hundreds.
    """

    position: np.ndarray
    output: np.ndarray
    bias: np.ndarray
    activation: str
    feature_order: int = 0
    word_class: np.ndarray | None = None  # (V,) class ids, with features
    ngram_class: np.ndarray | None = None  # (ngram_class_table,) hashed (suffix, class) weights
    ngram_word: np.ndarray | None = None  # (ngram_word_table,) hashed (suffix, word) weights
    tree: TreePaths | None = None  # a tree output's codes

    @property
    def kind(self) -> str:
        """The wire's ``output``: "class" (the self-normalised score) or "tree" (exact)."""
        return "class" if self.tree is None else "tree"

    @property
    def feature_tables(self) -> tuple[int, int]:
        """Sizes of the two hashed tables (0, 0 without features)."""
        return (0 if self.ngram_class is None else self.ngram_class.size,
                0 if self.ngram_word is None else self.ngram_word.size)

    def flat(self) -> np.ndarray:
        """The tables as the one float32 array the wire streams: position, output, bias;
        with features the word classes (ids, exact in float32: below 2^24), ngram_class and
        ngram_word; with a tree its code_start, step_start and steps (``TreePaths``, whole
        numbers below 2^24; UnsupportedModelError for a tree too large for that)."""
        parts = [self.position.reshape(-1), self.output.reshape(-1), self.bias]
        if self.feature_order:
            assert self.word_class is not None
            parts.append(self.word_class.astype(np.float32))
            parts.extend(t for t in (self.ngram_class, self.ngram_word) if t is not None)
        if self.tree is not None:
            ints = (self.tree.code_start, self.tree.step_start, self.tree.steps)
            if max(int(a.max()) for a in ints) >= FLOAT_EXACT:
                raise UnsupportedModelError(f"no scoring tables: the tree's paths do not fit them (steps or "
                                            f"ids of {FLOAT_EXACT:,} or more)")
            parts.extend(a.astype(np.float32) for a in ints)
        return np.concatenate([p.astype(np.float32, copy=False) for p in parts])

    def score(self, rows: npt.ArrayLike) -> np.ndarray:
        """The formula above for canonical rows (N, n) → float32 (N,) (the reference the
        C++ evaluation is tested against)."""
        rows = np.asarray(rows, dtype=np.int64)
        n1, V, D = self.position.shape
        with torch.inference_mode():
            with warnings.catch_warnings():  # a mapped tables file is read-only; nothing writes here
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                tables = torch.from_numpy(self.position.reshape(n1 * V, D))
            ctx = torch.from_numpy(rows[:, :n1])
            summed = position_sum(tables, ctx, torch.arange(n1) * V, known=ctx < no_word_id(V))  # (N, D)
            r = activate(summed, self.activation).numpy()
        t = rows[:, n1]
        if self.tree is not None:
            return self._tree_score(r, t)
        s = np.einsum("nd,nd->n", r, self.output[t]) + self.bias[t]
        if self.feature_order:
            assert self.word_class is not None
            h = context_hashes(torch.from_numpy(rows[:, n1 - (self.feature_order - 1):n1]), no_word=no_word_id(V))
            has = (h != NO_HASH).numpy()
            for table, y in ((self.ngram_class, self.word_class[t]), (self.ngram_word, t)):
                if table is not None:
                    s = s + (table[ngram_feature_index(h, torch.from_numpy(y), table.size).numpy()] * has).sum(axis=1)
        return s.astype(np.float32)  # type: ignore[no-any-return]

    def _tree_score(self, r: np.ndarray, target: np.ndarray) -> np.ndarray:
        assert self.tree is not None
        paths = self.tree
        out = np.full(target.size, -np.inf)  # <s>: no code
        for i, w in enumerate(target.tolist()):
            per_code = []
            for c in range(int(paths.code_start[w]), int(paths.code_start[w + 1])):
                step = paths.steps[paths.step_start[c]:paths.step_start[c + 1]]
                x = self.output[step >> 1].astype(np.float64) @ r[i] + self.bias[step >> 1]
                per_code.append(-np.logaddexp(0.0, -np.where(step & 1, x, -x)).sum())  # Σ log σ(±x)
            if per_code:
                out[i] = np.logaddexp.reduce(per_code)
        return out.astype(np.float32)


class _InferenceTables:
    """Read-only copies for CPU inference of a class-output model, rebuilt whenever a
    parameter changes in place: the context side here (per-position tables of the diagonal
    context), the output side in ``out`` (``nlmserve.lm.outputs.class_factored.ClassTables``)."""

    def __init__(self, net: NeuralLM) -> None:
        # The network's parameters, listed once (a walk over its modules costs more than a
        # small batch's scoring), and their in-place versions when the copies were made.
        self.params = tuple(net.parameters())
        self.versions = tuple(p._version for p in self.params)
        cfg = net.config
        assert isinstance(net.output, ClassOutput)
        self.out = net.output.inference_tables()
        # Diagonal context: one table per position, q(w) * c_j, stacked ((n-1)·(V+1), D, a
        # zero row for a word that is not known ending each), for ``position_sum``; kept
        # when it fits in ENCODE_TABLE_BYTES.
        self.position_tables: Tensor | None = None
        if cfg.context == "diagonal" and (cfg.order - 1) * cfg.vocab_size * cfg.dim * 4 <= ENCODE_TABLE_BYTES:
            with torch.no_grad():
                self.position_tables = _position_tables(net, no_word_rows=True)
                self.position_shift = torch.arange(cfg.order - 1) * (cfg.vocab_size + 1)
        # With nothing after the sum (no hidden layer, no activation: the recipes' shape), a
        # tiny batch is encoded in numpy from the same tables (position_sum_numpy).
        self.sum_is_r = self.position_tables is not None and net.hidden is None and cfg.activation == "none"
        if self.position_tables is not None:
            self.position_numpy, self.shift_numpy = self.position_tables.numpy(), self.position_shift.numpy()
        self.net = net

    def stale(self) -> bool:
        """Whether a parameter has changed in place since the copies were made (training
        steps and ``load_state_dict`` change parameters in place; none is ever replaced)."""
        return tuple(p._version for p in self.params) != self.versions

    def encode(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) → r (N, E): ``NeuralLM.encode`` with the context sum from the
        position tables where there are some."""
        if self.position_tables is None:
            return self.net.encode(ctx)
        return self.net.finish(position_sum(self.position_tables, ctx, self.position_shift))

    def log_prob_numpy(self, plan: BatchPlan, ctx: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The rows of ``plan`` (``plan_batch`` of ``ctx``, ``target``) as
        ``LanguageModel._score_plan`` scores them, the output side in numpy → float32 (N,)."""
        contexts = ctx[plan.contexts]
        if self.sum_is_r:
            r = position_sum_numpy(self.position_numpy, contexts, self.shift_numpy)
        else:
            r = self.encode(torch.from_numpy(np.ascontiguousarray(contexts))).numpy()
        return self.out.log_prob_numpy(plan, r, target)


__all__ = ["LanguageModel", "ScoringTables", "SentenceScores", "FORMAT_VERSION", "UNK_ID", "BOS_ID", "EOS_ID"]
