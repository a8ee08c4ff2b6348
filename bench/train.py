"""Training speed and quality of the three objectives in the same wall time.

For each objective (nce: class-factored NCE with sparse AdaGrad; mle: exact
class-factored cross-entropy; softmax: full-softmax cross-entropy) it trains a model on
the same text with the same vocabulary, width, batch size and learning rate for the same
number of minutes (``nlmserve.lm.train`` with ``max_minutes``) and reports:

* tokens/s: training tokens per second of wall time (periodic validation included);
* steps and tokens seen;
* dev perplexity (exact, normalised, ``</s>`` counted, OOVs as ``<unk>``) of the best
  model, as ``nlmserve eval`` reports it;
* the ratio of each row's tokens/s and perplexity to the softmax baseline's;
* the training step that ran and why (the model file's ``step_ran``, ``step_reason``): NCE
  with ``--nce-step`` (default ``fused``; ``torch`` for the reference step), the others with
  ``torch``, the only step they have. The step is always named, never ``auto``, so a run that
  would have measured another step (``NLMSERVE_FUSED=0``, numba missing) is refused.

It also times the two exact in-class normaliser strategies (grouped by class vs padded to
the largest class) on one batch, the measurement behind the model's choice. Usage:

    .venv/bin/python -m bench.train                          # shipped slice, 3 x 1.5 min on 1 thread
    .venv/bin/python -m bench.train --minutes 3 --threads 2 --dim 256
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import exit_with, TRAINING_STEPS, train_seconds, training_step

from nlmserve.lm.evaluate import evaluate
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.data import prepare_data
from nlmserve.lm.train import TrainConfig, model_config, train

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "data" / "lm" / "europarl.train.50k.lc-moses.en.xz"
DEV = REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en"

log = logging.getLogger("bench.train")


def in_class_timing(cfg: TrainConfig, batch: int = 512, repeats: int = 3) -> dict[str, float]:
    """Milliseconds per forward+backward of the exact in-class normaliser, per strategy."""
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.outputs.class_factored import ClassOutput

    data = prepare_data(cfg)
    mconf = model_config(cfg, data)
    assert data.classes is not None
    model = NeuralLM(mconf, data.classes.word_class)
    rng = np.random.default_rng(0)
    pos = np.sort(rng.integers(0, data.train.num_tokens, batch))
    ctx, tgt = data.train.examples(pos, mconf.order)
    out_layer = model.output
    assert isinstance(out_layer, ClassOutput)
    r = model.encode(torch.from_numpy(ctx))
    cls = out_layer.word_class[torch.from_numpy(tgt)]
    out: dict[str, float] = {}
    for method in ("grouped", "padded"):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out_layer.in_class_log_normalizer(r, cls, method=method).sum().backward(retain_graph=True)
        out[method] = (time.perf_counter() - t0) / repeats * 1000
    return out


def step_of(objective: str, nce_step: str) -> str:
    """The ``--step`` an objective's run is given: ``nce_step`` for NCE, ``torch`` for the
    others (the fused step is NCE's)."""
    return nce_step if objective == "nce" else "torch"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", default=str(TRAIN))
    p.add_argument("--dev", default=str(DEV))
    p.add_argument("--minutes", type=float, default=1.5, help="wall time per objective")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--objectives", default="nce,mle,softmax")
    p.add_argument("--nce-step", choices=TRAINING_STEPS, default="fused",
                   help="nlmserve train --step of the NCE run (mle and softmax: torch, their only step)")
    p.add_argument("--workdir", default="runs/bench-train")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON lines")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for objective in args.objectives.split(","):
        cfg = TrainConfig(
            train=args.train, valid=args.dev, out=str(work / f"{objective}.nlm"), workdir=str(work / "ids"),
            objective=objective, dim=args.dim, batch_size=args.batch_size, lr=args.lr, threads=args.threads,
            epochs=1000, max_minutes=args.minutes, checkpoint_every=0, progress=False, learning_curve=False,
            step=step_of(objective, args.nce_step),
        )
        t0 = time.monotonic()
        result = train(cfg)
        wall = time.monotonic() - t0
        lm = LanguageModel.load(cfg.out, device="cpu")
        ev = evaluate(lm, args.dev)
        seconds = train_seconds(cfg.out)
        rows.append({
            "objective": objective,
            **training_step(lm.training, cfg.step, cfg.out),
            "output": lm.output_type,
            "vocab": len(lm.vocab),
            "classes": lm.num_classes,
            "steps": result.steps,
            "tokens": result.tokens,
            "train_seconds": seconds,
            "tokens_per_s": result.tokens / seconds,
            "dev_ppl": ev.perplexity,
            "dev_ppl_excl_oov": ev.perplexity_excl_oov,
            "wall_seconds": wall,
        })
        log.info("%s: %s", objective, rows[-1])
    base = next((r for r in rows if r["objective"] == "softmax"), rows[0])
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
          f"torch {torch.__version__}; {args.minutes} min per objective; dim {args.dim}, batch {args.batch_size}, "
          f"AdaGrad lr {args.lr}")
    print(f"# train {args.train}; dev {args.dev}; V = {rows[0]['vocab']}")
    print("| objective | training step | output | classes | steps | tokens seen | tokens/s | × softmax | dev ppl "
          "| dev ppl excl. OOV |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['objective']} | {r['step']} | {r['output']} | {r['classes']} | {r['steps']} | {r['tokens']:,} | "
              f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.1f} | {r['dev_ppl']:.1f} | "
              f"{r['dev_ppl_excl_oov']:.1f} |")
    if any(r["objective"] != "softmax" for r in rows):
        cfg = TrainConfig(train=args.train, out=str(work / "timing.nlm"), workdir=str(work / "ids"),
                          dim=args.dim, objective="mle")
        t = in_class_timing(cfg, 64)
        print(f"\nexact in-class normaliser, forward+backward of one batch of 64: "
              f"grouped by class {t['grouped']:.1f} ms, padded to the largest class {t['padded']:.1f} ms "
              f"({t['padded'] / t['grouped']:.0f}x)")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    exit_with(main)
