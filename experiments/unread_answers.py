"""A token holder that never reads its ScoreNgrams answers (a receive window of 0), against
one server.

    .venv/bin/python -m experiments.unread_answers [--frontend python|native] [--connections 4] [--calls 280] [--ngrams 3000]

Trains the soak's small model, starts ``nlmserve serve --frontend F`` with a token file on
127.0.0.1, and opens ``--connections`` raw HTTP/2 connections whose receive window is 0,
each sending ``--calls`` ScoreNgrams calls of ``--ngrams`` n-grams one after the other
(the next once the server has sent the last one's headers; ``bench.h2.unread_calls``):
the server computes each answer, which then waits, unsent ("held"). Prints, before, 10 s
and 40 s after the first call and 5 s after the connections are closed: a probe's outcome
(Check on a new connection), an authorised call's outcome (same token and address: the
same client), the resident memory of the server's processes, and how the calls ended so
far; then how many lines the server logged (and how many were ERRORs with a traceback). Client and server share this machine's
cores. The numbers in experiments/hostile-clients.md#answers-never-read come from it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/

TOKEN = "unread-answers-experiment-token"


def request(ngrams: int) -> bytes:
    """A serialised ScoreNgrams request of ``ngrams`` n-grams."""
    from nlmserve.proto import lm_pb2

    rows = np.full((ngrams, 5), 7, dtype="<u4")
    return lm_pb2.ScoreNgramsRequest(packed_ids=rows.tobytes(), packed_order=5, log_base=lm_pb2.LN).SerializeToString()


async def holder(port: int, calls: int, message: bytes, ended: Counter[str], stop: asyncio.Event) -> None:
    """One connection with a receive window of 0 sending ``calls`` calls (bench.h2.unread_calls),
    then reading how they end until ``stop``."""
    from bench.h2 import unread_calls
    from bench.soak_hostile import SCORE

    outcomes, conn = await unread_calls(port, SCORE, TOKEN, message, calls)
    ended.update(o.split(":")[0] for o in outcomes)
    try:
        while not stop.is_set():
            try:
                *_, how = await conn.exchange(0.5)
            except TimeoutError:
                continue
            if how:
                ended[how] += 1
    except EOFError:
        ended["connection closed by the server"] += 1
    finally:
        conn.close()


def scored(target: str) -> str:
    """An authorised ScoreNgrams call of 10 n-grams (the holder's token: the same client)."""
    import grpc

    from bench.soak_hostile import SCORE

    start = time.monotonic()
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            channel.unary_unary(SCORE)(request(10), timeout=5, metadata=[("authorization", f"Bearer {TOKEN}")])
            return f"OK in {(time.monotonic() - start) * 1e3:.0f} ms"
        except grpc.RpcError as e:
            return f"{e.code().name} ({e.details()})"


async def run(args: Any) -> None:
    from bench.soak import two_models
    from experiments.held_open import probe, resident_mb
    from nlmserve.common.serve_process import start_server

    with tempfile.TemporaryDirectory(prefix="nlmserve-unread-") as tmp:
        work = Path(tmp)
        model, _ = two_models(None, work)
        (work / "tokens").write_text(TOKEN + "\n", encoding="utf-8")
        with open(work / "server.log", "w", encoding="utf-8") as log:
            server = start_server(model, ["--frontend", args.frontend, "--token-file", str(work / "tokens")],
                                  stderr=log)
        pid, target = server.process.pid, server.target
        try:
            print(f"before: probe {probe(target)}; score {scored(target)}; MB {resident_mb(pid)}", flush=True)
            ended, stop = Counter[str](), asyncio.Event()
            port = int(target.rsplit(":", 1)[1])
            body = request(args.ngrams)
            began = time.monotonic()
            tasks = [asyncio.create_task(holder(port, args.calls, body, ended, stop)) for _ in range(args.connections)]
            for at in (10, 40):
                await asyncio.sleep(max(0.0, at - (time.monotonic() - began)))
                print(f"{at} s: probe {await asyncio.to_thread(probe, target)}; score "
                      f"{await asyncio.to_thread(scored, target)}; MB {resident_mb(pid)}; calls {dict(ended)}",
                      flush=True)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(5)
            print(f"after: score {scored(target)}; MB {resident_mb(pid)}; calls {dict(ended)}", flush=True)
        finally:
            server.process.terminate()
            server.process.wait(30)
        text = (work / "server.log").read_text(encoding="utf-8")
        print(f"the server logged {text.count(chr(10))} lines, {text.count('Traceback')} with a traceback")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frontend", choices=("python", "native"), default="python")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--calls", type=int, default=280, help="ScoreNgrams calls per connection")
    p.add_argument("--ngrams", type=int, default=3000, help="n-grams per request")
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    from bench._common import exit_with

    exit_with(lambda: main())
