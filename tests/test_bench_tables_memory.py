"""bench/tables_memory.py without Moses: reading a live process's memory from /proc (a file
this process maps), the verdict rule and the table it renders from a hand-made run."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from bench import tables_memory
from support import REPO


def test_the_pss_of_a_mapped_file_is_read_from_smaps(tmp_path: Path) -> None:
    """This process maps 64 pages of a file and touches each: smaps shows them resident, and
    not shared with anyone, the whole of them in its PSS; the rollup is at least as large."""
    path = tmp_path / "tables.nlt"
    path.write_bytes(b"\1" * (64 * 4096))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) == 64
        got = tables_memory.smaps_kb(os.getpid(), path)
    assert got["file_rss"] == got["file_pss"] == 256
    assert got["pss"] >= got["file_pss"] and got["rss"] >= got["file_rss"]
    assert "file_pss" not in tables_memory.smaps_kb(os.getpid())


def _run(file_pss_kb: list[int]) -> dict:  # type: ignore[type-arg]
    return {"machine": {"cpu": "CPU X"}, "command": "bench/tables_memory.py --decoders 2 --json /scratch/t.json",
            "decoders": 2, "lines": 20, "tables_bytes": 100 * 2**20,
            "runs": {"fetched": [{"pss": 300 * 1024, "rss": 310 * 1024}, {"pss": 300 * 1024, "rss": 310 * 1024}],
                     "mapped": [{"pss": 250 * 1024, "rss": 300 * 1024, "file_pss": k, "file_rss": 100 * 1024}
                                for k in file_pss_kb]}}


def test_the_table_and_its_verdict() -> None:
    """Two decoders of 300 MiB each fetched, 250 MiB mapped with 50 MiB each of a 100 MiB
    file: 100 MiB saved, the tables counted once (met); counted 1.5 times, not met."""
    text = tables_memory.render(_run([50 * 1024, 50 * 1024]))
    lines = text.splitlines()
    assert lines[0] == "<!-- bench/tables_memory.py: begin -->" and lines[-1] == "<!-- bench/tables_memory.py: end -->"
    assert "| fetched (a copy each) | 600 MiB | 300 MiB | 200 MiB (the difference, plus the file's share below) " \
           "| 310 MiB |" in lines
    assert "| mapped (`tables=FILE`) | 500 MiB | 250 MiB | 100 MiB (the file's mappings) | 300 MiB |" in lines
    assert "Saved: 100 MiB for 2 decoders (50 MiB each). Verdict: met, the mapped tables count 100 MiB in all " \
           "for a 100 MiB file. Command: `python -m bench.tables_memory --decoders 2 --json t.json` (CPU X)." in text
    assert tables_memory.verdict(_run([75 * 1024, 75 * 1024])).startswith("not met, the mapped tables count 150 MiB")


def test_the_page_holds_the_rendered_run() -> None:
    """docs/performance-tables.md's section is what --render writes from bench/results/tables-memory.json."""
    import json

    result = json.loads((REPO / "bench" / "results" / "tables-memory.json").read_text(encoding="utf-8"))
    assert tables_memory.render(result) in (REPO / "docs" / "performance-tables.md").read_text(encoding="utf-8")


def test_the_load_times_line() -> None:
    """With single-decoder loads recorded, their line: each round and the median of each way."""
    result = {**_run([50 * 1024, 50 * 1024]), "load_seconds": {"fetched": [1.5, 1.25, 1.75], "mapped": [0.25, 0.5, 0.3]}}
    assert ("One decoder alone, from its start until the tables are ready (the feature's log line), 3 rounds in "
            "turn: fetched 1.50, 1.25, 1.75 s (median 1.50), mapped 0.25, 0.50, 0.30 s (median 0.30).") \
        in tables_memory.render(result)
    assert "One decoder alone" not in tables_memory.render(_run([1, 1]))

