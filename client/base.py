"""What the sync and asyncio clients share: settings, security, the balanced channel, and
every client method as a plan of RPCs.

A plan is a generator: it builds the requests (``client.core``), yields them as an
:class:`Rpc` step, is sent the responses, and returns the parsed result. It does no I/O, so
one plan serves both transports: ``LMClient`` performs a step's calls one after the other
with ``grpc``, ``AsyncLMClient`` concurrently with ``grpc.aio``; each retries a call as
its ``RetryPolicy`` says and maps errors with ``core.map_error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Sequence, TypeVar

import numpy as np
from google.protobuf.message import Message

from . import core, replicas
from .core import IdMap, ModelInfo, NgramScores, RetryPolicy, SentenceScore
from ..common.errors import InvalidRequestError
from ..proto import lm_pb2, lm_pb2_grpc

R = TypeVar("R")


@dataclass(frozen=True)
class Rpc:
    """A plan's step: call ``service``'s ``method`` once per request; the plan is sent the
    responses in request order (a list of messages per call for a streaming method).

    Fields:
        method: the RPC's name (``ScoreNgrams``, ``GetVocabulary``, ``ReloadModel``, ...).
        requests: (index of the request's first item, request); the index shifts the item
            named in an InvalidRequestError back to the caller's numbering.
        service: ``"lm"`` (nlmserve.v1.LanguageModel) or ``"admin"`` (nlmserve.v1.Admin).
        stream: the method streams its answer.
        sequential: perform the calls one after the other on every transport.
        retry: retry per the client's RetryPolicy (False: one attempt).
    """

    method: str
    requests: Sequence[tuple[int, Message]]
    service: str = "lm"
    stream: bool = False
    sequential: bool = False
    retry: bool = True


class NeedIdMap:
    """A plan's step: the transport answers with the client's ``IdMap`` (fetched once, under
    the transport's own lock)."""


NEED_ID_MAP = NeedIdMap()

#: A client method: yields steps, is sent their answers, returns the result.
Plan = Generator["Rpc | NeedIdMap", Any, R]


class ClientBase:
    """Builds the one channel a client keeps (arguments documented on ``LMClient``), and
    holds every method as a plan.

    Subclasses say how a channel is opened (``grpc`` or ``grpc.aio``), which lock guards
    the lazily fetched id map, and how a plan's steps are performed.
    """

    def __init__(self, target: str | Sequence[str], *, timeout: float | None = 30.0, retries: int = 5,
                 retry_policy: RetryPolicy | None = None, pack_ids: bool = True,
                 max_message_bytes: int = 64 * 1024 * 1024, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_server_name: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 allow_mixed_models: bool = False) -> None:
        self.endpoint = replicas.endpoint_of(target)
        self.target = self.endpoint.target
        self.timeout = timeout
        self.retry = retry_policy or RetryPolicy(retries=retries)
        self.pack_ids = pack_ids
        self.max_message_bytes = max_message_bytes
        self.security = core.security_of(tls, tls_ca, tls_cert, tls_key, tls_server_name, token, token_file)
        self._metadata = self.security.metadata()
        options = (core.channel_options(max_message_bytes) + self.security.options()
                   + replicas.balancing_options(self.endpoint) + replicas.tls_name_options(self.endpoint, self.security))
        self._channel = self._open_channel(self.target, self.security.credentials(), options)
        self._guard = replicas.ModelGuard(self.target, self.endpoint.replicated, allow_mixed_models)
        self._stubs: dict[str, Any] = {"lm": lm_pb2_grpc.LanguageModelStub(self._channel),
                                       "admin": lm_pb2_grpc.AdminStub(self._channel)}
        self._info: ModelInfo | None = None
        self._idmap: IdMap | None = None
        self._lock = self._make_lock()

    def _make_lock(self) -> Any:
        raise NotImplementedError

    def _open_channel(self, target: str, credentials: Any, options: list[tuple[str, Any]]) -> Any:
        raise NotImplementedError

    def _method(self, step: Rpc) -> Any:
        """The stub's callable for a step."""
        return getattr(self._stubs[step.service], step.method)

    # -------------------------------------------------------------- plans
    def _get_info(self) -> Plan[ModelInfo]:
        """The model's description, fetched once from every ready replica (which must agree)."""
        if self._info is None:
            probes = [(0, lm_pb2.GetModelInfoRequest())] * self.endpoint.probe_calls
            replies = yield Rpc("GetModelInfo", probes, sequential=True)
            self._guard.check(r.model_hash for r in replies)
            self._info = ModelInfo.from_proto(replies[0])
        return self._info

    def _fetch_id_map(self) -> Plan[IdMap]:
        """The server's vocabulary as an IdMap (the transport calls this once, under its lock)."""
        info = yield from self._get_info()
        (chunks,) = yield Rpc("GetVocabulary", [(0, lm_pb2.GetVocabularyRequest())], stream=True)
        return IdMap(core.vocabulary_from_chunks(chunks, info.vocab_size), info)

    def _score_ids(self, ids: np.ndarray, log_base: str, normalized: bool) -> Plan[NgramScores]:
        arr = np.asarray(ids)
        if arr.ndim != 2:
            raise InvalidRequestError(f"ids must be a 2-D array (N, n), got shape {arr.shape}")
        if arr.shape[1] == 0 and arr.shape[0]:
            raise InvalidRequestError("empty n-gram", index=0)
        info = yield from self._get_info()
        rows = core.rows_per_request(info, 4 * max(arr.shape[1], 1), self.max_message_bytes)
        requests = [(start, core.packed_request(chunk, log_base, normalized))
                    for start, chunk in core.id_chunks(arr, rows)]
        responses = yield Rpc("ScoreNgrams", requests)
        result = core.merge_ngram_responses(responses, log_base)
        model_hash = self._guard.check(r.model_hash for r in responses)
        oov = arr[:, -1] == info.unk_id if arr.shape[1] else result.oov
        return NgramScores(result.log_probs, oov, result.log_base, result.normalized, model_hash)

    def _score_ngrams(self, ngrams: Sequence[Sequence[str]], log_base: str, normalized: bool) -> Plan[NgramScores]:
        if self.pack_ids:
            idmap: IdMap = yield NEED_ID_MAP
            ids, oov = idmap.pack(ngrams)
            scores = yield from self._score_ids(ids, log_base, normalized)
            return NgramScores(scores.log_probs, oov, scores.log_base, scores.normalized, scores.model_hash)
        info = yield from self._get_info()
        responses = yield Rpc("ScoreNgrams", list(core.string_requests(ngrams, info, self.max_message_bytes,
                                                                       log_base, normalized)))
        result = core.merge_ngram_responses(responses, log_base)
        model_hash = self._guard.check(r.model_hash for r in responses)
        return NgramScores(result.log_probs, result.oov, result.log_base, result.normalized, model_hash)

    def _score_sentences(self, sentences: Sequence[str], bos: bool, eos: bool, log_base: str,
                         normalized: bool) -> Plan[list[SentenceScore]]:
        info = yield from self._get_info()
        responses = yield Rpc("ScoreSentences", list(core.sentence_requests(
            sentences, info, self.max_message_bytes, bos=bos, eos=eos, log_base=log_base, normalized=normalized)))
        self._guard.check(r.model_hash for r in responses)
        return core.merge_sentence_responses(responses, log_base)

    def _reload_model(self, path: str) -> Plan[ModelInfo]:
        if self.endpoint.replicated:
            raise ValueError(f"{self.target} is replicated: reload each replica through its own address")
        (reply,) = yield Rpc("ReloadModel", [(0, lm_pb2.ReloadModelRequest(path=path))], service="admin",
                             retry=False)
        self._info = ModelInfo.from_proto(reply)
        self._guard.pin(reply.model_hash)
        return self._info
