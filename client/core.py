"""What the sync and asyncio clients share: result types, request building, chunking,
response merging, the retry policy and the mapping of gRPC errors to nlmserve errors.

Only grpc, protobuf, numpy and the wire rules (``nlmserve.wire``: n-grams, log bases, token
files, retried codes) are imported here (never torch, nor ``nlmserve.lm``): a decoder host
needs no more.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import grpc
import numpy as np

from ..common.errors import (
    InputError, InvalidRequestError, NlmserveError, OverloadedError, RequestTimeoutError, RpcError, ServerUnavailableError,
)
from ..common.perplexity import from_log10
from ..proto import lm_pb2
from ..wire.logbase import is_log10
from ..wire.ngrams import pack_ngrams
from ..wire.status import NOT_HTTP2, retryable
from ..wire.tokens import read_tokens


@dataclass(frozen=True)
class ModelInfo:
    """What the server says about its model (GetModelInfo)."""

    order: int
    vocab_size: int
    num_classes: int
    objective: str
    output_type: str
    model_hash: str
    format_version: int
    device: str
    bos_id: int
    eos_id: int
    unk_id: int
    self_normalized: bool
    max_ngrams_per_request: int
    lowercase: bool

    @classmethod
    def from_proto(cls, m: lm_pb2.ModelInfo) -> "ModelInfo":
        return cls(
            order=m.order, vocab_size=m.vocab_size, num_classes=m.num_classes, objective=m.objective,
            output_type=m.output_type, model_hash=m.model_hash, format_version=m.format_version,
            device=m.device, bos_id=m.bos_id, eos_id=m.eos_id, unk_id=m.unk_id,
            self_normalized=m.self_normalized, max_ngrams_per_request=m.max_ngrams_per_request or 200_000,
            lowercase=m.lowercase,
        )


@dataclass(frozen=True)
class NgramScores:
    """One score per n-gram, in request order.

    Fields:
        log_probs: float32 (N,), in ``log_base``.
        oov: bool (N,), the predicted word is not in the vocabulary.
        log_base: ``"log10"`` or ``"ln"``.
        normalized: the values are exact log-probabilities (False only for unnormalised
            scores of a self-normalised model).
        model_hash: the model that scored them.
    """

    log_probs: np.ndarray
    oov: np.ndarray
    log_base: str = "log10"
    normalized: bool = True
    model_hash: str = ""


@dataclass(frozen=True)
class SentenceScore:
    """Per-token scores of one sentence (its tokens, then ``</s>`` when eos), KenLM style.

    Fields:
        token_log_probs: float32 (T,), in ``log_base``.
        oov: bool (T,).
        ngram_lengths: uint32 (T,), words of history used, ``<s>`` included, capped at the order.
        total: the sum of ``token_log_probs`` (float64).
        log_base: ``"log10"`` or ``"ln"``.
    """

    token_log_probs: np.ndarray
    oov: np.ndarray
    ngram_lengths: np.ndarray
    total: float
    log_base: str = "log10"


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for UNAVAILABLE and CANCELLED (a server shutting down), and
    RESOURCE_EXHAUSTED from overload.

    Fields:
        retries: extra attempts after the first (0: no retry).
        initial_backoff: seconds before the first retry.
        max_backoff: cap on one wait.
        multiplier: growth of the wait per attempt.
        retry_overloaded: also retry RESOURCE_EXHAUSTED answers that mean "queue full"
            (never those about message size, which cannot succeed on retry).
    """

    retries: int = 5
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    retry_overloaded: bool = True

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0-based), with ±20% jitter."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        return base * random.uniform(0.8, 1.2)

    def should_retry(self, error: grpc.RpcError, attempt: int) -> bool:
        """Whether retry ``attempt`` (0-based) of ``error``'s call is made: within the budget,
        for a code the wire's rule retries (``nlmserve.wire.status.retryable``)."""
        if attempt >= self.retries:
            return False
        return retryable(error.code(), error.details() or "", self.retry_overloaded)


_ITEM = re.compile(r"^item (\d+): (.*)$", re.S)


def connection_hint(details: str, tls: bool | None) -> str:
    """What a failed connection's details suggest about a TLS mismatch ("" when nothing):
    a TLS server closes a plaintext client's connection at once ("Socket closed"); a TLS
    client's handshake with a plaintext server fails with WRONG_VERSION_NUMBER."""
    if tls is False and "Socket closed" in details:
        return (" (the server closed the connection at once, as a TLS server does to a plaintext client: "
                "if it serves TLS, connect with --tls or --tls-ca, in Python tls=True or tls_ca=)")
    if tls and "WRONG_VERSION_NUMBER" in details:
        return " (the TLS handshake got no TLS answer: the server may serve plaintext; connect without TLS)"
    if NOT_HTTP2 in details:
        return (" (something answers at that address, but not gRPC: check the port, e.g. not the server's "
                "metrics port; `nlmserve serve` prints the port it listens on)")
    if tls and "CERTIFICATE_VERIFY_FAILED" in details:
        return " (the server's certificate is not signed by a CA this client trusts: check --tls-ca)"
    return ""


def map_error(error: grpc.RpcError, index_offset: int = 0, tls: bool | None = None) -> NlmserveError:
    """The nlmserve error for a failed RPC; item indices shifted by ``index_offset`` (chunking);
    ``tls`` (whether the client uses TLS) lets a refused connection say what may be wrong."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        m = _ITEM.match(details)
        if m:
            return InvalidRequestError(m.group(2), index=int(m.group(1)) + index_offset)
        return InvalidRequestError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return ServerUnavailableError(f"server unavailable ({code.name}): {details}{connection_hint(details, tls)}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeoutError(f"deadline exceeded: {details}")
    return RpcError(f"{code.name}: {details}", code)


def log_base_enum(log_base: str) -> Any:
    """The wire's LogBase for a ``log_base`` name (ValueError for another name)."""
    return lm_pb2.LOG10 if is_log10(log_base) else lm_pb2.LN


# ------------------------------------------------------------------ vocabulary and packing
class IdMap:
    """The server's word → id map, for packing n-grams on the client."""

    def __init__(self, words: Sequence[str], info: ModelInfo) -> None:
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.lowercase = info.lowercase
        self.order = info.order
        self.unk_id, self.bos_id = info.unk_id, info.bos_id

    def __contains__(self, word: str) -> bool:
        return (word.lower() if self.lowercase else word) in self.index

    def pack(self, ngrams: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """n-grams of words → (ids (N, order) uint32 left-padded with ``<s>``, oov (N,))
        (``nlmserve.wire.ngrams.pack_ngrams``, as the server maps string n-grams)."""
        return pack_ngrams(ngrams, self.index, self.order, lowercase=self.lowercase, dtype=np.uint32,
                           unk_id=self.unk_id, bos_id=self.bos_id)


def vocabulary_from_chunks(chunks: Sequence[lm_pb2.VocabularyChunk], vocab_size: int) -> list[str]:
    words: list[str] = [""] * vocab_size
    for chunk in chunks:
        words[chunk.offset : chunk.offset + len(chunk.words)] = list(chunk.words)
    return words


# ------------------------------------------------------------------ chunking
def id_chunks(ids: np.ndarray, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, max(len(ids), 1), rows_per_chunk):
        yield start, ids[start : start + rows_per_chunk]


def rows_per_request(info: ModelInfo, row_bytes: int, max_message_bytes: int) -> int:
    """Rows that fit in one request: the server's item limit and 90% of the message size."""
    by_bytes = max(1, int(0.9 * max_message_bytes) // max(1, row_bytes))
    return max(1, min(info.max_ngrams_per_request, by_bytes))


def packed_request(ids: np.ndarray, log_base: str, normalized: bool) -> lm_pb2.ScoreNgramsRequest:
    a = np.ascontiguousarray(ids, dtype="<u4")
    if a.ndim != 2:
        raise InvalidRequestError(f"ids must be a 2-D array (N, n), got shape {a.shape}")
    return lm_pb2.ScoreNgramsRequest(
        packed_ids=a.tobytes(), packed_order=a.shape[1], log_base=log_base_enum(log_base),
        allow_unnormalized=not normalized,
    )


def string_requests(ngrams: Sequence[Sequence[str]], info: ModelInfo, max_message_bytes: int, log_base: str,
                    normalized: bool) -> Iterator[tuple[int, lm_pb2.ScoreNgramsRequest]]:
    """String n-gram requests within the item and byte limits, with their first index."""
    budget = int(0.9 * max_message_bytes)
    start, size = 0, 0
    for i, ng in enumerate(ngrams):
        cost = 4 + sum(len(w) + 3 for w in ng)
        if i > start and (i - start >= info.max_ngrams_per_request or size + cost > budget):
            yield start, _strings_request(ngrams[start:i], log_base, normalized)
            start, size = i, 0
        size += cost
    if len(ngrams) > start or not ngrams:
        yield start, _strings_request(ngrams[start:], log_base, normalized)


def _strings_request(ngrams: Sequence[Sequence[str]], log_base: str, normalized: bool) -> lm_pb2.ScoreNgramsRequest:
    return lm_pb2.ScoreNgramsRequest(
        ngrams=[lm_pb2.NgramStrings(words=list(ng)) for ng in ngrams],
        log_base=log_base_enum(log_base), allow_unnormalized=not normalized,
    )


def sentence_requests(sentences: Sequence[str], info: ModelInfo, max_message_bytes: int, *, bos: bool, eos: bool,
                      log_base: str, normalized: bool) -> Iterator[tuple[int, lm_pb2.ScoreSentencesRequest]]:
    """Sentence requests within the server's token limit and the byte limit."""
    budget = int(0.9 * max_message_bytes)

    def make(batch: Sequence[str]) -> lm_pb2.ScoreSentencesRequest:
        return lm_pb2.ScoreSentencesRequest(sentences=list(batch), bos=bos, eos=eos,
                                            log_base=log_base_enum(log_base), allow_unnormalized=not normalized)

    start, tokens, size = 0, 0, 0
    for i, s in enumerate(sentences):
        t = len(s.split()) + int(eos)
        cost = len(s) + 4
        if i > start and (tokens + t > info.max_ngrams_per_request or size + cost > budget):
            yield start, make(sentences[start:i])
            start, tokens, size = i, 0, 0
        tokens += t
        size += cost
    if len(sentences) > start or not sentences:
        yield start, make(sentences[start:])


# ------------------------------------------------------------------ merging
def merge_ngram_responses(responses: Sequence[lm_pb2.ScoreNgramsResponse], log_base: str,
                          oov: np.ndarray | None = None) -> NgramScores:
    if responses:
        lp = np.concatenate([np.asarray(r.log_probs, dtype=np.float32) for r in responses])
        server_oov = np.concatenate([np.asarray(r.oov, dtype=bool) for r in responses])
        normalized = all(r.normalized for r in responses)
        model_hash = responses[0].model_hash
    else:
        lp, server_oov, normalized, model_hash = np.empty(0, np.float32), np.empty(0, bool), True, ""
    return NgramScores(lp, server_oov if oov is None else oov, log_base, normalized, model_hash)


def merge_sentence_responses(responses: Sequence[lm_pb2.ScoreSentencesResponse], log_base: str) -> list[SentenceScore]:
    out = []
    for r in responses:
        for s in r.sentences:
            out.append(SentenceScore(
                np.asarray(s.token_log_probs, dtype=np.float32), np.asarray(s.oov, dtype=bool),
                np.asarray(s.ngram_lengths, dtype=np.uint32), float(s.total), log_base,
            ))
    return out


def full_scores_tuples(score: SentenceScore) -> Iterator[tuple[float, int, bool]]:
    """KenLM's ``full_scores`` triples: (log prob, n-gram length, oov)."""
    for lp, n, o in zip(score.token_log_probs.tolist(), score.ngram_lengths.tolist(), score.oov.tolist()):
        yield float(lp), int(n), bool(o)


def perplexity_of(total_log10: float, sentence: str, eos: bool = True) -> float:
    """KenLM's ``perplexity``: 10 ** (-score / (words + 1))."""
    words = len(sentence.split()) + int(eos)
    return from_log10(total_log10, max(words, 1))


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
    ]


# ------------------------------------------------------------------ security
@dataclass(frozen=True)
class Security:
    """How a client reaches a secured server.

    Fields:
        tls: use TLS (implied by any of the files below); without ``tls_ca`` the system's
            root certificates verify the server.
        tls_ca: PEM file of the CA that signed the server's certificate.
        tls_cert: PEM client certificate, for servers that require one (mutual TLS).
        tls_key: PEM private key of ``tls_cert``.
        tls_server_name: the name to check the server's certificate against, when it
            differs from the host in the target (e.g. connecting by IP address).
        token: bearer token sent as ``authorization: Bearer <token>`` on every call.
    """

    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("a token must be non-empty and hold no whitespace")

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_cert is not None

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials for TLS (None: plaintext)."""
        if not self.uses_tls:
            return None
        ca = _read_pem(self.tls_ca, "TLS CA") if self.tls_ca else None
        key = _read_pem(self.tls_key, "TLS key") if self.tls_key else None
        cert = _read_pem(self.tls_cert, "TLS certificate") if self.tls_cert else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []


def _read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}", path) from e


def read_token_file(path: str) -> str:
    """The first token in a token file (one per line; blank and ``#`` lines skipped; the
    rule is ``nlmserve.wire.tokens``')."""
    return read_tokens(path)[0]


def security_of(tls: bool, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
                tls_server_name: str | None, token: str | None, token_file: str | None) -> Security:
    """The client constructors' security arguments as one ``Security``."""
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token_file is not None:
        token = read_token_file(token_file)
    return Security(tls, tls_ca, tls_cert, tls_key, tls_server_name, token)

