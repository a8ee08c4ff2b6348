"""The accelerator check: one call on a machine with a CUDA GPU, under 8 minutes, one JSON.

What it runs, each side by side with the CPU in the same run:

1. **Training**: the demo's model (``nlmserve experiment``'s training: its texts, 4,000 steps
   of 512 positions, width 256, validated every 500 steps) trained on the GPU (the torch
   step) and on the CPU (the fused step, ``CUDA_VISIBLE_DEVICES=`` hides the GPU): tokens/s
   of the training loop and the validation perplexity each reached (the same within noise).
2. **The CUDA scoring path**: the GPU-trained model loaded on the GPU and on the CPU
   (``--no-cpu-tables``' torch code and the CPU tables), every n-gram of the shipped dev text
   scored each way, exact and self-normalised: the largest difference (a check, with a bound).
3. **Serving**: the engine in-process on each device (n-grams/s at batches of 4,096 and
   10,000, exact and self-normalised), and ``nlmserve serve --device D`` on 127.0.0.1 with
   single-n-gram requests one after another (p50, p99), for bench/serve.py's model (order 5,
   width 256, 20,000 words).
4. **Cores**: bench/scaling.py's table (one process, Hogwild workers 2, 4, ... up to the
   machine's cores, two averaging ranks, two ranks of Hogwild workers on half the cores
   each) where the machine has more than 2 cores.

It needs nothing from the network: torch with CUDA, numpy, numba, grpcio, protobuf and
prometheus-client there, and this checkout with its generated gRPC stubs
(``proto/lm_pb2.py``, ``proto/lm_pb2_grpc.py``: ``make install`` writes them here; carry them
along, they are ignored by git). ``bench/device_check.sh`` makes the checkout importable as
``nlmserve`` and runs this module. Without a GPU it runs the CPU side alone (``--device cpu``)
so that the script itself is tested anywhere. Usage:

    bench/device_check.sh --json $OUT/device-check.json              # on the GPU machine
    .venv/bin/python -m bench.device_check --render docs/training-scale.md bench/results/device-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import exit_with, machine, markers, write_json, write_saved

REPO = Path(__file__).resolve().parent.parent
#: The largest difference allowed between a score on the GPU and on the CPU (natural log).
SCORE_BOUND = 1e-3


def _devices(asked: str) -> list[str]:
    import torch

    if asked == "cpu":
        return ["cpu"]
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (torch.cuda.is_available() is False): run with --device cpu "
                         "to check the script on the CPU alone")
    return ["cuda", "cpu"]


def _log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(f"{out}.log.jsonl").read_text(encoding="utf-8").splitlines()]


def check_training(work: Path, devices: list[str], steps: int | None) -> dict[str, Any]:
    """The demo's training on each device → tokens/s, validation perplexity, the step that ran."""
    from dataclasses import replace

    from nlmserve.pipeline.config import ExperimentConfig
    from nlmserve.pipeline.experiment import training_command, training_text

    config = ExperimentConfig()
    if steps is not None:
        config = replace(config, steps=steps)
    text = training_text(config.train_text, work)
    rows: dict[str, Any] = {}
    for device in devices:
        out = work / f"demo.{device}.nlm"
        for stale in (out, Path(f"{out}.ckpt"), Path(f"{out}.log.jsonl")):
            stale.unlink(missing_ok=True)
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
        cmd = [*training_command(config, text, out), "--no-progress"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"training on {device} failed ({done.returncode}): {done.stderr[-2000:]}")
        records = _log(out)
        start, end = records[0], records[-1]
        rows[device] = {"model": str(out), "step_ran": start.get("step_ran"), "steps": end["step"],
                        "tokens": end["tokens"], "train_s": end["elapsed"],
                        "tokens_per_s": end["tokens"] / max(float(end["elapsed"]), 1e-9),
                        "valid_ppl": end.get("best_ppl"), "command": shlex.join(cmd)}
        print(f"training on {device}: {rows[device]['tokens_per_s']:,.0f} tokens/s, "
              f"valid ppl {rows[device]['valid_ppl']}", flush=True)
    return rows


def check_scores(model: Path, devices: list[str]) -> dict[str, Any]:
    """Every dev n-gram scored on each device (and on the CPU by the torch code a GPU runs,
    ``cpu_tables=False``) → the largest difference to the first device, exact and self-normalised."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.server.config import ServerConfig
    from nlmserve.server.engine import Engine

    from bench.serve import test_ngrams

    ways = [(d, True) for d in devices] + [("cpu", False)]
    scores: dict[str, dict[str, np.ndarray]] = {}
    ids = None
    for device, tables in ways:
        lm = LanguageModel.load(model, device=device, cpu_tables=tables)
        if ids is None:
            ids, _ = test_ngrams(lm, 200_000)
        engine = Engine(lm, ServerConfig(model=str(model), device=device, cpu_tables=tables))
        name = device if tables else "cpu, torch code"
        scores[name] = {kind: np.asarray(engine.score_ngrams(ids, normalized=kind == "exact"), dtype=np.float64)
                        for kind in ("exact", "self-normalised")}
        engine.shutdown()
    first = next(iter(scores))
    result: dict[str, Any] = {"ngrams": int(len(ids)) if ids is not None else 0, "against": first, "bound": SCORE_BOUND,
                              "largest_difference": {}}
    for name, got in scores.items():
        if name == first:
            continue
        result["largest_difference"][name] = {kind: float(np.abs(got[kind] - scores[first][kind]).max())
                                              for kind in got}
    result["within_bound"] = all(v <= SCORE_BOUND for d in result["largest_difference"].values() for v in d.values())
    print(f"scores against {first}: {result['largest_difference']}", flush=True)
    return result


def check_serving(work: Path, devices: list[str], seconds: float) -> dict[str, Any]:
    """bench/serve.py's model on each device: the engine's rates, and single n-grams through
    ``nlmserve serve --device D``."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.server.config import ServerConfig
    from nlmserve.server.engine import Engine

    from bench.serve import BenchConfig, ServerProcess, build_model, rate, single_latency, test_ngrams

    path = work / "serve-bench.nlm"
    build_model(BenchConfig(), path)
    rows: dict[str, Any] = {}
    for device in devices:
        lm = LanguageModel.load(path, device=device)
        ids, _ = test_ngrams(lm, 20_000)
        engine = Engine(lm, ServerConfig(model=str(path), device=device))
        row: dict[str, Any] = {}
        for bs in (4096, 10_000):
            batch = ids[:bs]
            for kind in ("exact", "self-normalised"):
                row[f"engine_{bs}_{kind}"] = rate(
                    lambda: len(engine.score_ngrams(batch, normalized=kind == "exact")), seconds)
        engine.shutdown()
        server = ServerProcess(path, "--device", device)
        try:
            row["single"] = single_latency(server.target, ids, 1000)
        finally:
            server.stop()
        rows[device] = row
        print(f"serving on {device}: {row}", flush=True)
    return rows


def check_cores(work: Path, steps: int) -> dict[str, Any] | None:
    """bench/scaling.py's table where the machine has more than 2 cores."""
    cores = os.cpu_count() or 1
    if cores <= 2:
        return None
    from bench import scaling

    args = argparse.Namespace(train=REPO / "data" / "lm" / "europarl.train.50k.lc-moses.en.xz",
                              valid=REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en", steps=steps, batch_size=512,
                              order=5, dim=128, seed=1, rounds=1)
    names = ["one", *(f"workers{n}" for n in (2 ** k for k in range(1, 8)) if n <= cores), "dist2:128"]
    if cores >= 4:  # two ranks, each a Hogwild group on half the cores
        names.append(f"dist2x{cores // 2}:128")
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's table
    try:
        runs = [scaling.measure(name, args, work, 0) for name in names]
    finally:
        if env is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env
    return {"machine": machine(), "command": "device_check (bench/scaling.py's configurations)",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "rows": scaling.summarise(runs, names)}


def render(result: dict[str, Any]) -> str:
    begin, end = markers("device_check.py")
    m = result["machine"]
    lines = [begin, "", f"{result['gpu']}; {m['cpu']}, {m['cores']} cores; torch {m.get('torch')}; "
             f"the whole check took {result['seconds']:.0f} s.", ""]
    train = result["training"]
    lines += ["| training the demo's model | step | tokens/s | validation perplexity |", "|---|---|---:|---:|"]
    for device, row in train.items():
        lines.append(f"| {device} | {row['step_ran']} | {row['tokens_per_s']:,.0f} | {row['valid_ppl']:.2f} |")
    s = result["scores"]
    diffs = "; ".join(f"{name}: exact {d['exact']:.2g}, self-normalised {d['self-normalised']:.2g}"
                      for name, d in s["largest_difference"].items())
    lines += ["", f"{s['ngrams']:,} dev n-grams scored against {s['against']}, largest difference {diffs} "
              f"(bound {s['bound']:g}: {'met' if s['within_bound'] else '**not met**'}).", ""]
    lines += ["| serving (bench/serve.py's model) | engine, 4,096 exact | 4,096 self-normalised | 10,000 exact | "
              "10,000 self-normalised | one n-gram through `serve`, p50 / p99 ms |", "|---|---:|---:|---:|---:|---|"]
    for device, row in result["serving"].items():
        lines.append(f"| {device} | {row['engine_4096_exact']:,.0f} | {row['engine_4096_self-normalised']:,.0f} | "
                     f"{row['engine_10000_exact']:,.0f} | {row['engine_10000_self-normalised']:,.0f} | "
                     f"{row['single']['p50_ms']:.2f} / {row['single']['p99_ms']:.2f} |")
    if result.get("cores"):
        from bench import scaling

        lines += ["", "Cores (bench/scaling.py's table on this machine's CPU):", "",
                  *scaling.render(result["cores"]).splitlines()[2:-2]]
    lines += ["", f"Command: `{result['command']}`", "", end]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the GPU beside the CPU; cpu: the CPU alone (to test the script)")
    p.add_argument("--work", type=Path, default=Path("device-check-work"))
    p.add_argument("--train-steps", type=int, help="steps of the demo's training (default: the demo's 4,000)")
    p.add_argument("--scaling-steps", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=3.0, help="time of each engine rate")
    p.add_argument("--json", type=Path)
    p.add_argument("--render", nargs=2, type=Path, metavar=("DOC", "JSON"), help="write a saved run's section")
    args = p.parse_args()
    if args.render:
        write_saved(*args.render, "device_check.py", render)
        return 0
    for stub in ("lm_pb2.py", "lm_pb2_grpc.py"):
        if not (REPO / "proto" / stub).is_file():
            raise SystemExit(f"proto/{stub} is missing: `make install` writes the gRPC stubs; carry them along")
    import torch

    devices = _devices(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result: dict[str, Any] = {"machine": machine(), "command": shlex.join(["device_check", *sys.argv[1:]]),
                              "gpu": torch.cuda.get_device_name(0) if "cuda" in devices else "no GPU (--device cpu)"}
    result["training"] = check_training(args.work, devices, args.train_steps)
    result["scores"] = check_scores(Path(result["training"][devices[0]]["model"]), devices)
    result["serving"] = check_serving(args.work, devices, args.seconds)
    result["cores"] = check_cores(args.work, args.scaling_steps)
    result["seconds"] = time.monotonic() - started
    if args.json:
        write_json(args.json, result)
    print(render(result))
    return 0 if result["scores"]["within_bound"] else 1


if __name__ == "__main__":
    exit_with(main)
