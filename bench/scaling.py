"""Training on several CPU processes: Hogwild workers against data-parallel ranks that average
their copies, after the same tokens, in one run.

Every configuration trains the same model (the fused step: NCE, class output, AdaGrad) on
the same text with the same seed for the same number of steps of ``--batch-size`` positions
(so the same tokens), then validates once on ``--valid`` (nothing is selected: one
validation, one model). Configurations:

* ``one``: one process (``--workers 1``);
* ``workersN``: N Hogwild processes sharing the parameters (``--workers N``; by default
  2, 4, ... up to the machine's cores);
* ``dist2:N``: two ranks under torchrun (``--distributed``), each training its own copy and
  averaging it with the other's every N steps (``--average-every N``);
* ``dist2xW:N``: the same two ranks, each W Hogwild workers on its copy (``--workers W``;
  by default, where the machine has 4 cores or more, W = half of them, N = 128): the
  layout for several many-core hosts;
* ``dist2:torch``: two ranks by the torch step (``--distributed --step torch``), whose
  gradients are all-reduced every step (a global batch of twice ``--batch-size``, half the
  steps: the same tokens).

It reports the training loop's wall time (the log's end record: not the vocabulary and id files;
the fused step's code comes from numba's cache after the first run), tokens/s and its ratio to ``one``, the dev perplexity, and for
the ranks the seconds spent averaging. Each configuration runs ``--rounds`` times in turn;
the table takes medians. Time it on a quiet machine: every process wants a core. Usage:

    .venv/bin/python -m bench.scaling --train data/lm/europarl.train.50k.lc-moses.en.xz \\
        --valid data/lm/europarl.dev.1k.lc-moses.en --steps 2000 --average-every 8 32 128 512 --rounds 2 \\
        --json bench/results/scaling.json --doc docs/training-scale.md
    .venv/bin/python -m bench.scaling --render docs/training-scale.md bench/results/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nlmserve.common.serve_process import free_port
from nlmserve.lm.distributed import TORCHRUN_VARS

from bench._common import (exit_with, machine, machine_line, markers, shown_command, write_json, write_saved,
                           write_section)

REPO = Path(__file__).resolve().parent.parent


def command(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The command line of configuration ``name`` (``one``, ``workers2``, ``dist2:N``)."""
    train = ["train", "--recipe", "none", "--train", str(args.train), "--valid", str(args.valid), "--out", str(out),
             "--order", str(args.order), "--dim", str(args.dim), "--batch-size", str(args.batch_size),
             "--threads", "1", "--max-steps", str(args.steps), "--valid-every", "0", "--checkpoint-every", "0",
             "--log-every", "100", "--seed", str(args.seed), "--step", "fused", "--no-progress"]
    if name == "one":
        return [sys.executable, "-m", "nlmserve", *train, "--workers", "1"]
    if name.startswith("workers") and name[len("workers"):].isdigit():
        return [sys.executable, "-m", "nlmserve", *train, "--workers", name[len("workers"):]]
    if name == "dist2:torch":  # the synchronous torch step: a step is the global batch of both ranks
        train[train.index("--batch-size") + 1] = str(2 * args.batch_size)
        train[train.index("--max-steps") + 1] = str(args.steps // 2)
        train[train.index("--step") + 1] = "torch"
        return _two_ranks(train)
    ranks = _RANKS.fullmatch(name)
    if ranks:
        workers, every = ranks.group(1) or "1", ranks.group(2)
        return _two_ranks([*train, "--average-every", every, "--workers", workers])
    raise SystemExit(f"unknown configuration {name!r}: one, workersN, dist2:N, dist2xW:N or dist2:torch")


_RANKS = re.compile(r"dist2(?:x([1-9][0-9]*))?:([1-9][0-9]*)")  # dist2:N, dist2xW:N


def _two_ranks(train: list[str]) -> list[str]:
    """``nlmserve train --distributed`` with ``train``'s flags, two ranks under torchrun on 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "nlmserve", *train, "--distributed"]


def measure(name: str, args: argparse.Namespace, work: Path, rnd: int) -> dict[str, Any]:
    """One training of configuration ``name`` → its log's numbers."""
    out = work / f"{name.replace(':', '-')}.r{rnd}.nlm"
    for stale in (out, Path(f"{out}.log.jsonl"), Path(f"{out}.ckpt")):
        stale.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    started = time.monotonic()
    proc = subprocess.run(command(name, args, out), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: training failed ({proc.returncode}): {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in Path(f"{out}.log.jsonl").read_text(encoding="utf-8").splitlines()]
    end = records[-1]
    valid = [r for r in records if "valid_ppl" in r]
    if end.get("event") != "end" or not valid:
        raise SystemExit(f"{name}: the log of {out} has no end record or no validation")
    start = records[0]
    if start.get("step_ran") != ("torch" if name == "dist2:torch" else "fused"):
        raise SystemExit(f"{name}: trained with the {start.get('step_ran')} step ({start.get('step_reason')})")
    digests = end.get("rank_param_sha256")
    return {"name": name, "round": rnd, "train_s": float(end["elapsed"]), "wall_s": round(time.monotonic() - started, 2),
            "tokens": int(end["tokens"]), "steps": int(end["step"]), "valid_ppl": float(valid[-1]["valid_ppl"]),
            "average_s": end.get("average_s"), "ranks_identical": None if digests is None else len(set(digests)) == 1}


def summarise(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Medians per configuration, with tokens/s against ``one`` (when it ran)."""
    rows = []
    for name in names:
        mine = [r for r in runs if r["name"] == name]
        train_s = statistics.median(r["train_s"] for r in mine)
        row = {"name": name, "rounds": [r["train_s"] for r in mine], "train_s": train_s,
               "tokens": mine[0]["tokens"], "tokens_per_s": mine[0]["tokens"] / train_s,
               "valid_ppl": statistics.median(r["valid_ppl"] for r in mine),
               "average_s": None if mine[0]["average_s"] is None else statistics.median(r["average_s"] for r in mine),
               "ranks_identical": None if mine[0]["ranks_identical"] is None else all(r["ranks_identical"] for r in mine)}
        rows.append(row)
    base = next((r for r in rows if r["name"] == "one"), None)
    for row in rows:
        row["vs_one"] = None if base is None else row["tokens_per_s"] / base["tokens_per_s"]
    return rows


def _label(name: str) -> str:
    if name == "one":
        return "1 process"
    if name.startswith("workers"):
        return f"{name[len('workers'):]} Hogwild workers (`--workers {name[len('workers'):]}`)"
    if name == "dist2:torch":
        return "2 ranks, the torch step, gradients all-reduced every step (`--distributed --step torch`)"
    ranks = _RANKS.fullmatch(name)
    if ranks and ranks.group(1):
        return (f"2 ranks of {ranks.group(1)} Hogwild workers, averaged every {ranks.group(2)} steps "
                f"(`--distributed --workers {ranks.group(1)}`)")
    if ranks:
        return f"2 ranks, averaged every {ranks.group(2)} steps (`--distributed`)"
    return name


def render(result: dict[str, Any]) -> str:
    begin, end = markers("scaling.py")
    m, a = result["machine"], result["args"]
    lines = [begin, "",
             f"{machine_line(m)}; order {a['order']}, "
             f"width {a['dim']}, NCE by the fused step, {a['steps']} steps of {a['batch_size']} positions "
             f"({result['rows'][0]['tokens']:,} tokens) on `{Path(a['train']).name}`, one validation on "
             f"`{Path(a['valid']).name}` at the end; median of {a['rounds']} interleaved rounds.", "",
             "| configuration | training s (rounds) | tokens/s | × 1 process | dev perplexity | averaging s | ranks identical |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        rounds = ", ".join(f"{s:.1f}" for s in r["rounds"])
        vs = "" if r["vs_one"] is None else f"{r['vs_one']:.2f}"
        avg = "" if r["average_s"] is None else f"{r['average_s']:.2f}"
        same = "" if r["ranks_identical"] is None else ("yes" if r["ranks_identical"] else "**no**")
        lines.append(f"| {_label(r['name'])} | {r['train_s']:.1f} ({rounds}) | {r['tokens_per_s']:,.0f} | {vs} | "
                     f"{r['valid_ppl']:.2f} | {avg} | {same} |")
    lines += ["", f"Command: `{shown_command(result['command'])}`", "", end]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=Path, default=REPO / "data" / "lm" / "europarl.train.50k.lc-moses.en.xz")
    p.add_argument("--valid", type=Path, default=REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en")
    p.add_argument("--steps", type=int, default=2000, help="minibatches in all (the same tokens everywhere)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--order", type=int, default=5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--average-every", type=int, nargs="+", default=[8, 32, 128, 512], metavar="N")
    p.add_argument("--configs", nargs="+", help="one, workersN, dist2:N, dist2xW:N, dist2:torch (default: one, "
                   "workersN for N = 2, 4, ... up to the cores, dist2:torch, dist2 at each --average-every, "
                   "and dist2xW:128 with W = half the cores where there are 4 or more)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("scaling-work"))
    p.add_argument("--json", type=Path)
    p.add_argument("--doc", type=Path)
    p.add_argument("--render", nargs=2, type=Path, metavar=("DOC", "JSON"), help="write a saved run's section")
    args = p.parse_args()
    if args.render:
        write_saved(*args.render, "scaling.py", render)
        return 0
    for path in (args.train, args.valid):
        if not path.is_file():
            raise SystemExit(f"{path}: not a file")
    cores = os.cpu_count() or 1
    workers = [f"workers{n}" for n in (2 ** k for k in range(1, 8)) if n <= cores]
    groups = [f"dist2x{cores // 2}:128"] if cores >= 4 else []  # two hosts' worth of Hogwild groups
    names = args.configs or ["one", *workers, "dist2:torch", *(f"dist2:{n}" for n in args.average_every), *groups]
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "command": shlex.join([sys.executable, *sys.argv]),
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    runs = []
    for rnd in range(args.rounds):
        for name in names:
            runs.append(measure(name, args, args.work, rnd))
            print(f"{name} round {rnd}: {runs[-1]['train_s']:.1f} s, ppl {runs[-1]['valid_ppl']:.2f}", flush=True)
    result["runs"], result["rows"] = runs, summarise(runs, names)
    if args.json:
        write_json(args.json, result)
    text = render(result)
    print(text)
    if args.doc:
        write_section(args.doc, *markers("scaling.py"), text)
    return 0


if __name__ == "__main__":
    exit_with(main)
