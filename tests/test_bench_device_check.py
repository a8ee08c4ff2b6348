"""bench/device_check.py, the accelerator check, run here on the CPU alone (``--device cpu``):
the same script a GPU machine runs, end to end, and the section it renders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import device_check
from support import REPO


def test_without_a_gpu_cuda_is_refused_with_the_way_out() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="--device cpu"):
        device_check._devices("cuda")


def test_the_check_runs_on_the_cpu_and_renders_its_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = subprocess.run(["sh", str(REPO / "bench" / "device_check.sh"), "--device", "cpu", "--train-steps", "60",
                           "--scaling-steps", "40", "--seconds", "0.2", "--work", str(tmp_path / "w"),
                           "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    train = result["training"]["cpu"]
    assert train["step_ran"] == "fused" and train["steps"] == 60 and train["tokens"] == 60 * 512
    assert train["valid_ppl"] > 1
    # the CPU tables against the torch code a GPU runs: the same scores within the bound
    scores = result["scores"]
    assert scores["against"] == "cpu" and scores["ngrams"] > 20_000 and scores["within_bound"]
    assert 0 < scores["largest_difference"]["cpu, torch code"]["exact"] <= device_check.SCORE_BOUND
    serving = result["serving"]["cpu"]
    assert serving["engine_4096_self-normalised"] > 0 and 0 < serving["single"]["p50_ms"] <= serving["single"]["p99_ms"]
    text = device_check.render(result)
    assert text.splitlines()[0] == "<!-- bench/device_check.py: begin -->"
    assert "| cpu | fused |" in text and "bound 0.001: met" in text
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- bench/device_check.py: begin -->\n<!-- bench/device_check.py: end -->\nafter\n")
    saved = subprocess.run([sys.executable, "-m", "bench.device_check", "--render", str(doc), str(out)], cwd=REPO,
                           capture_output=True, text=True)
    assert saved.returncode == 0, saved.stderr
    assert doc.read_text() == f"before\n{text}\nafter\n"
