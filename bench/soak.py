"""Soak under hostile clients and faults: nothing lost, nothing wrong, no failed probe, and
memory back where it started once the attackers leave.

    .venv/bin/python -m bench.soak [--model M] [--minutes 10] [--frontend python|native|both] [--json bench/results/soak.json] [--doc experiments/hostile-clients.md --doc docs/operating.md --doc docs/performance-serving.md]
    .venv/bin/python -m bench.soak --render bench/results/soak.json [--doc experiments/hostile-clients.md --doc docs/operating.md --doc docs/performance-serving.md]

Two ``nlmserve serve`` replicas (``--frontend python``, or ``--frontend native``: the C++
front end before each model server, built with ``make cpp`` when it is missing; ``both``
runs one after the other, each for ``--minutes``) serve a model on 127.0.0.1 with a token
file of two tokens: the authorised clients' and the hostile clients' (those that hold one),
so that each side is one client to the servers' ``--max-rpcs-per-client`` share. Each run
goes through four phases:

1. **warm-up** (``--warmup-seconds``): the authorised clients alone; then they pause and,
   after ``quiet_seconds`` (2), the resident memory (VmRSS) of every server process (the model
   server, and the native front end) and the size of /metrics are taken as the start.
2. **attack** (``--minutes``): the authorised clients again, with every hostile client of
   ``--attacks`` (bench/soak_attacks.py: held and flooding health Watch streams, half-open
   calls and half-open health Checks, random and oversized messages, gzip bombs, 1 ms deadlines, invented method
   names, server-streaming calls never read, rapid reset, large metadata, slow
   connections, random TCP bytes, clients killed with large requests in flight) and the
   faults: every ``--fault-every`` seconds a replica's model file replaced by a bad one
   (garbage, a FIFO, a truncated copy) + SIGHUP, then by a good one (the other of two
   models of one vocabulary) + SIGHUP, in turn on each; or replica B killed with SIGKILL
   (its whole process tree) and restarted on its port. Replica A is never killed, so that
   its memory is measured over the whole run. Memory and /metrics are taken again at the
   end, the attackers still there.
3. **settle** (``--settle-seconds``): the attackers gone, the authorised clients on.
4. the authorised clients pause, and after ``quiet_seconds`` memory is taken a last time.

Health probes (Health/Check of each replica every 0.5 s on a new connection, connection and
answer within 2 s, from a process of their own as an orchestrator's: bench/soak_probe.py)
run throughout; those of a replica killed and not yet listening again are not counted.
Their times are kept, and each failure with its phase (no connection, or no answer), the
kernel's count of connections dropped at a full accept queue, and the replica's log lines
written meanwhile. The authorised clients: ``--decoders`` decoder-like threads (1-50 packed n-grams back to back)
and ``--rescorers`` rescoring-like ones (5,000-20,000), each a replicated ``LMClient`` over
both replicas (round_robin, health Watch of each, the token, ``allow_mixed_models``), one
more that builds a new replicated ``LMClient`` every second (new connections, new Watch
streams), and a strict one: plain gRPC calls to replica A that are never retried. Every
answer is compared with the in-process score of the model its ``model_hash`` names (within
1e-5, natural log); what the clients retried (and so hid) is counted by code.

The target, per front end: 0 failed or wrong answers (some answered), 0 failed probes, every
killed replica restarted, and every server process's resident memory after the settle
within 10% of its start (exit 1 otherwise). ``--json`` writes the result; each ``--doc``
document gets every table between ``<!-- soak:begin -->`` and ``<!-- soak:end -->``, and
the verdict alone between ``<!-- soak summary:begin -->`` and ``<!-- soak summary:end -->``,
and a table cell between ``<!-- soak cell:begin -->`` and ``<!-- soak cell:end -->``,
whichever markers it has; ``--render`` makes them from a JSON. Without ``--model`` two
small models are trained first (the test fixture's recipe; a few seconds). The authorised clients are in
bench/soak_clients.py, the verdict and the tables in bench/soak_report.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench._common import (exit_with, machine, read_doc, read_saved, resident_bytes, signalled_heaps,
                           tree_pids, write_json, write_section)
from bench.load import DEV_TXT, train_small_model
from bench.soak_attacks import Hostile
from bench.soak_clients import TOKEN, Load, Tally, authorised, strict
from bench.soak_hostile import ATTACKS, REPO, HostileConfig
from bench.soak_report import (BEGIN, CELL_BEGIN, CELL_END, END, SUMMARY_BEGIN, SUMMARY_END, misses, render,
                               render_cell, render_summary)

log = logging.getLogger("bench.soak")

#: The hostile clients that hold a token hold one of their own: a client of its own to the
#: servers' per-client share (``--max-rpcs-per-client``), as a second decoder host would be.
HOSTILE_TOKEN = "soak-token-hostile-9876543210"
FRONTENDS = ("python", "native")


@dataclass(frozen=True)
class SoakConfig:
    """One soak run (flags of the same names).

    Fields:
        model: the served model file (None: train the small test model).
        minutes: the attack phase, per front end.
        frontend: ``python``, ``native`` or ``both`` (one run after the other).
        decoders: decoder-like authorised client threads.
        rescorers: rescoring-like authorised client threads.
        max_concurrent_rpcs: the replicas' limit (also the number of held Watch streams and
            half-open calls per replica).
        max_rpcs_per_client: the replicas' per-client share of it (a client is its token).
        max_health_watches: the replicas' Watch pool (the flood asks for more).
        max_message_bytes: the replicas' largest message.
        fault_every: seconds between two faults.
        warmup_seconds: the authorised clients alone before memory is first taken.
        settle_seconds: the authorised clients alone after the attackers leave.
        quiet_seconds: the authorised clients paused before memory is taken, at the start
            and after the settle.
        seed: of the hostile clients' random bytes and of the clients' requests.
        poll_engine: gRPC's polling engine in the replicas (GRPC_POLL_STRATEGY): None for
            gRPC's default (epoll1 on Linux), or e.g. "poll" (experiments/results.md says why).
        serve_args: more flags of the replicas' ``nlmserve serve`` (after the soak's own).
        hostile: what the hostile clients do.
    """

    model: str | None = None
    minutes: float = 10.0
    frontend: str = "python"
    decoders: int = 8
    rescorers: int = 2
    max_concurrent_rpcs: int = 64
    max_rpcs_per_client: int = 32
    max_health_watches: int = 1024
    max_message_bytes: int = 8 * 1024 * 1024
    fault_every: float = 15.0
    warmup_seconds: float = 20.0
    settle_seconds: float = 30.0
    quiet_seconds: float = 2.0
    seed: int = 0
    poll_engine: str | None = None
    serve_args: tuple[str, ...] = ()
    hostile: HostileConfig = field(default_factory=HostileConfig)

    def __post_init__(self) -> None:
        if self.frontend not in (*FRONTENDS, "both"):
            raise ValueError(f"--frontend must be python, native or both, not {self.frontend!r}")

    @property
    def frontends(self) -> tuple[str, ...]:
        return FRONTENDS if self.frontend == "both" else (self.frontend,)


# ---------------------------------------------------------------------- models and replicas
def two_models(model: str | None, work: Path) -> tuple[Path, Path]:
    """The served model and a second one of the same vocabulary (for good reloads)."""
    from nlmserve.lm.model_file import read_model_file, save_model
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
    mf = read_model_file(first)
    net = mf.build_model()
    for p in net.parameters():
        p.data.mul_(0.9)
    save_model(second, net, lm.vocab, mf.classes, objective=mf.objective, lowercase=mf.lowercase,
               training={"note": "bench/soak.py: the served model's weights x 0.9"},
               unigram_counts=mf.tensors.get("unigram_counts"))
    return first, second


def native_binary() -> Path:
    """``nlmserve_frontend`` as ``serve --frontend native`` finds it, built with ``make cpp``
    when it is not there; SystemExit when it cannot be built."""
    from nlmserve.common.errors import InputError
    from nlmserve.server.frontend import find_binary

    try:
        return find_binary(None)
    except InputError:
        log.info("building the native front end: make cpp")
        done = subprocess.run(["make", "-C", str(REPO), "cpp"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the native front end could not be built (make cpp, exit {done.returncode}): "
                             f"{done.stderr.strip()[-400:]}") from None
    return find_binary(None)


class ReplicaStartError(RuntimeError):
    """A replica's server did not start (its flags, its model, its port)."""


class Replica:
    """One ``nlmserve serve`` subprocess (with its native front end, if asked) on a fixed port
    (0 the first time), logging to a file."""

    def __init__(self, name: str, model: Path, work: Path, cfg: SoakConfig, tokens: Path, frontend: str) -> None:
        self.name, self.model, self.work, self.cfg, self.tokens = name, model, work, cfg, tokens
        self.frontend = frontend
        self.port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.up = threading.Event()
        self.restarts = 0
        self.totals: Counter[str] = Counter()  # metric samples of the incarnations before this one

    def start(self) -> None:
        from nlmserve.common.errors import NlmserveError
        from nlmserve.common.serve_process import start_server

        flags = ["--token-file", str(self.tokens), "--torch-threads", "1",
                 "--max-concurrent-rpcs", str(self.cfg.max_concurrent_rpcs),
                 "--max-rpcs-per-client", str(self.cfg.max_rpcs_per_client),
                 "--max-health-watches", str(self.cfg.max_health_watches),
                 "--max-message-bytes", str(self.cfg.max_message_bytes), "--first-message-seconds", "5",
                 "--frontend", self.frontend, *self.cfg.serve_args]
        log_path = self.log_path
        with open(log_path, "a", encoding="utf-8") as stderr:
            try:
                env = None if self.cfg.poll_engine is None else {**os.environ,
                                                                  "GRPC_POLL_STRATEGY": self.cfg.poll_engine}
                server = start_server(self.model, flags, port=self.port, metrics_port=0, stderr=stderr, env=env)
            except NlmserveError as e:
                tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
                raise ReplicaStartError(f"replica {self.name} did not start: {e}; its log ends: {' | '.join(tail)}") from e
        self.proc, self.port, self.metrics_port = server.process, server.port, server.metrics_port or 0
        self.up.set()

    @property
    def log_path(self) -> Path:
        return self.work / f"{self.name}-{self.frontend}.log"

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> list[str]:
        """The lines of its log from byte ``offset`` on."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read(1 << 16).decode("utf-8", errors="replace").splitlines()
        except OSError:
            return []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> str:
        """This incarnation's /metrics ("" when it cannot be read)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
                return str(r.read().decode())
        except OSError as e:
            log.warning("metrics of %s: %s", self.name, e)
            return ""

    def samples(self) -> Counter[str]:
        """``nlmserve_refused_total`` and ``nlmserve_requests_total`` samples of this incarnation."""
        out: Counter[str] = Counter()
        for line in self.metrics().splitlines():
            if line.startswith(("nlmserve_refused_total{", "nlmserve_requests_total{")):
                key, _, value = line.rpartition(" ")
                out[key] += int(float(value))
        return out

    def memory(self) -> dict[str, int]:
        """Resident bytes of each of its processes, by role (the ``serve`` process, its children
        by program name)."""
        out: dict[str, int] = {}
        if self.proc is None:
            return out
        for i, pid in enumerate(tree_pids(self.proc.pid)):
            rss = resident_bytes(pid)
            if rss is not None:
                out["nlmserve serve" if i == 0 else _program(pid)] = rss
        return out

    def heap(self, timeout: float = 5.0) -> dict[str, float]:
        """malloc's heap in use, MiB, of each of its processes by role (as :meth:`memory`): the
        lines ``serve`` and the native front end log on SIGUSR1 ({} where none came)."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        pids = tree_pids(self.proc.pid)
        programs = [_program(pid) for pid in pids[1:]]
        roles = {"nlmserve.server.app": "nlmserve serve",
                 "nlmserve.server.frontend": next((p for p in programs if "frontend" in p), "front end")}
        found = signalled_heaps(self.proc, self.log_path, 1 + (self.frontend == "native"), timeout)
        return {roles[logger]: heap["in_use"] for logger, heap in found.items() if logger in roles}

    def kill_and_restart(self) -> None:
        """SIGKILL to its whole process tree (a host that dies), then a start on the same port."""
        assert self.proc is not None
        self.totals += self.samples()
        self.up.clear()
        pids = tree_pids(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for pid in pids[1:]:  # the front end: not our child, so wait for it to be gone
            deadline = time.monotonic() + 10
            while resident_bytes(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
        self.restarts += 1
        self.start()

    def stop(self) -> Counter[str]:
        """SIGTERM; the counts of every incarnation."""
        total = self.totals + self.samples()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in tree_pids(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.wait()
        return total


def _program(pid: int) -> str:
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name
    except OSError:
        return str(pid)


class MemoryWatch:
    """The replicas' resident memory sampled every second on a thread: the peak of each process."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.peak: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def snapshot(self) -> dict[tuple[str, str], int]:
        out = {(r.name, role): rss for r in self.replicas for role, rss in r.memory().items()}
        for key, rss in out.items():
            self.peak[key] = max(self.peak.get(key, 0), rss)
        return out

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.snapshot()

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def listen_drops() -> int:
    """The kernel's count of connections dropped at a full accept queue (TcpExt
    ListenOverflows + ListenDrops in /proc/net/netstat; the machine's, 0 where unreadable)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            return int(row.get("ListenOverflows", 0)) + int(row.get("ListenDrops", 0))
    return 0


class Probes:
    """What the health probes saw: counts, each probe's time, and each failure with its
    time (``at``; ``t``: seconds from the run's start, warm-up included), phase
    (``connect``: no connection within the deadline; ``answer``: connected, no answer in
    what was left of it), the kernel's accept-queue drops since the run began
    and the replica's log lines written while it was on its way."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seconds: list[float] = []
        self.failures: list[dict[str, Any]] = []
        self.began = time.monotonic()
        self.drops_at_start = listen_drops()

    def summary(self) -> dict[str, Any]:
        times = np.array(self.seconds) if self.seconds else np.zeros(1)
        return {"sent": self.counts["probes"], "failed": self.counts["failed"],
                "skipped_while_killed": self.counts["skipped_down"],
                "p50_ms": round(float(np.percentile(times, 50)) * 1e3, 1),
                "p99_ms": round(float(np.percentile(times, 99)) * 1e3, 1),
                "max_ms": round(float(times.max()) * 1e3, 1),
                "accept_queue_drops": listen_drops() - self.drops_at_start,
                "own_process": True,  # the probes ran in a process of their own (older runs: in the soak's)
                "failures": self.failures}


PROBE_DEADLINE = 2.0


def probe(replicas: list[Replica], stop: threading.Event, out: Probes) -> None:
    """Health/Check as an orchestrator's probe makes it: from a process of its own
    (bench/soak_probe.py), a new connection each time, the answer within PROBE_DEADLINE s."""
    child = subprocess.Popen([sys.executable, "-m", "bench.soak_probe", str(PROBE_DEADLINE)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert child.stdin is not None and child.stdout is not None
    try:
        while not stop.wait(0.5):
            for r in replicas:
                if not r.up.is_set():
                    out.counts["skipped_down"] += 1
                    continue
                log_from = r.log_size()
                sent = time.monotonic()
                child.stdin.write(r.target + "\n")
                line = child.stdout.readline()
                if not line:
                    raise RuntimeError(f"the probe process ended (exit status {child.wait()})")
                seen = json.loads(line)
                code, ok = seen["code"], seen["code"] == "SERVING"
                if not ok and code != "NOT_SERVING":
                    if not r.up.is_set():  # killed while the probe was on its way
                        out.counts["skipped_down"] += 1
                        continue
                    log.error("health probe of %s failed (%s): %s %s", r.name, seen["phase"], code, seen["details"])
                out.counts["probes"] += 1
                out.seconds.append(seen["seconds"])
                if not ok:
                    out.counts["failed"] += 1
                    out.failures.append({"at": time.strftime("%H:%M:%S"), "t": round(sent - out.began, 1),
                                         "replica": r.name, "phase": seen["phase"] or "answer", "code": code,
                                         "seconds": round(seen["seconds"], 2),
                                         "accept_queue_drops": listen_drops() - out.drops_at_start,
                                         "log": r.log_since(log_from)[-20:]})
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


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
    """Every third fault a SIGKILL of the last replica; the others reloads, in turn on each."""
    bad = ("garbage", "fifo", "truncated")
    turn = reloads = 0
    began = time.monotonic()
    while not stop.wait(cfg.fault_every):
        at = round(time.monotonic() - began, 1)
        if turn % 3 == 2 and len(replicas) > 1:
            r = replicas[-1]
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
            r = replicas[reloads % len(replicas)]
            assert r.proc is not None
            kind = bad[(reloads // len(replicas)) % len(bad)]
            _put(models[0], r.model, kind)
            r.proc.send_signal(signal.SIGHUP)
            counts["sighup_bad"] += 1
            time.sleep(1.0)
            good = models[(reloads // len(replicas) + 1) % 2]
            _put(good, r.model, "good")
            r.proc.send_signal(signal.SIGHUP)
            counts["sighup_good"] += 1
            events.append({"t": at, "replica": r.name, "fault": f"SIGHUP {kind}, then SIGHUP {good.name}"})
            reloads += 1
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


def hostile_requests(ids: np.ndarray, cfg: SoakConfig, work: Path) -> tuple[list[bytes], Path]:
    """The 1 ms-deadline clients' requests (1 to 5,000 n-grams), and the vanishing clients'
    request (``vanish_ngrams`` n-grams) in a file."""
    from nlmserve.proto import lm_pb2

    def request(n: int) -> bytes:
        rows = np.ascontiguousarray(np.resize(ids, (n, ids.shape[1])), dtype="<u4")
        return lm_pb2.ScoreNgramsRequest(packed_ids=rows.tobytes(), packed_order=rows.shape[1],
                                         log_base=lm_pb2.LN).SerializeToString()

    path = work / "vanish.bin"
    path.write_bytes(request(cfg.hostile.vanish_ngrams))
    return [request(n) for n in (1, 10, 100, 1_000, 5_000)], path


def _quiet_memory(load: Load, memory: MemoryWatch, seconds: float
                  ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
    """Every process's resident bytes and malloc's heap in use (MiB), the authorised clients
    paused for ``seconds``."""
    load.pause()
    time.sleep(seconds)
    taken = memory.snapshot()
    heaps = {(r.name, role): mib for r in memory.replicas for role, mib in r.heap().items()}
    load.resume()
    return taken, heaps


def _metrics_size(replicas: list[Replica]) -> dict[str, dict[str, int]]:
    out = {}
    for r in replicas:
        text = r.metrics()
        out[r.name] = {"bytes": len(text.encode()),
                       "series": sum(1 for line in text.splitlines() if line and not line.startswith("#"))}
    return out


def run_frontend(cfg: SoakConfig, frontend: str, models: tuple[Path, Path], ids: np.ndarray,
                 expected: dict[str, np.ndarray], work: Path) -> dict[str, Any]:
    """One front end's run through its four phases (the module's docstring)."""
    tokens = work / "tokens"
    tokens.write_text(f"{TOKEN}\n{HOSTILE_TOKEN}\n", encoding="utf-8")
    requests, vanish_request = hostile_requests(ids, cfg, work)
    replicas = []
    for name in ("A", "B"):
        served = work / f"served-{name}-{frontend}.nlm"
        shutil.copyfile(models[0], served)
        replicas.append(Replica(name, served, work, cfg, tokens, frontend))
    with ThreadPoolExecutor(len(replicas)) as pool:  # side by side: each loads the model
        list(pool.map(Replica.start, replicas))
    targets = [r.target for r in replicas]
    stop, stop_faults, load = threading.Event(), threading.Event(), Load()
    kinds = {"decoder": cfg.decoders, "rescoring": cfg.rescorers, "reconnecting": 1, "strict": 1}
    tallies = {kind: [Tally() for _ in range(n)] for kind, n in kinds.items()}
    probes = Probes()
    fault_counts: Counter[str] = Counter()
    events: list[dict[str, Any]] = []
    threads = [threading.Thread(target=probe, args=(replicas, stop, probes), daemon=True)]
    sizes = {"decoder": (1, 50), "rescoring": (5_000, 20_000), "reconnecting": (1, 50)}
    for kind, group in tallies.items():
        for i, tally in enumerate(group):
            seed = cfg.seed + 100 * i + len(kind)
            args: tuple[Any, ...]
            target: Callable[..., None]
            if kind == "strict":
                target, args = strict, (targets[0], ids, expected, load, stop, seed, tally)
            else:
                target, args = authorised, (kind, targets, ids, expected, sizes[kind], load, stop, seed, tally)
            threads.append(threading.Thread(target=target, args=args, daemon=True))
    hostile = Hostile(replicas, cfg.hostile, token=HOSTILE_TOKEN, max_concurrent_rpcs=cfg.max_concurrent_rpcs,
                      max_health_watches=cfg.max_health_watches, max_message_bytes=cfg.max_message_bytes,
                      requests=requests, vanish_request=vanish_request, seed=cfg.seed)
    injector = threading.Thread(target=faults, args=(replicas, models, cfg, stop_faults, events, fault_counts),
                                daemon=True)
    server_counts: Counter[str] = Counter()
    try:
        with MemoryWatch(replicas) as memory:
            for t in threads:
                t.start()
            log.info("%s: warm-up, %.0f s", frontend, cfg.warmup_seconds)
            time.sleep(cfg.warmup_seconds)
            start_memory, start_heap = _quiet_memory(load, memory, cfg.quiet_seconds)
            metrics_start = _metrics_size(replicas)
            log.info("%s: attack, %.1f minutes", frontend, cfg.minutes)
            hostile.start()
            injector.start()
            began = time.monotonic()
            time.sleep(cfg.minutes * 60.0)
            stop_faults.set()
            injector.join(120)  # a replica being restarted is up again
            attack_memory = memory.snapshot()
            metrics_end = _metrics_size(replicas)
            hostile.stop()
            seconds = time.monotonic() - began
            log.info("%s: settle, %.0f s", frontend, cfg.settle_seconds)
            time.sleep(cfg.settle_seconds)
            settled_memory, settled_heap = _quiet_memory(load, memory, cfg.quiet_seconds)
    finally:
        stop_faults.set()
        hostile.stop()
        stop.set()
        load.resume()
        for t in threads:
            t.join(120)
        for r in replicas:
            server_counts += r.stop()
    every = Tally()
    clients: dict[str, Any] = {}
    for kind, group in tallies.items():
        total = Tally()
        for tally in group:
            total.add(tally)
        every.add(total)
        clients[kind] = total.summary()
    clients["all"] = every.summary()
    restarts = {r.name: r.restarts for r in replicas}
    result: dict[str, Any] = {
        "frontend": frontend,
        "seconds": round(seconds, 1),
        "authorised": clients,
        "health_probes": probes.summary(),
        "hostile": hostile.report(),
        "faults": dict(fault_counts),
        "fault_events": events,
        "server_counts": dict(sorted(server_counts.items())),
        "memory": [{"replica": name, "process": role, "restarts": restarts[name],
                    "start_mb": _mb(start_memory[name, role]), "attack_end_mb": _mb(attack_memory.get((name, role))),
                    "peak_mb": _mb(memory.peak.get((name, role))), "settled_mb": _mb(settled_memory.get((name, role))),
                    "settled_over_start": (round(settled_memory[name, role] / start_memory[name, role], 3)
                                           if (name, role) in settled_memory else None),
                    "start_heap_mb": _round(start_heap.get((name, role))),
                    "settled_heap_mb": _round(settled_heap.get((name, role)))}
                   for name, role in sorted(start_memory)],
        "metrics": {name: {"start_bytes": metrics_start[name]["bytes"], "end_bytes": metrics_end[name]["bytes"],
                           "end_series": metrics_end[name]["series"]} for name in metrics_start},
    }
    result["missed"] = misses(result)
    result["target_met"] = not result["missed"]
    return result


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def _round(mib: float | None) -> float | None:
    return None if mib is None else round(mib, 1)


def run(cfg: SoakConfig) -> dict[str, Any]:
    info = machine()  # the load before the soak's own
    if "native" in cfg.frontends:
        native_binary()
    with tempfile.TemporaryDirectory(prefix="nlmserve-soak-") as tmp:
        work = Path(tmp)
        models = two_models(cfg.model, work)
        ids, expected = expected_scores(models)
        runs = [run_frontend(cfg, frontend, models, ids, expected, work) for frontend in cfg.frontends]
    info["load_average_end_1m"] = round(os.getloadavg()[0], 2)
    return {"command": " ".join(["bench/soak.py", *sys.argv[1:]]), "machine": info, "config": asdict(cfg),
            "runs": runs, "target_met": all(r["target_met"] for r in runs)}


def write_docs(docs: list[Path], result: dict[str, Any]) -> None:
    """Write ``result`` into each of ``docs``: every table between the soak markers, the
    verdict alone between the summary markers, one table cell between the cell markers,
    whichever each has; SystemExit, with nothing written, when one has none."""
    kinds = ((BEGIN, END, render), (SUMMARY_BEGIN, SUMMARY_END, render_summary), (CELL_BEGIN, CELL_END, render_cell))
    plan = []
    for doc in docs:
        text = read_doc(doc)
        sections = [(begin, end, make) for begin, end, make in kinds if begin in text and end in text]
        if not sections:
            raise SystemExit(f"{doc}: no section to replace ("
                             + ", ".join(f"'{b}' ... '{e}'" for b, e, _ in kinds) + ")")
        plan += [(doc, *section) for section in sections]
    for doc, begin, end, make in plan:
        write_section(doc, begin, end, make(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model file (default: train the small test model)")
    p.add_argument("--minutes", type=float, default=10.0, help="the attack phase, per front end")
    p.add_argument("--frontend", choices=(*FRONTENDS, "both"), default="python",
                   help="the replicas' front end; both: one run after the other")
    p.add_argument("--decoders", type=int, default=8, help="decoder-like client threads")
    p.add_argument("--rescorers", type=int, default=2, help="rescoring-like client threads")
    p.add_argument("--max-concurrent-rpcs", type=int, default=64, help="the replicas' limit, and the hostile streams")
    p.add_argument("--max-rpcs-per-client", type=int, default=32, help="the replicas' per-client share")
    p.add_argument("--max-health-watches", type=int, default=1024, help="the replicas' Watch pool")
    p.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    p.add_argument("--warmup-seconds", type=float, default=20.0)
    p.add_argument("--settle-seconds", type=float, default=30.0)
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"the hostile clients that run, comma-separated (default all: {', '.join(ATTACKS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll-engine", choices=("epoll1", "poll"),
                   help="gRPC's polling engine in the replicas (GRPC_POLL_STRATEGY; default: gRPC's)")
    p.add_argument("--serve-args", default="",
                   help="more flags of the replicas' nlmserve serve, one string (e.g. "
                        "\"--max-connection-age-seconds 60\")")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--doc", action="append", default=[],
                   help="write the tables into this document (every table between the soak markers, the verdict "
                        "between the summary markers, one table cell between the cell markers); may be given more "
                        "than once")
    p.add_argument("--render", help="make the tables from this JSON instead of running")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.render:
        result = read_saved(Path(args.render))
    else:
        try:
            hostile = HostileConfig(attacks=tuple(a for a in args.attacks.split(",") if a))
        except ValueError as e:
            p.error(f"--attacks: {e}")
        try:
            serve_args = tuple(shlex.split(args.serve_args))
        except ValueError as e:
            p.error(f"--serve-args: {e}")
        cfg = SoakConfig(model=args.model, minutes=args.minutes, frontend=args.frontend,
                                decoders=args.decoders, rescorers=args.rescorers,
                                max_concurrent_rpcs=args.max_concurrent_rpcs,
                                max_rpcs_per_client=args.max_rpcs_per_client,
                                max_health_watches=args.max_health_watches, fault_every=args.fault_every,
                                warmup_seconds=args.warmup_seconds, settle_seconds=args.settle_seconds,
                                seed=args.seed, poll_engine=args.poll_engine,
                                serve_args=serve_args, hostile=hostile)
        try:
            result = run(cfg)
        except ReplicaStartError as e:  # e.g. a flag of --serve-args that serve refuses
            print(f"bench.soak: {e}", file=sys.stderr)
            return 2
        if args.json:
            write_json(Path(args.json), result)
    table = render(result)
    print(table, end="")
    write_docs([Path(doc) for doc in args.doc], result)
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    exit_with(main)
