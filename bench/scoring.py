"""Scoring micro-benchmark: n-grams/s of ``LanguageModel.score_prepared`` on decoder-like
batches, every row scored on its own against the batch's distinct work done once, in one run.

    .venv/bin/python -m bench.scoring [--hypotheses 47] [--targets 100] [--json out.json] [--doc PAGE]
    .venv/bin/python -m bench.scoring --render docs/performance-serving.md bench/results/scoring.json
    .venv/bin/python -m bench.scoring --quick   # a tiny model and batch: checks the script only

The model is like the decoder's (order 5, width 256, the 36,000 most frequent words of the
shipped Europarl and news training slices, sqrt(V) frequency classes on their counts, random
weights: speed does not depend on the values), saved and loaded through the lm API on the
CPU, one torch thread. A request is a decoder's: for each of H hypotheses (the contexts of
real held-out n-grams), T targets drawn from the held-out text's word frequencies, H × T
rows (4,700 by default) in a shuffled order; like a decoder's boundary n-grams they share
contexts, (context, class) pairs and whole rows. The same number of rows of distinct
contexts (real held-out n-grams) has nothing to share: there the ratio is the cost of
finding the shared work.

Two paths score each batch, normalised (exact) and unnormalised (self-normalised) rows:

* per-row: the scoring API's pieces (``encode_contexts``, ``raw_score``,
  ``class_log_normalizer``, ``in_class_log_normalizer``) on every row, which is what
  ``score_prepared`` computed before it de-duplicated (kept here only, to measure against);
* dedup: ``score_prepared`` (``nlmserve.lm.dedup``: r and the class normaliser per
  distinct context, the in-class normaliser per distinct (context, class), s_c + s_w per
  distinct row).

Both paths' scores are checked equal within 1e-5 before anything is timed; each rate is the
best of three runs of ``--seconds`` / 3 after a warm-up call.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from nlmserve.lm.dedup import plan_batch
from nlmserve.lm.scoring import LanguageModel

from bench._common import (exit_with, machine_line, markers, random_class_model, shown_command, write_json,
                           write_saved, write_section)
from bench.serve import DATA, DEV_TXT, machine, rate

TRAIN_TEXTS = (DATA / "europarl.train.50k.lc-moses.en.xz", DATA / "wmtnews.30k.lc-moses.en.xz")
TOL = 1e-5


@dataclass(frozen=True)
class ScoringBench:
    """What the benchmark builds and how long it measures.

    Fields:
        vocab_size, order, dim: shape of the random model.
        hypotheses, targets: a request is ``hypotheses`` contexts x ``targets`` targets.
        seconds: time spent on each rate (best of three).
        torch_threads: torch threads of the scoring calls.
        seed: of the contexts and targets drawn.
    """

    vocab_size: int = 36_000
    order: int = 5
    dim: int = 256
    hypotheses: int = 47
    targets: int = 100
    seconds: float = 3.0
    torch_threads: int = 1
    seed: int = 0


QUICK = ScoringBench(vocab_size=2_000, dim=16, hypotheses=4, targets=12, seconds=0.0)


def build_model(cfg: ScoringBench, path: Path) -> None:
    random_class_model(list(TRAIN_TEXTS), cfg.vocab_size, cfg.order, cfg.dim, cfg.seed, path)


def held_out_rows(lm: LanguageModel) -> np.ndarray:
    """The canonical n-grams of the shipped held-out text (T, order)."""
    with open(DEV_TXT, encoding="utf-8") as f:
        sentences = [line.split() for line in f]
    rows, _, _, _ = lm.sentence_ngrams(sentences)
    return lm.canonical_rows(rows)


def decoder_batch(held_out: np.ndarray, cfg: ScoringBench) -> np.ndarray:
    """``hypotheses`` contexts of held-out n-grams x ``targets`` targets drawn from the held-out
    word frequencies → (H*T, order), shuffled."""
    rng = np.random.default_rng(cfg.seed)
    contexts = np.unique(held_out[:, :-1], axis=0)
    ctx = contexts[rng.choice(len(contexts), size=cfg.hypotheses, replace=False)]
    words = held_out[:, -1]  # every held-out token once: its real frequency
    target = words[rng.integers(0, len(words), size=(cfg.hypotheses, cfg.targets))]
    rows = np.concatenate([np.repeat(ctx, cfg.targets, axis=0), target.reshape(-1, 1)], axis=1)
    return rows[rng.permutation(len(rows))]


def distinct_batch(held_out: np.ndarray, n: int) -> np.ndarray:
    """``n`` held-out n-grams of pairwise different contexts."""
    _, first = np.unique(held_out[:, :-1], axis=0, return_index=True)
    if len(first) < n:
        raise SystemExit(f"the held-out text has {len(first)} distinct contexts, fewer than {n}")
    return held_out[np.sort(first)[:n]]


def per_row(lm: LanguageModel, ctx: np.ndarray, target: np.ndarray, normalized: np.ndarray) -> np.ndarray:
    """Every piece on every row: what ``score_prepared`` computed before it de-duplicated."""
    with torch.inference_mode():
        ctx_t, target_t = torch.from_numpy(ctx), torch.from_numpy(target)
        r = lm.encode_contexts(ctx_t)  # (N, E)
        score = lm.raw_score(r, target_t, ctx_t)
        if normalized.all():
            score -= lm.class_log_normalizer(r, ctx_t)
            score -= lm.in_class_log_normalizer(r, lm.word_classes(target_t), ctx_t)
        elif normalized.any():
            rows = torch.from_numpy(np.flatnonzero(normalized))
            rr, cc = r[rows], ctx_t[rows]
            score[rows] -= lm.class_log_normalizer(rr, cc) + lm.in_class_log_normalizer(rr, lm.word_classes(target_t[rows]), cc)
        return score.numpy()  # type: ignore[no-any-return]


def measure(lm: LanguageModel, name: str, rows: np.ndarray, cfg: ScoringBench) -> list[dict[str, Any]]:
    """Both paths on ``rows``, normalised and not: checked equal, then timed."""
    ctx, target = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, -1])
    n = len(rows)
    out = []
    for normalized in (True, False):
        flags = np.full(n, normalized)
        plan = plan_batch(ctx, target, lm.word_classes(torch.from_numpy(target)).numpy(), flags)
        old = per_row(lm, ctx, target, flags)
        new = lm.score_prepared(ctx, target, flags)
        gap = float(np.abs(old - new).max())
        if gap > TOL:
            raise SystemExit(f"{name}: the two paths differ by {gap:.3g} (normalised {normalized})")

        def timed(fn: Callable[[np.ndarray, np.ndarray, np.ndarray], object]) -> Callable[[], int]:
            return lambda: (fn(ctx, target, flags), n)[1]

        old_rate = rate(timed(lambda c, t, f: per_row(lm, c, t, f)), cfg.seconds)
        new_rate = rate(timed(lm.score_prepared), cfg.seconds)
        row = {"batch": name, "rows": n, "contexts": int(plan.contexts.size), "distinct_rows": int(plan.rows.size),
               "pairs": int(plan.pair_class.size), "normalized": normalized, "max_abs_diff": gap,
               "per_row_ngrams_per_s": old_rate, "dedup_ngrams_per_s": new_rate,
               "ratio": new_rate / old_rate if old_rate else float("nan")}
        print(f"{name:9s} {n:6d} {row['contexts']:9d} {row['distinct_rows']:9d} {row['pairs']:7d} "
              f"{'exact' if normalized else 'unnorm':7s} {old_rate:14,.0f} {new_rate:14,.0f} {row['ratio']:7.2f}x",
              flush=True)
        out.append(row)
    return out


def render(res: dict[str, Any]) -> str:
    """The run's section of docs/performance-serving.md: both paths' rates on both batches."""
    begin, end = markers("scoring.py")
    m, c = res["machine"], res["config"]
    lines = [begin, "",
             f"{res['date']}, {machine_line(m)}. "
             f"Model: order {c['order']}, width {c['dim']}, {c['vocab_size']:,} words, random weights, "
             f"{c['torch_threads']} torch thread(s). `decoder`: {c['hypotheses']} hypotheses' contexts × "
             f"{c['targets']} targets, as a decoder's boundary n-grams; `distinct`: as many held-out n-grams, "
             "no two with the same context. Best of three runs of each.", "",
             "| batch | rows | distinct contexts | distinct rows | (context, class) pairs | scores | every row on its own (n-grams/s) | de-duplicated (n-grams/s) | ratio |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in res["results"]:
        lines.append(f"| {r['batch']} | {r['rows']:,} | {r['contexts']:,} | {r['distinct_rows']:,} | {r['pairs']:,} | "
                     f"{'exact' if r['normalized'] else 'self-normalised'} | {r['per_row_ngrams_per_s']:,.0f} | "
                     f"{r['dedup_ngrams_per_s']:,.0f} | {r['ratio']:.2f} |")
    lines += ["", f"Command: `{shown_command(res['command'])}`", "", end]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    d = ScoringBench()
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--hypotheses", type=int, default=d.hypotheses)
    ap.add_argument("--targets", type=int, default=d.targets)
    ap.add_argument("--seconds", type=float, default=d.seconds)
    ap.add_argument("--torch-threads", type=int, default=d.torch_threads)
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model and batch, one call per rate: checks the script, measures nothing")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--doc", type=Path, help="write the table into this page (between its bench/scoring.py markers)")
    ap.add_argument("--render", nargs=2, type=Path, metavar=("DOC", "JSON"),
                    help="write a saved run's table into DOC, measuring nothing")
    args = ap.parse_args(argv)
    if args.render:
        write_saved(*args.render, "scoring.py", render)
        return 0
    if args.quick and (args.json or args.doc):
        ap.error("--quick measures nothing: it writes no --json or --doc")
    cfg = QUICK if args.quick else ScoringBench(
        vocab_size=args.vocab_size, dim=args.dim, hypotheses=args.hypotheses, targets=args.targets,
        seconds=args.seconds, torch_threads=args.torch_threads)
    torch.set_num_threads(cfg.torch_threads)
    res: dict[str, Any] = {"command": shlex.join(["bench/scoring.py", *(argv if argv is not None else sys.argv[1:])]),
                           "date": time.strftime("%Y-%m-%d"), "machine": machine(), "config": asdict(cfg)}
    print(json.dumps(res["machine"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.nlm"
        build_model(cfg, path)
        lm = LanguageModel.load(path, device="cpu")
    assert lm._tables() is not None  # the CPU tables, as the server scores with
    print(f"model: V={len(lm.vocab):,} K={lm.num_classes} D={cfg.dim} order={cfg.order}; "
          f"{cfg.hypotheses} hypotheses x {cfg.targets} targets, {cfg.torch_threads} torch thread(s)")
    held_out = held_out_rows(lm)
    decoder = decoder_batch(held_out, cfg)
    print(f"{'batch':9s} {'rows':>6s} {'contexts':>9s} {'distinct':>9s} {'pairs':>7s} {'rows':7s} "
          f"{'per-row/s':>14s} {'dedup/s':>14s} {'ratio':>8s}")
    res["results"] = (measure(lm, "decoder", decoder, cfg)
                      + measure(lm, "distinct", distinct_batch(held_out, len(decoder)), cfg))
    if args.quick:
        print("(--quick: a tiny model, one call per rate; the numbers measure nothing)")
    if args.json:
        write_json(args.json, res)
    if args.doc:
        write_section(args.doc, *markers("scoring.py"), render(res))
    return 0


if __name__ == "__main__":
    exit_with(main)
