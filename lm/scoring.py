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
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from nlmserve.errors import InvalidRequestError
from nlmserve.lm.model import ModelConfig, NeuralLM
from nlmserve.lm.model_file import FORMAT_VERSION, ModelFile, read_model_file
from nlmserve.lm.vocab import BOS_ID, EOS_ID, UNK_ID, Vocabulary

log = logging.getLogger(__name__)

LOG10_E = 1.0 / math.log(10.0)
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


class LanguageModel:
    """A loaded model: vocabulary, classes, network on ``device``, batch scoring."""

    def __init__(self, model_file: ModelFile, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
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

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: str | torch.device | None = None) -> "LanguageModel":
        """Read and verify ``path`` (ModelFileError on any problem) and move it to ``device``
        (None: cuda if available, else cpu)."""
        return cls(read_model_file(path), device)

    # ------------------------------------------------------------------ properties
    @property
    def order(self) -> int:
        return self.config.order

    @property
    def output_type(self) -> str:
        return self.config.output

    @property
    def self_normalized(self) -> bool:
        """Unnormalised scores approximate log-probabilities (NCE with fixed normalisers)."""
        return self.objective == "nce"

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
            f"objective={self.objective}, hash={self.model_hash[:12]}, device={self.device})"
        )

    # ------------------------------------------------------------------ validation
    def validate_ngrams(self, ids: Any) -> np.ndarray:
        """Check an (N, n) id array; returns it as int64. InvalidRequestError names the row."""
        arr = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
        if arr.ndim != 2:
            raise InvalidRequestError(f"n-gram ids must be a 2-D array (N, n), got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequestError(f"n-gram ids must be integers, got {arr.dtype}")
        n = arr.shape[1]
        if arr.shape[0] == 0:
            return np.empty((0, min(max(n, 1), self.order)), dtype=np.int64)
        if n == 0:
            raise InvalidRequestError("empty n-gram", index=0)
        if n > self.order:
            raise InvalidRequestError(f"n-gram of length {n} is longer than the model order {self.order}", index=0)
        arr = arr.astype(np.int64, copy=False)
        bad = (arr < 0) | (arr >= len(self.vocab))
        if bad.any():
            i = int(np.flatnonzero(bad.any(axis=1))[0])
            raise InvalidRequestError(f"word id out of range [0, {len(self.vocab)}): {arr[i].tolist()}", index=i)
        bos = arr[:, -1] == BOS_ID
        if bos.any():
            i = int(np.flatnonzero(bos)[0])
            raise InvalidRequestError("<s> cannot be the predicted word", index=i)
        return arr

    # ------------------------------------------------------------------ pieces for the server
    def prepare_contexts(self, ids: Any) -> tuple[Tensor, Tensor]:
        """Validate (N, n) ids and normalise their contexts → (ctx (N, order-1), target (N,))
        as LongTensors on ``self.device``."""
        arr = self.validate_ngrams(ids)
        n1 = self.order - 1
        N = arr.shape[0]
        ctx = np.full((N, n1), BOS_ID, dtype=np.int64)
        given = arr[:, :-1][:, max(0, arr.shape[1] - 1 - n1) :]  # (N, <= n-1), newest last
        if given.shape[1]:
            ctx[:, n1 - given.shape[1] :] = given
        # Everything left of the newest <s> becomes <s>: reverse cumulative OR of is-<s>.
        is_bos = ctx == BOS_ID
        left_of_bos = np.flip(np.logical_or.accumulate(np.flip(is_bos, axis=1), axis=1), axis=1)
        ctx[left_of_bos] = BOS_ID
        target = arr[:, -1]
        return (
            torch.from_numpy(ctx).to(self.device),
            torch.from_numpy(np.ascontiguousarray(target)).to(self.device),
        )

    def encode_contexts(self, ctx: Tensor) -> Tensor:
        """ctx (N, order-1) → r (N, E)."""
        with torch.inference_mode():
            return self.net.encode(ctx)

    def class_log_normalizer(self, r: Tensor) -> Tensor:
        """log Σ_c exp s_c(h) → (N,); zeros for the softmax output."""
        with torch.inference_mode():
            return self.net.class_log_normalizer(r)

    def in_class_log_normalizer(self, r: Tensor, cls: Tensor) -> Tensor:
        """log Σ_{w ∈ cls} exp s_w(h) → (N,); the full-softmax log Z for the softmax output
        (``cls`` ignored)."""
        with torch.inference_mode():
            return self.net.in_class_log_normalizer(r, cls)

    def word_classes(self, target: Tensor) -> Tensor:
        """Class id of each target (zeros for the softmax output)."""
        if self.config.output == "softmax":
            return torch.zeros_like(target)
        return self.net.word_class[target]

    def raw_scores(self, r: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """(class_score (N,), word_score (N,)); class_score is 0 for the softmax output.
        log p = class_score - class_lognorm + word_score - in_class_lognorm."""
        with torch.inference_mode():
            word = self.net.word_score(r, target)
            if self.config.output == "softmax":
                return torch.zeros_like(word), word
            return self.net.class_score(r, self.net.word_class[target]), word

    # ------------------------------------------------------------------ batch scoring
    def score_ngrams(self, ids: Any, *, normalized: bool = True, log10: bool = False) -> np.ndarray:
        """log P(last | rest) for each row of an (N, n) id array → float32 (N,).

        ``normalized=False`` returns the unnormalised score when the model is
        self-normalised (NCE); other models always return normalised values.
        """
        arr = self.validate_ngrams(ids)
        out = np.empty(arr.shape[0], dtype=np.float32)
        use_raw = not normalized and self.self_normalized
        chunk = CHUNK if use_raw else min(CHUNK, self.net.scoring_chunk())
        with torch.inference_mode():
            for start in range(0, arr.shape[0], chunk):
                ctx, target = self.prepare_contexts(arr[start : start + chunk])
                lp = self.net.log_prob(ctx, target, normalized=not use_raw)
                out[start : start + chunk] = lp.float().cpu().numpy()
        if log10:
            out *= np.float32(LOG10_E)
        return out

    def sentence_ngrams(
        self, sentences: Sequence[Sequence[str]], *, bos: bool = True, eos: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """All n-grams of ``sentences`` → (ids (T, order), oov (T,), ngram_len (T,), sentence
        index (T,)). Words are lowercased first when the model was trained lowercased."""
        n = self.order
        rows: list[np.ndarray] = []
        oovs: list[np.ndarray] = []
        lens: list[np.ndarray] = []
        owner: list[np.ndarray] = []
        for s_idx, words in enumerate(sentences):
            toks = [w.lower() for w in words] if self.lowercase else list(words)
            ids = self.vocab.encode(toks).astype(np.int64)
            if (ids == BOS_ID).any():
                raise InvalidRequestError("<s> inside a sentence cannot be predicted", index=s_idx)
            oov = np.array([t not in self.vocab for t in toks], dtype=bool)
            if eos:
                ids = np.append(ids, EOS_ID)
                oov = np.append(oov, False)
            T = len(ids)
            if T == 0:
                continue
            # Padded history: n-1 <s> then the sentence; row t = padded[t : t + n].
            padded = np.concatenate([np.full(n - 1, BOS_ID, dtype=np.int64), ids])
            windows = np.lib.stride_tricks.sliding_window_view(padded, n)[:T]  # (T, n)
            rows.append(windows)
            oovs.append(oov)
            avail = np.arange(1, T + 1) + (1 if bos else 0)  # tokens incl. this one (+ <s>)
            lens.append(np.minimum(avail, n).astype(np.uint32))
            owner.append(np.full(T, s_idx, dtype=np.int64))
        if not rows:
            empty = np.empty(0, dtype=np.int64)
            return np.empty((0, n), dtype=np.int64), np.empty(0, dtype=bool), empty.astype(np.uint32), empty
        return np.concatenate(rows), np.concatenate(oovs), np.concatenate(lens), np.concatenate(owner)

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


__all__ = ["LanguageModel", "SentenceScores", "FORMAT_VERSION", "UNK_ID", "BOS_ID", "EOS_ID"]
