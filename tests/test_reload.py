"""Hot reload under load: no request fails, and every answer carries the values of the
model its hash names.

Two real tiny models: the conftest ``tiny_model_path`` and one trained here briefly with
another seed on the same data (so the same vocabulary). Expected values come from the two
models loaded in-process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from nlmserve.client import LMClient, RpcError
from nlmserve.server.app import create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine

from support import DEV, serve_subprocess

NLMSERVE = [sys.executable, "-m", "nlmserve"]
TOL = 1e-5
SLICES = 16  # distinct requests the clients cycle through
THREADS = 4


def _train(out: Path, train: Path, valid: Path, seed: int, steps: int, min_count: int = 2) -> Path:
    from nlmserve.lm.train import TrainConfig, train as run_train

    run_train(TrainConfig(
        train=str(train), valid=str(valid), out=str(out), order=5, dim=16, classes=24, class_method="frequency",
        objective="nce", min_count=min_count, max_steps=steps, batch_size=256, lr=0.1, threads=1, seed=seed,
        progress=False, learning_curve=False,
    ))
    return out


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path,
                     dev_small_path: Path) -> Path:
    """Same data and vocabulary as ``tiny_model_path``, another seed: other values, other hash."""
    return _train(tmp_path_factory.mktemp("other") / "other.nlm", train_small_path, dev_small_path, seed=11,
                  steps=60)


@pytest.fixture(scope="module")
def models(tiny_lm: Any, other_model_path: Path) -> dict[str, Any]:
    from nlmserve.lm.scoring import LanguageModel

    other = LanguageModel.load(other_model_path, device="cpu")
    assert other.model_hash != tiny_lm.model_hash
    assert other.vocab.words == tiny_lm.vocab.words
    return {tiny_lm.model_hash: tiny_lm, other.model_hash: other}


@pytest.fixture(scope="module")
def requests(tiny_lm: Any) -> list[np.ndarray]:
    """SLICES id arrays (n-grams of real dev sentences), some larger than one batch."""
    with open(DEV, encoding="utf-8") as f:
        sentences = [line.split() for _, line in zip(range(300), f) if line.strip()]
    ids, _, _, _ = tiny_lm.sentence_ngrams(sentences[200:300])
    ids = np.asarray(ids, dtype=np.uint32)
    sizes = [5, 40, 300, 700]
    out, start = [], 0
    for i in range(SLICES):
        n = sizes[i % len(sizes)]
        out.append(ids[start : start + n])
        start = (start + n) % (len(ids) - 700)
    return out


@pytest.fixture(scope="module")
def expected(models: dict[str, Any], requests: list[np.ndarray]) -> dict[str, list[np.ndarray]]:
    return {h: [lm.score_ngrams(r) for r in requests] for h, lm in models.items()}


@dataclass
class Hammer:
    """Client threads scoring the requests in a loop until stopped; they keep every answer."""

    target: str
    requests: list[np.ndarray]
    token: str | None = None
    answers: list[tuple[int, str, np.ndarray]] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with LMClient(self.target, timeout=30, retries=0, token=self.token) as client:
            while not self.stop.is_set():
                i = int(rng.integers(len(self.requests)))
                try:
                    got = client.score_ids(self.requests[i], log_base="ln")
                except BaseException as e:  # every failure is a test failure
                    self.failures.append(e)
                    return
                self.answers.append((i, got.model_hash, got.log_probs))

    def __enter__(self) -> "Hammer":
        self.threads = [threading.Thread(target=self.run, args=(s,)) for s in range(THREADS)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def hashes_since(self, mark: int) -> set[str]:
        return {h for _, h, _ in self.answers[mark:]}

    def hashes_of_next(self, count: int, timeout: float = 60.0) -> set[str]:
        """The model hashes of ``count`` answers to requests sent from now on."""
        mark = len(self.answers) + THREADS  # answers in flight may predate this call
        deadline = time.monotonic() + timeout
        while len(self.answers) < mark + count and not self.failures:
            assert time.monotonic() < deadline, f"fewer than {count} answers within {timeout} s"
            time.sleep(0.02)
        return {h for _, h, _ in self.answers[mark : mark + count]}

    def wait_for(self, model_hash: str, timeout: float = 60.0) -> None:
        """Until an answer started after this call names ``model_hash``."""
        mark = len(self.answers) + THREADS  # answers in flight may predate the swap
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.failures:
            if len(self.answers) > mark and model_hash in self.hashes_since(mark):
                return
            time.sleep(0.02)
        raise AssertionError(f"no answer from {model_hash} within {timeout} s; failures {self.failures[:1]}")


def check_answers(hammer: Hammer, expected: dict[str, list[np.ndarray]]) -> dict[str, int]:
    assert not hammer.failures, hammer.failures[:3]
    counts = {h: 0 for h in expected}
    for i, model_hash, values in hammer.answers:
        assert model_hash in expected, model_hash
        np.testing.assert_allclose(values, expected[model_hash][i], atol=TOL, rtol=0)
        counts[model_hash] += 1
    return counts


def metric_lines(port: int, name: str) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith(name + "{")]


def test_admin_reloads_under_load_lose_nothing(tiny_lm: Any, tiny_model_path: Path, other_model_path: Path,
                                               expected: dict[str, list[np.ndarray]], requests: list[np.ndarray],
                                               tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("admin-token\n", encoding="utf-8")
    config = ServerConfig(model=str(tiny_model_path), port=0, metrics_port=0, max_batch_ngrams=256,
                          ngram_cache_size=50_000, context_cache_size=5_000, token_file=str(tokens),
                          reload_dir=str(tmp_path.parent))  # the folder of every test's files
    running = create_server(config, engine=Engine(tiny_lm, config))
    a, b = tiny_lm.model_hash, next(h for h in expected if h != tiny_lm.model_hash)
    broken = tmp_path / "broken.nlm"
    broken.write_bytes(other_model_path.read_bytes()[:5000])  # truncated
    try:
        with LMClient(running.target, token="admin-token", timeout=120) as admin:
            with Hammer(running.target, requests, token="admin-token") as hammer:
                hammer.wait_for(a)
                for path, model_hash in ((other_model_path, b), (tiny_model_path, a), (other_model_path, b)):
                    info = admin.reload_model(str(path))
                    assert info.model_hash == model_hash
                    hammer.wait_for(model_hash)
                    time.sleep(0.3)  # let the caches of the new model fill
                with pytest.raises(RpcError) as err:
                    admin.reload_model(str(broken))
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert hammer.hashes_of_next(20) == {b}  # the refused file changed nothing
            counts = check_answers(hammer, expected)
        assert counts[a] > 0 and counts[b] > 0
        gauge = metric_lines(running.metrics_port or 0, "nlmserve_model_info")
        assert len(gauge) == 1 and f'model_hash="{b}"' in gauge[0]
        reloads = metric_lines(running.metrics_port or 0, "nlmserve_model_reloads_total")
        assert 'nlmserve_model_reloads_total{result="ok"} 3.0' in reloads
        assert 'nlmserve_model_reloads_total{result="error"} 1.0' in reloads
    finally:
        running.stop(1.0)


def test_a_model_with_another_vocabulary_is_refused(tiny_lm: Any, tiny_model_path: Path, train_small_path: Path,
                                                    dev_small_path: Path, tmp_path: Path) -> None:
    smaller = _train(tmp_path / "min3.nlm", train_small_path, dev_small_path, seed=3, steps=5, min_count=3)
    config = ServerConfig(model=str(tiny_model_path), port=0, allow_unauthenticated_admin=True,
                          reload_dir=str(tmp_path))
    running = create_server(config, engine=Engine(tiny_lm, config))
    try:
        with LMClient(running.target) as client:
            with pytest.raises(RpcError, match="vocabulary differs") as err:
                client.reload_model(str(smaller))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert client.score_ngrams([["of", "the"]]).model_hash == tiny_lm.model_hash
    finally:
        running.stop(0.5)


def test_reload_cli(tiny_lm: Any, tiny_model_path: Path, other_model_path: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("cli-admin-token\n", encoding="utf-8")
    config = ServerConfig(model=str(tiny_model_path), port=0, token_file=str(tokens),
                          reload_dir=str(other_model_path.parent))
    running = create_server(config, engine=Engine(tiny_lm, config))
    cmd = NLMSERVE + ["reload", "--server", running.target, "--model", str(other_model_path)]
    old = NLMSERVE + ["reload", "--server", running.target, "--path", str(other_model_path)]  # the old spelling
    try:
        denied = subprocess.run(old, capture_output=True, text=True, timeout=60)
        ok = subprocess.run(cmd + ["--token-file", str(tokens)], capture_output=True, text=True, timeout=60)
        with LMClient(running.target, token="cli-admin-token") as client:
            served = client.info.model_hash
    finally:
        running.stop(0.5)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    assert denied.stderr.startswith("nlmserve reload: warning: --path is deprecated; use --model\n")
    assert ok.returncode == 0 and "deprecated" not in ok.stderr, ok.stderr
    assert ok.stdout.split() == ["serving", served]
    assert served != tiny_lm.model_hash


@pytest.fixture()
def serve_process(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, str, int]]:
    model = tmp_path / "served.nlm"
    shutil.copyfile(tiny_model_path, model)
    server = serve_subprocess(model, "--ngram-cache-size", "50000", "--max-batch-ngrams", "256", metrics_port=0,
                              log=tmp_path / "serve.log")
    proc = server.process
    try:
        assert server.metrics_port is not None
        yield proc, model, server.target, server.metrics_port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def _replace(src: Path, dst: Path) -> None:
    """Put ``src``'s bytes at ``dst`` atomically (as a deployment would)."""
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def test_sighup_reloads_the_model_file_under_load(serve_process: tuple[subprocess.Popen[str], Path, str, int],
                                                  tiny_lm: Any, tiny_model_path: Path, other_model_path: Path,
                                                  expected: dict[str, list[np.ndarray]],
                                                  requests: list[np.ndarray], tmp_path: Path) -> None:
    proc, model, target, metrics_port = serve_process
    a, b = tiny_lm.model_hash, next(h for h in expected if h != tiny_lm.model_hash)
    with Hammer(target, requests) as hammer:
        hammer.wait_for(a)
        for src, model_hash in ((other_model_path, b), (tiny_model_path, a), (other_model_path, b)):
            _replace(src, model)
            proc.send_signal(signal.SIGHUP)
            hammer.wait_for(model_hash)
            time.sleep(0.3)
        # A damaged file: the reload is refused, the served model stays.
        garbage = tmp_path / "garbage"
        garbage.write_bytes(b"not a model file\n" * 100)
        _replace(garbage, model)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while 'result="error"} 1.0' not in "".join(metric_lines(metrics_port, "nlmserve_model_reloads_total")):
            assert time.monotonic() < deadline, "the refused reload was not counted"
            time.sleep(0.05)
        assert hammer.hashes_of_next(20) == {b}
    counts = check_answers(hammer, expected)
    assert counts[a] > 0 and counts[b] > 0
    assert proc.poll() is None
    gauge = metric_lines(metrics_port, "nlmserve_model_info")
    assert len(gauge) == 1 and f'model_hash="{b}"' in gauge[0]
    assert 'nlmserve_model_reloads_total{result="ok"} 3.0' in metric_lines(metrics_port, "nlmserve_model_reloads_total")


class GatedScorer:
    """The real scorer of the served model behind a gate, to hold the batching thread in a batch."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.rows: list[int] = []

    def score(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        self.rows.append(ids.shape[0])
        self.entered.set()
        assert self.gate.wait(30)
        return self.inner.score(ids, normalized)

    def stats(self) -> dict[str, tuple[int, int, int]]:
        return self.inner.stats()  # type: ignore[no-any-return]


def test_parts_queued_before_a_swap_keep_their_model_and_no_batch_mixes_models(
        tiny_lm: Any, models: dict[str, Any], requests: list[np.ndarray]) -> None:
    other = next(lm for h, lm in models.items() if h != tiny_lm.model_hash)
    engine = Engine(tiny_lm, ServerConfig(model="(in-process)", max_batch_ngrams=4096, max_delay_us=0))
    try:
        gated = GatedScorer(engine.scorer)
        engine.scorer = gated  # type: ignore[assignment]
        old_state = engine.state
        first = engine.submit_ngrams(requests[0])
        assert gated.entered.wait(30)  # the batching thread is inside the old model's batch
        queued_old = engine.submit_ngrams(requests[1])
        engine.swap(engine.prepare(other))
        queued_new = engine.submit_ngrams(requests[2])
        pinned_old = engine.submit_ngrams(requests[3], state=old_state)  # explicitly pinned
        gated.gate.set()
        np.testing.assert_allclose(first.result(30), tiny_lm.score_ngrams(requests[0]), atol=TOL, rtol=0)
        np.testing.assert_allclose(queued_old.result(30), tiny_lm.score_ngrams(requests[1]), atol=TOL, rtol=0)
        np.testing.assert_allclose(queued_new.result(30), other.score_ngrams(requests[2]), atol=TOL, rtol=0)
        np.testing.assert_allclose(pinned_old.result(30), tiny_lm.score_ngrams(requests[3]), atol=TOL, rtol=0)
        # The old model's batches: the first request, then the one queued before the swap
        # (not merged with the next, which belongs to the new model), then the pinned one.
        assert gated.rows == [len(requests[0]), len(requests[1]), len(requests[3])]
        assert engine.state.model_hash == other.model_hash
    finally:
        engine.shutdown()
