"""Serving benchmark: n-grams/s of the engine, gRPC (packed ids, strings), KenLM, the compute
limit, single-request latency and the micro-batching gain, all measured in one run.

    .venv/bin/python -m bench.serve [--kenlm-model lm.arpa|lm.binary] [--json out.json] [--doc PAGE]
    .venv/bin/python -m bench.serve --render docs/performance-serving.md bench/results/serve.json

The model is one like a realistic one (order 5, width 256, the 20k most frequent words of
the shipped Europarl training slice, sqrt(V) frequency classes on their counts, random
weights: speed does not depend on the values), built and saved through the lm API and
served by a real ``nlmserve serve`` process on 127.0.0.1. Test n-grams are the n-grams of
the shipped held-out Europarl text, so target class sizes are those of real text; KenLM (d)
scores the same n-grams as words. Ratios are printed against the targets of the serving issue.

The micro-batching measurement sends one n-gram per request from 32 concurrent clients, each
on its own connection, each sending its next request when its last is answered:
``nlmserve_load`` (bench/cpp, built by `make cpp` on first use) when the C++
toolchain is there, Python asyncio clients otherwise. ``--load-mode async`` (the default)
drives the 32 clients from one thread through a gRPC completion queue, as Triton's
perf_analyzer does in its async mode; ``threads`` gives each client a thread calling the C++
client library a Moses decoder links. The load generator shares the two cores with the
server it measures, so the cheaper one measures the server better; ``serve --frontend
native`` and ``--max-batch-ngrams 1`` are also measured with the other mode, and both are
printed. It runs against the batching server, ``--max-batch-ngrams 1`` and a no-op server
on the same gRPC stack that answers without touching a model, twice each in turn: the no-op
rate is the ceiling that no batching can pass on this machine. When the C++ project builds,
the same load also goes to ``serve --frontend native`` (server/native's ``nlmserve_frontend``
before the batching server, its merged batches over the model server's private socket),
and to ``serve --frontend native --max-batch-ngrams 1``; the gain of the
native path is stated against the Python server with ``--max-batch-ngrams 1`` (the faster of
the two unbatched set-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from nlmserve.lm.scoring import LanguageModel

from bench._common import (exit_with, machine, machine_line, markers, random_class_model, shown_command,
                           tree_cpu_seconds, write_json, write_saved, write_section)

log = logging.getLogger("bench.serve")

REPO = Path(__file__).resolve().parent.parent  # the checkout holding this bench/
DATA = REPO / "data" / "lm"
TRAIN_XZ = DATA / "europarl.train.50k.lc-moses.en.xz"
DEV_TXT = DATA / "europarl.dev.1k.lc-moses.en"


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark builds and how long it measures.

    Fields:
        vocab_size, order, dim: shape of the random model.
        seconds: time spent on each throughput measurement.
        torch_threads: torch threads of the engine (in-process and in the server).
        concurrency: clients sending one n-gram each in the micro-batching test.
        load_mode: how nlmserve_load drives them: async (one thread, a completion queue) or
            threads (a thread per client, through the C++ client library).
        latency_requests: single-n-gram requests timed at concurrency 1.
        kenlm_model: ARPA or binary KenLM file for (d); None skips (d).
    """

    vocab_size: int = 20_000
    order: int = 5
    dim: int = 256
    seconds: float = 4.0
    torch_threads: int = 1
    concurrency: int = 32
    load_mode: str = "async"
    latency_requests: int = 2000
    kenlm_model: str | None = None


def build_model(cfg: BenchConfig, path: Path) -> None:
    random_class_model([TRAIN_XZ], cfg.vocab_size, cfg.order, cfg.dim, 0, path)


def test_ngrams(lm: LanguageModel, n: int) -> tuple[np.ndarray, list[list[str]]]:
    """The first ``n`` n-grams of the shipped held-out text (as ids, ``<s>``-padded, and as words)."""
    with open(DEV_TXT, encoding="utf-8") as f:
        sentences = [line.split() for line in f]
    ids, _, _, _ = lm.sentence_ngrams(sentences)
    ids = ids[:n].astype(np.uint32)
    words = [lm.vocab.decode(row) for row in ids.tolist()]
    return ids, words


def rate(fn: Callable[[], int], seconds: float, repeats: int = 3) -> float:
    """Items per second of ``fn`` (returns items done): the best of ``repeats`` runs of
    ``seconds / repeats`` each, after one warm-up call (the best run is the one least
    disturbed by other work on a shared machine)."""
    fn()
    best = 0.0
    for _ in range(repeats):
        done, t0 = 0, time.perf_counter()
        while True:
            done += fn()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / repeats:
                break
        best = max(best, done / elapsed)
    return best


def gemm_rate(dim: int, seconds: float) -> float:
    """FLOP/s of torch.matmul on a (4096, dim) x (dim, 2048) product."""
    a, b = torch.randn(4096, dim), torch.randn(dim, 2048)
    flops = 2 * 4096 * dim * 2048
    return rate(lambda: (a @ b, flops)[1], seconds)


def flops_per_ngram(lm: LanguageModel, ids: np.ndarray) -> float:
    """Multiply-adds x 2 of one normalised class-factored prediction, averaged over ``ids``."""
    c = lm.config
    E = c.out_dim
    ctx = 2 * (c.order - 1) * c.dim if c.context == "diagonal" else 2 * (c.order - 1) * c.dim * c.dim
    hidden = 2 * c.dim * c.hidden if c.hidden else 0
    assert lm.classes is not None
    sizes = lm.classes.class_sizes[lm.classes.word_class[ids[:, -1].astype(np.int64)]]
    return float(ctx + hidden + 2 * c.num_classes * E + 2 * sizes.mean() * E + 4 * E)


class _Process:
    """A benchmark subprocess: its CPU time and a SIGTERM stop."""

    proc: subprocess.Popen[str]

    def cpu_seconds(self) -> float:
        """User + system CPU time so far of the process (all its threads) and of its running
        children (``serve --frontend native``: the front end)."""
        return tree_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class ServerProcess(_Process):
    """A server subprocess on 127.0.0.1, port 0: ``nlmserve serve`` with its /metrics on a free
    port, or (``noop=True``) this script's no-op server (same gRPC stack, no model work).

    ``nlmserve serve`` through ``nlmserve.common.serve_process.start_server``, its log kept off the
    terminal between the tables; the no-op server prints the same ``listening on`` line."""

    def __init__(self, model: Path, *flags: str, noop: bool = False) -> None:
        from nlmserve.common.serve_process import parse_listening, start_server

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.metrics_url: str | None = None
        if not noop:
            server = start_server(model, flags, metrics_port=0, stderr=subprocess.DEVNULL, env=env)
            self.proc, self.target = server.process, server.target
            self.metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.serve", "--noop-server", str(model)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                         cwd=REPO)
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            target = parse_listening(line)
            if target is None:
                self.proc.kill()
                raise RuntimeError(f"server did not start: {line!r}")
            self.target = target
        self.native = "native" in flags  # the front end merges requests before the model server

    def metric(self, name: str) -> float:
        import urllib.request

        if self.metrics_url is None:
            return 0.0
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                key, _, value = line.rpartition(" ")
                if key == name:
                    return float(value)
        return 0.0


def noop_serve(model: Path) -> int:
    """A gRPC server with the served API on the same asyncio stack as ``nlmserve serve`` whose
    ScoreNgrams answers at once (-1 for every n-gram): the RPC cost alone, the ceiling that
    no batching of the model's work can pass."""
    import grpc

    from nlmserve.proto import lm_pb2, lm_pb2_grpc
    from nlmserve.common.serve_process import listening_line
    from nlmserve.server.servicer import model_info
    from nlmserve.server.config import ServerConfig
    from nlmserve.server.engine import ModelState, load_model

    config = ServerConfig(model=str(model))
    state = ModelState(load_model(config), config)
    info = model_info(state, config.max_ngrams_per_request)
    words = list(state.words)

    class Noop(lm_pb2_grpc.LanguageModelServicer):
        async def ScoreNgrams(self, request: Any, context: Any) -> Any:
            n = len(request.packed_ids) // (4 * max(request.packed_order, 1)) or len(request.ngrams)
            return lm_pb2.ScoreNgramsResponse(log_probs=[-1.0] * n, oov=[False] * n, log_base=request.log_base,
                                              normalized=True, model_hash=info.model_hash)

        async def ScoreSentences(self, request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the no-op server scores n-grams only")

        async def GetModelInfo(self, request: Any, context: Any) -> Any:
            return info

        async def GetVocabulary(self, request: Any, context: Any) -> Any:
            size = request.chunk_size or 10_000
            for i in range(0, len(words), size):
                yield lm_pb2.VocabularyChunk(offset=i, words=words[i : i + size])

        async def GetScoringTables(self, request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the no-op server has no scoring tables")
            yield  # an async generator, as the servicer's streaming methods are

    async def run() -> None:
        server = grpc.aio.server()
        lm_pb2_grpc.add_LanguageModelServicer_to_server(Noop(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(listening_line("127.0.0.1", port), flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0.5)

    asyncio.run(run())
    return 0


def percentile_ms(lat: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(lat) * 1e3, q))


def single_latency(target: str, ids: np.ndarray, n: int, warmup: int = 100,
                   probe: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``n`` requests of one n-gram each (the rows of ``ids`` in turn), one after another, after
    ``warmup`` unmeasured ones → p50 and p99 (ms). ``probe``: called just before and just after
    the measured requests; its two results are returned as ``before`` and ``after``."""
    import grpc

    from nlmserve.proto import lm_pb2, lm_pb2_grpc

    reqs = [lm_pb2.ScoreNgramsRequest(packed_ids=ids[i % len(ids)].tobytes(), packed_order=ids.shape[1])
            for i in range(n)]
    lat = []
    with grpc.insecure_channel(target) as ch:
        stub = lm_pb2_grpc.LanguageModelStub(ch)
        for r in reqs[:warmup]:
            stub.ScoreNgrams(r)
        before = probe() if probe else None
        for r in reqs:
            t0 = time.perf_counter()
            stub.ScoreNgrams(r)
            lat.append(time.perf_counter() - t0)
        after = probe() if probe else None
    out: dict[str, Any] = {"p50_ms": percentile_ms(lat, 50), "p99_ms": percentile_ms(lat, 99)}
    if probe:
        out.update(before=before, after=after)
    return out


def concurrent_single(target: str, ids: np.ndarray, clients: int, seconds: float) -> dict[str, float]:
    """``clients`` asyncio clients, each sending one n-gram per request back to back."""
    from grpc import aio

    from nlmserve.proto import lm_pb2, lm_pb2_grpc

    async def run() -> tuple[int, list[float], float]:
        async with aio.insecure_channel(target) as ch:
            stub: Any = lm_pb2_grpc.LanguageModelStub(ch)
            await stub.GetModelInfo(lm_pb2.GetModelInfoRequest())
            lat: list[float] = []
            stop_at = time.perf_counter() + seconds

            async def one(k: int) -> int:
                i, done = k, 0
                while time.perf_counter() < stop_at:
                    req = lm_pb2.ScoreNgramsRequest(packed_ids=ids[i % len(ids)].tobytes(), packed_order=ids.shape[1])
                    t0 = time.perf_counter()
                    await stub.ScoreNgrams(req)
                    lat.append(time.perf_counter() - t0)
                    i += clients
                    done += 1
                return done

            t0 = time.perf_counter()
            counts = await asyncio.gather(*[one(k) for k in range(clients)])
            return sum(counts), lat, time.perf_counter() - t0

    done, lat, elapsed = asyncio.run(run())
    return {"ngrams_per_s": done / elapsed, "p50_ms": percentile_ms(lat, 50), "p99_ms": percentile_ms(lat, 99)}



def cpp_tool(name: str) -> Path | None:
    """A binary of the C++ projects (``nlmserve_load`` in build/bench, ``nlmserve_frontend`` in
    build/native), built with `make cpp` when missing; None when the C++ toolchain or Debian's
    gRPC packages are not there (``make system-deps``)."""
    tool = REPO / "build" / ("native" if name == "nlmserve_frontend" else "bench") / name
    if tool.exists():
        return tool
    try:
        subprocess.run(["make", "-C", str(REPO), "cpp"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"({name} could not be built: {e})")
        return None
    return tool


def cpp_concurrent_single(tool: Path, target: str, words: list[list[str]], clients: int,
                          seconds: float, mode: str) -> dict[str, float]:
    """``clients`` C++ clients, one n-gram per request: ``mode`` threads (a thread each, through
    the client library a Moses decoder links) or async (one thread, a completion queue)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ngrams", encoding="utf-8", delete=False) as f:
        f.write("".join(" ".join(w) + "\n" for w in words))
    try:
        out = subprocess.run([str(tool), target, f.name, "--clients", str(clients), "--batch", "1",
                              "--seconds", str(seconds), "--warmup", "1", "--mode", mode],
                             check=True, capture_output=True, text=True, timeout=seconds + 120)
    finally:
        os.unlink(f.name)
    r = json.loads(out.stdout)
    return {"ngrams_per_s": r["ngrams_per_s"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}


def concurrent_measure(server: ServerProcess, ids: np.ndarray, words: list[list[str]], cfg: BenchConfig,
                       tool: Path | None, clients: int | None = None, mode: str | None = None) -> dict[str, float]:
    """One-n-gram requests from ``clients`` (default ``cfg.concurrency``) clients (``tool`` in
    ``mode``, default ``cfg.load_mode``, when built, else Python asyncio), sent to the server
    (with ``--frontend native``: to the front end before it), plus the serving side's view: requests per
    forward pass, CPU per request (front end and server together)."""
    clients = clients or cfg.concurrency
    cpu = server.cpu_seconds
    target = server.target
    before = (server.metric("nlmserve_batch_requests_count"), server.metric("nlmserve_batch_requests_sum"), cpu())
    if tool is not None:
        out = cpp_concurrent_single(tool, target, words, clients, cfg.seconds, mode or cfg.load_mode)
    else:
        out = concurrent_single(target, ids, clients, cfg.seconds)
    served = out["ngrams_per_s"] * cfg.seconds
    batches = server.metric("nlmserve_batch_requests_count") - before[0]
    parts = server.metric("nlmserve_batch_requests_sum") - before[1]
    used = cpu() - before[2]
    if server.native:  # the server sees the front end's merged requests, not the clients'
        parts = served
    out["requests_per_forward_pass"] = parts / max(batches, 1) if batches else 0.0
    out["server_cpu_us_per_request"] = 1e6 * used / max(parts if batches else served, 1)
    return out


def kenlm_rate(path: str, words: list[list[str]], seconds: float) -> float | None:
    try:
        import kenlm  # type: ignore[import-not-found]
    except ImportError:
        print("(d) skipped: the kenlm module is not installed (pip install kenlm)")
        return None
    model = kenlm.Model(path)

    # <s> padding: start from the sentence-start state and drop the <s> words.
    stripped = [(ng.count("<s>") > 0, [w for w in ng if w != "<s>"]) for ng in words]

    def run() -> int:
        s_in, s_out = kenlm.State(), kenlm.State()
        total = 0.0
        for at_start, ng in stripped:
            if at_start:
                model.BeginSentenceWrite(s_in)
            else:
                model.NullContextWrite(s_in)
            for w in ng[:-1]:
                model.BaseScore(s_in, w, s_out)
                s_in, s_out = s_out, s_in
            total += model.BaseScore(s_in, ng[-1], s_out)
        return len(words)

    return rate(run, seconds)


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kenlm-model", help="KenLM ARPA/binary for (d); without it (d) is skipped")
    ap.add_argument("--seconds", type=float, default=BenchConfig.seconds)
    ap.add_argument("--vocab-size", type=int, default=BenchConfig.vocab_size)
    ap.add_argument("--dim", type=int, default=BenchConfig.dim)
    ap.add_argument("--torch-threads", type=int, default=BenchConfig.torch_threads)
    ap.add_argument("--load-mode", choices=("async", "threads"), default=BenchConfig.load_mode,
                    help="how nlmserve_load drives the concurrent clients (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--doc", type=Path, help="write the table into this page (between its bench/serve.py markers)")
    ap.add_argument("--render", nargs=2, type=Path, metavar=("DOC", "JSON"),
                    help="write a saved run's table into DOC, measuring nothing")
    ap.add_argument("--noop-server", type=Path, metavar="MODEL", help=argparse.SUPPRESS)
    return ap


@dataclass(frozen=True)
class Workload:
    """The built model and the test n-grams every measurement sends to it."""

    cfg: BenchConfig
    model_path: Path
    lm: LanguageModel
    ids: np.ndarray
    words: list[list[str]]

    @classmethod
    def build(cls, cfg: BenchConfig, model_path: Path) -> "Workload":
        build_model(cfg, model_path)
        lm = LanguageModel.load(model_path, device="cpu")
        ids, words = test_ngrams(lm, 20_000)
        return cls(cfg, model_path, lm, ids, words)

    def server(self, *flags: str, noop: bool = False) -> ServerProcess:
        """A server of the model with the engine's torch threads and ``flags``."""
        return ServerProcess(self.model_path, "--torch-threads", str(self.cfg.torch_threads), *flags, noop=noop)

    def concurrent(self, flags: tuple[str, ...] | None, tool: Path | None, clients: int | None = None,
                   mode: str | None = None) -> dict[str, float]:
        """concurrent_measure against a server of its own (``flags`` None: the no-op server)."""
        server = self.server(*(flags or ()), noop=flags is None)
        try:
            return concurrent_measure(server, self.ids, self.words, self.cfg, tool, clients=clients, mode=mode)
        finally:
            server.stop()


def measure_compute_limit(res: dict[str, Any], w: Workload) -> None:
    """(e) the compute limit: FLOPs per n-gram against the GEMM rate."""
    res["flops_per_ngram"] = flops_per_ngram(w.lm, w.ids)
    res["gemm_flops"] = gemm_rate(w.cfg.dim, w.cfg.seconds / 2)
    res["compute_limit"] = res["gemm_flops"] / res["flops_per_ngram"]
    print(f"(e) compute limit: {res['flops_per_ngram'] / 1e3:.0f} kFLOP/n-gram, "
          f"GEMM {res['gemm_flops'] / 1e9:.1f} GFLOP/s -> {res['compute_limit']:,.0f} n-grams/s")


def measure_engine(res: dict[str, Any], w: Workload) -> None:
    """(a) the engine in-process, batches of 4096 and 10,000 n-grams, with the allocator
    settings of ``nlmserve serve`` (common/memory.py: they decide how many page faults a
    forward pass takes), so that (b) compares with what the server could do."""
    from nlmserve.common.memory import return_freed_memory
    from nlmserve.server.config import ServerConfig
    from nlmserve.server.engine import Engine

    return_freed_memory()
    engine = Engine(w.lm, ServerConfig(model=str(w.model_path), torch_threads=w.cfg.torch_threads))
    for bs in (4096, 10_000):
        batch = w.ids[:bs]
        res[f"engine_{bs}"] = rate(lambda: len(engine.score_ngrams(batch, log10=True)), w.cfg.seconds)
        print(f"(a) engine, batch {bs}: {res[f'engine_{bs}']:,.0f} n-grams/s "
              f"({res[f'engine_{bs}'] / res['compute_limit']:.0%} of the compute limit)")
    engine.shutdown()


def measure_grpc(res: dict[str, Any], w: Workload) -> None:
    """(b) gRPC with packed ids, (c) with strings, and one n-gram's latency at concurrency 1,
    through one ``nlmserve serve``."""
    server = w.server()
    try:
        from nlmserve.client import LMClient

        with LMClient(server.target) as client:
            for bs in (1000, 10_000):
                batch = w.ids[:bs]
                res[f"grpc_packed_{bs}"] = rate(lambda: len(client.score_ids(batch).log_probs), w.cfg.seconds)
                print(f"(b) gRPC packed ids, batch {bs}: {res[f'grpc_packed_{bs}']:,.0f} n-grams/s "
                      f"({res[f'grpc_packed_{bs}'] / res['engine_10000']:.0%} of the engine)")
        with LMClient(server.target, pack_ids=False) as client:
            res["grpc_strings_10000"] = rate(lambda: len(client.score_ngrams(w.words[:10_000]).log_probs),
                                             w.cfg.seconds)
        print(f"(c) gRPC strings, batch 10000: {res['grpc_strings_10000']:,.0f} n-grams/s "
              f"({res['grpc_strings_10000'] / res['engine_10000']:.0%} of the engine)")
        res["latency_c1"] = single_latency(server.target, w.ids, w.cfg.latency_requests)
        print(f"single n-gram, concurrency 1: p50 {res['latency_c1']['p50_ms']:.3f} ms, "
              f"p99 {res['latency_c1']['p99_ms']:.3f} ms")
    finally:
        server.stop()


Variant = tuple[str, tuple[str, ...] | None, str | None]  # name, serve flags (None: no-op server), load mode


def concurrent_variants(cfg: BenchConfig, tool: Path | None, fe: tuple[str, ...], other: str) -> list[Variant]:
    """The servers the micro-batching load goes to, and the load generator's mode for each
    (None: ``cfg.load_mode``); ``fe``: the native front end's flags, empty when it did not build."""
    variants: list[Variant] = [
        ("concurrent_batching", (), None), ("concurrent_no_batching", ("--max-batch-ngrams", "1"), None),
        ("concurrent_noop", None, None)]
    # The native front end (server/native) before the batching server, and with
    # --max-batch-ngrams 1 (one server call per client request, as many in flight as
    # there are clients) before a --max-batch-ngrams 1 server.
    # `serve --frontend native` sends merged batches over the model server's private
    # socket; unbatched, the front end keeps one request per client in flight.
    if fe:
        variants += [("native_batching", fe, None),
                     ("native_no_batching", (*fe, "--max-batch-ngrams", "1", "--frontend-max-inflight",
                                             str(cfg.concurrency)), None)]
    if tool is not None:  # the main pair again, driven by the load generator's other mode
        variants += [("concurrent_no_batching_" + other, ("--max-batch-ngrams", "1"), other)]
        if fe:
            variants += [("native_batching_" + other, fe, other)]
    return variants


def measure_concurrent(res: dict[str, Any], w: Workload, tool: Path | None, variants: list[Variant]) -> None:
    """The variants' servers one after the other, twice, so that a change of load on the
    machine during the run shows as a difference between the rounds; the better round of each."""
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}
    for _ in range(2):
        for name, flags, mode in variants:
            rounds[name].append(w.concurrent(flags, tool, mode=mode))
    for name, runs in rounds.items():  # the better round of each
        res[name] = max(runs, key=lambda r: r["ngrams_per_s"])
        res[name + "_rounds"] = runs


def report_batching(res: dict[str, Any], cfg: BenchConfig) -> None:
    """The Python server's micro-batching gain, its CPU per request and the no-op ceiling."""
    b, nb, noop = res["concurrent_batching"], res["concurrent_no_batching"], res["concurrent_noop"]
    gain = b["ngrams_per_s"] / nb["ngrams_per_s"]
    res["batching_gain"] = gain
    res["batching_cpu_gain"] = nb["server_cpu_us_per_request"] / b["server_cpu_us_per_request"]
    res["noop_ceiling_gain"] = noop["ngrams_per_s"] / nb["ngrams_per_s"]
    print(f"{cfg.concurrency} clients x 1 n-gram ({res['load_clients']}): micro-batching "
          f"{b['ngrams_per_s']:,.0f}/s (p99 {b['p99_ms']:.2f} ms) vs --max-batch-ngrams 1 "
          f"{nb['ngrams_per_s']:,.0f}/s (p99 {nb['p99_ms']:.2f} ms): {gain:.1f}x;"
          f" {b['requests_per_forward_pass']:.1f} requests per forward pass")
    print(f"  server CPU per request: {b['server_cpu_us_per_request']:.0f} us batched vs "
          f"{nb['server_cpu_us_per_request']:.0f} us unbatched ({res['batching_cpu_gain']:.1f}x less)")
    print(f"  no-op server (the same gRPC stack, no model): {noop['ngrams_per_s']:,.0f}/s (p99 "
          f"{noop['p99_ms']:.2f} ms), {noop['server_cpu_us_per_request']:.0f} us CPU per request: "
          f"micro-batching reaches {b['ngrams_per_s'] / noop['ngrams_per_s']:.0%} of it; no batching "
          f"can gain more than {res['noop_ceiling_gain']:.1f}x over --max-batch-ngrams 1 here")


def report_native(res: dict[str, Any], other: str) -> None:
    """``serve --frontend native``'s gains: against the Python server with --max-batch-ngrams 1,
    on its own stack, and with the load generator's other mode."""
    nb = res["concurrent_no_batching"]
    nb_native, b_native = res["native_no_batching"], res["native_batching"]
    res["native_gain"] = b_native["ngrams_per_s"] / nb["ngrams_per_s"]
    res["native_gain_same_stack"] = b_native["ngrams_per_s"] / nb_native["ngrams_per_s"]
    r = b_native
    print(f"  serve --frontend native: "
          f"{r['ngrams_per_s']:,.0f}/s (p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms), "
          f"{r['requests_per_forward_pass']:.1f} client requests per forward pass, "
          f"{r['server_cpu_us_per_request']:.0f} us CPU per request (front end + server): "
          f"{r['ngrams_per_s'] / nb['ngrams_per_s']:.1f}x the server with --max-batch-ngrams 1")
    print(f"  serve --frontend native --max-batch-ngrams 1 (one request per client in flight): "
          f"{nb_native['ngrams_per_s']:,.0f}/s (p99 {nb_native['p99_ms']:.2f} ms): batching in the front "
          f"end gains {res['native_gain_same_stack']:.1f}x on the same stack")
    b_o, nb_o = res["native_batching_" + other], res["concurrent_no_batching_" + other]
    res["native_gain_" + other] = b_o["ngrams_per_s"] / nb_o["ngrams_per_s"]
    print(f"  the same two with nlmserve_load --mode {other}: serve --frontend native "
          f"{b_o['ngrams_per_s']:,.0f}/s (p50 {b_o['p50_ms']:.2f} ms, p99 {b_o['p99_ms']:.2f} ms) vs "
          f"--max-batch-ngrams 1 {nb_o['ngrams_per_s']:,.0f}/s (p99 {nb_o['p99_ms']:.2f} ms): "
          f"{res['native_gain_' + other]:.1f}x")


def measure_cpp_latency(res: dict[str, Any], w: Workload, tool: Path, fe: tuple[str, ...]) -> None:
    """One client thread: the latency a decoder thread sees through the C++ client, from the
    server and through the native front end (and the Python client's through the front end)."""
    for name, flags in (("latency_c1_cpp", ()), ("latency_c1_cpp_native", fe)):
        server = w.server(*flags)
        try:
            res[name] = concurrent_measure(server, w.ids, w.words, w.cfg, tool, clients=1, mode="threads")
            if flags:  # and the Python client's, through the front end
                res["latency_c1_native"] = single_latency(server.target, w.ids, w.cfg.latency_requests)
        finally:
            server.stop()
    print(f"single n-gram, concurrency 1, C++ client: p50 {res['latency_c1_cpp']['p50_ms']:.3f} ms "
          f"(server), {res['latency_c1_cpp_native']['p50_ms']:.3f} ms (serve --frontend native); "
          f"Python client through the front end: p50 {res['latency_c1_native']['p50_ms']:.3f} ms")


def measure_kenlm(res: dict[str, Any], w: Workload) -> None:
    """(d) KenLM's Python module on the same n-grams, as words."""
    if w.cfg.kenlm_model:
        kr = kenlm_rate(w.cfg.kenlm_model, w.words[:10_000], w.cfg.seconds)
        if kr is not None:
            res["kenlm"] = kr
            print(f"(d) KenLM Python module: {kr:,.0f} n-grams/s (engine / KenLM = {res['engine_10000'] / kr:.2f})")
    else:
        print("(d) skipped: no --kenlm-model given")


def measure_all(res: dict[str, Any], cfg: BenchConfig, model_path: Path) -> None:
    """Every measurement, in the order they are printed, into ``res``."""
    w = Workload.build(cfg, model_path)
    measure_compute_limit(res, w)
    measure_engine(res, w)
    measure_grpc(res, w)
    tool = cpp_tool("nlmserve_load")
    native = cpp_tool("nlmserve_frontend") if tool else None
    other = res["load_mode_other"] = "threads" if cfg.load_mode == "async" else "async"
    res["load_clients"] = f"C++ nlmserve_load, {cfg.load_mode}" if tool else "Python asyncio"
    fe = ("--frontend", "native", "--frontend-binary", str(native)) if native is not None else ()
    measure_concurrent(res, w, tool, concurrent_variants(cfg, tool, fe, other))
    report_batching(res, cfg)
    if native is not None and tool is not None:
        report_native(res, other)
        measure_cpp_latency(res, w, tool, fe)
    measure_kenlm(res, w)


def target_checks(res: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The serving issue's targets: (target, measured, met)."""
    lat, conc = res["latency_c1"], res["concurrent_batching"]
    best_engine = max(res["engine_4096"], res["engine_10000"])
    checks = [  # (target, measured, met)
        ("engine >= 50% of the compute limit", f"{best_engine / res['compute_limit']:.0%}",
         best_engine >= 0.5 * res["compute_limit"]),
        ("gRPC packed (10k) >= 80% of the engine", f"{res['grpc_packed_10000'] / res['engine_10000']:.0%}",
         res["grpc_packed_10000"] >= 0.8 * res["engine_10000"]),
        ("single n-gram p50 <= 1 ms (Python client)", f"{lat['p50_ms']:.3f} ms", lat["p50_ms"] <= 1.0),
        # The Python server's own micro-batching, for comparison: the target is met (or
        # not) through the native front end below.
        ("(Python server alone: batching gain >= 5x)", f"{res['batching_gain']:.1f}x", res["batching_gain"] >= 5.0),
        ("(Python server alone: p99 <= 10 ms)", f"{conc['p99_ms']:.2f} ms", conc["p99_ms"] <= 10.0),
        ("(no-op server / --max-batch-ngrams 1 >= 5x)", f"{res['noop_ceiling_gain']:.1f}x",
         res["noop_ceiling_gain"] >= 5.0),
    ]
    if "native_gain" in res:
        checks += native_checks(res)
    return checks


def native_checks(res: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The targets met (or not) through ``serve --frontend native``, and the same with the load
    generator's other mode, for comparison."""
    nat = res["native_batching"]
    checks = [(f"single n-gram p50 <= 1 ms ({label})", f"{res[key]['p50_ms']:.3f} ms", res[key]["p50_ms"] <= 1.0)
              for label, key in (("C++ client", "latency_c1_cpp"), ("native, C++ client", "latency_c1_cpp_native"),
                                 ("native, Python client", "latency_c1_native"))]
    checks += [
        ("micro-batching gain >= 5x (serve --frontend native)", f"{res['native_gain']:.1f}x",
         res["native_gain"] >= 5.0),
        ("micro-batching p99 <= 10 ms (serve --frontend native)", f"{nat['p99_ms']:.2f} ms", nat["p99_ms"] <= 10.0),
    ]
    other = res["load_mode_other"]
    nat_o = res["native_batching_" + other]
    checks += [  # the same with the load generator's other mode, for comparison
        (f"(the same, {other} clients: gain >= 5x)", f"{res['native_gain_' + other]:.1f}x",
         res["native_gain_" + other] >= 5.0),
        (f"(the same, {other} clients: p99 <= 10 ms)", f"{nat_o['p99_ms']:.2f} ms", nat_o["p99_ms"] <= 10.0),
    ]
    return checks


def print_checks(checks: list[tuple[str, str, bool]]) -> None:
    print(f"\n{'target':54s} {'measured':>10s}   met")
    for name, value, met in checks:
        print(f"{name:54s} {value:>10s}   {'yes' if met else 'NO'}")


def _rate_row(what: str, r: dict[str, Any] | float | None) -> str | None:
    """A row of the rates table: n-grams/s, and p50 and p99 where the run timed requests."""
    if r is None:
        return None
    if not isinstance(r, dict):
        return f"| {what} | {r:,.0f} | | |"
    rate = f"{r['ngrams_per_s']:,.0f}" if "ngrams_per_s" in r else ""
    return f"| {what} | {rate} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"


def render(res: dict[str, Any]) -> str:
    """The run's section of docs/performance-serving.md: the serving targets and the rates behind them."""
    begin, end = markers("serve.py")
    m, c = res["machine"], res["config"]
    lines = [begin, "",
             f"{res['date']}, {machine_line(m)}. Model: order {c['order']}, width {c['dim']}, the {c['vocab_size']:,} most frequent words "
             f"of the shipped Europarl slice, random weights, {c['torch_threads']} torch thread(s); test n-grams "
             f"from held-out Europarl text. {c['concurrency']} clients send one n-gram per request each "
             f"({res['load_clients']}). Each rate is the best of three; each load the better of two rounds.", "",
             "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {name} | {v['measured']} | {'yes' if v['met'] else '**no**'} |" for name, v in res["checks"].items()]
    n = c["concurrency"]
    rows = [("(e) the compute limit (GEMM rate / FLOPs per n-gram)", res["compute_limit"]),
            ("(a) the engine in process, batch 4,096", res["engine_4096"]),
            ("(a) the engine in process, batch 10,000", res["engine_10000"]),
            ("(b) gRPC, packed ids, batch 1,000", res["grpc_packed_1000"]),
            ("(b) gRPC, packed ids, batch 10,000", res["grpc_packed_10000"]),
            ("(c) gRPC, strings, batch 10,000", res["grpc_strings_10000"]),
            ("one n-gram at concurrency 1, Python client", res["latency_c1"]),
            ("one n-gram at concurrency 1, C++ client", res.get("latency_c1_cpp")),
            ("one n-gram at concurrency 1, C++ client, `serve --frontend native`", res.get("latency_c1_cpp_native")),
            (f"{n} clients: `serve` (micro-batching)", res["concurrent_batching"]),
            (f"{n} clients: `serve --max-batch-ngrams 1`", res["concurrent_no_batching"]),
            (f"{n} clients: the no-op server (the same gRPC stack, no model)", res["concurrent_noop"]),
            (f"{n} clients: `serve --frontend native`", res.get("native_batching")),
            (f"{n} clients: `serve --frontend native --max-batch-ngrams 1`", res.get("native_no_batching")),
            ("(d) KenLM's Python module, the same n-grams as words", res.get("kenlm"))]
    lines += ["", "| what | n-grams/s | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    lines += [row for what, r in rows if (row := _rate_row(what, r)) is not None]
    lines += ["", f"Command: `{shown_command(res['command'])}`", "", end]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.noop_server:
        return noop_serve(args.noop_server)
    if args.render:
        write_saved(*args.render, "serve.py", render)
        return 0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = BenchConfig(vocab_size=args.vocab_size, dim=args.dim, seconds=args.seconds,
                      torch_threads=args.torch_threads, kenlm_model=args.kenlm_model, load_mode=args.load_mode)
    torch.set_num_threads(cfg.torch_threads)
    res: dict[str, Any] = {"machine": machine(), "config": cfg.__dict__, "date": time.strftime("%Y-%m-%d"),
                           "command": shlex.join(["bench/serve.py", *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps(res["machine"]))
    with tempfile.TemporaryDirectory() as tmp:
        measure_all(res, cfg, Path(tmp) / "bench.nlm")
    checks = target_checks(res)
    print_checks(checks)
    res["checks"] = {name: {"measured": value, "met": met} for name, value, met in checks}
    if args.json:
        write_json(args.json, res)
    if args.doc:
        write_section(args.doc, *markers("serve.py"), render(res))
    return 0


if __name__ == "__main__":
    exit_with(main)
