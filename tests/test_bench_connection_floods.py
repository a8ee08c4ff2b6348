"""bench/connection_floods.py: floods of real connections against each front end, read from
the heap line each server process logs on SIGUSR1; the heap lines parsed as both languages
write them; bad flags one line."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import REPO
from test_cpp_client import driver  # noqa: F401 - the driver fixture builds build/native (or skips)

from bench import connection_floods
from bench._common import logged_heaps
from nlmserve.common.memory import heap_report


def test_the_heap_lines_are_read_back_by_process() -> None:
    """The Python server's line (common.memory.heap_report) and the front end's, as
    server/native/memory.h writes it, each read under its logger; the last line wins."""
    python_line = f"2026-12-07 07:00:00,000 INFO nlmserve.server.app: received SIGUSR1: {heap_report()}"
    frontend = ("2026-12-07 07:00:00,001 INFO nlmserve.server.frontend: got SIGUSR1: heap: 0.671 MiB in use, "
                "2.114 MiB free, 17.035 MiB resident")
    later = frontend.replace("0.671 MiB in use", "0.800 MiB in use")
    heaps = logged_heaps(["other line", python_line, frontend, later])
    assert set(heaps) == {"nlmserve.server.app", "nlmserve.server.frontend"}
    assert heaps["nlmserve.server.frontend"] == {"in_use": 0.8, "free": 2.114, "resident": 17.035}
    assert 0 < heaps["nlmserve.server.app"]["in_use"] and 0 < heaps["nlmserve.server.app"]["resident"]


def check_floods(tiny_model_path: Path, frontend: str, tmp_path: Path, *serve_args: str) -> dict[str, Any]:
    out = tmp_path / "floods.json"
    done = subprocess.run([sys.executable, "-m", "bench.connection_floods", "--model", str(tiny_model_path),
                           "--frontend", frontend, "--floods", "30,60", "--settle-seconds", "0.5", "--json", str(out),
                           "--serve-args", " ".join(serve_args)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    assert [r["flood"] for r in result["readings"]] == [0, 30, 60]
    assert [r["codes"] for r in result["readings"]] == [{}, {"OK": 30}, {"OK": 60}]
    roles = {"nlmserve serve", "front end"} if frontend == "native" else {"nlmserve serve"}
    for reading in result["readings"]:
        assert set(reading["heap"]) == roles
        for heap in reading["heap"].values():
            assert 0 < heap["in_use"] and 0 < heap["resident"] and heap["free"] >= 0
    assert "| 60 | nlmserve serve | OK 60 |" in done.stdout
    return result


def test_floods_of_the_python_server(tiny_model_path: Path, tmp_path: Path) -> None:
    """On the default malloc: jemalloc where the system has it."""
    result = check_floods(tiny_model_path, "python", tmp_path)
    on = "jemalloc" if ctypes.util.find_library("jemalloc") else "glibc's"
    assert [line.split()[0] for line in result["malloc"]] == [on]


def test_floods_of_the_native_front_end(driver: Path, tiny_model_path: Path, tmp_path: Path) -> None:  # noqa: F811
    """``--serve-args`` reach serve: both processes on glibc's malloc when it is asked for."""
    result = check_floods(tiny_model_path, "native", tmp_path, "--allocator", "glibc")
    assert result["malloc"] == ["glibc's", "glibc's"]
    heap = result["readings"][-1]["heap"]
    assert heap["front end"]["resident"] < heap["nlmserve serve"]["resident"]  # no model, no torch


@pytest.mark.parametrize("flags, message", [
    (["--floods", "10,x"], "--floods 10,x: comma-separated counts of connections"),
    (["--floods", "0"], "--floods: at least one flood, each of 1 connection or more"),
    (["--settle-seconds", "-1"], "--settle-seconds must be >= 0"),
])
def test_bad_flags_are_one_line(flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["connection_floods", *flags])
    with pytest.raises(SystemExit) as stopped:
        connection_floods.main()
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_a_model_the_server_refuses_is_one_line_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model.nlm"
    bad.write_text("hello\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "bench.connection_floods", "--model", str(bad), "--frontend", "python",
                           "--floods", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = [line for line in done.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and "did not start" in lines[0] and f"{bad}: not an nlmserve model file" in lines[0], done.stderr
