"""Every output strategy trained for the same wall time on the same Europarl text, in one
run, then compared: test perplexity alone and interpolated with a Kneser-Ney 5-gram,
training tokens/s, normalised and unnormalised scoring n-grams/s, model size, and the
validation perplexity against time (a PNG). Writes experiments/strategies.md.

Data (``--data``, default ../shared/data/lm): the first ``--lines`` lines of
europarl.train.lc-moses.en.xz for training (and for the KN 5-gram); of
europarl.dev.lc-moses.en, lines 1-300 are the validation text of the curves (and of the
learning-rate schedule), lines 301-1300 tune the interpolation weight, lines 1301-2300
are the test text. ``--min-count 1`` on both sides, so the neural and the KN vocabularies
(and OOV sets) coincide.

Each strategy first runs 20 steps to measure its speed, so that every one validates
about every ``--valid-seconds`` seconds of training; then it trains for ``--minutes``
(wall time from the start of ``train``: vocabulary and id files are cached after the
first strategy; the feature-based trees spend up to a third of it on their random-tree
model). Usage:

    .venv/bin/python -m experiments.strategies --kenlm-bin /path/to/kenlm/build/bin          # ~45 min
    .venv/bin/python -m experiments.strategies --minutes 0.3 --lines 20000 --only huffman,softmax --doc /tmp/s.md
"""

from __future__ import annotations

import argparse
import json
import logging
import lzma
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nlmserve.lm.evaluate import evaluate
from nlmserve.lm.interpolate import load_kn, mix_log10, score_text, tune_weight
from nlmserve.lm.outputs.tree import TreeOutput
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.train import TrainConfig, train
from nlmserve.common.perplexity import from_log10

from bench._common import machine, train_seconds

log = logging.getLogger("experiments.strategies")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Strategy:
    name: str
    output: str
    objective: str
    extra: dict[str, Any] = field(default_factory=dict)


STRATEGIES = (
    Strategy("class + NCE", "class", "nce"),
    Strategy("softmax", "softmax", "mle"),
    Strategy("dsoftmax", "dsoftmax", "mle"),
    Strategy("target sampling", "softmax", "sampling", {"noise_samples": 500}),
    Strategy("weaknorm", "softmax", "weaknorm"),
    Strategy("weaknormsq", "softmax", "weaknormsq"),
    Strategy("huffman tree", "huffman", "mle"),
    Strategy("random tree", "random", "mle"),
    Strategy("balanced tree", "balanced", "mle"),
    Strategy("adaptive tree", "adaptive", "mle"),
    Strategy("adaptive(0.25) tree", "adaptive-eps", "mle"),
)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def split_texts(data: Path, lines: int, work: Path) -> dict[str, Path]:
    """train (first ``lines`` lines), valid, tune, test."""
    out = {name: work / f"{name}.txt" for name in ("train", "valid", "tune", "test")}
    if not out["train"].exists():
        with lzma.open(data / "europarl.train.lc-moses.en.xz", "rt", encoding="utf-8") as src, \
                open(out["train"], "w", encoding="utf-8") as dst:
            for i, line in enumerate(src):
                if i >= lines:
                    break
                dst.write(line)
    dev = (data / "europarl.dev.lc-moses.en").read_text(encoding="utf-8").splitlines(keepends=True)
    for name, (a, b) in {"valid": (0, 300), "tune": (300, 1300), "test": (1300, 2300)}.items():
        out[name].write_text("".join(dev[a:b]), encoding="utf-8")
    return out


def build_kn(kenlm_bin: Path, train_txt: Path, work: Path) -> Path:
    binary = work / "kn5.binary"
    if binary.exists():
        return binary
    arpa = work / "kn5.arpa"
    with open(train_txt, "rb") as src, open(arpa, "wb") as dst:
        subprocess.run([str(kenlm_bin / "lmplz"), "-o", "5", "-S", "2G", "-T", str(work)], stdin=src, stdout=dst,
                       check=True, stderr=subprocess.DEVNULL)
    subprocess.run([str(kenlm_bin / "build_binary"), str(arpa), str(binary)], check=True, stdout=subprocess.DEVNULL)
    return binary


def base_config(s: Strategy, texts: dict[str, Path], work: Path, args: argparse.Namespace, **kw: Any) -> TrainConfig:
    settings: dict[str, Any] = dict(
        train=str(texts["train"]), valid=str(texts["valid"]), out=str(work / f"{slug(s.name)}.nlm"),
        order=5, dim=args.dim, min_count=1, objective=s.objective, output=s.output, threads=args.threads,
        seed=1, batch_size=512, lr=0.1, epochs=100, patience=1000, progress=False, learning_curve=False,
        checkpoint_every=0, workdir=str(work / "data"), log_every=50, tree_pretrain_steps=100_000,
    )
    settings.update(s.extra)
    settings.update(kw)
    return TrainConfig(**settings)


def calibrate(s: Strategy, texts: dict[str, Path], work: Path, args: argparse.Namespace) -> int:
    """Steps between validations so that one falls every ``args.valid_seconds`` seconds."""
    probe = Strategy(s.name, "random" if s.output in ("balanced", "adaptive", "adaptive-eps") else s.output,
                     s.objective, s.extra)
    cfg = base_config(probe, texts, work, args, valid=None, max_steps=20, out=str(work / "probe.nlm"), log_every=10)
    t0 = time.monotonic()
    res = train(cfg)
    per_step = train_seconds(res.model_path) / max(res.steps, 1)
    log.info("%s: %.3f s/step (probe %.1f s)", s.name, per_step, time.monotonic() - t0)
    return max(10, int(args.valid_seconds / max(per_step, 1e-6)))


def scoring_speed(lm: LanguageModel, ids: np.ndarray, normalized: bool, batch: int) -> float:
    """n-grams/s of score_ngrams over ``ids`` in requests of ``batch`` rows."""
    lm.score_ngrams(ids[:batch], normalized=normalized)  # warm up
    t0 = time.perf_counter()
    for a in range(0, len(ids), batch):
        lm.score_ngrams(ids[a : a + batch], normalized=normalized)
    return len(ids) / (time.perf_counter() - t0)


def curve(log_path: Path, offset: float) -> list[tuple[float, float]]:
    points = []
    for line in log_path.read_text().splitlines():
        rec = json.loads(line)
        if "valid_ppl" in rec:
            points.append((offset + float(rec["elapsed"]), float(rec["valid_ppl"])))
    return points


def run_one(s: Strategy, texts: dict[str, Path], work: Path, args: argparse.Namespace, kn: Any) -> dict[str, Any]:
    every = calibrate(s, texts, work, args)
    cfg = base_config(s, texts, work, args, max_minutes=args.minutes, valid_every=every)
    t0 = time.monotonic()
    res = train(cfg)
    wall = time.monotonic() - t0
    lm = LanguageModel.load(res.model_path, device="cpu")
    seconds = train_seconds(res.model_path)
    setup = wall - seconds  # data, tree building (and pretraining), saving
    ev = evaluate(lm, texts["test"])
    row: dict[str, Any] = {
        "name": s.name, "output": s.output, "objective": s.objective, "steps": res.steps, "tokens": res.tokens,
        "train_seconds": seconds, "setup_seconds": round(setup, 1),
        "tokens_per_s": res.tokens / max(seconds, 1e-9), "valid_ppl": res.best_valid_ppl,
        "test_ppl": ev.perplexity, "test_ppl_excl_oov": ev.perplexity_excl_oov, "test_oov": ev.oov,
        "test_tokens": ev.tokens, "log_z_mean": ev.log_z_mean, "log_z_std": ev.log_z_std,
        "size_mb": os.path.getsize(res.model_path) / 2**20, "self_normalized": lm.self_normalized,
        "curve": curve(Path(cfg.log_path), setup),
    }
    if isinstance(lm.net.output, TreeOutput):
        lengths = lm.net.output.tree.code_lengths()
        row["codes_per_word"] = len(lengths) / (lm.config.vocab_size - 1)
        row["mean_code_length"] = float(lengths.mean())
    if kn is not None:
        weight = tune_weight(score_text(lm, kn, texts["tune"]))
        t = score_text(lm, kn, texts["test"])
        mix = mix_log10(t.nlm, t.kn, weight)
        row.update(kn_weight=weight, kn_test_ppl=from_log10(float(t.kn.sum()), t.kn.size),
                   mix_test_ppl=from_log10(float(mix.sum()), mix.size))
    ids, _, _, _ = lm.sentence_ngrams([line.split() for line in texts["test"].read_text().splitlines()[:800]])
    ids = ids[: args.speed_ngrams]
    row["score_norm_per_s"] = scoring_speed(lm, ids, True, args.speed_batch)
    row["score_unnorm_per_s"] = scoring_speed(lm, ids, False, args.speed_batch) if lm.self_normalized else None
    log.info("%s: %s", s.name, {k: v for k, v in row.items() if k != "curve"})
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(rows):
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            ax.plot([x / 60 for x in xs], ys, styles[i % 4], marker="o", markersize=3, label=r["name"])
    ax.set_xlabel("minutes since the start of train (setup included)")
    ax.set_ylabel("validation perplexity (300 dev lines)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| strategy | output | objective | test ppl | + KN (λ) | tokens/s | steps | scoring n-grams/s norm. "
             "| unnorm. | size MB | valid ppl |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mix = f"{r['mix_test_ppl']:.1f} ({r['kn_weight']:.2f})" if "mix_test_ppl" in r else "–"
        lines.append(
            f"| {r['name']} | {r['output']} | {r['objective']} | {r['test_ppl']:.1f} | {mix} | "
            f"{r['tokens_per_s']:,.0f} | {r['steps']:,} | {r['score_norm_per_s']:,.0f} | "
            f"{fmt(r['score_unnorm_per_s'], ',.0f')} | {r['size_mb']:.1f} | {fmt(r['valid_ppl'], '.1f')} |")
    return lines


def write_doc(rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any], doc: Path,
              png: Path) -> None:
    best = min(rows, key=lambda r: r["test_ppl"])
    kn_ppl = next((r["kn_test_ppl"] for r in rows if "kn_test_ppl" in r), None)
    lines = [
        "# Output strategies side by side",
        "",
        "Written by `experiments/strategies.py` (one command; the numbers below are from the run it describes).",
        f"Command: `{info['command']}`.",
        "",
        f"Machine: {info['machine']['cpu']}, {info['machine']['cores']} cores, torch {info['machine']['torch']}, "
        f"{args.threads} training threads. The CPU was shared with other jobs: load average "
        f"{info['load_start']:.2f} at the start and {info['load_end']:.2f} at the end of the run "
        f"({info['minutes']:.0f} minutes in all), so absolute speeds are lower than on an idle machine and "
        "strategies trained later may have met a different load than earlier ones.",
        "",
        f"Data: the first {args.lines:,} lines of Europarl (`europarl.train.lc-moses.en.xz`), vocabulary of every "
        f"word seen (V = {info['vocab']:,}); test: {rows[0]['test_tokens']:,} tokens "
        f"({rows[0]['test_oov']} OOV) of `europarl.dev.lc-moses.en` lines 1301-2300; the interpolation weight λ "
        "is tuned on lines 301-1300, the curves and the learning-rate schedule use lines 1-300. Every model: "
        f"order 5, width {args.dim}, diagonal context, AdaGrad (rate 0.1), batch 512, "
        f"**{args.minutes:g} minutes of wall time** from the start of training (the feature-based trees "
        "spend up to a third of it training the random-tree model whose context vectors they cluster).",
        "",
        "## Results",
        "",
        *table(rows),
        "",
        "*test ppl*: exact (normalised) perplexity including OOVs, `</s>` counted, as KenLM's `query` reports it. "
        f"*+ KN*: the linear mix with a modified Kneser-Ney 5-gram (`lmplz -o 5` on the same lines"
        + (f", alone {kn_ppl:.1f}" if kn_ppl else "") + "); λ is the neural model's weight. "
        "*tokens/s*: training tokens per second of the training loop (validation included). "
        f"*scoring*: `LanguageModel.score_ngrams` on {args.speed_ngrams:,} test n-grams in requests of "
        f"{args.speed_batch} rows, normalised, and unnormalised where the method allows it (self-normalised "
        "objectives; a tree's score is its log-probability). *size*: the model file.",
        "",
        f"![validation perplexity against time]({png.name})",
        "",
        "## Reading the table",
        "",
        f"* Lowest test perplexity within the budget: **{best['name']}** ({best['test_ppl']:.1f}).",
    ]
    for r in sorted(rows, key=lambda r: r["test_ppl"]):
        if r is best:
            continue
        lines.append(f"* {r['name']}: {r['test_ppl']:.1f}, {100 * (r['test_ppl'] / best['test_ppl'] - 1):.0f}% "
                     f"above the best, {r['tokens_per_s']:,.0f} tokens/s ({r['steps']:,} steps)"
                     + (f"; mean code length {r['mean_code_length']:.1f}, {r['codes_per_word']:.2f} codes per word"
                        if "mean_code_length" in r else "")
                     + (f"; log Z on the test text {r['log_z_mean']:+.2f} ± {r['log_z_std']:.2f}"
                        if r.get("log_z_mean") is not None else "") + ".")
    if kn_ppl:
        worse = [r["name"] for r in rows if r["test_ppl"] > kn_ppl]
        lines.append(f"* Against Kneser-Ney alone ({kn_ppl:.1f}): {len(worse)} of {len(rows)} strategies are worse "
                     f"alone within this budget; every mix is below both of its parts"
                     + "." if all(r["mix_test_ppl"] < min(r["test_ppl"], kn_ppl) for r in rows)
                     else f"* Against Kneser-Ney alone ({kn_ppl:.1f}): {len(worse)} of {len(rows)} strategies are "
                     "worse alone within this budget.")
    same = {r["name"]: r["tokens_per_s"] for r in rows if r["objective"] in ("weaknorm", "weaknormsq")}
    if len(same) == 2:
        hi, lo = max(same.values()), min(same.values())
        lines.append(f"* **Speeds are noisy in this run.** Weaknorm and WeaknormSQ do the same work per step, yet "
                     f"trained at {lo:,.0f} and {hi:,.0f} tokens/s ({hi / lo:.1f}×): the machine's load from other "
                     "jobs changed while the strategies ran one after the other, and it moves the tokens/s and "
                     "n-grams/s columns (and, through the steps a budget buys, the perplexities) by that much. "
                     "Speed differences smaller than that factor are not evidence, and the ranking by perplexity "
                     "within a wall-time budget inherits that noise: a re-run on an idle machine is needed before "
                     "reading more into it than the large gaps (the full softmax family against the rest).")
    lines += ["", "Raw results: `strategies.json` next to this page.", ""]
    doc.write_text("\n".join(lines) + NOTES, encoding="utf-8")


NOTES = """
## Settings, and where they depart from the papers

* **Trees** (Mnih & Hinton 2008): a word's code is the path from the root; each node n has a
  vector q_n and a bias b_n, P(left) = σ(r·q_n + b_n). Node biases start at the unigram's
  log-odds of the two subtrees (the untrained tree gives the unigram). The feature-based
  trees train a model on a random balanced tree (up to a third of the budget here; Mnih &
  Hinton trained it to convergence), average its predicted context vectors r over each
  word's occurrences (400,000 training positions at most), and split the words recursively
  with a two-component spherical Gaussian mixture fitted by EM (at most 12 iterations, from a
  random word and the word farthest from it). ADAPTIVE(ε) uses ε = 0.25 (Mnih & Hinton tried 0.25
  and 0.4) and caps each word at 4 codes. The tree model is then trained from scratch on
  the new tree, as in the paper. Mnih & Hinton's log-bilinear model is this project's
  diagonal-context model.
* **Huffman** (Mikolov et al. 2013): Huffman codes of the training counts; ties broken by
  word id.
* **Differentiated softmax** (Chen, Grangier & Auli 2016): words by frequency rank in bands
  of 2,500 / 7,500 / the rest with widths 1/2, 1/4, 1/4 of the context width (Chen et al.
  used bands of 10K / 90K / the rest of much larger vocabularies with a 1024+ wide last
  layer; we scaled the band edges to our vocabulary and width).
* **Target sampling** (Jean et al. 2015, as in Chen et al.): one sample of 500 words per
  batch from the unigram, shared by the rows; each row's softmax over the batch's targets
  and the sample, scores corrected by −log q(w). Evaluation is exact.
* **Weaknorm / WeaknormSQ**: the normaliser log Z is computed on a random γ = 10% of the
  rows of each batch. Weaknorm: −s_y on every row plus (log Z + α log² Z)/γ on those rows
  (an unbiased estimate of the cross-entropy plus the penalty), α = 0.1; WeaknormSQ: −s_y
  plus α log² Z/γ (Andreas & Klein's weak normalisation), α = 1. The full text of Chen et
  al. §2.5 was not at hand when this was written: these definitions and the values of α
  and γ follow our reading of Chen et al., Devlin et al. (2014) (α = 0.1) and Andreas & Klein
  (2015); Chen et al. tuned α and γ per data set, which was not done here.
* **Optimiser**: AdaGrad for all, sparse updates of the output rows where a batch touches
  few of them (NCE, sampling, trees); no per-strategy tuning of the learning rate.
* **Budget**: equal wall time, not equal epochs or steps: that is the comparison Chen et al.
  make in their time-budget plots. Validation is part of the training time; a softmax
  validation costs more than a tree's, which the calibration (one validation about every
  `--valid-seconds` seconds of training) bounds but does not remove.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "lm"))
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--minutes", type=float, default=2.5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--valid-seconds", type=float, default=20.0)
    p.add_argument("--speed-ngrams", type=int, default=20_000)
    p.add_argument("--speed-batch", type=int, default=1000)
    p.add_argument("--kenlm-bin", help="directory with lmplz and build_binary (KN 5-gram); none: no KN columns")
    p.add_argument("--only", help="comma-separated strategy names or outputs")
    p.add_argument("--work", default="/tmp/nlmserve-strategies")
    p.add_argument("--doc", default=str(REPO / "experiments" / "strategies.md"))
    p.add_argument("--doc-only", action="store_true", help="rewrite the page from strategies.json (no training)")
    args = p.parse_args(argv)
    if args.doc_only:
        doc = Path(args.doc)
        saved = json.loads(doc.with_name("strategies.json").read_text())
        saved_args = argparse.Namespace(**{**vars(args), **saved["info"].get("args", {})})
        write_doc(saved["rows"], saved_args, saved["info"], doc, doc.with_name("strategies-curves.png"))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("nlmserve").setLevel(logging.WARNING)
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    texts = split_texts(Path(args.data), args.lines, work)
    kn = load_kn(build_kn(Path(args.kenlm_bin), texts["train"], work)) if args.kenlm_bin else None
    chosen = [s for s in STRATEGIES if not args.only or s.name in args.only.split(",") or
              slug(s.name) in args.only.split(",") or s.output in args.only.split(",")]
    rows = [run_one(s, texts, work, args, kn) for s in chosen]
    doc = Path(args.doc)
    png = doc.with_name("strategies-curves.png")
    plot(rows, png)
    vocab = LanguageModel.load(work / f"{slug(chosen[0].name)}.nlm", device="cpu").config.vocab_size
    info = {"machine": machine(), "load_start": load_start, "load_end": os.getloadavg()[0],
            "minutes": (time.monotonic() - t_start) / 60, "vocab": vocab,
            "args": {k: v for k, v in vars(args).items() if k != "doc_only"},
            "command": "python -m experiments.strategies " + " ".join(argv if argv is not None else sys.argv[1:])}
    doc.with_name("strategies.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    write_doc(rows, args, info, doc, png)
    print(f"wrote {doc}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
