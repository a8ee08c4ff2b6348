"""Replicated targets: several servers (or a DNS name) behind one channel.

The channel balances with gRPC's ``round_robin`` policy and health-checks each replica with
grpc.health.v1 (client-side health checking, done by grpcio's C core); the ``ModelGuard``
checks that every answer comes from one model. Only grpc and the standard library here.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .core import Security
from ..common.errors import ModelMismatchError

log = logging.getLogger(__name__)

HEALTH_SERVICE = "nlmserve.v1.LanguageModel"
MAX_RECONNECT_BACKOFF_MS = 5_000  # a restarted replica gets requests again within about this long
_RESOLVER_SCHEMES = ("dns:", "ipv4:", "ipv6:")
_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.%]+)\]|(?P<host>[^:\[\]/\s]+)):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class Endpoint:
    """Where a client's channel connects.

    Fields:
        target: the gRPC target given to the channel (``host:port``; ``ipv4:a:1,b:2`` or
            ``ipv6:[a]:1,[b]:2`` for a static list of replicas; ``dns:///name:port``).
        replicas: the replica addresses as given (one for a single server; empty when a
            resolver finds them, as ``dns:///``).
        replicated: several replicas or a resolver target: the channel balances with
            gRPC's ``round_robin`` policy and skips replicas whose health check fails.
        host_name: the one host name all static replicas share (the name a TLS certificate
            is checked against), None when they differ.
    """

    target: str
    replicas: tuple[str, ...]
    replicated: bool
    host_name: str | None = None

    @property
    def probe_calls(self) -> int:
        """GetModelInfo calls that reach every ready replica at least once under round_robin."""
        if not self.replicated:
            return 1
        return 2 * len(self.replicas) if self.replicas else 4


def endpoint_of(target: str | Sequence[str]) -> Endpoint:
    """The channel target for one address, a list (or comma-separated string) of replica
    addresses ``host:port``, or a resolver target (``dns:///name:port``, ``ipv4:...``).

    Host names in a static list are resolved once, here (one address each); a list whose
    membership changes belongs behind a DNS name (``dns:///name:port``), which gRPC
    re-resolves.
    """
    if isinstance(target, str):
        parts = [target.strip()] if target.strip().startswith(_RESOLVER_SCHEMES) else target.split(",")
    else:
        parts = list(target)
    parts = [p.strip() for p in parts if p.strip()]
    if not parts:
        raise ValueError("no server address given")
    if len(parts) == 1:
        only = parts[0]
        if only.startswith(_RESOLVER_SCHEMES):
            replicated = only.startswith("dns:") or "," in only
            return Endpoint(only, () if only.startswith("dns:") else tuple(only.split(":", 1)[1].split(",")),
                            replicated)
        try:
            host: str | None = _address(only)[0]
        except ValueError:
            host = None  # gRPC reports a target it cannot use when connecting
        return Endpoint(only, (only,), False, host)
    families: set[int] = set()
    resolved: list[str] = []
    hosts: set[str] = set()
    for address in parts:
        host, port = _address(address)
        hosts.add(host)
        ip = _resolve(host, port, address)
        families.add(ip.version)
        resolved.append(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    if len(families) > 1:
        raise ValueError(f"replica addresses mix IPv4 and IPv6 ({', '.join(parts)}); use one family or a DNS name")
    scheme = "ipv6:" if families == {6} else "ipv4:"
    return Endpoint(scheme + ",".join(resolved), tuple(parts), True, hosts.pop() if len(hosts) == 1 else None)


def _address(address: str) -> tuple[str, int]:
    m = _ADDRESS.match(address)
    if not m or not 0 < int(m.group("port")) < 65536:
        raise ValueError(f"not a HOST:PORT address: {address!r}")
    return m.group("v6") or m.group("host"), int(m.group("port"))


def _resolve(host: str, port: int, address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"cannot resolve {address!r}: {e}") from e
    return ipaddress.ip_address(str(infos[0][4][0]).split("%", 1)[0])


def balancing_options(endpoint: Endpoint) -> list[tuple[str, Any]]:
    """Channel options of a replicated endpoint: ``round_robin`` over the replicas, each
    subchannel health-checked with grpc.health.v1 (a NOT_SERVING or unreachable replica
    gets no requests until it is SERVING again), reconnection attempts at most
    ``MAX_RECONNECT_BACKOFF_MS`` apart (gRPC's default grows to 120 s). Empty for a single
    server."""
    if not endpoint.replicated:
        return []
    config = {"loadBalancingConfig": [{"round_robin": {}}],
              "healthCheckConfig": {"serviceName": HEALTH_SERVICE}}
    return [("grpc.service_config", json.dumps(config)), ("grpc.service_config_disable_resolution", 1),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


def tls_name_options(endpoint: Endpoint, security: Security) -> list[tuple[str, Any]]:
    """The name TLS checks for a static replica list (its target names no single host)."""
    if not (security.uses_tls and endpoint.replicated and endpoint.replicas) or security.tls_server_name:
        return []
    if endpoint.host_name is None:
        raise ValueError("replicas on different hosts over TLS need tls_server_name (the name in their certificates)")
    return [("grpc.ssl_target_name_override", endpoint.host_name)]


class ModelGuard:
    """Checks that every answer of a replicated client comes from one model.

    round_robin hides which replica answered, so the check is on the ``model_hash`` each
    response carries: the first hash seen is pinned, and a response naming another one
    raises ``ModelMismatchError`` (``allow_mixed`` logs it instead, for rolling reloads).
    A single-server client checks nothing: a hot reload there changes the hash for all.
    """

    def __init__(self, target: str, enabled: bool, allow_mixed: bool) -> None:
        self.target = target
        self.enabled = enabled
        self.allow_mixed = allow_mixed
        self.expected: str | None = None
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def pin(self, model_hash: str) -> None:
        with self._lock:
            self.expected = model_hash or None

    def check(self, hashes: Iterable[str]) -> str:
        """The model hash of one merged result (several, comma-joined, when mixing is allowed)."""
        distinct = list(dict.fromkeys(h for h in hashes if h))
        if not self.enabled:
            return distinct[0] if distinct else ""
        with self._lock:
            if self.expected is None and distinct:
                self.expected = distinct[0]
            expected = self.expected
            new = [h for h in distinct if h != expected and h not in self._seen]
            self._seen.update(distinct)
        others = [h for h in distinct if h != expected]
        if others and not self.allow_mixed:
            raise ModelMismatchError(
                f"replicas of {self.target} serve different models: {expected} and {', '.join(others)} "
                "(allow_mixed_models=True accepts this during a rolling reload)")
        for h in new:
            log.warning("replicas of %s serve different models: %s and %s", self.target, expected, h)
        return ",".join(distinct)
