"""Logs that stay logs: a tqdm bar only on a terminal, plain log lines in files and pipes.

The commands run as a user would run them with ``2> file``; the only change is
``LOG_SECONDS = 0`` (a log line at every update) so that a run of a few seconds shows the
periodic lines a long one writes every 30 s.
"""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nlmserve.common.progress import LogLines, progress

from support import TINY_ARPA, nbest_head

# `nlmserve ARGS` with log lines at every update instead of every 30 s
CLI_LOG_EVERY_UPDATE = ("import sys, nlmserve.common.progress as p; p.LOG_SECONDS = 0; from nlmserve.cli import main; "
                        "sys.exit(main(sys.argv[1:]))")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_bar_and_anything_else_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.progress")
    term = Terminal()
    with progress(total=3, unit="step", desc="work", logger=logger, stream=term) as bar:
        for _ in range(3):
            bar.update(1)
    assert "\r" in term.getvalue() and "3/3" in term.getvalue()

    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with progress(total=4, initial=1, unit="step", desc="work", logger=logger, stream=pipe, min_seconds=0) as bar:
            assert isinstance(bar, LogLines)
            bar.set_postfix(loss="4.500", refresh=False)
            bar.update(2)
            bar.set_postfix(loss="4.250", refresh=False)
            bar.update(1)
    assert pipe.getvalue() == ""  # nothing on the stream itself: the records go through logging
    assert [r.getMessage() for r in caplog.records] == ["work: 3/4 step (75%), loss 4.500",
                                                         "work: 4/4 step (100%), loss 4.250"]


def test_log_lines_wait_for_their_interval_and_the_end_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with progress(unit="sent", desc="rescore", logger=logger, stream=io.StringIO(), min_seconds=3600) as bar:
            for _ in range(100):
                bar.update(5)
        with progress(unit="sent", desc="silent", logger=logger, enabled=False) as bar:
            bar.update(5)
    assert [r.getMessage() for r in caplog.records] == ["rescore: 500 sent"]


def run_cli(args: list[str], stderr_path: Path) -> str:
    with open(stderr_path, "w") as err:
        done = subprocess.run([sys.executable, "-c", CLI_LOG_EVERY_UPDATE, *args], stderr=err,
                              stdout=subprocess.PIPE, text=True, timeout=600)
    text = stderr_path.read_bytes().decode()  # not read_text(): universal newlines would turn \r into \n
    assert done.returncode == 0, text
    return text


def test_training_into_a_file_writes_log_lines_with_steps_loss_and_speed(
        tmp_path: Path, train_small_path: Path, dev_small_path: Path) -> None:
    text = run_cli(["train", "--recipe", "none", "--train", str(train_small_path), "--valid", str(dev_small_path),
                    "--out", str(tmp_path / "m.nlm"), "--order", "3", "--dim", "16", "--threads", "1",
                    "--max-steps", "24", "--log-every", "4", "--checkpoint-every", "0"], tmp_path / "stderr")
    assert "\r" not in text
    # the total is the run's budget (--max-steps), not the recipe's epochs of steps
    lines = re.findall(r"nlmserve\.lm\.train: train: (\d+)/24 step \(\d+%\), loss ([\d.]+), tok_s ([\d,]+)$",
                       text, re.M)
    steps = [int(s) for s, _, _ in lines]
    assert len(steps) >= 5 and steps == sorted(steps) and steps[-1] == 24, text
    assert "train: 24/24 step (100%)" in text
    assert all(float(loss) > 0 and int(tps.replace(",", "")) > 0 for _, loss, tps in lines)


def test_rescoring_into_a_file_draws_no_bar(tmp_path: Path) -> None:
    pytest.importorskip("kenlm", reason="the kenlm module is in the dev extras (make install)")
    (tmp_path / "lm.arpa").write_text(TINY_ARPA)
    nbest = nbest_head(tmp_path / "in.nbest.gz", 3)
    text = run_cli(["rescore", "--kenlm", str(tmp_path / "lm.arpa"), "--feature-name", "KN1",
                    "--nbest", str(nbest), "--out", str(tmp_path / "out.nbest.gz")], tmp_path / "stderr")
    assert "\r" not in text
