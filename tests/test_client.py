"""The Python client (sync and asyncio) and the ``score`` CLI against a real server on port 0."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from nlmserve.client import AsyncLMClient, LMClient, RetryPolicy
from nlmserve.common.errors import InvalidRequestError, ServerUnavailableError
from nlmserve.common.serve_process import free_port
from nlmserve.server.app import RunningServer

from support import dev_ngrams, dev_sentences, start_server

TOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny_lm: Any) -> Iterator[RunningServer]:
    # A small request limit, so that the client has to chunk.
    running = start_server(tiny_lm, max_ngrams_per_request=300)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[LMClient]:
    with LMClient(server.target, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def ngrams(tiny_lm: Any) -> list[list[str]]:
    """1,000 n-grams of 1..order words from real dev text (with unknown words)."""
    words = " ".join(dev_sentences(400, 60)).split()
    rng = np.random.default_rng(5)
    out = []
    for _ in range(1000):
        n = int(rng.integers(1, tiny_lm.order + 1))
        pos = int(rng.integers(0, len(words) - n))
        out.append(words[pos : pos + n])
    return out


def reference(lm: Any, ngrams: list[list[str]], **kw: Any) -> np.ndarray:
    return np.array([lm.score_ngrams(np.array([lm.vocab.encode(ng)]), **kw)[0] for ng in ngrams], dtype=np.float32)


def test_client_package_never_imports_torch_or_the_model_room() -> None:
    """A decoder host's client loads the wire rules (``nlmserve.wire``), never ``nlmserve.lm``."""
    code = ("import sys; import nlmserve.client, nlmserve.client.cli, nlmserve.client.aio; "
            "from nlmserve.client import LMClient; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "lm = sorted(m for m in sys.modules if m == 'nlmserve.lm' or m.startswith('nlmserve.lm.')); "
            "assert not lm, f'imported {lm}'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("pack_ids", [True, False])
@pytest.mark.parametrize("log_base", ["log10", "ln"])
def test_score_ngrams_equal_in_process_and_are_chunked(server: RunningServer, tiny_lm: Any, ngrams: list[list[str]],
                                                       pack_ids: bool, log_base: str) -> None:
    with LMClient(server.target, pack_ids=pack_ids) as c:
        got = c.score_ngrams(ngrams, log_base=log_base)
    want = reference(tiny_lm, ngrams, log10=log_base == "log10")
    np.testing.assert_allclose(got.log_probs, want, atol=TOL, rtol=0)
    assert got.oov.tolist() == [ng[-1] not in tiny_lm.vocab for ng in ngrams]
    assert got.oov.any() and got.normalized and got.model_hash == tiny_lm.model_hash
    assert got.log_base == log_base


def test_score_ids_unnormalized(client: LMClient, tiny_lm: Any) -> None:
    ids = dev_ngrams(tiny_lm, 500, 30)
    got = client.score_ids(ids, log_base="ln", normalized=False)
    np.testing.assert_allclose(got.log_probs, tiny_lm.score_ngrams(ids, normalized=False), atol=TOL, rtol=0)
    assert not got.normalized and len(ids) > 600  # more than two chunks of 300


def test_errors_name_the_global_index_across_chunks(client: LMClient, ngrams: list[list[str]]) -> None:
    bad = ngrams[:700] + [["the", "<s>"]] + ngrams[:10]
    for pack in (True, False):
        client.pack_ids = pack
        try:
            with pytest.raises(InvalidRequestError, match="item 700:") as err:
                client.score_ngrams(bad)
            assert err.value.index == 700
            with pytest.raises(InvalidRequestError, match="item 3:"):
                client.score_ngrams([["a"], ["b"], ["c"], ["a", "b", "c", "d", "e", "f"]])
        finally:
            client.pack_ids = True


def test_score_sentences_and_kenlm_surface(client: LMClient, tiny_lm: Any) -> None:
    sentences = dev_sentences(600, 120)  # > 300 tokens: several requests
    got = client.score_sentences(sentences)
    want = tiny_lm.score_sentences([s.split() for s in sentences], log10=True)
    assert len(got) == len(sentences)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.token_log_probs, w.token_log_probs, atol=TOL, rtol=0)
        assert g.oov.tolist() == w.oov.tolist() and g.ngram_lengths.tolist() == w.ngram_lengths.tolist()
    s = sentences[3]
    total = client.score(s)
    assert total == pytest.approx(want[3].total, abs=1e-4)
    triples = list(client.full_scores(s))
    assert len(triples) == len(s.split()) + 1
    assert sum(p for p, _, _ in triples) == pytest.approx(total, abs=1e-4)
    assert [n for _, n, _ in triples][:3] == [2, 3, 4] and all(isinstance(o, bool) for _, _, o in triples)
    assert client.perplexity(s) == pytest.approx(10 ** (-total / (len(s.split()) + 1)), rel=1e-9)
    assert client.score(s, bos=False, eos=False) == pytest.approx(
        tiny_lm.score_sentences([s.split()], bos=False, eos=False, log10=True)[0].total, abs=1e-4)
    assert client.score("") == pytest.approx(tiny_lm.score_sentences([[]], log10=True)[0].total, abs=1e-5)


def test_model_info_vocabulary_and_contains(client: LMClient, tiny_lm: Any) -> None:
    assert client.order == tiny_lm.order
    assert client.info.model_hash == tiny_lm.model_hash and client.info.max_ngrams_per_request == 300
    vocab = client.vocabulary()
    assert len(vocab) == len(tiny_lm.vocab) and vocab["the"] == tiny_lm.vocab.id("the")
    assert "the" in client and "qqqnotawordqqq" not in client
    assert ("The" in client) == tiny_lm.lowercase


def test_async_client_equals_sync(server: RunningServer, client: LMClient, ngrams: list[list[str]]) -> None:
    sentences = dev_sentences(700, 20)

    async def run() -> tuple[Any, ...]:
        async with AsyncLMClient(server.target) as c:
            scores, sents, total, ppl = await asyncio.gather(
                c.score_ngrams(ngrams), c.score_sentences(sentences), c.score(sentences[0]),
                c.perplexity(sentences[0]))
            contains = await c.contains("the")
            return scores, sents, total, ppl, contains, c.order, "the" in c

    scores, sents, total, ppl, contains, order, contains2 = asyncio.run(run())
    # (equal up to float rounding: concurrent calls may share a forward pass)
    np.testing.assert_allclose(scores.log_probs, client.score_ngrams(ngrams).log_probs, atol=TOL, rtol=0)
    sync_sents = client.score_sentences(sentences)
    assert [s.total for s in sents] == pytest.approx([s.total for s in sync_sents], abs=1e-4)
    assert total == pytest.approx(client.score(sentences[0]), abs=1e-4)
    assert ppl == pytest.approx(client.perplexity(sentences[0]), rel=1e-5)
    assert contains and contains2 and order == client.order


def test_concurrent_threads_share_one_client(client: LMClient, tiny_lm: Any, ngrams: list[list[str]]) -> None:
    want = reference(tiny_lm, ngrams, log10=True)
    errors: list[int] = []

    def work(i: int) -> None:
        sl = slice(i * 100, i * 100 + 100)
        for _ in range(5):
            if np.abs(client.score_ngrams(ngrams[sl]).log_probs - want[sl]).max() > TOL:
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_unavailable_is_retried_until_the_budget(tiny_lm: Any) -> None:
    port = free_port()
    policy = RetryPolicy(retries=3, initial_backoff=0.05, max_backoff=0.1)
    t0 = time.monotonic()
    with LMClient(f"127.0.0.1:{port}", timeout=2, retry_policy=policy) as c:
        with pytest.raises(ServerUnavailableError):
            c.score("the house")
    assert time.monotonic() - t0 >= 3 * 0.05 * 0.8  # it waited between the attempts


def test_retry_reaches_a_server_that_starts_late(tiny_lm: Any) -> None:
    port = free_port()
    holder: list[RunningServer] = []
    timer = threading.Timer(0.5, lambda: holder.append(start_server(tiny_lm, port=port)))
    timer.start()
    try:
        policy = RetryPolicy(retries=10, initial_backoff=0.1, max_backoff=0.5)
        with LMClient(f"127.0.0.1:{port}", timeout=5, retry_policy=policy) as c:
            assert c.score("the house") == pytest.approx(
                tiny_lm.score_sentences([["the", "house"]], log10=True)[0].total, abs=1e-4)
    finally:
        timer.join()
        for running in holder:
            running.stop(1.0)


def test_an_address_that_does_not_speak_grpc_is_named_at_once_not_retried() -> None:
    """`nlmserve score` pointed at a web server (a server's metrics port, say) fails on the
    first attempt with what to check: its answer is not HTTP/2 and would be the same on
    every retry (the old client logged five retries first)."""
    import http.server

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        target = f"127.0.0.1:{web.server_address[1]}"
        done = subprocess.run([sys.executable, "-m", "nlmserve", "score", "--server", target],
                              input="the house\n", capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and done.stdout == ""
        assert "Failed parsing HTTP/2" in done.stderr and "but not gRPC: check the port" in done.stderr, done.stderr
        assert "retry" not in done.stderr, done.stderr
        with LMClient(target, timeout=5, retry_policy=RetryPolicy(retries=3)) as c, \
                pytest.raises(ServerUnavailableError, match="not gRPC"):
            c.score("the house")
    finally:
        web.shutdown()
        web.server_close()


def test_score_cli_output(server: RunningServer, tiny_lm: Any) -> None:
    sentences = dev_sentences(800, 4) + ["qqqunknownqqq europe"]
    text = "\n".join(sentences) + "\n"
    cmd = [sys.executable, "-m", "nlmserve", "score", "--server", server.target]
    plain = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    js = subprocess.run(cmd + ["--json"], input=text, capture_output=True, text=True, timeout=60)
    assert js.returncode == 0, js.stderr
    want = tiny_lm.score_sentences([s.split() for s in sentences], log10=True)
    lines = plain.stdout.splitlines()
    assert len(lines) == len(sentences) + 4
    first = lines[0].split("\t")
    words = sentences[0].split()
    assert len(first) == len(words) + 2  # tokens, </s>, Total
    w0, n0, p0 = first[0].rsplit(" ", 2)[0], first[0].split(" ")[1], float(first[0].split(" ")[2])
    assert w0 == f"{words[0]}={tiny_lm.vocab.id(words[0])}" and n0 == "2"
    assert p0 == pytest.approx(float(want[0].token_log_probs[0]), abs=1e-5)
    assert first[-2].startswith("</s>=2 ")
    assert lines[len(sentences) - 1].endswith("OOV: 1") and "qqqunknownqqq=0 " in lines[len(sentences) - 1]
    objs = [json.loads(line) for line in js.stdout.splitlines()]
    assert len(objs) == len(sentences) + 1
    tokens = sum(len(s.split()) + 1 for s in sentences)
    oovs = sum(int(w.oov.sum()) for w in want)
    total = sum(w.total for w in want)
    oov_lp = sum(float(w.token_log_probs[w.oov].sum()) for w in want)
    for o, w in zip(objs, want):
        assert o["total"] == pytest.approx(w.total, abs=1e-4)
        assert [t["log_prob"] for t in o["tokens"]] == pytest.approx(w.token_log_probs.tolist(), abs=1e-5)
        assert [t["oov"] for t in o["tokens"]] == w.oov.tolist()
    summary = objs[-1]["summary"]
    assert summary["tokens"] == tokens and summary["oov"] == oovs
    assert summary["perplexity"] == pytest.approx(10 ** (-total / tokens), rel=1e-5)
    assert summary["perplexity_excl_oov"] == pytest.approx(10 ** (-(total - oov_lp) / (tokens - oovs)), rel=1e-5)
    assert lines[-4] == f"Perplexity including OOVs:\t{summary['perplexity']:.6g}"
    assert lines[-2:] == [f"OOVs:\t{oovs}", f"Tokens:\t{tokens}"]
    assert math.isfinite(summary["perplexity"])


def test_deadline_gives_request_timeout_error(tiny_lm: Any) -> None:
    from nlmserve.client import RequestTimeoutError

    running = start_server(tiny_lm)
    gate = threading.Event()
    scorer = running.engine.scorer
    real_score = scorer.score

    def held(ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:  # the real scorer, held at a gate
        gate.wait(10)
        return real_score(ids, normalized)

    scorer.score = held  # type: ignore[method-assign]
    try:
        with LMClient(running.target, timeout=0.3, retries=0) as c:
            c.info  # noqa: B018 - connect and fetch the info before the engine is held
            t0 = time.monotonic()
            with pytest.raises(RequestTimeoutError):
                c.score("the house")
            assert time.monotonic() - t0 < 3
            gate.set()
            assert c.score("the house") == pytest.approx(
                tiny_lm.score_sentences([["the", "house"]], log10=True)[0].total, abs=1e-4)
    finally:
        gate.set()
        running.stop(1.0)


def test_client_refuses_malformed_id_arrays(client: LMClient) -> None:
    with pytest.raises(InvalidRequestError, match="item 0: empty n-gram"):
        client.score_ids(np.zeros((3, 0), dtype=np.uint32))
    with pytest.raises(InvalidRequestError, match="2-D"):
        client.score_ids(np.zeros(3, dtype=np.uint32))
    assert len(client.score_ids(np.zeros((0, 2), dtype=np.uint32)).log_probs) == 0
    assert len(client.score_ngrams([]).log_probs) == 0 and client.score_sentences([]) == []


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "retried"),
    [
        (grpc.StatusCode.UNAVAILABLE, "", True),
        (grpc.StatusCode.CANCELLED, "Cancelled", True),  # a server shutting down
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max (10 vs. 5)", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "item 3: bad", False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", False),
    ],
)
def test_retry_policy_codes(code: grpc.StatusCode, details: str, retried: bool) -> None:
    from nlmserve.client.core import RetryPolicy

    policy = RetryPolicy(retries=2)
    assert policy.should_retry(_Failed(code, details), 0) is retried
    assert policy.should_retry(_Failed(code, details), 2) is False
