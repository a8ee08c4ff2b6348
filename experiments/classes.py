"""Word classes: frequency binning vs the exchange algorithm, K = √V vs 3·√V.

For each method and each factor f (K = round(f·√V)) it measures, in one run on the same
data:

* the time to build the classes, the largest class and the output cost ``K + E|c(w)|``
  (dot products of one normalised prediction, averaged over training tokens);
* the class-bigram log-likelihood per training token (the exchange objective);
* the perplexity of a smoothed class-bigram model on the dev text (a model-free measure
  of how predictive the classes are);
* unless ``--no-train``: a class-factored NCE model trained for the same number of steps
  with those classes (``nlmserve.lm.train``, ``class_file`` so every model sees exactly
  the partition measured above), its exact (normalised) dev perplexity, training time and
  normalised scoring speed on the dev text.

Each row is also given as a ratio to the first row (frequency, smallest factor). Usage:

    .venv/bin/python -m experiments.classes                       # shipped 50k-line slice, 6-8 min on 1 core
    .venv/bin/python -m experiments.classes --no-train            # classes only, under a minute
    .venv/bin/python -m experiments.classes --train ../shared/data/lm/europarl.train.lc-moses.en.xz \\
        --dev ../shared/data/lm/europarl.dev.lc-moses.en --steps 20000 --threads 2

experiments/results.md ("Training") records the measurements; docs/classes.md ("Number of
classes"), the default chosen from them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from nlmserve.lm.classes import (
    WordClasses,
    brown_clusters,
    class_bigram_log_likelihood,
    frequency_binning,
    save_wcluster,
)
from nlmserve.lm.corpus import CorpusIds, count_words, read_sentences
from nlmserve.lm.vocab import Vocabulary

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("experiments.classes")


@dataclass
class Row:
    method: str
    factor: float
    num_classes: int
    build_s: float
    max_class_size: int
    output_cost: float  # K + E|c(w)|: dot products per normalised prediction, token-weighted
    train_ll_per_token: float
    dev_class_bigram_ppl: float
    nlm_dev_ppl: float | None = None
    nlm_train_s: float | None = None
    nlm_score_tokens_per_s: float | None = None


def class_bigram_perplexity(
    classes: WordClasses, train: tuple[np.ndarray, np.ndarray, np.ndarray], dev: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> float:
    """Dev perplexity of ``P(c(w)|c(u)) · P(w|c(w))`` estimated on the training bigrams.

    Class transitions are Witten–Bell smoothed towards the class unigram distribution;
    ``P(w|c)`` adds 1/2 to every word's count (so ``<unk>`` and rare dev words get mass).
    """
    wc = classes.word_class
    K, V = classes.num_classes, classes.vocab_size
    left, right, count = train
    cnt = count.astype(np.float64)
    m = np.bincount(wc[left] * K + wc[right], weights=cnt, minlength=K * K).reshape(K, K)
    n_left = m.sum(axis=1)
    types = (m > 0).sum(axis=1)
    class_uni = m.sum(axis=0) / m.sum()
    p_class = (m + types[:, None] * class_uni[None, :]) / np.maximum(n_left + types, 1.0)[:, None]
    p_class[n_left == 0] = class_uni
    n_word = np.bincount(right, weights=cnt, minlength=V) + 0.5
    p_word = n_word / np.bincount(wc, weights=n_word, minlength=K)[wc]
    dl, dr, dc = dev
    ll = float((dc * (np.log(p_class[wc[dl], wc[dr]]) + np.log(p_word[dr]))).sum())
    return math.exp(-ll / float(dc.sum()))


def head_lines(src: Path, n: int | None, dst: Path) -> Path:
    if n is None:
        return src
    with open(dst, "w", encoding="utf-8") as out:
        for i, tokens in enumerate(read_sentences(src)):
            if i >= n:
                break
            out.write(" ".join(tokens) + "\n")
    return dst


def build(method: str, corpus: CorpusIds, unigram: np.ndarray, k: int, seed: int) -> WordClasses:
    if method == "frequency":
        return frequency_binning(unigram, k)
    if method == "sqrt":
        return frequency_binning(unigram, k, sqrt=True)
    if method == "brown":
        return brown_clusters(corpus, unigram.size, k, seed=seed)
    raise ValueError(f"unknown method {method!r}")


def train_with(args: argparse.Namespace, text: Path, paths_file: Path, out: Path) -> tuple[float | None, float, float]:
    """Train one model with the classes of ``paths_file``; (dev ppl, train s, scoring tokens/s)."""
    import torch

    from nlmserve.lm.train import TrainConfig, perplexity, train

    cfg = TrainConfig(
        train=str(text), valid=str(args.dev), out=str(out), order=args.order, dim=args.dim,
        class_file=str(paths_file), objective="nce", min_count=args.min_count, epochs=1000,
        max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, threads=args.threads,
        seed=args.seed, progress=False, learning_curve=False, checkpoint_every=0,
        workdir=str(out.parent / "work"),
    )
    t0 = time.perf_counter()
    result = train(cfg)
    train_s = time.perf_counter() - t0
    dev = CorpusIds.open(out.parent / "work" / "valid.ids")
    model = result.model.eval()
    t0 = time.perf_counter()
    perplexity(model, dev, args.order, torch.device("cpu"))
    score_s = time.perf_counter() - t0
    return result.best_valid_ppl, train_s, dev.num_tokens / score_s


def run(args: argparse.Namespace) -> list[Row]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    text = head_lines(Path(args.train), args.max_train_lines, work / "train.txt")
    counts, n_sent = count_words(text)
    vocab = Vocabulary.build(counts, min_count=args.min_count)
    V = len(vocab)
    corpus = CorpusIds.encode(text, vocab, work / "train.ids")
    dev = CorpusIds.encode(args.dev, vocab, work / "dev.ids")
    log.info("train: %d sentences, %d tokens, V=%d; dev: %d tokens", n_sent, corpus.num_tokens, V, dev.num_tokens)
    unigram = corpus.unigram_counts(V)
    train_bigrams = corpus.bigram_counts(V)
    dev_bigrams = dev.bigram_counts(V)
    rows: list[Row] = []
    for factor in args.factors:
        k = max(1, min(V, round(factor * math.sqrt(V))))
        for method in args.methods:
            t0 = time.perf_counter()
            classes = build(method, corpus, unigram, k, args.seed)
            build_s = time.perf_counter() - t0
            ll = class_bigram_log_likelihood(*train_bigrams, classes.word_class) / float(train_bigrams[2].sum())
            mass = np.bincount(classes.word_class, weights=unigram, minlength=k)
            cost = k + float((mass * classes.class_sizes).sum() / mass.sum())
            row = Row(method, factor, k, build_s, int(classes.class_sizes.max()), cost, ll,
                      class_bigram_perplexity(classes, train_bigrams, dev_bigrams))
            if not args.no_train:
                run_dir = work / f"{method}.{factor:g}"
                run_dir.mkdir(exist_ok=True)
                paths_file = run_dir / "classes.paths"
                save_wcluster(paths_file, classes, vocab, unigram)
                row.nlm_dev_ppl, row.nlm_train_s, row.nlm_score_tokens_per_s = train_with(
                    args, text, paths_file, run_dir / "model.nlm"
                )
            log.info("%s", row)
            rows.append(row)
    return rows


def report(rows: list[Row], args: argparse.Namespace) -> str:
    base = rows[0]
    lines = [
        f"# experiments/classes.py  train={args.train} lines={args.max_train_lines} min_count={args.min_count} "
        f"steps={args.steps if not args.no_train else 0} dim={args.dim} order={args.order} threads={args.threads}",
        f"{'method':<10} {'K':>5} {'build s':>8} {'max|c|':>6} {'K+E|c|':>7} {'LL/tok':>8} {'cb ppl':>8} {'ratio':>6}"
        + ("" if args.no_train else f" {'NLM ppl':>8} {'ratio':>6} {'train s':>8} {'score tok/s':>11} {'ratio':>6}"),
    ]
    for r in rows:
        line = (f"{r.method:<10} {r.num_classes:>5} {r.build_s:>8.1f} {r.max_class_size:>6} {r.output_cost:>7.1f} "
                f"{r.train_ll_per_token:>8.4f} "
                f"{r.dev_class_bigram_ppl:>8.1f} {r.dev_class_bigram_ppl / base.dev_class_bigram_ppl:>6.3f}")
        if r.nlm_dev_ppl is not None and base.nlm_dev_ppl is not None:
            assert r.nlm_score_tokens_per_s is not None and base.nlm_score_tokens_per_s is not None
            line += (f" {r.nlm_dev_ppl:>8.1f} {r.nlm_dev_ppl / base.nlm_dev_ppl:>6.3f} {r.nlm_train_s:>8.1f}"
                     f" {r.nlm_score_tokens_per_s:>11,.0f} {r.nlm_score_tokens_per_s / base.nlm_score_tokens_per_s:>6.3f}")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--train", default=str(REPO / "data/lm/europarl.train.50k.lc-moses.en.xz"))
    p.add_argument("--dev", default=str(REPO / "data/lm/europarl.dev.1k.lc-moses.en"))
    p.add_argument("--max-train-lines", type=int, default=None, help="use only the first N training lines")
    p.add_argument("--min-count", type=int, default=2)
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 3.0],
                   help="K = round(f·sqrt(V)) for each f (default 1,3)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["frequency", "brown"],
                   help="frequency, sqrt (frequency binning by sqrt mass), brown (default frequency,brown)")
    p.add_argument("--no-train", action="store_true", help="measure the classes only")
    p.add_argument("--steps", type=int, default=6000, help="training steps per model (default 6000, ≈ 2 epochs of the 50k slice)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--order", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", default="runs/bench-classes")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    rows = run(args)
    print(report(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
