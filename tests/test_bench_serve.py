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


def test_the_page_shows_the_saved_run() -> None:
    """docs/performance-serving.md's serving tables are what --render writes from bench/results/serve.json,
    with every serving target in it."""
    import json

    from bench import serve

    repo = Path(__file__).resolve().parent.parent
    saved = json.loads((repo / "bench" / "results" / "serve.json").read_text(encoding="utf-8"))
    text = serve.render(saved)
    assert text in (repo / "docs" / "performance-serving.md").read_text(encoding="utf-8")
    for target in ("engine >= 50% of the compute limit", "gRPC packed (10k) >= 80% of the engine",
                   "single n-gram p50 <= 1 ms (Python client)"):
        assert f"| {target} | " in text
