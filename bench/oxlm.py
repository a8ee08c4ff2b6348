"""nlmserve's trainer against OxLM's ``train_factored_sgd``: the same text, the same model,
the same tokens, one process and one thread each, interleaved on one machine.

Each round runs, one after the other:

1. OxLM on ``--tokens`` training tokens (``--minibatch-threshold`` minibatches of 10,000
   tokens; with no test set OxLM stops after exactly that many);
2. ``nlmserve train --recipe none --step STEP`` with the same model flags for ``--tokens`` / 512
   steps (``--step``, default ``fused``: the step measured; nlmserve train refuses a run that
   step cannot train, and the JSON records the step that ran and why);
3. OxLM again, for as many minibatches as it trains (at step 1's speed) in the seconds
   nlmserve's run of step 2 took: the model each tool gives in the same training time.

Both models of a run are scored on the dev text by the tool's own evaluator (OxLM's
``evaluate``, ``nlmserve eval``): exact perplexity, ``</s>`` counted, unknown words as
``<unk>``; the JSON records both tools' dev token counts, which must agree. Training seconds
are each tool's own clock of its training loop: OxLM's "Iteration: ..., Time:" lines (they
include writing the model file at the end of a pass: 51 MB at width 256), nlmserve's log
end record (``elapsed``: the steps, without the vocabulary, the id file, the classes and the
final write). Neither validates while it trains. Learning rates are each tool's default
(OxLM's AdaGrad step size 0.05 with its default L2 ``--lambda-lbl`` 7, nlmserve's AdaGrad
0.1 and no L2; ``--oxlm-step-size`` and ``--oxlm-lambda`` change OxLM's); the JSON records
what each ran with.

The text: the first ``--lines`` lines of ``--train``, words seen fewer than ``--min-count``
times replaced by ``<unk>`` in it and in the dev text (as OxLM's README prepares them);
both tools read the same two files (with the defaults, V = 24,291).

    .venv/bin/python -m bench.oxlm --oxlm-bin /tmp/oxlm/bin --json oxlm.json
    .venv/bin/python -m bench.oxlm --oxlm-bin /tmp/oxlm/bin --tokens 50000 --rounds 1   # a check of the script
    .venv/bin/python -m bench.oxlm --render docs/performance.md bench/results/oxlm.json

Without ``--oxlm-bin`` it says so and exits 0. Building OxLM: bench/oxlm_build.sh and
docs/performance.md ("Against OxLM"). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench._common import (exit_with, TRAINING_STEPS, machine, markers, shown_command, train_seconds, training_step,
                           write_json, write_section)
from bench.targets import DEV, TRAIN, head_lines, map_rare

log = logging.getLogger("bench.oxlm")

#: Tokens per OxLM minibatch (its default --minibatch-size, in tokens, ``</s>`` included).
OXLM_MINIBATCH = 10_000
#: n-grams per nlmserve step (its default --batch-size).
NLM_BATCH = 512
#: OxLM's --activation numbers.
OXLM_ACTIVATIONS = {"none": 0, "relu": 2}
SKIP_MESSAGE = ("bench/oxlm.py: no OxLM given (--oxlm-bin DIR: the bin/ of an OxLM build with "
                "train_factored_sgd and evaluate; bench/oxlm_build.sh, docs/performance.md#against-oxlm); skipped")


# --- OxLM's output ------------------------------------------------------------------------------

_CONFIG = re.compile(r"^# ([\w -]+?) = (.*)$", re.M)
_BINNED = re.compile(r"^Binned (\d+) types in (\d+) classes", re.M)
_PARAMS = re.compile(r"^\s*Total parameters = (\d+)$", re.M)
_ITERATION = re.compile(r"^Iteration: (\d+), Time: (\S+) seconds, Objective: (\S+)$", re.M)
_EVAL_TOKENS = re.compile(r"^Calculating perplexity for (\d+) tokens", re.M)
_EVAL_PPL = re.compile(r"^Test set perplexity: (\S+)$", re.M)


def parse_oxlm_train(stdout: str) -> dict[str, Any]:
    """What ``train_factored_sgd`` printed: its config summary (``# key = value``), the
    vocabulary and classes it binned, its parameter count, and per pass over the data
    ("Iteration") the seconds and objective; ``seconds`` is their sum."""
    passes = [(float(t), float(o)) for _, t, o in _ITERATION.findall(stdout)]
    binned = _BINNED.search(stdout)
    params = _PARAMS.search(stdout)
    if not passes or binned is None:
        raise ValueError(f"not the output of a finished train_factored_sgd run: {stdout[-500:]!r}")
    return {
        "config": dict(_CONFIG.findall(stdout)),
        "vocab": int(binned.group(1)),
        "classes": int(binned.group(2)),
        "parameters": int(params.group(1)) if params else None,
        "pass_seconds": [t for t, _ in passes],
        "objective": passes[-1][1],
        "seconds": sum(t for t, _ in passes),
    }


def parse_oxlm_eval(stdout: str) -> dict[str, float]:
    """OxLM ``evaluate``'s dev perplexity and the tokens it counted (``</s>`` included)."""
    tokens, ppl = _EVAL_TOKENS.search(stdout), _EVAL_PPL.search(stdout)
    if tokens is None or ppl is None:
        raise ValueError(f"no perplexity in OxLM evaluate's output: {stdout[-500:]!r}")
    return {"tokens": int(tokens.group(1)), "perplexity": float(ppl.group(1))}


def oxlm_tokens(minibatches: int, corpus_tokens: int, minibatch: int = OXLM_MINIBATCH) -> int:
    """Tokens OxLM trains on in ``minibatches`` minibatches: each pass over the corpus is cut
    into minibatches of ``minibatch`` tokens, the last one of a pass shorter."""
    per_pass = math.ceil(corpus_tokens / minibatch)
    passes, rest = divmod(minibatches, per_pass)
    return passes * corpus_tokens + rest * minibatch


def text_tokens(path: Path) -> int:
    """Tokens of a text as both tools count them: words plus one ``</s>`` per line."""
    with open(path, encoding="utf-8") as f:
        return sum(len(line.split()) + 1 for line in f)


# --- the runs -----------------------------------------------------------------------------------


def oxlm_command(bin_dir: Path, text: Path, model: Path, args: argparse.Namespace, minibatches: int,
                 corpus_tokens: int) -> list[str]:
    """``train_factored_sgd`` for exactly ``minibatches`` minibatches on one thread, no test
    set (so ``--minibatch-threshold`` counts minibatches), no model write before the end."""
    passes = math.ceil(minibatches / math.ceil(corpus_tokens / OXLM_MINIBATCH))
    return [str(bin_dir / "train_factored_sgd"), "--input", str(text), "--model-out", str(model),
            "--order", str(args.order), "--word-width", str(args.dim), "--threads", "1",
            "--noise-samples", str(args.noise_samples), "--classes", str(args.classes),
            "--activation", str(OXLM_ACTIVATIONS[args.activation]), "--diagonal-contexts", "true",
            "--hidden-layers", "0", "--minibatch-size", str(OXLM_MINIBATCH),
            "--minibatch-threshold", str(minibatches), "--iterations", str(passes),
            "--evaluate-frequency", str(minibatches + 1), "--randomise", "true",
            *(["--step-size", str(args.oxlm_step_size)] if args.oxlm_step_size is not None else []),
            *(["--lambda-lbl", str(args.oxlm_lambda)] if args.oxlm_lambda is not None else [])]


def nlmserve_command(text: Path, out: Path, args: argparse.Namespace, steps: int, corpus_tokens: int) -> list[str]:
    """``nlmserve train`` of this installation with OxLM's model: no recipe, no validation,
    no checkpoints, one process and one thread, ``steps`` steps."""
    from nlmserve.common.serve_process import nlmserve_command as cli

    epochs = math.ceil(steps * NLM_BATCH / corpus_tokens)
    return [*cli(), "train", "--recipe", "none", "--train", str(text), "--out", str(out),
            "--workdir", str(out.parent / "nlm-ids"), "--min-count", str(args.min_count),
            "--order", str(args.order), "--dim", str(args.dim), "--context", "diagonal",
            "--activation", args.activation, "--classes", str(args.classes), "--class-method", "frequency",
            "--objective", "nce", "--noise-samples", str(args.noise_samples), "--optimizer", "adagrad",
            "--no-ngram-features", "--dropout", "0", "--batch-size", str(NLM_BATCH),
            "--max-steps", str(steps), "--epochs", str(epochs), "--threads", "1", "--workers", "1",
            "--step", args.step, "--checkpoint-every", "0", "--no-progress"]


def _run(cmd: list[str], log_file: Path, env: dict[str, str] | None = None) -> str:
    """``cmd``'s stdout (its output also appended to ``log_file``), or SystemExit with the
    tail of its output."""
    log.info("$ %s", " ".join(cmd))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    with log_file.open("a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-20:])
        raise SystemExit(f"{cmd[0]} failed with {out.returncode}:\n{tail}")
    return out.stdout


def oxlm_run(bin_dir: Path, text: Path, dev: Path, model: Path, args: argparse.Namespace, minibatches: int,
             corpus_tokens: int) -> dict[str, Any]:
    """Train OxLM for ``minibatches`` minibatches, score the dev text → the run's record."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_file = model.with_name(model.name + ".log")
    log_file.unlink(missing_ok=True)
    stdout = _run(oxlm_command(bin_dir, text, model, args, minibatches, corpus_tokens), log_file, env)
    trained = parse_oxlm_train(stdout)
    model_file = trained["config"].get("model-out", str(model))  # OxLM appends its git revision when built in a clone
    ev = parse_oxlm_eval(_run([str(bin_dir / "evaluate"), "-m", model_file, "-t", "2", "-d", str(dev),
                               "--threads", "1"], log_file, env))
    tokens = oxlm_tokens(minibatches, corpus_tokens)
    return {"minibatches": minibatches, "tokens": tokens, "seconds": trained["seconds"],
            "tokens_per_s": tokens / trained["seconds"], "dev_ppl": ev["perplexity"], "dev_tokens": ev["tokens"],
            "vocab": trained["vocab"], "classes": trained["classes"], "parameters": trained["parameters"],
            "config": trained["config"]}


def nlmserve_run(text: Path, dev: Path, out: Path, args: argparse.Namespace, steps: int,
                 corpus_tokens: int) -> dict[str, Any]:
    """Train nlmserve for ``steps`` steps, score the dev text → the run's record."""
    from nlmserve.common.serve_process import nlmserve_command as cli

    log_file = out.with_name(out.name + ".log")
    for old in (out, log_file, out.with_name(out.name + ".log.jsonl"), out.with_name(out.name + ".ckpt")):
        old.unlink(missing_ok=True)
    _run(nlmserve_command(text, out, args, steps, corpus_tokens), log_file)
    records = [json.loads(line) for line in out.with_name(out.name + ".log.jsonl").read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "start")
    end = next(r for r in records if r.get("event") == "end")
    step = training_step(start, args.step, f"{out}.log.jsonl")
    seconds = train_seconds(out)
    ev = json.loads(_run([*cli(), "eval", "--model", str(out), "--text", str(dev), "--json", "--threads", "1"],
                         log_file))
    return {"steps": end["step"], "tokens": end["tokens"], "seconds": seconds,
            "tokens_per_s": end["tokens"] / seconds,
            "dev_ppl": ev["perplexity"], "dev_tokens": ev["tokens"], "vocab": start["vocab_size"],
            "train_tokens": start["train_tokens"],
            "classes": start["model"]["num_classes"], **step,
            "config": {k: start["config"][k] for k in ("lr", "optimizer", "batch_size", "lr_schedule", "seed")}}


def one_round(r: int, bin_dir: Path, text: Path, dev: Path, work: Path, args: argparse.Namespace,
              corpus_tokens: int) -> dict[str, Any]:
    """OxLM on the tokens, nlmserve on the tokens, OxLM in nlmserve's seconds."""
    minibatches = max(1, round(args.tokens / OXLM_MINIBATCH))
    steps = max(1, round(args.tokens / NLM_BATCH))
    ox = oxlm_run(bin_dir, text, dev, work / f"oxlm-{r}.bin", args, minibatches, corpus_tokens)
    log.info("round %d: OxLM %s tokens/s, dev ppl %.2f", r, f"{ox['tokens_per_s']:,.0f}", ox["dev_ppl"])
    nlm = nlmserve_run(text, dev, work / f"nlm-{r}.nlm", args, steps, corpus_tokens)
    log.info("round %d: nlmserve %s tokens/s, dev ppl %.2f", r, f"{nlm['tokens_per_s']:,.0f}", nlm["dev_ppl"])
    same = max(1, round(nlm["seconds"] * ox["tokens_per_s"] / OXLM_MINIBATCH))
    ox_time = oxlm_run(bin_dir, text, dev, work / f"oxlm-{r}-time.bin", args, same, corpus_tokens)
    log.info("round %d: OxLM in nlmserve's %.1f s: %d minibatches in %.1f s, dev ppl %.2f", r, nlm["seconds"],
             same, ox_time["seconds"], ox_time["dev_ppl"])
    return {"oxlm": ox, "nlmserve": nlm, "oxlm_same_time": ox_time}


def nlmserve_source() -> dict[str, Any]:
    """Which nlmserve the runs measured: the installed package's source folder and, when it
    is a git work tree, its commit and whether it had uncommitted changes."""
    import nlmserve.lm

    src = Path(nlmserve.lm.__file__).resolve().parent
    info: dict[str, Any] = {"lm": str(src)}
    git = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode == 0:
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True).stdout
        info.update(commit=git.stdout.strip(), uncommitted_changes=bool(dirty.strip()))
    return info


# --- the report ---------------------------------------------------------------------------------


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the rounds (and each round's value) of what the table shows."""
    def col(run: str, key: str) -> list[float]:
        return [float(r[run][key]) for r in rounds]

    def both(run: str, key: str) -> dict[str, Any]:
        values = col(run, key)
        return {"mean": statistics.fmean(values), "runs": values}

    ox, nlm = both("oxlm", "tokens_per_s"), both("nlmserve", "tokens_per_s")
    return {
        "oxlm_tokens_per_s": ox, "nlmserve_tokens_per_s": nlm, "ratio": nlm["mean"] / ox["mean"],
        "same_tokens": {"oxlm_tokens": both("oxlm", "tokens"), "nlmserve_tokens": both("nlmserve", "tokens"),
                        "oxlm_ppl": both("oxlm", "dev_ppl"), "nlmserve_ppl": both("nlmserve", "dev_ppl")},
        "same_time": {"nlmserve_seconds": both("nlmserve", "seconds"),
                      "oxlm_seconds": both("oxlm_same_time", "seconds"),
                      "oxlm_tokens": both("oxlm_same_time", "tokens"),
                      "oxlm_ppl": both("oxlm_same_time", "dev_ppl"), "nlmserve_ppl": both("nlmserve", "dev_ppl")},
        "dev_tokens": {"oxlm": sorted({int(v) for v in col("oxlm", "dev_tokens")}),
                       "nlmserve": sorted({int(v) for v in col("nlmserve", "dev_tokens")})},
        "vocab": {"oxlm": sorted({int(v) for v in col("oxlm", "vocab")}),
                  "nlmserve": sorted({int(v) for v in col("nlmserve", "vocab")})},
    }


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"


def _cell(stat: dict[str, Any]) -> str:
    """The mean, and each round's value in parentheses when there are several."""
    runs = stat["runs"]
    return _num(stat["mean"]) + (f" ({', '.join(map(_num, runs))})" if len(runs) > 1 else "")


def _step_text(rounds: list[dict[str, Any]]) -> str:
    """Which training step nlmserve's runs measured, and why, as the table's caption says it."""
    steps = sorted({(r["nlmserve"].get("step"), r["nlmserve"].get("step_reason")) for r in rounds}, key=str)
    if any(step is None for step, _ in steps):
        return "**the training step nlmserve ran is not recorded**"
    return "nlmserve's " + " and ".join(f"{step} training step ({why})" for step, why in steps)


def render(result: dict[str, Any]) -> str:
    """The comparison as Markdown: what ran where, the table, what differs, the command."""
    m, s, st = result["machine"], result["settings"], result["summary"]
    tokens, same = st["same_tokens"], st["same_time"]
    n = len(result["rounds"])
    src = s["nlmserve"].get("source", {})
    rev = f"nlmserve at {src['commit'][:7]}" + (" with uncommitted changes" if src.get("uncommitted_changes") else "") \
        if "commit" in src else "nlmserve"
    vocab = ", ".join(format(v, ",") for v in st["vocab"]["oxlm"])
    lines = [
        f"{rev} against OxLM, {n} round{'s' if n > 1 else ''} interleaved (OxLM, nlmserve, OxLM in nlmserve's time); "
        f"{m['cpu']}, one process and one thread each, load average {m['load_average_1m']} at the start. "
        f"The first {s['lines']:,} lines of `{Path(s['train']).name}`, words seen fewer than {s['min_count']} "
        f"times as `<unk>` (V = {vocab}); order {s['order']}, width {s['dim']}, "
        f"diagonal contexts, {s['activation']}, {s['classes']} frequency classes, NCE with {s['noise_samples']} "
        f"noise samples, AdaGrad (OxLM step size {s['oxlm']['step_size']}, L2 {s['oxlm']['lambda']:g}; nlmserve "
        f"{s['nlmserve']['lr']}, no L2), no direct features; {_step_text(result['rounds'])}.",
        "",
        "| | OxLM `train_factored_sgd` | nlmserve | nlmserve / OxLM |",
        "|---|---|---|---|",
        f"| training tokens/s, one core | {_cell(st['oxlm_tokens_per_s'])} | {_cell(st['nlmserve_tokens_per_s'])} "
        f"| {st['ratio']:.2f} |",
        f"| dev perplexity after {_num(tokens['nlmserve_tokens']['mean'])} tokens "
        f"(OxLM {_num(tokens['oxlm_tokens']['mean'])}) | {_cell(tokens['oxlm_ppl'])} | {_cell(tokens['nlmserve_ppl'])} "
        f"| {tokens['nlmserve_ppl']['mean'] / tokens['oxlm_ppl']['mean']:.3f} |",
        f"| dev perplexity after nlmserve's {same['nlmserve_seconds']['mean']:.1f} s of training "
        f"(OxLM: {_num(same['oxlm_tokens']['mean'])} tokens in {same['oxlm_seconds']['mean']:.1f} s) "
        f"| {_cell(same['oxlm_ppl'])} | {_cell(same['nlmserve_ppl'])} "
        f"| {same['nlmserve_ppl']['mean'] / same['oxlm_ppl']['mean']:.3f} |",
    ]
    dev = st["dev_tokens"]
    if dev["oxlm"] != dev["nlmserve"] or len(dev["oxlm"]) != 1:
        lines += ["", f"**The tools counted different dev tokens** (OxLM {dev['oxlm']}, nlmserve {dev['nlmserve']}): "
                  "the perplexities are not comparable."]
    else:
        lines += ["", f"Dev perplexity: each tool's own evaluator, exact, over the same {dev['oxlm'][0]:,} tokens "
                  "(`</s>` included, unknown words as `<unk>`). Tokens/s: each tool's clock of its training loop."]
    lines += ["", f"Command: `{shown_command(result['command'])}`"]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--oxlm-bin", type=Path, help="OxLM's bin/ (train_factored_sgd, evaluate); without it: skip")
    p.add_argument("--train", type=Path, default=TRAIN, help="training text (plain or .xz)")
    p.add_argument("--lines", type=int, default=200_000, help="its first N lines")
    p.add_argument("--dev", type=Path, default=DEV, help="dev text")
    p.add_argument("--min-count", type=int, default=2, help="words seen fewer times become <unk>")
    p.add_argument("--tokens", type=int, default=2_560_000, help="training tokens per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--order", type=int, default=5)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--classes", type=int, default=156)
    p.add_argument("--noise-samples", type=int, default=10)
    p.add_argument("--activation", choices=("none", "relu"), default="relu", help="on the context vector")
    p.add_argument("--oxlm-step-size", type=float, help="OxLM's AdaGrad step size (default: OxLM's, 0.05)")
    p.add_argument("--step", choices=TRAINING_STEPS, default="fused",
                   help="nlmserve train --step: the training step measured (a run it cannot train is refused)")
    p.add_argument("--oxlm-lambda", type=float, help="OxLM's L2 strength --lambda-lbl (default: OxLM's, 7)")
    p.add_argument("--work", type=Path, default=Path("/tmp/nlmserve-oxlm"), help="texts and models (texts reused)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--render", nargs=2, metavar=("DOC", "JSON"),
                   help="only replace DOC's bench/oxlm.py section with JSON's table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.render:
        doc, js = map(Path, args.render)
        begin, end = markers("oxlm.py")
        write_section(doc, begin, end, f"{begin}\n\n{render(json.loads(js.read_text()))}\n\n{end}")
        return 0
    if args.oxlm_bin is None:
        print(SKIP_MESSAGE)
        return 0
    missing = [b for b in ("train_factored_sgd", "evaluate") if not (args.oxlm_bin / b).is_file()]
    if missing:
        raise SystemExit(f"bench/oxlm.py: {args.oxlm_bin} has no {' or '.join(missing)} "
                         "(bench/oxlm_build.sh builds them)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args.work.mkdir(parents=True, exist_ok=True)
    raw = head_lines(args.train, args.lines, args.work / f"train.{args.lines}.txt")
    text, dev = map_rare(raw, args.dev, args.min_count, args.work, placeholder="<unk>")
    corpus_tokens = text_tokens(text)
    result: dict[str, Any] = {"machine": machine(), "command": " ".join(["bench/oxlm.py", *(argv or sys.argv[1:])])}
    rounds = [one_round(r + 1, args.oxlm_bin, text, dev, args.work, args, corpus_tokens) for r in range(args.rounds)]
    ox_config, nlm_config = rounds[0]["oxlm"]["config"], rounds[0]["nlmserve"]["config"]
    result["settings"] = {
        "train": str(args.train), "lines": args.lines, "dev": str(args.dev), "min_count": args.min_count,
        "train_tokens": corpus_tokens, "tokens": args.tokens, "order": args.order, "dim": args.dim,
        "classes": args.classes, "noise_samples": args.noise_samples, "activation": args.activation,
        "oxlm": {"bin": str(args.oxlm_bin), "step_size": float(ox_config["step size"]),
                 "lambda": float(ox_config["lambda"]), "minibatch": OXLM_MINIBATCH, "config": ox_config},
        "nlmserve": {**nlm_config, "source": nlmserve_source()},
    }
    result["rounds"] = rounds
    result["summary"] = summarise(rounds)
    print(render(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    exit_with(main)
