"""What the servers' malloc costs and gives: ``nlmserve serve --allocator glibc`` against
``--allocator auto`` (jemalloc where the system has it), side by side in one run.

    .venv/bin/python -m bench.allocator [--rounds 3] [--seconds 6] [--floods 1000,3000] [--json F]

Speed: bench/serve.py's micro-batching load (32 clients, one n-gram per request, each
sending its next when its last is answered; ``nlmserve_load`` when `make cpp` built it,
Python asyncio clients otherwise) against the Python server and against ``--frontend
native``, on bench/serve.py's model (order 5, width 256, 20k words), each allocator in turn
for ``--rounds`` rounds, so that a change of the machine's load hits both alike: n-grams/s
and the servers' CPU per request (model server and front end together), the median of the
rounds and the ratio jemalloc / glibc. The smallest requests are where malloc weighs most;
larger ones spend their time in the forward pass.

Memory: bench/connection_floods.py's floods (``--floods``) against each server with each
allocator: what each process keeps above its start after each flood.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._common import exit_with, machine, machine_line, write_json

log = logging.getLogger("bench.allocator")

ALLOCATORS = ("glibc", "auto")
SERVERS = {"python": (), "native": ("--frontend", "native")}


def speed(rounds: int, seconds: float, work: Path) -> dict[str, Any]:
    from bench.serve import BenchConfig, Workload, cpp_tool

    cfg = BenchConfig(seconds=seconds)
    tool = cpp_tool("nlmserve_load")
    w = Workload.build(cfg, work / "serve-bench.nlm")
    runs: dict[str, list[dict[str, float]]] = {}
    for n in range(rounds):
        for allocator in ALLOCATORS:
            for server, flags in SERVERS.items():
                r = w.concurrent((*flags, "--allocator", allocator), tool)
                runs.setdefault(f"{server} {allocator}", []).append(r)
                log.info("round %d, %s, %s: %.0f n-grams/s, %.1f us of CPU a request", n + 1, server, allocator,
                         r["ngrams_per_s"], r["server_cpu_us_per_request"])
    return {"load": "nlmserve_load" if tool is not None else "asyncio", "runs": runs}


def memory(floods: list[int], settle: float, work: Path) -> dict[str, Any]:
    from bench.connection_floods import run
    from bench.load import train_small_model

    model = work / "small.nlm"
    train_small_model(model)
    return {f"{server} {allocator}": run(str(model), server, floods, settle, work, ["--allocator", allocator])
            for server in SERVERS for allocator in ALLOCATORS}


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(result: dict[str, Any]) -> str:
    runs = result["speed"]["runs"]
    rounds = len(next(iter(runs.values())))
    lines = [f"`{result['command']}` ({machine_line(result['machine'])}; {rounds} rounds of "
             f"{result['seconds']:.0f} s per server and allocator, the median; load from "
             f"{result['speed']['load']})", "",
             "| server | glibc n-grams/s | jemalloc n-grams/s | ratio | glibc CPU µs/request | jemalloc CPU µs/request "
             "| ratio |", "|---|---|---|---|---|---|---|"]
    for server in SERVERS:
        g, j = runs[f"{server} glibc"], runs[f"{server} auto"]
        rate_g, rate_j = median(g, "ngrams_per_s"), median(j, "ngrams_per_s")
        cpu_g, cpu_j = median(g, "server_cpu_us_per_request"), median(j, "server_cpu_us_per_request")
        lines.append(f"| {server} | {rate_g:,.0f} | {rate_j:,.0f} | {rate_j / rate_g:.2f} | {cpu_g:.0f} | {cpu_j:.0f} | "
                     f"{cpu_j / cpu_g:.2f} |")
    lines += ["", "| after a flood of | process | glibc: MiB above its start | jemalloc: MiB above its start |",
              "|---|---|---|---|"]
    mem = result["memory"]
    for server in SERVERS:
        g, j = mem[f"{server} glibc"]["readings"], mem[f"{server} auto"]["readings"]
        for rg, rj in zip(g[1:], j[1:]):
            for role in sorted(rg["heap"]):
                above_g = rg["heap"][role]["resident"] - g[0]["heap"][role]["resident"]
                above_j = rj["heap"][role]["resident"] - j[0]["heap"][role]["resident"]
                lines.append(f"| {rg['flood']} | {server}: {role} | {above_g:+.1f} | {above_j:+.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="turns of each allocator, alternating")
    p.add_argument("--seconds", type=float, default=6.0, help="load per turn")
    p.add_argument("--floods", default="1000,3000", help="connections of each flood, comma-separated")
    p.add_argument("--settle-seconds", type=float, default=4.0, help="wait after each flood before reading")
    p.add_argument("--json", help="write the result as JSON here")
    args = p.parse_args()
    from bench.connection_floods import parse_floods

    floods = parse_floods(p, args.floods)
    if args.rounds < 1 or args.seconds <= 0 or args.settle_seconds < 0:
        p.error("--rounds must be >= 1, --seconds > 0, --settle-seconds >= 0")
    if args.json and Path(args.json).is_dir():
        p.error(f"--json {args.json} is a directory")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench.soak import native_binary
    from nlmserve.common.memory import jemalloc_environment

    if jemalloc_environment(dict(os.environ)) is None:
        p.error("jemalloc is not installed here (Debian: libjemalloc2): nothing to compare")
    native_binary()
    info = machine()
    with tempfile.TemporaryDirectory(prefix="nlmserve-allocator-") as work:
        result = {"command": " ".join(["python -m bench.allocator", *sys.argv[1:]]), "machine": info,
                  "seconds": args.seconds, "speed": speed(args.rounds, args.seconds, Path(work)),
                  "memory": memory(floods, args.settle_seconds, Path(work))}
    if args.json:
        write_json(Path(args.json), result)
    print(render(result))
    return 0


if __name__ == "__main__":
    exit_with(main)
