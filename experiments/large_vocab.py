"""A large-vocabulary model: memory, class shapes and scoring speed at V ≥ 100k.

    .venv/bin/python -m experiments.large_vocab --model big.nlm --text dev.en [--cache-entries 100000]

For the trained model file ``--model`` it reports:

* V, K, the model file's size, and the class shapes of the model's classes and of the
  alternatives from its training unigram counts: K = √V/3, √V, 3√V, each by frequency
  binning on counts (the default) and on square roots of counts; per option the largest
  class and ``K + E|c|``, the output dot products of one normalised prediction averaged
  over training tokens (class softmax plus the softmax inside the token's class);
* exact (normalised) scoring n-grams/s in this process, one torch thread, batches of
  ``--batch`` real n-grams of ``--text``, for every option (the model's weights with the
  class layer of each option: speed does not depend on the values);
* a real ``nlmserve serve`` (one torch thread, loopback): resident memory after start,
  and resident memory per cache entry: a server with only the n-gram cache, then one with
  only the context cache, each of ``--cache-entries`` entries, filled by distinct n-grams
  of the text until the cache is full (``nlmserve_cache_entries``), RSS after minus RSS
  before, over the entries; and n-grams/s through gRPC (packed ids, batches of
  ``--batch``, ``--client-threads`` threads, ``--seconds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nlmserve.lm.classes import WordClasses, frequency_binning
from nlmserve.lm.model_file import read_model_file
from nlmserve.lm.scoring import LanguageModel

from experiments.replicas import counter as metric, start_replica as start_server


def text_ngrams(lm: LanguageModel, text: Path, limit: int) -> np.ndarray:
    """Up to ``limit`` n-grams of the text (every position of every line, in order)."""
    with open(text, encoding="utf-8") as f:
        sentences = [line.split() for line, _ in zip(f, range(limit)) if line.strip()]
    ids, _, _, _ = lm.sentence_ngrams(sentences)
    return np.asarray(ids[:limit])


def class_stats(wc: np.ndarray, counts: np.ndarray) -> tuple[int, int, float]:
    K = int(wc.max()) + 1
    sizes = np.bincount(wc, minlength=K)
    p = counts / counts.sum()
    return K, int(sizes.max()), float(K + (p * sizes[wc]).sum())


def scoring_rate(lm: LanguageModel, ngrams: np.ndarray, batch: int, seconds: float) -> float:
    lm.score_ngrams(ngrams[:batch])  # warm-up
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start = (done * batch) % max(1, len(ngrams) - batch)
        lm.score_ngrams(ngrams[start : start + batch])
        done += 1
    return done * batch / (time.perf_counter() - t0)


def with_classes(path: str, classes: WordClasses) -> LanguageModel:
    """The model of ``path`` with another class layer (random class weights)."""
    mf = read_model_file(path)
    K = classes.num_classes
    E = mf.config.out_dim
    rng = np.random.default_rng(0)
    tensors = dict(mf.tensors, class_embed=rng.normal(0, 0.1, (K, E)).astype(np.float32),
                   class_bias=np.zeros(K, dtype=np.float32))
    mf = dataclasses.replace(mf, config=dataclasses.replace(mf.config, num_classes=K), classes=classes, tensors=tensors)
    return LanguageModel(mf, device="cpu")


def class_options(path: str, ngrams: np.ndarray, batch: int, seconds: float) -> list[dict[str, Any]]:
    lm = LanguageModel.load(path, device="cpu")
    assert lm.classes is not None and lm._unigram_counts is not None
    counts = lm._unigram_counts.astype(np.float64)
    V = counts.size
    rows = []
    K0, big0, cost0 = class_stats(lm.classes.word_class, counts)
    rows.append({"classes": f"the model's ({lm.classes.method})", "K": K0, "max": big0, "cost": cost0,
                 "rate": scoring_rate(lm, ngrams, batch, seconds)})
    del lm
    for K in (round(math.sqrt(V) / 3), round(math.sqrt(V)), round(3 * math.sqrt(V))):
        for sqrt in (False, True):
            wc = frequency_binning(counts, K, sqrt=sqrt)
            Kx, big, cost = class_stats(wc.word_class, counts)
            alt = with_classes(path, wc)
            rows.append({"classes": "frequency, √counts" if sqrt else "frequency", "K": Kx, "max": big, "cost": cost,
                         "rate": scoring_rate(alt, ngrams, batch, seconds)})
    return rows


# ---------------------------------------------------------------------------- the server


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(m.group(1)) if m else 0


def cache_entry_bytes(model: str, flag: str, cache: str, entries: int, ngrams: np.ndarray,
                      batch: int) -> dict[str, float]:
    """Resident bytes per entry of one cache, filled with distinct n-grams of the text."""
    from nlmserve.client import LMClient

    proc, target, url = start_server(model, flag, str(entries))
    try:
        with LMClient(target, timeout=300) as client:
            client.score_ids(ngrams[:batch].astype(np.uint32))  # warm-up: buffers and the arena
            before, filled = rss_kib(proc.pid), metric(url, "nlmserve_cache_entries", f'cache="{cache}"')
            for start in range(batch, len(ngrams), batch):
                client.score_ids(ngrams[start : start + batch].astype(np.uint32))
                if metric(url, "nlmserve_cache_entries", f'cache="{cache}"') >= entries:
                    break
            after, full = rss_kib(proc.pid), metric(url, "nlmserve_cache_entries", f'cache="{cache}"')
    finally:
        proc.terminate()
        proc.wait(30)
    return {"entries": full - filled, "bytes": 1024.0 * (after - before) / max(1.0, full - filled)}


def served(model: str, ngrams: np.ndarray, batch: int, threads: int, seconds: float) -> dict[str, float]:
    from nlmserve.client import LMClient

    proc, target, url = start_server(model)
    try:
        rss_start = rss_kib(proc.pid)
        reqs = [ngrams[i : i + batch].astype(np.uint32) for i in range(0, len(ngrams) - batch, batch)][:16]
        with LMClient(target, timeout=300) as client:
            stop = threading.Event()

            def work(k: int) -> None:
                i = k
                while not stop.is_set():
                    client.score_ids(reqs[i % len(reqs)])
                    i += 1

            pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for t in pool:
                t.start()
            time.sleep(2.0)
            n0, t0 = metric(url, "nlmserve_ngrams_scored_total"), time.monotonic()
            time.sleep(seconds)
            rate = (metric(url, "nlmserve_ngrams_scored_total") - n0) / (time.monotonic() - t0)
            stop.set()
            for t in pool:
                t.join()
        rss_busy = rss_kib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"rss_start_mib": rss_start / 1024, "rss_busy_mib": rss_busy / 1024, "ngrams_per_s": rate}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, type=Path, help="held-out text for the n-grams")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--client-threads", type=int, default=4)
    ap.add_argument("--cache-entries", type=int, default=100_000)
    ap.add_argument("--skip-classes", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = LanguageModel.load(args.model, device="cpu")
    ngrams = text_ngrams(lm, args.text, 400_000)
    print(f"# V {lm.config.vocab_size:,}, K {lm.num_classes}, order {lm.order}, dim {lm.config.dim}; "
          f"model file {os.path.getsize(args.model) / 2**20:.1f} MiB; {len(ngrams):,} n-grams of {args.text.name}; "
          f"load average {os.getloadavg()[0]:.1f}")
    del lm
    if not args.skip_classes:
        print("| classes | K | largest class | K + E\\|c\\| | exact n-grams/s (1 thread, in process) |")
        print("|---|---|---|---|---|")
        for r in class_options(args.model, ngrams, args.batch, args.seconds):
            print(f"| {r['classes']} | {r['K']} | {r['max']:,} | {r['cost']:,.0f} | {r['rate']:,.0f} |")
    s = served(args.model, ngrams, args.batch, args.client_threads, args.seconds * 2)
    print(f"server: RSS {s['rss_start_mib']:.0f} MiB after start, {s['rss_busy_mib']:.0f} MiB after "
          f"{args.seconds * 2:.0f} s of load; {s['ngrams_per_s']:,.0f} n-grams/s (gRPC, batch {args.batch}, "
          f"{args.client_threads} client threads, caches off)")
    for flag, cache in (("--ngram-cache-size", "ngram"), ("--context-cache-size", "context")):
        c = cache_entry_bytes(args.model, flag, cache, args.cache_entries, ngrams, args.batch)
        print(f"{cache} cache: {c['bytes']:,.0f} resident bytes per entry ({c['entries']:,.0f} entries)")
    print(f"# load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
