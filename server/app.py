"""Wiring: engine + servicer + health + reflection + metrics into one gRPC (asyncio) server.

``create_server(config)`` builds and starts everything on an event loop of its own (a
background thread) and returns a :class:`RunningServer`; tests bind port 0 and talk to it.
``serve(config)`` adds the process lifecycle: SIGTERM/SIGINT → health NOT_SERVING → new RPCs
get UNAVAILABLE → in-flight RPCs finish within ``grace_seconds`` and their answers get
:data:`SETTLE_SECONDS` to reach the client → stop (gRPC closes the connections) → release the
engine (in ``finally``) → exit 0. SIGHUP reloads the model file (and the token and TLS files) without
failing a request (``server.admin``); SIGUSR1 logs the heap (and the native front end's).

Security (``server.auth``): TLS (``tls_cert``/``tls_key``, mutual with ``tls_client_ca``)
and bearer tokens (``token_file``); what a client may hold (tokens, the first-message
deadline, concurrency limits, the stream write timeout) is the call gate's (``server.gate``,
a grpc.aio interceptor); what a connection may hold (streams, metadata, its handshake's and
SETTINGS acknowledgement's time, how many connections there are, how long one may live) is
gRPC's own, set by :func:`server_options`.

One event-loop thread receives every RPC and one engine thread runs the forward passes,
so the GIL is shared by two busy threads, not by a pool of handler threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..proto import lm_pb2
from ..common.errors import ReloadError
from ..common.memory import allocator_report, heap_report, return_freed_memory, trim_heap
from ..common.serve_process import listening_line, metrics_line
from .admin import ADMIN_SERVICE, AdminServicer, Reloader, add_admin_to_server
from .auth import TlsFiles, TokenStore
from .config import ServerConfig, streams_per_connection
from .engine import Engine, ModelState
from .gate import CallGate
from .local import LocalBackend
from .metrics import ServerMetrics
from .requests import RequestHandler
from .servicer import LanguageModelServicer, add_to_server

log = logging.getLogger(__name__)

#: How long the drain keeps connections open after the last large answer (beyond the
#: client's initial HTTP/2 flow-control window) was sent. gRPC closes a
#: connection as soon as its last stream is written to the socket; a client still reading a
#: large answer then sends a flow-control update to a closed socket, gets a TCP reset and
#: loses the rest of the answer ("Connection reset by peer"). Waiting lets it read first.
SETTLE_SECONDS = 1.0

#: The shortest interval between a client's keepalive pings that the server accepts.
CLIENT_PING_FLOOR_MS = 10_000

#: Metadata one call may carry once its connection's SETTINGS are acknowledged: gRPC
#: refuses some calls past the soft limit and every call past the hard one.
METADATA_SOFT_BYTES = 8 * 1024
METADATA_BYTES = 16 * 1024
#: Longest a connection may leave the server's SETTINGS unacknowledged before it is closed.
#: Until a client acknowledges them gRPC holds a call's metadata to HTTP/2's default
#: (16 MiB) rather than to the limits above; a gRPC client acknowledges at once.
SETTINGS_ACK_MS = 10_000
#: Longest a new connection may take to finish its handshake (TLS, the HTTP/2 preface), in
#: ms (gRPC's default is 120 s): under --max-connections, a connection that never sends its
#: preface holds a place only this long.
HANDSHAKE_MS = 10_000
#: Open files kept for other uses than connections (model, logs, sockets of the metrics).
RESERVED_FILES = 64
#: Seconds between two returns of free heap memory to the system (:func:`trim_heap`). Often,
#: since the calls that follow a flood carve their blocks from its free chunks and touch
#: their pages again: after 1 minute of every bench/soak.py attack the servers settled at
#: 1.07-1.08 x their start with a trim every 2 s, 1.10-1.12 x with one every 30 s (one
#: run each). A trim of a fragmented heap with little to give back took about 7 ms.
TRIM_SECONDS = 2.0

SERVICE_NAME = lm_pb2.DESCRIPTOR.services_by_name["LanguageModel"].full_name  # nlmserve.v1.LanguageModel


@dataclass
class RunningServer:
    """A started server, the event loop it runs on, and what it owns."""

    server: grpc.aio.Server
    port: int
    engine: Engine
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    servicer: LanguageModelServicer
    metrics: ServerMetrics
    metrics_port: int | None
    config: ServerConfig
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    reloader: Reloader
    gate: CallGate
    local: LocalBackend | None = None

    def start_local_backend(self, path: str) -> LocalBackend:
        """Serve the native front end's packed batches on the Unix socket ``path`` too
        (server/local.py); closed by :meth:`stop`."""
        if self.local is None:
            self.local = LocalBackend(path, self.engine, self.servicer.requests)
        return self.local

    def reload(self, path: str | None = None) -> ModelState:
        """Load ``path`` (default ``config.model``), check it, swap it in (ReloadError if refused)."""
        return self.reloader.reload(path)

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, stop accepting, drain within ``grace`` seconds, release the engine."""
        grace = self.config.grace_seconds if grace is None else grace
        try:
            done = asyncio.run_coroutine_threadsafe(self._drain(grace), self.loop)
            done.result(grace + 10.0)
        finally:
            if self.local is not None:
                self.local.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10.0)
            self.engine.shutdown()
            self.metrics.stop_http()

    async def _drain(self, grace: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.health.enter_graceful_shutdown()
        servicer = self.servicer
        servicer.draining = True
        while servicer.active > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        settle = servicer.large_answer_at + SETTLE_SECONDS - time.monotonic()
        if settle > 0:
            await asyncio.sleep(min(settle, max(0.0, deadline - loop.time())))
        await self.server.stop(max(0.0, deadline - loop.time()))

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(self.health.set(name, status), self.loop).result(5.0)


def exposure_warning(config: ServerConfig) -> str | None:
    """The warning for a bind on every interface without TLS or tokens (None: nothing to say)."""
    if config.host not in ("0.0.0.0", "::", "[::]", ""):
        return None
    missing = [name for name, on in (("TLS", config.tls_cert is not None), ("a token", config.token_file is not None))
               if not on]
    if not missing:
        return None
    return (f"SECURITY: binding {config.host or '*'} without {' or '.join(missing)}: any host that reaches this "
            "port can use the service" + ("" if config.tls_cert else " and read its traffic")
            + "; use --tls-cert/--tls-key and --token-file, or bind 127.0.0.1")


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def server_options(config: ServerConfig) -> list[tuple[str, Any]]:
    """The gRPC server's channel arguments: message and metadata sizes, streams per
    connection, calls waiting for the server, connections, keepalive and connection age."""
    streams = streams_per_connection(config)
    # Every stream a connection may open can wait for the event loop to take it; gRPC's
    # default (1,000, with random refusals from there to 3,000) let one connection's reset
    # streams crowd out, and cancel, other clients' calls. Connections times streams bounds it.
    pending = min(config.max_connections * streams, 2**31 - 1)
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_metadata_size", METADATA_SOFT_BYTES),
        ("grpc.absolute_max_metadata_size", METADATA_BYTES),
        ("grpc.max_concurrent_streams", streams),
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.http2.settings_timeout", SETTINGS_ACK_MS),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_MS),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", _ms(config.keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", _ms(config.keepalive_timeout_seconds)),
        # Clients ping every 30 s while they have calls (client.core.channel_options);
        # gRPC's default would answer pings more frequent than 5 min with GOAWAY.
        ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_FLOOR_MS),
    ]
    if config.max_connection_idle_seconds:
        options.append(("grpc.max_connection_idle_ms", _ms(config.max_connection_idle_seconds)))
    if config.max_connection_age_seconds:
        options.append(("grpc.max_connection_age_ms", _ms(config.max_connection_age_seconds)))
        options.append(("grpc.max_connection_age_grace_ms", _ms(config.max_connection_age_grace_seconds)))
    return options


async def _start(config: ServerConfig, engine: Engine, metrics: ServerMetrics,
                 reloader: Reloader) -> tuple[grpc.aio.Server, int, Any, LanguageModelServicer, CallGate]:
    # One owner of tokens, size limits, error mapping and request metrics for the gRPC
    # servicer, the call gate and the native front end's socket (server/local.py).
    requests = RequestHandler(engine.config.max_ngrams_per_request, metrics, reloader.tokens)
    # Tokens, first-message deadline and concurrency limits (server/gate.py): gRPC's own
    # maximum_concurrent_rpcs would count calls before their token is checked.
    gate = CallGate(config, requests, metrics)
    server = grpc.aio.server(options=server_options(config), interceptors=[gate])
    servicer = LanguageModelServicer(engine, metrics, requests)
    add_to_server(servicer, server)
    add_admin_to_server(AdminServicer(reloader, metrics), server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    try:
        if reloader.tls is not None:
            port = server.add_secure_port(address, reloader.tls.credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot bind {address}: {e}") from e
    if port == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer, servicer, gate




def raise_open_files_limit(max_connections: int) -> int:
    """Raise this process's open-files soft limit to its hard limit (a connection takes a
    file: at the usual soft limit of 1,024 new connections would time out long before
    ``max_connections``); warn when even the hard limit is below the connection cap.
    Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, max_connections + RESERVED_FILES)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %s to %s: %s", soft, wanted, e)
    if soft < max_connections + RESERVED_FILES:
        log.warning("the open-files limit (%s) is below --max-connections %s plus %s: connections beyond "
                    "about %s will time out; raise the hard limit (ulimit -Hn) or lower --max-connections",
                    soft, max_connections, RESERVED_FILES, max(0, soft - RESERVED_FILES))
    return soft


def create_server(config: ServerConfig, *, engine: Engine | None = None) -> RunningServer:
    """Load the model (unless ``engine`` is given), bind, start; port 0 picks a free port."""
    raise_open_files_limit(config.max_connections)
    metrics = ServerMetrics()
    # Unusable token or TLS files are an InputError before the model is loaded.
    tokens = TokenStore(config.token_file) if config.token_file is not None else None
    tls = None
    if config.tls_cert is not None and config.tls_key is not None:
        tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca)
    if engine is None:
        engine = Engine.load(config, metrics)
    else:
        engine.attach_metrics(metrics)
    warning = exposure_warning(config)
    if warning is not None:
        log.warning("%s", warning)
    reloader = Reloader(engine, config, tokens, metrics, tls)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="nlmserve-grpc", daemon=True)
    thread.start()
    try:
        started = asyncio.run_coroutine_threadsafe(_start(config, engine, metrics, reloader), loop)
        server, port, health_servicer, servicer, gate = started.result(60)
        metrics_port = None
        if config.metrics_port is not None:
            metrics_port = metrics.start_http(config.host, config.metrics_port)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
        engine.shutdown()
        raise
    log.info("serving %s on %s:%s (%s, %s)", SERVICE_NAME, config.host, port,
             "TLS" + (" with client certificates" if config.tls_client_ca else "") if config.tls_cert else "plaintext",
             f"{len(tokens)} bearer token(s)" if tokens is not None else "no token")
    return RunningServer(server, port, engine, health_servicer, servicer, metrics, metrics_port, config, loop, thread,
                         reloader, gate)


def _reload_logged(running: RunningServer) -> None:
    try:
        running.reload()
    except ReloadError:
        pass  # logged by the reloader; the served model stays


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT; print ``listening on HOST:PORT`` on stdout once bound.

    SIGHUP reloads ``config.model`` (and the token and TLS files) in a thread of its own,
    off the serving path; a file that fails to load or check, or a SIGHUP while a reload
    is in progress, is logged and the served model stays. SIGUSR1 logs malloc's heap in
    use and free and the resident size (and makes the native front end log its own). The process's allocator gives
    freed memory back (:func:`~nlmserve.common.memory.return_freed_memory`, and
    :func:`~nlmserve.common.memory.trim_heap` every :data:`TRIM_SECONDS`); the ``serve``
    command runs it on jemalloc where the system has it (``server.cli.run_on_allocator``).
    """
    # Before the model and the first request: a burst must not move message-sized blocks
    # into malloc's arenas for good (common/memory.py).
    return_freed_memory()
    public = config
    binary = None
    if config.frontend == "native":
        from .frontend import find_binary

        binary = find_binary(config.frontend_binary)
        warning = exposure_warning(config)  # the front end is what the network reaches
        if warning is not None:
            log.warning("%s", warning)
        # The model server on a private loopback port; the front end takes the public one,
        # applies the per-connection and per-client limits there itself, and is the model
        # server's only client (one connection, one address, its callers' tokens: only the
        # global limit applies behind it).
        config = dataclasses.replace(config, host="127.0.0.1", port=0, metrics_port=None,
                                     max_rpcs_per_connection=config.max_concurrent_rpcs,
                                     max_rpcs_per_client=config.max_concurrent_rpcs)
    running = create_server(config)
    log.info("malloc: %s", allocator_report())  # once the model has loaded: a mistake stays one line
    frontend = None
    stop = threading.Event()
    hup = threading.Event()
    usr1 = threading.Event()
    wake = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: draining", signal.Signals(signum).name)
        stop.set()
        wake.set()

    def on_hup(signum: int, frame: FrameType | None) -> None:
        hup.set()
        wake.set()

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        usr1.set()
        wake.set()

    socket_dir = None
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hup)
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_usr1)
    code = 0
    try:
        if binary is not None:
            from .frontend import NativeFrontend

            if public.metrics_port is not None:
                running.metrics_port = running.metrics.start_http(public.host, public.metrics_port)
            socket_dir = tempfile.mkdtemp(prefix="nlmserve-")  # a directory only this user may enter
            socket_path = running.start_local_backend(os.path.join(socket_dir, "backend.sock")).path
            frontend = NativeFrontend(binary, public, running.target, socket_path)
            print(listening_line(public.host, frontend.port), flush=True)
        else:
            print(listening_line(config.host, running.port), flush=True)
        if running.metrics_port is not None:
            print(metrics_line(public.host, running.metrics_port), flush=True)
        trimmed_at = time.monotonic()
        while True:
            wake.wait(0.5)
            wake.clear()
            if stop.is_set():
                break
            if time.monotonic() - trimmed_at >= TRIM_SECONDS:
                trim_heap()
                trimmed_at = time.monotonic()
            if usr1.is_set():
                usr1.clear()
                log.info("received SIGUSR1: %s", heap_report())
                if frontend is not None:
                    frontend.report_heap()
            if hup.is_set():
                hup.clear()
                log.info("received SIGHUP: reloading %s", config.model)
                if frontend is not None:
                    frontend.reload()
                # In a thread of its own, so that SIGTERM is still heard during a long read.
                threading.Thread(target=_reload_logged, args=(running,), name="nlmserve-sighup", daemon=True).start()
            if not running.engine.check_health():
                log.error("engine worker died; stopping")
                running.set_serving(False)
                code = 1
                break
            if frontend is not None and not frontend.alive():
                log.error("the native front end exited (code %s); stopping", frontend.proc.returncode)
                code = 1
                break
    finally:
        if frontend is not None:  # first, so that its in-flight requests still reach the model
            frontend.stop(public.grace_seconds + 10)
        running.stop()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.stdout.flush()
    log.info("stopped")
    return code
