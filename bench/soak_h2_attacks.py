"""The soak's hostile clients that write HTTP/2 frames on a socket themselves (bench/h2.py),
for what no gRPC client sends: a header block before the SETTINGS acknowledgement,
HEADERS + RST_STREAM bursts, a zero receive window, a connection that stops inside its
preface. bench/soak_attacks.py runs them."""

from __future__ import annotations

import asyncio
import time

from bench.h2 import (DATA, END_STREAM, GOAWAY, H2, HEADER_TABLE_SIZE, INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS,
                      MAX_HEADER_LIST_SIZE, PREFACE, RST_STREAM, frame, grpc_fields, header_block, headers_frames,
                      settings)
from bench.soak_hostile import EMPTY_MESSAGE, SCORE, STREAMING, HostileConfig, Tally, Target, wait_or_stop


async def never_read(r: Target, cfg: HostileConfig, token: str, request: bytes, stop: asyncio.Event,
                     out: Tally) -> None:
    """A token holder with ``never_read_calls`` GetScoringTables, GetVocabulary and (with
    ``never_read_unary``) ScoreNgrams calls (``request``, a serialised request) open on one
    connection and a receive window of 0: the server may send their headers, never a
    message. A call the server ends is counted by how, with how long it held, and re-opened
    a second later; the connection is re-opened after a GOAWAY or a close."""
    paths = (*STREAMING, SCORE) if cfg.never_read_unary else STREAMING
    score_message = b"\x00" + len(request).to_bytes(4, "big") + request
    while not stop.is_set():
        if not r.up.is_set():
            await wait_or_stop(stop, 0.5)
            continue
        try:
            conn = await H2.open(r.port, {HEADER_TABLE_SIZE: 0, INITIAL_WINDOW_SIZE: 0})
        except (OSError, TimeoutError):
            out.counts["connect_failed"] += 1
            await wait_or_stop(stop, 1.0)
            continue
        opened: dict[int, float] = {}
        next_id = 1
        reopen_at: list[float] = []

        def call() -> None:
            nonlocal next_id
            path = paths[(next_id // 2) % len(paths)]
            conn.send(headers_frames(next_id, header_block(grpc_fields(r.port, path, token)))
                      + frame(DATA, END_STREAM, next_id, score_message if path == SCORE else EMPTY_MESSAGE))
            opened[next_id] = time.monotonic()
            out.counts["calls"] += 1
            next_id += 2

        try:
            first = await conn.read(10)  # the server's SETTINGS: how many streams it allows
            conn.answer(*first[:2], first[3])
            for _ in range(min(cfg.never_read_calls, conn.peer.get(MAX_CONCURRENT_STREAMS, 1 << 31))):
                call()
            await conn.drain()
            while not stop.is_set():
                now = time.monotonic()
                while reopen_at and reopen_at[0] <= now:
                    reopen_at.pop(0)
                    call()
                try:
                    kind, _, stream, _, how = await conn.exchange(0.5)
                except TimeoutError:
                    continue
                if how is None:
                    continue
                if kind == GOAWAY:
                    out.counts[how] += 1
                    break
                began = opened.pop(stream, None)
                if began is not None:
                    out.counts[how] += 1
                    out.hold("call_ended", time.monotonic() - began)
                    reopen_at.append(time.monotonic() + 1.0)
        except EOFError:
            out.counts["connection closed by the server"] += 1
        except (OSError, TimeoutError) as e:
            out.counts[type(e).__name__] += 1
        finally:
            if stop.is_set():
                out.counts["held_when_stopped"] += len(opened)
            else:  # the server let go of them with their connection
                out.counts["held_when_cut"] += len(opened)
                for began in opened.values():
                    out.hold("call_ended", time.monotonic() - began)
            conn.close()
        await wait_or_stop(stop, 1.0)


async def rapid_reset(r: Target, cfg: HostileConfig, stop: asyncio.Event, out: Tally) -> None:
    """Every ``reset_every`` s, ``reset_burst`` ScoreNgrams HEADERS each followed at once by
    its RST_STREAM (CANCEL), without a token, on one connection kept between bursts."""
    conn: H2 | None = None
    reader: asyncio.Task[None] | None = None
    next_id = 1

    async def read(c: H2) -> None:
        try:
            while True:
                kind, flags, _, payload = await c.read()
                c.answer(kind, flags, payload)
                how = c.ended(kind, flags, payload)
                if how is not None:
                    out.counts[how] += 1
                if kind == GOAWAY:
                    return
        except EOFError:
            out.counts["connection closed by the server"] += 1
        except (OSError, TimeoutError):
            pass

    try:
        while not stop.is_set():
            if r.up.is_set():
                if conn is None or reader is None or reader.done() or next_id > (1 << 30):
                    if conn is not None:
                        conn.close()
                    await _ended(reader)
                    try:
                        conn = await H2.open(r.port, {HEADER_TABLE_SIZE: 0})
                    except (OSError, TimeoutError):
                        out.counts["connect_failed"] += 1
                        conn = None
                    else:
                        out.counts["connections"] += 1
                        reader = asyncio.create_task(read(conn))
                        next_id = 1
                if conn is not None:
                    block = header_block(grpc_fields(r.port, SCORE))
                    rst = (8).to_bytes(4, "big")  # CANCEL
                    try:
                        for start in range(0, cfg.reset_burst, 500):
                            conn.send(b"".join(headers_frames(next_id + 2 * i, block) + frame(RST_STREAM, 0, next_id + 2 * i, rst)
                                               for i in range(min(500, cfg.reset_burst - start))))
                            next_id += 2 * min(500, cfg.reset_burst - start)
                            await conn.drain()
                        out.counts["streams_reset"] += cfg.reset_burst
                        out.counts["bursts"] += 1
                    except (OSError, TimeoutError):
                        out.counts["burst cut by the server"] += 1
                        conn.close()
                        conn = None
            await wait_or_stop(stop, cfg.reset_every)
    finally:
        await _ended(reader)
        if conn is not None:
            conn.close()


async def _ended(task: asyncio.Task[None] | None) -> None:
    """``task`` cancelled and awaited, so that none is left pending when the loop closes."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def big_metadata(r: Target, cfg: HostileConfig, unacked: bool, stop: asyncio.Event, out: Tally) -> None:
    """One half-open ScoreNgrams call without a token whose metadata is large: sent before
    the server's SETTINGS are acknowledged (``unacked``: ``big_metadata_bytes``, never
    acknowledged), or after, as large as the server accepts: first the
    SETTINGS_MAX_HEADER_LIST_SIZE it announces (``big_metadata_bytes`` when it announces
    none), 3/4 of the last size after each quick refusal other than UNAUTHENTICATED (which
    means the metadata was read). The call never sends a
    message; once the server ends it or closes the connection, a new one follows 2 s later.
    Counts the largest metadata sent, and the largest held for more than a second."""
    size = cfg.big_metadata_bytes
    announced = False
    while not stop.is_set():
        if not r.up.is_set():
            await wait_or_stop(stop, 0.5)
            continue
        try:
            conn = await H2.open(r.port, {HEADER_TABLE_SIZE: 0})
        except (OSError, TimeoutError):
            out.counts["connect_failed"] += 1
            await wait_or_stop(stop, 2.0)
            continue
        began = time.monotonic()
        how: str | None = None
        try:
            if not unacked:
                kind, flags, _, payload = await conn.read(10)
                conn.answer(kind, flags, payload)
                if not announced:
                    size, announced = conn.peer.get(MAX_HEADER_LIST_SIZE, size), True
            fields = grpc_fields(r.port, SCORE)
            left = size - sum(len(n) + len(v) + 32 for n, v in fields) - 64
            while left > 64:
                value = "x" * min(16_000, left - 48)
                fields.append((f"x-pad-{len(fields)}", value))
                left -= len(fields[-1][0]) + len(value) + 32
            conn.send(headers_frames(1, header_block(fields)))
            await conn.drain()
            out.counts["calls"] += 1
            out.counts["largest_sent_bytes"] = max(out.counts["largest_sent_bytes"], size)
            began = time.monotonic()
            while not stop.is_set():
                try:
                    *_, how = await conn.exchange(0.5, ack_settings=not unacked)
                except TimeoutError:
                    if time.monotonic() - began > 1.0:
                        out.counts["largest_held_bytes"] = max(out.counts["largest_held_bytes"], size)
                    continue
                if how is not None:
                    out.counts[how] += 1
                    out.hold("call_ended", time.monotonic() - began)
                    break
            else:
                out.counts["held_when_stopped"] += 1
        except EOFError:
            how = "connection closed by the server"
            out.counts[how] += 1
            out.hold("call_ended", time.monotonic() - began)
        except (OSError, TimeoutError) as e:
            out.counts[type(e).__name__] += 1
        finally:
            conn.close()
        if not unacked and how not in (None, "UNAUTHENTICATED") and time.monotonic() - began < 1.0:
            size = max(1024, size * 3 // 4)  # refused for its size, most likely: a smaller one next
        await wait_or_stop(stop, 2.0)


async def slow(r: Target, kind: str, stop: asyncio.Event, out: Tally) -> None:
    """A connection that stops: ``silent`` sends nothing, ``mid_preface`` half the preface,
    ``mid_header`` the preface, SETTINGS and a HEADERS frame without END_HEADERS (a header
    block never finished). Held until the server closes it (counted, with how long it
    stayed), then re-opened a second later."""
    sent = {"silent": b"", "mid_preface": PREFACE[:12],
            "mid_header": PREFACE + settings({}) + headers_frames(1, header_block(grpc_fields(r.port, SCORE)),
                                                                  end_headers=False)}[kind]
    while not stop.is_set():
        if not r.up.is_set():
            await wait_or_stop(stop, 0.5)
            continue
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", r.port), 10)
        except (OSError, TimeoutError):
            out.counts[f"{kind} connect_failed"] += 1
            await wait_or_stop(stop, 1.0)
            continue
        began = time.monotonic()
        try:
            writer.write(sent)
            await asyncio.wait_for(writer.drain(), 10)
            out.counts[f"{kind} opened"] += 1
            while not stop.is_set():
                try:
                    if not await asyncio.wait_for(reader.read(65536), 0.5):
                        out.counts[f"{kind} closed by the server"] += 1
                        out.hold(kind, time.monotonic() - began)
                        break
                except TimeoutError:
                    continue
            else:
                out.counts[f"{kind} held_when_stopped"] += 1
        except (OSError, TimeoutError):
            out.counts[f"{kind} closed by the server"] += 1
            out.hold(kind, time.monotonic() - began)
        finally:
            writer.transport.abort()
        await wait_or_stop(stop, 1.0)
