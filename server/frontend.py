"""``nlmserve serve --frontend native``: the C++ front end (server/native) before this server.

The model server binds a private loopback port; ``nlmserve_frontend`` binds the public
address, micro-batches the small ScoreNgrams requests of many clients in C++ and forwards
everything else (docs/serving.md, "Settings", the paragraph on the native front end);
merged packed batches reach this process over its private Unix socket (server/local.py).
This module finds the binary, starts it with the server's guards (tokens, first-message
deadline, keepalive and connection limits, concurrency limits, stream write timeout: the
front end applies them to the public port itself, :func:`frontend_flags`), relays its log
lines, passes SIGHUP on (the front end then reads its token files again) and stops it
first on shutdown, so that in-flight requests drain through it while the model server is
still up.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO

from ..common.errors import InputError
from ..common.memory import without_jemalloc
from ..common.serve_process import parse_listening
from .config import ServerConfig, streams_per_connection

log = logging.getLogger(__name__)

BINARY = "nlmserve_frontend"
# `make cpp` builds it here in a source checkout (server/native's own CMake project).
BUILD_PATH = Path(__file__).resolve().parent.parent / "build" / "native" / BINARY


def _ms(seconds: float) -> str:
    return str(max(1, int(round(seconds * 1000))))


def frontend_flags(config: ServerConfig) -> list[str]:
    """The front end's flags for the public port's limits, taken from the same settings as
    the Python server's (times in milliseconds; 0 keeps "never" where the setting has it)."""
    flags = ["--first-message-ms", _ms(config.first_message_seconds),
             "--keepalive-ms", _ms(config.keepalive_seconds),
             "--keepalive-timeout-ms", _ms(config.keepalive_timeout_seconds),
             "--max-connection-idle-ms",
             _ms(config.max_connection_idle_seconds) if config.max_connection_idle_seconds else "0",
             "--max-connection-age-ms",
             _ms(config.max_connection_age_seconds) if config.max_connection_age_seconds else "0",
             "--max-connection-age-grace-ms", str(int(round(config.max_connection_age_grace_seconds * 1000))),
             "--max-concurrent-rpcs", str(config.max_concurrent_rpcs),
             "--max-rpcs-per-connection", str(config.max_rpcs_per_connection),
             "--max-rpcs-per-client", str(config.max_rpcs_per_client),
             "--max-health-watches", str(config.max_health_watches),
             "--max-health-watches-per-connection", str(config.max_health_watches_per_connection),
             "--stream-write-timeout-ms", _ms(config.stream_write_timeout_seconds),
             "--max-connections", str(config.max_connections),
             "--max-concurrent-streams", str(streams_per_connection(config))]
    if config.token_file is not None:
        flags += ["--token-file", config.token_file]
        if config.admin_token_file is not None:
            flags += ["--admin-token-file", config.admin_token_file]
    return flags


def find_binary(given: str | None) -> Path:
    """``--frontend-binary``, else ``nlmserve_frontend`` on PATH, else the checkout's build/native."""
    if given is not None:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise InputError("not an executable file", given)
        return path
    on_path = shutil.which(BINARY)
    if on_path is not None:
        return Path(on_path)
    if BUILD_PATH.is_file() and os.access(BUILD_PATH, os.X_OK):
        return BUILD_PATH
    raise InputError(f"{BINARY} not found on PATH or in {BUILD_PATH.parent}: build it with `make cpp` "
                     "(needs `make system-deps`) or give --frontend-binary")


class NativeFrontend:
    """A running ``nlmserve_frontend`` listening on ``host:port`` before ``backend``."""

    def __init__(self, binary: Path, config: ServerConfig, backend: str, socket_path: str) -> None:
        host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
        cmd = [str(binary), "--listen", f"{host}:{config.port}", "--backend", backend,
               "--max-batch-ngrams", str(config.max_batch_ngrams),
               "--max-delay-us", str(config.frontend_max_delay_us),
               "--max-inflight", str(config.frontend_max_inflight),
               "--max-queue-ngrams", str(config.max_queue_ngrams),
               "--max-message-mb", str(max(1, config.max_message_bytes // (1024 * 1024))),
               "--grace-s", str(max(0, int(round(config.grace_seconds)))),
               "--backend-socket", socket_path, *frontend_flags(config)]
        log.info("starting the native front end: %s", " ".join(cmd))
        # glibc's malloc, with the front end's own settings, even where this process runs on
        # jemalloc (common/memory.py, without_jemalloc).
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=without_jemalloc(dict(os.environ)))
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._relay = threading.Thread(target=self._log_lines, args=(self.proc.stderr,), daemon=True)
        self._relay.start()
        line = self.proc.stdout.readline()
        target = parse_listening(line)
        if target is None:
            code = self.proc.wait(30)
            raise InputError(f"the native front end did not start (exit {code}); its log is above")
        self.port = int(target.rsplit(":", 1)[1])

    @staticmethod
    def _log_lines(stream: IO[str]) -> None:
        for line in stream:
            log.info("%s", line.rstrip("\n").removeprefix("nlmserve_frontend: "))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def reload(self) -> None:
        """SIGHUP: the front end reads its token files again (an unusable one is logged and
        its tokens in force stay)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def report_heap(self) -> None:
        """SIGUSR1: the front end logs its heap (in use, free, resident)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def stop(self, timeout: float) -> int:
        """SIGTERM (drain within its grace period), then wait; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("the native front end did not stop within %.0f s: killing it", timeout)
            self.proc.kill()
            code = self.proc.wait(10)
        self._relay.join(5)
        return code
