"""What a server keeps after floods of connections: the resident memory and malloc's heap
of ``nlmserve serve`` (and of its native front end) after each flood, so that memory still
held (the heap in use grows) is told apart from freed memory whose pages stay resident.

    .venv/bin/python -m bench.connection_floods [--model M] [--frontend native|python] [--floods 1000,1000,2000,1000,3000,1000] [--serve-args "--allocator glibc"] [--json F]

One ``nlmserve serve`` runs on 127.0.0.1 (port 0, ``--torch-threads 1``, ``--serve-args``; gRPC's
polling engine as ``GRPC_POLL_STRATEGY`` in the environment says; the malloc each process
runs on, as it logs it). Each flood opens its number of
connections at once from one client process, each sending a health Check (answered),
then closes them all; ``--settle-seconds`` (4) later, after the servers' periodic trims
(the front end's every second, the Python server's every 2 s), each process logs its heap
on SIGUSR1 (``heap: X MiB in use, Y MiB free, Z MiB resident``), read from the server's
log. A first reading is taken before any flood. Without ``--model`` the small test model is
trained first (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench._common import exit_with, machine, signalled_heaps, write_json

log = logging.getLogger("bench.connection_floods")

ROLES = {"nlmserve.server.app": "nlmserve serve", "nlmserve.server.frontend": "front end"}


async def flood(target: str, connections: int) -> dict[str, int]:
    """``connections`` channels at once, each of its own connection, one health Check each;
    then every one closed. The codes of the answers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]

    async def check(channel: Any) -> str:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        except grpc.aio.AioRpcError as e:
            return str(e.code().name)
        return "OK"

    codes = Counter(await asyncio.gather(*(check(c) for c in channels)))
    await asyncio.gather(*(c.close() for c in channels))
    return dict(codes)


def heaps(process: Any, log_path: Path, processes: int, timeout: float = 10.0) -> dict[str, dict[str, float]]:
    """SIGUSR1 to ``serve``; each of its ``processes`` heap lines, by role."""
    found = signalled_heaps(process, log_path, processes, timeout)
    if len(found) >= processes:
        return {ROLES.get(logger, logger): heap for logger, heap in found.items()}
    raise RuntimeError(f"no heap line from each of the {processes} processes within {timeout:.0f} s "
                       f"(its log: {log_path})")


def run(model: str, frontend: str, floods: list[int], settle: float, work: Path,
        serve_args: list[str] | None = None) -> dict[str, Any]:
    from nlmserve.common.errors import InputError, NlmserveError
    from nlmserve.common.serve_process import start_server

    log_path = work / "serve.log"
    with open(log_path, "w", encoding="utf-8") as stderr:
        try:
            server = start_server(model, ["--torch-threads", "1", "--frontend", frontend, *(serve_args or [])],
                                  stderr=stderr)
        except NlmserveError as e:
            tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            raise InputError(f"the server did not start; its log ends: {' | '.join(tail) or '(nothing)'}") from e
    processes = 2 if frontend == "native" else 1
    readings = []
    try:
        time.sleep(settle)
        readings.append({"flood": 0, "codes": {}, "heap": heaps(server.process, log_path, processes)})
        for connections in floods:
            codes = asyncio.run(flood(server.target, connections))
            time.sleep(settle)
            readings.append({"flood": connections, "codes": codes,
                             "heap": heaps(server.process, log_path, processes)})
            log.info("after %d connections: %s", connections, readings[-1]["heap"])
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
    return {"frontend": frontend, "poll_strategy": os.environ.get("GRPC_POLL_STRATEGY", "default"),
            "serve_args": serve_args or [], "malloc": malloc_lines(log_path), "settle_seconds": settle,
            "readings": readings}


def malloc_lines(log_path: Path) -> list[str]:
    """What each process said of its malloc as it started (``malloc: …``)."""
    text = log_path.read_text(encoding="utf-8", errors="replace")
    return re.findall(r"malloc: (jemalloc \([^)]*\)|glibc's)", text)


def render(result: dict[str, Any]) -> str:
    start = result["readings"][0]["heap"]
    lines = [f"`{result['command']}` ({result['machine']['cpu']}, {result['machine']['cores']} cores, load average "
             f"{result['machine']['load_average_1m']} at the start; polling engine {result['poll_strategy']}; "
             f"malloc: {', '.join(result.get('malloc', [])) or 'not logged'}; "
             f"read {result['settle_seconds']:.0f} s after each flood)", "",
             "| after a flood of | process | answers | resident MiB | above the start | heap in use MiB | free MiB |",
             "|---|---|---|---|---|---|---|"]
    for reading in result["readings"]:
        answers = ", ".join(f"{code} {n}" for code, n in sorted(reading["codes"].items())) or "–"
        for role, heap in sorted(reading["heap"].items()):
            above = heap["resident"] - start[role]["resident"]
            lines.append(f"| {reading['flood'] or 'none (the start)'} | {role} | {answers} | {heap['resident']:.1f} | "
                         f"{above:+.1f} | {heap['in_use']:.2f} | {heap['free']:.1f} |")
    return "\n".join(lines)


def parse_floods(p: argparse.ArgumentParser, text: str) -> list[int]:
    """``--floods``: comma-separated counts of connections, each 1 or more (else ``p.error``)."""
    try:
        floods = [int(n) for n in text.split(",") if n]
    except ValueError:
        p.error(f"--floods {text}: comma-separated counts of connections")
    if not floods or min(floods) < 1:
        p.error("--floods: at least one flood, each of 1 connection or more")
    return floods


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.connection_floods", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model file (default: train the small test model)")
    p.add_argument("--frontend", choices=("native", "python"), default="native")
    p.add_argument("--floods", default="1000,1000,2000,1000,3000,1000",
                   help="connections of each flood, comma-separated, in order")
    p.add_argument("--settle-seconds", type=float, default=4.0, help="wait after each flood before reading")
    p.add_argument("--serve-args", default="", help='more flags of nlmserve serve, one string (e.g. "--allocator glibc")')
    p.add_argument("--json", help="write the result as JSON here")
    args = p.parse_args()
    floods = parse_floods(p, args.floods)
    if args.settle_seconds < 0:
        p.error("--settle-seconds must be >= 0")
    if args.json and Path(args.json).is_dir():
        p.error(f"--json {args.json} is a directory")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    info = machine()
    if args.frontend == "native":
        from bench.soak import native_binary

        native_binary()
    with tempfile.TemporaryDirectory(prefix="nlmserve-floods-") as work:
        model = args.model
        if model is None:
            from bench.load import train_small_model

            model = str(Path(work) / "small.nlm")
            train_small_model(Path(model))
        result = run(model, args.frontend, floods, args.settle_seconds, Path(work), shlex.split(args.serve_args))
    result = {"command": " ".join(["python -m bench.connection_floods", *sys.argv[1:]]), "machine": info, **result}
    if args.json:
        write_json(Path(args.json), result)
    print(render(result))
    return 0


if __name__ == "__main__":
    exit_with(main)
