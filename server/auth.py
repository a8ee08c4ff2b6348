"""Bearer tokens and TLS credentials for the server.

Tokens: ``--token-file FILE`` holds one or more tokens, one per line (blank lines and lines
starting with ``#`` are skipped; the rule is ``nlmserve.wire.tokens``'). A call must carry ``authorization: Bearer <token>``
metadata naming one of them; the comparison is constant-time (``hmac.compare_digest``,
against every token). The call gate (server/gate.py) ends calls without a valid token
UNAUTHENTICATED from their metadata, before any handler waits for a message, counts
them in ``nlmserve_requests{code="UNAUTHENTICATED"}``, logs them (rate-limited) and, once an
address has failed often, answers it more slowly (:class:`AuthFailures`). The health service
(``grpc.health.v1.Health``) stays open, so load balancers and container health checks need
no secret; reflection needs the token like every other service. The file is re-read on
reload (SIGHUP or the Admin ReloadModel RPC); a file that cannot be read or holds no token
(an emptied file included) keeps the tokens in force, logged at ERROR: failing safe, since
dropping every token would lock every client out.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from ..common.errors import InputError
from .files import read_small_file
from ..wire.tokens import parse_tokens

log = logging.getLogger(__name__)

#: Services reachable without a token (full names as in the method path).
OPEN_SERVICES = ("grpc.health.v1.Health",)


def address_of(peer: str) -> str:
    """A gRPC peer (``ipv4:10.0.0.7:51234``, ``ipv6:[::1]:51234``) without its port: the
    address that several connections of one host share. Other peers are returned whole."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class AuthFailures:
    """Failed authentications per client address, answered more slowly as they accumulate.

    An address's first :attr:`FREE` failures within :attr:`WINDOW` seconds are answered at
    once (a client with a wrong token learns it at once); after them each refusal waits
    :attr:`FIRST_DELAY` seconds, doubling with each further failure up to
    :attr:`MAX_DELAY`, so that one address can test at most a few tokens a second per call
    it keeps waiting. At most :attr:`HELD_PER_ADDRESS` refusals of one address, and
    :attr:`HELD` in all, wait at once; beyond those a refusal is answered at once, so that
    waiting refusals hold bounded memory. Calls with a valid token are never slowed, from
    any address. Used on the event loop thread only.
    """

    FREE = 10
    WINDOW = 60.0
    FIRST_DELAY = 0.05
    MAX_DELAY = 1.0
    HELD_PER_ADDRESS = 32
    HELD = 1024
    #: Addresses remembered at most; the oldest window is forgotten first.
    ADDRESSES = 65_536

    def __init__(self) -> None:
        self._recent: dict[str, tuple[float, int]] = {}  # address -> (window start, failures in it)
        self._held: dict[str, int] = {}
        self.held = 0

    def failed(self, address: str, now: float | None = None) -> float:
        """Count a failure of ``address``; the seconds its refusal waits (0: answer at once).
        A positive delay must be followed by :meth:`answered` once the refusal is sent."""
        now = time.monotonic() if now is None else now
        start, count = self._recent.pop(address, (now, 0))
        if now - start > self.WINDOW:
            start, count = now, 0
        count += 1
        self._recent[address] = (start, count)  # re-inserted: the dict keeps the latest last
        if len(self._recent) > self.ADDRESSES:
            del self._recent[next(iter(self._recent))]
        held = self._held.get(address, 0)
        if count <= self.FREE or held >= self.HELD_PER_ADDRESS or self.held >= self.HELD:
            return 0.0
        self._held[address] = held + 1
        self.held += 1
        return min(self.MAX_DELAY, self.FIRST_DELAY * 2.0 ** min(count - self.FREE - 1, 30))

    def answered(self, address: str) -> None:
        """A delayed refusal of ``address`` was sent (or its call ended)."""
        self.held -= 1
        held = self._held.pop(address, 1) - 1
        if held > 0:
            self._held[address] = held


def read_tokens(path: str | Path) -> tuple[bytes, ...]:
    """The tokens in ``path`` (the rule is ``nlmserve.wire.tokens``'); InputError naming the file
    (and line) when it is unusable."""
    data = read_small_file(str(path), "token file")
    return tuple(token.encode("ascii") for token in parse_tokens(data, str(path)))


def read_client_token(path: str | Path) -> str:
    """The first token of a token file (what a client sends)."""
    return read_tokens(path)[0].decode("ascii")


class TokenStore:
    """The accepted tokens; thread-safe; ``reload`` re-reads the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._tokens = read_tokens(path)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tokens)

    def reload(self) -> None:
        """Re-read the file; on an error the tokens in force stay (and the error is raised)."""
        tokens = read_tokens(self.path)
        with self._lock:
            self._tokens = tokens
        log.info("token file %s: %s token(s)", self.path, len(tokens))

    def check(self, header: str | bytes | None) -> bool:
        """True when ``header`` is ``Bearer <token>`` with an accepted token (constant time per token)."""
        if header is None:
            return False
        raw = header.encode("utf-8", "replace") if isinstance(header, str) else header
        scheme, _, given = raw.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = given.strip()
        ok = False
        for token in self._tokens:  # compare with every token: the time does not say which matched
            ok |= hmac.compare_digest(given, token)
        return ok


class TlsFiles:
    """Server TLS from PEM files; ``reload`` re-reads them and new connections get the new
    certificate (connections already open keep theirs). With ``client_ca`` clients must
    present a certificate it signed (mutual TLS)."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._initial = self._configuration()
        self._pending: Any = None
        self._lock = threading.Lock()

    def _configuration(self) -> Any:
        """The certificate configuration; InputError naming the file when unusable."""
        # Read first: only regular files of a bounded size (server/files.py).
        pair = (read_small_file(self.key, "TLS key"), read_small_file(self.cert, "TLS certificate"))
        ca = read_small_file(self.client_ca, "client CA") if self.client_ca else None
        try:  # the key must belong to the certificate: check now, not at the first handshake
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except OSError as e:  # ssl.SSLError is an OSError
            raise InputError(f"TLS certificate and key do not load together ({self.key}): {e}", self.cert) from e
        if ca is not None:
            try:
                ssl.create_default_context(cadata=ca.decode("ascii"))
            except (ValueError, OSError) as e:
                raise InputError(f"client CA is not a PEM certificate: {e}", self.client_ca) from e
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def reload(self) -> None:
        """Re-read the files for new connections; on an error the certificate in use stays."""
        configuration = self._configuration()
        with self._lock:
            self._pending = configuration
        log.info("TLS certificate %s re-read", self.cert)

    def _fetch(self) -> Any:  # called by gRPC before each handshake; None: keep the current one
        with self._lock:
            configuration, self._pending = self._pending, None
        return configuration

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.client_ca is not None
        )
