"""Rescoring throughput: `nlmserve rescore` through a real server vs KenLM's Python module.

    .venv/bin/python -m bench.rescore [--model M] [--kenlm-model lm.arpa|lm.binary]
                                      [--nbest LIST ...] [--json out.json]

Both score the same n-best lists: every hypothesis' sentence probability with ``</s>``.
nlmserve: the rescoring path (ids packed with the vocabulary, distinct n-grams of a batch
scored once over gRPC, sums per hypothesis, the output written with checkpoints) against a
``nlmserve serve`` subprocess on 127.0.0.1. KenLM: ``kenlm.Model.score`` in-process on
each hypothesis. Without ``--model`` a model is trained for ``--train-minutes`` on the
shipped Europarl slice (speed does not depend on how well it is trained); without
``--kenlm-model`` a count-based 5-gram ARPA (n-grams seen twice or more, relative
frequencies, constant back-off: the size of a real model on this text, not its quality)
is written from the same slice. Prints rates measured in this one run and their ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import lzma
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from nlmserve.client import LMClient
from nlmserve.pipeline.experiment import train_model
from nlmserve.pipeline.config import ExperimentConfig
from nlmserve.moses_plugin.nbest import iter_entries
from nlmserve.moses_plugin.rescore import RescoreConfig, rescore
from nlmserve.common.serve_process import start_server

from bench._common import exit_with, machine

REPO = Path(__file__).resolve().parent.parent
NEWS = REPO / "data" / "nbest" / "newstest-fr-en"
TRAIN = REPO / "data" / "lm" / "europarl.train.50k.lc-moses.en.xz"


def write_arpa(text: Path, out: Path, order: int = 5, min_count: int = 2) -> int:
    """A valid ARPA file of relative frequencies from ``text`` (see the module doc); returns n-grams."""
    counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]
    with lzma.open(text, "rt", encoding="utf-8") as handle:
        for line in handle:
            words = ["<s>", *line.split(), "</s>"]
            for n in range(1, order + 1):
                for i in range(len(words) - n + 1):
                    counts[n - 1][tuple(words[i : i + n])] += 1
    kept = [counts[0]] + [Counter({k: v for k, v in c.items() if v >= min_count}) for c in counts[1:]]
    kept[0][("<unk>",)] = 1
    total = sum(kept[0].values())
    lines = ["\\data\\"] + [f"ngram {n + 1}={len(c)}" for n, c in enumerate(kept)] + [""]
    for n, c in enumerate(kept):
        lines.append(f"\\{n + 1}-grams:")
        for gram, count in c.items():
            denominator = total if n == 0 else counts[n - 1][gram[:-1]]
            prob = -99.0 if gram == ("<s>",) else math.log10(count / denominator)
            backoff = "\t-0.5" if n + 1 < order else ""
            lines.append(f"{prob:.6f}\t{' '.join(gram)}{backoff}")
        lines.append("")
    lines.append("\\end\\")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sum(len(c) for c in kept)


def kenlm_rate(path: str, hyps: list[str]) -> dict[str, float]:
    import kenlm  # type: ignore[import-not-found]

    model = kenlm.Model(path)
    start = time.perf_counter()
    total = 0.0
    for hyp in hyps:
        total += model.score(hyp, bos=True, eos=True)
    seconds = time.perf_counter() - start
    ngrams = sum(len(h.split()) + 1 for h in hyps)
    return {"seconds": seconds, "hyp_per_s": len(hyps) / seconds, "ngrams_per_s": ngrams / seconds, "order": model.order}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="nlmserve model file (default: train one briefly)")
    ap.add_argument("--train-minutes", type=float, default=1.0)
    ap.add_argument("--kenlm-model", help="KenLM ARPA or binary (default: build a count-based ARPA)")
    ap.add_argument("--nbest", nargs="+", default=[str(NEWS / "newstest2013.300.nbest.gz"),
                                                    str(NEWS / "newstest2012.300.nbest.gz")])
    ap.add_argument("--batch-ngrams", type=int, default=50_000)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    host = machine()
    with tempfile.TemporaryDirectory(prefix="bench-rescore-") as tmp:
        work = Path(tmp)
        model = Path(args.model) if args.model else train_model(
            ExperimentConfig(minutes=args.train_minutes, train_args=("--order", "5", "--dim", "128", "--min-count", "2",
                                                                     "--threads", "2", "--max-steps", "200")),
            work / "bench.model")
        kenlm_path = args.kenlm_model
        arpa_ngrams = None
        if kenlm_path is None:
            kenlm_path = str(work / "bench.arpa")
            arpa_ngrams = write_arpa(TRAIN, Path(kenlm_path))
        hyps = [e.hyp for path in args.nbest for e in iter_entries(path)]
        server = start_server(model, ["--torch-threads", "2"])
        try:
            ours: dict[str, Any] = {"hypotheses": 0, "ngrams": 0, "distinct_ngrams": 0, "seconds": 0.0}
            for i, path in enumerate(args.nbest):
                config = RescoreConfig(batch_ngrams=args.batch_ngrams, progress=False)
                stats = rescore(path, str(work / f"out.{i}.nbest"), lambda: LMClient(server.target, timeout=120), config)
                for key in ("hypotheses", "ngrams", "distinct_ngrams", "seconds"):
                    ours[key] += getattr(stats, key)
        finally:
            server.stop()
        ours.update(hyp_per_s=ours["hypotheses"] / ours["seconds"], ngrams_per_s=ours["ngrams"] / ours["seconds"],
                    dedup_rate=ours["distinct_ngrams"] / ours["ngrams"], distinct_per_s=ours["distinct_ngrams"] / ours["seconds"])
        theirs = kenlm_rate(kenlm_path, hyps)
    result = {"nlmserve": ours, "kenlm": theirs, "kenlm_arpa_ngrams": arpa_ngrams, "lists": args.nbest,
              "machine": host}
    print(f"nlmserve rescore: {ours['hypotheses']} hypotheses, {ours['ngrams']} n-grams in {ours['seconds']:.2f} s:"
          f" {ours['hyp_per_s']:,.0f} hyp/s, {ours['ngrams_per_s']:,.0f} n-grams/s"
          f" (distinct/total {ours['dedup_rate']:.3f}: {ours['distinct_per_s']:,.0f} distinct n-grams/s reach the server)")
    print(f"KenLM Python module (order {theirs['order']}, in-process): {theirs['hyp_per_s']:,.0f} hyp/s,"
          f" {theirs['ngrams_per_s']:,.0f} n-grams/s")
    print(f"ratio nlmserve / KenLM: {ours['ngrams_per_s'] / theirs['ngrams_per_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    exit_with(main)
