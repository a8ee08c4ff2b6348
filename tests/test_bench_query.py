"""bench/query.py without a clock: KenLM's bins (the quantisation int8 was chosen over), the
tables it renders from hand-made runs, and the pages holding the runs saved in bench/results."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import query
from support import REPO


def test_kenlm_bins_keep_few_values_and_take_the_nearest_centre() -> None:
    """A table of at most 256 distinct values is kept exactly; with more, every value becomes
    the nearest of 256 centres, each the mean of an equal share of the values in order."""
    few = np.repeat(np.arange(200, dtype=np.float32) / 8, 3).reshape(1, 60, 10)
    np.testing.assert_array_equal(query.binned(few), few)
    many = np.arange(512, dtype=np.float32).reshape(1, 64, 8)
    got = query.binned(many).reshape(-1)
    centres = np.arange(256, dtype=np.float32) * 2 + 0.5  # the mean of each pair 2k, 2k+1
    assert set(got.tolist()) == set(centres.tolist())
    assert np.abs(got - many.reshape(-1)).max() == 0.5


def _errors_run() -> dict:  # type: ignore[type-arg]
    form = {"mean": 0.01, "p99": 0.05, "max": 0.09, "bound": 2.0, "perplexity": 100.5, "bytes": 25_000_000}
    bins = {**form, "bound": float("nan"), "mean": 0.1}
    return {"command": "bench/query.py --model m.nlm --errors /scratch/dev.txt",
            "texts": {"/scratch/dev.txt": {"ngrams": 1234, "perplexity": 100.25, "bytes": 100_000_000,
                                           "forms": {"fp16": form, "int8": form, "int8, KenLM's bins": bins}}}}


def test_the_errors_table() -> None:
    lines = query.render_errors(_errors_run()).splitlines()
    assert lines[0] == "<!-- bench/query.py errors: begin -->" and lines[-1] == "<!-- bench/query.py errors: end -->"
    assert "`python -m bench.query --model m.nlm --errors dev.txt`" in lines
    assert ("1,234 n-grams of `dev.txt`; float32: 100.0 MB, perplexity of the self-normalised scores 100.25."
            in lines)
    assert "| int8 | 25.0 | 0.01000 | 0.0500 | 0.0900 | 2 | 100.50 |" in lines
    assert "| int8, KenLM's bins | 25.0 | 0.10000 | 0.0500 | 0.0900 | - | 100.50 |" in lines


def test_the_speed_table() -> None:
    row = {"start_s": 0.5, "text_s": 2.5, "ngrams_per_s": 100_000.0, "file_bytes": 50_000_000}
    result = {"machine": {"cpu": "CPU X", "cores": 2, "load_average_1m": 0.3}, "load_average_end_1m": 0.4,
              "command": "bench/query.py --model m.nlm --text /scratch/t.txt", "text": "/scratch/t.txt", "lines": 10,
              "ngrams": 200_000, "rounds": 3, "rows": {"query --tables (int8)": row},
              "vocabulary": {"python_open_lookup_ms": 1.25, "python_dict_ms": 40.0}}
    text = query.render(result)
    assert "| query --tables (int8) | 50.0 | 0.50 | 2.50 | 100,000 |" in text.splitlines()
    assert "CPU X, 2 cores, load 0.3 at the start and 0.4 at the end; 10 lines, 200,000 n-grams (`t.txt`)" in text
    assert "in 1.2 ms, and builds the dict of every word" in text and "C++" not in text


@pytest.mark.parametrize("saved,page,render", [("query-errors.json", "interfaces.md", "render_errors"),
                                               ("query.json", "performance-tables.md", "render")])
def test_the_pages_hold_the_saved_runs(saved: str, page: str, render: str) -> None:
    path = REPO / "bench" / "results" / saved
    if not path.exists():
        pytest.skip(f"no saved run {saved}")
    result = json.loads(path.read_text(encoding="utf-8"))
    assert getattr(query, render)(result) in (REPO / "docs" / page).read_text(encoding="utf-8")
