"""Before and after: the serving and training benchmarks of two revisions, run interleaved on
one machine in one command, with new/old ratios and each side's run-to-run spread.

    .venv/bin/python -m bench.revisions --old 19f2784                 # against HEAD
    .venv/bin/python -m bench.revisions --old 19f2784 --new HEAD --rounds 3 --json out.json
    .venv/bin/python -m bench.revisions --render docs/performance.md out.json
    .venv/bin/python -m bench.revisions --old 19f2784 --prepare-only    # build now, measure later

Each revision is exported with ``git archive`` into the work folder and set up as a user
would: its gRPC stubs generated (by its own ``make proto`` when it has no setup.py, by the
package build otherwise), the package installed with ``pip install --no-deps
--no-build-isolation --target``, and its C++ (client library, native front end) built with its
own ``make cpp``. A revision already set up there is reused. Every side then runs its own
tree's code (``PYTHONPATH`` = its install) in this environment's Python.

Each round runs old, then new:

* that tree's ``bench/serve.py --seconds S --json`` (engine, gRPC, single-request latency, 32
  one-n-gram clients with and without micro-batching, the native front end);
* sequential single n-gram requests (``--requests`` of them) to that tree's ``nlmserve serve``
  and ``serve --frontend native`` on one model file: p50, p99, and the server's CPU per
  request;
* that tree's ``bench/train.py --objectives nce --nce-step STEP --minutes M --threads 1 --json``:
  training tokens/s and the dev perplexity reached;
* with ``--train-args="ARGS"``: that tree's ``nlmserve train ARGS --step STEP --out F`` (give it
  a budget, e.g. ``--max-minutes 4``), and from its log (``F.log.jsonl``) the tokens per second
  from step 1,000 on (the minutes before, vocabulary, classes and the first steps, are left
  out) and the steps taken: a user's own training recipe, old against new.

STEP is ``--train-step`` (default ``fused``): both trainings name the step they measure, and
one that ran another step (or that the trainer refuses) stops the comparison. ARGS that give
``--step`` themselves keep theirs. A tree older than the flag (its bench/train.py without
``--nce-step``, its ``nlmserve train`` without ``--step``, or its records without ``step_ran``)
is run without it, and the table says that its step is not recorded.

``--skip-serve`` leaves the serving measurements out (training only), and the C++ build with them.

A metric is "same" when the two sides' means differ by no more than the larger of the two
sides' ranges (max - min over the rounds: the machine's own noise), or by less than 1%.
Otherwise it is better or worse in the metric's direction. Run it on a quiet machine: both
cores, nothing beside it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _common
from bench._common import (exit_with, TRAINING_STEPS, machine, random_class_model, training_step, tree_cpu_seconds, write_json,
                           write_section)

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "lm"
BEGIN, END = _common.markers("revisions.py")


def markers(section: str = "") -> tuple[str, str]:
    """The markers of this script's table in a page, or of a named ``section`` of its own."""
    return _common.markers("revisions.py", section)


@dataclass(frozen=True)
class Metric:
    """One row of the comparison: where its value is in a side's results, and which way is
    better."""

    key: str  # "serve.engine_10000", "latency.python.p50_ms", "train.tokens_per_s"
    label: str
    higher_is_better: bool


METRICS = (
    Metric("serve.engine_4096", "engine, batches of 4,096 (n-grams/s)", True),
    Metric("serve.engine_10000", "engine, batches of 10,000 (n-grams/s)", True),
    Metric("serve.grpc_packed_10000", "gRPC packed ids, 10,000 per request (n-grams/s)", True),
    Metric("serve.grpc_strings_10000", "gRPC strings, 10,000 per request (n-grams/s)", True),
    Metric("serve.latency_c1.p50_ms", "bench/serve.py single n-gram p50 (ms)", False),
    Metric("serve.concurrent_batching.ngrams_per_s", "32 one-n-gram clients, micro-batching (n-grams/s)", True),
    Metric("serve.concurrent_no_batching.ngrams_per_s", "32 clients, no batching (n-grams/s)", True),
    Metric("serve.concurrent_noop.ngrams_per_s", "32 clients, no-op server: the ceiling (n-grams/s)", True),
    Metric("serve.native_batching.ngrams_per_s", "32 clients, native front end (n-grams/s)", True),
    Metric("latency.python.p50_ms", "sequential single n-grams, Python server, p50 (ms)", False),
    Metric("latency.python.p99_ms", "sequential single n-grams, Python server, p99 (ms)", False),
    Metric("latency.python.server_cpu_us", "sequential single n-grams, Python server CPU per request (µs)", False),
    Metric("latency.native.p50_ms", "sequential single n-grams, native front end, p50 (ms)", False),
    Metric("latency.native.p99_ms", "sequential single n-grams, native front end, p99 (ms)", False),
    Metric("train.tokens_per_s", "training, NCE, 1 thread (tokens/s)", True),
    Metric("train.dev_ppl", "training, dev perplexity reached", False),
    Metric("recipe.tokens_per_s", "nlmserve train with --train-args, from step 1,000 (tokens/s)", True),
    Metric("recipe.steps", "nlmserve train with --train-args, steps taken", True),
)

#: The first steps of a ``--train-args`` run that its speed leaves out.
SKIP_STEPS = 1000


def lookup(result: dict[str, Any], key: str) -> float | None:
    """The value at the dotted ``key`` of one side's round, None when that revision's
    benchmark does not report it."""
    node: Any = result
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) else None


#: A difference below this share of the old mean is never called a change (two runs can
#: agree by chance and show no range at all).
FLOOR = 0.01


def compare(old: list[float], new: list[float], higher_is_better: bool) -> dict[str, Any]:
    """Ratio of the means (new / old), the noise, and the verdict: "same" when the means
    differ by no more than the noise (the larger of the two sides' ranges, at least
    :data:`FLOOR` of the old mean), else "better" or "worse"."""
    mo, mn = statistics.fmean(old), statistics.fmean(new)
    noise = max(max(old) - min(old), max(new) - min(new), FLOOR * abs(mo))
    if abs(mn - mo) <= noise:
        verdict = "same"
    else:
        verdict = "better" if (mn > mo) == higher_is_better else "worse"
    return {"old_mean": mo, "new_mean": mn, "ratio": mn / mo if mo else float("inf"), "noise": noise,
            "verdict": verdict}


# --- setting a revision up -------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    name: str  # "old" | "new"
    rev: str
    sha: str
    src: Path  # the exported tree
    site: Path  # its install (PYTHONPATH)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.site), "PYTHONUNBUFFERED": "1"}

    def bench(self, name: str) -> list[str]:
        """The arguments that run the tree's bench/NAME.py from its root: ``-m bench.NAME``, or
        the script's path in a tree from before bench/ was a package."""
        if (self.src / "bench" / "__init__.py").exists():
            return ["-m", f"bench.{name}"]
        return [str(self.src / "bench" / f"{name}.py")]

    def knows(self, script: str, flag: str) -> bool:
        """Whether the tree's ``script`` (a path under its root) declares ``flag``: a tree older
        than the flag is run without it."""
        path = self.src / script
        return path.exists() and f'"{flag}"' in path.read_text(encoding="utf-8")

    def frontend(self) -> Path:
        """The tree's own ``nlmserve_frontend`` (build/native since the front end has its own
        CMake project, build/cpp before)."""
        for sub in ("native", "cpp"):
            path = self.src / "build" / sub / "nlmserve_frontend"
            if path.exists():
                return path
        raise SystemExit(f"{self.rev}: no nlmserve_frontend under {self.src / 'build'} (make cpp failed?)")


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, log: Path | None = None) -> str:
    """Run ``cmd``; its stdout, or SystemExit with the tail of its output."""
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-20:])
        raise SystemExit(f"{' '.join(cmd)} (in {cwd}) failed with {out.returncode}:\n{tail}")
    return out.stdout


def prepare(name: str, rev: str, work: Path, cpp: bool = True) -> Side:
    """Export ``rev`` into ``work`` and set it up (stubs, install, and with ``cpp`` its C++),
    unless done before."""
    sha = run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], REPO).strip()
    root = work / sha[:12]
    side = Side(name, rev, sha, root / "src", root / "site")
    ready = root / "ready"
    if ready.exists():
        if cpp and not (root / "ready-cpp").exists():
            run(["make", "cpp"], side.src, log=root / "setup.log")
            side.frontend()
            (root / "ready-cpp").write_text(sha + "\n")
        return side
    log = root / "setup.log"
    if root.exists():
        run(["rm", "-rf", str(root)], work)
    side.src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(side.src, filter="data")
    print(f"# setting up {name} = {rev} ({sha[:12]}) in {root}", file=sys.stderr, flush=True)
    bin_dir = Path(sys.executable).parent
    if not (side.src / "setup.py").exists():  # stubs came from the Makefile then
        run(["make", "proto", f"PY={sys.executable}", f"BIN={bin_dir}"], side.src, log=log)
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
         str(side.site), str(side.src)], side.src, log=log)
    if cpp:
        run(["make", "cpp"], side.src, log=log)
        side.frontend()
        (root / "ready-cpp").write_text(sha + "\n")
    ready.write_text(sha + "\n")
    return side


# --- the measurements ------------------------------------------------------------------------


def serve_bench(side: Side, seconds: float, out: Path) -> dict[str, Any]:
    """That tree's bench/serve.py → its JSON."""
    run([sys.executable, *side.bench("serve"), "--seconds", str(seconds), "--json", str(out)],
        side.src, side.env, log=out.with_suffix(".log"))
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def train_bench(side: Side, minutes: float, work: Path, step: str = "fused") -> dict[str, Any]:
    """That tree's bench/train.py, NCE on one thread with the training step ``step`` → its JSON
    row (``step`` and ``step_reason`` the step that ran; None in a tree older than them)."""
    named = side.knows("bench/train.py", "--nce-step")
    stdout = run([sys.executable, *side.bench("train"), "--objectives", "nce", "--minutes",
                  str(minutes), "--threads", "1", "--workdir", str(work), "--json",
                  *(["--nce-step", step] if named else [])], side.src, side.env, log=work.with_suffix(".log"))
    for line in stdout.splitlines():
        if line.startswith("{"):
            row: dict[str, Any] = json.loads(line)
            if row.get("objective") == "nce":
                if named:
                    row.update(training_step({"step_ran": row.get("step"), "step_reason": row.get("step_reason")},
                                             step, f"{side.rev}: bench/train.py"))
                else:
                    row.update(step=None, step_reason=None)
                return row
    raise SystemExit(f"{side.rev}: bench/train.py printed no nce row")


def training_speed(log: Path, skip_steps: int = SKIP_STEPS) -> dict[str, float]:
    """From an ``nlmserve train`` log (``MODEL.log.jsonl``): tokens per second between its
    first progress record at or after ``skip_steps`` and its last one, and the steps taken."""
    rows = [r for r in map(json.loads, log.read_text().splitlines()) if "tokens_per_s" in r]
    start = next((r for r in rows if r["step"] >= skip_steps), None)
    if start is None or rows[-1] is start:
        raise SystemExit(f"{log}: no progress record after step {skip_steps:,} and a later one; "
                         "give the training a larger budget in --train-args")
    end = rows[-1]
    return {"tokens_per_s": (end["tokens"] - start["tokens"]) / (end["elapsed"] - start["elapsed"]),
            "steps": float(end["step"])}


def given_step(train_args: list[str]) -> str | None:
    """The ``--step`` that ``--train-args`` give themselves (None: none); SystemExit for
    ``auto``, which would measure whichever step the run happens to get."""
    given = next((a.split("=", 1)[1] if "=" in a else (train_args[i + 1] if i + 1 < len(train_args) else "")
                  for i, a in enumerate(train_args) if a == "--step" or a.startswith("--step=")), None)
    if given is not None and given not in TRAINING_STEPS:
        raise SystemExit(f"--train-args: --step {given or '(no value)'}: name the step measured, "
                         f"{' or '.join(TRAINING_STEPS)} (or leave --step out: --train-step names it)")
    return given


def recipe_bench(side: Side, train_args: list[str], out: Path, step: str = "fused") -> dict[str, Any]:
    """That tree's ``nlmserve train ARGS --step STEP --out OUT`` (earlier outputs of OUT removed
    first; ARGS that give ``--step`` keep theirs) → :func:`training_speed` of its log, with the
    step that ran and why (``step``, ``step_reason``: None in a tree older than them)."""
    for old in out.parent.glob(out.name + "*"):
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    from nlmserve.common.serve_process import nlmserve_command

    given = given_step(train_args)
    named = given is None and side.knows("lm/cli.py", "--step")
    asked = given or (step if named else None)
    run([*nlmserve_command(), "train", *train_args, *(["--step", step] if named else []), "--out", str(out)],
        side.src, side.env, log=out.with_suffix(".log"))
    log_path = out.with_name(out.name + ".log.jsonl")
    start = json.loads(log_path.read_text().splitlines()[0])
    ran: dict[str, Any] = {"step": None, "step_reason": None}
    if asked is not None and "step_ran" in start:
        ran = dict(training_step(start, asked, f"{side.rev}: {log_path}"))
    return {**training_speed(log_path), **ran}


def sequential_latency(side: Side, model: Path, requests: int, native: bool) -> dict[str, float]:
    """``requests`` single 5-gram requests, one after another, to that tree's ``nlmserve
    serve`` (with ``native``: behind its native front end) → p50, p99 (ms) and the server
    tree's CPU per request (µs)."""
    import numpy as np

    from nlmserve.common.errors import NlmserveError
    from nlmserve.common.serve_process import start_server
    from bench.serve import single_latency

    extra = ["--host", "127.0.0.1"]
    if native:
        extra += ["--frontend", "native", "--frontend-binary", str(side.frontend())]
    try:
        server = start_server(model, extra, env=side.env, cwd=side.src)
    except NlmserveError as e:
        raise SystemExit(f"{side.rev}: `nlmserve serve` did not start ({e}); "
                         "can this revision read the model? (--model)") from e
    try:
        ids = np.random.default_rng(0).integers(4, 1000, size=(requests, 5)).astype("<u4")
        r = single_latency(server.target, ids, requests, warmup=200,
                           probe=lambda: tree_cpu_seconds(server.process.pid))
    finally:
        server.stop()
    return {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
            "server_cpu_us": (r["after"] - r["before"]) / requests * 1e6}


# --- the report --------------------------------------------------------------------------------


def summarise(rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per metric both sides report: the values of each round and :func:`compare`'s result."""
    rows = []
    for m in METRICS:
        old = [lookup(r, m.key) for r in rounds["old"]]
        new = [lookup(r, m.key) for r in rounds["new"]]
        if not old or not new or None in old or None in new:
            continue
        olds = [v for v in old if v is not None]
        news = [v for v in new if v is not None]
        rows.append({"key": m.key, "label": m.label, "old": olds, "new": news,
                     **compare(olds, news, m.higher_is_better)})
    return rows


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def render(result: dict[str, Any]) -> str:
    """The comparison as Markdown: one line on what ran where, the table, the command."""
    m = result["machine"]
    old, new = result["old"], result["new"]
    lines = [
        f"`{old['rev']}` ({old['sha'][:7]}) against `{new['rev']}` ({new['sha'][:7]}), {result['rounds']} rounds "
        f"interleaved old/new; {m['cpu']}, {m['cores']} cores, load average {m['load_average_1m']} at the start. "
        "Same: the means differ by no more than the larger of the two sides' ranges, or by less than 1%.",
        "",
        "| metric | old runs | new runs | new / old | verdict |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['label']} | {', '.join(map(_fmt, row['old']))} | {', '.join(map(_fmt, row['new']))} "
                     f"| {row['ratio']:.2f} | {row['verdict']} |")
    steps = _steps(result.get("rounds_detail", {}))
    if steps:
        lines += ["", "Training step: " + "; ".join(steps) + "."]
    lines += ["", f"Command: `{_common.shown_command(result['command'])}`"]
    return "\n".join(lines)


def _steps(rounds: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What each side's trainings say of the step that ran, e.g. ``train: old fused (--step
    fused), new fused (--step fused)``; a training without a record says so."""
    out = []
    for what in ("train", "recipe"):
        sides = []
        for name in ("old", "new"):
            runs = [r[what] for r in rounds.get(name, []) if what in r]
            if not runs:
                continue
            seen = sorted({(r.get("step"), r.get("step_reason")) for r in runs}, key=str)
            said = ", ".join("not recorded" if step is None else f"{step} ({why})" for step, why in seen)
            sides.append(f"{name} {said}")
        if sides:
            out.append(f"{what} " + ", ".join(sides))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the revision before (any git revision)")
    ap.add_argument("--new", default="HEAD", help="the revision after")
    ap.add_argument("--rounds", type=int, default=3, help="old/new pairs (at least 2: the spread needs two)")
    ap.add_argument("--seconds", type=float, default=3.0, help="bench/serve.py --seconds")
    ap.add_argument("--train-minutes", type=float, default=1.0, help="bench/train.py --minutes (0: no training)")
    ap.add_argument("--train-args", type=shlex.split, default=[],
                    help='also time `nlmserve train ARGS` of each tree (one quoted string, given with "=": '
                    '--train-args="--train T --max-minutes 4"; --out is added)')
    ap.add_argument("--train-step", choices=TRAINING_STEPS, default="fused",
                    help="the training step both trainings measure (nlmserve train --step; bench/train.py --nce-step)")
    ap.add_argument("--skip-serve", action="store_true", help="leave the serving measurements out")
    ap.add_argument("--requests", type=int, default=3000, help="sequential single n-gram requests per server")
    ap.add_argument("--model", type=Path, help="model file for the sequential requests (default: a random one "
                    "of bench/serve.py's shape, written by this tree)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/nlmserve-revisions"),
                    help="exported trees, installs and logs (reused)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--prepare-only", action="store_true",
                    help="set the two revisions up (export, install, make cpp) and stop: build ahead, "
                    "measure later on a quiet machine")
    ap.add_argument("--render", nargs=2, metavar=("DOC", "JSON"),
                    help="only replace DOC's bench/revisions.py section with JSON's table")
    ap.add_argument("--section", default="", help="with --render: the named section (its own markers, "
                    "<!-- bench/revisions.py NAME: begin/end -->) instead of the unnamed one")
    args = ap.parse_args(argv)
    if args.render:
        doc, js = map(Path, args.render)
        begin, end = markers(args.section)
        write_section(doc, begin, end, f"{begin}\n\n{render(json.loads(js.read_text()))}\n\n{end}")
        return 0
    if not args.old:
        ap.error("--old is required")
    if args.rounds < 2:
        ap.error("--rounds must be at least 2")
    given_step(args.train_args)  # before any work
    args.work.mkdir(parents=True, exist_ok=True)
    cpp = not args.skip_serve  # the C++ front end is measured by the serving benchmarks only
    sides = [prepare("old", args.old, args.work, cpp), prepare("new", args.new, args.work, cpp)]
    if args.prepare_only:
        for side in sides:
            print(f"{side.name}: {side.rev} ({side.sha[:12]}) ready in {side.src.parent}")
        return 0
    model = args.model
    if model is None and not args.skip_serve:
        model = args.work / "latency.nlm"
        if not model.exists():
            random_class_model([DATA / "europarl.train.50k.lc-moses.en.xz"], 10_000, 5, 256, 0, model)
    result: dict[str, Any] = {"machine": machine(), "command": " ".join(["bench/revisions.py", *(argv or sys.argv[1:])]),
                              "rounds": args.rounds}
    rounds: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in sides:
            tag = f"{side.name}{r + 1}"
            print(f"# round {r + 1}: {side.name} ({side.rev})", file=sys.stderr, flush=True)
            one: dict[str, Any] = {}
            if not args.skip_serve:
                one["serve"] = serve_bench(side, args.seconds, args.work / f"serve-{tag}.json")
                one["latency"] = {"python": sequential_latency(side, model, args.requests, False),
                                  "native": sequential_latency(side, model, args.requests, True)}
            if args.train_minutes > 0:
                one["train"] = train_bench(side, args.train_minutes, args.work / f"train-{tag}", args.train_step)
            if args.train_args:
                one["recipe"] = recipe_bench(side, args.train_args, args.work / f"recipe-{tag}.nlm", args.train_step)
            rounds[side.name].append(one)
    result.update({s.name: {"rev": s.rev, "sha": s.sha} for s in sides})
    result["rounds_detail"] = rounds
    result["rows"] = summarise(rounds)
    print(render(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    exit_with(main)
