"""``nlmserve serve`` as a real process: port 0 printed, SIGTERM drains in-flight work, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from nlmserve.proto import lm_pb2, lm_pb2_grpc
from support import serve_subprocess

NLMSERVE = [sys.executable, "-m", "nlmserve"]


def in_flight(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("nlmserve_in_flight_requests "):
                return float(line.split()[1])
    return 0.0


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_model_path: Path, tiny_lm: Any) -> None:
    server = serve_subprocess(tiny_model_path, "--grace-seconds", "60", "--max-ngrams-per-request", "300000",
                              "--max-batch-ngrams", "4096", metrics_port=0, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc = server.process
    try:
        port, metrics_port = server.port, server.metrics_port
        rng = np.random.default_rng(0)
        ids = rng.integers(3, len(tiny_lm.vocab), size=(150_000, tiny_lm.order)).astype(np.uint32)
        result: dict[str, Any] = {}

        def big_request() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = lm_pb2_grpc.LanguageModelStub(channel)
                try:
                    result["resp"] = stub.ScoreNgrams(lm_pb2.ScoreNgramsRequest(
                        packed_ids=ids.tobytes(), packed_order=ids.shape[1]), timeout=120)
                except grpc.RpcError as e:
                    result["error"] = e

        t = threading.Thread(target=big_request)
        t.start()
        deadline = time.monotonic() + 30
        while in_flight(metrics_port) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert in_flight(metrics_port) >= 1
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert "error" not in result, result.get("error")
        got = np.asarray(result["resp"].log_probs)
        assert got.shape == (len(ids),)
        np.testing.assert_allclose(got[-500:], tiny_lm.score_ngrams(ids[-500:], log10=True), atol=1e-5, rtol=0)
        assert proc.wait(60) == 0
        assert proc.stderr is not None
        assert "SIGTERM" in proc.stderr.read()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # no longer accepting
            with pytest.raises(grpc.RpcError) as err:
                lm_pb2_grpc.LanguageModelStub(channel).GetModelInfo(lm_pb2.GetModelInfoRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_reports_a_bad_model_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.nlm"
    bad.write_bytes(b"not a model")
    proc = subprocess.run(NLMSERVE + ["serve", "--model", str(bad), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "broken.nlm" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_reports_a_port_in_use(tiny_model_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(NLMSERVE + ["serve", "--model", str(tiny_model_path), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
