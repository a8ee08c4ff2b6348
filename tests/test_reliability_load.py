"""A shorter run of ``python -m bench.load``: 64 concurrent clients against a real ``nlmserve serve``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_64_clients_mixing_tiny_and_large_requests_lose_nothing(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, "-m", "bench.load", "--model", str(tiny_model_path), "--seconds", "15",
                           "--warmup", "4", "--clients", "64", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.exists(), done.stderr[-3000:]
    result = json.loads(out.read_text())
    classes = result["classes"]
    assert result["failed"] == 0, {k: c["examples"] for k, c in classes.items()}
    # Nothing lost: every request of every class came back with all its n-grams, each checked
    # against the in-process score (bench/load.py counts only those), tiny ones 1-3 n-grams,
    # large ones at least 5,000.
    for name, smallest in (("tiny", 1), ("large_ids", 5_000), ("large_strings", 5_000)):
        c = classes[name]
        assert c["requests"] >= (200 if name == "tiny" else 10), c
        assert c["failed"] == 0 and c["ngrams"] >= smallest * c["requests"], c
    assert classes["large_ids"]["ngrams"] >= 10 * 5_000
    # Mixed, not queued behind one another: a tiny request's median wait is below a large one's.
    assert classes["tiny"]["p50_ms"] < min(classes["large_ids"]["p50_ms"], classes["large_strings"]["p50_ms"]), classes
    assert result["rss_growth"] < 0.10, result["rss_kib"]
    assert result["server_exit_code"] == 0
    assert done.returncode == 0 and "OK" in done.stdout.splitlines()[-1], done.stdout
