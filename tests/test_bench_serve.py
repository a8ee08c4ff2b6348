"""bench/serve.py's servers start as the benchmark starts them: the no-op server (the RPC
cost alone) runs as ``python -m bench.serve`` from the checkout, wherever the caller stands."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from bench.serve import ServerProcess
from nlmserve.proto import lm_pb2, lm_pb2_grpc


def test_the_noop_server_answers_from_any_working_directory(tiny_model_path: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the checkout: the module must still be found
    server = ServerProcess(tiny_model_path, noop=True)
    try:
        with grpc.insecure_channel(server.target) as channel:
            reply = lm_pb2_grpc.LanguageModelStub(channel).ScoreNgrams(
                lm_pb2.ScoreNgramsRequest(packed_ids=(b"\x01\x00\x00\x00" * 4 + b"\x05\x00\x00\x00") * 3,
                                          packed_order=5), timeout=30)
        assert list(reply.log_probs) == [-1.0, -1.0, -1.0]
    finally:
        server.stop()
    assert server.proc.returncode == 0  # SIGTERM stops it cleanly
