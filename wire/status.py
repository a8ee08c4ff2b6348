"""``nlmserve.wire.status``: the status code of each way a call ends, and the codes a
client tries again. proto/contract/status_codes.tsv and retry_codes.tsv hold both tables
(their C++ owners: the native front end's ``kEndingCodes``, ``nlmserve::Retryable``).

The server ends a request that raised an exception with :func:`status_of` (the servicers
only turn errors into codes, server/requests.py)::

    InvalidRequestError    → INVALID_ARGUMENT (the message names the offending index)
    UnsupportedModelError  → FAILED_PRECONDITION
    ReloadError            → FAILED_PRECONDITION (the served model stays)
    OverloadedError        → RESOURCE_EXHAUSTED
    RequestExpiredError    → DEADLINE_EXCEEDED
    EngineStoppedError     → UNAVAILABLE
    anything else          → INTERNAL

and the calls that end before or beside the engine with a :class:`CallStatus` (the
servicer, Admin and the call gate of server/gate.py abort with these).

A client retries (:func:`retryable`; ``client.core.RetryPolicy`` adds the budget and the
backoff) what says "not served now, the same call may succeed later": UNAVAILABLE
(unless the address answered with something other than HTTP/2, which it does again),
CANCELLED (a stopping server cancels the calls that arrived as it stopped accepting) and
RESOURCE_EXHAUSTED from overload, never a message over the size limit ("larger than max"),
nor DEADLINE_EXCEEDED (the caller's budget for the call).
"""

from __future__ import annotations

import grpc

from ..common.errors import (EngineStoppedError, InvalidRequestError, OverloadedError, ReloadError,
                             RequestExpiredError, UnsupportedModelError)

#: Each exception of the engine and the model, and its code (the first class that matches).
ERROR_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedModelError, grpc.StatusCode.FAILED_PRECONDITION),
    (ReloadError, grpc.StatusCode.FAILED_PRECONDITION),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestExpiredError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),
)


class CallStatus:
    """The status of each way a call ends other than by an exception of the engine."""

    unauthenticated = grpc.StatusCode.UNAUTHENTICATED  # no or an unknown bearer token (call gate)
    draining = grpc.StatusCode.UNAVAILABLE  # the server is stopping: another replica may answer
    malformed = grpc.StatusCode.INVALID_ARGUMENT  # a request message that does not parse
    no_message = grpc.StatusCode.INVALID_ARGUMENT  # the call ended without a request message
    first_message_timeout = grpc.StatusCode.DEADLINE_EXCEEDED  # no request message in time
    slots_full = grpc.StatusCode.RESOURCE_EXHAUSTED  # the call gate's concurrency limits
    # A health Watch beyond its pool: gRPC clients' own health checking (gRFC A17) then counts
    # the server as healthy instead of failing it (server/gate.py).
    watches_full = grpc.StatusCode.UNIMPLEMENTED
    write_timeout = grpc.StatusCode.DEADLINE_EXCEEDED  # a streaming call's client did not read
    admin_disabled = grpc.StatusCode.PERMISSION_DENIED  # Admin without a token file (or the flag)
    cancelled = grpc.StatusCode.CANCELLED  # the client cancelled (counted; nothing is sent)


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status code a request that raised ``error`` ends with."""
    for cls, code in ERROR_CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


#: gRPC's status message when the address answered with bytes that are not HTTP/2 (a web
#: server, a server's metrics port, another protocol): not an nlmserve server's port.
NOT_HTTP2 = "Failed parsing HTTP/2"


def retryable(code: grpc.StatusCode, details: str, overloaded: bool = True) -> bool:
    """Whether a call that failed with ``code`` (and the status message ``details``) may
    succeed when sent again; ``overloaded``: RESOURCE_EXHAUSTED from overload counts."""
    # CANCELLED reaches a client that did not cancel only from a server that is shutting
    # down (a call that arrived as it stopped accepting); scoring is idempotent, so it is
    # retried like UNAVAILABLE.
    if code == grpc.StatusCode.UNAVAILABLE:
        return NOT_HTTP2 not in details  # an address that does not speak gRPC answers so again
    if code == grpc.StatusCode.CANCELLED:
        return True
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and overloaded:
        return "larger than max" not in details
    return False
