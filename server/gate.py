"""The call gate: what a client may hold, decided before any handler waits for it.

One grpc.aio interceptor in front of every service, in this order:

1. **Token** (with ``--token-file``): a call to any service but ``grpc.health.v1.Health``
   without a valid ``authorization: Bearer`` token is refused UNAUTHENTICATED from its
   metadata alone. The refusal is a handler of a request-streaming kind, which gRPC runs
   at once; a unary kind would first wait for the request message, so a client that
   opens calls and never sends one would hold them.
2. **First message**: every call's first request message must arrive within
   ``first_message_seconds`` of its headers (DEADLINE_EXCEEDED after it). The gate reads
   it itself (each handler is served as its request-streaming twin), so a call whose
   message never comes is cut, not held.
3. **Slots**, taken once the message is there and given back when the call ends:
   ``max_concurrent_rpcs`` for every authorised call (LanguageModel, Admin, reflection),
   of which one connection may hold ``max_rpcs_per_connection``; health ``Watch``
   streams have a pool of their own (``max_health_watches``, per connection
   ``max_health_watches_per_connection``) so that they never take a slot of the others;
   health ``Check`` is never limited. Beyond a limit: RESOURCE_EXHAUSTED naming it (the
   Python client retries it with backoff). gRPC's own ``maximum_concurrent_rpcs`` is not
   used: it counts a call before any interceptor runs, so calls without a token took the
   slots of those with one.

Every refusal by a limit or the first-message deadline counts in
``nlmserve_refused_total{reason}`` (reasons: ``metrics.REFUSAL_REASONS``) and in
``nlmserve_requests_total{code}``, and is logged at WARNING (at most one line per reason
every :data:`LOG_EVERY_SECONDS`, with the count since the last). The gate runs on the
event loop thread only, so its counts need no lock.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import grpc

from .auth import OPEN_SERVICES
from .config import ServerConfig
from .metrics import ServerMetrics
from .requests import CallStatus, RequestHandler

if TYPE_CHECKING:  # the stubs make these generic in the request and response types, grpc does not
    Handler = grpc.RpcMethodHandler[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor

log = logging.getLogger(__name__)

WATCH_METHOD = "/grpc.health.v1.Health/Watch"
#: What ``context.read()`` returns when the client has sent its last message.
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # not in the stubs
#: Seconds between two log lines about refusals of one reason.
LOG_EVERY_SECONDS = 10.0


class Pool:
    """Slots of one kind of call: at most ``limit`` in all, ``per_connection`` per peer."""

    def __init__(self, limit: int, per_connection: int, reasons: tuple[str, str], flags: tuple[str, str]) -> None:
        self.limit = limit
        self.per_connection = min(per_connection, limit)
        self.reasons = reasons  # (the limit's, the per-connection limit's)
        self.flags = flags
        self.active = 0
        self._by_peer: dict[str, int] = {}

    def take(self, peer: str) -> tuple[str, str] | None:
        """Take a slot for ``peer``; None when taken, else (reason, message)."""
        held = self._by_peer.get(peer, 0)
        if self.active >= self.limit:
            return self.reasons[0], (f"the server holds its most concurrent calls of this kind ({self.flags[0]} "
                                     f"{self.limit}); retry later")
        if held >= self.per_connection:
            return self.reasons[1], (f"this connection holds its most concurrent calls of this kind "
                                     f"({self.flags[1]} {self.per_connection}); retry later")
        self.active += 1
        self._by_peer[peer] = held + 1
        return None

    def give(self, peer: str) -> None:
        self.active -= 1
        held = self._by_peer.pop(peer, 1) - 1
        if held > 0:
            self._by_peer[peer] = held

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)


class _Refusals:
    """Counts refusals and logs them without letting a flood of them flood the log."""

    def __init__(self, requests: RequestHandler, metrics: ServerMetrics | None) -> None:
        self.requests = requests
        self.metrics = metrics
        self._unlogged: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}

    def note(self, reason: str, rpc: str, code: grpc.StatusCode, peer: str) -> None:
        self.requests.count(rpc, code)
        if self.metrics is not None:
            self.metrics.refused.labels(reason=reason).inc()
        now = time.monotonic()
        count = self._unlogged.get(reason, 0) + 1
        last = self._logged_at.get(reason)
        if last is None or now - last >= LOG_EVERY_SECONDS:
            log.warning("refused %s call(s) by %s since the last such line; the latest: %s from %s",
                        count, reason, rpc, peer)
            self._logged_at[reason] = now
            count = 0
        self._unlogged[reason] = count


def refuse(code: grpc.StatusCode, message: str) -> Handler:
    """A handler that ends its call with ``code`` at once, without reading the request."""

    async def deny(request_iterator: Any, context: Context) -> None:
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(deny)


class CallGate(_Interceptor):
    """Token check, first-message deadline and slot limits of one server (module docstring)."""

    def __init__(self, config: ServerConfig, requests: RequestHandler, metrics: ServerMetrics | None = None) -> None:
        self.requests = requests
        self.first_message_seconds = config.first_message_seconds
        self.rpcs = Pool(config.max_concurrent_rpcs, config.max_rpcs_per_connection,
                         ("max_concurrent_rpcs", "max_rpcs_per_connection"),
                         ("--max-concurrent-rpcs", "--max-rpcs-per-connection"))
        self.watches = Pool(config.max_health_watches, config.max_health_watches_per_connection,
                            ("max_health_watches", "max_health_watches_per_connection"),
                            ("--max-health-watches", "--max-health-watches-per-connection"))
        self.refusals = _Refusals(requests, metrics)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method: str = handler_call_details.method
        service, _, name = method.lstrip("/").rpartition("/")
        rpc = name or method
        open_service = service in OPEN_SERVICES
        if not open_service:
            header = None
            for key, value in handler_call_details.invocation_metadata or ():
                if key == "authorization":
                    header = value
                    break
            message = self.requests.refusal(header)
            if message is not None:
                log.debug("%s: %s", method, message)
                self.requests.count(rpc, CallStatus.unauthenticated)
                return refuse(CallStatus.unauthenticated, message)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # UNIMPLEMENTED, from gRPC
        pool = self.watches if method == WATCH_METHOD else None if open_service else self.rpcs
        return self._guard(handler, rpc, pool)

    # -------------------------------------------------------------- one call
    async def _first(self, context: Context, rpc: str) -> Any:
        """The call's first request message, within ``first_message_seconds``."""
        try:
            async with asyncio.timeout(self.first_message_seconds):
                request = await context.read()
        except TimeoutError:
            self.refusals.note("first_message_timeout", rpc, CallStatus.first_message_timeout, context.peer())
            await context.abort(CallStatus.first_message_timeout,
                                f"no request message within {self.first_message_seconds:g} s of the call's "
                                "headers (--first-message-seconds)")
        if request is EOF:
            self.requests.count(rpc, CallStatus.no_message)
            await context.abort(CallStatus.no_message, "the call ended without a request message")
        return request

    async def _enter(self, pool: Pool | None, context: Context, rpc: str) -> str:
        """Take a slot of ``pool`` for the caller's connection (its peer, returned)."""
        peer: str = context.peer()
        if pool is not None:
            refused = pool.take(peer)
            if refused is not None:
                reason, message = refused
                self.refusals.note(reason, rpc, CallStatus.slots_full, peer)
                await context.abort(CallStatus.slots_full, message)
        return peer

    def _guard(self, handler: Handler, rpc: str, pool: Pool | None) -> Handler:
        """``handler`` as its request-streaming twin that reads the first message itself
        (within the deadline), then holds a slot of ``pool`` while it runs."""
        deserialize, serialize = handler.request_deserializer, handler.response_serializer
        inner: Any
        if handler.request_streaming:
            inner = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
            return handler  # a synchronous handler: none of ours

        async def requests(first: Any, context: Context) -> AsyncIterator[Any]:
            yield first
            while (request := await context.read()) is not EOF:
                yield request

        async def unary(request_iterator: Any, context: Context) -> Any:
            request = await self._first(context, rpc)
            peer = await self._enter(pool, context, rpc)
            try:
                if handler.request_streaming:
                    return await inner(requests(request, context), context)
                return await inner(request, context)
            finally:
                if pool is not None:
                    pool.give(peer)

        async def stream(request_iterator: Any, context: Context) -> None:
            request = await self._first(context, rpc)
            peer = await self._enter(pool, context, rpc)
            try:
                if handler.request_streaming:
                    request = requests(request, context)
                if inspect.isasyncgenfunction(inner):
                    async for response in inner(request, context):
                        await context.write(response)
                else:  # the reader-writer form (the health service's Watch)
                    await inner(request, context)
            finally:
                if pool is not None:
                    pool.give(peer)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, deserialize, serialize)
        return grpc.stream_unary_rpc_method_handler(unary, deserialize, serialize)
