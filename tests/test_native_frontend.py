"""The native micro-batching front end (server/native) before a real ``nlmserve serve``.

The backend is a real server on the tiny model (127.0.0.1, port 0); ``nlmserve_frontend``
is built with cmake into build/native (by test_cpp_client's ``driver`` fixture, which builds
the whole C++ project) and started on port 0 in front of it, with merged packed batches
going to the backend's private Unix socket (``--backend-socket``, server/local.py). Values
through the front end must equal the backend's own; merged batches must reach the backend
as fewer batches than the clients sent requests, while its request metrics count the
clients' requests; errors must be the backend's, for the request that caused them only.
"""

from __future__ import annotations

import os
import urllib.request
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nlmserve.client import LMClient
from nlmserve.wire.ngrams import BOS_ID
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.common.serve_process import parse_listening
from nlmserve.server.app import RunningServer
from support import GatedScorer, dev_ngrams, dev_sentences, serve_subprocess, start_server
from test_cpp_client import CONTRACT, NATIVE, SERVE, driver  # noqa: F401 - the driver fixture builds build/native

FRONTEND = NATIVE / "nlmserve_frontend"
SERVICE = "nlmserve.v1.LanguageModel"


class Frontend:
    """A running nlmserve_frontend process; ``stop()`` sends SIGTERM and returns its stderr."""

    def __init__(self, binary: Path, backend: str, *flags: str) -> None:
        self.proc = subprocess.Popen([str(binary), "--backend", backend, "--listen", "127.0.0.1:0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        target = parse_listening(line)
        if target is None or not target.startswith("127.0.0.1:"):
            self.proc.kill()
            raise AssertionError(f"front end did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.target = target

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err


def packed(ids: np.ndarray, **kw: Any) -> lm_pb2.ScoreNgramsRequest:
    return lm_pb2.ScoreNgramsRequest(packed_ids=ids.astype("<u4").tobytes(), packed_order=ids.shape[1], **kw)


def strings(ngrams: list[list[str]], **kw: Any) -> lm_pb2.ScoreNgramsRequest:
    return lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=ng) for ng in ngrams], **kw)


def socket_flags(running: RunningServer, tmp: Path) -> tuple[str, ...]:
    """The front end's --backend-socket for ``running`` (which serves one in ``tmp``)."""
    return ("--backend-socket", running.start_local_backend(str(tmp / "backend.sock")).path)


def backend_requests(running: RunningServer, code: str = "OK") -> float:
    """ScoreNgrams requests the backend finished with ``code``, from its live metrics."""
    return running.metrics.requests.labels(rpc="ScoreNgrams", code=code)._value.get()  # type: ignore[no-any-return]


def backend_batches(running: RunningServer) -> int:
    """Merged batches the backend's socket answered."""
    assert running.local is not None
    return running.local.batches


def test_the_front_ends_own_status_codes_are_the_contracts(driver: Path, tmp_path: Path) -> None:  # noqa: F811
    """The front end's table of the calls it ends itself is the "frontend:" rows of
    proto/contract/status_codes.tsv, and a file that differs by one code is refused."""
    golden = CONTRACT / "status_codes.tsv"
    done = subprocess.run([str(FRONTEND), "--check-status-codes", str(golden)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    rows = [line for line in golden.read_text().splitlines() if line.startswith("frontend:")]
    assert done.stdout == f"status codes: {len(rows)} front-end endings, 0 differ\n"
    changed = tmp_path / "status_codes.tsv"
    changed.write_text(golden.read_text().replace("frontend:queue_full\tRESOURCE_EXHAUSTED\t8",
                                                  "frontend:queue_full\tUNAVAILABLE\t14"))
    done = subprocess.run([str(FRONTEND), "--check-status-codes", str(changed)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1
    assert "frontend:queue_full ends with code 8, the file says 14" in done.stderr


@pytest.fixture(scope="module")
def backend(tiny_lm: Any) -> Iterator[RunningServer]:
    running = start_server(tiny_lm, metrics_port=0, max_ngrams_per_request=4096, max_queue_ngrams=8192)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def frontend(driver: Path, backend: RunningServer,  # noqa: F811
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    flags = socket_flags(backend, tmp_path_factory.mktemp("sock"))
    fe = Frontend(FRONTEND, backend.target, "--max-delay-us", "2000", *flags)
    yield fe
    code, err = fe.stop()
    assert code == 0, err


@pytest.fixture(scope="module")
def stubs(frontend: Frontend, backend: RunningServer) -> Iterator[tuple[Any, Any]]:
    with grpc.insecure_channel(frontend.target) as fch, grpc.insecure_channel(backend.target) as bch:
        yield lm_pb2_grpc.LanguageModelStub(fch), lm_pb2_grpc.LanguageModelStub(bch)


@pytest.mark.parametrize("log_base", ["LN", "LOG10"])
@pytest.mark.parametrize("unnormalized", [False, True])
def test_packed_ids_equal_the_backend(stubs: tuple[Any, Any], tiny_lm: Any, log_base: str, unnormalized: bool) -> None:
    fe, be = stubs
    ids = dev_ngrams(tiny_lm, 100, 10)
    kw = {"log_base": getattr(lm_pb2, log_base), "allow_unnormalized": unnormalized}
    got, want = fe.ScoreNgrams(packed(ids, **kw)), be.ScoreNgrams(packed(ids, **kw))
    np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=0, atol=1e-6)
    assert (got.log_base, got.normalized, got.model_hash) == (want.log_base, want.normalized, want.model_hash)
    assert list(got.oov) == list(want.oov)


def test_strings_with_oov_and_short_contexts_equal_the_backend(stubs: tuple[Any, Any]) -> None:
    fe, be = stubs
    ngrams = [["the"], ["<s>", "<s>", "<s>", "<s>", "the"], ["zzqx-not-a-word", "of", "the"], ["the", "zzqx"],
              ["of", "the", "european", "parliament", "."]]
    got, want = fe.ScoreNgrams(strings(ngrams)), be.ScoreNgrams(strings(ngrams))
    np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=0, atol=1e-6)
    assert list(got.oov) == list(want.oov) == [False, False, False, True, False]


def _strip_padding(row: np.ndarray, bos: int) -> np.ndarray:
    """The row without its leading <s> padding (at least the predicted word): the same n-gram."""
    k = 0
    while k < len(row) - 1 and row[k] == bos:
        k += 1
    return row[k:]


def test_concurrent_clients_get_their_own_answers_in_fewer_backend_calls(
        frontend: Frontend, backend: RunningServer, tiny_lm: Any) -> None:
    # 32 clients send one n-gram per request; every other request drops its <s> padding,
    # so merged batches mix packed orders and the front end pads them again. The backend
    # holds the first call it gets until every client has sent its first request: those wait
    # in the front end together (one backend call in flight) and must go out merged.
    ids = dev_ngrams(tiny_lm, 0, 30)
    assert any(len(_strip_padding(r, BOS_ID)) < tiny_lm.order for r in ids)
    with grpc.insecure_channel(backend.target) as ch:
        want = list(lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(ids, log_base=lm_pb2.LN)).log_probs)
    assert len(want) == len(ids)
    clients, rounds = 32, 12
    got: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    sent_first: list[int] = []
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        try:
            with grpc.insecure_channel(frontend.target) as ch:
                stub = lm_pb2_grpc.LanguageModelStub(ch)
                stub.GetModelInfo(lm_pb2.GetModelInfoRequest())
                barrier.wait()
                out = []
                for r in range(rounds):
                    row = ids[(c * rounds + r) % len(ids)]
                    if (c + r) % 2:
                        row = _strip_padding(row, BOS_ID)
                    if r == 0:
                        sent_first.append(c)
                    out.append(stub.ScoreNgrams(packed(row[None, :], log_base=lm_pb2.LN)).log_probs[0])
                got[c] = out
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    gated = GatedScorer(backend.engine.scorer)
    backend.engine.scorer = gated  # type: ignore[assignment]
    before, batches = backend_requests(backend), backend_batches(backend)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    try:
        for t in threads:
            t.start()
        assert gated.entered.wait(10)
        deadline = time.monotonic() + 10
        while len(sent_first) < clients and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # the last first requests are on their way to the front end's queue
        gated.gate.set()
        for t in threads:
            t.join(60)
    finally:
        gated.gate.set()
        backend.engine.scorer = gated.scorer  # type: ignore[assignment]
    assert not errors, errors[0]
    for c in range(clients):
        expected = [want[(c * rounds + r) % len(ids)] for r in range(rounds)]
        np.testing.assert_allclose(got[c], expected, rtol=0, atol=1e-5)
    # Requests were merged: fewer batches than requests; the backend's request metrics count
    # every client request.
    calls = backend_batches(backend) - batches
    assert 1 <= calls < clients * rounds, calls
    assert backend_requests(backend) - before == clients * rounds


def burst_behind_a_held_call(gated: Any, client: Any, n: int, started: list[int]) -> None:
    """Client 0's call is held inside the backend (``gated``); clients 1..n-1 then call
    (each appends itself to ``started``) and queue in the front end; then the backend is
    let go and every client's call is waited for."""
    first = threading.Thread(target=client, args=(0,))
    first.start()
    assert gated.entered.wait(10)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(1, n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(started) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the last calls are on their way to the front end's queue
    gated.gate.set()
    for t in [first, *threads]:
        t.join(10)


def test_requests_queued_behind_a_backend_call_reach_it_as_one_merged_batch(
        frontend: Frontend, backend: RunningServer, tiny_lm: Any) -> None:
    # One batch is held inside the backend (at most one in flight by default) while 31 more
    # clients send one n-gram each; when it is let go the front end sends the 31 together.
    ids = dev_ngrams(tiny_lm, 0, 30)[:32]
    want = tiny_lm.score_ngrams(ids.astype(np.int64))
    gated = GatedScorer(backend.engine.scorer)
    backend.engine.scorer = gated  # type: ignore[assignment]
    got: dict[int, float] = {}
    started: list[int] = []
    before, batches = backend_requests(backend), backend_batches(backend)
    try:
        with grpc.insecure_channel(frontend.target) as ch:
            stub = lm_pb2_grpc.LanguageModelStub(ch)
            stub.GetModelInfo(lm_pb2.GetModelInfoRequest())

            def client(c: int) -> None:
                started.append(c)
                got[c] = stub.ScoreNgrams(packed(ids[c:c + 1], log_base=lm_pb2.LN)).log_probs[0]

            burst_behind_a_held_call(gated, client, len(ids), started)
    finally:
        gated.gate.set()
        backend.engine.scorer = gated.scorer  # type: ignore[assignment]
    np.testing.assert_allclose([got[c] for c in range(len(ids))], want, rtol=0, atol=1e-5)
    # The held call, then the 31 waiting requests in one call (two if the last arrivals were
    # slower than half a second to reach the front end); 32 client requests in the metrics.
    assert backend_batches(backend) - batches <= 3
    assert backend_requests(backend) - before == len(ids)


def test_short_context_is_left_padded_like_the_backend(stubs: tuple[Any, Any], tiny_lm: Any) -> None:
    fe, be = stubs
    the, of = tiny_lm.vocab.id("the"), tiny_lm.vocab.id("of")
    short = np.array([[of, the]], dtype=np.uint32)
    want = be.ScoreNgrams(packed(short)).log_probs[0]
    assert fe.ScoreNgrams(packed(short)).log_probs[0] == pytest.approx(want, abs=1e-6)


def test_invalid_requests_get_the_backends_error(stubs: tuple[Any, Any], tiny_lm: Any) -> None:
    fe, be = stubs
    the = tiny_lm.vocab.id("the")
    bad = {
        "too long": strings([["the"], ["a", "b", "c", "d", "e", "f"]]),
        "<s> predicted": packed(np.array([[the, the], [the, BOS_ID]], dtype=np.uint32)),
        "id out of range": packed(np.array([[the, 10**6]], dtype=np.uint32)),
        "ragged": lm_pb2.ScoreNgramsRequest(packed_ids=b"\x01\x00\x00\x00\x02", packed_order=1),
    }
    for name, req in bad.items():
        with pytest.raises(grpc.RpcError) as want:
            be.ScoreNgrams(req)
        with pytest.raises(grpc.RpcError) as got:
            fe.ScoreNgrams(req)
        assert got.value.code() == want.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert got.value.details() == want.value.details(), name


def test_an_invalid_request_merged_with_others_fails_alone(frontend: Frontend, backend: RunningServer,
                                                          stubs: tuple[Any, Any], tiny_lm: Any) -> None:
    # One batch is held inside the backend while 7 more clients queue one request each in
    # the front end; two of them are invalid (a short one with an id outside the vocabulary,
    # padded in the merged batch, and <s> predicted). When the held batch is let go the 7
    # reach the backend merged: the two invalid ones get the backend's own status and
    # message for their request, the others their values; all 8 are counted.
    _, be = stubs
    the = tiny_lm.vocab.id("the")
    ids = dev_ngrams(tiny_lm, 0, 30)[:8]
    want = tiny_lm.score_ngrams(ids.astype(np.int64))
    bad = {3: packed(np.array([[10**6, the]], dtype=np.uint32), log_base=lm_pb2.LN),
           5: packed(np.array([[the, BOS_ID]], dtype=np.uint32), log_base=lm_pb2.LN)}
    expected: dict[int, tuple[Any, Any]] = {}
    for c, req in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            be.ScoreNgrams(req)
        expected[c] = (err.value.code(), err.value.details())
    gated = GatedScorer(backend.engine.scorer)
    backend.engine.scorer = gated  # type: ignore[assignment]
    got: dict[int, Any] = {}
    started: list[int] = []
    before = {code: backend_requests(backend, code) for code in ("OK", "INVALID_ARGUMENT")}
    batches = backend_batches(backend)
    try:
        with grpc.insecure_channel(frontend.target) as ch:
            stub = lm_pb2_grpc.LanguageModelStub(ch)
            stub.GetModelInfo(lm_pb2.GetModelInfoRequest())

            def client(c: int) -> None:
                started.append(c)
                try:
                    got[c] = stub.ScoreNgrams(bad.get(c, packed(ids[c:c + 1], log_base=lm_pb2.LN))).log_probs[0]
                except grpc.RpcError as e:
                    got[c] = (e.code(), e.details())

            burst_behind_a_held_call(gated, client, len(ids), started)
    finally:
        gated.gate.set()
        backend.engine.scorer = gated.scorer  # type: ignore[assignment]
    for c in range(len(ids)):
        if c in bad:
            assert got[c] == expected[c], c
        else:
            assert got[c] == pytest.approx(want[c], abs=1e-5), c
    assert backend_batches(backend) - batches <= 3  # merged
    assert backend_requests(backend, "OK") - before["OK"] == len(ids) - len(bad)
    assert backend_requests(backend, "INVALID_ARGUMENT") - before["INVALID_ARGUMENT"] == len(bad)


def test_other_rpcs_pass_through(stubs: tuple[Any, Any], tiny_lm: Any) -> None:
    fe, be = stubs
    assert fe.GetModelInfo(lm_pb2.GetModelInfoRequest()) == be.GetModelInfo(lm_pb2.GetModelInfoRequest())
    chunks = list(fe.GetVocabulary(lm_pb2.GetVocabularyRequest(chunk_size=100)))
    assert [w for c in chunks for w in c.words] == tiny_lm.vocab.words
    tables = list(fe.GetScoringTables(lm_pb2.GetScoringTablesRequest(chunk_floats=50_000)))
    assert len(tables) > 1 and tables == list(be.GetScoringTables(lm_pb2.GetScoringTablesRequest(chunk_floats=50_000)))
    assert np.frombuffer(b"".join(c.data for c in tables), dtype="<f4").size == tables[0].total_floats
    req = lm_pb2.ScoreSentencesRequest(sentences=dev_sentences(0, 5), log_base=lm_pb2.LN)
    got, want = fe.ScoreSentences(req), be.ScoreSentences(req)
    assert [s.total for s in got.sentences] == pytest.approx([s.total for s in want.sentences], abs=1e-6)
    with pytest.raises(grpc.RpcError) as err:
        fe.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["the " * 300_000]))
    with pytest.raises(grpc.RpcError) as direct:
        be.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["the " * 300_000]))
    assert (err.value.code(), err.value.details()) == (direct.value.code(), direct.value.details())


def test_python_client_works_through_the_front_end(frontend: Frontend, backend: RunningServer) -> None:
    text = dev_sentences(20, 3)
    with LMClient(frontend.target) as fe, LMClient(backend.target) as be:
        assert fe.info.model_hash == be.info.model_hash
        for s in text:
            assert fe.score(s) == pytest.approx(be.score(s), abs=1e-5)


def test_health_and_reflection(frontend: Frontend) -> None:
    with grpc.insecure_channel(frontend.target) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICE):
            assert h.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answers[0].list_services_response.service}
        assert SERVICE in names and "nlmserve.v1.Admin" in names


def test_full_queue_is_resource_exhausted(driver: Path, backend: RunningServer, tiny_lm: Any,  # noqa: F811
                                          tmp_path: Path) -> None:
    # Batches of 4 wait up to 3 s for company; the queue holds 4 n-grams. A first request
    # of 3 waits; a second of 3 does not fit and is refused at once; the first is then
    # answered with its values.
    fe = Frontend(FRONTEND, backend.target, "--max-batch-ngrams", "4", "--max-queue-ngrams", "4",
                  "--max-delay-us", "3000000", "--delay-policy", "fixed", *socket_flags(backend, tmp_path))
    try:
        ids = dev_ngrams(tiny_lm, 0, 2)[:3]
        first: dict[str, Any] = {}

        def send() -> None:
            with grpc.insecure_channel(fe.target) as ch:
                first["r"] = lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(ids), timeout=30)

        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.5)
        with grpc.insecure_channel(fe.target) as ch, pytest.raises(grpc.RpcError) as err:
            lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(ids), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in (err.value.details() or "")
        t.join()
        with grpc.insecure_channel(backend.target) as ch:
            want = lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(ids)).log_probs
        np.testing.assert_allclose(first["r"].log_probs, want, rtol=0, atol=1e-6)
    finally:
        code, err_text = fe.stop()
    assert code == 0, err_text
    assert "1 refused (queue full)" in err_text


def test_sigterm_drains_in_flight_requests(driver: Path, backend: RunningServer, tiny_lm: Any,  # noqa: F811
                                           tmp_path: Path) -> None:
    # Requests wait 2 s in the queue; SIGTERM arrives meanwhile: they are still answered,
    # and the process exits 0.
    fe = Frontend(FRONTEND, backend.target, "--max-batch-ngrams", "1000", "--max-delay-us", "2000000",
                  "--delay-policy", "fixed", *socket_flags(backend, tmp_path))
    ids = dev_ngrams(tiny_lm, 0, 2)[:5]
    answers: list[Any] = []

    def send() -> None:
        with grpc.insecure_channel(fe.target) as ch:
            answers.append(lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(ids), timeout=30))

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.7)
    fe.proc.send_signal(signal.SIGTERM)
    t.join()
    code, err = fe.stop()
    assert code == 0, err
    assert len(answers) == 1 and len(answers[0].log_probs) == 5
    assert "SIGTERM" in err


def test_health_follows_the_backend(driver: Path, tiny_lm: Any, tmp_path: Path) -> None:  # noqa: F811
    running = start_server(tiny_lm)
    fe = Frontend(FRONTEND, running.target, *socket_flags(running, tmp_path))
    try:
        with grpc.insecure_channel(fe.target) as ch:
            h = health_pb2_grpc.HealthStub(ch)
            assert h.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
            running.stop(0.5)
            deadline = time.monotonic() + 10
            status = None
            while time.monotonic() < deadline:
                status = h.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.2)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(np.array([[4, 5]], dtype=np.uint32)), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        code, err_text = fe.stop()
    assert code == 0, err_text


def test_socket_channel_reconnects_after_the_model_server_reopens_it(driver: Path, tiny_lm: Any,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    # The model server's socket goes away under a running front end: the batch in its way
    # gets UNAVAILABLE (the client may retry), the front end keeps serving, and once the
    # socket is back the next batch reconnects and gets its values.
    running = start_server(tiny_lm)
    path = str(tmp_path / "backend.sock")
    fe = Frontend(FRONTEND, running.target, "--backend-socket", running.start_local_backend(path).path)
    ids = dev_ngrams(tiny_lm, 0, 2)
    want = np.asarray(tiny_lm.score_ngrams(ids)) / np.log(10)
    try:
        with grpc.insecure_channel(fe.target) as ch:
            stub = lm_pb2_grpc.LanguageModelStub(ch)
            np.testing.assert_allclose(stub.ScoreNgrams(packed(ids), timeout=30).log_probs, want, rtol=0, atol=1e-5)
            assert running.local is not None
            running.local.close()
            running.local = None
            for _ in range(2):  # the dead connection, then no socket to connect to
                with pytest.raises(grpc.RpcError) as err:
                    stub.ScoreNgrams(packed(ids), timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "backend socket" in (err.value.details() or "")
            running.start_local_backend(path)
            np.testing.assert_allclose(stub.ScoreNgrams(packed(ids), timeout=30).log_probs, want, rtol=0, atol=1e-5)
    finally:
        code, err_text = fe.stop()
        running.stop(0.5)
    assert code == 0, err_text


def test_bad_flags_and_absent_backend_are_clear_errors(driver: Path) -> None:  # noqa: F811
    done = subprocess.run([str(FRONTEND), "--backend", "127.0.0.1:1", "--max-batch-ngrams", "0"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--max-batch-ngrams needs an integer >= 1" in done.stderr
    done = subprocess.run([str(FRONTEND), "--backend", "127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--backend-socket PATH is required" in done.stderr
    done = subprocess.run([str(FRONTEND), "--backend", "127.0.0.1:1", "--backend-socket", "/nonexistent/b.sock",
                           "--connect-timeout-s", "1"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "no answer from the backend 127.0.0.1:1" in done.stderr


def test_serve_with_the_native_front_end_is_one_command(driver: Path, tiny_model_path: Path, tiny_lm: Any,  # noqa: F811
                                                        tmp_path: Path) -> None:
    # `nlmserve serve --frontend native`: the front end on the public port, the model server
    # on a private one and its private socket; values equal the in-process model; /metrics
    # counts the clients' requests; SIGTERM stops both, exit 0, and the socket's directory
    # is gone.
    log = tmp_path / "serve.log"
    server = serve_subprocess(tiny_model_path, "--frontend", "native", "--frontend-binary", str(FRONTEND),
                              metrics_port=0, log=log, command=SERVE, env={**os.environ, "TMPDIR": str(tmp_path)})
    proc = server.process
    try:
        assert server.target.startswith("127.0.0.1:") and server.metrics_url is not None
        ids = dev_ngrams(tiny_lm, 50, 5)
        with grpc.insecure_channel(server.target) as ch:
            stub = lm_pb2_grpc.LanguageModelStub(ch)
            got = stub.ScoreNgrams(packed(ids, log_base=lm_pb2.LN)).log_probs
            for row in ids[:3]:
                stub.ScoreNgrams(packed(row[None, :], log_base=lm_pb2.LN))
        want = tiny_lm.score_ngrams(ids)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        with urllib.request.urlopen(server.metrics_url, timeout=10) as page:
            text = page.read().decode()
        counted = [line for line in text.splitlines() if line.startswith("nlmserve_requests_total{")
                   and 'rpc="ScoreNgrams"' in line and 'code="OK"' in line]
        assert len(counted) == 1 and float(counted[0].split()[-1]) == 4.0, counted
        sockets = list(tmp_path.glob("nlmserve-*/backend.sock"))
        assert len(sockets) == 1
        assert all(stat.S_IMODE(p.parent.stat().st_mode) == 0o700 for p in sockets)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text(encoding="utf-8")[-3000:]
    assert not list(tmp_path.glob("nlmserve-*"))


def test_native_front_end_refuses_tls_and_a_missing_binary(tiny_model_path: Path, tmp_path: Path) -> None:
    done = subprocess.run([*SERVE, "serve", "--model", str(tiny_model_path), "--port", "0", "--frontend", "native",
                           "--tls-cert", "c.pem", "--tls-key", "k.pem"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "native front end serves plaintext only" in done.stderr
    done = subprocess.run([*SERVE, "serve", "--model", str(tiny_model_path), "--port", "0", "--frontend", "native",
                           "--frontend-binary", str(tmp_path / "absent")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not an executable file" in done.stderr


def test_bearer_tokens_are_checked_by_the_backend(driver: Path, tiny_lm: Any, tiny_model_path: Path,  # noqa: F811
                                                  tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# the front end's own token first\nfrontend-token-0123\ncaller-token-456789\n")
    running = start_server(tiny_lm, model=str(tiny_model_path), token_file=str(tokens))
    fe = Frontend(FRONTEND, running.target, "--token-file", str(tokens), *socket_flags(running, tmp_path))
    try:
        ids = dev_ngrams(tiny_lm, 0, 2)
        with grpc.insecure_channel(fe.target) as ch:
            stub = lm_pb2_grpc.LanguageModelStub(ch)
            for metadata in ((), (("authorization", "Bearer wrong-token-0000"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.ScoreNgrams(packed(ids), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            got = stub.ScoreNgrams(packed(ids), metadata=(("authorization", "Bearer caller-token-456789"),))
        np.testing.assert_allclose(got.log_probs, np.asarray(tiny_lm.score_ngrams(ids)) / np.log(10), rtol=0, atol=1e-5)
    finally:
        code, err_text = fe.stop()
        running.stop(0.5)
    assert code == 0, err_text
