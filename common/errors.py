"""``nlmserve.common.errors``: the exception hierarchy of every room, in one module.

Each server-side class maps to one gRPC status code in the servicer (``server.servicer``);
the client maps status codes back (``client.core.map_error``); the CLI prints the message
as one line and exits 1 (2 for a :class:`UsageError`). Wrap foreign errors with context
(``raise CorpusError(...) from exc``); never ``assert`` on user input. Nothing is imported
here (grpc only for type checking).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class NlmserveError(Exception):
    """Base of every error nlmserve raises on purpose."""


class UsageError(NlmserveError):
    """A flag's value, or a combination of flags, that cannot work: the command line prints
    the message and exits 2 (as for argparse's own errors), before any work."""


class InputError(NlmserveError):
    """Bad user input in a file: the message names the file and, where known, the line."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class CorpusError(InputError):
    """A training or evaluation text cannot be read (missing, empty, not UTF-8)."""


class NbestFormatError(InputError):
    """A malformed Moses n-best line."""


class ModelFileError(NlmserveError):
    """A model file that is missing, truncated, foreign, corrupt or of a newer format."""


class ReloadError(ModelFileError):
    """A hot reload that was refused; the served model stays (maps to FAILED_PRECONDITION)."""


class UnsupportedModelError(NlmserveError):
    """The model cannot do what was asked, e.g. export scoring tables (maps to
    FAILED_PRECONDITION); the message says why."""


class InvalidRequestError(NlmserveError):
    """A request that cannot be scored (maps to INVALID_ARGUMENT).

    ``index`` names the offending item (n-gram or sentence) when there is one; ``kind``
    names the rule broken when it is one of the n-gram rules (``nlmserve.wire.ngrams``:
    ``empty``, ``too-long``, ``out-of-range``, ``bos-target``, ``bos-in-sentence``).
    """

    def __init__(self, message: str, index: int | None = None, kind: str | None = None) -> None:
        super().__init__(f"item {index}: {message}" if index is not None else message)
        self.index = index
        self.kind = kind


class OverloadedError(NlmserveError):
    """The server's queue or concurrency bound is full (maps to RESOURCE_EXHAUSTED)."""


class ServerUnavailableError(NlmserveError):
    """The service could not be reached within the retry budget (client side)."""


# ---------------------------------------------------------------------- server side
class RequestExpiredError(NlmserveError):
    """The request's deadline passed before it was scored (maps to DEADLINE_EXCEEDED)."""


class EngineStoppedError(NlmserveError):
    """The engine was shut down (maps to UNAVAILABLE)."""


class ProtocolError(NlmserveError):
    """A frame on the private Unix socket (``server.local``) that breaks the format: the
    connection is closed (the front end reconnects)."""


# ---------------------------------------------------------------------- client side
class RequestTimeoutError(NlmserveError, TimeoutError):
    """The server did not answer within the client's deadline (DEADLINE_EXCEEDED)."""


class ModelMismatchError(NlmserveError):
    """Replicas behind one client answered with different models (``model_hash``)."""


class RpcError(NlmserveError):
    """Any other gRPC failure; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code
