"""``AsyncLMClient``: the asyncio client (grpc.aio); the methods of ``LMClient`` as coroutines.

    async with AsyncLMClient("127.0.0.1:50051") as lm:
        total = await lm.score("this is a sentence")

``word in client`` needs the vocabulary: await ``client.vocabulary()`` once first, or use
``await client.contains(word)``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import grpc
import numpy as np
from grpc import aio

from nlmserve.client import core, replicas
from nlmserve.client.base import ClientBase
from nlmserve.client.core import IdMap, ModelInfo, NgramScores, RetryPolicy, SentenceScore
from nlmserve.errors import InvalidRequestError
from nlmserve.proto import lm_pb2, lm_pb2_grpc

log = logging.getLogger(__name__)

R = TypeVar("R")


class AsyncLMClient(ClientBase):
    """Asyncio client; arguments (replicas too) as :class:`nlmserve.client.LMClient`. Create it inside
    the event loop."""

    def _make_lock(self) -> Any:
        return asyncio.Lock()

    def _open_channel(self, target: str, credentials: Any, options: list[tuple[str, Any]]) -> Any:
        if credentials is None:
            return aio.insecure_channel(target, options=options)
        return aio.secure_channel(target, credentials, options=options)

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> "AsyncLMClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -------------------------------------------------------------- model
    async def get_info(self) -> ModelInfo:
        """The model's description (fetched once; from every ready replica, which must agree)."""
        if self._info is None:
            replies = [await self._call(self._stub.GetModelInfo, lm_pb2.GetModelInfoRequest())
                       for _ in range(self.endpoint.probe_calls)]
            self._guard.check(r.model_hash for r in replies)
            self._info = ModelInfo.from_proto(replies[0])
        return self._info

    @property
    def info(self) -> ModelInfo:
        """The model's description; available after the first call (or ``await get_info()``)."""
        if self._info is None:
            raise RuntimeError("await client.get_info() first")
        return self._info

    @property
    def order(self) -> int:
        return self.info.order

    async def vocabulary(self) -> dict[str, int]:
        return dict((await self._ids()).index)

    async def contains(self, word: str) -> bool:
        return word in await self._ids()

    def __contains__(self, word: str) -> bool:
        if self._idmap is None:
            raise RuntimeError("await client.vocabulary() first, or use await client.contains(word)")
        return word in self._idmap

    async def _ids(self) -> IdMap:
        async with self._lock:
            if self._idmap is None:
                info = await self.get_info()

                async def fetch(req: lm_pb2.GetVocabularyRequest, **kw: Any) -> list[Any]:
                    return [chunk async for chunk in self._stub.GetVocabulary(req, **kw)]

                chunks = await self._call(fetch, lm_pb2.GetVocabularyRequest())
                self._idmap = IdMap(core.vocabulary_from_chunks(chunks, info.vocab_size), info)
            return self._idmap

    # -------------------------------------------------------------- scoring
    async def score_ids(self, ids: np.ndarray, log_base: str = "log10", normalized: bool = True) -> NgramScores:
        arr = np.asarray(ids)
        if arr.ndim != 2:
            raise InvalidRequestError(f"ids must be a 2-D array (N, n), got shape {arr.shape}")
        if arr.shape[1] == 0 and arr.shape[0]:
            raise InvalidRequestError("empty n-gram", index=0)
        info = await self.get_info()
        rows = core.rows_per_request(info, 4 * max(arr.shape[1], 1), self.max_message_bytes)
        responses = await asyncio.gather(*[
            self._call(self._stub.ScoreNgrams, core.packed_request(chunk, log_base, normalized), start)
            for start, chunk in core.id_chunks(arr, rows)
        ])
        result = core.merge_ngram_responses(responses, log_base)
        model_hash = self._guard.check(r.model_hash for r in responses)
        oov = arr[:, -1] == info.unk_id if arr.shape[1] else result.oov
        return NgramScores(result.log_probs, oov, result.log_base, result.normalized, model_hash)

    async def score_ngrams(self, ngrams: Sequence[Sequence[str]], log_base: str = "log10",
                           normalized: bool = True) -> NgramScores:
        if self.pack_ids:
            ids, oov = (await self._ids()).pack(ngrams)
            scores = await self.score_ids(ids, log_base, normalized)
            return NgramScores(scores.log_probs, oov, scores.log_base, scores.normalized, scores.model_hash)
        info = await self.get_info()
        responses = await asyncio.gather(*[
            self._call(self._stub.ScoreNgrams, req, start)
            for start, req in core.string_requests(ngrams, info, self.max_message_bytes, log_base, normalized)
        ])
        result = core.merge_ngram_responses(responses, log_base)
        model_hash = self._guard.check(r.model_hash for r in responses)
        return NgramScores(result.log_probs, result.oov, result.log_base, result.normalized, model_hash)

    async def score_sentences(self, sentences: Sequence[str], bos: bool = True, eos: bool = True,
                              log_base: str = "log10", normalized: bool = True) -> list[SentenceScore]:
        info = await self.get_info()
        responses = await asyncio.gather(*[
            self._call(self._stub.ScoreSentences, req, start)
            for start, req in core.sentence_requests(sentences, info, self.max_message_bytes, bos=bos, eos=eos,
                                                     log_base=log_base, normalized=normalized)
        ])
        self._guard.check(r.model_hash for r in responses)
        return core.merge_sentence_responses(responses, log_base)

    async def reload_model(self, path: str = "") -> ModelInfo:
        """Admin/ReloadModel: the server loads ``path`` (empty: its ``--model``) and serves it.

        Not retried. Returns the new model's info; ``RpcError`` with FAILED_PRECONDITION when
        the server refused the file (it keeps serving the old model), PERMISSION_DENIED or
        UNAUTHENTICATED when this client may not reload. A replicated client refuses
        (``ValueError``): reload replicas one by one through their own addresses.
        """
        if self.endpoint.replicated:
            raise ValueError(f"{self.target} is replicated: reload each replica through its own address")
        try:
            reply = await self._admin.ReloadModel(lm_pb2.ReloadModelRequest(path=path), timeout=self.timeout,
                                                  metadata=self._metadata)
        except grpc.RpcError as e:
            raise core.map_error(e) from e
        self._info = ModelInfo.from_proto(reply)
        self._guard.pin(reply.model_hash)
        return self._info

    async def score(self, sentence: str, bos: bool = True, eos: bool = True) -> float:
        return (await self.score_sentences([sentence], bos=bos, eos=eos))[0].total

    async def full_scores(self, sentence: str, bos: bool = True, eos: bool = True) -> list[tuple[float, int, bool]]:
        return list(core.full_scores_tuples((await self.score_sentences([sentence], bos=bos, eos=eos))[0]))

    async def perplexity(self, sentence: str) -> float:
        return core.perplexity_of(await self.score(sentence), sentence)

    # -------------------------------------------------------------- transport
    async def _call(self, method: Callable[..., Awaitable[R]], request: Any, index_offset: int = 0) -> R:
        attempt = 0
        while True:
            try:
                return await method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:  # aio.AioRpcError
                if not self.retry.should_retry(e, attempt):
                    raise core.map_error(e, index_offset) from e
                wait = self.retry.delay(attempt)
                log.info("%s from %s; retry %s in %.3f s", e.code().name, self.target, attempt + 1, wait)
                await asyncio.sleep(wait)
                attempt += 1
