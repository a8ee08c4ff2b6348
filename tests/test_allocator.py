"""The servers' malloc: ``nlmserve serve`` runs itself again with jemalloc preloaded where the
system has it (``--allocator auto``, the default; ``common.memory.jemalloc_environment``), its
native front end inheriting it, and a flood of connections then leaves a fraction of what
glibc's malloc kept (gRPC's per-connection records each pinned a page of the flood's freed
blocks). Real servers on 127.0.0.1 (port 0) over the tiny real model; resident memory read
from /proc; jemalloc is Debian's libjemalloc2 (``make system-deps``)."""

from __future__ import annotations

import asyncio
import ctypes.util
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from nlmserve.common import memory
from nlmserve.common.errors import InputError
from nlmserve.common.serve_process import nlmserve_command
from nlmserve.server.cli import run_on_allocator

from bench._common import tree_pids
from bench.connection_floods import flood
from support import open_files, serve_subprocess, start_server
from test_native_frontend import FRONTEND, socket_flags
from test_cpp_client import driver  # noqa: F401 - the driver fixture builds build/native

#: Connections in the flood, and what it may leave resident on jemalloc (measured with
#: python -m bench.connection_floods: the Python server 3.3 MiB after 2,000, against 15 on
#: glibc's malloc).
FLOOD = 2000
PYTHON_KEPT_MIB = 8.0
#: After a flood: the servers trim (the front end every second, the Python server every
#: 2 s) and jemalloc's background thread purges within a second.
SETTLE_SECONDS = 4.0


@pytest.fixture(scope="module")
def jemalloc() -> None:
    if ctypes.util.find_library("jemalloc") is None:
        message = "jemalloc is not installed (Debian: libjemalloc2, in `make system-deps`)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def many_files() -> Iterator[None]:
    """This process may open the flood's connections."""
    with open_files(FLOOD):
        yield


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def wait_for(log: Path, pattern: str, timeout: float = 10.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(encoding="utf-8", errors="replace"))
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in {log}:\n{log.read_text()[-2000:]}")


def stopped(server: Any) -> int:
    server.process.send_signal(signal.SIGTERM)
    return server.process.wait(60)


def test_serve_runs_on_jemalloc_where_it_is_installed(jemalloc: None, tiny_model_path: Path, tmp_path: Path) -> None:
    """The default: the same process (its pid, its arguments) with jemalloc mapped, the
    server's settings in MALLOC_CONF, and the heap it reports is jemalloc's count (in use
    above the model's tensors; glibc's own heap would read almost nothing)."""
    log = tmp_path / "serve.log"
    server = serve_subprocess(tiny_model_path, log=log)
    try:
        assert "libjemalloc" in maps(server.process.pid)
        assert f"malloc: jemalloc (MALLOC_CONF={memory.SERVER_MALLOC_CONF}, PYTHONMALLOC=malloc)" in log.read_text()
        server.process.send_signal(signal.SIGUSR1)
        in_use = float(wait_for(log, r"received SIGUSR1: heap: ([0-9.]+) MiB in use").group(1))
        assert in_use > 1.0
    finally:
        assert stopped(server) == 0


def test_glibc_is_kept_when_asked_and_a_users_malloc_conf_wins(jemalloc: None, tiny_model_path: Path,
                                                               tmp_path: Path) -> None:
    """``--allocator glibc``: no jemalloc in the process. A MALLOC_CONF of the user's own is
    what jemalloc runs with."""
    log = tmp_path / "glibc.log"
    server = serve_subprocess(tiny_model_path, "--allocator", "glibc", log=log)
    try:
        assert "libjemalloc" not in maps(server.process.pid)
        assert "malloc: glibc's" in log.read_text()
    finally:
        assert stopped(server) == 0
    log = tmp_path / "conf.log"
    server = serve_subprocess(tiny_model_path, log=log, env={**os.environ, "MALLOC_CONF": "tcache:false"})
    try:
        assert "malloc: jemalloc (MALLOC_CONF=tcache:false, PYTHONMALLOC=malloc)" in log.read_text()
    finally:
        assert stopped(server) == 0


def test_jemalloc_asked_for_and_not_loadable_is_one_line(tiny_model_path: Path) -> None:
    """``--allocator jemalloc`` where it cannot be loaded (a preload that the dynamic loader
    could not find): exit 1 with one line naming the package and the other choice; the
    process does not run itself again and again."""
    env = {**os.environ, "LD_PRELOAD": "/nonexistent/libjemalloc.so.2"}
    done = subprocess.run([*nlmserve_command(), "serve", "--model", str(tiny_model_path), "--port", "0",
                           "--allocator", "jemalloc"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("nlmserve serve: error:")]
    assert errors == ["nlmserve serve: error: --allocator jemalloc: libjemalloc.so.2 cannot be loaded (Debian: apt "
                      "install libjemalloc2), or use --allocator glibc"], done.stderr
    assert "Traceback" not in done.stderr


def test_auto_without_jemalloc_stays_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the system has no jemalloc, auto goes on as it is and jemalloc is refused."""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail(f"ran itself again: {a}"))
    assert memory.jemalloc_environment({"PATH": "/bin"}) is None
    run_on_allocator("auto")
    with pytest.raises(InputError, match="--allocator jemalloc: libjemalloc.so.2 cannot be loaded"):
        run_on_allocator("jemalloc")


def test_jemalloc_environment_keeps_the_users_preloads_and_settings(jemalloc: None) -> None:
    env = memory.jemalloc_environment({"LD_PRELOAD": "libfoo.so", "MALLOC_CONF": "narenas:2"})
    assert env is not None
    assert env["LD_PRELOAD"] == "libjemalloc.so.2 libfoo.so" and env["MALLOC_CONF"] == "narenas:2"
    assert env["PYTHONMALLOC"] == "malloc"
    assert memory.jemalloc_environment({})["MALLOC_CONF"] == memory.SERVER_MALLOC_CONF  # type: ignore[index]
    assert memory.jemalloc_environment({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None


def flooded(target: str, pids: list[int]) -> list[float]:
    """MiB each of ``pids`` holds after a flood of FLOOD connections (each a health Check,
    answered), beyond what it held before it."""
    time.sleep(SETTLE_SECONDS)
    before = [memory.resident_bytes(pid) or 0 for pid in pids]
    codes = asyncio.run(flood(target, FLOOD))
    assert codes == {"OK": FLOOD}, codes
    time.sleep(SETTLE_SECONDS)
    return [((memory.resident_bytes(pid) or 0) - b) / 2**20 for pid, b in zip(pids, before)]


def test_a_flood_of_connections_leaves_little_on_the_python_server(jemalloc: None, many_files: None,
                                                                   tiny_model_path: Path, tmp_path: Path) -> None:
    """2,000 connections at once, then gone: the Python server keeps under 8 MiB of it (3.3
    measured; 15 on glibc's malloc, which fails this)."""
    server = serve_subprocess(tiny_model_path, log=tmp_path / "serve.log")
    try:
        [kept] = flooded(server.target, [server.process.pid])
        assert kept < PYTHON_KEPT_MIB, kept
    finally:
        assert stopped(server) == 0


def test_the_native_front_end_keeps_glibcs_malloc(driver: Path, jemalloc: None, tiny_model_path: Path,  # noqa: F811
                                                 tmp_path: Path) -> None:
    """``serve --frontend native`` on jemalloc: its front end runs on glibc's malloc (with
    its own settings) and says so; a preload of the user's own other than jemalloc stays."""
    log = tmp_path / "serve.log"
    env = {**os.environ, "LD_PRELOAD": "libpthread.so.0"}
    server = serve_subprocess(tiny_model_path, "--frontend", "native", "--frontend-binary", str(FRONTEND), log=log,
                              env=env)
    try:
        frontend = tree_pids(server.process.pid)[1]
        assert "libjemalloc" in maps(server.process.pid) and "libjemalloc" not in maps(frontend)
        environ = Path(f"/proc/{frontend}/environ").read_bytes().split(b"\0")
        assert b"LD_PRELOAD=libpthread.so.0" in environ
        wait_for(log, r"nlmserve\.server\.frontend: listening on .*; malloc: glibc's")
    finally:
        assert stopped(server) == 0


def test_the_front_end_reports_jemallocs_heap_when_preloaded(driver: Path, jemalloc: None,  # noqa: F811
                                                             tiny_lm: Any, tmp_path: Path) -> None:
    """The front end started on jemalloc by hand: its start line says so, and SIGUSR1's heap
    line is jemalloc's count (glibc's own would be almost nothing in use)."""
    running = start_server(tiny_lm)
    env = {**os.environ, "LD_PRELOAD": memory.JEMALLOC_LIBRARY, "MALLOC_CONF": memory.SERVER_MALLOC_CONF}
    proc = subprocess.Popen([str(FRONTEND), "--backend", running.target, "--listen", "127.0.0.1:0",
                             *socket_flags(running, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        running.stop(1.0)
    assert f"malloc: jemalloc (MALLOC_CONF={memory.SERVER_MALLOC_CONF})" in err, err[-2000:]
    in_use = re.search(r"got SIGUSR1: heap: ([0-9.]+) MiB in use", err)
    assert in_use is not None and float(in_use.group(1)) > 0.1, err[-2000:]
