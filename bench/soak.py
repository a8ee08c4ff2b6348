"""Soak under hostile clients and faults: nothing lost, nothing wrong, no failed probe.

    .venv/bin/python -m bench.soak [--model M] [--minutes 10] [--json bench/results/soak.json] [--doc docs/operating.md]
    .venv/bin/python -m bench.soak --render bench/results/soak.json [--doc docs/operating.md]

Two ``nlmserve serve`` replicas on 127.0.0.1 with a token file serve a model; for
``--minutes`` these run side by side:

* **authorised clients**, each an ``LMClient`` over both replicas (gRPC round_robin with
  health checks, the token, ``allow_mixed_models``): ``--decoders`` decoder-like threads
  sending 1-50 packed n-grams back to back, ``--rescorers`` rescoring-like threads sending
  5,000-20,000. Every answer is compared with the in-process score of the model its
  ``model_hash`` names (within 1e-5, natural log).
* **health probes**: Health/Check of each replica every 0.5 s (2 s deadline); probes of a
  replica the fault injector has killed and not yet seen listening again are not counted.
* **hostile clients, without a token**: on each replica, ``--max-concurrent-rpcs`` health
  Watch streams held open on connections of their own (re-opened when cut) and as many
  ScoreNgrams calls whose request never comes (re-opened as soon as they are refused);
  raw TCP connections sending random bytes; gRPC calls of random bytes, and of
  messages over ``--max-message-bytes``, on three methods, without and with the token.
* **faults**: every ``--fault-every`` seconds, in turn on each replica: its model file
  replaced by a bad one (garbage, a FIFO, a truncated copy) + SIGHUP, then by a good one
  (the other of two models of one vocabulary) + SIGHUP; or the replica killed with SIGKILL
  and restarted on its port.

The report: for the authorised clients sent, answered, failed by cause, wrong answers,
p50/p99 latency; health probes sent and failed; what each hostile client got; the faults;
the servers' own counts (``nlmserve_refused_total``, ``nlmserve_requests_total`` by code).
The target: 0 failed or wrong answers for authorised clients and 0 failed probes (exit 1
otherwise). ``--json`` writes the result; ``--doc`` writes its table into the document
between ``<!-- soak:begin -->`` and ``<!-- soak:end -->``; ``--render`` makes the table
from a JSON. Without ``--model`` two small models are trained first (the test fixture's
recipe, seeds 7 and 8; a few seconds each).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from bench._common import machine, shown_command, write_json, write_section
from bench.load import DEV_TXT, train_small_model

log = logging.getLogger("bench.soak")

TOKEN = "soak-token-0123456789"
TOLERANCE = 1e-5  # natural log
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
SCORE = "/nlmserve.v1.LanguageModel/ScoreNgrams"
METHODS = (SCORE, "/nlmserve.v1.LanguageModel/ScoreSentences", "/nlmserve.v1.LanguageModel/GetModelInfo")


@dataclass(frozen=True)
class SoakConfig:
    """One soak run (flags of the same names)."""

    model: str | None = None
    minutes: float = 10.0
    decoders: int = 8
    rescorers: int = 2
    max_concurrent_rpcs: int = 64
    max_message_bytes: int = 8 * 1024 * 1024
    fault_every: float = 15.0
    seed: int = 0


# ---------------------------------------------------------------------- models and replicas
def two_models(model: str | None, work: Path) -> tuple[Path, Path]:
    """The served model and a second one of the same vocabulary (for good reloads)."""
    from nlmserve.lm.scoring import LanguageModel

    if model is None:
        first = work / "a.nlm"
        log.info("training the small test model into %s", first)
        train_small_model(first)
    else:
        first = Path(model)
    second = work / "b.nlm"
    lm = LanguageModel.load(first, device="cpu")
    # A second model of the same vocabulary: the same file with every weight scaled.
    from nlmserve.lm.model_file import read_model_file, save_model

    mf = read_model_file(first)
    net = mf.build_model()
    for p in net.parameters():
        p.data.mul_(0.9)
    save_model(second, net, lm.vocab, mf.classes, objective=mf.objective, lowercase=mf.lowercase,
               training={"note": "bench/soak.py: the served model's weights x 0.9"},
               unigram_counts=mf.tensors.get("unigram_counts"))
    return first, second


class Replica:
    """One ``nlmserve serve`` subprocess on a fixed port (0 the first time), logging to a file."""

    def __init__(self, name: str, model: Path, work: Path, cfg: SoakConfig, tokens: Path) -> None:
        self.name, self.model, self.work, self.cfg, self.tokens = name, model, work, cfg, tokens
        self.port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.up = threading.Event()
        self.totals: Counter[str] = Counter()  # metric samples of the incarnations before this one

    def start(self) -> None:
        from nlmserve.common.serve_process import start_server

        flags = ["--token-file", str(self.tokens), "--torch-threads", "1",
                 "--max-concurrent-rpcs", str(self.cfg.max_concurrent_rpcs),
                 "--max-message-bytes", str(self.cfg.max_message_bytes), "--first-message-seconds", "5"]
        with open(self.work / f"{self.name}.log", "a", encoding="utf-8") as stderr:
            server = start_server(self.model, flags, port=self.port, metrics_port=0, stderr=stderr)
        self.proc, self.port, self.metrics_port = server.process, server.port, server.metrics_port or 0
        self.up.set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def samples(self) -> Counter[str]:
        """``nlmserve_refused_total`` and ``nlmserve_requests_total`` samples of this incarnation."""
        out: Counter[str] = Counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(("nlmserve_refused_total{", "nlmserve_requests_total{")):
                        key, _, value = line.rpartition(" ")
                        out[key] += int(float(value))
        except OSError as e:
            log.warning("metrics of %s: %s", self.name, e)
        return out

    def kill_and_restart(self) -> None:
        assert self.proc is not None
        self.totals += self.samples()
        self.up.clear()
        self.proc.kill()
        self.proc.wait()
        self.start()

    def stop(self) -> Counter[str]:
        """SIGTERM; the counts of every incarnation."""
        total = self.totals + self.samples()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return total


# ---------------------------------------------------------------------- authorised clients
@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    wrong: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def add(self, other: "Tally") -> None:
        self.sent += other.sent
        self.answered += other.answered
        self.wrong += other.wrong
        self.failed += other.failed
        self.latencies += other.latencies

    def summary(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies) * 1000.0
        return {"sent": self.sent, "answered": self.answered, "wrong": self.wrong, "failed": dict(self.failed),
                "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
                "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None}


def authorised(kind: str, targets: list[str], ids: np.ndarray, expected: dict[str, np.ndarray], sizes: tuple[int, int],
               stop: threading.Event, seed: int, tally: Tally) -> None:
    from nlmserve.client import LMClient

    rng = np.random.default_rng(seed)
    with LMClient(targets, token=TOKEN, timeout=60, allow_mixed_models=True) as client:
        while not stop.is_set():
            n = int(rng.integers(sizes[0], sizes[1] + 1))
            start = int(rng.integers(0, len(ids) - n))
            rows = ids[start : start + n]
            tally.sent += 1
            began = time.perf_counter()
            try:
                got = client.score_ids(rows, log_base="ln")
            except Exception as e:  # every failure is counted by its class (and gRPC code)
                code = getattr(e, "code", None)
                tally.failed[type(e).__name__ + (f"({code.name})" if code is not None else "")] += 1
                log.warning("%s request failed: %s", kind, e)
                continue
            tally.latencies.append(time.perf_counter() - began)
            want = expected.get(got.model_hash)
            if (want is None or got.log_probs.shape != (n,)
                    or not np.all(np.abs(got.log_probs - want[start : start + n]) <= TOLERANCE)):
                tally.wrong += 1
                log.error("%s: a wrong answer from model %s", kind, got.model_hash)
            else:
                tally.answered += 1
            if kind == "decoder":
                time.sleep(0.002)


def probe(replicas: list[Replica], stop: threading.Event, counts: Counter[str]) -> None:
    """Health/Check as an orchestrator's probe makes it: a new connection each time."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    while not stop.wait(0.5):
        for r in replicas:
            if not r.up.is_set():
                counts["skipped_down"] += 1
                continue
            with grpc.insecure_channel(r.target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                try:
                    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    ok = answer.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError as e:
                    if not r.up.is_set():  # killed while the probe was on its way
                        counts["skipped_down"] += 1
                        continue
                    ok = False
                    log.error("health probe of %s failed: %s %s", r.name, e.code().name, e.details())
            counts["probes"] += 1
            counts["failed"] += 0 if ok else 1


# ---------------------------------------------------------------------- hostile clients
async def _never_sends(stop: asyncio.Event) -> AsyncIterator[bytes]:
    await stop.wait()
    if False:  # pragma: no cover (an async generator that yields nothing)
        yield b""


async def hostile_grpc(replicas: list[Replica], cfg: SoakConfig, stop_flag: threading.Event,
                       out: dict[str, Counter[str]]) -> None:
    """Held Watch streams, half-open ScoreNgrams calls, random and oversized messages."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stop = asyncio.Event()
    rng = random.Random(cfg.seed)
    streams = cfg.max_concurrent_rpcs
    oversized = rng.randbytes(cfg.max_message_bytes + 1024)

    def identity(b: bytes) -> bytes:
        return b

    async def watcher(r: Replica) -> None:  # one connection each; read until the stream is cut
        while True:
            channel = grpc.aio.insecure_channel(r.target, options=[("grpc.use_local_subchannel_pool", 1)])
            try:
                first = True
                async for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                    if first:
                        out["watch"]["held"] += 1
                        first = False
            except grpc.aio.AioRpcError as e:
                out["watch"][e.code().name] += 1
            finally:
                await channel.close(None)
            await asyncio.sleep(0.5)

    async def half_open(r: Replica) -> None:
        channel = None
        while not stop.is_set():
            if channel is None or not r.up.is_set():
                if channel is not None:
                    await channel.close(None)
                channel = grpc.aio.insecure_channel(r.target, options=[("grpc.use_local_subchannel_pool", 1)])
            calls = [channel.stream_unary(SCORE, None, None)(_never_sends(stop), timeout=30) for _ in range(streams)]
            for call in calls:
                try:
                    await call
                    out["half_open"]["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    out["half_open"][e.code().name] += 1
            await asyncio.sleep(0.2)
        if channel is not None:
            await channel.close(None)

    async def garbage(r: Replica) -> None:
        while not stop.is_set():
            channel = grpc.aio.insecure_channel(r.target, options=[("grpc.max_send_message_length", -1)])
            for method in METHODS:
                for token in (False, True):
                    for kind in ("random", "oversized"):
                        body = rng.randbytes(rng.randint(1, 4096)) if kind == "random" else oversized
                        metadata = (("authorization", f"Bearer {TOKEN}"),) if token else None
                        try:
                            await channel.unary_unary(method, request_serializer=identity,
                                                      response_deserializer=identity)(body, metadata=metadata,
                                                                                      timeout=10)
                            out[f"{kind}{'_token' if token else ''}"]["OK"] += 1
                        except grpc.aio.AioRpcError as e:
                            out[f"{kind}{'_token' if token else ''}"][e.code().name] += 1
            await channel.close(None)
            await asyncio.sleep(1.0)

    tasks = [asyncio.create_task(watcher(r)) for r in replicas for _ in range(streams)]
    tasks += [asyncio.create_task(half_open(r)) for r in replicas]
    tasks += [asyncio.create_task(garbage(r)) for r in replicas]
    while not stop_flag.is_set():
        await asyncio.sleep(0.5)
    stop.set()
    for task in tasks[: len(replicas) * streams]:  # the watchers
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def raw_bytes(replicas: list[Replica], stop: threading.Event, counts: Counter[str], seed: int) -> None:
    rng = random.Random(seed + 1)
    while not stop.wait(0.2):
        for r in replicas:
            try:
                with socket.create_connection(("127.0.0.1", r.port), timeout=2) as s:
                    s.sendall(rng.randbytes(rng.randint(1, 4096)))
                    counts["sent"] += 1
            except OSError:
                counts["refused"] += 1


# ---------------------------------------------------------------------- faults
def _put(src: Path | None, dst: Path, kind: str) -> None:
    """Put a good copy of ``src``, or a bad file of ``kind``, at ``dst`` atomically."""
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists() or tmp.is_fifo():
        tmp.unlink()
    if kind == "good":
        assert src is not None
        shutil.copyfile(src, tmp)
    elif kind == "garbage":
        tmp.write_bytes(os.urandom(4096))
    elif kind == "fifo":
        os.mkfifo(tmp)
    else:  # truncated
        assert src is not None
        tmp.write_bytes(src.read_bytes()[:-100])
    os.replace(tmp, dst)


def faults(replicas: list[Replica], models: tuple[Path, Path], cfg: SoakConfig, stop: threading.Event,
           events: list[dict[str, Any]], counts: Counter[str]) -> None:
    bad = ("garbage", "fifo", "truncated")
    turn = 0
    began = time.monotonic()
    while not stop.wait(cfg.fault_every):
        r = replicas[turn % len(replicas)]
        assert r.proc is not None
        at = round(time.monotonic() - began, 1)
        if turn % 3 == 2:
            try:
                r.kill_and_restart()
            except (OSError, RuntimeError) as e:  # counted: the run then misses its target
                counts["restart_failed"] += 1
                events.append({"t": at, "replica": r.name, "fault": f"restart failed: {e}"})
                log.error("replica %s did not restart: %s", r.name, e)
                time.sleep(1.0)
                continue
            counts["kill_restart"] += 1
            events.append({"t": at, "replica": r.name, "fault": "SIGKILL + restart"})
        else:
            kind = bad[(turn // 3) % len(bad)]
            _put(models[0], r.model, kind)
            r.proc.send_signal(signal.SIGHUP)
            counts["sighup_bad"] += 1
            time.sleep(1.0)
            good = models[(turn // 3 + 1) % 2]
            _put(good, r.model, "good")
            r.proc.send_signal(signal.SIGHUP)
            counts["sighup_good"] += 1
            events.append({"t": at, "replica": r.name, "fault": f"SIGHUP {kind}, then SIGHUP {good.name}"})
        turn += 1


# ---------------------------------------------------------------------- the run
def expected_scores(models: tuple[Path, Path]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    import torch

    from nlmserve.lm.scoring import LanguageModel

    torch.set_num_threads(1)
    lms = [LanguageModel.load(m, device="cpu") for m in models]
    with open(DEV_TXT, encoding="utf-8") as f:
        sentences = [line.split() for line in f if line.strip()]
    ids, _, _, _ = lms[0].sentence_ngrams(sentences)
    ids = np.asarray(ids, dtype=np.uint32)
    return ids, {lm.model_hash: np.asarray(lm.score_ngrams(ids.astype(np.int64)), dtype=np.float32) for lm in lms}


def run(cfg: SoakConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="nlmserve-soak-") as tmp:
        work = Path(tmp)
        models = two_models(cfg.model, work)
        ids, expected = expected_scores(models)
        tokens = work / "tokens"
        tokens.write_text(TOKEN + "\n", encoding="utf-8")
        replicas = []
        for name in ("A", "B"):
            served = work / f"served-{name}.nlm"
            shutil.copyfile(models[0], served)
            replicas.append(Replica(name, served, work, cfg, tokens))
        for r in replicas:
            r.start()
        targets = [r.target for r in replicas]
        stop = threading.Event()
        tallies = {"decoder": [Tally() for _ in range(cfg.decoders)], "rescoring": [Tally() for _ in range(cfg.rescorers)]}
        probes: Counter[str] = Counter()
        raw: Counter[str] = Counter()
        fault_counts: Counter[str] = Counter()
        events: list[dict[str, Any]] = []
        hostile: dict[str, Counter[str]] = {k: Counter() for k in ("watch", "half_open", "random", "random_token",
                                                                    "oversized", "oversized_token")}
        loop = asyncio.new_event_loop()
        threads = [threading.Thread(target=loop.run_until_complete,
                                    args=(hostile_grpc(replicas, cfg, stop, hostile),), daemon=True),
                   threading.Thread(target=raw_bytes, args=(replicas, stop, raw, cfg.seed), daemon=True),
                   threading.Thread(target=probe, args=(replicas, stop, probes), daemon=True)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # the hostile clients hold their streams before the measured load starts
        for kind, sizes in (("decoder", (1, 50)), ("rescoring", (5_000, 20_000))):
            for i, tally in enumerate(tallies[kind]):
                threads.append(threading.Thread(target=authorised, args=(kind, targets, ids, expected, sizes, stop,
                                                                          cfg.seed + 100 * i + len(kind), tally),
                                                daemon=True))
                threads[-1].start()
        injector = threading.Thread(target=faults, args=(replicas, models, cfg, stop, events, fault_counts),
                                    daemon=True)
        injector.start()
        began = time.monotonic()
        stop.wait(cfg.minutes * 60.0)
        stop.set()
        for t in [injector, *threads]:
            t.join(120)
        seconds = time.monotonic() - began
        server_counts: Counter[str] = Counter()
        for r in replicas:
            server_counts += r.stop()
        loop.close()
    every = Tally()
    result_clients: dict[str, Any] = {}
    for kind, group in tallies.items():
        total = Tally()
        for tally in group:
            total.add(tally)
        every.add(total)
        result_clients[kind] = total.summary()
    result_clients["all"] = every.summary()
    result = {
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "machine": machine(),
        "config": asdict(cfg),
        "seconds": round(seconds, 1),
        "authorised": result_clients,
        "health_probes": {"sent": probes["probes"], "failed": probes["failed"],
                          "skipped_while_killed": probes["skipped_down"]},
        "hostile": {kind: dict(c) for kind, c in hostile.items()} | {"raw_tcp_bytes": dict(raw)},
        "faults": dict(fault_counts),
        "fault_events": events,
        "server_counts": dict(sorted(server_counts.items())),
    }
    result["target_met"] = meets_target(result)
    return result


def meets_target(result: dict[str, Any]) -> bool:
    """0 failed or wrong answers for the authorised clients (some answered), 0 failed
    health probes, and every killed replica restarted."""
    every = result["authorised"]["all"]
    return (not sum(every["failed"].values()) and every["wrong"] == 0 and every["answered"] > 0
            and result["health_probes"]["failed"] == 0 and not result["faults"].get("restart_failed"))


# ---------------------------------------------------------------------- the report
def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [BEGIN,
             f"`{shown_command(result['command'])}`: {result['seconds'] / 60:.1f} minutes on {result['machine']['cores']} cores "
             f"({result['machine']['cpu']}), two replicas, `--max-concurrent-rpcs {cfg['max_concurrent_rpcs']}`.",
             "",
             "| authorised clients | sent | answered | failed | wrong | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for kind in ("decoder", "rescoring", "all"):
        c = result["authorised"][kind]
        failed = ", ".join(f"{k} {v}" for k, v in c["failed"].items()) or "0"
        lines.append(f"| {kind} | {c['sent']} | {c['answered']} | {failed} | {c['wrong']} | {c['p50_ms']} | "
                     f"{c['p99_ms']} |")
    h = result["health_probes"]
    hostile = result["hostile"]

    def outcomes(kind: str) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(hostile.get(kind, {}).items())) or "none"

    f = result["faults"]
    counts = result["server_counts"]
    unauthenticated = sum(v for k, v in counts.items() if 'code="UNAUTHENTICATED"' in k)
    limits = ", ".join(f"{k.split('=', 1)[1].rstrip('}')} {v}" for k, v in counts.items()
                       if k.startswith("nlmserve_refused_total")) or "none"
    lines += ["",
              f"Health probes: {h['sent']} sent, {h['failed']} failed ({h['skipped_while_killed']} skipped while "
              "their replica was killed).",
              f"Faults: {f.get('sighup_bad', 0)} SIGHUP reloads of bad files, {f.get('sighup_good', 0)} of good "
              f"ones, {f.get('kill_restart', 0)} SIGKILLs of a replica (restarted on its port).",
              "",
              "| hostile client (no token unless said) | got |",
              "|---|---|",
              f"| Watch streams held open ({cfg['max_concurrent_rpcs']} per replica) | {outcomes('watch')} |",
              f"| ScoreNgrams calls that never send ({cfg['max_concurrent_rpcs']} at a time per replica, re-opened "
              "when refused) | "
              f"{outcomes('half_open')} |",
              f"| random bytes on three methods | {outcomes('random')} |",
              f"| random bytes, with the token | {outcomes('random_token')} |",
              f"| messages over `--max-message-bytes` | {outcomes('oversized')} |",
              f"| the same with the token | {outcomes('oversized_token')} |",
              f"| raw TCP connections of random bytes | {outcomes('raw_tcp_bytes')} |",
              "",
              f"The replicas counted {unauthenticated} calls refused UNAUTHENTICATED and, by limit "
              f"(`nlmserve_refused_total`): {limits}.",
              "",
              "Target (0 failed or wrong answers, 0 failed probes): "
              + ("**met**." if result["target_met"] else "**not met**."),
              END]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model file (default: train the small test model)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--decoders", type=int, default=8, help="decoder-like client threads")
    p.add_argument("--rescorers", type=int, default=2, help="rescoring-like client threads")
    p.add_argument("--max-concurrent-rpcs", type=int, default=64, help="the replicas' limit, and the hostile streams")
    p.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--doc", help="write the table into this document between the soak markers")
    p.add_argument("--render", help="make the table from this JSON instead of running")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.render:
        import json

        result = json.loads(Path(args.render).read_text(encoding="utf-8"))
    else:
        result = run(SoakConfig(model=args.model, minutes=args.minutes, decoders=args.decoders,
                                rescorers=args.rescorers, max_concurrent_rpcs=args.max_concurrent_rpcs,
                                fault_every=args.fault_every, seed=args.seed))
        if args.json:
            write_json(Path(args.json), result)
    table = render(result)
    print(table, end="")
    if args.doc:
        write_section(Path(args.doc), BEGIN, END, table)
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
