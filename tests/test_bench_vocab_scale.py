"""bench/vocab_scale.py without Moses or a large model: its scorer driver scores the contract's
tables files as the Python scorer does, its table from a hand-made run (the ratios taken within
each round), and the page holds the recorded run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import vocab_scale
from support import REPO

CONTRACT = REPO / "proto" / "contract"


@pytest.mark.parametrize("name", ["scoring_tables.nlt", "scoring_tables.fp16.nlt", "scoring_tables.int8.nlt"])
def test_the_driver_scores_the_text_as_python_does(name: str, tmp_path: Path) -> None:
    """The contract's 3-gram model (tanh, direct features), the text "the été" and "straße
    nowhere": by hand, rows <s> <s> the, <s> the été, the été </s>, <s> <s> straße, <s> straße
    <unk>, straße <unk> </s>; the driver's checksum is the sum of the Python scorer's scores of
    them, in every form of the file."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but g++ is missing: make system-deps installs it")
        pytest.skip("needs g++ (make system-deps)")
    from nlmserve.lm.tables_scorer import TablesScorer

    binary, _ = vocab_scale.build_driver(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("the été\nstraße nowhere\n", encoding="utf-8")
    got = vocab_scale.time_scorer(binary, CONTRACT / name, text, passes=2)
    unk, bos, eos, the, ete, strasse = 0, 1, 2, 3, 4, 5
    rows = np.array([[bos, bos, the], [bos, the, ete], [the, ete, eos],
                     [bos, bos, strasse], [bos, strasse, unk], [strasse, unk, eos]], dtype=np.int64)
    want = TablesScorer.open(CONTRACT / name).score_rows(rows).astype(np.float64).sum()
    assert (got["rows"], got["calls"], got["words"], got["unknown"]) == (6, 2, 4, 1)
    assert got["checksum"] == pytest.approx(want, abs=1e-5)
    assert len(got["ns_per_row"]) == 2 and got["median_ns_per_row"] > 0


def _scorer_run(ns: float, first: float) -> dict[str, Any]:
    return {"map_s": 0.0001, "lookup_ns_per_word": 30.0, "first_lookup_ns_per_word": 60.0, "words": 90, "unknown": 3,
            "rows": 100, "calls": 10, "first_ns_per_row": first, "ns_per_row": [ns, ns + 10, ns - 10],
            "median_ns_per_row": ns, "checksum": -1.0}


def _result() -> dict[str, Any]:
    model = {"path": "/m/x.nlm", "order": 5, "dim": 256, "output": "class", "objective": "nce", "lowercase": False,
             "ngram_features": False}
    small = {n: [_scorer_run(ns, 400) for ns in (300, 400)] for n in vocab_scale.FORMS}
    large = {n: [_scorer_run(ns, 500) for ns in (330, 360)] for n in vocab_scale.FORMS}
    proc = {"pss": 300 * 1024, "rss": 500 * 1024, "file_pss": 50 * 1024, "file_rss": 200 * 1024}
    return {"machine": {"cpu": "CPU X", "cores": 2, "load_average_1m": 1.0}, "load_average_end_1m": 1.5,
            "command": "bench/vocab_scale.py --rounds 2 --json /scratch/v.json", "text": "/work/shared/data/lm/dev.en",
            "models": {"small": {**model, "vocab_size": 1000}, "large": {**model, "vocab_size": 100_000}},
            "files": {n: {q: {"bytes": b * 10**6} for q, b in zip(vocab_scale.FORMS, (400, 200, 100))}
                      for n in vocab_scale.MODELS},
            "scorer": {"compiler": "g++ 12", "flags": "-O3", "passes": 3, "rounds": 2,
                       "runs": {"small": small, "large": large}},
            "decoders": {"n": 4, "lines": 20, "runs": {"large none": [proc] * 4},
                         "load_seconds": {"large none": [1.0, 1.25, 1.5]}}}


def test_the_tables_from_a_hand_made_run() -> None:
    """Round 1: 330 / 300 = 1.10; round 2: 360 / 400 = 0.90; their median 1.00 (the medians'
    ratio, 345 / 350, would say 0.99), their quartiles 0.95 and 1.05. Four decoders of 300 MiB PSS, each with 200 MiB
    of the file resident and a 50 MiB share of it: 200 MiB of the file counted in all."""
    text = vocab_scale.render(_result())
    lines = text.splitlines()
    assert lines[0] == "<!-- bench/vocab_scale.py: begin -->" and lines[-1] == "<!-- bench/vocab_scale.py: end -->"
    assert "| `--quantize none` | 400.0 | 400.0 | 0.10 / 0.10 | 350 | 345 | 1.00 (0.95–1.05) | 400 / 500 |" in lines
    assert "| large `none` | 400.0 | 1,200 | 300 | 200 | 200 | 1.25 (1.00, 1.25, 1.50) |" in lines
    assert "`python -m bench.vocab_scale --rounds 2 --json v.json`" in lines
    assert "`../shared/data/lm/dev.en` (90 words, 3 unknown to the small model, 3 to the large)" in text


def test_the_page_holds_the_rendered_run() -> None:
    """docs/performance-tables.md's section is what --render writes from bench/results/vocab-scale.json."""
    result = json.loads((REPO / "bench" / "results" / "vocab-scale.json").read_text(encoding="utf-8"))
    assert vocab_scale.render(result) in (REPO / "docs" / "performance-tables.md").read_text(encoding="utf-8")


def test_a_directory_as_the_model_is_one_line(tmp_path: Path) -> None:
    """A wrong --model (a directory) is one line and exit code 1, no traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.vocab_scale", "--model", str(tmp_path), "--small",
                           str(tmp_path), "--text", os.devnull], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == f"{tmp_path}: cannot read model file: Is a directory"
