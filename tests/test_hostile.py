"""Hostile and unlucky clients against real servers on 127.0.0.1 (port 0): calls without a
token, calls that never send their message, health Watch streams held open, and a client
that opens more calls than its share (server/gate.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Coroutine, Iterator, TypeVar

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nlmserve.client import LMClient
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer
from nlmserve.server.config import ServerConfig

from support import GatedScorer, dev_ngrams, ended, metric, start_server

T = TypeVar("T")
TOKEN = "hostile-test-token-0123"
SCORE = "/nlmserve.v1.LanguageModel/ScoreNgrams"
CHECK = "/grpc.health.v1.Health/Check"
HALF_OPEN = 300


class Loop:
    """An asyncio loop on a thread of its own, for the hostile clients (grpc.aio)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture()
def loop() -> Iterator[Loop]:
    held = Loop()
    yield held
    held.close()


def own_connection() -> list[tuple[str, Any]]:
    """Channel options that give a channel a TCP connection of its own (gRPC otherwise
    shares one between channels to the same address)."""
    return [("grpc.use_local_subchannel_pool", 1)]


async def never_sends(stop: asyncio.Event) -> AsyncIterator[bytes]:
    await stop.wait()
    if False:  # pragma: no cover (an async generator that yields nothing)
        yield b""


def packed(ids: np.ndarray) -> lm_pb2.ScoreNgramsRequest:
    a = np.ascontiguousarray(ids, dtype="<u4")
    return lm_pb2.ScoreNgramsRequest(packed_ids=a.tobytes(), packed_order=a.shape[1], log_base=lm_pb2.LN)


def check_serving(running: RunningServer, lm: Any, rows: np.ndarray) -> None:
    """An authorised client gets the model's own scores, and Health/Check answers SERVING."""
    with LMClient(running.target, token=TOKEN, retries=0, timeout=10) as client:
        got = client.score_ids(rows, log_base="ln").log_probs
    np.testing.assert_allclose(got, lm.score_ngrams(rows.astype(np.int64)), atol=1e-5, rtol=0)
    with grpc.insecure_channel(running.target, options=own_connection()) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture()
def secured(tiny_lm: Any, tmp_path: Path) -> Iterator[RunningServer]:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n", encoding="utf-8")
    running = start_server(tiny_lm, token_file=str(tokens), metrics_port=0, first_message_seconds=1.5)
    yield running
    running.stop(0.5)


def test_half_open_unauthenticated_streams_hold_nothing(secured: RunningServer, tiny_lm: Any,
                                                        loop: Loop) -> None:
    """300 ScoreNgrams calls without a token whose request never comes, and 300 health Watch
    streams held open on 38 connections (more than --max-concurrent-rpcs 256 each): the
    ScoreNgrams calls end UNAUTHENTICATED at once, the Watch streams stay open without taking
    a slot, and an authorised client and Health/Check keep answering."""
    rows = dev_ngrams(tiny_lm, 0, 5)
    per_connection = 8  # --max-health-watches-per-connection's default

    async def hostile() -> tuple[list[str], list[Any], list[Any], asyncio.Event]:
        stop = asyncio.Event()
        channels = [grpc.aio.insecure_channel(secured.target, options=own_connection())
                    for _ in range(-(-HALF_OPEN // per_connection))]
        watches = [health_pb2_grpc.HealthStub(channels[i // per_connection]).Watch(
            health_pb2.HealthCheckRequest(service="")) for i in range(HALF_OPEN)]
        first = await asyncio.gather(*(w.read() for w in watches))
        assert all(f.status == health_pb2.HealthCheckResponse.SERVING for f in first)
        # Spread over the connections: one connection may have fewer streams open at once.
        calls = [channels[i % len(channels)].stream_unary(SCORE)(never_sends(stop), timeout=20)
                 for i in range(HALF_OPEN)]
        codes = [code for code, _ in await ended(calls)]
        return codes, watches, channels, stop

    codes, watches, channels, stop = loop.run(hostile())
    try:
        assert codes == ["UNAUTHENTICATED"] * HALF_OPEN
        check_serving(secured, tiny_lm, rows)
        assert secured.gate.watches.active == HALF_OPEN and secured.gate.rpcs.active == 0
        assert not any(w.done() for w in watches)  # still held while the others were served
        assert metric(secured, 'nlmserve_requests_total{code="UNAUTHENTICATED",rpc="ScoreNgrams"}') == HALF_OPEN
    finally:
        async def close() -> None:
            stop.set()
            for w in watches:
                w.cancel()
            await asyncio.gather(*(c.close() for c in channels))

        loop.run(close())


def test_watch_streams_have_a_pool_of_their_own(tiny_lm: Any, loop: Loop) -> None:
    """Watch streams beyond --max-health-watches-per-connection or --max-health-watches
    end UNIMPLEMENTED (a gRPC client's own health checking then counts the server as
    healthy) and are counted; scoring and Check are not affected."""
    running = start_server(tiny_lm, metrics_port=0, max_health_watches=5, max_health_watches_per_connection=3)
    rows = dev_ngrams(tiny_lm, 0, 2)

    async def open_watches() -> tuple[list[str], list[Any], list[Any]]:
        channels = [grpc.aio.insecure_channel(running.target, options=own_connection()) for _ in range(3)]
        watches, outcome = [], []
        for i in range(12):  # 4 on each connection, one after the other
            w = health_pb2_grpc.HealthStub(channels[i // 4]).Watch(health_pb2.HealthCheckRequest(service=""))
            watches.append(w)
            try:
                await w.read()
                outcome.append("held")
            except grpc.aio.AioRpcError as e:
                outcome.append(e.code().name)
        return outcome, watches, channels

    outcome, watches, channels = loop.run(open_watches())
    try:
        # connection 1: 3 held, its 4th refused; connection 2: 2 held (5 in all), the rest refused
        assert outcome.count("held") == 5
        assert outcome[:4] == ["held"] * 3 + ["UNIMPLEMENTED"]
        assert outcome[4:] == ["held"] * 2 + ["UNIMPLEMENTED"] * 6
        assert metric(running, 'nlmserve_refused_total{reason="max_health_watches_per_connection"}') == 1
        assert metric(running, 'nlmserve_refused_total{reason="max_health_watches"}') == 6
        with LMClient(running.target, retries=0, timeout=10) as client:
            np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs,
                                       tiny_lm.score_ngrams(rows.astype(np.int64)), atol=1e-5, rtol=0)
        with grpc.insecure_channel(running.target) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        async def close() -> None:
            for w in watches:
                w.cancel()
            await asyncio.gather(*(c.close() for c in channels))

        loop.run(close())
        running.stop(0.5)


def wait_for(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def test_health_calls_held_open_never_keep_out_a_probe(tiny_lm: Any, tmp_path: Path, loop: Loop) -> None:
    """Health calls whose message never comes (no token needed) wait at most 4 per
    connection and 16 in all here (--max-health-watches-per-connection,
    --max-health-watches): each newer one cuts the one of its connection, or of the
    server, that has waited longest, so a probe's Check on a new connection is answered
    however many are held open, and what they hold stays bounded."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n", encoding="utf-8")
    running = start_server(tiny_lm, token_file=str(tokens), metrics_port=0, max_health_watches=16,
                           max_health_watches_per_connection=4, first_message_seconds=60)
    waiting = running.gate.health_waiting
    stop = asyncio.Event()

    async def connect() -> Any:
        return grpc.aio.insecure_channel(running.target, options=own_connection())

    async def hold(channel: Any, n: int) -> list[Any]:
        return [channel.stream_unary(CHECK)(never_sends(stop), timeout=60) for _ in range(n)]

    channels = [loop.run(connect()) for _ in range(5)]
    held = []
    try:
        for i in range(4):  # 4 on each of 4 connections, one connection after the other: 16 wait
            held.append(loop.run(hold(channels[i], 4)))
            wait_for(lambda: len(waiting) == 4 * (i + 1))
        fifth = loop.run(hold(channels[0], 1))  # a 5th on the first connection cuts one of its 4
        wait_for(lambda: sum(c.done() for c in held[0]) == 1)
        held.append(loop.run(hold(channels[4], 4)))  # 4 on a 5th connection cut the 4 oldest in all
        wait_for(lambda: sum(c.done() for c in held[0] + held[1]) == 5)
        assert len(waiting) == 16
        with grpc.insecure_channel(running.target, options=own_connection()) as channel:  # the probe
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: sum(c.done() for c in held[1]) == 2)  # the probe cut one more, then left
        assert len(waiting) == 15
        done = [c for group in held for c in group if c.done()]
        assert len(done) == 6 and not any(c.done() for c in fifth + held[2] + held[3] + held[4])
        why = [f"{code}: {details}" for code, details in loop.run(ended(done))]
        on_connection = ("RESOURCE_EXHAUSTED: cut for a newer call: 4 health calls on this connection were waiting "
                         "for their request message (--max-health-watches-per-connection 4); a client sends it "
                         "with the call's headers; retry later")
        in_all = ("RESOURCE_EXHAUSTED: cut for a newer call: 16 health calls in all were waiting for their request "
                  "message (--max-health-watches 16); a client sends it with the call's headers; retry later")
        assert sorted(why) == sorted([on_connection] + [in_all] * 5), why
        assert metric(running, 'nlmserve_refused_total{reason="calls_awaiting_message"}') == 6
        assert metric(running, 'nlmserve_requests_total{code="RESOURCE_EXHAUSTED",rpc="Check"}') == 6
    finally:
        async def close() -> None:
            stop.set()
            await asyncio.gather(*(c.close() for c in channels))

        loop.run(close())
        running.stop(0.5)
    assert len(waiting) == 0


def test_authorised_calls_that_never_send_are_cut(secured: RunningServer, tiny_lm: Any, loop: Loop) -> None:
    """300 authorised calls whose message never comes (on two connections: one connection
    may open fewer streams at once) take no slot while they wait: beyond the 128 one client
    may have waiting (--max-rpcs-per-client; one token: the client is its address), each
    newer call cuts the one that has waited longest (RESOURCE_EXHAUSTED, as a refusal by a
    limit), the client's own requests too, which are served; the rest end DEADLINE_EXCEEDED
    after --first-message-seconds (1.5 here). Each counted and logged."""
    rows = dev_ngrams(tiny_lm, 0, 3)
    metadata = (("authorization", f"Bearer {TOKEN}"),)

    async def half_open() -> tuple[list[Any], list[Any], asyncio.Event]:
        stop = asyncio.Event()
        channels = [grpc.aio.insecure_channel(secured.target, options=own_connection()) for _ in range(2)]
        return [channels[i % 2].stream_unary(SCORE)(never_sends(stop), metadata=metadata, timeout=30)
                for i in range(HALF_OPEN)], channels, stop

    per_client = ServerConfig(model="m").max_rpcs_per_client
    calls, channels, stop = loop.run(half_open())
    try:
        deadline = time.monotonic() + 10
        while len(secured.gate.waiting) < per_client and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(secured.gate.waiting) == per_client and secured.gate.rpcs.active == 0
        check_serving(secured, tiny_lm, rows)  # while they wait
        codes = loop.run(ended(calls))
        cut = [why for code, why in codes if code == "RESOURCE_EXHAUSTED"]
        # mostly the client's bound (the two connections' calls arrive interleaved); the
        # connection's own (128 too) where one connection's calls came first
        per_connection = ServerConfig(model="m").max_rpcs_per_connection
        assert cut and set(cut) <= {
            f"cut for a newer call: {per_client} calls of this client were waiting for their request message "
            f"(--max-rpcs-per-client {per_client}); a client sends it with the call's headers; retry later",
            f"cut for a newer call: {per_connection} calls on this connection were waiting for their request "
            f"message (--max-rpcs-per-connection {per_connection}); a client sends it with the call's headers; "
            "retry later"}, set(cut)
        assert [code for code, _ in codes].count("DEADLINE_EXCEEDED") == HALF_OPEN - len(cut)
        # the client's own requests (check_serving's) each cut one more
        assert HALF_OPEN - per_client < len(cut) <= HALF_OPEN - per_client + 3
        assert metric(secured, 'nlmserve_refused_total{reason="calls_awaiting_message"}') == len(cut)
        assert metric(secured, 'nlmserve_refused_total{reason="first_message_timeout"}') == HALF_OPEN - len(cut)
        assert len(secured.gate.waiting) == 0
        check_serving(secured, tiny_lm, rows)
    finally:
        async def close() -> None:
            stop.set()
            await asyncio.gather(*(c.close() for c in channels))

        loop.run(close())


def test_one_connection_cannot_take_every_slot(tiny_lm: Any) -> None:
    """With --max-concurrent-rpcs 4 and --max-rpcs-per-connection 2, a connection's third
    call in flight is refused RESOURCE_EXHAUSTED naming the limit while another connection is
    served; with four calls in flight a fifth from anywhere is refused naming the other."""
    running = start_server(tiny_lm, metrics_port=0, max_concurrent_rpcs=4, max_rpcs_per_connection=2)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    rows = dev_ngrams(tiny_lm, 0, 5)[:100]  # more than a lone request scored inline
    channels = [grpc.insecure_channel(running.target, options=own_connection()) for _ in range(3)]
    try:
        stubs = [lm_pb2_grpc.LanguageModelStub(c) for c in channels]
        held = [stubs[0].ScoreNgrams.future(packed(rows), timeout=20)]
        assert gated.entered.wait(5)
        held.append(stubs[0].ScoreNgrams.future(packed(rows), timeout=20))
        deadline = time.monotonic() + 10
        while running.engine.queue_depth() < len(rows) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            stubs[0].ScoreNgrams(packed(rows), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-rpcs-per-connection 2" in (err.value.details() or "")
        held += [stubs[1].ScoreNgrams.future(packed(rows), timeout=20) for _ in range(2)]
        while running.engine.queue_depth() < 3 * len(rows) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            stubs[2].ScoreNgrams(packed(rows), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-rpcs 4" in (err.value.details() or "")
        # Check is never limited
        assert health_pb2_grpc.HealthStub(channels[2]).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        gated.gate.set()
        expected = tiny_lm.score_ngrams(rows.astype(np.int64))
        for call in held:
            np.testing.assert_allclose(call.result(10).log_probs, expected, atol=1e-5, rtol=0)
        # the slots are given back: the refused connection is served again
        np.testing.assert_allclose(stubs[0].ScoreNgrams(packed(rows), timeout=10).log_probs, expected,
                                   atol=1e-5, rtol=0)
        assert metric(running, 'nlmserve_refused_total{reason="max_rpcs_per_connection"}') == 1
        assert metric(running, 'nlmserve_refused_total{reason="max_concurrent_rpcs"}') == 1
        assert metric(running, 'nlmserve_requests_total{code="RESOURCE_EXHAUSTED",rpc="ScoreNgrams"}') == 2
    finally:
        gated.gate.set()
        for c in channels:
            c.close()
        running.stop(0.5)


@pytest.mark.parametrize("limit", ["age", "idle"])
def test_clients_ride_over_connection_limits(tiny_lm: Any, limit: str) -> None:
    """A connection older than --max-connection-age-seconds, or idle longer than
    --max-connection-idle-seconds, is closed by the server with GOAWAY: the Python client,
    alone and over two replicas (whose health Watch streams are cut too), reconnects and
    loses no request."""
    settings = ({"max_connection_age_seconds": 0.3, "max_connection_age_grace_seconds": 0.5} if limit == "age"
                else {"max_connection_idle_seconds": 0.2})
    servers = [start_server(tiny_lm, **settings) for _ in range(2)]
    rows = dev_ngrams(tiny_lm, 0, 4)
    expected = tiny_lm.score_ngrams(rows.astype(np.int64))
    try:
        # The limit is in force: a connection that made a call is closed by the server (the
        # channel falls back to IDLE), and with the age limit a held Watch stream is cut.
        states: list[grpc.ChannelConnectivity] = []
        with grpc.insecure_channel(servers[0].target, options=own_connection()) as channel:
            channel.subscribe(states.append)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=20)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            if limit == "age":
                with pytest.raises(grpc.RpcError) as err:
                    next(watch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            else:
                watch.cancel()
            deadline = time.monotonic() + 10
            ready, idle = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
            while not (ready in states and idle in states[states.index(ready):]):
                assert time.monotonic() < deadline, states
                time.sleep(0.05)
            channel.unsubscribe(states.append)
        with LMClient(servers[0].target, timeout=10) as alone, \
                LMClient([s.target for s in servers], timeout=10) as both:
            for i in range(40):  # about 3 s: several ages, or an idle pause every 10 requests
                for client in (alone, both):
                    np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs, expected,
                                               atol=1e-5, rtol=0)
                time.sleep(0.5 if limit == "idle" and i % 10 == 9 else 0.05)
    finally:
        for s in servers:
            s.stop(0.5)


@pytest.mark.parametrize("rpc", ["ScoreNgrams", "ScoreSentences"])
def test_a_log_base_the_enum_does_not_hold_is_invalid(tiny_lm: Any, rpc: str) -> None:
    running = start_server(tiny_lm)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = lm_pb2_grpc.LanguageModelStub(channel)
            if rpc == "ScoreNgrams":
                call, request = stub.ScoreNgrams, lm_pb2.ScoreNgramsRequest(
                    ngrams=[lm_pb2.NgramStrings(words=["of", "the"])], log_base=7)  # type: ignore[arg-type]
            else:
                call, request = stub.ScoreSentences, lm_pb2.ScoreSentencesRequest(
                    sentences=["of the"], log_base=7)  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "log_base 7 is not a LogBase" in (err.value.details() or "")
            for base in (lm_pb2.LOG_BASE_UNSPECIFIED, lm_pb2.LOG10, lm_pb2.LN):  # the three it holds
                request.log_base = base
                assert call(request, timeout=10).log_base == (lm_pb2.LN if base == lm_pb2.LN else lm_pb2.LOG10)
    finally:
        running.stop(0.5)
