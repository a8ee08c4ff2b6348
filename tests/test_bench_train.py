"""bench/train.py names the training step of every run: NCE with ``--nce-step`` (default
``fused``), the other objectives with ``torch``; a run the named step cannot train is refused
before it trains, and each row says which step ran and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import train as bench_train
from nlmserve.common.errors import InputError


def test_each_objective_is_given_a_named_step() -> None:
    assert bench_train.step_of("nce", "fused") == "fused"
    assert bench_train.step_of("nce", "torch") == "torch"
    assert bench_train.step_of("mle", "fused") == "torch" and bench_train.step_of("softmax", "fused") == "torch"


def test_a_run_the_fused_step_cannot_train_is_refused(train_small_path: Path, dev_small_path: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NLMSERVE_FUSED", "0")
    with pytest.raises(InputError, match="--step fused does not apply: NLMSERVE_FUSED=0"):
        bench_train.main(["--train", str(train_small_path), "--dev", str(dev_small_path), "--objectives", "nce",
                          "--dim", "8", "--minutes", "0.01", "--workdir", str(tmp_path)])


def test_the_rows_say_which_step_ran_and_why(train_small_path: Path, dev_small_path: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NLMSERVE_FUSED", "0")  # the torch step, asked for: runs anyway
    assert bench_train.main(["--train", str(train_small_path), "--dev", str(dev_small_path), "--objectives", "nce",
                             "--nce-step", "torch", "--dim", "8", "--batch-size", "64", "--minutes", "0.005",
                             "--workdir", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert (row["objective"], row["step"], row["step_reason"]) == ("nce", "torch", "--step torch")
    assert "| nce | torch | class |" in out
