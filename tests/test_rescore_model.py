"""``nlmserve rescore --model FILE``: the model file scored in this process, through the same
streaming, checkpointed rescoring as a server, with the same bytes out.

The server is a real one on 127.0.0.1 (port 0) over the same tiny model file; the lists
are the first sentences of the shipped newstest2013 50-best list.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.cli import main
from nlmserve.client import LMClient
from nlmserve.common.errors import NlmserveError
from nlmserve.moses_plugin.model_source import PASS_ROWS, ModelScorer
from nlmserve.moses_plugin.rescore import RescoreConfig, rescore
from nlmserve.server.app import RunningServer
from nlmserve.server.config import ServerConfig

from support import TINY_ARPA, dev_ngrams, golden_model, nbest_head, start_server

N_SENTENCES = 30


@pytest.fixture(scope="module")
def server(tiny_lm: Any) -> Iterator[RunningServer]:
    running = start_server(tiny_lm, torch_threads=1)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def small_list(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 30 sentences (2,956 hypotheses, 62,710 n-grams) of the newstest2013 list."""
    return nbest_head(tmp_path_factory.mktemp("nbest") / "small.nbest.gz", N_SENTENCES)


@pytest.fixture(scope="module")
def served(server: RunningServer, small_list: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The list rescored through the server, 3,000 n-grams per batch (many checkpoints)."""
    out = tmp_path_factory.mktemp("served") / "served.nbest"
    rescore(str(small_list), str(out), lambda: LMClient(server.target), _config())
    return out


def _config(**overrides: Any) -> RescoreConfig:
    values: dict[str, Any] = {"batch_ngrams": 3000, "progress": False}
    values.update(overrides)
    return RescoreConfig(**values)


def test_the_model_file_gives_the_servers_bytes(server: RunningServer, tiny_model_path: Path, small_list: Path,
                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rescore --model`` and ``rescore --server`` as a user runs them (default batches)."""
    # One file name in two folders: gzip's header holds the name.
    (tmp_path / "server").mkdir()
    (tmp_path / "model").mkdir()
    by_server, by_model = tmp_path / "server" / "out.nbest.gz", tmp_path / "model" / "out.nbest.gz"
    common = ["--nbest", str(small_list), "--no-progress"]
    assert main(["rescore", "--server", server.target, *common, "--out", str(by_server)]) == 0
    served_text = capsys.readouterr().out
    assert main(["rescore", "--model", str(tiny_model_path), *common, "--out", str(by_model)]) == 0
    printed = capsys.readouterr().out
    assert by_model.read_bytes() == by_server.read_bytes()
    lines = gzip.decompress(by_model.read_bytes()).decode().splitlines()
    assert len(lines) == 2956 and all(" NLM0= -" in line for line in lines)
    # The same summary: counts, de-duplication and the model hash the server reports.
    def summary(text: str) -> list[str]:
        return re.findall(r"rescored \d+ sentences, \d+ hypotheses|n-grams \d+, distinct \d+|model \w+", text)

    assert summary(printed) == summary(served_text)
    assert f"model {server.engine.state.model_hash}" in printed
    assert sorted(p.name for p in tmp_path.glob("*/*")) == ["out.nbest.gz", "out.nbest.gz"]


def test_scores_are_the_servers_floats(server: RunningServer, tiny_lm: Any, tiny_model_path: Path) -> None:
    """Row for row, in both log bases, normalised or not, over more rows than one pass."""
    ids = dev_ngrams(tiny_lm, 0, 300)
    assert len(ids) > PASS_ROWS and len(np.unique(ids, axis=0)) < len(ids)
    assert PASS_ROWS == ServerConfig(model="m").max_batch_ngrams
    local = ModelScorer(tiny_model_path, device="cpu")
    with LMClient(server.target) as client:
        assert local.order == client.order and local.info.model_hash == client.info.model_hash
        assert local.vocabulary() == client.vocabulary()
        for log_base in ("ln", "log10"):
            for normalized in (True, False):
                want = client.score_ids(ids, log_base=log_base, normalized=normalized).log_probs
                got = local.score_ids(ids, log_base=log_base, normalized=normalized).log_probs
                assert got.dtype == np.float32 and np.array_equal(got, want), (log_base, normalized)
    assert local.score_ids(ids[:0]).log_probs.shape == (0,)


class FailingScorer(ModelScorer):
    """The model source, raising after a number of scoring calls (an injected crash)."""

    def __init__(self, path: Path, fail_after: int) -> None:
        super().__init__(path, device="cpu")
        self.calls = 0
        self.fail_after = fail_after

    def score_ids(self, ids: np.ndarray, log_base: str = "ln", normalized: bool = True) -> Any:
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("injected failure")
        return super().score_ids(ids, log_base, normalized)


def _crash(small_list: Path, out: Path, model: Path) -> int:
    """Rescore into ``out`` until the injected crash; the sentences checkpointed."""
    with pytest.raises(RuntimeError, match="injected failure"):
        rescore(str(small_list), str(out), lambda: FailingScorer(model, 4), _config())
    assert not out.exists()
    done = int(json.loads(Path(f"{out}.progress.json").read_text())["sentences_done"])
    assert 0 < done < N_SENTENCES
    with open(f"{out}.partial", "ab") as partial:  # a write the crash interrupted: cut off on resume
        partial.write(b"half a line that was never checkpoin")
    return done


def test_a_crash_resumes_to_the_uninterrupted_bytes(server: RunningServer, tiny_model_path: Path, small_list: Path,
                                                    served: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # In this process, resumed by the CLI with the same flags.
    out = tmp_path / "out.nbest"
    done = _crash(small_list, out, tiny_model_path)
    assert main(["rescore", "--model", str(tiny_model_path), "--nbest", str(small_list), "--out", str(out),
                 "--batch-ngrams", "3000", "--no-progress"]) == 0
    assert f"({done} sentences resumed from a checkpoint)" in capsys.readouterr().out
    assert out.read_bytes() == served.read_bytes()
    # Begun here, finished through a server of the same model (one model hash).
    across = tmp_path / "across.nbest"
    done = _crash(small_list, across, tiny_model_path)
    stats = rescore(str(small_list), str(across), lambda: LMClient(server.target), _config())
    assert stats.resumed_sentences == done and across.read_bytes() == served.read_bytes()


def test_another_model_does_not_finish_a_begun_run(tiny_model_path: Path, small_list: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.nbest"
    _crash(small_list, out, tiny_model_path)
    other = golden_model(tmp_path / "golden.nlm")
    with pytest.raises(NlmserveError, match="the model is now .* as when this output was begun"):
        rescore(str(small_list), str(out), lambda: ModelScorer(other, device="cpu"), _config())
    assert not out.exists() and Path(f"{out}.partial").exists()


def test_a_wrong_model_file_is_a_clear_error_and_nothing_is_written(
        tiny_model_path: Path, small_list: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lm.arpa").write_text(TINY_ARPA)
    (tmp_path / "cut.nlm").write_bytes(tiny_model_path.read_bytes()[:-100])
    for name, message in (("lm.arpa", "not an nlmserve model file"), ("missing.nlm", "no such file"),
                          ("cut.nlm", "truncated model file")):
        out = tmp_path / "out.nbest.gz"
        assert main(["rescore", "--model", str(tmp_path / name), "--nbest", str(small_list),
                     "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"nlmserve rescore: error: {tmp_path / name}: {message}"), err
        assert "Traceback" not in err
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"lm.arpa", "cut.nlm"})


def test_one_source_only(tiny_model_path: Path, small_list: Path, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--server", "127.0.0.1:1"], ["--kenlm", str(tmp_path / "lm.arpa")]):
        with pytest.raises(SystemExit) as stop:
            main(["rescore", "--model", str(tiny_model_path), *extra, "--nbest", str(small_list),
                  "--out", str(tmp_path / "x")])
        assert stop.value.code == 2
        assert "not allowed with argument" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_rescoring_through_a_server_never_imports_torch(server: RunningServer, small_list: Path,
                                                        tmp_path: Path) -> None:
    """The CLI with ``--server`` (and every rescoring module, the model source's included)
    in a fresh interpreter: torch stays out of ``sys.modules``."""
    out = tmp_path / "out.nbest"
    script = ("import sys; from nlmserve.cli import main; "
              "import nlmserve.moses_plugin.model_source, nlmserve.pipeline.experiment, "
              "nlmserve.pipeline.steps; "
              f"code = main(['rescore', '--server', {server.target!r}, '--nbest', {str(small_list)!r}, "
              f"'--out', {str(out)!r}, '--no-progress']); "
              "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no torch"
    assert out.stat().st_size > 0


def test_progress_off_a_terminal_is_log_lines(tiny_model_path: Path, small_list: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import nlmserve.common.progress

    monkeypatch.setattr(nlmserve.common.progress, "LOG_SECONDS", 0.0)  # a line at every batch, not every 30 s
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with caplog.at_level(logging.INFO, logger="nlmserve.moses_plugin.rescore"):
        rescore(str(small_list), str(tmp_path / "out.nbest"), lambda: ModelScorer(tiny_model_path, device="cpu"),
                _config(progress=True))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rescore: ")]
    counts = [int(m.group(1)) for m in (re.match(r"rescore: (\d+) sent, ngrams_s [\d,]+, distinct [\d.]+%$", line)
                                        for line in lines) if m]
    assert len(counts) == len(lines) > 3 and counts == sorted(counts) and counts[-1] == N_SENTENCES, lines
    assert stream.getvalue() == ""


def test_unnormalized_rescoring_adds_the_self_normalised_sums(server: RunningServer, tiny_lm: Any,
                                                              tiny_model_path: Path, small_list: Path,
                                                              tmp_path: Path) -> None:
    """``--unnormalized``: the scores the decoder's ``normalized=false`` uses, the same bytes
    from the model file as from a server, and each hypothesis' NLM0 the sum of its tokens'
    self-normalised scores (not the normalised ones)."""
    assert tiny_lm.self_normalized
    common = ["--nbest", str(small_list), "--no-progress", "--unnormalized"]
    by_server, by_model, exact = tmp_path / "s.nbest", tmp_path / "m.nbest", tmp_path / "e.nbest"
    assert main(["rescore", "--server", server.target, *common, "--out", str(by_server)]) == 0
    assert main(["rescore", "--model", str(tiny_model_path), *common, "--out", str(by_model)]) == 0
    assert by_model.read_bytes() == by_server.read_bytes()
    assert main(["rescore", "--model", str(tiny_model_path), *common[:3], "--out", str(exact)]) == 0

    def first(path: Path) -> tuple[str, float]:
        fields = path.read_text(encoding="utf-8").splitlines()[0].split(" ||| ")
        return fields[1], float(re.search(r"NLM0= (\S+)", fields[2]).group(1))  # type: ignore[union-attr]

    words, unnorm = first(by_model)
    _, norm = first(exact)
    [want] = tiny_lm.score_sentences([words.split()], normalized=False)
    [want_norm] = tiny_lm.score_sentences([words.split()], normalized=True)
    assert unnorm == pytest.approx(want.total, abs=1e-3) and norm == pytest.approx(want_norm.total, abs=1e-3)
    assert abs(unnorm - norm) > 1e-2
