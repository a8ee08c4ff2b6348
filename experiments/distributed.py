"""Data-parallel training on one machine: 1 process × 2 threads against 2 processes × 1
thread (``torchrun``, gloo), same model, same data, same global batch and steps.

Each configuration is a real ``nlmserve train`` command (the 2-process ones under
``python -m torch.distributed.run --nproc-per-node 2 ... --distributed``) that trains for
``--steps`` optimiser steps of ``--batch-size`` positions (so every run sees the same number
of tokens) and then validates once on the dev text. From the training log's last record it
reports tokens/s (training tokens over the loop's wall time: data preparation, start-up
and the final validation excluded), the ratio to the first row, and the dev perplexity of
the final model. The configurations:

* ``1x1``: one process, ``--threads 1`` (the reference for scaling);
* ``1x2``: one process, ``--threads 2``;
* ``1x2 passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads sleep instead
  of spinning while they wait: on a machine shared with other jobs spinning threads lose
  their time slices to them, see docs/training.md, "Several processes, GPUs or machines");
* ``2x1 sparse``: two processes, ``--threads 1`` each, sparse embedding gradients (the
  default with AdaGrad: sparse all-reduce) and DDP for the dense ones;
* ``2x1 dense``: the same with ``--dense-grads`` (every gradient through DDP);
* ``1x1 seed 2`` (``--noise-band``): the first row with another seed, to show how far
  perplexity moves from the seed alone (NCE noise and initialisation).

Usage (the shipped slice and dev text by default; id files are shared between the runs):

    .venv/bin/python -m experiments.distributed --steps 2000
    .venv/bin/python -m experiments.distributed --steps 2000 --objective mle --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nlmserve.common.serve_process import free_port

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "data" / "lm" / "europarl.train.50k.lc-moses.en.xz"
DEV = REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en"


def run(name: str, procs: int, threads: int, extra: list[str], args: argparse.Namespace, work: Path,
        env_extra: dict[str, str]) -> dict[str, Any]:
    out = work / (name.replace(" ", "_") + ".nlm")
    train_args = ["train", "--train", str(args.train), "--valid", str(args.dev), "--out", str(out),
                  "--workdir", str(work / "ids"), "--objective", args.objective, "--dim", str(args.dim),
                  "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--threads", str(threads),
                  "--checkpoint-every", "0", "--log-every", "100", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **env_extra}
    if procs == 1:
        cmd = [sys.executable, "-m", "nlmserve", *train_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", "nlmserve", *train_args, "--distributed"]
    load_before = os.getloadavg()[0]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = json.loads(Path(str(out) + ".log.jsonl").read_text().splitlines()[-1])
    return {"name": name, "procs": procs, "threads": threads, "steps": end["step"], "tokens": end["tokens"],
            "seconds": end["elapsed"], "tokens_per_s": end["tokens"] / end["elapsed"], "ppl": end["best_ppl"],
            "load": (load_before, os.getloadavg()[0])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, default=TRAIN)
    ap.add_argument("--dev", type=Path, default=DEV)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=512, help="global batch (each of 2 processes takes half)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--objective", default="nce", choices=("nce", "mle", "softmax"))
    ap.add_argument("--repeats", type=int, default=1, help="run the configurations this many times, interleaved")
    ap.add_argument("--no-dense", action="store_true", help="skip the 2x1 dense-gradient row")
    ap.add_argument("--noise-band", action="store_true", help="add the 1x2 run with seed 2")
    ap.add_argument("--only", help="comma-separated run names to keep, e.g. '1x1,2x1 sparse'")
    ap.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    configs: list[tuple[str, int, int, list[str], dict[str, str]]] = [
        ("1x1", 1, 1, [], {}), ("1x2", 1, 2, [], {}), ("1x2 passive", 1, 2, [], passive), ("2x1 sparse", 2, 1, [], {})]
    if not args.no_dense:
        configs.append(("2x1 dense", 2, 1, ["--dense-grads"], {}))
    if args.noise_band:
        configs.append(("1x1 seed 2", 1, 1, ["--seed", "2"], {}))
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    print(f"# {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores; python {platform.python_version()}; "
          f"{args.train.name}, {args.objective}, dim {args.dim}, global batch {args.batch_size}, {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [run(f"{name} r{i}" if args.repeats > 1 else name, procs, threads, extra, args, work, env)
                for i in range(args.repeats) for name, procs, threads, extra, env in configs]
    by_kind = {r["name"].split(" r")[0]: r["tokens_per_s"] for r in reversed(rows)}  # first repeat of each
    one = by_kind.get("1x1", rows[0]["tokens_per_s"])
    two = by_kind.get("1x2", float("nan"))
    print("| run | processes × threads | steps | tokens | loop s | tokens/s | × 1x1 | × 1x2 | dev ppl | load avg before–after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['procs']} × {r['threads']} | {r['steps']} | {r['tokens']:,} | {r['seconds']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / one:.2f} | {r['tokens_per_s'] / two:.2f} | "
              f"{r['ppl']:.2f} | {r['load'][0]:.1f}–{r['load'][1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
