"""Server configuration: one frozen dataclass, built from an optional TOML file and CLI flags.

Precedence: defaults < ``--config FILE.toml`` < explicit command-line flags. The TOML file
holds the same keys as the dataclass fields, at top level or under a ``[server]`` table.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..common.errors import InputError, UsageError


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``nlmserve serve`` can be told; defaults suit one CPU box."""

    #: Model file written by ``nlmserve train``.
    model: str
    #: Address to bind. Loopback by default; ``0.0.0.0`` or ``::`` exposes the service (a loud
    #: warning is logged unless both TLS and tokens are on).
    host: str = "127.0.0.1"
    #: gRPC port; 0 picks a free port (printed on stdout as ``listening on HOST:PORT``).
    port: int = 50051
    #: Prometheus ``/metrics`` port; None turns the exporter off, 0 picks a free port.
    metrics_port: int | None = None
    #: Torch device (``cpu``, ``cuda``, ``cuda:1``); None: cuda when available, else cpu.
    device: str | None = None
    #: On the CPU, score a class-output model with its inference tables (numpy for tiny
    #: batches); False: with the device-agnostic torch code a GPU runs (to check that path on
    #: a CPU box). None: on unless the environment variable NLMSERVE_NO_CPU_TABLES is set.
    cpu_tables: bool | None = None
    #: Most n-grams scored in one forward pass; larger requests are split.
    max_batch_ngrams: int = 4096
    #: Longest wait (microseconds) for more requests to join a batch. The batcher only waits
    #: while other requests are on their way, so a lone client never pays it.
    max_delay_us: int = 2000
    #: Requests of at most this many n-grams (decoder lookups) are queued ahead of larger
    #: ones (rescoring batches) and never wait behind them; a batch is filled with them
    #: first, then with a slice of the oldest large request. 0 (the default): one
    #: first-come queue. Under saturation, more large requests are then in flight at once
    #: (they wait longer), which takes memory: see docs/operating.md, "Limits".
    priority_ngrams: int = 0
    #: Most n-grams waiting in the queue; beyond it requests get RESOURCE_EXHAUSTED.
    max_queue_ngrams: int = 1_000_000
    #: Most RPCs served at once, counted after the token check (authorised calls only;
    #: RESOURCE_EXHAUSTED beyond it). The health service is not counted (see below).
    max_concurrent_rpcs: int = 256
    #: Most RPCs one connection may have served at once (at most ``max_concurrent_rpcs``),
    #: so that no single client can take every slot; RESOURCE_EXHAUSTED beyond it.
    max_rpcs_per_connection: int = 128
    #: Most RPCs one client may have served at once (at most ``max_concurrent_rpcs``), over
    #: all its connections, so that no single caller can take every slot; RESOURCE_EXHAUSTED
    #: beyond it. A client is its bearer token when the token file holds more than one token
    #: (tokens then tell callers apart), else its peer address without the port.
    max_rpcs_per_client: int = 128
    #: Seconds a server-streaming call (GetVocabulary, GetScoringTables) may wait for its
    #: client to read the next message; a client that does not read within it loses the
    #: call (DEADLINE_EXCEEDED) and its slot.
    stream_write_timeout_seconds: float = 30.0
    #: Most client connections open at once; a connection beyond it is closed as soon as it
    #: is accepted (the client sees UNAVAILABLE). The open-files soft limit is raised to the
    #: hard one at start, so that the cap, not the file limit, is what a flood meets.
    max_connections: int = 4096
    #: Most grpc.health.v1 ``Watch`` streams open at once (replicated clients hold one per
    #: replica connection; open without a token, so bounded on its own). Health ``Check``
    #: is never limited.
    max_health_watches: int = 1024
    #: Most ``Watch`` streams on one connection.
    max_health_watches_per_connection: int = 8
    #: Longest wait, in seconds, for a call's first request message once its headers have
    #: arrived (a client that opens a call and sends nothing); DEADLINE_EXCEEDED after it.
    first_message_seconds: float = 60.0
    #: Seconds between the server's HTTP/2 keepalive pings on a connection (a peer that
    #: does not answer within ``keepalive_timeout_seconds`` is closed with its calls).
    keepalive_seconds: float = 60.0
    #: Seconds a keepalive ping may wait for its answer.
    keepalive_timeout_seconds: float = 20.0
    #: Close a connection that had no call for this many seconds (GOAWAY: the client
    #: reconnects on its next call). 0: never.
    max_connection_idle_seconds: float = 300.0
    #: Ask a client to reconnect after this many seconds (GOAWAY; calls in flight get
    #: ``max_connection_age_grace_seconds`` to finish). 0 (the default): never.
    max_connection_age_seconds: float = 0.0
    #: Seconds calls in flight get after a ``max_connection_age`` GOAWAY.
    max_connection_age_grace_seconds: float = 60.0
    #: Largest model file the server loads (at start and on reload), in bytes; a reload reads
    #: at most this much before its digest is checked, so it is also the most memory a
    #: refused reload can take for a while. Sized to the models ``nlmserve train`` makes: its
    #: recipes (lm/recipe.py: order 10, width 768, class output, 2^22 + 2^24 feature slots)
    #: at a WMT vocabulary of 200,000 words give 1.23 GiB of tensors (two V×768 float32
    #: tables, 1.14 GiB, and the feature tables, 80 MiB); 2 GiB leaves 60 % of headroom
    #: (about 330,000 words at that width). Raise it for larger models.
    max_model_bytes: int = 2 * 1024**3
    #: Longest a reload may take to read and check its file, in seconds; a read that takes
    #: longer is abandoned (the served model stays) and reloads stay refused until it ends.
    reload_timeout_seconds: float = 300.0
    #: Most n-grams (or sentence tokens) in one request; clients read it from GetModelInfo.
    max_ngrams_per_request: int = 200_000
    #: Largest gRPC message, both directions, in bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    #: Entries in the n-gram -> score LRU cache (0: off).
    ngram_cache_size: int = 0
    #: Entries in the context -> (r, normalisers) LRU cache (0: off).
    context_cache_size: int = 0
    #: Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    grace_seconds: float = 10.0
    #: Torch intra-op threads (0: torch's default).
    torch_threads: int = 0
    #: Words per GetVocabulary chunk when the client does not say.
    vocab_chunk_size: int = 10_000
    #: PEM server certificate (chain); with ``tls_key`` the port speaks TLS only.
    tls_cert: str | None = None
    #: PEM private key of ``tls_cert``.
    tls_key: str | None = None
    #: PEM CA bundle: clients must present a certificate it signed (mutual TLS).
    tls_client_ca: str | None = None
    #: File of bearer tokens, one per line; calls need ``authorization: Bearer <token>``
    #: (the health service stays open). Re-read on reload. None: no token required.
    token_file: str | None = None
    #: Serve the Admin service (ReloadModel) on a server without tokens. Off by default:
    #: without tokens anyone who reaches the port could make the server load a file.
    allow_unauthenticated_admin: bool = False
    #: File of admin bearer tokens (the token file's format, re-read on reload). When set,
    #: only its tokens may call the Admin service (ReloadModel): a call with a scoring token
    #: gets PERMISSION_DENIED, one with no or an unknown token UNAUTHENTICATED, whatever
    #: ``allow_unauthenticated_admin`` says. An admin token is accepted by every other
    #: service too. None: Admin takes the scoring tokens (``token_file``), as before.
    admin_token_file: str | None = None
    #: Folder a ReloadModel call's path must lie in: the path is taken by its name (``..``
    #: resolved as text) and opened with no symlink followed below the folder, so no caller
    #: can make the server read a file elsewhere (FAILED_PRECONDITION naming the folder).
    #: A call without a path, and SIGHUP, reload ``model`` itself, which may be a symlink.
    #: None: the folder that holds ``model``.
    reload_dir: str | None = None
    #: ``python``: this process serves the public port. ``native``: the C++ front end
    #: (server/native, ``nlmserve_frontend``) serves it and micro-batches small ScoreNgrams
    #: requests before this process, which binds a private loopback port (plaintext only).
    frontend: str = "python"
    #: Path of ``nlmserve_frontend``; None: on PATH, else the checkout's build/native.
    frontend_binary: str | None = None
    #: The native front end's longest wait for a batch to fill, microseconds.
    frontend_max_delay_us: int = 500
    #: Merged requests the native front end keeps at this server at once.
    frontend_max_inflight: int = 1
    #: The processes' malloc: ``auto`` runs ``nlmserve serve`` (and its front end) again with
    #: jemalloc preloaded where the system has it (Debian's libjemalloc2), which gives back
    #: far more of what floods of connections leave; ``jemalloc`` refuses to start without
    #: it; ``glibc`` keeps the C library's (common/memory.py).
    allocator: str = "auto"

    def __post_init__(self) -> None:
        checks = (
            (self.max_batch_ngrams >= 1, "max_batch_ngrams must be >= 1"),
            (self.max_delay_us >= 0, "max_delay_us must be >= 0"),
            (self.priority_ngrams >= 0, "priority_ngrams must be >= 0"),
            (self.max_ngrams_per_request >= 1, "max_ngrams_per_request must be >= 1"),
            (
                self.max_queue_ngrams >= self.max_ngrams_per_request,
                "max_queue_ngrams must be >= max_ngrams_per_request",
            ),
            (self.max_concurrent_rpcs >= 1, "max_concurrent_rpcs must be >= 1"),
            (self.max_rpcs_per_connection >= 1, "max_rpcs_per_connection must be >= 1"),
            (self.max_rpcs_per_client >= 1, "max_rpcs_per_client must be >= 1"),
            (self.stream_write_timeout_seconds > 0, "stream_write_timeout_seconds must be > 0"),
            (self.max_connections >= 1, "max_connections must be >= 1"),
            (self.max_health_watches >= 0, "max_health_watches must be >= 0"),
            (self.max_health_watches_per_connection >= 0, "max_health_watches_per_connection must be >= 0"),
            (self.first_message_seconds > 0, "first_message_seconds must be > 0"),
            (self.keepalive_seconds >= 1, "keepalive_seconds must be >= 1"),
            (self.keepalive_timeout_seconds > 0, "keepalive_timeout_seconds must be > 0"),
            (self.max_connection_idle_seconds >= 0, "max_connection_idle_seconds must be >= 0"),
            (self.max_connection_age_seconds >= 0, "max_connection_age_seconds must be >= 0"),
            (self.max_connection_age_grace_seconds >= 0, "max_connection_age_grace_seconds must be >= 0"),
            (self.max_model_bytes >= 1024, "max_model_bytes must be >= 1024"),
            (self.reload_timeout_seconds > 0, "reload_timeout_seconds must be > 0"),
            (self.admin_token_file != "", "admin_token_file must name a file"),
            (self.reload_dir != "", "reload_dir must name a folder"),
            (self.max_message_bytes >= 1024, "max_message_bytes must be >= 1024"),
            (self.ngram_cache_size >= 0, "ngram_cache_size must be >= 0"),
            (self.context_cache_size >= 0, "context_cache_size must be >= 0"),
            (self.grace_seconds >= 0, "grace_seconds must be >= 0"),
            (self.torch_threads >= 0, "torch_threads must be >= 0"),
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port must be in [0, 65535]"),
            (self.vocab_chunk_size >= 1, "vocab_chunk_size must be >= 1"),
            ((self.tls_cert is None) == (self.tls_key is None), "tls_cert and tls_key go together"),
            (self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca needs tls_cert and tls_key"),
            (self.frontend in ("python", "native"), "frontend must be python or native"),
            (self.frontend == "python" or self.tls_cert is None,
             "the native front end serves plaintext only: use frontend python for TLS"),
            (self.frontend_max_delay_us >= 0, "frontend_max_delay_us must be >= 0"),
            (self.frontend_max_inflight >= 1, "frontend_max_inflight must be >= 1"),
            (self.allocator in ("auto", "jemalloc", "glibc"), "allocator must be auto, jemalloc or glibc"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ServerConfig))


def load_toml(path: str | Path) -> dict[str, Any]:
    """The server settings in a TOML file (top level or a ``[server]`` table)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise InputError(f"cannot read config: {e.strerror}", str(path)) from e
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"invalid TOML: {e}", str(path)) from e
    table = data.get("server", data)
    if not isinstance(table, dict):
        raise InputError("[server] must be a table", str(path))
    unknown = sorted(set(table) - set(FIELD_NAMES))
    if unknown:
        raise InputError(f"unknown setting(s) {unknown}; known: {list(FIELD_NAMES)}", str(path))
    return dict(table)


def build_config(overrides: Mapping[str, Any], config_file: str | Path | None = None) -> ServerConfig:
    """Defaults, then the TOML file, then ``overrides`` (flags given on the command line; None = unset)."""
    from_file: dict[str, Any] = load_toml(config_file) if config_file is not None else {}
    values = {**from_file, **{k: v for k, v in overrides.items() if v is not None}}
    if "model" not in values:
        raise InputError("no model given (--model or `model = ...` in the config file)")
    try:
        return ServerConfig(**values)
    except (TypeError, ValueError) as e:
        if not _valid({**from_file, "model": values["model"]}):  # the file's own setting
            raise InputError(f"bad server setting: {e}", str(config_file)) from e
        # a flag's value: a usage error, as argparse's own (exit 2)
        raise UsageError(f"bad server setting: {e}") from e


def _valid(values: dict[str, Any]) -> bool:
    try:
        ServerConfig(**values)
    except (TypeError, ValueError):
        return False
    return True


#: Streams a connection may open beyond the calls and Watch streams it may hold.
STREAM_HEADROOM = 16


def streams_per_connection(config: ServerConfig) -> int:
    """HTTP/2 streams one connection may have open at once (MAX_CONCURRENT_STREAMS).

    gRPC counts a stream until the server has let it go, also once its client has reset or
    finished it, and refuses streams beyond the limit (REFUSED_STREAM, which clients see as
    UNAVAILABLE). So a connection that resets streams as fast as it opens them (rapid
    reset) has at most this many on the server at once; and so that a client that keeps
    the calls and Watch streams a connection may hold busy is never refused while the
    server lets its finished ones go, the limit is twice those, plus
    :data:`STREAM_HEADROOM` for calls that wait for their message or are being refused."""
    return 2 * (config.max_rpcs_per_connection + config.max_health_watches_per_connection) + STREAM_HEADROOM
