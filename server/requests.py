"""What every request goes through, on gRPC and on the native front end's socket alike.

The gRPC servicer (server/servicer.py, with the token interceptor of server/auth.py) and
the native front end's private channel (server/local.py) serve the same requests; this
module is the one owner of what they must agree on, so a client gets the same answer
whichever way its request reached the model:

* bearer tokens: :meth:`RequestHandler.refusal` gives the UNAUTHENTICATED message, and
  :meth:`RequestHandler.holder` the client a token stands for;
* size limits: :meth:`RequestHandler.check_size` (``max_ngrams_per_request``); a message
  too large to parse on the event loop thread is a :class:`LargeRequest` until the call
  gate has parsed it in a worker thread;
* error mapping: :meth:`RequestHandler.error` logs an exception and gives its status code,
  the wire's rule (``nlmserve.wire.status``: :func:`status_of` for the exceptions of the
  engine and the model, :class:`CallStatus` for the calls that end before or beside it;
  proto/contract/status_codes.tsv holds both tables);
* metrics: ``nlmserve_requests`` counts client requests by method and status code,
  ``nlmserve_request_latency_seconds`` their server-side latency and
  ``nlmserve_in_flight_requests`` those being served (:meth:`count`, :meth:`started`,
  :meth:`finished`). A batch the native front end merged counts as the client requests it
  holds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable

import grpc

from ..common.errors import InvalidRequestError
from ..wire.status import status_of
from .auth import TokenStore
from .metrics import ServerMetrics

log = logging.getLogger(__name__)


class LargeRequest:
    """The bytes of a request message too large to parse on the event loop thread; the call
    gate parses it in a worker thread once the call holds its slot (:meth:`parse`)."""

    __slots__ = ("data", "_parse")

    #: Messages larger than this many bytes are parsed off the event loop.
    BYTES = 256 * 1024

    def __init__(self, data: bytes, parse: Callable[[bytes], Any]) -> None:
        self.data = data
        self._parse = parse

    def parse(self) -> Any:
        return self._parse(self.data)


class RequestHandler:
    """Tokens, size limit, error mapping and request metrics of one server."""

    def __init__(self, max_items: int, metrics: ServerMetrics | None = None,
                 tokens: TokenStore | None = None) -> None:
        self.max_items = max_items
        self.metrics = metrics
        self.tokens = tokens
        self._children: dict[Any, Any] = {}  # metric children by label values

    # -------------------------------------------------------------- tokens
    def refusal(self, header: str | bytes | None) -> str | None:
        """None when ``header`` (the ``authorization`` metadata) may call; else the
        UNAUTHENTICATED message. Without a token file every call may."""
        if self.tokens is None or self.tokens.check(header):
            return None
        return "missing bearer token" if header is None else "invalid bearer token"

    def holder(self, header: str | bytes | None) -> str | None:
        """The label of the accepted token in ``header`` when the token file holds several
        (tokens then tell callers apart: each is a client of its own for the per-client
        share), else None. A label is a digest, never the token."""
        if self.tokens is None or len(self.tokens) < 2 or header is None:
            return None
        raw = header.encode("utf-8", "replace") if isinstance(header, str) else header
        return hashlib.sha256(raw.partition(b" ")[2].strip()).hexdigest()[:16]

    # -------------------------------------------------------------- size
    def check_size(self, n: int, what: str) -> None:
        """InvalidRequestError when a request holds more than ``max_ngrams_per_request`` items."""
        if n > self.max_items:
            raise InvalidRequestError(
                f"request has {n} {what}, more than max_ngrams_per_request = {self.max_items}; split it"
            )

    # -------------------------------------------------------------- errors
    def error(self, rpc: str, e: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status and message of a request that raised ``e`` (INTERNAL is logged with its traceback)."""
        code = status_of(e)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", rpc, exc_info=e)
            return code, f"internal error: {type(e).__name__}: {e}"
        log.debug("%s: %s: %s", rpc, code.name, e)
        return code, str(e)

    # -------------------------------------------------------------- metrics
    def count(self, rpc: str, code: grpc.StatusCode, n: int = 1) -> None:
        """``n`` requests of ``rpc`` finished with ``code``."""
        if self.metrics is None:
            return
        child = self._children.get((rpc, code))
        if child is None:  # labels() takes a lock and builds a key: do it once per pair
            child = self._children[(rpc, code)] = self.metrics.requests.labels(rpc=rpc, code=code.name)
        child.inc(n)

    def started(self, n: int = 1) -> float:
        """``n`` requests are being served from now on; returns the start time for :meth:`finished`."""
        if self.metrics is not None:
            self.metrics.in_flight.inc(n)
        return time.perf_counter()

    def finished(self, rpc: str, start: float, n: int = 1) -> None:
        """``n`` requests of ``rpc`` started at ``start`` are answered."""
        if self.metrics is None:
            return
        self.metrics.in_flight.dec(n)
        latency = self._children.get(rpc)
        if latency is None:
            latency = self._children[rpc] = self.metrics.request_latency.labels(rpc=rpc)
        took = time.perf_counter() - start
        for _ in range(n):
            latency.observe(took)
