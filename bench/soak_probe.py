"""bench/soak.py's health probe, in a process of its own as an orchestrator's is (a
kubelet's gRPC probe, ``grpc_health_probe``): the soak's own process runs the authorised
clients and the attackers on many threads, and a probe made there waited for them too (its
channel's creation alone took over a second at times).

    .venv/bin/python -m bench.soak_probe DEADLINE

Reads a target (``host:port``) per line on stdin; for each, one Health/Check on a new
connection with a deadline of DEADLINE seconds, and one JSON line on stdout: ``seconds``
(from the channel's creation to the answer or the failure), ``code`` (``SERVING``,
``NOT_SERVING`` or the gRPC status's name), ``phase`` (for a failure: ``answer`` when the
channel had connected, else ``connect``) and ``details``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _phase(channel: Any) -> str:
    """``answer`` when the probe's channel is connected as its call failed, else ``connect``.
    grpcio's public way to see a channel's state (``subscribe``) costs each probe 200 ms (its
    polling thread, joined at close), so the state is read once, from the channel's core
    (``check_connectivity_state``; ``unknown`` where a grpcio lacks it)."""
    check = getattr(getattr(channel, "_channel", None), "check_connectivity_state", None)
    if check is None:
        return "unknown"
    return "answer" if check(False) == 2 else "connect"  # 2: READY (gRPC's connectivity_state)


def check(target: str, deadline: float) -> dict[str, Any]:
    """One Health/Check of ``target`` on a connection of its own."""
    sent = time.monotonic()
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=deadline)
        except grpc.RpcError as e:
            return {"seconds": time.monotonic() - sent, "code": e.code().name, "phase": _phase(channel),
                    "details": e.details() or ""}
        took = time.monotonic() - sent  # (closing the channel is not the probe's)
    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
    return {"seconds": took, "code": "SERVING" if serving else "NOT_SERVING", "phase": "", "details": ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One Health/Check per target read on stdin, one JSON line each.")
    p.add_argument("deadline", type=float, help="seconds each Check may take")
    args = p.parse_args(argv)
    if not args.deadline > 0:
        p.error("deadline: must be > 0")
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(check(line.strip(), args.deadline)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
