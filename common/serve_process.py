"""``nlmserve.common.serve_process``: the lines ``nlmserve serve`` prints once bound, and ``nlmserve
serve`` started as a subprocess that is ready when it returns.

Once its port is bound the server writes to stdout, in this order, and nothing else (its log
goes to stderr)::

    listening on HOST:PORT
    metrics on http://HOST:PORT/metrics      (with --metrics-port only)

``server.app`` prints them with :func:`listening_line` and :func:`metrics_line`; whoever
starts a server (the Moses experiment, benchmarks, tests) calls :func:`start_server`, which
reads them. The native front end prints the same ``listening on`` line. Whoever must name a
port before anything binds it (torchrun's master port, a server restarted on the port of one
that died) takes one from :func:`free_port`. Only the standard library is imported here.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Sequence

from .errors import NlmserveError

log = logging.getLogger(__name__)

_LISTENING = re.compile(r"listening on (\S+:\d+)")
_METRICS = re.compile(r"metrics on (http://\S+:\d+/metrics)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket holds now: the kernel's pick for port 0, released
    at once (another process may take it before the caller binds it; a server that can be
    given port 0 should be, and its port read from its ``listening on`` line)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening_line(host: str, port: int) -> str:
    """``listening on HOST:PORT``: the server's first stdout line (no newline)."""
    return f"listening on {host}:{port}"


def metrics_line(host: str, port: int) -> str:
    """``metrics on http://HOST:PORT/metrics``: the second, with a metrics port."""
    return f"metrics on http://{host}:{port}/metrics"


def parse_listening(line: str) -> str | None:
    """``HOST:PORT`` of a ``listening on`` line (trailing white space allowed), else None."""
    m = _LISTENING.fullmatch(line.strip())
    return m.group(1) if m else None


def parse_metrics(line: str) -> str | None:
    """The /metrics URL of a ``metrics on`` line, else None."""
    m = _METRICS.fullmatch(line.strip())
    return m.group(1) if m else None


def nlmserve_command() -> list[str]:
    """How to run the ``nlmserve`` CLI of this installation in a subprocess."""
    return [sys.executable, "-m", "nlmserve"]


@dataclass
class ServerProcess:
    """A running ``nlmserve serve``: its process, ``HOST:PORT``, every stdout line so far and,
    when it serves metrics, their URL."""

    process: subprocess.Popen[str]
    target: str
    lines: list[str] = field(default_factory=list)
    metrics_url: str | None = None

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    @property
    def metrics_port(self) -> int | None:
        return int(self.metrics_url.rsplit(":", 1)[1].split("/")[0]) if self.metrics_url else None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM (the server drains), then SIGKILL if it has not exited within ``grace`` s."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("server %d did not stop in %.0f s; killing it", self.process.pid, grace)
            self.process.kill()
            self.process.wait()

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL (if it still runs) and wait."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout)


def start_server(model: str | Path, extra: Sequence[str] = (), timeout: float = 180.0,
                 env: dict[str, str] | None = None, cwd: Path | None = None, *, port: int = 0,
                 metrics_port: int | None = None, stderr: int | IO[Any] | None = None,
                 command: Sequence[str] | None = None) -> ServerProcess:
    """Start ``nlmserve serve --model M --port PORT [--metrics-port P] EXTRA...`` and wait
    (``timeout`` s) for its ``listening on`` line, and its ``metrics on`` line when
    ``metrics_port`` is given (0: a free one). ``NlmserveError`` (the process killed) when it
    does not come.

    ``env``, ``cwd``: the subprocess's environment and directory (default: this process's),
    e.g. another installation's ``PYTHONPATH``; ``stderr``: where its log goes (default:
    this process's stderr); ``command``: how to run the CLI (default :func:`nlmserve_command`).
    A thread reads the server's stdout to the end, so use ``lines``, not ``process.stdout``.
    """
    cmd = [*(command or nlmserve_command()), "serve", "--model", str(model), "--port", str(port)]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    cmd += list(extra)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1,
                               env=env, cwd=cwd)
    found: list[str] = []
    ready = threading.Event()

    def addresses() -> tuple[str | None, str | None]:
        target = next((t for t in map(parse_listening, found) if t), None)
        url = next((u for u in map(parse_metrics, found) if u), None)
        return target, url

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            found.append(line.rstrip("\n"))
            target, url = addresses()
            if target is not None and (metrics_port is None or url is not None):
                ready.set()
        ready.set()

    threading.Thread(target=read, name=f"nlmserve-serve-{process.pid}", daemon=True).start()
    ready.wait(timeout)
    target, url = addresses()
    if target is None or (metrics_port is not None and url is None):
        process.kill()
        process.wait()
        raise NlmserveError(f"server did not start: {' '.join(cmd)} (output: {found[-3:]})")
    log.info("server %d listening on %s", process.pid, target)
    return ServerProcess(process, target, found, url)
