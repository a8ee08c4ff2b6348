"""Throughput of 1..N ``nlmserve serve`` replicas behind one replicated client (round_robin).

    .venv/bin/python -m experiments.replicas --model runs/demo/nlm.model [--replicas 1 2] [--seconds 15]
        [--threads 4] [--batch 10000] [--json out.json]

For each replica count: start that many ``nlmserve serve --torch-threads 1`` subprocesses on
127.0.0.1 (port 0, ``--metrics-port 0``), open one ``LMClient`` on all of them, and let
``--threads`` threads send packed-id requests of ``--batch`` n-grams (drawn from the held-out
Europarl text) back to back for ``--seconds`` after a short warm-up. Reports n-grams/s in
all and per replica (each replica's ``nlmserve_ngrams_scored_total``), and how evenly the
requests were spread. Client and replicas share this machine's cores: on a machine with
fewer cores than replicas plus one, the result shows the sharing, not the replicas.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEV = REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en"
log = logging.getLogger("experiments.replicas")


def start_replica(model: str, *flags: str) -> tuple[subprocess.Popen[str], str, str]:
    """``nlmserve serve`` on a free port with one torch and one OpenMP thread; (process, target,
    /metrics URL)."""
    from nlmserve.common.errors import NlmserveError
    from nlmserve.common.serve_process import start_server

    try:
        server = start_server(model, ["--torch-threads", "1", *flags], metrics_port=0, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    except NlmserveError as e:
        raise SystemExit(f"replica did not start: {e}") from e
    assert server.metrics_url is not None
    return server.process, server.target, server.metrics_url


def counter(url: str, name: str, match: str = "") -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name) and match in line)


def requests_of(vocab: dict[str, int], order: int, batch: int, count: int) -> list[np.ndarray]:
    with open(DEV, encoding="utf-8") as f:
        words = " ".join(line.strip() for line in f).split()
    ids = np.array([vocab.get(w, 0) for w in words], dtype=np.uint32)
    ids[ids == 1] = 0  # <s> is never predicted
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        starts = rng.integers(0, len(ids) - order, size=batch)
        out.append(np.stack([ids[s : s + order] for s in starts]))
    return out


def run(model: str, replicas: int, seconds: float, threads: int, batch: int) -> dict[str, Any]:
    from nlmserve.client import LMClient

    started = [start_replica(model) for _ in range(replicas)]
    try:
        with LMClient([t for _, t, _ in started], timeout=120) as client:
            reqs = requests_of(client.vocabulary(), client.order, batch, 8)
            stop = threading.Event()
            done = [0] * threads

            def work(k: int) -> None:
                i = k
                while not stop.is_set():
                    client.score_ids(reqs[i % len(reqs)])
                    done[k] += 1
                    i += 1

            pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for t in pool:
                t.start()
            time.sleep(min(3.0, seconds / 4))  # warm-up
            before = [counter(m, "nlmserve_ngrams_scored_total") for _, _, m in started]
            reqs_before = [counter(m, "nlmserve_requests_total", 'rpc="ScoreNgrams"') for _, _, m in started]
            t0 = time.monotonic()
            time.sleep(seconds)
            after = [counter(m, "nlmserve_ngrams_scored_total") for _, _, m in started]
            reqs_after = [counter(m, "nlmserve_requests_total", 'rpc="ScoreNgrams"') for _, _, m in started]
            elapsed = time.monotonic() - t0
            stop.set()
            for t in pool:
                t.join()
    finally:
        for proc, _, _ in started:
            proc.terminate()
            proc.wait(30)
    per = [(a - b) / elapsed for a, b in zip(after, before)]
    share = [a - b for a, b in zip(reqs_after, reqs_before)]
    return {"replicas": replicas, "threads": threads, "batch": batch, "seconds": round(elapsed, 2),
            "ngrams_per_s": round(sum(per)), "per_replica": [round(p) for p in per], "requests_per_replica": share}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model file")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts to measure (default 1 2)")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds per count (default 15)")
    p.add_argument("--threads", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--batch", type=int, default=10_000, help="n-grams per request (default 10000)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = []
    for n in args.replicas:
        r = run(args.model, n, args.seconds, args.threads, args.batch)
        log.info("%d replica(s): %s n-grams/s (per replica %s, requests %s)", n, f"{r['ngrams_per_s']:,}",
                 r["per_replica"], r["requests_per_replica"])
        results.append(r)
    print("| replicas | n-grams/s in all | per replica | ScoreNgrams requests per replica |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['replicas']} | {r['ngrams_per_s']:,} | {', '.join(f'{x:,}' for x in r['per_replica'])} "
              f"| {', '.join(str(int(x)) for x in r['requests_per_replica'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": os.getloadavg(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
