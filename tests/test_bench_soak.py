"""bench/soak.py without running it: the bad files its faults put in place, and a table that
says the target was missed when one authorised request failed."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

from support import REPO

from bench import soak


def test_the_faults_files(tmp_path: Path) -> None:
    good = tmp_path / "good.nlm"
    good.write_bytes(b"x" * 1000)
    dst = tmp_path / "served.nlm"
    soak._put(good, dst, "good")
    assert dst.read_bytes() == good.read_bytes()
    soak._put(good, dst, "truncated")
    assert dst.read_bytes() == good.read_bytes()[:-100]
    soak._put(good, dst, "fifo")
    assert stat.S_ISFIFO(dst.stat().st_mode)
    soak._put(good, dst, "garbage")  # over the FIFO
    assert dst.is_file() and dst.stat().st_size == 4096
    soak._put(good, dst, "good")
    assert dst.read_bytes() == good.read_bytes()


def test_the_table_says_whether_the_target_was_met() -> None:
    result = json.loads((REPO / "bench" / "results" / "soak.json").read_text(encoding="utf-8"))
    table = soak.render(result)
    assert table.startswith(soak.BEGIN) and table.rstrip().endswith(soak.END)
    assert f"| all | {result['authorised']['all']['sent']} |" in table
    assert ("**met**" in table) == result["target_met"] == soak.meets_target(result)
    for damage in ("failed", "wrong", "probe", "restart"):
        bad = copy.deepcopy(result)
        if damage == "failed":
            bad["authorised"]["all"]["failed"] = {"ServerUnavailableError": 2}
        elif damage == "wrong":
            bad["authorised"]["all"]["wrong"] = 1
        elif damage == "probe":
            bad["health_probes"]["failed"] = 1
        else:
            bad["faults"]["restart_failed"] = 1
        assert not soak.meets_target(bad), damage
    shown = copy.deepcopy(result)
    shown["authorised"]["decoder"]["failed"] = {"ServerUnavailableError": 2}
    shown["target_met"] = False
    table = soak.render(shown)
    assert "ServerUnavailableError 2" in table and "**not met**" in table
