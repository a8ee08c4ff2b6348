"""What each kind of call leaves allocated in the Python server: bytes of glibc's malloc in
use (``mallinfo2``, every arena, after a full garbage collection) per call, so that memory
a server keeps for good is told apart from memory it lays out and gives back.

    .venv/bin/python -m bench.heap_per_call [--model M] [--calls N] [--patterns P,..] [--json F]

A server runs in this process (``create_server``, port 0, a token file of one token,
``--first-message-seconds 0.3``, ``--stream-write-timeout-seconds 0.5``); each pattern's
calls come from a client process of their own (this module with ``--client``), at most 64
at once, in two rounds: the first makes what the server keeps for later calls of the kind
(its tables, gRPC's caches), the second is the one to read. A pattern that leaves nothing
reads a few bytes a call either way; one whose calls each keep a block reads that block's
size in the second round too.

Patterns (:data:`PATTERNS`): ``check``, ``score`` and ``large`` (8 requests of 100,000
string n-grams at once: its first round shows what the server keeps for good after such a
burst, its scorer's buffers for a full batch) are answered calls; the others are
what hostile clients do (bench/soak_hostile.py): Health/Check calls that never send their
message (``half_open_check``, ended by the first-message deadline or cut for newer ones),
ScoreNgrams without a token, ScoreNgrams cancelled after 1 ms or with a 1 ms deadline,
Watch streams cancelled after their first answer, GetScoringTables on a connection that
never reads (its receive window 0), HEADERS + RST_STREAM bursts (``rapid_reset``, 20
streams per call counted) and client processes killed with large requests in flight
(``vanishing``, one process per call counted; read 2 s after the last kill, while the
server may still be working through their queue: rough). Needs glibc (``mallinfo2``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench._common import exit_with, machine, write_json
from bench.h2 import (ACK, PREFACE, RST_STREAM, SETTINGS, frame, grpc_fields, header_block, headers_frames,
                      unread_calls)
from nlmserve.common.memory import heap_now

PATTERNS: dict[str, str] = {
    "check": "Health/Check, answered",
    "score": "ScoreNgrams of 50 n-grams, answered",
    "half_open_check": "Health/Check that never sends its message",
    "unauthenticated": "ScoreNgrams without a token, refused",
    "score_cancel": "ScoreNgrams cancelled by its client after 1 ms",
    "score_1ms": "ScoreNgrams with a 1 ms deadline",
    "watch_cancel": "Watch cancelled after its first answer",
    "never_read_tables": "GetScoringTables on a connection whose receive window is 0, closed after 1 s",
    "rapid_reset": "20 HEADERS + RST_STREAM pairs on one connection",
    "large": "ScoreNgrams of 100,000 n-grams, 8 at once, answered",
    "vanishing": "a client process killed 1.5 s after sending 8 ScoreNgrams of 100,000 n-grams",
}
CONCURRENT = 64
#: The server's one token; every pattern but ``unauthenticated`` and health calls sends it.
TOKEN = "heap-per-call-token"
RESETS_PER_CALL = 20
LARGE_NGRAMS = 100_000
LARGE_AT_ONCE = 8
LARGE_TRIES = 5


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back, in every arena and mapping, after a
    full garbage collection and a moment for the server's threads to finish."""
    gc.collect()
    time.sleep(2.0)
    gc.collect()
    heap = heap_now()
    assert heap is not None, "needs glibc's mallinfo2 (checked at start)"
    return heap[0]


# ---------------------------------------------------------------------- the client process
async def _calls(target: str, pattern: str, calls: int) -> None:
    from nlmserve.proto import lm_pb2

    same = lambda b: b  # noqa: E731  # raw bytes both ways
    request = lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["the", "house", "is"])] * 50)
    raw = request.SerializeToString()

    async def never() -> Any:
        await asyncio.sleep(3600)
        yield b""

    held = asyncio.Semaphore(CONCURRENT)
    port = int(target.rpartition(":")[2])
    bearer = (("authorization", f"Bearer {TOKEN}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", same, same)
        half_open = channel.stream_stream("/grpc.health.v1.Health/Check", same, same)
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch", same, same)
        score = channel.unary_unary("/nlmserve.v1.LanguageModel/ScoreNgrams", same, same)

        async def one() -> None:
            async with held:
                try:
                    if pattern == "check":
                        await check(b"")
                    elif pattern == "score":
                        await score(raw, metadata=bearer)
                    elif pattern == "unauthenticated":
                        await score(raw)
                    elif pattern == "half_open_check":
                        async for _ in half_open(never()):
                            pass
                    elif pattern == "score_cancel":
                        call = score(raw, metadata=bearer)
                        await asyncio.sleep(0.001)
                        call.cancel()
                    elif pattern == "score_1ms":
                        await score(raw, timeout=0.001, metadata=bearer)
                    elif pattern == "watch_cancel":
                        stream = watch(b"")
                        async for _ in stream:
                            break
                        stream.cancel()
                    elif pattern == "never_read_tables":
                        _, conn = await unread_calls(port, "/nlmserve.v1.LanguageModel/GetScoringTables", TOKEN,
                                                     b"", 1)
                        await asyncio.sleep(1.0)  # past the write timeout: the server ends the call
                        conn.close()
                except grpc.RpcError:
                    pass

        await asyncio.gather(*(one() for _ in range(calls)))


def _rapid_reset(target: str, calls: int) -> None:
    host, _, port = target.rpartition(":")
    block = header_block(grpc_fields(int(port), "/nlmserve.v1.LanguageModel/ScoreNgrams", TOKEN))
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        stream = 1
        for _ in range(calls):
            burst = bytearray()
            for _ in range(RESETS_PER_CALL):
                burst += headers_frames(stream, block) + frame(RST_STREAM, 0, stream, (8).to_bytes(4, "big"))
                stream += 2
            try:
                s.sendall(bytes(burst))
            except (BrokenPipeError, ConnectionResetError):
                return  # the server closed a connection that reset too much
        s.settimeout(0.2)
        try:
            while s.recv(1 << 16):
                pass
        except (TimeoutError, OSError):
            pass


async def _large_calls(target: str, calls: int, *, stay: bool) -> None:
    """``calls`` ScoreNgrams of 100,000 n-grams, :data:`LARGE_AT_ONCE` at a time (each sent
    again when the first-message deadline cut it); then, when ``stay``, wait to be killed."""
    from nlmserve.proto import lm_pb2

    raw = lm_pb2.ScoreNgramsRequest(
        ngrams=[lm_pb2.NgramStrings(words=["the", "house", "is"])] * LARGE_NGRAMS).SerializeToString()
    held = asyncio.Semaphore(LARGE_AT_ONCE)
    async with grpc.aio.insecure_channel(target) as channel:
        score = channel.unary_unary("/nlmserve.v1.LanguageModel/ScoreNgrams", lambda b: b, lambda b: b)
        bearer = (("authorization", f"Bearer {TOKEN}"),)

        async def one() -> None:
            async with held:
                for attempt in range(LARGE_TRIES):
                    try:
                        await score(raw, metadata=bearer)
                        return
                    except grpc.aio.AioRpcError as e:
                        # Cut by the server's 0.3 s first-message deadline: its loop was busy
                        # taking the other large messages in. Sent again, as clients retry.
                        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or attempt == LARGE_TRIES - 1:
                            raise

        await asyncio.gather(*(one() for _ in range(calls)), return_exceptions=stay)
        if stay:
            await asyncio.sleep(3600)


def _vanishing(target: str, calls: int) -> None:
    for _ in range(calls):
        proc = subprocess.Popen([sys.executable, "-m", "bench.heap_per_call", "--client", target, "large_then_stay",
                                 str(LARGE_AT_ONCE)])
        time.sleep(1.5)
        proc.kill()
        proc.wait()


def client(target: str, pattern: str, calls: int) -> None:
    if pattern == "rapid_reset":
        _rapid_reset(target, calls)
    elif pattern == "vanishing":
        _vanishing(target, calls)
    elif pattern in ("large", "large_then_stay"):
        asyncio.run(_large_calls(target, calls, stay=pattern == "large_then_stay"))
    else:
        asyncio.run(_calls(target, pattern, calls))


# ---------------------------------------------------------------------- the server process
def run(model: str, calls: int, patterns: list[str], work: Path) -> dict[str, Any]:
    from nlmserve.server.app import create_server
    from nlmserve.server.config import ServerConfig

    logging.getLogger("nlmserve").setLevel(logging.ERROR)  # the refusals' WARNING lines
    tokens = work / "tokens"
    tokens.write_text(TOKEN + "\n", encoding="utf-8")
    running = create_server(ServerConfig(model=model, port=0, token_file=str(tokens), first_message_seconds=0.3,
                                         stream_write_timeout_seconds=0.5))
    rows: dict[str, Any] = {}
    try:
        for pattern in patterns:
            per_round = []
            for _ in range(2):
                before = heap_in_use()
                subprocess.run([sys.executable, "-m", "bench.heap_per_call", "--client", running.target, pattern,
                                str(calls)], check=True, timeout=600)
                per_round.append((heap_in_use() - before) / calls)
            rows[pattern] = {"first_round_bytes_per_call": round(per_round[0], 1),
                             "bytes_per_call": round(per_round[1], 1)}
            print(f"{pattern:18s} {per_round[1]:8.1f} bytes a call (first round {per_round[0]:.1f}): "
                  f"{PATTERNS[pattern]}", flush=True)
    finally:
        running.stop(1.0)
    return {"calls": calls, "machine": machine(), "patterns": rows}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.heap_per_call", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model file (default: train the small test model)")
    p.add_argument("--calls", type=int, default=5000, help="calls of each pattern in each round")
    p.add_argument("--patterns", default=",".join(PATTERNS), help=f"comma-separated, of: {', '.join(PATTERNS)}")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--client", nargs=3, metavar=("TARGET", "PATTERN", "CALLS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client(args.client[0], args.client[1], int(args.client[2]))
        return 0
    patterns = [name for name in args.patterns.split(",") if name]
    unknown = sorted(set(patterns) - set(PATTERNS))
    if unknown:
        p.error(f"unknown patterns {', '.join(unknown)}; known: {', '.join(PATTERNS)}")
    if args.calls < 1:
        p.error("--calls must be >= 1")
    if args.json and Path(args.json).is_dir():
        p.error(f"--json {args.json} is a directory")
    if heap_now() is None:
        print("bench.heap_per_call: needs glibc's mallinfo2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nlmserve-heap-") as work:
        model = args.model
        if model is None:
            from bench.load import train_small_model

            model = str(Path(work) / "small.nlm")
            train_small_model(Path(model))
        result = run(model, args.calls, patterns, Path(work))
    if args.json:
        write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    exit_with(main)
