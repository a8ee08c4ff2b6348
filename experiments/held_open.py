"""Health Check calls held open without their request message, against one server.

    .venv/bin/python -m experiments.held_open [--frontend python|native] [--connections 200] [--calls 8]

Trains the soak's small model, starts ``nlmserve serve --frontend F`` with a token file on
127.0.0.1, and opens ``--connections`` connections, each with ``--calls`` Health/Check calls
that never send their message (no token: health is open). Prints, before, twice while they
are held (3 s and 11 s after) and 3 s after they are closed: a probe's outcome (Check on a
new connection, 2 s deadline, as an orchestrator makes it), the resident memory of the
server's processes, and how the held calls ended so far. Client and server share this
machine's cores. The numbers in experiments/hostile-clients.md#calls-held-open-without-their-message
come from it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import AsyncIterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/

CHECK = "/grpc.health.v1.Health/Check"


def resident_mb(pid: int) -> dict[str, int]:
    """Resident MB of the server and its children, by program name."""
    from bench._common import resident_bytes, tree_pids

    out: dict[str, int] = {}
    for p in tree_pids(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        size = resident_bytes(p)
        if size is not None and name != "sh":
            out[name] = out.get(name, 0) + size // 2**20
    return out


def probe(target: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    start = time.monotonic()
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except grpc.RpcError as e:
            status = e.code().name
    return f"{status} in {(time.monotonic() - start) * 1e3:.0f} ms"


async def _never_sends(stop: asyncio.Event) -> AsyncIterator[bytes]:
    await stop.wait()
    if False:  # an async generator that yields nothing
        yield b""


async def held_open(target: str, pid: int, connections: int, calls: int) -> None:
    import grpc

    stop, ended = asyncio.Event(), Counter[str]()
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]

    async def one(channel: grpc.aio.Channel) -> None:
        try:
            await channel.stream_unary(CHECK, None, None)(_never_sends(stop), timeout=120)
            ended["OK"] += 1
        except grpc.aio.AioRpcError as e:
            ended[e.code().name] += 1

    tasks = [asyncio.create_task(one(ch)) for ch in channels for _ in range(calls)]
    for wait in (3, 8):
        await asyncio.sleep(wait)
        print(f"held {connections} x {calls}: probe {await asyncio.to_thread(probe, target)}; "
              f"MB {resident_mb(pid)}; ended so far {dict(ended)}", flush=True)
    stop.set()
    for ch in channels:
        await ch.close(None)
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(3)
    print(f"after: probe {probe(target)}; MB {resident_mb(pid)}; ended {dict(ended)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frontend", choices=("python", "native"), default="python")
    p.add_argument("--connections", type=int, default=200)
    p.add_argument("--calls", type=int, default=8, help="held-open Check calls per connection")
    args = p.parse_args(argv)
    from bench.soak import two_models
    from nlmserve.common.serve_process import start_server

    with tempfile.TemporaryDirectory(prefix="nlmserve-held-open-") as tmp:
        work = Path(tmp)
        model, _ = two_models(None, work)
        (work / "tokens").write_text("held-open-experiment-token\n", encoding="utf-8")
        with open(work / "server.log", "w", encoding="utf-8") as log:
            server = start_server(model, ["--frontend", args.frontend, "--token-file", str(work / "tokens")],
                                  stderr=log)
        try:
            print(f"before: probe {probe(server.target)}; MB {resident_mb(server.process.pid)}", flush=True)
            asyncio.run(held_open(server.target, server.process.pid, args.connections, args.calls))
        finally:
            server.process.terminate()
            server.process.wait(30)
    return 0


if __name__ == "__main__":
    from bench._common import exit_with

    exit_with(lambda: main())
