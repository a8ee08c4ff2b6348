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

from . import core
from .base import ClientBase, NeedIdMap, Plan, Rpc
from .core import IdMap, ModelInfo, NgramScores, SentenceScore

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
        return self._run(self._get_info())

    @property
    def order(self) -> int:
        return self.info.order

    def vocabulary(self) -> dict[str, int]:
        """word → id, fetched once (GetVocabulary) and cached."""
        return dict(self._ids().index)

    def _ids(self) -> IdMap:
        with self._lock:
            if self._idmap is None:
                self._idmap = self._run(self._fetch_id_map())
            return self._idmap

    def __contains__(self, word: str) -> bool:
        return word in self._ids()

    # -------------------------------------------------------------- scoring
    def score_ids(self, ids: np.ndarray, log_base: str = "log10", normalized: bool = True) -> NgramScores:
        """Scores of id rows (N, n), oldest first, predicted word last (1 <= n <= order)."""
        return self._run(self._score_ids(ids, log_base, normalized))

    def score_ngrams(self, ngrams: Sequence[Sequence[str]], log_base: str = "log10",
                     normalized: bool = True) -> NgramScores:
        """Scores of word n-grams (oldest first, predicted word last); OOV flags the predicted word."""
        return self._run(self._score_ngrams(ngrams, log_base, normalized))

    def score_sentences(self, sentences: Sequence[str], bos: bool = True, eos: bool = True,
                        log_base: str = "log10", normalized: bool = True) -> list[SentenceScore]:
        """Per-token scores of whitespace-tokenised sentences (``</s>`` last when eos)."""
        return self._run(self._score_sentences(sentences, bos, eos, log_base, normalized))

    def reload_model(self, path: str = "") -> ModelInfo:
        """Admin/ReloadModel: the server loads ``path`` (empty: its ``--model``) and serves it.

        Not retried. Returns the new model's info; ``RpcError`` with FAILED_PRECONDITION when
        the server refused the file (it keeps serving the old model), PERMISSION_DENIED or
        UNAUTHENTICATED when this client may not reload. A replicated client refuses
        (``ValueError``): reload replicas one by one through their own addresses.
        """
        return self._run(self._reload_model(path))

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
    def _run(self, plan: Plan[R]) -> R:
        """Perform a plan's steps in this thread, one call after the other."""
        try:
            step = next(plan)
            while True:
                step = plan.send(self._ids() if isinstance(step, NeedIdMap) else self._perform(step))
        except StopIteration as done:
            result: R = done.value
            return result

    def _perform(self, step: Rpc) -> list[Any]:
        method = self._method(step)
        if step.stream:
            stream = method

            def method(req: Any, **kw: Any) -> list[Any]:
                return list(stream(req, **kw))

        return [self._call(method, request, start, step.retry) for start, request in step.requests]

    def _call(self, method: Callable[..., R], request: Any, index_offset: int = 0, retry: bool = True) -> R:
        attempt = 0
        while True:
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if not retry or not self.retry.should_retry(e, attempt):
                    raise core.map_error(e, index_offset, self.security.uses_tls) from e
                wait = self.retry.delay(attempt)
                log.info("%s from %s; retry %s in %.3f s", e.code().name, self.target, attempt + 1, wait)
                time.sleep(wait)
                attempt += 1
