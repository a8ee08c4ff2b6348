"""Hostile clients against the native front end (server/native) before a real backend.

Each test starts ``nlmserve_frontend`` on 127.0.0.1 port 0 before a real server on the tiny
model (its private socket for merged batches), attacks it as a client would, and checks
that an authorised client is still served and that the front end ends, bounds or sheds
what the attacker holds (call.h, and the guards: tokens.h, slots.h, connections.h,
memory.h). Attacks gRPC's own clients cannot make (a connection that never acknowledges
the server's settings, an unfinished header block, a window of 0 bytes) are written as raw
HTTP/2 frames (:class:`RawConnection`).
"""

from __future__ import annotations

import asyncio
import resource
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nlmserve.common.memory import resident_bytes
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer
from bench.h2 import unread_calls
from support import GatedScorer, dev_ngrams, ended, open_files, serve_subprocess, start_server
from test_cpp_client import SERVE, driver  # noqa: F401 - the driver fixture builds build/native
from test_hostile import Loop
from test_hostile_clients import closed, loop  # noqa: F401 - the loop fixture
from test_native_frontend import FRONTEND, Frontend, backend_requests, packed, socket_flags

TOKENS = ("hostile-native-token-0", "hostile-native-token-1")
AUTH = (("authorization", f"Bearer {TOKENS[0]}"),)
OTHER = (("authorization", f"Bearer {TOKENS[1]}"),)
SCORE = "/nlmserve.v1.LanguageModel/ScoreNgrams"
SERVICE = "nlmserve.v1.LanguageModel"


# ---------------------------------------------------------------------- raw HTTP/2
class RawConnection:
    """A TCP connection that speaks just enough HTTP/2 to open calls as no gRPC client would:
    it sends the preface and its SETTINGS (``initial_window``: the bytes the server may send
    on each stream), never acknowledges the server's, and never reads unless asked."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    def __init__(self, target: str, initial_window: int | None = None, preface: bool = True) -> None:
        host, port = target.rsplit(":", 1)
        self.target = target
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        if preface:
            settings = struct.pack(">HI", 0x4, initial_window) if initial_window is not None else b""
            self.sock.sendall(self.PREFACE + self.frame(0x4, 0, 0, settings))

    @staticmethod
    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

    @staticmethod
    def _integer(n: int, prefix: int) -> bytes:  # HPACK's integer with an n-bit prefix
        limit = (1 << prefix) - 1
        if n < limit:
            return bytes([n])
        out, n = [limit], n - limit
        while n >= 128:
            out.append((n & 127) | 128)
            n >>= 7
        return bytes(out + [n])

    @classmethod
    def field(cls, name: bytes, value: bytes) -> bytes:  # a literal field, never indexed
        return b"\x00" + cls._integer(len(name), 7) + name + cls._integer(len(value), 7) + value

    def block(self, path: str, *extra: tuple[bytes, bytes]) -> bytes:
        fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                  (b":authority", self.target.encode()), (b"content-type", b"application/grpc"),
                  (b"te", b"trailers"), *extra]
        return b"".join(self.field(k, v) for k, v in fields)

    def open_call(self, stream: int, path: str, *extra: tuple[bytes, bytes], message: bytes | None = None) -> None:
        """HEADERS (in 16 KiB frames), and the request message when given (then END_STREAM)."""
        block = self.block(path, *extra)
        chunks = [block[i:i + 16384] for i in range(0, len(block), 16384)]
        out = b"".join(self.frame(0x1 if i == 0 else 0x9, 0x4 if i == len(chunks) - 1 else 0, stream, c)
                       for i, c in enumerate(chunks))
        if message is not None:
            out += self.frame(0x0, 0x1, stream, b"\x00" + struct.pack(">I", len(message)) + message)
        self.sock.sendall(out)

    @staticmethod
    def closed(connections: list[RawConnection], seconds: float) -> list[bool]:
        """Which of ``connections`` the server closes within ``seconds`` (all watched at once)."""
        gone = [False] * len(connections)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(gone):
            waiting = [c.sock for c, g in zip(connections, gone) if not g]
            ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
            for sock in ready:
                i = next(k for k, c in enumerate(connections) if c.sock is sock)
                try:
                    gone[i] = not sock.recv(65536)
                except OSError:
                    gone[i] = True
        return gone

    def closed_within(self, seconds: float) -> float | None:
        """Seconds until the server closes the connection (reading and dropping what it
        sends), or None if it is still open after ``seconds``."""
        start = time.monotonic()
        self.sock.settimeout(0.1)
        while time.monotonic() - start < seconds:
            try:
                if not self.sock.recv(65536):
                    return time.monotonic() - start
            except socket.timeout:
                continue
            except OSError:
                return time.monotonic() - start
        return None

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text("\n".join(TOKENS) + "\n", encoding="utf-8")
    return path


def backend_for_frontend(lm: Any, tokens: Path, **overrides: Any) -> RunningServer:
    """A model server as ``serve --frontend native`` runs it: the token file, and its whole
    global limit open to its one client, the front end."""
    limit = overrides.pop("max_concurrent_rpcs", 256)
    return start_server(lm, token_file=str(tokens), max_concurrent_rpcs=limit, max_rpcs_per_connection=limit,
                        max_rpcs_per_client=limit, **overrides)


@pytest.fixture(scope="module")
def backend(tiny_lm: Any, tokens: Path) -> Iterator[RunningServer]:
    running = backend_for_frontend(tiny_lm, tokens)
    yield running
    running.stop(1.0)


class Started:
    """Front ends a test starts (with the token file), stopped at its end (exit 0)."""

    def __init__(self, tokens: Path, tmp_path: Path) -> None:
        self.tokens, self.tmp_path = tokens, tmp_path
        self.running: list[Frontend] = []

    def __call__(self, backend: RunningServer, *flags: str, token_file: Path | None = None) -> Frontend:
        fe = Frontend(FRONTEND, backend.target, "--token-file", str(token_file or self.tokens),
                      *socket_flags(backend, self.tmp_path), *flags)
        self.running.append(fe)
        return fe

    def stop(self, fe: Frontend) -> str:
        code, err = fe.stop()
        assert code == 0, err
        return err


@pytest.fixture()
def frontends(driver: Path, tokens: Path, tmp_path: Path) -> Iterator[Started]:  # noqa: F811
    started = Started(tokens, tmp_path)
    yield started
    for fe in started.running:
        if fe.proc.poll() is None:
            started.stop(fe)


def own_channel(target: str) -> grpc.Channel:
    """A channel on a TCP connection of its own."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def scores(target: str, tiny_lm: Any, metadata: Any = OTHER) -> None:
    """An authorised client on a connection of its own gets the model's scores."""
    rows = dev_ngrams(tiny_lm, 0, 2)[:3]
    with own_channel(target) as ch:
        got = lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(packed(rows, log_base=lm_pb2.LN), metadata=metadata,
                                                             timeout=10).log_probs
    np.testing.assert_allclose(got, tiny_lm.score_ngrams(rows.astype(np.int64)), rtol=0, atol=1e-5)


def health(target: str) -> int:
    with own_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE),  # type: ignore[no-any-return]
                                                    timeout=5).status


def vm_rss_mb(pid: int) -> float:
    value = resident_bytes(pid)
    assert value is not None, f"no VmRSS in /proc/{pid}/status"
    return value / 2**20


def watch_flood(fe: Frontend, connections: int, streams: int) -> float:
    """``connections`` connections with ``streams`` health Watch streams each, all answered
    SERVING, then cancelled and closed; the front end's resident MiB while they were held."""

    async def flood() -> float:
        channels = [grpc.aio.insecure_channel(fe.target, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(connections)]
        try:
            held = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
                    for ch in channels for _ in range(streams)]
            first = await asyncio.gather(*(s.read() for s in held))
            assert all(m.status == health_pb2.HealthCheckResponse.SERVING for m in first)
            rss = vm_rss_mb(fe.proc.pid)
            for s in held:
                s.cancel()
            return rss
        finally:
            await asyncio.gather(*(ch.close() for ch in channels))

    return asyncio.run(flood())


def flood_and_return(fe: Frontend, tiny_lm: Any, *, settle: float, connections: int, streams: int,
                     within_mb: float, seconds: float) -> None:
    """A client served, ``settle`` s, then :func:`watch_flood`: the flood takes the front end
    more than 10 MiB, and within ``seconds`` its resident memory is back within
    ``within_mb`` of where it was before it; a client is served after."""
    scores(fe.target, tiny_lm)
    time.sleep(settle)
    base = vm_rss_mb(fe.proc.pid)
    held = watch_flood(fe, connections=connections, streams=streams)
    wait_for_rss_below(fe, base + within_mb, seconds=seconds)
    assert held - base > 10, (base, held)  # the flood was held
    assert vm_rss_mb(fe.proc.pid) - base < within_mb, (base, held, vm_rss_mb(fe.proc.pid))
    scores(fe.target, tiny_lm)


def wait_for_rss_below(fe: Frontend, mb: float, seconds: float) -> None:
    """Returns once the front end's resident memory is under ``mb`` MiB, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while vm_rss_mb(fe.proc.pid) >= mb and time.monotonic() < deadline:
        time.sleep(0.2)


async def never_sends(stop: asyncio.Event) -> AsyncIterator[bytes]:
    await stop.wait()
    if False:  # pragma: no cover (an async generator that yields nothing)
        yield b""


def half_open_codes(target: str, metadata: Any, calls: int, timeout: float) -> list[str]:
    """Codes of ``calls`` ScoreNgrams calls on one connection whose request never comes."""

    async def run() -> list[str]:
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(target) as ch:
            method = ch.stream_unary(SCORE)
            pending = [method(never_sends(stop), metadata=metadata, timeout=timeout) for _ in range(calls)]
            codes = [code if code == "OK" else f"{code}:{details}" for code, details in await ended(pending)]
            stop.set()
            return codes

    return asyncio.run(run())


# ---------------------------------------------------------------------- tokens, messages
def test_calls_without_a_valid_token_end_before_their_message(frontends: Started, backend: RunningServer,
                                                              tiny_lm: Any) -> None:
    """200 ScoreNgrams calls whose message never comes, without a token or with a wrong
    one: each ends UNAUTHENTICATED from its metadata at once (the old front end held them
    until their deadline); every token of the file is accepted."""
    fe = frontends(backend)
    start = time.monotonic()
    codes = half_open_codes(fe.target, (), 100, 8.0)
    codes += half_open_codes(fe.target, (("authorization", "Bearer not-a-token"),), 100, 8.0)
    assert {c.split(":")[0] for c in codes} == {"UNAUTHENTICATED"}, set(codes)
    assert time.monotonic() - start < 6.0
    scores(fe.target, tiny_lm, AUTH)
    scores(fe.target, tiny_lm, OTHER)


def test_the_token_file_is_read_again_on_sighup(frontends: Started, backend: RunningServer, tmp_path: Path) -> None:
    """SIGHUP: the front end's own check takes the file's new tokens; a file that became
    unusable keeps the tokens in force. (A call with an accepted token waits for its
    message and meets the first-message deadline; a refused one ends UNAUTHENTICATED.)"""
    path = tmp_path / "rotating"
    path.write_text(TOKENS[0] + "\n", encoding="utf-8")
    fe = frontends(backend, "--first-message-ms", "300", token_file=path)

    def outcome(metadata: Any) -> str:
        return half_open_codes(fe.target, metadata, 1, 5.0)[0].split(":")[0]

    assert (outcome(AUTH), outcome(OTHER)) == ("DEADLINE_EXCEEDED", "UNAUTHENTICATED")
    path.write_text(TOKENS[1] + "\n", encoding="utf-8")
    fe.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while outcome(OTHER) != "DEADLINE_EXCEEDED" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (outcome(AUTH), outcome(OTHER)) == ("UNAUTHENTICATED", "DEADLINE_EXCEEDED")
    path.write_text("not a token\n", encoding="utf-8")
    fe.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert (outcome(AUTH), outcome(OTHER)) == ("UNAUTHENTICATED", "DEADLINE_EXCEEDED")
    err = frontends.stop(fe)
    assert "printable ASCII" in err and "previous tokens stay" in err


def test_sigusr1_logs_the_heap_and_the_front_end_serves_on(frontends: Started, backend: RunningServer,
                                                           tiny_lm: Any) -> None:
    """SIGUSR1: one log line with malloc's heap in use, its free part and the resident size
    (what tells a leak from freed pages the system has not had back), and the front end
    goes on serving; the same line after its drain."""
    fe = frontends(backend)
    scores(fe.target, tiny_lm)
    fe.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    resident = vm_rss_mb(fe.proc.pid)
    assert fe.proc.poll() is None
    scores(fe.target, tiny_lm)
    err = frontends.stop(fe)
    heap = re.findall(r"(got SIGUSR1|drained): heap: ([0-9.]+) MiB in use, ([0-9.]+) MiB free, ([0-9.]+) MiB resident",
                      err)
    assert [when for when, *_ in heap] == ["got SIGUSR1", "drained"], err
    in_use, free, reported = (float(v) for v in heap[0][1:])
    assert 0 < in_use < reported and free >= 0
    assert abs(reported - resident) < 0.2 * resident, (reported, resident)


def test_a_message_that_does_not_parse_is_invalid_argument(frontends: Started, backend: RunningServer) -> None:
    """A request message that is not the method's (a length-delimited field cut short) is
    INVALID_ARGUMENT with a message, for ScoreNgrams and for a forwarded method alike."""
    fe = frontends(backend)
    with own_channel(fe.target) as ch:
        for method in (SCORE, "/nlmserve.v1.LanguageModel/ScoreSentences"):
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(method)(b"\x0a\xff\xff\xff\x0f", metadata=AUTH, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "does not parse" in (err.value.details() or "")


def test_calls_held_without_their_message_are_cut_and_bounded(frontends: Started, backend: RunningServer,
                                                              tiny_lm: Any) -> None:
    """An authorised call whose message never comes ends DEADLINE_EXCEEDED at
    --first-message-ms; and of 40 such calls on one connection only
    --max-rpcs-per-connection wait: each newer one cuts the one that has waited longest
    (RESOURCE_EXHAUSTED, as a refusal by a limit)."""
    fe = frontends(backend, "--first-message-ms", "1500", "--max-rpcs-per-connection", "4")
    start = time.monotonic()
    codes = half_open_codes(fe.target, AUTH, 40, 10.0)
    assert time.monotonic() - start < 6.0
    timed_out = [c for c in codes if c.startswith("DEADLINE_EXCEEDED:") and "--first-message-ms" in c]
    cut = [c for c in codes if c == "RESOURCE_EXHAUSTED:cut for a newer call: 4 calls on this connection were "
           "waiting for their request message (--max-rpcs-per-connection 4); a client sends it with the call's "
           "headers; retry later"]
    assert (len(timed_out), len(cut)) == (4, 36), codes
    scores(fe.target, tiny_lm)


def test_health_calls_held_open_never_keep_out_a_probe(frontends: Started, backend: RunningServer) -> None:
    """Health calls whose message never comes (no token needed): at most
    --max-health-watches-per-connection (4 here) wait on one connection and
    --max-health-watches (16) in all; each newer one cuts the one that has waited longest,
    so a probe's Check on a new connection is answered however many are held open (the
    front end refused it RESOURCE_EXHAUSTED once 1,024 were)."""
    fe = frontends(backend, "--max-health-watches", "16", "--max-health-watches-per-connection", "4")

    async def run() -> tuple[list[str], str]:
        stop = asyncio.Event()
        channels = [grpc.aio.insecure_channel(fe.target, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(10)]
        held = [ch.stream_unary("/grpc.health.v1.Health/Check")(never_sends(stop), timeout=30)
                for ch in channels for _ in range(6)]  # 60: 2 beyond each connection's 4, 24 beyond all 16
        await asyncio.sleep(1.0)
        async with grpc.aio.insecure_channel(fe.target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            answer = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        for _ in range(100):  # the probe's victim is told on its own connection
            if sum(c.done() for c in held) > 44:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # (and nothing more is cut)
        codes = [f"{code}:{details}" for code, details in await ended([c for c in held if c.done()])]
        stop.set()
        await asyncio.gather(*(c.close() for c in channels))
        return codes, health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    codes, probe = asyncio.run(run())
    assert probe == "SERVING"
    # 60 held open, 16 may wait: 44 cut, and one more for the probe
    assert len(codes) == 45, codes
    kinds = {"RESOURCE_EXHAUSTED:cut for a newer call: 4 health calls on this connection were waiting for their "
             "request message (--max-health-watches-per-connection 4); a client sends it with the call's headers; "
             "retry later",
             "RESOURCE_EXHAUSTED:cut for a newer call: 16 health calls in all were waiting for their request message "
             "(--max-health-watches 16); a client sends it with the call's headers; retry later"}
    assert set(codes) <= kinds, set(codes) - kinds
    # at most 40 can wait on their connections (4 each): the bound in all cut some, whatever the order
    assert any("in all" in c for c in codes), codes


# ---------------------------------------------------------------------- memory
def test_a_gzip_bomb_is_refused_without_being_inflated(frontends: Started, backend: RunningServer) -> None:
    """48 MiB of zeros sent gzip-compressed (about 48 KiB on the wire, under the message
    limit once inflated): refused, and the front end's resident memory never grows by the
    inflated size (the old front end inflated it, then sent it on)."""
    fe = frontends(backend)
    bomb = lm_pb2.ScoreNgramsRequest(packed_ids=bytes(48 << 20), packed_order=4)
    base = vm_rss_mb(fe.proc.pid)
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], vm_rss_mb(fe.proc.pid))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with grpc.insecure_channel(fe.target, compression=grpc.Compression.Gzip,
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams(bomb, metadata=AUTH, timeout=30)
        time.sleep(0.3)
    finally:
        done.set()
        watcher.join()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "gzip" in (err.value.details() or "")
    assert peak[0] - base < 16, (base, peak[0])


def test_half_open_calls_with_large_metadata_hold_no_memory(frontends: Started, backend: RunningServer,
                                                            tiny_lm: Any) -> None:
    """200 authorised calls with 512 KiB of metadata each, on connections that never
    acknowledge the server's settings (so gRPC 1.51 applies no metadata limit) and never
    send a message: each is refused as it arrives, and the front end keeps well under the
    100 MiB they carry (the old front end held them all)."""
    fe = frontends(backend)
    base = vm_rss_mb(fe.proc.pid)
    pad = (b"x-pad", b"a" * (512 << 10))
    token = (b"authorization", f"Bearer {TOKENS[0]}".encode())
    connections = [RawConnection(fe.target) for _ in range(4)]
    try:
        for c in connections:
            for i in range(50):
                c.open_call(1 + 2 * i, SCORE, token, pad)
        time.sleep(1.0)
        grown = vm_rss_mb(fe.proc.pid) - base
        scores(fe.target, tiny_lm)
    finally:
        for c in connections:
            c.close()
    assert grown < 50, grown


def test_an_unfinished_header_block_is_shed_at_the_memory_limit(frontends: Started, backend: RunningServer,
                                                                tiny_lm: Any) -> None:
    """One header block sent without end (CONTINUATION frames of 16 KB fields) on a
    connection that never acknowledges the server's settings: gRPC 1.51 buffers it without
    bound, so the front end sheds the connection once its heap passes --max-memory-mb
    (the old one took all 192 MiB and kept them)."""
    fe = frontends(backend, "--max-memory-mb", "48")
    attacker = RawConnection(fe.target)
    attacker.sock.sendall(attacker.frame(0x1, 0, 1, attacker.block(SCORE)))
    chunk = b"".join(attacker.frame(0x9, 0, 1, attacker.field(b"x-pad", b"a" * 16000)) for _ in range(64))
    sent, shed = 0, False
    try:
        while sent < 192 << 20:
            attacker.sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        shed = True
    finally:
        attacker.close()
    assert shed and sent < 160 << 20, sent
    time.sleep(0.3)
    assert vm_rss_mb(fe.proc.pid) < 200
    scores(fe.target, tiny_lm)
    assert "max_memory" in frontends.stop(fe)


def test_memory_goes_back_once_a_flood_of_watch_streams_leaves(frontends: Started, backend: RunningServer,
                                                               tiny_lm: Any) -> None:
    """1,000 health Watch streams (125 connections x 8) take the front end some 20 MiB;
    once they leave, its resident memory is back within 5 MiB of where it started in a few
    seconds (the old front end kept every stream's memory in its list of watchers until the
    next health change, and trimmed its heaps only past 64 MiB kept: about 23 MiB stayed)."""
    flood_and_return(frontends(backend), tiny_lm, settle=0.5, connections=125, streams=8, within_mb=5, seconds=5.0)


def test_memory_goes_back_once_a_flood_of_connections_leaves(frontends: Started, backend: RunningServer,
                                                            tiny_lm: Any) -> None:
    """1,000 connections at once, each with a health Watch stream, take the front end some 30
    MiB; once they close, its resident memory is back within 2 MiB of where it started in a
    few seconds, on gRPC's default poller (epoll1). That poller keeps a record of every
    connection it has seen for reuse; made during the flood, each held a page of the freed
    heap resident (+4-5 MiB after 1,000, which fails this) until the front end made them all
    at start (poller.h). With glibc's fast bins, the trim could also leave the free top of a
    gRPC thread's arena resident (+3-14 MiB in some starts; memory.h). The front end also
    used to remember each closed connection until its descriptor number was reused, and
    trimmed its heaps only past 4 MiB kept."""
    with open_files(1000):  # settle: a trim after the first call
        flood_and_return(frontends(backend), tiny_lm, settle=1.5, connections=1000, streams=1, within_mb=2,
                         seconds=10.0)


def test_the_pollers_connection_records_are_made_at_start(frontends: Started, backend: RunningServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Before it listens, the front end makes epoll1's records of every connection it may
    hold at once (--max-connections, and two accept queues that gRPC accepts before the cap
    closes them) and says so; gRPC's poll engine frees its own, and nothing is made."""
    queue = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 100 + 2 * queue + 64:
        pytest.skip("the open-files hard limit is below two accept queues: the front end lowers both")
    err = frontends.stop(frontends(backend, "--max-connections", "100"))
    assert f"epoll1 poller: records for {100 + 2 * queue} connections made at start" in err, err[-2000:]
    monkeypatch.setenv("GRPC_POLL_STRATEGY", "poll")
    fe = frontends(backend)
    assert health(fe.target) == health_pb2.HealthCheckResponse.SERVING
    assert "made at start" not in frontends.stop(fe)


# ---------------------------------------------------------------------- the batcher
def test_expired_and_cancelled_requests_are_dropped_before_batching(frontends: Started, backend: RunningServer,
                                                                    tiny_lm: Any) -> None:
    """While a batch is held at the model, 5 requests whose 300 ms deadline passes in the
    queue and one its client cancels are dropped, never sent: the model server counts only
    the held request and a later one (the old front end merged and scored all 8)."""
    fe = frontends(backend)
    rows = dev_ngrams(tiny_lm, 0, 2)
    gated = GatedScorer(backend.engine.scorer)
    backend.engine.scorer = gated  # type: ignore[assignment]
    before = backend_requests(backend, "OK")
    try:
        with own_channel(fe.target) as ch:
            score = lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams
            held = score.future(packed(rows[:1]), metadata=AUTH, timeout=10)
            assert gated.entered.wait(10)
            expiring = [score.future(packed(rows[1 + i:2 + i]), metadata=AUTH, timeout=0.3) for i in range(5)]
            cancelled = score.future(packed(rows[6:7]), metadata=AUTH, timeout=10)
            time.sleep(0.2)
            cancelled.cancel()
            time.sleep(0.5)
            later = score.future(packed(rows[7:8]), metadata=AUTH, timeout=10)
            time.sleep(0.2)
            gated.gate.set()
            assert len(held.result().log_probs) == len(later.result().log_probs) == 1
            for f in expiring:
                assert f.exception().code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert cancelled.cancelled()
    finally:
        gated.gate.set()
        backend.engine.scorer = gated.scorer  # type: ignore[assignment]
    assert backend_requests(backend, "OK") - before == 2
    assert "6 dropped unsent" in frontends.stop(fe)


def test_a_request_sent_alone_is_cancelled_at_the_model_when_its_client_leaves(
        frontends: Started, backend: RunningServer, tiny_lm: Any) -> None:
    """A request larger than a batch goes to the model server alone; its client cancels
    while the model holds it: the front end cancels it there too (the model server counts
    it CANCELLED before the model is let go), instead of having it scored for nobody."""
    fe = frontends(backend, "--max-batch-ngrams", "16")
    rows = np.tile(dev_ngrams(tiny_lm, 0, 2), (8, 1))[:64]
    gated = GatedScorer(backend.engine.scorer)
    backend.engine.scorer = gated  # type: ignore[assignment]
    before = backend_requests(backend, "CANCELLED")
    try:
        with own_channel(fe.target) as ch:
            call = lm_pb2_grpc.LanguageModelStub(ch).ScoreNgrams.future(packed(rows), metadata=AUTH, timeout=10)
            assert gated.entered.wait(10)
            call.cancel()
            deadline = time.monotonic() + 5
            while backend_requests(backend, "CANCELLED") == before and time.monotonic() < deadline:
                time.sleep(0.05)
            counted = backend_requests(backend, "CANCELLED") - before
    finally:
        gated.gate.set()
        backend.engine.scorer = gated.scorer  # type: ignore[assignment]
    assert counted == 1


# ---------------------------------------------------------------------- slots
def test_streams_a_client_does_not_read_lose_their_slots_and_health_stays_serving(
        frontends: Started, tiny_lm: Any, tokens: Path) -> None:
    """4 GetScoringTables streams on a connection that lets the server send nothing (a 0
    byte window) hold every slot of --max-concurrent-rpcs 4: another client is refused
    RESOURCE_EXHAUSTED, the front end's health stays SERVING (its probe is the model
    server's Health/Check, which takes no slot), and after --stream-write-timeout-ms the
    streams are cut and the other client served (the old front end reported NOT_SERVING
    and kept the streams)."""
    running = backend_for_frontend(tiny_lm, tokens, max_concurrent_rpcs=4)
    try:
        fe = frontends(running, "--max-concurrent-rpcs", "4", "--max-rpcs-per-client", "4",
                       "--stream-write-timeout-ms", "1500")
        attacker = RawConnection(fe.target, initial_window=0)
        request = lm_pb2.GetScoringTablesRequest(chunk_floats=1000).SerializeToString()
        for i in range(4):
            attacker.open_call(1 + 2 * i, "/nlmserve.v1.LanguageModel/GetScoringTables",
                               (b"authorization", f"Bearer {TOKENS[0]}".encode()), message=request)
        time.sleep(0.5)
        with own_channel(fe.target) as ch, pytest.raises(grpc.RpcError) as err:
            lm_pb2_grpc.LanguageModelStub(ch).GetModelInfo(lm_pb2.GetModelInfoRequest(), metadata=OTHER, timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(1.2)  # the front end's probe runs once a second
        assert health(fe.target) == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 5
        while True:
            try:
                scores(fe.target, tiny_lm)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        attacker.close()
        assert "stream_write_timeout" in frontends.stop(fe)
    finally:
        running.stop(0.5)


def test_answers_waiting_in_grpc_hold_no_slot_but_their_clients_share(frontends: Started, backend: RunningServer,
                                                                       tiny_lm: Any) -> None:
    """4 ScoreNgrams calls of one token answered on a connection that lets the server send
    nothing (a 0 byte window): their answers wait in gRPC until --stream-write-timeout-ms.
    The calls are over for the front end and hold none of --max-concurrent-rpcs 4, so
    another client is served at once (the front end once kept each slot until gRPC let the
    call go, which under load lags the answer by seconds); but each counts against its
    client's --max-rpcs-per-client 4 until gRPC lets it go, so the same client's next call
    is refused RESOURCE_EXHAUSTED naming the flag (the front end let such answers pile up
    beyond the share), and is served once the unread connection has gone."""
    fe = frontends(backend, "--max-concurrent-rpcs", "4", "--max-rpcs-per-client", "4",
                   "--stream-write-timeout-ms", "8000")
    attacker = RawConnection(fe.target, initial_window=0)
    request = packed(dev_ngrams(tiny_lm, 0, 2)[:3]).SerializeToString()
    try:
        for i in range(4):
            attacker.open_call(1 + 2 * i, SCORE, (b"authorization", f"Bearer {TOKENS[0]}".encode()), message=request)
        time.sleep(1.0)
        scores(fe.target, tiny_lm, OTHER)
        with pytest.raises(grpc.RpcError) as err:
            scores(fe.target, tiny_lm, AUTH)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-rpcs-per-client 4" in (err.value.details() or ""), err.value.details()
    finally:
        attacker.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            scores(fe.target, tiny_lm, AUTH)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
            time.sleep(0.2)


def test_answers_waiting_unread_keep_little_and_end_at_the_write_timeout(frontends: Started, backend: RunningServer,
                                                                         tiny_lm: Any, loop: Loop) -> None:
    """A token holder that never reads (a receive window of 0) has 280 ScoreNgrams calls of
    3,000 n-grams answered, whose answers then wait in gRPC: the front end holds under 60
    KiB per waiting answer (12 KB each; about 35 KiB measured; it used to keep each call's
    request bytes, parsed request and parsed response too: about 170 KiB), and ends them
    DEADLINE_EXCEEDED at --stream-write-timeout-ms; another client is served meanwhile."""
    fe = frontends(backend, "--max-concurrent-rpcs", "512", "--max-rpcs-per-connection", "512",
                   "--max-rpcs-per-client", "512", "--stream-write-timeout-ms", "3000")
    rows = np.resize(dev_ngrams(tiny_lm, 0, 40), (3000, 5))
    scores(fe.target, tiny_lm)
    time.sleep(1.5)  # a trim after the first call
    base = vm_rss_mb(fe.proc.pid)
    outcomes, conn = loop.run(unread_calls(int(fe.target.rsplit(":", 1)[1]), SCORE, TOKENS[0],
                                           packed(rows).SerializeToString(), 280), timeout=60)
    try:
        held = vm_rss_mb(fe.proc.pid)
        assert outcomes == ["held"] * 280, Counter(outcomes)
        assert held - base < 280 * 60 / 1024, (base, held)
        scores(fe.target, tiny_lm)
        ends = loop.run(ended_calls(conn, 280), timeout=30)
        assert ends == Counter({"DEADLINE_EXCEEDED": 280}), ends
    finally:
        loop.run(closed(conn))
    assert "stream_write_timeout" in frontends.stop(fe)


async def ended_calls(conn: Any, calls: int) -> Counter[str]:
    """How the server ends ``calls`` calls on ``conn`` (their trailers), read until all have."""
    ends: Counter[str] = Counter()
    seen: set[int] = set()
    while len(seen) < calls:
        _, _, stream, _, how = await conn.exchange(20)
        if how is not None and not how.startswith("RST_STREAM") and stream not in seen:
            seen.add(stream)
            ends[how] += 1
    return ends


def test_one_connection_and_one_client_hold_only_their_share(frontends: Started, backend: RunningServer,
                                                             tiny_lm: Any) -> None:
    """While the model holds a batch, one connection may hold --max-rpcs-per-connection 2
    calls and one token --max-rpcs-per-client 3 over all its connections; beyond them
    RESOURCE_EXHAUSTED naming the limit, while another token is still admitted."""
    fe = frontends(backend, "--max-rpcs-per-connection", "2", "--max-rpcs-per-client", "3")
    rows = dev_ngrams(tiny_lm, 0, 2)
    gated = GatedScorer(backend.engine.scorer)
    backend.engine.scorer = gated  # type: ignore[assignment]
    try:
        with own_channel(fe.target) as a, own_channel(fe.target) as b, own_channel(fe.target) as c:
            on_a, on_b = lm_pb2_grpc.LanguageModelStub(a).ScoreNgrams, lm_pb2_grpc.LanguageModelStub(b).ScoreNgrams
            held = [on_a.future(packed(rows[:1]), metadata=AUTH, timeout=10)]
            assert gated.entered.wait(10)
            held.append(on_a.future(packed(rows[1:2]), metadata=AUTH, timeout=10))
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as per_connection:
                on_a(packed(rows[2:3]), metadata=AUTH, timeout=10)
            held.append(on_b.future(packed(rows[3:4]), metadata=AUTH, timeout=10))
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as per_client:
                on_b(packed(rows[4:5]), metadata=AUTH, timeout=10)
            other = lm_pb2_grpc.LanguageModelStub(c).ScoreNgrams.future(packed(rows[5:6]), metadata=OTHER, timeout=10)
            time.sleep(0.3)
            gated.gate.set()
            assert all(len(f.result().log_probs) == 1 for f in [*held, other])
    finally:
        gated.gate.set()
        backend.engine.scorer = gated.scorer  # type: ignore[assignment]
    assert per_connection.value.code() == per_client.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-rpcs-per-connection 2" in (per_connection.value.details() or "")
    assert "--max-rpcs-per-client 3" in (per_client.value.details() or "")


def test_health_watch_streams_beyond_their_pool_end_unimplemented(frontends: Started, backend: RunningServer) -> None:
    """Watch streams are open without a token, so they have a pool of their own: beyond
    --max-health-watches-per-connection a Watch ends UNIMPLEMENTED (a gRPC client's own
    health checking then counts the server healthy), Check still answers."""
    fe = frontends(backend, "--max-health-watches-per-connection", "3")
    with own_channel(fe.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        held = [stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10) for _ in range(3)]
        assert [next(w).status for w in held] == [health_pb2.HealthCheckResponse.SERVING] * 3
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
        for w in held:
            w.cancel()


# ---------------------------------------------------------------------- connections
def test_silent_and_stalled_connections_are_closed(frontends: Started, backend: RunningServer) -> None:
    """A connection that never sends the HTTP/2 preface is closed at --handshake-timeout-ms;
    one that stops inside a header block (it then cannot answer a keepalive ping) at
    --keepalive-ms plus --keepalive-timeout-ms. The old front end kept both."""
    fe = frontends(backend, "--handshake-timeout-ms", "500", "--keepalive-ms", "1000", "--keepalive-timeout-ms", "500")
    silent = RawConnection(fe.target, preface=False)
    stalled = RawConnection(fe.target)
    stalled.sock.sendall(stalled.frame(0x1, 0, 1, stalled.block(SCORE)[:40]))  # no END_HEADERS
    try:
        assert (silent.closed_within(3.0) or 99) < 3.0
        assert (stalled.closed_within(4.0) or 99) < 4.0
    finally:
        silent.close()
        stalled.close()


def test_a_connection_that_resets_its_calls_as_they_begin_is_closed(frontends: Started, backend: RunningServer,
                                                                    tiny_lm: Any) -> None:
    """HTTP/2 rapid reset: 2,000 ScoreNgrams HEADERS each followed at once by its
    RST_STREAM, without a token, on one connection. gRPC 1.51 forgets a reset stream at
    once, so its stream limit never stops them; the front end closes the connection once
    half of its calls were reset as they began (Envoy's rule), and another client is served
    (the old front end kept the connection and took every call: about 200 MiB for 10,000)."""
    fe = frontends(backend)
    attacker = RawConnection(fe.target)
    block = attacker.block(SCORE)
    cancel = struct.pack(">I", 8)
    try:
        attacker.sock.sendall(b"".join(attacker.frame(0x1, 0x4, 1 + 2 * i, block) + attacker.frame(0x3, 0, 1 + 2 * i, cancel)
                                       for i in range(2000)))
        assert (attacker.closed_within(10.0) or 99) < 10.0
    finally:
        attacker.close()
    scores(fe.target, tiny_lm)
    assert "premature_resets" in frontends.stop(fe)


def test_connections_beyond_the_cap_are_closed(frontends: Started, backend: RunningServer, tiny_lm: Any) -> None:
    """Of 10 connections, --max-connections 5 are kept and the others closed at once; once
    some leave, a new client is served."""
    fe = frontends(backend, "--max-connections", "5")
    connections = [RawConnection(fe.target) for _ in range(10)]
    try:
        closed = RawConnection.closed(connections, 0.5)
        assert sum(closed) == 5, closed
        for c in [c for c, gone in zip(connections, closed) if not gone][:2]:
            c.close()
        time.sleep(0.2)
        scores(fe.target, tiny_lm)
    finally:
        for c in connections:
            c.close()
    assert "5 max_connections" in frontends.stop(fe)


def test_a_connection_flood_past_the_file_limit_leaves_the_port_open(driver: Path, backend: RunningServer,  # noqa: F811
                                                                     tokens: Path, tmp_path: Path,
                                                                     tiny_lm: Any) -> None:
    """A front end whose open-files limit is 256 keeps its connections and its accept queue
    under it: of 300 connections at once those beyond its room are refused or wait in the
    kernel, and once they leave a client is served (gRPC 1.51 stops accepting on a port for
    good when accept() runs out of descriptors, which the old front end let happen)."""

    def low_file_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.Popen([str(FRONTEND), "--backend", backend.target, "--listen", "127.0.0.1:0",
                             "--token-file", str(tokens), *socket_flags(backend, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=low_file_limit)
    try:
        assert proc.stdout is not None
        target = proc.stdout.readline().split()[-1]
        host, port = target.rsplit(":", 1)
        flood = []
        for _ in range(300):  # connects started at once, not waited for
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((host, int(port)))
            flood.append(sock)
        time.sleep(1.0)
        for sock in flood:
            sock.close()
        time.sleep(0.5)
        scores(target, tiny_lm)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "the open-files limit (256) leaves room for 96 connections and 48 queued ones" in err


# ---------------------------------------------------------------------- serve
def test_serve_passes_its_guards_and_sighup_to_the_front_end(driver: Path, tiny_model_path: Path,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """`nlmserve serve --frontend native`: the front end applies the server's
    --first-message-seconds itself, and serve's SIGHUP makes it read the token file again."""
    path = tmp_path / "tokens"
    path.write_text(TOKENS[0] + "\n", encoding="utf-8")
    server = serve_subprocess(tiny_model_path, "--frontend", "native", "--frontend-binary", str(FRONTEND),
                              "--token-file", str(path), "--first-message-seconds", "0.4",
                              log=tmp_path / "serve.log", command=SERVE)
    try:
        codes = half_open_codes(server.target, AUTH, 1, 5.0)
        assert codes[0].startswith("DEADLINE_EXCEEDED:") and "--first-message-ms" in codes[0], codes
        assert half_open_codes(server.target, OTHER, 1, 5.0)[0].startswith("UNAUTHENTICATED:")
        path.write_text(TOKENS[1] + "\n", encoding="utf-8")
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not half_open_codes(server.target, OTHER, 1, 5.0)[0].startswith("DEADLINE_EXCEEDED:"):
            assert time.monotonic() < deadline, "the new token was not taken"
            time.sleep(0.2)
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
    assert server.process.returncode == 0


def test_serve_logs_both_heaps_on_sigusr1(tiny_model_path: Path, tmp_path: Path) -> None:  # noqa: F811
    """`nlmserve serve --frontend native` on SIGUSR1: the model server and the front end
    each log their heap, and serving goes on to a clean drain."""
    server = serve_subprocess(tiny_model_path, "--frontend", "native", "--frontend-binary", str(FRONTEND),
                              log=tmp_path / "serve.log")
    heap = r": heap: [0-9.]+ MiB in use, [0-9.]+ MiB free, [0-9.]+ MiB resident"
    try:
        server.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not (re.search(r"nlmserve\.server\.app: received SIGUSR1" + heap,
                             log := (tmp_path / "serve.log").read_text())
                   and re.search(r"nlmserve\.server\.frontend: got SIGUSR1" + heap, log)):
            assert time.monotonic() < deadline and server.process.poll() is None, log[-2000:]
            time.sleep(0.2)
        assert health(server.target) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
    assert server.process.returncode == 0
    assert re.search(r"nlmserve\.server\.frontend: drained" + heap, (tmp_path / "serve.log").read_text())
