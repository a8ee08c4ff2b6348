"""Load test: many concurrent clients mixing tiny and large requests against ``nlmserve serve``.

    .venv/bin/python -m bench.load --model runs/demo/nlm.model [--seconds 60] [--clients 64] [--json out.json]

A real ``nlmserve serve`` subprocess on 127.0.0.1 (port 0) serves the model. ``--clients``
threads in this process, each with its own gRPC channel, send requests back to back
(closed loop) until ``--seconds`` have passed. Each request is drawn at random from three
classes of prepared requests built from the n-grams of the shipped held-out Europarl text:

* ``tiny``: 1-3 n-grams, half of them as strings, half as packed ids (90% of requests);
* ``large_ids``: 5,000-20,000 n-grams as packed ids (5%);
* ``large_strings``: 5,000-20,000 n-grams as strings (5%).

Every answer is checked against the model loaded in this process (same length, every value
within 1e-3 log10 of the in-process score); an RPC error or a wrong answer is a failed
request. The server's resident set (``VmRSS`` of ``/proc/PID/status``) is read when the
warm-up (``--warmup`` seconds of the same load) ends, every second after, and at the end;
growth is ``end / warm - 1`` and the trend is the slope of a line fitted to the readings. Finally the server gets SIGTERM and must exit 0.

Without ``--model`` a small model is trained first (order 5, width 16, 300 NCE steps on the
first 3,000 lines of the training slice: the test fixture's model). The result is printed as
a table and, with ``--json``, written as JSON; the exit code is 1 when a request failed or
the resident set grew by 10% or more.
"""

from __future__ import annotations

import argparse
import json
import logging
import lzma
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import exit_with, machine, resident_bytes

from nlmserve.common.serve_process import start_server

log = logging.getLogger("bench.load")

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "lm"
TRAIN_XZ = DATA / "europarl.train.50k.lc-moses.en.xz"
DEV_TXT = DATA / "europarl.dev.1k.lc-moses.en"

CLASSES = ("tiny", "large_ids", "large_strings")
TOLERANCE = 1e-3  # log10; values are computed by the same model in float32


@dataclass(frozen=True)
class LoadConfig:
    """One load run.

    Fields:
        model: model file to serve (None: train the small test model into a temporary folder).
        seconds: length of the measured run, warm-up included.
        warmup: seconds of load before the first resident-set reading.
        clients: concurrent client threads, one gRPC channel each.
        large_share: probability that a request is large (split evenly between ids and strings).
        torch_threads: torch threads of the server's forward pass.
        seed: seed of the request mix.
        max_rss_growth: largest allowed relative growth of the server's resident set.
    """

    model: str | None = None
    seconds: float = 60.0
    warmup: float = 5.0
    clients: int = 64
    large_share: float = 0.1
    torch_threads: int = 1
    seed: int = 0
    max_rss_growth: float = 0.10


@dataclass
class Prepared:
    """One request ready to send, with the scores it must come back with (log10)."""

    kind: str
    request: Any  # lm_pb2.ScoreNgramsRequest
    expected: np.ndarray
    ngrams: int


@dataclass
class ClassStats:
    latencies: list[float] = field(default_factory=list)
    ngrams: int = 0
    failures: int = 0
    examples: list[str] = field(default_factory=list)


def train_small_model(out: Path) -> None:
    """The test fixture's model: order 5, width 16, 24 classes, 300 NCE steps, seed 7."""
    from nlmserve.lm.train import TrainConfig, train

    text = out.parent / "train.3k.en"
    with lzma.open(TRAIN_XZ, "rt", encoding="utf-8") as src, open(text, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= 3000:
                break
            dst.write(line)
    train(TrainConfig(train=str(text), valid=str(DEV_TXT), out=str(out), order=5, dim=16, classes=24,
                      class_method="frequency", objective="nce", min_count=2, max_steps=300, batch_size=256,
                      lr=0.1, threads=1, seed=7, progress=False, learning_curve=False))


def prepare(model: str, seed: int) -> dict[str, list[Prepared]]:
    """Requests of every class from the held-out text's n-grams, with in-process expected scores."""
    import torch

    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.proto import lm_pb2

    torch.set_num_threads(1)
    lm = LanguageModel.load(model, device="cpu")
    with open(DEV_TXT, encoding="utf-8") as f:
        sentences = [line.split() for line in f if line.strip()]
    ids, _, _, _ = lm.sentence_ngrams(sentences)
    ids = ids.astype(np.uint32)
    # The words of each n-gram without the <s> padding (the server pads strings the same way).
    words: list[list[str]] = []
    for s_idx, sent in enumerate(sentences):
        toks = [*sent, "</s>"]
        for t in range(len(toks)):
            words.append(toks[max(0, t - lm.order + 1) : t + 1])
    if len(words) != len(ids):
        raise RuntimeError(f"{len(words)} word n-grams for {len(ids)} id rows")
    expected_all = lm.score_ngrams(ids, log10=True)
    rng = np.random.default_rng(seed)
    out: dict[str, list[Prepared]] = {k: [] for k in CLASSES}

    def strings(rows: np.ndarray) -> Any:
        return lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=words[i]) for i in rows.tolist()])

    def packed(rows: np.ndarray) -> Any:
        block = np.ascontiguousarray(ids[rows], dtype="<u4")
        return lm_pb2.ScoreNgramsRequest(packed_ids=block.tobytes(), packed_order=lm.order)

    for i in range(64):
        rows = rng.choice(len(ids), size=int(rng.integers(1, 4)), replace=False)
        request = strings(rows) if i % 2 else packed(rows)
        out["tiny"].append(Prepared("tiny", request, expected_all[rows], len(rows)))
    for kind, make in (("large_ids", packed), ("large_strings", strings)):
        for size in (5_000, 10_000, 15_000, 20_000):
            rows = rng.choice(len(ids), size=min(size, len(ids)), replace=False)
            out[kind].append(Prepared(kind, make(rows), expected_all[rows], len(rows)))
    return out


def rss_kib(pid: int) -> int:
    """The resident set of a live process, KiB."""
    value = resident_bytes(pid)
    if value is None:
        raise RuntimeError(f"no VmRSS line in /proc/{pid}/status")
    return value // 1024


def client_loop(target: str, prepared: dict[str, list[Prepared]], cfg: LoadConfig, index: int,
                stop: threading.Event, stats: dict[str, ClassStats], lock: threading.Lock) -> None:
    import grpc

    from nlmserve.proto import lm_pb2_grpc

    rng = random.Random(cfg.seed * 1000 + index)
    local = {k: ClassStats() for k in CLASSES}
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                ("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = lm_pb2_grpc.LanguageModelStub(channel)
        while not stop.is_set():
            u = rng.random()
            kind = "tiny" if u >= cfg.large_share else ("large_ids" if u < cfg.large_share / 2 else "large_strings")
            item = rng.choice(prepared[kind])
            s = local[kind]
            t0 = time.perf_counter()
            try:
                response = stub.ScoreNgrams(item.request, timeout=60.0)
            except grpc.RpcError as e:
                s.failures += 1
                if len(s.examples) < 3:
                    s.examples.append(f"{e.code().name}: {e.details()}")
                continue
            s.latencies.append(time.perf_counter() - t0)
            got = np.asarray(response.log_probs, dtype=np.float64)
            if got.shape != item.expected.shape or not np.allclose(got, item.expected, atol=TOLERANCE, rtol=0):
                s.failures += 1
                if len(s.examples) < 3:
                    s.examples.append(f"wrong answer: {got.shape} values for {item.expected.shape}")
                continue
            s.ngrams += item.ngrams
    with lock:
        for k in CLASSES:
            stats[k].latencies += local[k].latencies
            stats[k].ngrams += local[k].ngrams
            stats[k].failures += local[k].failures
            stats[k].examples += local[k].examples[: 3 - len(stats[k].examples)]


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else float("nan")


def run(cfg: LoadConfig) -> dict[str, Any]:
    """Run the load and return the result (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="nlmserve-load-") as tmp:
        model = cfg.model
        if model is None:
            model = str(Path(tmp) / "small.nlm")
            log.info("training the small test model into %s", model)
            train_small_model(Path(model))
        prepared = prepare(model, cfg.seed)
        server = start_server(Path(model), ["--torch-threads", str(cfg.torch_threads)])  # its log goes to stderr
        pid = server.process.pid
        stats = {k: ClassStats() for k in CLASSES}
        lock = threading.Lock()
        stop = threading.Event()
        threads = [threading.Thread(target=client_loop, args=(server.target, prepared, cfg, i, stop, stats, lock),
                                    name=f"client-{i}", daemon=True) for i in range(cfg.clients)]
        try:
            start = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(cfg.warmup)
            rss_warm = rss_kib(pid)
            rss_max = rss_warm
            samples = [(round(time.monotonic() - start, 1), rss_warm)]
            while time.monotonic() - start < cfg.seconds:
                time.sleep(min(1.0, max(0.0, cfg.seconds - (time.monotonic() - start))))
                if server.process.poll() is not None:
                    raise RuntimeError(f"the server died (exit code {server.process.returncode}; its log is above)")
                samples.append((round(time.monotonic() - start, 1), rss_kib(pid)))
                rss_max = max(rss_max, samples[-1][1])
            rss_end = rss_kib(pid)
            stop.set()
            for t in threads:
                t.join(120)
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            server.stop(grace=60.0)
            exit_code = server.process.returncode
    classes: dict[str, Any] = {}
    for k in CLASSES:
        s = stats[k]
        classes[k] = {
            "requests": len(s.latencies) + s.failures, "failed": s.failures, "ngrams": s.ngrams,
            "requests_per_s": round(len(s.latencies) / elapsed, 1), "ngrams_per_s": round(s.ngrams / elapsed),
            "p50_ms": round(percentile_ms(s.latencies, 50), 2), "p99_ms": round(percentile_ms(s.latencies, 99), 2),
            "examples": s.examples,
        }
    failed = sum(c["failed"] for c in classes.values())
    growth = rss_end / rss_warm - 1.0
    when = np.array([x[0] for x in samples], dtype=np.float64)
    rss = np.array([x[1] for x in samples], dtype=np.float64)
    slope = float(np.polyfit(when, rss, 1)[0]) * 60.0 if len(samples) > 2 else 0.0  # KiB per minute
    return {
        "machine": machine(), "config": {**cfg.__dict__, "model": model if cfg.model else "(small test model)"},
        "seconds": round(elapsed, 1), "classes": classes,
        "requests": sum(c["requests"] for c in classes.values()), "failed": failed,
        "rss_kib": {"warm": rss_warm, "end": rss_end, "max": rss_max}, "rss_growth": round(growth, 4),
        "rss_trend_kib_per_min": round(slope),
        "rss_samples_kib": samples[:: max(1, len(samples) // 30)],
        "server_exit_code": exit_code,
        "ok": failed == 0 and growth < cfg.max_rss_growth and exit_code == 0,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['config']['clients']} clients, {result['seconds']} s, {result['machine']['cpu']} "
          f"({result['machine']['cores']} cores)")
    print(f"{'class':<14} {'requests':>9} {'failed':>7} {'req/s':>8} {'n-grams/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for k, c in result["classes"].items():
        print(f"{k:<14} {c['requests']:>9} {c['failed']:>7} {c['requests_per_s']:>8} {c['ngrams_per_s']:>10}"
              f" {c['p50_ms']:>8} {c['p99_ms']:>8}")
        for e in c["examples"]:
            print(f"  e.g. {e}")
    r = result["rss_kib"]
    print(f"server RSS after warm-up {r['warm']} KiB, at the end {r['end']} KiB (max {r['max']}),"
          f" growth {100 * result['rss_growth']:.1f}%, trend {result['rss_trend_kib_per_min']} KiB/min;"
          f" server exit code {result['server_exit_code']}")
    print("OK" if result["ok"] else "FAILED")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model file (default: train the small test model)")
    p.add_argument("--seconds", type=float, default=60.0, help="run length, warm-up included (default 60)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the first RSS reading (default 5)")
    p.add_argument("--clients", type=int, default=64, help="concurrent client threads (default 64)")
    p.add_argument("--large-share", type=float, default=0.1, help="share of large requests (default 0.1)")
    p.add_argument("--torch-threads", type=int, default=1, help="server torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.warmup >= args.seconds:
        p.error("--warmup must be shorter than --seconds")
    cfg = LoadConfig(model=args.model, seconds=args.seconds, warmup=args.warmup, clients=args.clients,
                     large_share=args.large_share, torch_threads=args.torch_threads, seed=args.seed)
    result = run(cfg)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    exit_with(main)
