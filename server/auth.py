"""Bearer tokens and TLS credentials for the server.

Tokens: ``--token-file FILE`` holds one or more tokens, one per line (blank lines and lines
starting with ``#`` are skipped; the rule is ``nlmserve.common.tokens``'). A call must carry ``authorization: Bearer <token>``
metadata naming one of them; the comparison is constant-time (``hmac.compare_digest``,
against every token). The call gate (server/gate.py) ends calls without a valid token
UNAUTHENTICATED from their metadata, before any handler waits for a message, and counts
them in ``nlmserve_requests{code="UNAUTHENTICATED"}``. The health service
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
from pathlib import Path
from typing import Any

import grpc

from ..common.errors import InputError
from .files import read_small_file
from ..common.tokens import parse_tokens

log = logging.getLogger(__name__)

#: Services reachable without a token (full names as in the method path).
OPEN_SERVICES = ("grpc.health.v1.Health",)


def read_tokens(path: str | Path) -> tuple[bytes, ...]:
    """The tokens in ``path`` (the rule is ``nlmserve.common.tokens``'); InputError naming the file
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
