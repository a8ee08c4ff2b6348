"""The C++ client (client/cpp) against replicated and secured servers.

Two real ``nlmserve serve`` replicas behind one C++ client (round_robin, health-checked),
one of them SIGKILLed while the driver's threads stream requests; a NOT_SERVING replica
that gets no requests; a TLS server with bearer tokens. The driver and its protocol are
those of tests/test_cpp_client.py, the replicas those of tests/test_replicas.py and the
throwaway PKI that of tests/test_tls.py.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.client import LMClient
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine
from test_cpp_client import Driver, _ngrams, driver  # noqa: F401 - the driver fixture builds build/cpp
from test_replicas import Replica, other_lm, replicas  # noqa: F401 - two replica processes; a second model
from test_tls import Pki, pki  # noqa: F401 - the session's throwaway PKI

TOL = 1e-5
TOKEN = "cpp-token-0123"


@pytest.fixture(scope="module")
def ngram_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    ngrams = _ngrams(lines=12)
    path = tmp_path_factory.mktemp("cpp-replica-ngrams") / "ngrams.txt"
    path.write_text("".join(" ".join(g) + "\n" for g in ngrams), encoding="utf-8")
    return path, ngrams


def _fields(answer: str) -> dict[str, str]:
    assert answer.startswith("ok "), answer
    return dict(item.split("=") for item in answer.split()[1:])


def test_killing_a_replica_mid_stream_fails_no_request(driver: Path, replicas: list[Replica],  # noqa: F811
                                                       ngram_file: tuple[Path, list[list[str]]]) -> None:
    path, ngrams = ngram_file
    victim, survivor = replicas
    # No cache: every call of the stream goes to a replica.
    cpp = Driver(driver, f"{victim.target},{survivor.target}", "--cache-size", "0", "--retries", "8",
                 "--deadline-ms", "10000")
    try:
        got = cpp.scores(path)
        with LMClient([victim.target, survivor.target]) as py:
            assert f"hash={py.info.model_hash}" in cpp.ask("info")
            expected = py.score_ngrams(ngrams, log_base="log10").log_probs
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
        assert cpp.proc.stdin is not None
        # Four threads stream the n-grams (batches of 1-16) 12 times each, each answer
        # compared with the reference the driver scores first.
        cpp.proc.stdin.write(f"threads 4 {path} 12\n")
        cpp.proc.stdin.flush()
        deadline = time.monotonic() + 60
        while victim.requests() < 60 and time.monotonic() < deadline:
            time.sleep(0.02)
        before = (victim.requests(), survivor.requests())
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        answer = cpp.read(timeout=120.0)
        after = survivor.requests()
        stats = cpp.stats()
    finally:
        cpp.close()
    fields = _fields(answer)
    assert fields["errors"] == "0" and fields["far"] == "0", answer
    assert float(fields["max_diff"]) <= TOL
    assert victim.proc.returncode == -signal.SIGKILL
    # Both replicas served the stream before the kill (round_robin), the survivor after it.
    assert min(before) >= 0.3 * sum(before) > 0, before
    assert after - before[1] >= 50, (before, after)
    assert stats["round_trips"] == int(fields["calls"]) + 2  # + the reference and the file
    assert stats["reconnects"] == 0  # retries stay on the balanced channel
    # Requests in flight on the killed replica failed and were answered by the survivor.
    assert stats["failed"] >= 1, stats


def _start(lm: Any, **overrides: Any) -> RunningServer:
    config = ServerConfig(model="(in-process)", port=0, **overrides)
    return create_server(config, engine=Engine(lm, config))


def _served(server: RunningServer) -> int:
    return int(server.metrics.requests.labels("ScoreNgrams", "OK")._value.get())


def test_a_not_serving_replica_gets_no_requests(driver: Path, tiny_lm: Any) -> None:  # noqa: F811
    a, b = _start(tiny_lm), _start(tiny_lm)
    cpp: Driver | None = None
    try:
        # A static list and a dns:/// name: both balance over health-checked replicas.
        cpp = Driver(driver, f"{a.target},{b.target}", "--cache-size", "0")
        expected = cpp.ask("score of the european union")
        assert expected.startswith("ok "), expected

        def burst(n: int) -> tuple[int, int]:
            start = _served(a), _served(b)
            for _ in range(n):
                assert cpp is not None and cpp.ask("score of the european union") == expected
            return _served(a) - start[0], _served(b) - start[1]

        assert burst(20) == (10, 10)  # round_robin alternates
        b.set_serving(False)
        deadline = time.monotonic() + 10
        while burst(4) != (4, 0):
            assert time.monotonic() < deadline, "the NOT_SERVING replica still gets requests"
        assert burst(20) == (20, 0)
        b.set_serving(True)
        deadline = time.monotonic() + 10
        while burst(4)[1] == 0:
            assert time.monotonic() < deadline, "the replica serving again gets no requests"
        assert burst(20) == (10, 10)
        cpp.close()
        cpp = Driver(driver, f"dns:///localhost:{a.port}", "--cache-size", "0")
        assert cpp.ask("score of the european union") == expected
    finally:
        if cpp is not None:
            cpp.close()
        a.stop(1.0)
        b.stop(1.0)


def test_replicas_serving_different_models_are_refused(driver: Path, tiny_lm: Any, other_lm: Any) -> None:  # noqa: F811
    assert other_lm.model_hash != tiny_lm.model_hash
    a, b = _start(tiny_lm), _start(other_lm)
    try:
        out = _refused(driver, f"{a.target},{b.target}")
    finally:
        a.stop(1.0)
        b.stop(1.0)
    assert out.startswith("error 9 replicas of "), out
    assert tiny_lm.model_hash in out and other_lm.model_hash in out


@pytest.fixture(scope="module")
def secured(tiny_lm: Any, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:  # noqa: F811
    tokens = tmp_path_factory.mktemp("cpp-tokens") / "tokens"
    tokens.write_text(f"# decoders\n\n{TOKEN}\nsecond-token-4567\n", encoding="utf-8")
    running = _start(tiny_lm, tls_cert=pki.server_cert, tls_key=pki.server_key, token_file=str(tokens))
    yield running
    running.stop(1.0)


def _refused(driver: Path, target: str, *extra: str) -> str:  # noqa: F811
    done = subprocess.run([str(driver), target, "--connect-timeout-ms", "2000", "--retries", "0", *extra],
                          input="", capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)  # an error, not a crash
    return done.stdout


def test_tls_and_token(driver: Path, secured: RunningServer, pki: Pki, tmp_path: Path,  # noqa: F811
                       ngram_file: tuple[Path, list[list[str]]]) -> None:
    path, ngrams = ngram_file
    token = tmp_path / "token"
    token.write_text(f"# mine\n{TOKEN}\n", encoding="utf-8")
    cpp = Driver(driver, secured.target, "--tls-ca", pki.ca, "--token-file", str(token))
    try:
        got = cpp.scores(path)
    finally:
        cpp.close()
    with LMClient(secured.target, tls_ca=pki.ca, token=TOKEN) as py:
        expected = py.score_ngrams(ngrams, log_base="log10").log_probs
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
    # The same through a one-replica list and by host name (checked against localhost).
    listed = Driver(driver, f"localhost:{secured.port},localhost:{secured.port}", "--tls-ca", pki.ca,
                    "--token-file", str(token))
    try:
        np.testing.assert_allclose(listed.scores(path), expected, rtol=0, atol=TOL)
    finally:
        listed.close()

    # No token, a wrong token: UNAUTHENTICATED (16), reported, exit 1.
    assert _refused(driver, secured.target, "--tls-ca", pki.ca).startswith("error 16 ")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n", encoding="utf-8")
    assert _refused(driver, secured.target, "--tls-ca", pki.ca, "--token-file", str(wrong)).startswith("error 16 ")
    # Plaintext or an untrusted CA: the handshake fails (UNAVAILABLE, 14).
    assert _refused(driver, secured.target, "--token-file", str(token)).startswith(("error 14 ", "error 4 "))
    assert _refused(driver, secured.target, "--tls-ca", pki.rogue_ca,
                    "--token-file", str(token)).startswith(("error 14 ", "error 4 "))
    # Unusable files are errors naming the file.
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n", encoding="utf-8")
    assert f"token file {empty} holds no token" in _refused(driver, secured.target, "--tls-ca", pki.ca,
                                                            "--token-file", str(empty))
    assert f"{tmp_path / 'absent.pem'}" in _refused(driver, secured.target, "--tls-ca", str(tmp_path / "absent.pem"))


def test_mutual_tls(driver: Path, tiny_lm: Any, pki: Pki) -> None:  # noqa: F811
    server = _start(tiny_lm, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    try:
        cpp = Driver(driver, server.target, "--tls-ca", pki.ca, "--tls-cert", pki.client_cert,
                     "--tls-key", pki.client_key)
        try:
            got = cpp.ask("score of the european union")
        finally:
            cpp.close()
        with LMClient(server.target, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as py:
            expected = py.score_ngrams([["of", "the", "european", "union"]], log_base="log10").log_probs[0]
        assert got.startswith("ok ") and abs(float(got.split()[1]) - expected) <= TOL, (got, expected)
        # No client certificate, or one from another CA: the handshake fails.
        assert _refused(driver, server.target, "--tls-ca", pki.ca).startswith(("error 14 ", "error 4 "))
        assert _refused(driver, server.target, "--tls-ca", pki.ca, "--tls-cert", pki.rogue_cert,
                        "--tls-key", pki.rogue_key).startswith(("error 14 ", "error 4 "))
        # A certificate without its key is refused before connecting.
        assert "tls-cert and tls-key" in _refused(driver, server.target, "--tls-ca", pki.ca,
                                                  "--tls-cert", pki.client_cert)
    finally:
        server.stop(1.0)
