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

from . import core
from .base import ClientBase, NeedIdMap, Plan, Rpc
from .core import IdMap, ModelInfo, NgramScores, SentenceScore

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
        return await self._run(self._get_info())

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
                self._idmap = await self._run(self._fetch_id_map())
            return self._idmap

    # -------------------------------------------------------------- scoring
    async def score_ids(self, ids: np.ndarray, log_base: str = "log10", normalized: bool = True) -> NgramScores:
        return await self._run(self._score_ids(ids, log_base, normalized))

    async def score_ngrams(self, ngrams: Sequence[Sequence[str]], log_base: str = "log10",
                           normalized: bool = True) -> NgramScores:
        return await self._run(self._score_ngrams(ngrams, log_base, normalized))

    async def score_sentences(self, sentences: Sequence[str], bos: bool = True, eos: bool = True,
                              log_base: str = "log10", normalized: bool = True) -> list[SentenceScore]:
        return await self._run(self._score_sentences(sentences, bos, eos, log_base, normalized))

    async def reload_model(self, path: str = "") -> ModelInfo:
        """Admin/ReloadModel, as :meth:`nlmserve.client.LMClient.reload_model`."""
        return await self._run(self._reload_model(path))

    async def score(self, sentence: str, bos: bool = True, eos: bool = True) -> float:
        return (await self.score_sentences([sentence], bos=bos, eos=eos))[0].total

    async def full_scores(self, sentence: str, bos: bool = True, eos: bool = True) -> list[tuple[float, int, bool]]:
        return list(core.full_scores_tuples((await self.score_sentences([sentence], bos=bos, eos=eos))[0]))

    async def perplexity(self, sentence: str) -> float:
        return core.perplexity_of(await self.score(sentence), sentence)

    # -------------------------------------------------------------- transport
    async def _run(self, plan: Plan[R]) -> R:
        """Perform a plan's steps on the event loop, the calls of a step concurrently."""
        try:
            step = next(plan)
            while True:
                step = plan.send(await self._ids() if isinstance(step, NeedIdMap) else await self._perform(step))
        except StopIteration as done:
            result: R = done.value
            return result

    async def _perform(self, step: Rpc) -> list[Any]:
        method = self._method(step)
        if step.stream:
            stream = method

            async def method(req: Any, **kw: Any) -> list[Any]:
                return [chunk async for chunk in stream(req, **kw)]

        if step.sequential:
            return [await self._call(method, request, start, step.retry) for start, request in step.requests]
        return list(await asyncio.gather(*[self._call(method, request, start, step.retry)
                                           for start, request in step.requests]))

    async def _call(self, method: Callable[..., Awaitable[R]], request: Any, index_offset: int = 0,
                    retry: bool = True) -> R:
        attempt = 0
        while True:
            try:
                return await method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:  # aio.AioRpcError
                if not retry or not self.retry.should_retry(e, attempt):
                    raise core.map_error(e, index_offset, self.security.uses_tls) from e
                wait = self.retry.delay(attempt)
                log.info("%s from %s; retry %s in %.3f s", e.code().name, self.target, attempt + 1, wait)
                await asyncio.sleep(wait)
                attempt += 1
