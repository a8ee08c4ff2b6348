"""bench/allocator.py: its table from a result (medians of the rounds, ratios jemalloc /
glibc, what each process kept above its start after each flood), and bad flags one line.
The measurement itself runs servers for minutes: `python -m bench.allocator`."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from bench import allocator


def heap(resident: float) -> dict[str, float]:
    return {"in_use": 1.0, "free": 0.0, "resident": resident}


def floods(start: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    return {"readings": [{"flood": 0, "heap": {k: heap(v) for k, v in start.items()}},
                         {"flood": 1000, "heap": {k: heap(v) for k, v in after.items()}}]}


def test_the_table_takes_medians_and_ratios() -> None:
    def runs(*rates: float) -> list[dict[str, float]]:
        return [{"ngrams_per_s": r, "server_cpu_us_per_request": 1e6 / r} for r in rates]

    result = {"command": "python -m bench.allocator", "seconds": 6.0,
              "machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 0.5},
              "speed": {"load": "nlmserve_load", "runs": {
                  "python glibc": runs(900, 1000, 5000), "python auto": runs(800, 200, 900),
                  "native glibc": runs(4000, 4000, 4000), "native auto": runs(5000, 5000, 1)}},
              "memory": {"python glibc": floods({"nlmserve serve": 240.0}, {"nlmserve serve": 249.5}),
                         "python auto": floods({"nlmserve serve": 241.0}, {"nlmserve serve": 243.5}),
                         "native glibc": floods({"front end": 16.0, "nlmserve serve": 240.0},
                                                {"front end": 20.5, "nlmserve serve": 240.0}),
                         "native auto": floods({"front end": 16.0, "nlmserve serve": 241.0},
                                               {"front end": 20.0, "nlmserve serve": 241.0})}}
    table = allocator.render(result)
    # medians: python 1000 against 800 (0.80), CPU 1000 µs against 1250 (1.25); native 4000 / 5000
    assert "| python | 1,000 | 800 | 0.80 | 1000 | 1250 | 1.25 |" in table
    assert "| native | 4,000 | 5,000 | 1.25 | 250 | 200 | 0.80 |" in table
    assert "| 1000 | python: nlmserve serve | +9.5 | +2.5 |" in table
    assert "| 1000 | native: front end | +4.5 | +4.0 |" in table
    assert "3 rounds of 6 s" in table


@pytest.mark.parametrize("flags, message", [
    (["--floods", "10,x"], "--floods 10,x: comma-separated counts of connections"),
    (["--floods", "0"], "--floods: at least one flood, each of 1 connection or more"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_flags_are_one_line(flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["allocator", *flags])
    with pytest.raises(SystemExit) as stopped:
        allocator.main()
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
