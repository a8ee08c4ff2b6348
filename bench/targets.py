"""The project's perplexity targets against Kneser-Ney, end to end, in one command.

Four experiments on the shared Europarl (``../shared/data/lm``; ``--train`` and ``--dev`` name
other texts):

* ``200k``: the first 200,000 lines, our model within 20 minutes: a perplexity at least 8%
  below that of a Kneser-Ney 5-gram of the same lines;
* ``full``: the whole 18.25M-token corpus within 60 minutes, the same goal;
* ``oxlm-nce`` / ``oxlm-mle``: the OxLM set-up, the first 120,000 lines with singletons
  mapped to ``<unk>`` (``--min-count 2``), width 256, NCE within 10 minutes and exact MLE
  within 20 (no goal: bench/oxlm.py measures OxLM itself).

**Selected on one text, reported on another.** The dev text is cut in two: its first half
(lines 1 to ⌊n/2⌋, ``WORK/dev.select.txt``) is training's ``--valid`` (the learning-rate
schedule, early stopping and the model kept), its second half (``WORK/dev.report.txt``) is the
text every number of the table is measured on. Neither model sees the second half before it
is scored; Kneser-Ney sees neither half.

**Both sides, both ways.** Kneser-Ney is built by ``--lmplz PATH`` (``lmplz -o 5`` on each
experiment's training lines) and scored by ``query`` (``--query``, default next to it) on the
report text; our model by ``nlmserve eval``. Each side gives its perplexity with OOVs
(``</s>`` counted, an unknown word scored as ``<unk>``) and without them: the tokens whose
word is outside the training lines' vocabulary are left out of the sum and the count. Both
vocabularies are the words of the training lines (``--min-count`` 1), so both sides leave
out the same positions; for the OxLM set-up, words seen fewer than ``--min-count`` times
become one placeholder word in Kneser-Ney's texts (KenLM refuses ``<unk>`` itself in its
input) and ``<unk>`` in ours, and the placeholder's positions are the ones left out. The
table prints both sides' OOV counts, and says so when they differ. Two models give ``<unk>``
different mass, so a target is met only when our model meets it both with and without OOVs.
Without ``--lmplz`` there is no Kneser-Ney number and no verdict: nothing is typed in.

**The step measured.** ``nlmserve train`` gets ``--step`` (the NCE rows ``--nce-step``, default
``fused``; MLE ``torch``, its only step), so a run that would train with another step is
refused; each row records the step that ran and why (the model file's training record).

``--scale F`` multiplies every budget (e.g. 0.1 for a short end-to-end check); the table
then says so. ``nlmserve train`` gets the text, the budget, the selection text, the step and
nothing else unless a model flag is given here (``--dim``, ``--lr``, ...): its recipe chooses
the rest, and the table prints what it chose. Training time includes building the
vocabulary, the id file and the classes. Usage:

    .venv/bin/python -m bench.targets --lmplz /path/to/lmplz                   # all, full budgets
    .venv/bin/python -m bench.targets --scale 0.05 --only 200k,oxlm-nce --lmplz /path/to/lmplz
    .venv/bin/python -m bench.targets --render docs/performance.md bench/results/targets-200k.json \
        bench/results/targets-full.json bench/results/targets-oxlm.json   # the rows of the page
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import lzma
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import (exit_with, TRAINING_STEPS, machine, markers, shown_command, training_step, write_json,
                           write_section)
from nlmserve.common.perplexity import from_log10

log = logging.getLogger("bench.targets")

REPO = Path(__file__).resolve().parent.parent
SHARED_LM = REPO.parent / "shared" / "data" / "lm"
TRAIN = SHARED_LM / "europarl.train.lc-moses.en.xz"
DEV = SHARED_LM / "europarl.dev.lc-moses.en"


@dataclass(frozen=True)
class Target:
    """One experiment.

    Fields:
        name: the table row's name (``--only`` selects by it).
        lines: first N training lines (None: all).
        minutes: the wall-time budget of our model's training.
        objective: nce or mle.
        min_count: 2 maps singletons to ``<unk>`` (the OxLM set-up).
        dim: embedding width (None: the ``--dim`` flag; the OxLM targets' 256 yields to ``--oxlm-dim``).
        goal: the relative change against Kneser-Ney the target asks for at most (None: none).
    """

    name: str
    lines: int | None
    minutes: float
    objective: str = "nce"
    min_count: int = 1
    dim: int | None = None
    goal: float | None = None


TARGETS = (
    Target("200k", 200_000, 20.0, goal=-0.08),
    Target("full", None, 60.0, goal=-0.08),
    Target("oxlm-nce", 120_000, 10.0, "nce", 2, 256),
    Target("oxlm-mle", 120_000, 20.0, "mle", 2, 256),
)


@dataclass(frozen=True)
class Perplexity:
    """One model's perplexity of the report text.

    Fields:
        ppl: with OOVs (``</s>`` counted, unknown words scored as ``<unk>``).
        ppl_excl_oov: without the OOV tokens (left out of the sum and of the count).
        oov: OOV tokens; tokens: all tokens, ``</s>`` included.
    """

    ppl: float
    ppl_excl_oov: float
    oov: int
    tokens: int


@dataclass
class Row:
    """One experiment's results: Kneser-Ney's (None without ``--lmplz``) and ours on the
    report text, and what the training did."""

    target: Target
    minutes: float
    kn: Perplexity | None = None
    ours: Perplexity | None = None
    steps: int | None = None
    tokens_seen: int | None = None
    train_seconds: float | None = None
    dim: int | None = None
    recipe: str = ""
    step: str = ""
    step_reason: str = ""
    train_text: str = ""
    train_tokens: int | None = None
    prepare_seconds: float | None = None
    loop_seconds: float | None = None
    peak_rss_bytes: int | None = None
    model_bytes: int | None = None


def head_lines(src: Path, n: int | None, dst: Path) -> Path:
    """The first ``n`` lines (all when None) of a plain or .xz text, as a plain file."""
    if dst.exists():
        return dst
    opener = lzma.open if src.suffix == ".xz" else open
    tmp = dst.with_name(dst.name + ".tmp")
    with opener(src, "rt", encoding="utf-8") as fin, open(tmp, "w", encoding="utf-8") as fout:  # type: ignore[operator]
        for i, line in enumerate(fin):
            if n is not None and i >= n:
                break
            fout.write(line)
    os.replace(tmp, dst)
    return dst


def split_dev(dev: Path, work: Path) -> tuple[Path, Path, int]:
    """``dev`` cut in two (rewritten every run): its first ⌊n/2⌋ lines, the text training
    selects on (``--valid``), and the rest, the text every number is reported on → their
    paths and the number of selection lines. SystemExit for a text of fewer than 2 lines."""
    lines = dev.read_text(encoding="utf-8").splitlines(keepends=True)
    if len(lines) < 2:
        raise SystemExit(f"bench/targets.py: {dev} has {len(lines)} line(s): selection and report need 2 at least")
    half = len(lines) // 2
    select, report = work / "dev.select.txt", work / "dev.report.txt"
    for path, part in ((select, lines[:half]), (report, lines[half:])):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(part), encoding="utf-8")
        os.replace(tmp, path)
    return select, report, half


PLACEHOLDER = "UNKWORD"  # stands for <unk> in KenLM's texts (the corpus is lowercased)


def map_rare(text: Path, dev: Path, min_count: int, work: Path,
             placeholder: str = PLACEHOLDER) -> tuple[Path, Path]:
    """Copies of ``text`` and ``dev`` with words outside the min-count vocabulary of ``text``
    replaced by ``placeholder`` (the OxLM set-up: singletons mapped to ``<unk>``; KenLM's
    texts take :data:`PLACEHOLDER`, OxLM's and ours ``<unk>`` itself)."""
    tag = f"min{min_count}" + ("" if placeholder == PLACEHOLDER else ".unk")
    out_text = work / f"{text.stem}.{tag}.txt"
    out_dev = work / f"{dev.stem}.{tag}.{text.stem}.txt"
    if out_text.exists() and out_dev.exists() and out_dev.stat().st_mtime_ns >= dev.stat().st_mtime_ns:
        return out_text, out_dev
    counts: dict[str, int] = {}
    with open(text, encoding="utf-8") as f:
        for line in f:
            for w in line.split():
                counts[w] = counts.get(w, 0) + 1
    if placeholder in counts:
        raise RuntimeError(f"{text} contains the placeholder word {placeholder!r}")
    keep = {w for w, c in counts.items() if c >= min_count}
    for src, dst in ((text, out_text), (dev, out_dev)):
        tmp = dst.with_name(dst.name + ".tmp")
        with open(src, encoding="utf-8") as fin, open(tmp, "w", encoding="utf-8") as fout:
            for line in fin:
                fout.write(" ".join(w if w in keep else placeholder for w in line.split()) + "\n")
        os.replace(tmp, dst)
    return out_text, out_dev


def parse_query(output: str, placeholder: str = PLACEHOLDER) -> Perplexity:
    """KenLM ``query``'s per-word output (``word=id ngram_length log10prob`` cells, a tab
    after each, then ``Total: T OOV: k`` per line) → the perplexity with OOVs and without
    them: a token is OOV when KenLM's vocabulary lacks it (id 0) or when it is
    ``placeholder``, the word that stands for the rare words mapped to ``<unk>``."""
    total = kept = 0.0
    tokens = oov = 0
    for line in output.splitlines():
        if "\tTotal: " not in line and not line.startswith("Total: "):
            continue
        for cell in line.split("\t")[:-1]:
            left, _, log10 = cell.rsplit(" ", 2)
            word, _, wid = left.rpartition("=")
            value = float(log10)
            tokens += 1
            total += value
            if wid == "0" or word == placeholder:
                oov += 1
            else:
                kept += value
    if tokens == 0:
        raise RuntimeError(f"no scored words in query's output: {output[:300]!r}")
    return Perplexity(from_log10(total, tokens), from_log10(kept, tokens - oov), oov, tokens)


def kenlm_perplexity(lmplz: Path, query: Path, text: Path, report: Path, work: Path) -> Perplexity:
    """A 5-gram built by lmplz on ``text`` (kept in ``work`` for the next run), scored by
    query on ``report``: with OOVs and without them (:func:`parse_query`)."""
    arpa = work / (text.stem + ".kn5.arpa")
    if not arpa.exists():
        with open(text, "rb") as fin, open(arpa.with_suffix(".tmp"), "wb") as fout:
            subprocess.run([str(lmplz), "-o", "5", "-S", "20%", "-T", str(work)], stdin=fin, stdout=fout,
                           stderr=subprocess.DEVNULL, check=True)
        os.replace(arpa.with_suffix(".tmp"), arpa)
    with open(report, "rb") as fin:
        out = subprocess.run([str(query), str(arpa)], stdin=fin, capture_output=True, check=True).stdout.decode()
    return parse_query(out)


def train_command(row: Row, args: argparse.Namespace, train_text: Path, select: Path, out: Path) -> list[str]:
    """The ``nlmserve train`` command of the row: the text, the budget, the selection text
    (``select``, the dev text's first half), the step, and only the model flags given here
    (its recipe chooses the others, lm/recipe.py)."""
    from nlmserve.common.serve_process import nlmserve_command

    t = row.target
    dim = (args.oxlm_dim or t.dim) if t.dim else args.dim
    cmd = nlmserve_command() + [
        "train", "--train", str(train_text), "--valid", str(select), "--out", str(out),
        "--max-minutes", f"{row.minutes:.3f}", "--step", step_of(t, args.nce_step), "--no-progress",
    ]
    if t.objective != "nce" or t.min_count != 1:  # the OxLM set-ups
        cmd += ["--objective", t.objective, "--min-count", str(t.min_count)]
    given = {"--dim": dim, "--order": args.order, "--ngram-order": args.ngram_order,
             "--class-method": args.class_method, "--threads": args.threads,
             "--valid-every": args.valid_every, "--batch-size": args.batch_size, "--lr": args.lr,
             "--dropout": args.dropout, "--min-improvement": args.min_improvement, "--workers": args.workers,
             "--lr-schedule": args.lr_schedule, "--ngram-class-bits": args.ngram_class_bits,
             "--ngram-word-bits": args.ngram_word_bits, "--noise-samples": args.noise_samples}
    for flag, value in given.items():
        if value is not None:
            cmd += [flag, str(value)]
    if args.ngram_features is not None:
        cmd += ["--ngram-features" if args.ngram_features else "--no-ngram-features"]
    return cmd


def step_of(target: Target, nce_step: str) -> str:
    """The ``--step`` a target's training is given: ``nce_step`` for NCE, ``torch`` for MLE
    (the fused step is NCE's)."""
    return nce_step if target.objective == "nce" else "torch"


def run_target(row: Row, args: argparse.Namespace, train_text: Path, select: Path, report: Path,
               work: Path) -> None:
    """Train our model for the row's budget on ``train_text``, selecting on ``select``, and
    evaluate it on ``report``."""
    from nlmserve.common.serve_process import nlmserve_command
    from nlmserve.lm.model_file import read_model_header
    from nlmserve.pipeline.moses_experiment import run_watched

    t = row.target
    out = work / f"{t.name}.nlm"
    cmd = train_command(row, args, train_text, select, out)
    log.info("%s: %s", t.name, " ".join(cmd))
    # its own log says how far it is; the largest resident set is of it and its workers
    done = run_watched(cmd, lambda: None, stdout=subprocess.DEVNULL, stderr=None)
    row.train_seconds = done.wall
    if done.code != 0:
        raise subprocess.CalledProcessError(done.code, cmd)
    row.peak_rss_bytes = done.maxrss
    row.model_bytes = out.stat().st_size
    records = [json.loads(line) for line in Path(f"{out}.log.jsonl").read_text(encoding="utf-8").splitlines()]
    start, end = records[0], records[-1]
    row.train_text, row.train_tokens = str(train_text), int(start["train_tokens"])
    row.prepare_seconds = start.get("prepare_s")  # vocabulary, id files, classes, model
    row.loop_seconds = float(end["elapsed"]) if end.get("event") == "end" else None
    ev = subprocess.run([*nlmserve_command(), "eval", "--model", str(out), "--text", str(report),
                         "--json", "--threads", str(args.threads or 0)], check=True, capture_output=True, text=True)
    res = json.loads(ev.stdout)
    row.ours = Perplexity(res["perplexity"], res["perplexity_excl_oov"], res["oov"], res["tokens"])
    training = read_model_header(out).training
    step = training_step(training, step_of(t, args.nce_step), str(out))
    row.step, row.step_reason = step["step"], step["step_reason"]
    row.steps = training["steps"]
    row.tokens_seen = training["tokens_seen"]
    row.recipe = training["train_config"].get("recipe", "")
    row.dim = training["train_config"]["dim"]


def change(ours: float, kn: float) -> float:
    """Our perplexity's relative change against Kneser-Ney's (−0.08: 8% lower)."""
    return ours / kn - 1


def verdict(goal: float | None, ours: Perplexity | None, kn: Perplexity | None) -> str:
    """``met`` when our model meets ``goal`` against Kneser-Ney both with and without OOVs,
    ``not met`` (naming where) otherwise; no verdict without a goal or without both sides."""
    if goal is None:
        return "no goal"
    if ours is None or kn is None:
        return "no verdict: no Kneser-Ney run (--lmplz)" if kn is None else "no verdict: not trained"
    missed = [what for what, a, b in (("with OOVs", ours.ppl, kn.ppl), ("without OOVs", ours.ppl_excl_oov,
                                                                        kn.ppl_excl_oov)) if change(a, b) > goal]
    return "met" if not missed else f"not met ({' and '.join(missed)})"


def _minus(number: str) -> str:
    """A signed number as the pages print it (U+2212 for the minus sign)."""
    return number.replace("-", "\u2212")


def _pct(x: float) -> str:
    """A signed percentage with two decimals, as the pages print it."""
    return _minus(f"{x * 100:+.2f}%")


def _compared(ours: Perplexity, kn: Perplexity | None) -> tuple[str, str]:
    """(with OOVs, without OOVs) cells: ours against Kneser-Ney's and the change."""
    if kn is None:
        return f"{ours.ppl:.2f} (KN not measured)", f"{ours.ppl_excl_oov:.2f} (KN not measured)"
    return (f"{ours.ppl:.2f} against {kn.ppl:.2f} ({_pct(change(ours.ppl, kn.ppl))})",
            f"{ours.ppl_excl_oov:.2f} against {kn.ppl_excl_oov:.2f} ({_pct(change(ours.ppl_excl_oov, kn.ppl_excl_oov))})")


def _oovs(ours: Perplexity, kn: Perplexity | None) -> str:
    """The OOV tokens each side left out, flagged when they differ."""
    if kn is None:
        return f"{ours.oov:,} of {ours.tokens:,}"
    if (kn.oov, kn.tokens) == (ours.oov, ours.tokens):
        return f"{ours.oov:,} of {ours.tokens:,} (both)"
    return f"**differ**: ours {ours.oov:,} of {ours.tokens:,}, KN {kn.oov:,} of {kn.tokens:,}"


def format_table(rows: list[Row], scale: float) -> str:
    lines = [
        f"budget scale {scale:g}" + ("" if scale == 1 else " (short runs: NOT the targets' budgets)"),
        "| target | budget (min) | width | step | ours / KN with OOVs | without OOVs | OOV tokens | verdict | steps "
        "| tokens seen | wall (s) | recipe chosen by nlmserve train |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.target
        with_oov, without = _compared(r.ours, r.kn) if r.ours is not None else ("n/a", "n/a")
        oovs = _oovs(r.ours, r.kn) if r.ours is not None else ""
        seen = f"{r.tokens_seen:,}" if r.tokens_seen is not None else ""
        lines.append(f"| {t.name} | {r.minutes:.2f} | {r.dim or ''} | {r.step} | {with_oov} | {without} | {oovs} "
                     f"| {verdict(t.goal, r.ours, r.kn)} | {r.steps or ''} | {seen} | {r.train_seconds or 0:.0f} "
                     f"| {r.recipe} |")
    return "\n".join(lines)


_TEXT = {"200k": "first 200,000 lines", "full": "all of Europarl (18.25M tokens)"}
_OXLM = {"oxlm-nce": "OxLM's set-up (the first 120,000 lines, words seen once as `<unk>`): NCE",
         "oxlm-mle": "OxLM's set-up (the first 120,000 lines, words seen once as `<unk>`): exact class MLE"}


def _text(result: dict[str, Any], r: dict[str, Any]) -> str:
    """The training text of a row as the table names it: the shared Europarl's (``_TEXT``), or
    the ``--train`` the run was given, with its tokens."""
    args = shlex.split(result["command"])
    if "--train" not in args[:-1]:
        return _TEXT[r["target"]["name"]]
    name = Path(args[args.index("--train") + 1]).name
    lines = r["target"]["lines"]
    tokens = r.get("train_tokens")
    if tokens is None:  # a run older than the field: the recipe's line names them
        found = re.search(r"for ([\d,]+) training tokens", r.get("recipe", ""))
        tokens = int(found.group(1).replace(",", "")) if found else None
    counted = f" ({tokens / 1e6:.2f}M tokens)" if tokens else ""
    return (f"first {lines:,} lines of `{name}`" if lines else f"all of `{name}`") + counted


def _training(r: dict[str, Any]) -> str:
    """The training cell: the step, steps, tokens and seconds, and where the run recorded them
    the loop's own rate, the set-up before it, the largest resident set and the model file."""
    rate = r["tokens_seen"] / r["train_seconds"]
    cell = (f"the {r['step']} step ({r['step_reason']}); {r['steps']:,} steps, "
            f"{r['tokens_seen'] / 1e6:.1f}M tokens, {rate:,.0f} tokens/s, {r['train_seconds']:,.0f} s")
    if r.get("loop_seconds") and r.get("prepare_seconds") is not None:
        cell += (f" (the loop {r['tokens_seen'] / r['loop_seconds']:,.0f} tokens/s, after "
                 f"{r['prepare_seconds']:,.0f} s of vocabulary, word classes and set-up)")
    if r.get("peak_rss_bytes"):
        cell += f"; largest resident set {r['peak_rss_bytes'] / 1e9:.1f} GB"
    if r.get("model_bytes"):
        cell += f"; model file {r['model_bytes'] / 1e6:,.0f} MB"
    return cell


def _perplexity(record: dict[str, Any] | None) -> Perplexity | None:
    return Perplexity(**record) if record is not None else None


def render(results: list[dict[str, Any]]) -> str:
    """The rows in ``results`` (each a ``--json`` file: a run's machine, command, dev split and
    rows) as the Markdown table of docs/performance.md: the no-flag targets (``200k``,
    ``full``) with their goal and verdict, the OxLM set-ups with their flags and no goal."""
    lines = ["| target | with OOVs: ours against Kneser-Ney | without OOVs | training | verdict | command |",
             "|---|---|---|---|---|---|"]
    for result in results:
        m, split = result["machine"], result["split"]
        for r in result["rows"]:
            t = r["target"]
            ours, kn = _perplexity(r["ours"]), _perplexity(r["kn"])
            if ours is None:
                continue
            selected = (f"selected on lines 1–{split['select_lines']:,} of the dev text, reported on "
                        f"lines {split['select_lines'] + 1:,}–{split['lines']:,}")
            recipe = f"`{r['recipe'].split(' (')[0]}`"
            if t["name"] in _OXLM:
                target = (f"{_OXLM[t['name']]} within {r['minutes']:g} minutes (`--objective {t['objective']} "
                          f"--min-count {t['min_count']} --dim {r['dim']}`, the {recipe} recipe's other choices), "
                          f"no goal; `lmplz -o 5` on the same mapped lines; {selected}")
            else:
                goal = _minus(f"{t['goal'] * 100:.0f}")
                target = (f"{_text(result, r)}, {r['minutes']:g} minutes, **no training flags** (`nlmserve train` "
                          f"chose the {recipe} recipe): at most {goal}% against `lmplz -o 5` on the same lines; "
                          f"{selected}")
            with_oov, without = _compared(ours, kn)
            training = _training(r)
            command = (f"`{shown_command(result['command'])}` ({result['date']}, {m['cpu']}, load average "
                       f"{m['load_average_1m']} at the start)")
            lines.append(f"| {target} | {with_oov} | {without}; OOV tokens {_oovs(ours, kn)} | {training} "
                         f"| {verdict(t['goal'], ours, kn)} | {command} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--scale", type=float, default=1.0, help="budget fraction (1: the targets' budgets)")
    p.add_argument("--only", help="comma-separated target names: " + ",".join(t.name for t in TARGETS))
    p.add_argument("--lmplz", type=Path, help="KenLM lmplz: build the Kneser-Ney baselines here (without it: none)")
    p.add_argument("--query", type=Path, help="KenLM query (default: next to lmplz)")
    p.add_argument("--train", type=Path, default=TRAIN, help="training text, plain or .xz (default: the shared Europarl)")
    p.add_argument("--dev", type=Path, default=DEV,
                   help="dev text: its first half selects (training's --valid), its second half reports")
    p.add_argument("--work", type=Path, default=Path("runs/targets"), help="texts, models and logs go here")
    p.add_argument("--nce-step", choices=TRAINING_STEPS, default="fused",
                   help="nlmserve train --step of the NCE targets (the MLE target: torch, its only step)")
    # Each of these is passed to nlmserve train only when given; otherwise its recipe chooses.
    p.add_argument("--dim", type=int)
    p.add_argument("--order", type=int, help="nlmserve train --order (n-gram order)")
    p.add_argument("--ngram-order", type=int, help="nlmserve train --ngram-order (longest n-gram with a direct feature)")
    p.add_argument("--oxlm-dim", type=int, help="width for the oxlm-* targets (default: 256, OxLM's own)")
    p.add_argument("--class-method", choices=("frequency", "brown"))
    p.add_argument("--threads", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--valid-every", type=int)
    p.add_argument("--ngram-features", action=argparse.BooleanOptionalAction)
    p.add_argument("--ngram-class-bits", type=int, help="nlmserve train --ngram-class-bits")
    p.add_argument("--ngram-word-bits", type=int, help="nlmserve train --ngram-word-bits")
    p.add_argument("--lr-schedule", choices=("plateau", "linear"),
                   help="nlmserve train --lr-schedule (linear: the rate falls to 0 over the budget)")
    p.add_argument("--min-improvement", type=float,
                   help="nlmserve train --min-improvement (learning-rate decay on small gains)")
    p.add_argument("--workers", type=int, help="Hogwild processes (nlmserve train --workers)")
    p.add_argument("--dropout", type=float, help="dropout on the context vector (0: none)")
    p.add_argument("--noise-samples", type=int, help="nlmserve train --noise-samples (NCE's k)")
    p.add_argument("--json", type=Path, help="also write the run (machine, command, dev split, rows) as JSON here")
    p.add_argument("--render", nargs="+", type=Path, metavar=("DOC", "JSON"),
                   help="only replace DOC's bench/targets.py section by the no-flag rows of the JSON files")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.render:
        if len(args.render) < 2:
            p.error("--render takes DOC and one or more JSON files")
        doc, *files = args.render
        begin, end = markers("targets.py")
        table = render([json.loads(f.read_text(encoding="utf-8")) for f in files])
        write_section(doc, begin, end, f"{begin}\n\n{table}\n\n{end}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.scale <= 0:
        p.error("--scale must be positive")
    names = args.only.split(",") if args.only else [t.name for t in TARGETS]
    unknown = set(names) - {t.name for t in TARGETS}
    if unknown:
        p.error(f"unknown targets: {sorted(unknown)}")
    for text in (args.train, args.dev):
        if not text.exists():
            print(f"bench/targets.py: error: no such text: {text}", file=sys.stderr)
            return 2
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    query = args.query or (args.lmplz.parent / "query" if args.lmplz else None)
    select, report, half = split_dev(args.dev, work)
    started = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(["bench/targets.py", *(argv if argv is not None else sys.argv[1:])]),
               "split": {"dev": str(args.dev), "lines": half + len(report.read_text(encoding="utf-8").splitlines()),
                         "select_lines": half, "select": "the first half: training's --valid",
                         "report": "the second half: every number of the rows"}}
    rows: list[Row] = []
    for t in TARGETS:
        if t.name not in names:
            continue
        row = Row(t, t.minutes * args.scale)
        train_text = head_lines(args.train, t.lines, work / f"train.{t.lines or 'full'}.txt")
        if args.lmplz is not None and query is not None:
            kn_text, kn_report = train_text, report
            if t.min_count > 1:
                kn_text, kn_report = map_rare(train_text, report, t.min_count, work)
            row.kn = kenlm_perplexity(args.lmplz, query, kn_text, kn_report, work)
        run_target(row, args, train_text, select, report, work)
        log.info("%s: %s", t.name, verdict(t.goal, row.ours, row.kn))
        rows.append(row)
    print(format_table(rows, args.scale))
    if args.json:
        write_json(args.json, {**started, "rows": [dataclasses.asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    exit_with(main)
