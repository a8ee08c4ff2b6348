"""Rescoring against a real server on 127.0.0.1: values, byte preservation, crash resume."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.client import LMClient
from nlmserve.common.errors import InputError, ServerUnavailableError
from nlmserve.moses_plugin.nbest import iter_entries
from nlmserve.moses_plugin.rescore import Connection, RescoreConfig, RescoreStats, SentenceLM, rescore
from nlmserve.server.app import RunningServer

from support import nbest_head, start_server

N_SENTENCES = 30


def start(lm: Any, port: int = 0) -> RunningServer:
    return start_server(lm, port=port, torch_threads=1)


@pytest.fixture(scope="module")
def server(tiny_lm: Any) -> Iterator[RunningServer]:
    running = start(tiny_lm)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def small_list(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 30 sentences (about 2,900 hypotheses) of the newstest2013 list, gzip."""
    return nbest_head(tmp_path_factory.mktemp("nbest") / "small.nbest.gz", N_SENTENCES)


@pytest.fixture(scope="module")
def reference_output(server: RunningServer, small_list: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run (plain text output)."""
    out = tmp_path_factory.mktemp("ref") / "rescored.nbest"
    stats = rescore(str(small_list), str(out), lambda: LMClient(server.target), _config())
    assert stats.sentences == N_SENTENCES and stats.resumed_sentences == 0
    assert 0 < stats.distinct_share < 0.5  # hypotheses of a sentence share most n-grams
    return out


def _config(**overrides: Any) -> RescoreConfig:
    values: dict[str, Any] = {"batch_ngrams": 3000, "progress": False, "wait_server": 30.0}
    values.update(overrides)
    return RescoreConfig(**values)


def test_feature_is_the_sentence_log_probability(tiny_lm: Any, reference_output: Path, small_list: Path) -> None:
    entries = list(iter_entries(reference_output))
    originals = list(iter_entries(small_list))
    assert len(entries) == len(originals)
    picks = entries[::97]
    expected = tiny_lm.score_sentences([e.hyp.split() for e in picks], bos=True, eos=True, log10=False)
    for entry, want in zip(picks, expected):
        name, (value,) = entry.dense[-1]
        assert name == "NLM0"
        assert value == pytest.approx(want.total, rel=2e-5, abs=2e-4)
        assert value < 0
    for new, old in zip(entries, originals):
        assert new.raw.replace(f" NLM0= {new.raw.split('NLM0= ')[1].split()[0]}", "", 1) == old.raw


def test_ngrams_pad_with_bos_and_end_with_eos() -> None:
    lm = SentenceLM({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}, order=3, lowercase=True)
    rows, owners = lm.ngrams(["a B", "", "zz"])
    assert rows.tolist() == [[1, 1, 3], [1, 3, 4], [3, 4, 2], [1, 1, 2], [1, 1, 0], [1, 0, 2]]
    assert owners.tolist() == [0, 0, 0, 1, 2, 2]


def test_gzip_output_matches_plain(server: RunningServer, small_list: Path, reference_output: Path, tmp_path: Path) -> None:
    # The same batches as the reference run: byte equality is promised for the same batches
    # (other batch sizes put each n-gram in a forward pass of another shape, whose last bits
    # may differ and, once in a while, move the sixth printed digit).
    out = tmp_path / "rescored.nbest.gz"
    rescore(str(small_list), str(out), lambda: LMClient(server.target), _config())
    assert gzip.decompress(out.read_bytes()) == reference_output.read_bytes()
    assert not (tmp_path / "rescored.nbest.gz.partial").exists()
    assert not (tmp_path / "rescored.nbest.gz.progress.json").exists()


class FailingClient:
    """A real client that raises after a number of scoring calls (an injected crash)."""

    def __init__(self, target: str, fail_after: int) -> None:
        self.client = LMClient(target)
        self.calls = 0
        self.fail_after = fail_after

    @property
    def order(self) -> int:
        return self.client.order

    @property
    def info(self) -> Any:
        return self.client.info

    def vocabulary(self) -> dict[str, int]:
        return self.client.vocabulary()

    def score_ids(self, ids: np.ndarray, log_base: str = "ln", normalized: bool = True) -> Any:
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("injected failure")
        return self.client.score_ids(ids, log_base=log_base, normalized=normalized)

    def close(self) -> None:
        self.client.close()


def test_injected_failure_then_resume_gives_the_same_file(server: RunningServer, small_list: Path,
                                                          reference_output: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.nbest"
    with pytest.raises(RuntimeError, match="injected failure"):
        rescore(str(small_list), str(out), lambda: FailingClient(server.target, 4), _config())
    assert not out.exists()
    progress = json.loads((tmp_path / "out.nbest.progress.json").read_text())
    assert 0 < progress["sentences_done"] < N_SENTENCES
    # Garbage after the checkpoint (a write the crash interrupted) must be cut off.
    with open(tmp_path / "out.nbest.partial", "ab") as partial:
        partial.write(b"half a line that was never checkpoin")
    stats = rescore(str(small_list), str(out), lambda: LMClient(server.target), _config())
    assert stats.resumed_sentences == progress["sentences_done"]
    assert stats.sentences == N_SENTENCES - progress["sentences_done"]
    assert out.read_bytes() == reference_output.read_bytes()


def test_killed_subprocess_resumes_to_the_same_file(server: RunningServer, small_list: Path,
                                                    reference_output: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed.nbest"
    progress = tmp_path / "killed.nbest.progress.json"
    cmd = [sys.executable, "-m", "nlmserve", "rescore", "--server", server.target, "--nbest", str(small_list),
           "--out", str(out), "--batch-ngrams", "3000", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 60
    done = 0
    while time.monotonic() < deadline and process.poll() is None:
        if progress.exists():
            try:
                done = json.loads(progress.read_text())["sentences_done"]
            except ValueError:
                done = 0
            if done >= 5:
                break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert 5 <= done < N_SENTENCES, "the run should be killed half-way"
    assert not out.exists()
    finished = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "sentences resumed from a checkpoint" in finished.stdout
    assert out.read_bytes() == reference_output.read_bytes()


def test_server_restart_is_waited_for(tiny_lm: Any, small_list: Path, reference_output: Path, tmp_path: Path) -> None:
    running = start(tiny_lm)
    port = running.port
    restarted: list[RunningServer] = []

    def bring_back() -> None:
        time.sleep(1.5)
        restarted.append(start(tiny_lm, port=port))

    def on_checkpoint(done: int) -> None:
        if not restarted and done < N_SENTENCES and running.engine.check_health():
            running.stop(0.0)
            threading.Thread(target=bring_back, daemon=True).start()

    out = tmp_path / "restart.nbest"
    try:
        stats = rescore(str(small_list), str(out), lambda: LMClient(f"127.0.0.1:{port}", timeout=5.0),
                        _config(), on_checkpoint=on_checkpoint)
    finally:
        for r in restarted:
            r.stop(0.5)
    assert restarted, "the server was never restarted"
    assert out.read_bytes() == reference_output.read_bytes()
    assert stats.sentences == N_SENTENCES


def test_bad_feature_name_and_missing_input(server: RunningServer, small_list: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sparse"):
        rescore(str(small_list), str(tmp_path / "o"), lambda: LMClient(server.target), _config(feature_name="NLM_0"))
    with pytest.raises(InputError, match="missing: no such file"):
        rescore(str(tmp_path / "missing"), str(tmp_path / "o"), lambda: LMClient(server.target), _config())


def test_skip_bad_lines_are_counted_and_dropped(server: RunningServer, tmp_path: Path) -> None:
    path = tmp_path / "bad.nbest"
    path.write_text("0 ||| a b ||| F0= 1 ||| 1\n0 ||| broken ||| F0= x ||| 1\n1 ||| c ||| F0= 2 ||| 2\n1 ||| d\n")
    out = tmp_path / "bad.out"
    with pytest.raises(InputError, match=f"{path}:2: feature value 'x'"):
        rescore(str(path), str(out), lambda: LMClient(server.target), _config())
    stats = rescore(str(path), str(out), lambda: LMClient(server.target), _config(skip_bad=True))
    assert stats.bad_lines == 2 and stats.hypotheses == 2 and stats.sentences == 2
    lines = out.read_text().splitlines()
    assert [line.split(" NLM0= ")[0] for line in lines] == ["0 ||| a b ||| F0= 1", "1 ||| c ||| F0= 2"]


def test_unwritable_output_is_one_clear_error(server: RunningServer, small_list: Path, tmp_path: Path) -> None:
    folder = tmp_path / "out.nbest"
    folder.mkdir()
    with pytest.raises(InputError, match=f"{folder}: the output is a directory"):
        rescore(str(small_list), str(folder), lambda: LMClient(server.target), _config())
    blocked = tmp_path / "missing-folder" / "out.nbest"
    with pytest.raises(InputError, match=f"{blocked}: cannot write the output: its folder"):
        rescore(str(small_list), str(blocked), lambda: LMClient(server.target), _config())


def test_a_server_that_stays_away_ends_the_run_after_wait_server(tiny_lm: Any) -> None:
    """The waits (0.2 s doubling) stop at --wait-server with ServerUnavailableError, both when
    connecting and when a server that answered dies and does not come back."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    started = time.monotonic()
    stats = RescoreStats()
    conn = Connection(lambda: LMClient(f"127.0.0.1:{closed}"), _config(wait_server=1.0), stats)
    with pytest.raises(ServerUnavailableError, match="server unreachable for 1 s: .*UNAVAILABLE"):
        conn.open()
    assert 0.6 <= time.monotonic() - started < 30  # waited 0.2 + 0.4 s, and not for ever

    running = start(tiny_lm)
    conn = Connection(lambda: LMClient(running.target), _config(wait_server=1.0), stats)
    lm = conn.open()
    rows, _ = lm.ngrams(["the house"])
    assert conn.score(rows).shape == (3,)  # the, house, </s>
    running.stop(0.5)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="server unreachable for 1 s"):
        conn.score(rows)
    assert time.monotonic() - started < 30
