"""bench/scoring.py: both scoring paths agree before anything is timed, a --quick run writes
nothing a page could show, and the page shows the saved run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scoring

REPO = Path(__file__).resolve().parent.parent


def test_a_quick_run_scores_both_batches_by_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert scoring.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("decoder ", "distinct "))]
    # decoder and distinct batches, exact and self-normalised: 4 x 12 rows each
    assert [(r[0], r[1], r[5]) for r in rows] == [("decoder", "48", "exact"), ("decoder", "48", "unnorm"),
                                                  ("distinct", "48", "exact"), ("distinct", "48", "unnorm")]
    decoder, distinct = rows[0], rows[2]
    assert int(decoder[2]) == 4  # the 4 hypotheses' contexts, shared by their 12 targets each
    assert int(distinct[2]) == 48  # no two rows of the distinct batch share a context


def test_a_quick_run_refuses_to_write_results(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        scoring.main(["--quick", "--json", str(tmp_path / "x.json")])
    assert e.value.code == 2
    assert not (tmp_path / "x.json").exists()


def test_the_page_shows_the_saved_run() -> None:
    """docs/performance-serving.md's de-duplication table is what --render writes from bench/results/scoring.json."""
    saved = json.loads((REPO / "bench" / "results" / "scoring.json").read_text(encoding="utf-8"))
    assert {(r["batch"], r["normalized"]) for r in saved["results"]} == {
        ("decoder", True), ("decoder", False), ("distinct", True), ("distinct", False)}
    assert scoring.render(saved) in (REPO / "docs" / "performance-serving.md").read_text(encoding="utf-8")


def test_render_of_a_file_that_is_not_a_saved_run_is_one_line(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("before\n<!-- bench/scoring.py: begin -->\n<!-- bench/scoring.py: end -->\n", encoding="utf-8")
    (tmp_path / "page.json").write_text("# not JSON\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="page.json: not a saved run's JSON"):
        scoring.main(["--render", str(doc), str(tmp_path / "page.json")])
    assert "before" in doc.read_text(encoding="utf-8")  # the page is left as it was
