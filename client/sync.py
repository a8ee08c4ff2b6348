"""``LMClient``: the blocking client, with a KenLM-shaped surface.

    with LMClient("127.0.0.1:50051", timeout=30.0) as lm:
        lm.score("this is a sentence")          # log10, as kenlm.Model.score
        lm.score_ngrams([["is", "a"], ["a", "sentence"]]).log_probs

    LMClient(["10.0.0.1:50051", "10.0.0.2:50051"])   # replicas, or "a:1,b:2", or "dns:///lm:50051"

One channel for the client's life (TLS and a bearer token when the server needs them). Each RPC gets ``timeout`` seconds; UNAVAILABLE (and
RESOURCE_EXHAUSTED from a full queue) is retried with exponential backoff, then
``ServerUnavailableError`` (``OverloadedError``). Inputs larger than the server's
``max_ngrams_per_request`` or the message size are split and the results joined in order.
Several replicas are balanced by gRPC's ``round_robin`` policy with client-side health
checking; a request that failed on a dying replica is retried on another one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar

import grpc
import numpy as np

from nlmserve.client import core, replicas
from nlmserve.client.base import ClientBase
from nlmserve.client.core import IdMap, ModelInfo, NgramScores, RetryPolicy, SentenceScore
from nlmserve.errors import InvalidRequestError
from nlmserve.proto import lm_pb2, lm_pb2_grpc

log = logging.getLogger(__name__)

R = TypeVar("R")


class LMClient(ClientBase):
    """Blocking client for ``nlmserve.v1.LanguageModel``; thread-safe.

    Args:
        target: ``host:port`` of the server; or replicas serving the same model file: a list
            of ``host:port``, a comma-separated string of them, or ``dns:///name:port``
            (every address the name resolves to). Replicas are balanced by gRPC's
            ``round_robin`` policy; one whose grpc.health.v1 check fails gets no requests.
        timeout: seconds per RPC (a deadline the server honours too).
        retries: extra attempts on UNAVAILABLE / overload (``retry_policy`` for more control).
        pack_ids: score string n-grams by mapping them to ids here and sending packed ids
            (the fast path; fetches the vocabulary once). False sends the strings.
        max_message_bytes: the largest message sent or accepted.
        tls: use TLS with the system's root certificates (implied by ``tls_ca``/``tls_cert``).
        tls_ca: PEM CA file that signed the server's certificate.
        tls_cert, tls_key: PEM client certificate and key, for servers that require one.
        tls_server_name: the name the server's certificate is checked against, when it
            is not the host in ``target``.
        token: bearer token for servers started with ``--token-file``; ``token_file``
            reads it (the first token) from such a file instead.
        allow_mixed_models: replicated targets only: accept answers from replicas that serve
            different models (during a rolling reload) instead of raising
            ``ModelMismatchError``; the result's ``model_hash`` then names every model used.
    """

    def _make_lock(self) -> Any:
        return threading.Lock()

    def _open_channel(self, target: str, credentials: Any, options: list[tuple[str, Any]]) -> Any:
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "LMClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------- model
    @property
    def info(self) -> ModelInfo:
        """The model's description (fetched once; from every ready replica, which must agree)."""
        if self._info is None:
            replies = [self._call(self._stub.GetModelInfo, lm_pb2.GetModelInfoRequest())
                       for _ in range(self.endpoint.probe_calls)]
            self._guard.check(r.model_hash for r in replies)
            self._info = ModelInfo.from_proto(replies[0])
        return self._info

    @property
    def order(self) -> int:
        return self.info.order

    def vocabulary(self) -> dict[str, int]:
        """word → id, fetched once (GetVocabulary) and cached."""
        return dict(self._ids().index)

    def _ids(self) -> IdMap:
        with self._lock:
            if self._idmap is None:
                info = self.info
                chunks = self._call(lambda req, **kw: list(self._stub.GetVocabulary(req, **kw)),
                                    lm_pb2.GetVocabularyRequest())
                self._idmap = IdMap(core.vocabulary_from_chunks(chunks, info.vocab_size), info)
            return self._idmap

    def __contains__(self, word: str) -> bool:
        return word in self._ids()

    # -------------------------------------------------------------- scoring
    def score_ids(self, ids: np.ndarray, log_base: str = "log10", normalized: bool = True) -> NgramScores:
        """Scores of id rows (N, n), oldest first, predicted word last (1 <= n <= order)."""
        arr = np.asarray(ids)
        if arr.ndim != 2:
            raise InvalidRequestError(f"ids must be a 2-D array (N, n), got shape {arr.shape}")
        if arr.shape[1] == 0 and arr.shape[0]:
            raise InvalidRequestError("empty n-gram", index=0)
        rows = core.rows_per_request(self.info, 4 * max(arr.shape[1], 1), self.max_message_bytes)
        responses = []
        for start, chunk in core.id_chunks(arr, rows):
            responses.append(self._call(self._stub.ScoreNgrams, core.packed_request(chunk, log_base, normalized), start))
        result = core.merge_ngram_responses(responses, log_base)
        model_hash = self._guard.check(r.model_hash for r in responses)
        oov = arr[:, -1] == self.info.unk_id if arr.shape[1] else result.oov
        return NgramScores(result.log_probs, oov, result.log_base, result.normalized, model_hash)

    def score_ngrams(self, ngrams: Sequence[Sequence[str]], log_base: str = "log10",
                     normalized: bool = True) -> NgramScores:
        """Scores of word n-grams (oldest first, predicted word last); OOV flags the predicted word."""
        if self.pack_ids:
            ids, oov = self._ids().pack(ngrams)
            scores = self.score_ids(ids, log_base, normalized)
            return NgramScores(scores.log_probs, oov, scores.log_base, scores.normalized, scores.model_hash)
        responses = [self._call(self._stub.ScoreNgrams, req, start) for start, req in
                     core.string_requests(ngrams, self.info, self.max_message_bytes, log_base, normalized)]
        result = core.merge_ngram_responses(responses, log_base)
        model_hash = self._guard.check(r.model_hash for r in responses)
        return NgramScores(result.log_probs, result.oov, result.log_base, result.normalized, model_hash)

    def score_sentences(self, sentences: Sequence[str], bos: bool = True, eos: bool = True,
                        log_base: str = "log10", normalized: bool = True) -> list[SentenceScore]:
        """Per-token scores of whitespace-tokenised sentences (``</s>`` last when eos)."""
        responses = [self._call(self._stub.ScoreSentences, req, start) for start, req in
                     core.sentence_requests(sentences, self.info, self.max_message_bytes, bos=bos, eos=eos,
                                            log_base=log_base, normalized=normalized)]
        self._guard.check(r.model_hash for r in responses)
        return core.merge_sentence_responses(responses, log_base)

    def reload_model(self, path: str = "") -> ModelInfo:
        """Admin/ReloadModel: the server loads ``path`` (empty: its ``--model``) and serves it.

        Not retried. Returns the new model's info; ``RpcError`` with FAILED_PRECONDITION when
        the server refused the file (it keeps serving the old model), PERMISSION_DENIED or
        UNAUTHENTICATED when this client may not reload. A replicated client refuses
        (``ValueError``): reload replicas one by one through their own addresses.
        """
        if self.endpoint.replicated:
            raise ValueError(f"{self.target} is replicated: reload each replica through its own address")
        try:
            reply = self._admin.ReloadModel(lm_pb2.ReloadModelRequest(path=path), timeout=self.timeout,
                                            metadata=self._metadata)
        except grpc.RpcError as e:
            raise core.map_error(e) from e
        with self._lock:
            self._info = ModelInfo.from_proto(reply)
        self._guard.pin(reply.model_hash)
        return self._info

    # -------------------------------------------------------------- KenLM surface
    def score(self, sentence: str, bos: bool = True, eos: bool = True) -> float:
        """log10 probability of the sentence (kenlm.Model.score)."""
        return self.score_sentences([sentence], bos=bos, eos=eos)[0].total

    def full_scores(self, sentence: str, bos: bool = True, eos: bool = True) -> Iterator[tuple[float, int, bool]]:
        """(log10 prob, n-gram length, oov) per token and ``</s>`` (kenlm.Model.full_scores)."""
        return core.full_scores_tuples(self.score_sentences([sentence], bos=bos, eos=eos)[0])

    def perplexity(self, sentence: str) -> float:
        """10 ** (-score / (words + 1)) (kenlm.Model.perplexity)."""
        return core.perplexity_of(self.score(sentence), sentence)

    # -------------------------------------------------------------- transport
    def _call(self, method: Callable[..., R], request: Any, index_offset: int = 0) -> R:
        attempt = 0
        while True:
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if not self.retry.should_retry(e, attempt):
                    raise core.map_error(e, index_offset) from e
                wait = self.retry.delay(attempt)
                log.info("%s from %s; retry %s in %.3f s", e.code().name, self.target, attempt + 1, wait)
                time.sleep(wait)
                attempt += 1
