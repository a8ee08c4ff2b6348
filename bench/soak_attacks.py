"""The soak's hostile clients (bench/soak.py), each bounded in what it holds and how fast it
comes back, all on 127.0.0.1, each counting what it got.

Most speak gRPC through grpcio; those that need what no gRPC client sends (a header block
before the SETTINGS acknowledgement, HEADERS + RST_STREAM bursts, a zero receive window,
a connection that stops inside its preface) write HTTP/2 frames on a socket themselves
(bench/soak_h2_attacks.py); what they share is in bench/soak_hostile.py. A vanishing client is a process of its own killed with SIGKILL while its
calls are in flight: ``python -m bench.soak_attacks --vanish PORT FILE CALLS``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from bench.soak_h2_attacks import big_metadata, never_read, rapid_reset, slow
from bench.soak_hostile import CHECK, METHODS, REPO, SCORE, HostileConfig, Tally, Target, log, wait_or_stop


# ---------------------------------------------------------------------- attacks through grpcio
async def _never_sends(stop: asyncio.Event) -> AsyncIterator[bytes]:
    await stop.wait()
    if False:  # pragma: no cover (an async generator that yields nothing)
        yield b""


def _identity(b: bytes) -> bytes:
    return b


def _own_connection() -> list[tuple[str, Any]]:
    """A channel with a TCP connection of its own (gRPC otherwise shares one per address)."""
    return [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]


async def watcher(r: Target, streams: int, stop: asyncio.Event, out: Tally) -> None:
    """``streams`` health Watch streams on one connection, read until each is cut (counted by
    its code), the connection re-opened 0.5 s after they all are."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def one(stub: Any) -> None:
        first = True
        try:
            async for _ in stub.Watch(health_pb2.HealthCheckRequest()):
                if first:
                    out.counts["held"] += 1
                    first = False
        except grpc.aio.AioRpcError as e:
            if not stop.is_set():  # not the cancellation of our own stop
                out.counts[e.code().name] += 1

    while not stop.is_set():
        if not r.up.is_set():
            await wait_or_stop(stop, 0.5)
            continue
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.port}", options=_own_connection())
        stub = health_pb2_grpc.HealthStub(channel)
        held: asyncio.Future[Any] = asyncio.gather(*(one(stub) for _ in range(streams)))
        stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([held, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            await channel.close(None)  # cancels the streams still open
            await asyncio.gather(held, return_exceptions=True)
        await wait_or_stop(stop, 0.5)


async def half_open(r: Target, calls: int, stop: asyncio.Event, out: Tally, method: str = SCORE) -> None:
    """``calls`` calls of ``method`` (ScoreNgrams) without a token whose request never comes,
    on one connection, re-opened 0.2 s after they end."""
    import grpc

    channel = None
    while not stop.is_set():
        if channel is None or not r.up.is_set():
            if channel is not None:
                await channel.close(None)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.port}", options=_own_connection())
        pending = [channel.stream_unary(method, None, None)(_never_sends(stop), timeout=30) for _ in range(calls)]
        for call in pending:
            try:
                await call
                out.counts["OK"] += 1
            except grpc.aio.AioRpcError as e:
                out.counts[e.code().name] += 1
        await wait_or_stop(stop, 0.2)
    if channel is not None:
        await channel.close(None)


async def garbage(r: Target, max_message_bytes: int, token: str, seed: int, stop: asyncio.Event,
                  out: dict[str, Tally]) -> None:
    """Every second, on three methods, without and with a token: random bytes, and a
    message over ``max_message_bytes``."""
    import grpc

    rng = random.Random(seed)
    oversized = rng.randbytes(max_message_bytes + 1024)
    while not stop.is_set():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.port}", options=[("grpc.max_send_message_length", -1)])
        for method in METHODS:
            for with_token in (False, True):
                for kind in ("random", "oversized"):
                    body = rng.randbytes(rng.randint(1, 4096)) if kind == "random" else oversized
                    metadata = (("authorization", f"Bearer {token}"),) if with_token else None
                    tally = out[f"{kind}{'_token' if with_token else ''}"]
                    try:
                        await channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)(
                            body, metadata=metadata, timeout=10)
                        tally.counts["OK"] += 1
                    except grpc.aio.AioRpcError as e:
                        tally.counts[e.code().name] += 1
        await channel.close(None)
        await wait_or_stop(stop, 1.0)


async def deadline_1ms(r: Target, cfg: HostileConfig, token: str, requests: list[bytes], stop: asyncio.Event,
                       out: Tally) -> None:
    """Rounds of ``deadline_calls`` concurrent ScoreNgrams calls with a token and a 1 ms
    deadline, every 0.1 s; each round's requests are of 1 to 5,000 n-grams."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),)
    rng = random.Random(len(requests))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}", options=_own_connection()) as channel:
        call = channel.unary_unary(SCORE, request_serializer=_identity, response_deserializer=_identity)
        while not stop.is_set():
            if r.up.is_set():
                results = await asyncio.gather(*(call(rng.choice(requests), metadata=metadata, timeout=0.001)
                                                 for _ in range(cfg.deadline_calls)), return_exceptions=True)
                for result in results:
                    out.counts[result.code().name if isinstance(result, grpc.aio.AioRpcError) else
                               "OK" if isinstance(result, bytes) else type(result).__name__] += 1
            await wait_or_stop(stop, 0.1)


async def invented_methods(r: Target, cfg: HostileConfig, token: str, stop: asyncio.Event, out: Tally) -> None:
    """``invented_methods`` calls, each of a method name never used before (half with the
    token, half without), at most 50 a second."""
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}", options=_own_connection()) as channel:
        for i in range(cfg.invented_methods):
            if stop.is_set():
                break
            if not r.up.is_set():
                await wait_or_stop(stop, 0.5)
                continue
            method = f"/nlmserve.v1.Invented{i}/Method{random.getrandbits(32):08x}"
            metadata = (("authorization", f"Bearer {token}"),) if i % 2 else None
            try:
                await channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)(
                    b"", metadata=metadata, timeout=10)
                out.counts["OK"] += 1
            except grpc.aio.AioRpcError as e:
                out.counts[e.code().name] += 1
            await asyncio.sleep(0.02)


def gzip_bomb(targets: Sequence[Target], cfg: HostileConfig, token: str, stop: threading.Event,
              out: dict[str, Tally]) -> None:
    """Every ``gzip_every`` s, in turn on each replica, a ScoreNgrams request of
    ``gzip_bomb_bytes`` compressed with gzip by grpcio (about 1/1,000 of it on the wire),
    without and with a token. A thread of its own: grpcio compresses on the caller's."""
    import grpc

    # ScoreNgramsRequest: packed_ids (field 2) of zeros, packed_order (field 3) 5.
    body = b"\x12" + _varint(cfg.gzip_bomb_bytes) + bytes(cfg.gzip_bomb_bytes) + b"\x18\x05"
    turn = 0
    while not stop.wait(cfg.gzip_every):
        r = targets[turn % len(targets)]
        turn += 1
        if not r.up.is_set():
            continue
        with grpc.insecure_channel(f"127.0.0.1:{r.port}", options=_own_connection()) as channel:
            call = channel.unary_unary(SCORE, request_serializer=_identity, response_deserializer=_identity)
            for name, metadata in (("gzip_bomb", None), ("gzip_bomb_token", (("authorization", f"Bearer {token}"),))):
                began = time.monotonic()
                try:
                    call(body, metadata=metadata, timeout=60, compression=grpc.Compression.Gzip)
                    out[name].counts["OK"] += 1
                except grpc.RpcError as e:
                    out[name].counts[e.code().name] += 1
                out[name].hold("answer", time.monotonic() - began)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def raw_tcp(targets: Sequence[Target], stop: threading.Event, out: Tally, seed: int) -> None:
    """Every 0.2 s on each replica a TCP connection that sends 1 to 4,096 random bytes and closes."""
    rng = random.Random(seed + 1)
    while not stop.wait(0.2):
        for r in targets:
            try:
                with socket.create_connection(("127.0.0.1", r.port), timeout=2) as s:
                    s.sendall(rng.randbytes(rng.randint(1, 4096)))
                    out.counts["sent"] += 1
            except OSError:
                out.counts["refused"] += 1


def vanishing(targets: Sequence[Target], cfg: HostileConfig, token: str, request_file: Path, stop: threading.Event,
              out: Tally) -> None:
    """Every ``vanish_every`` s, in turn on each replica, a client process that sends
    ``vanish_calls`` requests of ``vanish_ngrams`` n-grams with a token and is killed
    with SIGKILL 1 s later, its calls in flight."""
    turn = 0
    while not stop.wait(cfg.vanish_every):
        r = targets[turn % len(targets)]
        turn += 1
        if not r.up.is_set():
            continue
        env = dict(os.environ, NLMSERVE_SOAK_TOKEN=token)
        child = subprocess.Popen([sys.executable, "-m", "bench.soak_attacks", "--vanish", str(r.port),
                                  str(request_file), str(cfg.vanish_calls)], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 60
        while child.poll() is None and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.poll() is None:  # the soak stops (or the child hangs): no waiting for it
            child.kill()
            child.communicate()
            out.counts["child_stopped" if stop.is_set() else "child_timed_out"] += 1
            continue
        line, _ = child.communicate()
        if child.returncode != -signal.SIGKILL:
            out.counts[f"child_exit_{child.returncode}"] += 1
            continue
        out.counts["clients_killed"] += 1
        for item in line.split():
            code, _, n = item.partition("=")
            out.counts[code] += int(n)


def _vanish_main(port: int, request_file: Path, calls: int) -> None:
    """The vanishing client: ``calls`` copies of the request in ``request_file`` sent at
    once, then, 1 s later, what they got so far on stdout (``in_flight=N CODE=N ...``) and
    SIGKILL to itself."""
    import grpc

    body = request_file.read_bytes()
    metadata = (("authorization", f"Bearer {os.environ['NLMSERVE_SOAK_TOKEN']}"),)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_own_connection())
    call = channel.unary_unary(SCORE, request_serializer=_identity, response_deserializer=_identity)
    futures = [call.future(body, metadata=metadata, timeout=60) for _ in range(calls)]
    time.sleep(1.0)
    got: Counter[str] = Counter()
    for f in futures:
        got["in_flight" if not f.done() else "OK" if f.exception() is None else f.code().name] += 1
    print(" ".join(f"{k}={v}" for k, v in sorted(got.items())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------- all of them
class Hostile:
    """Every attack of ``cfg.attacks`` against ``targets``, started by :meth:`start` and
    stopped by :meth:`stop`; :meth:`report` gives what each got.

    The gRPC attacks run on one asyncio loop, the raw HTTP/2 ones on another, the gzip
    bombs, random TCP bytes and vanishing clients on threads of their own.
    """

    def __init__(self, targets: Sequence[Target], cfg: HostileConfig, *, token: str, max_concurrent_rpcs: int,
                 max_health_watches: int, max_message_bytes: int, requests: list[bytes], vanish_request: Path,
                 seed: int) -> None:
        self.targets, self.cfg, self.token = targets, cfg, token
        self.max_concurrent_rpcs, self.max_health_watches = max_concurrent_rpcs, max_health_watches
        self.max_message_bytes, self.requests, self.vanish_request, self.seed = (max_message_bytes, requests,
                                                                               vanish_request, seed)
        self.tallies: dict[str, Tally] = {}
        self._stop = threading.Event()
        self._loops: list[tuple[asyncio.AbstractEventLoop, threading.Thread, asyncio.Event]] = []
        self._threads: list[threading.Thread] = []

    def _tally(self, name: str) -> Tally:
        return self.tallies.setdefault(name, Tally())

    def _grpc_tasks(self, stop: asyncio.Event) -> list[Awaitable[None]]:
        on, cfg = set(self.cfg.attacks), self.cfg
        tasks: list[Awaitable[None]] = []
        for i, r in enumerate(self.targets):
            if "watch" in on:
                tasks += [watcher(r, 1, stop, self._tally("watch")) for _ in range(self.max_concurrent_rpcs)]
            if "watch_flood" in on:
                flood = self.max_health_watches // cfg.watch_per_connection + 2
                tasks += [watcher(r, cfg.watch_per_connection, stop, self._tally("watch_flood")) for _ in range(flood)]
            if "half_open" in on:
                tasks.append(half_open(r, self.max_concurrent_rpcs, stop, self._tally("half_open")))
            if "half_open_health" in on:
                flood = self.max_health_watches // cfg.watch_per_connection + 2
                tasks += [half_open(r, cfg.watch_per_connection, stop, self._tally("half_open_health"), CHECK)
                          for _ in range(flood)]
            if "garbage" in on:
                tallies = {k: self._tally(k) for k in ("random", "random_token", "oversized", "oversized_token")}
                tasks.append(garbage(r, self.max_message_bytes, self.token, self.seed + i, stop, tallies))
            if "deadline_1ms" in on:
                tasks.append(deadline_1ms(r, cfg, self.token, self.requests, stop, self._tally("deadline_1ms")))
            if "invented_methods" in on:
                tasks.append(invented_methods(r, cfg, self.token, stop, self._tally("invented_methods")))
        return tasks

    def _raw_tasks(self, stop: asyncio.Event) -> list[Awaitable[None]]:
        on, cfg = set(self.cfg.attacks), self.cfg
        tasks: list[Awaitable[None]] = []
        for r in self.targets:
            if "never_read" in on:
                tasks += [never_read(r, cfg, self.token, self.requests[2], stop, self._tally("never_read"))
                          for _ in range(cfg.never_read_connections)]
            if "rapid_reset" in on:
                tasks.append(rapid_reset(r, cfg, stop, self._tally("rapid_reset")))
            if "big_metadata" in on:
                tasks += [big_metadata(r, cfg, i % 2 == 0, stop,
                                       self._tally("big_metadata_unacked" if i % 2 == 0 else "big_metadata"))
                          for i in range(cfg.big_metadata_calls)]
            if "slow" in on:
                tasks += [slow(r, kind, stop, self._tally("slow")) for kind in ("silent", "mid_preface", "mid_header")
                          for _ in range(cfg.slow_connections)]
        return tasks

    def _loop(self, make: Callable[[asyncio.Event], list[Awaitable[None]]]) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        holder: list[asyncio.Event] = []

        async def main() -> None:
            stop = asyncio.Event()
            holder.append(stop)
            ready.set()
            results = await asyncio.gather(*make(stop), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    log.error("a hostile client ended with %r", result)
                    self._tally("errors").counts[type(result).__name__] += 1

        thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
        thread.start()
        ready.wait(10)
        self._loops.append((loop, thread, holder[0]))

    def start(self) -> None:
        on = set(self.cfg.attacks)
        self._loop(self._grpc_tasks)
        self._loop(self._raw_tasks)
        if "gzip_bomb" in on:
            tallies = {k: self._tally(k) for k in ("gzip_bomb", "gzip_bomb_token")}
            self._threads.append(threading.Thread(target=gzip_bomb, args=(self.targets, self.cfg, self.token,
                                                                          self._stop, tallies), daemon=True))
        if "raw_tcp" in on:
            self._threads.append(threading.Thread(target=raw_tcp, args=(self.targets, self._stop,
                                                                        self._tally("raw_tcp_bytes"), self.seed),
                                                  daemon=True))
        if "vanishing" in on:
            self._threads.append(threading.Thread(target=vanishing, args=(self.targets, self.cfg, self.token,
                                                                          self.vanish_request, self._stop,
                                                                          self._tally("vanishing")), daemon=True))
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Every attacker told to stop; what they still hold after ``timeout`` s is cut. Once."""
        if self._stop.is_set():
            return
        self._stop.set()
        for loop, _, stop in self._loops:
            loop.call_soon_threadsafe(stop.set)
        deadline = time.monotonic() + timeout
        for loop, thread, _ in self._loops:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():  # tasks that did not see the stop (a watcher on a quiet stream)
                loop.call_soon_threadsafe(_cancel_all, loop)
                thread.join(10)
        for t in self._threads:
            t.join(max(1.0, deadline - time.monotonic()))
        for loop, thread, _ in self._loops:
            if not thread.is_alive():
                loop.close()

    def report(self) -> dict[str, dict[str, Any]]:
        return {name: tally.summary() for name, tally in sorted(self.tallies.items())}


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--vanish":
        _vanish_main(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
    sys.exit("usage: python -m bench.soak_attacks --vanish PORT REQUEST_FILE CALLS (started by bench/soak.py)")
