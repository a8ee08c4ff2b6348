"""The native front end's private channel (server/local.py), spoken to directly from Python.

A real server on the tiny model opens its Unix socket; these tests write frames as the C++
front end does and check that the answers equal the gRPC servicer's: values, log base,
normalisation, the exact status and message of the same bad input (token, size, id), a
merged batch's parts answered each with its own status, the request metrics counting the
parts, and that a broken frame costs only its own connection.
"""

from __future__ import annotations

import socket
import stat
import struct
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer
from nlmserve.server.local_frames import ALLOW_UNNORMALIZED, LOG10, NORMALIZED, PART, REQUEST, RESPONSE
from support import dev_ngrams, start_server


Answer = tuple[int, int, str, str, np.ndarray, list[tuple[int, str]]]


def call(path: str, ids: np.ndarray, flags: int = 0, auth: bytes = b"", request_id: int = 7,
         conn: socket.socket | None = None, parts: list[tuple[int, int]] | None = None) -> Answer:
    """One frame out, its answer back → (status, flags, model hash, message, scores, each
    part's (status, message)). ``parts``: (rows, order) of each client request; default one."""
    own = conn is None
    sock = conn or socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if own:
            sock.connect(path)
        rows, width = ids.shape
        parts = parts if parts is not None else [(rows, width)]
        sock.sendall(REQUEST.pack(b"NLQ2", request_id, flags, 0, rows, width, len(auth), len(parts)) + auth
                     + b"".join(PART.pack(*p) for p in parts) + ids.astype("<u4").tobytes())
        head = _read(sock, RESPONSE.size)
        magic, rid, status, rflags, n, hash_len, msg_len, n_parts = RESPONSE.unpack(head)
        assert magic == b"NLR2" and rid == request_id
        digest = _read(sock, hash_len).decode()
        message = _read(sock, msg_len).decode()
        table = [PART.unpack(_read(sock, PART.size)) for _ in range(n_parts)]
        answers = [(code, _read(sock, length).decode()) for code, length in table]
        scores = np.frombuffer(_read(sock, 4 * n), dtype="<f4")
        return status, rflags, digest, message, scores, answers
    finally:
        if own:
            sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


@pytest.fixture(scope="module")
def served(tiny_lm: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str]]:
    running = start_server(tiny_lm, metrics_port=0, max_ngrams_per_request=1000)
    path = running.start_local_backend(str(tmp_path_factory.mktemp("sock") / "backend.sock")).path
    yield running, path
    running.stop(1.0)


@pytest.mark.parametrize("log10", [False, True])
@pytest.mark.parametrize("unnormalized", [False, True])
def test_values_equal_the_grpc_servicer(served: tuple[RunningServer, str], tiny_lm: Any, log10: bool,
                                        unnormalized: bool) -> None:
    running, path = served
    ids = dev_ngrams(tiny_lm, 0, 4)
    flags = (LOG10 if log10 else 0) | (ALLOW_UNNORMALIZED if unnormalized else 0)
    status, rflags, digest, message, scores, answers = call(path, ids, flags)
    with grpc.insecure_channel(running.target) as ch:
        want = lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(lm_pb2.ScoreNgramsRequest(
            packed_ids=ids.astype("<u4").tobytes(), packed_order=ids.shape[1],
            log_base=lm_pb2.LOG10 if log10 else lm_pb2.LN, allow_unnormalized=unnormalized))
    assert (status, message, digest, answers) == (0, "", want.model_hash, [(0, "")])
    assert bool(rflags & LOG10) == log10 and bool(rflags & NORMALIZED) == want.normalized
    np.testing.assert_allclose(scores, want.log_probs, rtol=0, atol=1e-6)
    if not unnormalized:
        expected = np.asarray(tiny_lm.score_ngrams(ids)) / (np.log(10) if log10 else 1.0)
        np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-5)


def test_short_rows_and_one_connection_for_many_requests(served: tuple[RunningServer, str], tiny_lm: Any) -> None:
    _, path = served
    ids = dev_ngrams(tiny_lm, 10, 3)
    full = call(path, ids)[4]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        for i in range(3):  # the same connection answers request after request
            status, _, _, _, scores, _ = call(path, ids[:, 2:], request_id=100 + i, conn=conn)
            assert status == 0
    # rows of a 3-word context are left-padded as the contract says: equal to the padded rows
    padded = ids.copy()
    padded[:, :2] = 1  # <s>
    np.testing.assert_allclose(scores, call(path, padded)[4], rtol=0, atol=1e-6)
    assert full.shape == scores.shape


def test_errors_are_the_servicers_and_the_channel_survives_garbage(served: tuple[RunningServer, str],
                                                                  tiny_lm: Any) -> None:
    running, path = served
    ids = dev_ngrams(tiny_lm, 0, 2)[:4].copy()
    ids[2, 1] = 1_000_000  # not a word id
    status, _, _, _, scores, answers = call(path, ids)
    with grpc.insecure_channel(running.target) as ch, pytest.raises(grpc.RpcError) as err:
        lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(lm_pb2.ScoreNgramsRequest(
            packed_ids=ids.astype("<u4").tobytes(), packed_order=ids.shape[1]))
    assert status == 0 and len(answers) == 1
    code, message = answers[0]
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] == err.value.code().value[0]
    assert message == err.value.details() and "2" in message
    # too many rows: the limit's message, then the connection is closed (the ids were not read)
    big = np.ones((1001, 2), dtype=np.uint32)
    status, _, _, message, _, _ = call(path, big)
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "max_ngrams_per_request = 1000" in message
    # a frame that is not one: that connection is closed, the next one is served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
        bad.connect(path)
        bad.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 32)
        try:
            answer = bad.recv(100)
        except ConnectionResetError:  # closed with the rest of the bytes unread
            answer = b""
        assert answer == b""
    assert call(path, dev_ngrams(tiny_lm, 0, 1))[0] == 0


def test_socket_is_private_and_gone_after_stop(tiny_lm: Any, tmp_path: Path) -> None:
    running = start_server(tiny_lm)
    path = running.start_local_backend(str(tmp_path / "b.sock")).path
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(path)  # an open connection does not hold the stop up
        running.stop(0.5)
    assert not Path(path).exists()


def test_tokens_are_checked_per_request(tiny_lm: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("right-token-0123456\n")
    running = start_server(tiny_lm, model=str(tiny_model_path), token_file=str(tokens), metrics_port=0)
    try:
        path = running.start_local_backend(str(tmp_path / "b.sock")).path
        ids = dev_ngrams(tiny_lm, 0, 1)
        for auth, text in ((b"", "missing bearer token"), (b"Bearer wrong-token-99", "invalid bearer token")):
            status, _, _, message, _, _ = call(path, ids, auth=auth)
            assert (status, message) == (grpc.StatusCode.UNAUTHENTICATED.value[0], text)
        assert call(path, ids, auth=b"Bearer right-token-0123456")[0] == 0
        refused = running.metrics.requests.labels(rpc="ScoreNgrams", code="UNAUTHENTICATED")._value.get()
        assert refused == 2
    finally:
        running.stop(0.5)


def test_requests_are_counted_in_the_metrics(served: tuple[RunningServer, str], tiny_lm: Any) -> None:
    running, path = served
    ok = running.metrics.requests.labels(rpc="ScoreNgrams", code="OK")
    before = ok._value.get()
    ids = dev_ngrams(tiny_lm, 0, 2)
    for _ in range(3):
        call(path, ids)
    assert ok._value.get() == before + 3
    assert struct.calcsize("<4s7I") == REQUEST.size == RESPONSE.size == 32 and PART.size == 8


def test_each_part_of_a_merged_batch_gets_its_own_status(served: tuple[RunningServer, str], tiny_lm: Any) -> None:
    # Three client requests in one frame, the second one short (padded with <s> to the
    # batch's width) and holding an id outside the vocabulary: it alone fails, with the
    # servicer's status and message for that request sent alone; the others get their
    # scores; the metrics count three requests.
    running, path = served
    ids = dev_ngrams(tiny_lm, 0, 3)[:5].astype(np.uint32)
    order = ids.shape[1]
    short = ids[:2, 2:].copy()
    short[1, -2] = 1_000_000
    padded = np.concatenate([np.full((2, 2), 1, dtype=np.uint32), short], axis=1)  # <s> = 1
    frame = np.concatenate([ids[:2], padded, ids[2:]])
    with grpc.insecure_channel(running.target) as ch, pytest.raises(grpc.RpcError) as err:
        lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(lm_pb2.ScoreNgramsRequest(
            packed_ids=short.astype("<u4").tobytes(), packed_order=short.shape[1]))
    ok = running.metrics.requests.labels(rpc="ScoreNgrams", code="OK")
    invalid = running.metrics.requests.labels(rpc="ScoreNgrams", code="INVALID_ARGUMENT")
    before = ok._value.get(), invalid._value.get()
    status, _, _, _, scores, answers = call(path, frame, parts=[(2, order), (2, order - 2), (3, order)])
    assert status == 0
    assert answers == [(0, ""), (err.value.code().value[0], err.value.details()), (0, "")]
    assert "1000000" in answers[1][1]  # the client's own row, not the padded one, is named
    want = np.asarray(tiny_lm.score_ngrams(ids.astype(np.int64)))
    np.testing.assert_allclose(scores[:2], want[:2], rtol=0, atol=1e-5)
    np.testing.assert_allclose(scores[4:], want[2:], rtol=0, atol=1e-5)
    assert (ok._value.get(), invalid._value.get()) == (before[0] + 2, before[1] + 1)


def test_a_part_table_that_does_not_add_up_closes_the_connection(served: tuple[RunningServer, str],
                                                                  tiny_lm: Any) -> None:
    _, path = served
    ids = dev_ngrams(tiny_lm, 0, 3)[:3]
    assert ids.shape[0] == 3
    for parts in ([(2, ids.shape[1])], [(3, ids.shape[1] + 1)], [(3, 0)]):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(path)
            sock.sendall(REQUEST.pack(b"NLQ2", 1, 0, 0, 3, ids.shape[1], 0, len(parts))
                         + b"".join(PART.pack(*p) for p in parts) + ids.astype("<u4").tobytes())
            try:
                answer = sock.recv(100)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", parts
    assert call(path, ids)[0] == 0


def test_same_bad_inputs_get_the_same_codes_and_messages_as_the_servicer(
        tiny_lm: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    # A missing token, an oversized request and a bad id: status code and message are the
    # same over gRPC and over the socket (one owner: server/requests.py).
    tokens = tmp_path / "tokens"
    tokens.write_text("right-token-0123456\n")
    running = start_server(tiny_lm, model=str(tiny_model_path), token_file=str(tokens), max_ngrams_per_request=10)
    try:
        path = running.start_local_backend(str(tmp_path / "b.sock")).path
        good = b"Bearer right-token-0123456"
        bad_id = dev_ngrams(tiny_lm, 0, 1)[:2].copy()
        bad_id[1, 0] = 1_000_000
        cases = {
            "no token": (dev_ngrams(tiny_lm, 0, 1)[:2], b""),
            "oversized": (np.ones((11, 2), dtype=np.uint32), good),
            "bad id": (bad_id, good),
        }
        with grpc.insecure_channel(running.target) as ch:
            stub = lm_pb2_grpc.LanguageModelStub(ch)
            for name, (ids, auth) in cases.items():
                with pytest.raises(grpc.RpcError) as err:
                    stub.ScoreNgrams(lm_pb2.ScoreNgramsRequest(
                        packed_ids=ids.astype("<u4").tobytes(), packed_order=ids.shape[1]),
                        metadata=(("authorization", auth.decode()),) if auth else ())
                status, _, _, message, _, answers = call(path, ids, auth=auth)
                if status == 0:  # failed on its own: the part's status
                    status, message = answers[0]
                assert (status, message) == (err.value.code().value[0], err.value.details()), name
    finally:
        running.stop(0.5)
