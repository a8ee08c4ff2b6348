"""Replicated serving: one client, several `nlmserve serve` replicas, gRPC's round_robin policy
with client-side health checking; the model-hash guard; the container health check script."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.client import AsyncLMClient, LMClient, ModelMismatchError
from nlmserve.client.replicas import Endpoint, ModelGuard, endpoint_of

from support import DEV, REPO, serve_subprocess, start_server

HEALTHCHECK = REPO / "docker" / "healthcheck.py"
NLMSERVE = [sys.executable, "-m", "nlmserve"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
TOL = 1e-5
REQUESTS = 300  # in the stream
KILL_AFTER = 120  # answered requests before one replica is killed
NGRAMS_PER_REQUEST = 40
THREADS = 6


class Replica:
    """``nlmserve serve --port 0 --metrics-port 0`` as a subprocess."""

    def __init__(self, model: Path) -> None:
        self.stderr = tempfile.TemporaryFile()
        server = serve_subprocess(model, metrics_port=0, stderr=self.stderr, env=ENV)
        self.proc = server.process
        self.target = server.target
        self.metrics_url = server.metrics_url

    def requests(self, rpc: str = "ScoreNgrams", code: str = "OK") -> int:
        """``nlmserve_requests_total{rpc=..., code=...}`` from the replica's /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("nlmserve_requests_total{") and f'rpc="{rpc}"' in line and f'code="{code}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture()
def replicas(tiny_model_path: Path) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for _ in range(2):
            started.append(Replica(tiny_model_path))
        yield started
    finally:
        for r in started:
            r.kill()


@pytest.fixture(scope="module")
def stream(tiny_lm: Any) -> list[tuple[list[list[str]], np.ndarray]]:
    """REQUESTS requests of NGRAMS_PER_REQUEST real dev n-grams, with tiny_lm's log10 values."""
    with open(DEV, encoding="utf-8") as f:
        words = " ".join(line.strip() for line in f.readlines()[:300]).split()
    rng = np.random.default_rng(3)
    out = []
    for _ in range(REQUESTS):
        ngrams = []
        for _ in range(NGRAMS_PER_REQUEST):
            n = int(rng.integers(1, tiny_lm.order + 1))
            pos = int(rng.integers(0, len(words) - n))
            ngrams.append(words[pos : pos + n])
        ids = np.array([np.concatenate([np.ones(tiny_lm.order - len(ng), np.int64), tiny_lm.vocab.encode(ng)])
                        for ng in ngrams])
        out.append((ngrams, tiny_lm.score_ngrams(ids, log10=True)))
    return out


# ------------------------------------------------------------------ the stream and the kill
def test_killing_a_replica_mid_stream_fails_no_request(replicas: list[Replica], stream: list[Any], tiny_lm: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nlmserve.client.sync")
    victim, survivor = replicas
    answers: dict[int, Any] = {}
    failures: list[tuple[int, BaseException]] = []
    next_index = iter(range(REQUESTS))
    lock = threading.Lock()
    killed = threading.Event()
    sent_after_kill: list[int] = []

    with LMClient([victim.target, survivor.target], timeout=10, retries=8) as client:
        assert client.endpoint.replicated
        assert client.target == f"ipv4:{victim.target},{survivor.target}"
        assert client.info.model_hash == tiny_lm.model_hash  # GetModelInfo from both, equal

        def work() -> None:
            while True:
                with lock:
                    i = next(next_index, None)
                    if i is None:
                        return
                    if killed.is_set():
                        sent_after_kill.append(i)
                try:
                    answers[i] = client.score_ngrams(stream[i][0])
                except BaseException as e:  # noqa: BLE001 - every failure counts
                    failures.append((i, e))

        threads = [threading.Thread(target=work) for _ in range(THREADS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(answers) < KILL_AFTER and time.monotonic() < deadline and not failures:
            time.sleep(0.005)
        before = (victim.requests(), survivor.requests())
        survivor_at_kill = before[1]
        victim.proc.send_signal(signal.SIGKILL)
        killed.set()
        for t in threads:
            t.join(60)
        victim.proc.wait(10)
        after = survivor.requests()

    assert not failures, failures[:3]
    assert sorted(answers) == list(range(REQUESTS))
    for i, got in answers.items():
        np.testing.assert_allclose(got.log_probs, stream[i][1], atol=TOL, rtol=0)
        assert got.model_hash == tiny_lm.model_hash
    # Traffic on both before the kill (round_robin: about half each, less for a replica whose
    # connection came up later on a busy machine: 28% was seen), only on the survivor after it.
    assert min(before) >= 0.2 * sum(before) > 0, before
    assert victim.proc.returncode == -signal.SIGKILL
    assert len(sent_after_kill) >= REQUESTS - KILL_AFTER - 60
    assert after - survivor_at_kill >= len(sent_after_kill), (after, survivor_at_kill, len(sent_after_kill))
    assert after + before[0] <= REQUESTS + 5 * THREADS  # nothing answered twice beyond a retry per thread
    # Requests in flight on the victim failed UNAVAILABLE and were answered by the survivor.
    retried = [r.getMessage() for r in caplog.records if r.getMessage().startswith("UNAVAILABLE from")]
    assert retried, "no request was in flight on the killed replica"


# ------------------------------------------------------------------ health checking, in process
def test_a_not_serving_replica_gets_no_requests_until_it_serves_again(tiny_lm: Any) -> None:
    a, b = start_server(tiny_lm), start_server(tiny_lm)
    try:
        with LMClient(f"{a.target},{b.target}", timeout=10) as client:
            ngrams = [["of", "the"], ["the", "european", "union"]]
            expected = client.score_ngrams(ngrams).log_probs

            def served() -> tuple[int, int]:
                return (int(a.metrics.requests.labels("ScoreNgrams", "OK")._value.get()),
                        int(b.metrics.requests.labels("ScoreNgrams", "OK")._value.get()))

            def burst(n: int) -> tuple[int, int]:
                start = served()
                for _ in range(n):
                    np.testing.assert_allclose(client.score_ngrams(ngrams).log_probs, expected, atol=TOL, rtol=0)
                end = served()
                return end[0] - start[0], end[1] - start[1]

            assert burst(20) == (10, 10)  # round_robin alternates
            b.set_serving(False)
            _wait_until(lambda: burst(4) == (4, 0))
            assert burst(20) == (20, 0)
            b.set_serving(True)
            _wait_until(lambda: burst(4)[1] > 0)
            assert burst(20) == (10, 10)
    finally:
        a.stop(1.0)
        b.stop(1.0)


def test_a_restarted_replica_gets_requests_again_and_dns_targets_balance(tiny_lm: Any) -> None:
    a, b = start_server(tiny_lm), start_server(tiny_lm)
    port = b.port
    try:
        with LMClient([a.target, b.target], timeout=10) as client:
            ngrams = [["the", "commission"]]
            expected = client.score_ngrams(ngrams).log_probs
            b.stop(0.5)
            for _ in range(10):  # all on a while b is gone
                np.testing.assert_allclose(client.score_ngrams(ngrams).log_probs, expected, atol=TOL, rtol=0)
            b = start_server(tiny_lm, port=port)  # the same address, a new process state
            started = time.monotonic()

            def b_served() -> bool:
                client.score_ngrams(ngrams)
                return int(b.metrics.requests.labels("ScoreNgrams", "OK")._value.get()) > 0

            _wait_until(b_served, timeout=20.0)
            assert time.monotonic() - started < 12.0  # reconnection backoff capped at 5 s
        with LMClient(f"dns:///localhost:{a.port}", timeout=10) as by_name:
            assert by_name.endpoint.replicated
            np.testing.assert_allclose(by_name.score_ngrams(ngrams).log_probs, expected, atol=TOL, rtol=0)
    finally:
        a.stop(1.0)
        b.stop(1.0)


def _wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


# ------------------------------------------------------------------ one model across replicas
@pytest.fixture(scope="module")
def other_lm(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path, dev_small_path: Path) -> Any:
    """Same data as tiny_model_path, another seed and fewer steps: another model hash."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.train import TrainConfig, train

    out = tmp_path_factory.mktemp("other") / "other.nlm"
    train(TrainConfig(train=str(train_small_path), valid=str(dev_small_path), out=str(out), order=5, dim=16,
                      classes=24, class_method="frequency", objective="nce", min_count=2, max_steps=20,
                      batch_size=256, lr=0.1, threads=1, seed=11, progress=False, learning_curve=False))
    return LanguageModel.load(out, device="cpu")


def test_replicas_serving_different_models_raise_unless_mixing_is_allowed(tiny_lm: Any, other_lm: Any) -> None:
    assert other_lm.model_hash != tiny_lm.model_hash
    a, b = start_server(tiny_lm), start_server(other_lm)
    try:
        # the info probes reach every replica the channel has connected; one that connects
        # later is caught by the first answer it gives
        with LMClient([a.target, b.target], timeout=10) as client, pytest.raises(ModelMismatchError) as info:
            client.info
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                client.score_ngrams([["of", "the"]])
        assert tiny_lm.model_hash in str(info.value) and other_lm.model_hash in str(info.value)

        with LMClient([a.target, b.target], timeout=10, allow_mixed_models=True) as mixed:
            seen: set[str] = set()
            deadline = time.monotonic() + 20
            while len(seen) < 2 and time.monotonic() < deadline:
                seen.add(mixed.score_ngrams([["of", "the"]]).model_hash)
        assert seen == {tiny_lm.model_hash, other_lm.model_hash}

        async def run() -> None:
            async with AsyncLMClient([a.target, b.target], timeout=10) as aclient:
                with pytest.raises(ModelMismatchError):  # as above: a replica connected later too
                    await aclient.get_info()
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        await aclient.score_ngrams([["of", "the"]])

        asyncio.run(run())
        with LMClient(f"{a.target},{b.target}", timeout=10) as client, pytest.raises(ValueError, match="replica"):
            client.reload_model()
    finally:
        a.stop(1.0)
        b.stop(1.0)


def test_model_guard_pins_the_first_hash() -> None:
    guard = ModelGuard("ipv4:x", enabled=True, allow_mixed=False)
    assert guard.check(["aa", "aa", ""]) == "aa"
    with pytest.raises(ModelMismatchError, match="aa and bb"):
        guard.check(["aa", "bb"])
    with pytest.raises(ModelMismatchError):
        guard.check(["bb"])
    guard.pin("bb")  # after a reload through this client
    assert guard.check(["bb"]) == "bb"
    mixed = ModelGuard("ipv4:x", enabled=True, allow_mixed=True)
    assert mixed.check(["aa", "bb", "aa"]) == "aa,bb"
    assert mixed.check(["bb"]) == "bb"
    single = ModelGuard("h:1", enabled=False, allow_mixed=False)
    assert single.check(["aa"]) == "aa" and single.check(["bb", "aa"]) == "bb"


def test_targets() -> None:
    assert endpoint_of("127.0.0.1:5001") == Endpoint("127.0.0.1:5001", ("127.0.0.1:5001",), False, "127.0.0.1")
    assert endpoint_of(["127.0.0.1:5001", "127.0.0.1:5002"]) == Endpoint(
        "ipv4:127.0.0.1:5001,127.0.0.1:5002", ("127.0.0.1:5001", "127.0.0.1:5002"), True, "127.0.0.1")
    assert endpoint_of(" 127.0.0.1:5001, 10.0.0.2:5002 ").target == "ipv4:127.0.0.1:5001,10.0.0.2:5002"
    assert endpoint_of("127.0.0.1:5001,10.0.0.2:5002").host_name is None
    assert endpoint_of("[::1]:5001,[::1]:5002").target == "ipv6:[::1]:5001,[::1]:5002"
    assert endpoint_of("localhost:5001,localhost:5002").host_name == "localhost"
    dns = endpoint_of("dns:///lm.example:50051")
    assert dns.replicated and dns.replicas == () and dns.probe_calls == 4
    assert endpoint_of("unix:/tmp/x.sock") == Endpoint("unix:/tmp/x.sock", ("unix:/tmp/x.sock",), False, None)
    for bad in ("127.0.0.1,127.0.0.2:1", "127.0.0.1:5001,[::1]:5002", "a:1,b:99999", ","):
        with pytest.raises(ValueError):
            endpoint_of(bad)


def test_score_cli_takes_a_replica_list(tiny_lm: Any) -> None:
    a, b = start_server(tiny_lm), start_server(tiny_lm)
    try:
        line = "the european union is a union of states ."
        done = subprocess.run(NLMSERVE + ["score", "--server", f"{a.target},{b.target}", "--json"], input=line + "\n",
                              capture_output=True, text=True, env=ENV, timeout=60)
        assert done.returncode == 0, done.stderr
        total = float(done.stdout.splitlines()[0].split('"total": ')[1].split(",")[0])
        expected = tiny_lm.score_sentences([line.split()], log10=True)[0]
        assert abs(total - expected.total) < 1e-4
        def served() -> list[int]:
            return [int(s.metrics.requests.labels("ScoreSentences", "OK")._value.get()) for s in (a, b)]

        async def run() -> list[float]:
            # round_robin over the replicas the channel has connected: both, once the
            # second has connected (a busy machine may take a few requests)
            totals: list[float] = []
            async with AsyncLMClient(f"{a.target},{b.target}", timeout=10) as aclient:
                deadline = time.monotonic() + 20
                while (len(totals) < 4 or min(served()) < 2) and time.monotonic() < deadline:
                    totals.append((await aclient.score_sentences([line]))[0].total)
            return totals

        assert np.allclose(asyncio.run(run()), expected.total, atol=1e-4)
        assert min(served()) >= 2, served()
        bad = subprocess.run(NLMSERVE + ["score", "--server", f"{a.target},nowhere"], input=line + "\n",
                             capture_output=True, text=True, env=ENV, timeout=60)
        assert bad.returncode != 0 and "HOST:PORT" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        a.stop(1.0)
        b.stop(1.0)


# ------------------------------------------------------------------ docker/healthcheck.py
def test_container_health_check_against_a_real_server(tiny_lm: Any) -> None:
    running = start_server(tiny_lm)
    try:
        ok = subprocess.run([sys.executable, str(HEALTHCHECK)], capture_output=True, text=True, timeout=30,
                            env={**ENV, "NLMSERVE_PORT": str(running.port)})
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == "SERVING"
        running.set_serving(False)
        draining = subprocess.run([sys.executable, str(HEALTHCHECK)], capture_output=True, text=True, timeout=30,
                                  env={**ENV, "NLMSERVE_PORT": str(running.port)})
        assert draining.returncode == 1 and draining.stdout.strip() == "NOT_SERVING"
    finally:
        running.stop(1.0)
    stopped = subprocess.run([sys.executable, str(HEALTHCHECK)], capture_output=True, text=True, timeout=30,
                             env={**ENV, "NLMSERVE_PORT": str(running.port)})
    assert stopped.returncode == 1
    assert "unhealthy: UNAVAILABLE" in stopped.stderr
