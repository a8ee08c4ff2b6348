"""Hostile clients, round two, against real servers on 127.0.0.1 (port 0): a full health
Watch pool under replicated clients, a token holder that does not read its streams or
spreads its calls over connections, HTTP/2 rapid reset, invented method names, guessed
tokens, a huge sentence, connections beyond the cap and a client that never acknowledges
the server's SETTINGS (server/gate.py, server/app.py)."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.h2 import unread_calls
from nlmserve.client import LMClient
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server import app

from support import GatedScorer, dev_ngrams, heap_per_call, metric, needs_mallinfo, serve_subprocess, start_server
from test_hostile import Loop, own_connection, packed

TOKEN = "hostile-clients-token-a"
OTHER = "hostile-clients-token-b"
SCORE = "/nlmserve.v1.LanguageModel/ScoreNgrams"


@pytest.fixture()
def loop() -> Iterator[Loop]:
    held = Loop()
    yield held
    held.close()


def token_file(tmp_path: Path, *tokens: str) -> str:
    path = tmp_path / "tokens"
    path.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    return str(path)


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def host_port(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host, int(port)


def wait_for(predicate: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


# ---------------------------------------------------------------------- raw HTTP/2
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS = 1, 3, 4
END_HEADERS, ACK = 0x4, 0x1
CANCEL = 8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def header_block(target: str, path: str) -> bytes:
    """An HPACK block of a gRPC call's headers: :method POST and :scheme http from the static
    table, the rest as literals without indexing (each shorter than 127 bytes)."""
    block = b"\x83\x86"
    for name, value in ((":path", path), (":authority", target), ("content-type", "application/grpc"),
                        ("te", "trailers")):
        block += b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()
    return block


def rapid_reset(target: str, streams: int, batch: int = 500) -> None:
    """Open ``streams`` calls on one connection and reset each at once (HEADERS, then
    RST_STREAM CANCEL), reading whatever the server answers meanwhile."""
    host, port = host_port(target)
    block = header_block(target, SCORE)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        s.setblocking(False)
        stream = 1
        try:
            while stream < 2 * streams:
                burst = bytearray()
                for _ in range(batch):
                    burst += frame(HEADERS, END_HEADERS, stream, block) + frame(RST_STREAM, 0, stream,
                                                                                  struct.pack(">I", CANCEL))
                    stream += 2
                s.setblocking(True)
                s.sendall(bytes(burst))
                s.setblocking(False)
                try:
                    while s.recv(1 << 16):
                        pass
                except BlockingIOError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close a connection that resets this much


# ---------------------------------------------------------------------- health Watch
def test_a_full_watch_pool_leaves_replicated_clients_served(tiny_lm: Any, tmp_path: Path, loop: Loop) -> None:
    """Clients without a token fill --max-health-watches on both replicas; a replicated
    client (whose Watch streams, opened by gRPC itself, carry no token) is still served by
    both: a Watch beyond the pool ends UNIMPLEMENTED, which gRPC's client-side health
    checking takes as 'healthy, not watched', where any other code fails the replica."""
    tokens = token_file(tmp_path, TOKEN)
    servers = [start_server(tiny_lm, token_file=tokens, metrics_port=0, max_health_watches=4,
                            max_health_watches_per_connection=2) for _ in range(2)]
    rows = dev_ngrams(tiny_lm, 0, 3)
    expected = tiny_lm.score_ngrams(rows.astype(np.int64))

    async def fill() -> tuple[list[str], list[Any], list[Any]]:
        channels = [grpc.aio.insecure_channel(s.target, options=own_connection()) for s in servers for _ in range(3)]
        watches = [health_pb2_grpc.HealthStub(c).Watch(health_pb2.HealthCheckRequest()) for c in channels
                   for _ in range(2)]
        outcome = []
        for w in watches:
            try:
                await w.read()
                outcome.append("held")
            except grpc.aio.AioRpcError as e:
                outcome.append(e.code().name)
        return outcome, watches, channels

    outcome, watches, channels = loop.run(fill())
    try:
        assert Counter(outcome) == {"held": 8, "UNIMPLEMENTED": 4}
        with LMClient([s.target for s in servers], token=TOKEN, retries=0, timeout=10) as client:
            for _ in range(4):
                np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs, expected,
                                           atol=1e-5, rtol=0)
        for s in servers:
            assert s.gate.watches.active == 4
            assert metric(s, 'nlmserve_refused_total{reason="max_health_watches"}') >= 2
    finally:
        async def close() -> None:
            for w in watches:
                w.cancel()
            await asyncio.gather(*(c.close() for c in channels))

        loop.run(close())
        for s in servers:
            s.stop(0.5)


# ---------------------------------------------------------------------- one client's share
def test_a_client_that_does_not_read_loses_its_streams_and_slots(tiny_lm: Any, tmp_path: Path, loop: Loop,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A token holder opens GetScoringTables twice (--max-concurrent-rpcs 2) and stops
    reading: after --stream-write-timeout-seconds (1 here) both slots are free and another
    client is served; reading again, the holder learns that its calls ended
    DEADLINE_EXCEEDED; nothing is logged at ERROR."""
    running = start_server(tiny_lm, token_file=token_file(tmp_path, TOKEN, OTHER), metrics_port=0,
                           max_concurrent_rpcs=2, max_rpcs_per_connection=2, max_rpcs_per_client=2,
                           stream_write_timeout_seconds=1.0)
    rows = dev_ngrams(tiny_lm, 0, 3)
    # No BDP probing: the connection keeps HTTP/2's 64 KiB window, so 1 KiB chunks stall soon.
    options = own_connection() + [("grpc.http2.bdp_probe", 0)]

    async def hold() -> tuple[list[Any], Any]:
        channel = grpc.aio.insecure_channel(running.target, options=options)
        stub = lm_pb2_grpc.LanguageModelStub(channel)
        calls = [stub.GetScoringTables(lm_pb2.GetScoringTablesRequest(chunk_floats=256), metadata=bearer(TOKEN))
                 for _ in range(2)]
        for call in calls:
            await call.read()
        return calls, channel

    async def read_rest(calls: list[Any]) -> list[str]:
        ends = []
        for call in calls:
            try:
                while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    pass
                ends.append("OK")
            except grpc.aio.AioRpcError as e:
                ends.append(f"{e.code().name}: {e.details()}")
        return ends

    caplog.set_level(logging.WARNING)
    calls, channel = loop.run(hold())
    try:
        wait_for(lambda: metric(running, 'nlmserve_refused_total{reason="stream_write_timeout"}') == 2)
        assert running.gate.rpcs.active == 0
        with LMClient(running.target, token=OTHER, retries=0, timeout=10) as client:
            np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs,
                                       tiny_lm.score_ngrams(rows.astype(np.int64)), atol=1e-5, rtol=0)
        ends = loop.run(read_rest(calls))
        assert all(e.startswith("DEADLINE_EXCEEDED") and "--stream-write-timeout-seconds" in e for e in ends), ends
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        loop.run(channel.close())
        running.stop(0.5)


async def closed(conn: Any) -> None:
    conn.close()  # on the loop that owns the connection


def test_answers_a_client_does_not_read_count_against_its_share(tiny_lm: Any, tmp_path: Path, loop: Loop,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A token holder whose receive window is 0 sends five ScoreNgrams calls, one after the
    other: the server computes each answer, which then waits in gRPC. Each waits against
    the holder's share (--max-rpcs-per-client 3), so the fourth and fifth calls are refused
    naming the flag, and the server's own slots are free: the other client is served. Once
    the holder goes away its share is free again, and its leaving is one log line, no ERROR
    (gRPC logs each such answer with a traceback)."""
    running = start_server(tiny_lm, token_file=token_file(tmp_path, TOKEN, OTHER), metrics_port=0,
                           max_concurrent_rpcs=8, max_rpcs_per_connection=8, max_rpcs_per_client=3)
    rows = dev_ngrams(tiny_lm, 0, 3)[:50]
    expected = tiny_lm.score_ngrams(rows.astype(np.int64))
    caplog.set_level(logging.DEBUG, logger="grpc")
    caplog.set_level(logging.INFO, logger="nlmserve")
    try:
        outcomes, conn = loop.run(unread_calls(host_port(running.target)[1], SCORE, TOKEN,
                                               packed(rows).SerializeToString(), 5))
        assert outcomes[:3] == ["held"] * 3, outcomes
        assert all(o.startswith("RESOURCE_EXHAUSTED: this client holds") and "--max-rpcs-per-client 3" in o
                   for o in outcomes[3:]), outcomes
        assert running.gate.rpcs.active == 0
        with LMClient(running.target, token=OTHER, retries=0, timeout=10) as client:
            np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs, expected, atol=1e-5, rtol=0)
        loop.run(closed(conn))
        wait_for(lambda: sum(running.gate.rpcs._by_client.values()) == 0)
        with LMClient(running.target, token=TOKEN, retries=0, timeout=10) as client:
            np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs, expected, atol=1e-5, rtol=0)
        assert metric(running, 'nlmserve_refused_total{reason="max_rpcs_per_client"}') == 2
        wait_for(lambda: any("went away" in r.getMessage() for r in caplog.records))
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        running.stop(0.5)


def test_one_client_cannot_take_every_slot_over_several_connections(tiny_lm: Any, tmp_path: Path) -> None:
    """With two tokens (so each is a client), --max-concurrent-rpcs 4 and
    --max-rpcs-per-client 2: a client's third call in flight, on a connection of its own,
    is refused RESOURCE_EXHAUSTED naming the limit, while the other client is served."""
    running = start_server(tiny_lm, token_file=token_file(tmp_path, TOKEN, OTHER), metrics_port=0,
                           max_concurrent_rpcs=4, max_rpcs_per_connection=4, max_rpcs_per_client=2)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    rows = dev_ngrams(tiny_lm, 0, 5)[:100]  # more than a lone request scored inline
    channels = [grpc.insecure_channel(running.target, options=own_connection()) for _ in range(4)]
    try:
        stubs = [lm_pb2_grpc.LanguageModelStub(c) for c in channels]
        held = [stubs[0].ScoreNgrams.future(packed(rows), timeout=20, metadata=bearer(TOKEN))]
        assert gated.entered.wait(5)
        held.append(stubs[1].ScoreNgrams.future(packed(rows), timeout=20, metadata=bearer(TOKEN)))
        wait_for(lambda: running.gate.rpcs.active == 2)
        with pytest.raises(grpc.RpcError) as err:
            stubs[2].ScoreNgrams(packed(rows), timeout=10, metadata=bearer(TOKEN))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-rpcs-per-client 2" in (err.value.details() or "")
        held += [stubs[3].ScoreNgrams.future(packed(rows), timeout=20, metadata=bearer(OTHER)) for _ in range(2)]
        wait_for(lambda: running.gate.rpcs.active == 4)
        gated.gate.set()
        expected = tiny_lm.score_ngrams(rows.astype(np.int64))
        for call in held:
            np.testing.assert_allclose(call.result(10).log_probs, expected, atol=1e-5, rtol=0)
        assert metric(running, 'nlmserve_refused_total{reason="max_rpcs_per_client"}') == 1
    finally:
        gated.gate.set()
        for c in channels:
            c.close()
        running.stop(0.5)


def test_a_client_is_its_token_when_tokens_tell_callers_apart_else_its_address() -> None:
    from nlmserve.server.auth import address_of
    from nlmserve.server.gate import client_of

    assert address_of("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert address_of("ipv6:[::1]:51234") == "ipv6:[::1]"
    assert address_of("ipv6:%5B::1%5D:51234") == "ipv6:%5B::1%5D"
    assert address_of("unix:/run/nlmserve.sock") == "unix:/run/nlmserve.sock"
    assert client_of("ipv4:10.0.0.7:51234", None) == client_of("ipv4:10.0.0.7:40000", None)
    assert client_of("ipv4:10.0.0.7:51234", "ab12") != client_of("ipv4:10.0.0.7:51234", "cd34")


def test_waiting_calls_cut_the_longest_waiting_of_their_scope() -> None:
    """Waiting (server/gate.py): a call beyond the limit of its connection, its client or
    the server cuts the one of that scope that has waited longest (its timeout ends at
    once, with the reason); one whose own deadline has just passed is not cut again (its
    timeout can no longer be changed: the server logged a RuntimeError traceback)."""
    from nlmserve.server.gate import Waiting

    async def run() -> None:
        waiting = Waiting("calls", 3, 2, 2, ("--in-all", "--per-connection", "--per-client"))
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(60) as t1, asyncio.timeout(60) as t2, asyncio.timeout(60) as t3:
            a = waiting.enter("conn1", "alice", t1)
            b = waiting.enter("conn1", "bob", t2)
            c = waiting.enter("conn1", "carol", t3)  # conn1's third: a cut
            assert a.cut.startswith("cut for a newer call: 2 calls on this connection were waiting") and \
                "(--per-connection 2)" in a.cut and t1.when() is not None and t1.when() <= loop.time()
            assert not b.cut and not c.cut and len(waiting) == 2
            waiting.leave(b)
            waiting.leave(c)
            waiting.leave(a)  # once: a cut call has left already
            assert len(waiting) == 0
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0) as expired:
                late = waiting.enter("conn2", "dave", expired)
                await asyncio.sleep(1)
        async with asyncio.timeout(60) as t4, asyncio.timeout(60) as t5:
            d = waiting.enter("conn3", "dave", t4)  # dave's second: the late one has not left yet
            e = waiting.enter("conn4", "dave", t5)  # dave's third: the late one is the longest waiting
            assert not late.cut  # its deadline had passed: it leaves, not cut again
            assert not d.cut and not e.cut and len(waiting) == 2

    asyncio.run(run())


# ---------------------------------------------------------------------- HTTP/2 rapid reset
def test_rapid_reset_cancels_no_other_clients_call(tiny_model_path: Path, tmp_path: Path) -> None:
    """Four connections each open and reset 20,000 calls without a token while four
    authorised clients score on connections of their own: every authorised call succeeds
    (before: some ended CANCELLED, other clients' calls crowded out of gRPC's queue of
    calls waiting for the server) and the server answers Check afterwards."""
    server = serve_subprocess(tiny_model_path, "--token-file", token_file(tmp_path, TOKEN),
                              log=tmp_path / "server.log")
    request = lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["of", "the"])])
    outcome: Counter[str] = Counter()
    stop = threading.Event()

    def score() -> None:
        with grpc.insecure_channel(server.target, options=own_connection()) as channel:
            stub = lm_pb2_grpc.LanguageModelStub(channel)
            while not stop.is_set():
                try:
                    stub.ScoreNgrams(request, timeout=30, metadata=bearer(TOKEN))
                    outcome["OK"] += 1
                except grpc.RpcError as e:
                    outcome[e.code().name] += 1
                time.sleep(0.01)

    clients = [threading.Thread(target=score) for _ in range(4)]
    try:
        for t in clients:
            t.start()
        attackers = [threading.Thread(target=rapid_reset, args=(server.target, 20_000)) for _ in range(4)]
        for t in attackers:
            t.start()
        for t in attackers:
            t.join(60)
        time.sleep(1.0)
        stop.set()
        for t in clients:
            t.join(60)
        assert set(outcome) == {"OK"}, outcome
        with grpc.insecure_channel(server.target) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        stop.set()
        server.stop()


# ---------------------------------------------------------------------- smaller ones
def test_invented_method_names_add_no_metric_series(tiny_lm: Any, tmp_path: Path) -> None:
    """Calls to 40 invented methods, without a token and with one, are counted under
    rpc="unknown": /metrics holds none of their names."""
    running = start_server(tiny_lm, token_file=token_file(tmp_path, TOKEN), metrics_port=0)
    running.gate.auth_failures.FREE = 1000  # answered at once: this test is about the count
    try:
        with grpc.insecure_channel(running.target) as channel:
            for i in range(40):
                call = channel.unary_unary(f"/nlmserve.v1.LanguageModel/Invented{i}")
                for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                                       (bearer(TOKEN), grpc.StatusCode.UNIMPLEMENTED)):
                    with pytest.raises(grpc.RpcError) as err:
                        call(b"", timeout=10, metadata=metadata)
                    assert err.value.code() == code
        exposition = running.metrics.render().decode()
        assert "Invented" not in exposition
        assert metric(running, 'nlmserve_requests_total{code="UNAUTHENTICATED",rpc="unknown"}') == 40
    finally:
        running.stop(0.5)


def test_failed_authentication_is_logged_once_and_slowed(tiny_lm: Any, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """16 guesses of the token from one address: each refused UNAUTHENTICATED, one WARNING
    line names the refusals (not one per guess), and the guesses after the first ten
    waited their growing delays; the right token is then served at once."""
    running = start_server(tiny_lm, token_file=token_file(tmp_path, TOKEN), metrics_port=0)
    failures = running.gate.auth_failures
    failures.FIRST_DELAY, failures.MAX_DELAY = 0.02, 0.08
    delays = [min(failures.MAX_DELAY, failures.FIRST_DELAY * 2 ** k) for k in range(16 - failures.FREE)]
    rows = dev_ngrams(tiny_lm, 0, 2)
    caplog.set_level(logging.WARNING, logger="nlmserve.server.gate")
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = lm_pb2_grpc.LanguageModelStub(channel)
            started = time.monotonic()
            for i in range(16):
                with pytest.raises(grpc.RpcError) as err:
                    stub.ScoreNgrams(packed(rows), timeout=10, metadata=bearer(f"guess-{i}"))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            waited = time.monotonic() - started
            assert waited >= sum(delays)  # sleeps: a lower bound, never a race
            assert failures.held == 0
            assert len(stub.ScoreNgrams(packed(rows), timeout=10, metadata=bearer(TOKEN)).log_probs) == len(rows)
        lines = [r.getMessage() for r in caplog.records if "by unauthenticated" in r.getMessage()]
        assert len(lines) == 1 and "invalid bearer token" in lines[0], lines
        assert metric(running, 'nlmserve_requests_total{code="UNAUTHENTICATED",rpc="ScoreNgrams"}') == 16
    finally:
        running.stop(0.5)


def _memory_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_huge_sentence_is_refused_before_it_is_split(tiny_model_path: Path, tmp_path: Path) -> None:
    """One 30 MB sentence of 10 million tokens (the limit is 200,000) is refused
    INVALID_ARGUMENT without a string per token: the server's peak resident memory grows by
    less than 300 MB (splitting it first took over 600 MB), and it serves on."""
    server = serve_subprocess(tiny_model_path, log=tmp_path / "server.log")
    try:
        pid = server.process.pid
        with grpc.insecure_channel(server.target) as channel:
            stub = lm_pb2_grpc.LanguageModelStub(channel)
            stub.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["of the"]), timeout=30)
            peak = _memory_kb(pid, "VmHWM")
            with pytest.raises(grpc.RpcError) as err:
                stub.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["of " * 10_000_000]), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "more than 200000 tokens" in (err.value.details() or "")
            assert (_memory_kb(pid, "VmHWM") - peak) < 300 * 1024
            assert len(stub.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["of the"]),
                                           timeout=30).sentences) == 1
    finally:
        server.stop()


def test_connections_beyond_the_cap_are_closed(tiny_lm: Any) -> None:
    """With --max-connections 2 and two connections open (sockets that send nothing), a
    new client's connection is closed at once (UNAVAILABLE); once one of them goes, it is
    served."""
    running = start_server(tiny_lm, max_connections=2)
    host, port = host_port(running.target)
    sockets = [socket.create_connection((host, port), timeout=5) for _ in range(2)]

    def check() -> Any:
        with grpc.insecure_channel(running.target, options=own_connection()) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3).status

    try:
        time.sleep(0.3)  # both accepted
        with pytest.raises(grpc.RpcError) as err:
            check()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        sockets.pop().close()
        wait_for(lambda: _served(check))
    finally:
        for s in sockets:
            s.close()
        running.stop(0.5)


def _served(check: Any) -> bool:
    try:
        return bool(check() == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def test_the_open_files_limit_is_raised_to_the_hard_limit(tiny_lm: Any) -> None:
    """A server started under a soft open-files limit of 256 raises it to the hard limit
    (at 1,024 new connections timed out long before --max-connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard open-files limit is 256 or less")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        running = start_server(tiny_lm)
        running.stop(0.5)
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised == hard if hard != resource.RLIM_INFINITY else raised > 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


def test_a_connection_that_never_acknowledges_settings_is_closed(tiny_lm: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Until a client acknowledges the server's SETTINGS, gRPC holds each call's metadata to
    HTTP/2's default 16 MiB rather than to the server's 16 KiB; such a connection is closed
    after the SETTINGS timeout (0.5 s here, app.SETTINGS_ACK_MS) instead of gRPC's minute."""
    monkeypatch.setattr(app, "SETTINGS_ACK_MS", 500)
    running = start_server(tiny_lm)
    host, port = host_port(running.target)
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(PREFACE + frame(SETTINGS, 0, 0))  # no ACK of the server's SETTINGS
            received = b""
            while chunk := s.recv(1 << 16):  # the server's SETTINGS, then its GOAWAY and EOF
                received += chunk
            assert len(received) > 0
    finally:
        running.stop(0.5)


def test_a_client_gone_mid_stream_leaves_one_line(tiny_lm: Any, loop: Loop, caplog: pytest.LogCaptureFixture) -> None:
    """Three clients leave while the server waits to write their GetScoringTables answers:
    their calls end and free their slots, logged in one line (no ERROR, no traceback)."""
    running = start_server(tiny_lm, metrics_port=0)
    options = own_connection() + [("grpc.http2.bdp_probe", 0)]

    async def leave() -> None:
        for _ in range(3):
            channel = grpc.aio.insecure_channel(running.target, options=options)
            call = lm_pb2_grpc.LanguageModelStub(channel).GetScoringTables(
                lm_pb2.GetScoringTablesRequest(chunk_floats=256))
            await call.read()
            await asyncio.sleep(0.3)  # the server's writes stall on the full window
            await channel.close()

    caplog.set_level(logging.DEBUG, logger="grpc")
    caplog.set_level(logging.INFO, logger="nlmserve")
    try:
        loop.run(leave())
        wait_for(lambda: running.gate.rpcs.active == 0)
        time.sleep(0.3)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        lines = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
        assert len(lines) == 1, caplog.text
    finally:
        running.stop(0.5)


# ---------------------------------------------------------------------- memory of cut calls
#: What each call may leave allocated: 9 bytes were measured, about 100 while each deadline
#: or cut cancelled the call's pending read (grpc.aio keeps a cancelled read's operations
#: for good: gRPC issue 43360).
CUT_CALL_BYTES = 40


def test_calls_cut_before_their_message_leave_nothing_allocated(tiny_lm: Any) -> None:
    """4,000 health Checks that never send their message, each ended by the first-message
    deadline or cut for a newer one (bench/heap_per_call.py's ``half_open_check``, from a
    process of its own): the server's malloc holds less than 40 bytes more per call
    afterwards (9 measured; about 100 while the gate cancelled each call's read)."""
    import subprocess
    import sys

    from bench.heap_per_call import heap_in_use

    needs_mallinfo()
    running = start_server(tiny_lm, first_message_seconds=0.1)
    repo = Path(__file__).resolve().parent.parent

    def half_open(calls: int) -> None:
        subprocess.run([sys.executable, "-m", "bench.heap_per_call", "--client", running.target, "half_open_check",
                        str(calls)], check=True, timeout=120, cwd=repo)

    try:
        half_open(500)  # the server's first such calls make what it keeps for later ones
        before = heap_in_use()
        half_open(4000)
        grown = heap_in_use() - before
        assert grown < 4000 * CUT_CALL_BYTES, f"{grown / 4000:.0f} bytes a call"
    finally:
        running.stop(0.5)



#: What a server may keep for good after its first 16 ScoreNgrams of 100,000 string n-grams,
#: 8 at once: its scorer's buffers for a full batch (6 MB measured with the tiny model);
#: upb's map of live message wrappers made it ~56 MB while the server listed every n-gram's
#: words before mapping them.
LARGE_CALLS_KEPT = 16_000_000


def test_large_requests_leave_no_more_than_a_full_batch_needs(tiny_model_path: Path, tmp_path: Path) -> None:
    """bench/heap_per_call.py's ``large`` pattern (a server of its own in a fresh process, two
    rounds of 8 ScoreNgrams of 100,000 string n-grams at once): the server's malloc holds
    under 16 MB more afterwards, however many such requests were mapped at the same moment."""
    row = heap_per_call(tiny_model_path, 8, "large", tmp_path)[0]["patterns"]["large"]
    kept = 8 * (row["first_round_bytes_per_call"] + row["bytes_per_call"])
    assert kept < LARGE_CALLS_KEPT, f"{kept / 1e6:.1f} MB kept after 16 large requests"
