"""The call gate: what a client may hold, decided before any handler waits for it.

One grpc.aio interceptor in front of every service, in this order:

1. **Token** (with ``--token-file``): a call to any service but ``grpc.health.v1.Health``
   without a valid ``authorization: Bearer`` token is refused UNAUTHENTICATED from its
   metadata alone. The refusal is a handler of a request-streaming kind, which gRPC runs
   at once; a unary kind would first wait for the request message, so a client that
   opens calls and never sends one would hold them. Failed authentications are logged
   (rate-limited) and, once an address has failed often, answered more slowly
   (:class:`~nlmserve.server.auth.AuthFailures`).
2. **First message**: every call's first request message must arrive within
   ``first_message_seconds`` of its headers (DEADLINE_EXCEEDED after it). The gate reads
   it itself (each handler is served as its request-streaming twin), so a call whose
   message never comes is cut, not held. While it waits, a call counts among the calls
   waiting for their message (:class:`Waiting`; health calls apart, with the Watch
   limits): beyond the limit per connection, per client or in all, the call of that
   connection, client or server that has waited longest is cut for it
   (RESOURCE_EXHAUSTED, a Watch UNIMPLEMENTED), so that no one holding calls open keeps
   out a call whose message is on its way (a probe's Check). The read of the message is
   never cancelled: it ends with its call (grpc.aio keeps a cancelled read's C side for
   good, gRPC issue 43360). A large message is parsed off the event loop
   (:class:`~nlmserve.server.requests.LargeRequest`), once the call holds its slot.
3. **Slots**, taken once the message is there and given back when the call ends:
   ``max_concurrent_rpcs`` for every authorised call (LanguageModel, Admin, reflection),
   of which one connection may hold ``max_rpcs_per_connection`` and one client
   ``max_rpcs_per_client`` (a client is its token when the token file holds several,
   else its address without the port: :func:`client_of`). Beyond a limit:
   RESOURCE_EXHAUSTED naming it (the Python client retries it with backoff). gRPC's own
   ``maximum_concurrent_rpcs`` is not used: it counts a call before any interceptor runs,
   so calls without a token took the slots of those with one.
4. **Health**: ``Check`` is never limited. ``Watch`` streams have a pool of their own
   (``max_health_watches``, per connection ``max_health_watches_per_connection``) so that
   they never take a slot of the others; a Watch beyond it ends UNIMPLEMENTED, which a
   gRPC client's own health checking (gRFC A17, what a replicated client uses) takes as
   "this server does not watch health": it then counts the replica as healthy instead of
   failing it. Any other code would make such a client count the replica as unhealthy,
   so whoever filled the pool (no token is needed to watch) could take every replica
   out of its clients' balancing.
5. **Writes**: each message of a server-streaming call must be taken by its client within
   ``stream_write_timeout_seconds``; a client that does not read loses the call
   (DEADLINE_EXCEEDED once it reads again) and the server's slot at once. Until gRPC has
   handed the call's last message over, the call still counts against its client's own
   share, so that one client cannot pile up such calls without bound. The answer of any
   other call is sent by gRPC after the handler has returned, out of the gate's reach (a
   grpc.aio server cannot end such a call): the server's slot is free then, and the call
   counts against its client's share until gRPC is done with it (its client took the
   answer, or went away). gRPC's ERROR with a traceback for each answer whose client went
   away becomes the gate's one line (:class:`_GoneAnswers`).

Every refusal by a limit or deadline counts in ``nlmserve_refused_total{reason}`` (reasons:
``metrics.REFUSAL_REASONS``) and in ``nlmserve_requests_total{rpc,code}``, whose ``rpc``
is a method the server serves or ``unknown`` (so invented method names add no series), and
is logged at WARNING (at most one line per reason every :data:`LOG_EVERY_SECONDS`, with the
count since the last). The gate runs on the event loop thread only, so its counts need no
lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import grpc
from grpc._cython import cygrpc  # type: ignore[attr-defined]  # not in the stubs

from ..wire.status import CallStatus
from .auth import OPEN_SERVICES, AuthFailures, address_of
from .config import ServerConfig
from .metrics import ServerMetrics
from .requests import LargeRequest, RequestHandler

if TYPE_CHECKING:  # the stubs make these generic in the request and response types, grpc does not
    Handler = grpc.RpcMethodHandler[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor

log = logging.getLogger(__name__)

WATCH_METHOD = "/grpc.health.v1.Health/Watch"
#: The ``rpc`` label of a call to a method this server does not serve.
UNKNOWN_RPC = "unknown"
#: What ``context.read()`` returns when the client has sent its last message.
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # not in the stubs
#: What ``context.write()`` raises once the call's client has gone.
ExecuteBatchError: type[Exception] = cygrpc.ExecuteBatchError
#: Seconds between two log lines about refusals of one reason.
LOG_EVERY_SECONDS = 10.0


def client_of(peer: str, holder: str | None) -> str:
    """The client a call counts against for a per-client share: its token's ``holder``
    label when tokens tell callers apart, else its peer address without the port."""
    return f"token:{holder}" if holder is not None else address_of(peer)


def _dec(counts: dict[str, int], key: str) -> None:
    held = counts.pop(key, 1) - 1
    if held > 0:
        counts[key] = held


class Pool:
    """Slots of one kind of call: at most ``limit`` in all, ``per_connection`` per
    connection (its peer address and port) and ``per_client`` per client (:func:`client_of`)."""

    def __init__(self, limit: int, per_connection: int, per_client: int | None,
                 reasons: tuple[str, str, str], flags: tuple[str, str, str]) -> None:
        self.limit = limit
        self.per_connection = min(per_connection, limit)
        self.per_client = min(per_client if per_client is not None else limit, limit)
        self.reasons = reasons  # (the limit's, the per-connection limit's, the per-client limit's)
        self.flags = flags
        self.active = 0
        self._by_connection: dict[str, int] = {}
        self._by_client: dict[str, int] = {}

    def take(self, connection: str, client: str) -> tuple[str, str] | None:
        """Take a slot; None when taken, else (reason, message)."""
        if self.active >= self.limit:
            which, scope, value = 0, "the server holds", self.limit
        elif self._by_connection.get(connection, 0) >= self.per_connection:
            which, scope, value = 1, "this connection holds", self.per_connection
        elif self._by_client.get(client, 0) >= self.per_client:
            which, scope, value = 2, "this client holds", self.per_client
        else:
            self.active += 1
            self._by_connection[connection] = self._by_connection.get(connection, 0) + 1
            self._by_client[client] = self._by_client.get(client, 0) + 1
            return None
        return self.reasons[which], (f"{scope} its most concurrent calls of this kind ({self.flags[which]} "
                                     f"{value}); retry later")

    def leave_server(self, connection: str) -> None:
        """The call no longer holds a slot of the server or of its connection."""
        self.active -= 1
        _dec(self._by_connection, connection)

    def leave_client(self, client: str) -> None:
        """The call no longer counts against its client's share."""
        _dec(self._by_client, client)

    def held_by(self, connection: str) -> int:
        return self._by_connection.get(connection, 0)

    def held_by_client(self, client: str) -> int:
        return self._by_client.get(client, 0)


class _Wait:
    """One call waiting for its request message (:class:`Waiting`); ``cut``: why it was cut."""

    __slots__ = ("connection", "client", "timeout", "cut")

    def __init__(self, connection: str, client: str, timeout: asyncio.Timeout) -> None:
        self.connection, self.client, self.timeout = connection, client, timeout
        self.cut = ""


class Waiting:
    """Calls of one kind whose headers have come and whose request message has not (a
    client sends it with the headers: only a call held open without one waits long): at
    most ``per_connection`` of one connection, ``per_client`` of one client (None: no such
    limit) and ``limit`` in all. A call beyond one of them cuts the one of that connection,
    client or server that has waited longest, so that calls held open, by others or by the
    caller itself, never keep out a call whose message is on its way (a health probe's
    Check, an authorised request), and what they hold stays bounded. The same rule as the
    native front end's (server/native/waiting.h)."""

    REASON = "calls_awaiting_message"

    def __init__(self, what: str, limit: int, per_connection: int, per_client: int | None,
                 flags: tuple[str, str, str]) -> None:
        self.what = what
        self.limit = max(1, limit)
        self.per_connection = max(1, min(per_connection, self.limit))
        self.per_client = None if per_client is None else max(1, min(per_client, self.limit))
        self.flags = flags
        # Each in the order they came: the first has waited longest.
        self._calls: dict[_Wait, None] = {}
        self._by_connection: dict[str, dict[_Wait, None]] = {}
        self._by_client: dict[str, dict[_Wait, None]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def enter(self, connection: str, client: str, timeout: asyncio.Timeout) -> _Wait:
        """Count a call as waiting (``timeout``: its first-message deadline, which a cut
        ends at once), cutting another where a limit is reached."""
        scopes = ((self._by_connection.get(connection), self.per_connection, "on this connection", 1),
                  (self._by_client.get(client), self.per_client, "of this client", 2),
                  (self._calls, self.limit, "in all", 0))
        for calls, limit, where, flag in scopes:
            if calls is not None and limit is not None and len(calls) >= limit:
                oldest = next(iter(calls))
                self.leave(oldest)
                if oldest.timeout.expired():  # its deadline has passed: it is ending already
                    continue
                oldest.cut = (f"cut for a newer call: {limit} {self.what} {where} were waiting for their "
                              f"request message ({self.flags[flag]} {limit}); a client sends it with the "
                              "call's headers; retry later")
                oldest.timeout.reschedule(asyncio.get_running_loop().time())  # its wait ends now
        wait = _Wait(connection, client, timeout)
        self._calls[wait] = None
        self._by_connection.setdefault(connection, {})[wait] = None
        self._by_client.setdefault(client, {})[wait] = None
        return wait

    def leave(self, wait: _Wait) -> None:
        """The call no longer waits (its message came, it was cut or it ended); once."""
        if self._calls.pop(wait, 0) is None:
            for by, key in ((self._by_connection, wait.connection), (self._by_client, wait.client)):
                calls = by[key]
                del calls[wait]
                if not calls:
                    del by[key]


class _Refusals:
    """Counts refusals and logs them without letting a flood of them flood the log."""

    def __init__(self, requests: RequestHandler, metrics: ServerMetrics | None) -> None:
        self.requests = requests
        self.metrics = metrics
        self._unlogged: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}

    def note(self, reason: str, rpc: str, code: grpc.StatusCode, peer: str, why: str = "") -> None:
        self.requests.count(rpc, code)
        if self.metrics is not None:
            self.metrics.refused.labels(reason=reason).inc()
        count = self._due(reason)
        if count:
            log.warning("refused %s call(s) by %s since the last such line; the latest: %s from %s%s",
                        count, reason, rpc, peer, f" ({why})" if why else "")

    def gone(self, rpc: str, peer: str, counted: bool = False) -> None:
        """A call's client went away while the server sent its answer (``counted``: the call
        is counted in the metrics already, by the code it was answered with)."""
        if not counted:
            self.requests.count(rpc, CallStatus.cancelled)
        count = self._due("gone")
        if count:
            log.info("%s call(s) ended by their client mid-answer since the last such line; the "
                     "latest: %s from %s went away", count, rpc, peer)

    def _due(self, kind: str) -> int:
        """Count one event of ``kind``; the events to log now (0: not yet, at most one line
        per kind every LOG_EVERY_SECONDS)."""
        now = time.monotonic()
        count = self._unlogged.get(kind, 0) + 1
        last = self._logged_at.get(kind)
        if last is None or now - last >= LOG_EVERY_SECONDS:
            self._logged_at[kind] = now
            self._unlogged[kind] = 0
            return count
        self._unlogged[kind] = count
        return 0


class _GoneAnswers(logging.Filter):
    """gRPC logs an ERROR with its traceback for each answer of a unary call whose client
    went away before taking it (the answer is sent after the handler has returned, out of
    the gate's reach): such records become the gate's one line per
    :data:`LOG_EVERY_SECONDS` (:meth:`_Refusals.gone`), so that clients that go away
    (killed, or on purpose, a connection at a time) cannot flood the log."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals: weakref.ref[_Refusals] | None = None  # the newest server's

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or not isinstance(record.exc_info[1], ExecuteBatchError):
            return True
        refusals = self.refusals() if self.refusals is not None else None
        if refusals is not None:
            method = record.getMessage().rpartition("[")[2].rstrip("]")
            refusals.gone(method.rpartition("/")[2] or UNKNOWN_RPC, "a client", counted=True)
        return False


_GONE_ANSWERS = _GoneAnswers()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Take a finished read's outcome, so that asyncio does not log it as never retrieved
    (a read whose call was ended for it ends in gRPC's error for a finished call)."""
    if not task.cancelled():
        task.exception()


class CallGate(_Interceptor):
    """Token check, first-message deadline, slot limits and write timeout of one server
    (module docstring)."""

    def __init__(self, config: ServerConfig, requests: RequestHandler, metrics: ServerMetrics | None = None) -> None:
        self.requests = requests
        self.first_message_seconds = config.first_message_seconds
        self.write_seconds = config.stream_write_timeout_seconds
        self.rpcs = Pool(config.max_concurrent_rpcs, config.max_rpcs_per_connection, config.max_rpcs_per_client,
                         ("max_concurrent_rpcs", "max_rpcs_per_connection", "max_rpcs_per_client"),
                         ("--max-concurrent-rpcs", "--max-rpcs-per-connection", "--max-rpcs-per-client"))
        self.watches = Pool(config.max_health_watches, config.max_health_watches_per_connection, None,
                            ("max_health_watches", "max_health_watches_per_connection", "max_health_watches"),
                            ("--max-health-watches", "--max-health-watches-per-connection", "--max-health-watches"))
        self.waiting = Waiting("calls", config.max_concurrent_rpcs, config.max_rpcs_per_connection,
                               config.max_rpcs_per_client, self.rpcs.flags)
        self.health_waiting = Waiting("health calls", config.max_health_watches,
                                      config.max_health_watches_per_connection, None, self.watches.flags)
        self.refusals = _Refusals(requests, metrics)
        self.auth_failures = AuthFailures()
        _GONE_ANSWERS.refusals = weakref.ref(self.refusals)
        grpc_log = logging.getLogger(cygrpc.__name__)
        if _GONE_ANSWERS not in grpc_log.filters:
            grpc_log.addFilter(_GONE_ANSWERS)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method: str = handler_call_details.method
        service, _, name = method.lstrip("/").rpartition("/")
        handler = await continuation(handler_call_details)  # a look-up: nothing runs yet
        rpc = name if handler is not None else UNKNOWN_RPC
        open_service = service in OPEN_SERVICES
        holder = None
        if not open_service:
            header = None
            for key, value in handler_call_details.invocation_metadata or ():
                if key == "authorization":
                    header = value
                    break
            message = self.requests.refusal(header)
            if message is not None:
                return self._deny(rpc, message)
            holder = self.requests.holder(header)
        if handler is None:
            return handler  # UNIMPLEMENTED, from gRPC
        pool = self.watches if method == WATCH_METHOD else None if open_service else self.rpcs
        return self._guard(handler, rpc, pool, holder)

    def _deny(self, rpc: str, message: str) -> Handler:
        """A handler that ends its call UNAUTHENTICATED without reading the request: at once,
        or after the delay :class:`AuthFailures` gives the caller's address."""
        failures = self.auth_failures

        async def deny(request_iterator: Any, context: Context) -> None:
            peer: str = context.peer()
            self.refusals.note("unauthenticated", rpc, CallStatus.unauthenticated, peer, message)
            address = address_of(peer)
            delay = failures.failed(address)
            if delay > 0:
                try:
                    await asyncio.sleep(delay)
                finally:
                    failures.answered(address)
            await context.abort(CallStatus.unauthenticated, message)

        return grpc.stream_stream_rpc_method_handler(deny)

    # -------------------------------------------------------------- one call
    async def _first(self, context: Context, rpc: str, waiting: Waiting, peer: str, client: str,
                     cut_code: grpc.StatusCode) -> Any:
        """The call's first request message, within ``first_message_seconds``, the call
        counted meanwhile among ``waiting``'s, which may cut it for a newer call (ended
        ``cut_code``)."""
        wait: _Wait | None = None
        # The read is a task of its own that a deadline or a cut never cancels: grpc.aio
        # frees a read's C-side operations only when the read completes, so every read
        # cancelled while gRPC still held it stayed allocated for good (about 100 bytes a
        # call, gRPC issue 43360). Once the call is ended, gRPC completes the read.
        read = asyncio.ensure_future(context.read())
        read.add_done_callback(_retrieved)
        try:
            async with asyncio.timeout(self.first_message_seconds) as timeout:
                wait = waiting.enter(peer, client, timeout)
                try:
                    request = await asyncio.shield(read)
                finally:
                    waiting.leave(wait)
        except TimeoutError:
            if wait is not None and wait.cut:
                self.refusals.note(Waiting.REASON, rpc, cut_code, peer)
                await context.abort(cut_code, wait.cut)
            self.refusals.note("first_message_timeout", rpc, CallStatus.first_message_timeout, peer)
            await context.abort(CallStatus.first_message_timeout,
                                f"no request message within {self.first_message_seconds:g} s of the call's "
                                "headers (--first-message-seconds)")
        if request is EOF:
            self.requests.count(rpc, CallStatus.no_message)
            await context.abort(CallStatus.no_message, "the call ended without a request message")
        return request

    async def _enter(self, pool: Pool | None, context: Context, rpc: str, peer: str, client: str) -> None:
        """Take a slot of ``pool`` for the caller's connection (its ``peer``) and client."""
        if pool is not None:
            refused = pool.take(peer, client)
            if refused is not None:
                reason, message = refused
                if pool is self.watches:  # gRFC A17: the client's health checking then stands aside
                    self.refusals.note(reason, rpc, CallStatus.watches_full, peer)
                    await context.abort(CallStatus.watches_full, f"{message}; use Check")
                self.refusals.note(reason, rpc, CallStatus.slots_full, peer)
                await context.abort(CallStatus.slots_full, message)

    async def _write(self, context: Context, response: Any, rpc: str, peer: str) -> bool:
        """Write ``response``; False when the client did not take it within the write timeout.
        A client that went away ends the call quietly: one log line for many such calls
        (gRPC would log each with its traceback)."""
        try:
            async with asyncio.timeout(self.write_seconds):
                await context.write(response)
        except TimeoutError:
            return False
        except ExecuteBatchError:
            self.refusals.gone(rpc, peer)
            raise asyncio.CancelledError() from None  # gRPC ends a cancelled handler without a word
        return True

    @staticmethod
    def _leave_client_when_done(context: Context, pool: Pool, client: str) -> None:
        """The call counts against its client's share until it is over: until gRPC has handed
        its answer over (the client read it) or the call ended otherwise (the client went
        away), so that a client that does not read cannot pile up answers without bound."""
        if context.done():
            pool.leave_client(client)
        else:
            context.add_done_callback(lambda _: pool.leave_client(client))  # type: ignore[arg-type]  # a class in the stubs

    def _guard(self, handler: Handler, rpc: str, pool: Pool | None, holder: str | None) -> Handler:
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

        async def parsed(request: Any) -> Any:
            if isinstance(request, LargeRequest):  # parsing a large message would stall every other call
                return await asyncio.to_thread(request.parse)
            return request

        waiting = self.waiting if pool is self.rpcs else self.health_waiting
        # A call cut while it waits ends as one refused by a limit: RESOURCE_EXHAUSTED, which
        # clients retry (a call of a burst whose message had come but was not read yet may
        # be cut), or UNIMPLEMENTED for a Watch (4. below).
        cut_code = CallStatus.watches_full if pool is self.watches else CallStatus.slots_full

        async def unary(request_iterator: Any, context: Context) -> Any:
            peer: str = context.peer()
            client = client_of(peer, holder)
            request = await self._first(context, rpc, waiting, peer, client, cut_code)
            await self._enter(pool, context, rpc, peer, client)
            answer = None
            try:
                request = await parsed(request)
                if handler.request_streaming:
                    answer = await inner(requests(request, context), context)
                else:
                    answer = await inner(request, context)
                return answer
            finally:
                if pool is not None:
                    pool.leave_server(peer)
                    if answer is None:
                        pool.leave_client(client)
                    else:  # gRPC sends the answer once its client reads: its share is held until then
                        self._leave_client_when_done(context, pool, client)

        async def stream(request_iterator: Any, context: Context) -> None:
            peer: str = context.peer()
            client = client_of(peer, holder)
            request = await self._first(context, rpc, waiting, peer, client, cut_code)
            await self._enter(pool, context, rpc, peer, client)
            holds_server = pool is not None
            try:
                request = await parsed(request)
                if handler.request_streaming:
                    request = requests(request, context)
                if not inspect.isasyncgenfunction(inner):  # the reader-writer form (the health service's Watch)
                    await inner(request, context)
                    return
                async with contextlib.aclosing(inner(request, context)) as responses:
                    async for response in responses:
                        if not await self._write(context, response, rpc, peer):
                            break
                    else:
                        return
                # The client did not read: its call ends, and the server's slot is free at once.
                if pool is not None:
                    pool.leave_server(peer)
                    holds_server = False
                self.refusals.note("stream_write_timeout", rpc, CallStatus.write_timeout, peer)
                # Returns once gRPC has handed over the message it holds (the client reads
                # again or goes away); the call counts against its client until then.
                await context.abort(CallStatus.write_timeout,
                                    f"the client did not read the answer's next message within "
                                    f"{self.write_seconds:g} s (--stream-write-timeout-seconds)")
            finally:
                if pool is not None:
                    if holds_server:
                        pool.leave_server(peer)
                    pool.leave_client(client)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, deserialize, serialize)
        return grpc.stream_unary_rpc_method_handler(unary, deserialize, serialize)
