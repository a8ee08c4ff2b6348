"""``nlmserve serve``: flags (and an optional TOML file) → ServerConfig → serve()."""

from __future__ import annotations

import argparse
import errno
import logging
import socket

from ..common.errors import InputError, ModelFileError

log = logging.getLogger(__name__)

# flag → (type, help); defaults live in ServerConfig (None here means "not given").
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--host", str, "address to bind (default 127.0.0.1; 0.0.0.0 exposes the service)"),
    ("--port", int, "gRPC port (default 50051; 0 picks a free port and prints it)"),
    ("--metrics-port", int, "Prometheus /metrics port (default off; 0 picks a free port)"),
    ("--device", str, "torch device: cpu, cuda, cuda:1 (default cuda when available)"),
    ("--max-batch-ngrams", int, "most n-grams per forward pass (default 4096)"),
    ("--max-delay-us", int, "longest wait for a batch to fill, microseconds (default 2000)"),
    ("--priority-ngrams", int, "requests of at most this many n-grams go ahead of larger ones (default 0: first come, first served)"),
    ("--max-queue-ngrams", int, "most n-grams queued before RESOURCE_EXHAUSTED (default 1000000)"),
    ("--max-concurrent-rpcs", int, "most authorised RPCs served at once (default 256)"),
    ("--max-rpcs-per-connection", int, "most RPCs one connection may have served at once (default 128)"),
    ("--max-rpcs-per-client", int, "most RPCs one client (its token when there are several, else its address) "
                                   "may have served at once (default 128)"),
    ("--stream-write-timeout-seconds", float, "a streaming call whose client does not read for this long is "
                                              "ended (default 30)"),
    ("--max-connections", int, "most client connections open at once (default 4096)"),
    ("--max-health-watches", int, "most open health Watch streams (default 1024)"),
    ("--max-health-watches-per-connection", int, "most health Watch streams on one connection (default 8)"),
    ("--first-message-seconds", float, "longest wait for a call's request message after its headers (default 60)"),
    ("--keepalive-seconds", float, "seconds between the server's keepalive pings (default 60)"),
    ("--keepalive-timeout-seconds", float, "seconds a keepalive ping waits for its answer (default 20)"),
    ("--max-connection-idle-seconds", float, "close connections idle this long (default 300; 0: never)"),
    ("--max-connection-age-seconds", float, "make clients reconnect after this long (default 0: never)"),
    ("--max-connection-age-grace-seconds", float, "time calls get after an age limit's GOAWAY (default 60)"),
    ("--max-model-bytes", int, "largest model file loaded, at start or on reload (default 2 GiB)"),
    ("--reload-timeout-seconds", float, "longest a reload may read and check its file (default 300)"),
    ("--max-ngrams-per-request", int, "most n-grams or tokens per request (default 200000)"),
    ("--max-message-bytes", int, "largest gRPC message (default 64 MiB)"),
    ("--ngram-cache-size", int, "n-gram score LRU entries (default 0: off)"),
    ("--context-cache-size", int, "context normaliser LRU entries (default 0: off)"),
    ("--grace-seconds", float, "drain time after SIGTERM (default 10)"),
    ("--torch-threads", int, "torch intra-op threads (default: torch's)"),
    ("--tls-cert", str, "PEM server certificate: serve TLS only (needs --tls-key; re-read on SIGHUP)"),
    ("--tls-key", str, "PEM private key of --tls-cert"),
    ("--tls-client-ca", str, "PEM CA: require client certificates it signed (mutual TLS)"),
    ("--token-file", str, "file of bearer tokens, one per line (re-read on SIGHUP); health stays open"),
    ("--admin-token-file", str, "file of admin tokens: only they may call Admin/ReloadModel (re-read on SIGHUP)"),
    ("--reload-dir", str, "folder a ReloadModel path must lie in, no symlink followed (default: the folder of --model)"),
    ("--frontend", str, "python (default) or native: the C++ front end (server/native) takes the public port "
                        "and micro-batches small requests before this process"),
    ("--frontend-binary", str, "path of nlmserve_frontend (default: on PATH, else build/native of the checkout)"),
    ("--frontend-max-delay-us", int, "native front end: longest wait for a batch to fill (default 500)"),
    ("--frontend-max-inflight", int, "native front end: merged requests at the model server at once (default 1)"),
    ("--allocator", str, "malloc of the server's processes: auto (default: jemalloc where the system has it), "
                         "jemalloc, or glibc"),
)


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("serve", help="serve a model over gRPC",
                              description="Serve a model file over gRPC (nlmserve.v1.LanguageModel).")
    p.add_argument("--model", help="model file written by `nlmserve train`")
    p.add_argument("--config", help="TOML file with ServerConfig fields (flags override it)")
    for flag, typ, help_text in _FLAGS:
        p.add_argument(flag, type=typ, default=None, help=help_text)
    p.add_argument("--allow-unauthenticated-admin", action="store_true", default=None,
                   help="serve the Admin service (ReloadModel) without --token-file")
    p.add_argument("--no-cpu-tables", dest="cpu_tables", action="store_const", const=False, default=None,
                   help="score on the CPU with the device-agnostic torch code a GPU runs, not the CPU tables "
                        "(also: environment NLMSERVE_NO_CPU_TABLES=1)")
    # Kept so that existing command lines still start; the asyncio server has no handler pool.
    p.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_serve)


def check_ports_free(host: str, ports: tuple[int | None, ...]) -> None:
    """Refuse, before the model is loaded, a port (not 0 or None) that another process holds
    on ``host``: InputError "port P is in use", one line. A trial bind with SO_REUSEADDR and
    without SO_REUSEPORT, as the server binds (server_options sets grpc.so_reuseport 0)."""
    for port in ports:
        if not port:
            continue
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError):
            continue  # the server says what is wrong with the host
        for family, kind, proto, _, address in infos:
            try:
                with socket.socket(family, kind, proto) as trial:
                    trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    trial.bind(address)
            except OSError as e:  # other errors (an address family the host lacks) are the server's to report
                if e.errno == errno.EADDRINUSE:
                    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                    raise InputError(f"port {port} is in use ({where}): stop what holds it, or choose another "
                                     "port (0 picks a free one)") from e


def run_on_allocator(allocator: str) -> None:
    """Run this command again with jemalloc preloaded (``allocator`` auto or jemalloc, and
    the process not yet on it; :func:`~nlmserve.common.memory.jemalloc_environment`): the
    same arguments, the same process id, its front end inheriting the environment. Returns
    when the process stays as it is: glibc asked for, jemalloc already there, or (auto) the
    system without it; raises InputError when jemalloc was asked for and cannot be had."""
    import os
    import sys

    from ..common.memory import JEMALLOC_LIBRARY, jemalloc_environment, on_jemalloc

    if allocator == "glibc" or on_jemalloc():
        return
    env = jemalloc_environment(dict(os.environ))
    if env is None:
        if allocator == "jemalloc":
            raise InputError(f"--allocator jemalloc: {JEMALLOC_LIBRARY} cannot be loaded (Debian: apt install "
                             "libjemalloc2), or use --allocator glibc")
        log.info("serving on glibc's malloc (%s not found or not loadable)", JEMALLOC_LIBRARY)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def run_serve(args: argparse.Namespace) -> int:
    from .app import serve
    from .config import build_config

    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in _FLAGS}
    overrides["model"] = args.model
    overrides["allow_unauthenticated_admin"] = args.allow_unauthenticated_admin
    overrides["cpu_tables"] = args.cpu_tables
    if args.threads is not None:
        log.warning("--threads is ignored (the asyncio server has no handler threads)")
    config = build_config(overrides, args.config)
    check_ports_free(config.host, (config.port, config.metrics_port))
    run_on_allocator(config.allocator)
    try:
        return serve(config)
    except ModelFileError:
        raise
    except OSError as e:
        raise InputError(str(e)) from e
