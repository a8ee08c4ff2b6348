"""bench/heap_per_call.py against the tiny real model: both rounds of each pattern run from
a client process of their own and the result says bytes per call; an unknown pattern is
one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import heap_per_call

REPO = Path(__file__).resolve().parent.parent


def test_each_pattern_reads_bytes_per_call(tiny_model_path: Path, tmp_path: Path) -> None:
    result, printed = heap_per_call(tiny_model_path, 2000, "check,rapid_reset", tmp_path)
    assert result["calls"] == 2000 and set(result["patterns"]) == {"check", "rapid_reset"}
    # Answered calls and resets keep nothing: a few bytes a call at most, well under the
    # ~100 that a kept block of gRPC's would read.
    for row in result["patterns"].values():
        assert abs(row["bytes_per_call"]) < 60, result
    assert [line.split()[0] for line in printed.splitlines()] == ["check", "rapid_reset"]


def test_an_unknown_pattern_is_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.heap_per_call", "--patterns", "score,slowloris"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown patterns slowloris" in done.stderr and "Traceback" not in done.stderr


def test_a_json_path_that_is_a_directory_is_one_line_before_the_run(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.heap_per_call", "--json", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is a directory" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.parent.glob(tmp_path.name + ".tmp"))


def test_write_json_leaves_nothing_beside_a_path_it_cannot_replace(tmp_path: Path) -> None:
    from bench._common import write_json

    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(OSError):
        write_json(target, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
