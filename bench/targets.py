"""The project's perplexity targets against Kneser-Ney, end to end, in one command.

Three experiments on the shared Europarl (``../shared/data/lm``), dev perplexity on
``europarl.dev.lc-moses.en`` (``</s>`` counted, OOVs scored as ``<unk>`` on both sides, as
KenLM's ``query`` reports it):

* ``200k``: the first 200,000 lines, our model within 20 minutes, against a Kneser-Ney
  5-gram on the same lines (61.1);
* ``full``: the whole 18.25M-token corpus within 60 minutes (Kneser-Ney: 52.4);
* ``oxlm-nce`` / ``oxlm-mle``: the OxLM comparison on the first 120,000 lines with
  singletons mapped to ``<unk>`` (``--min-count 2``), width 256, NCE within 10 minutes
  and exact MLE within 20 (OxLM reached 66.7 and 66.0 where Kneser-Ney scored 68.5).

Kneser-Ney: with ``--lmplz PATH`` (and ``--query``, default next to it) a modified
Kneser-Ney 5-gram is built with ``lmplz -o 5`` on each experiment's training lines and
scored with ``query``; otherwise the perplexities above, typed in here from earlier
``lmplz`` runs, are used and the table says "typed in" (``--kn NAME=PPL`` overrides one).
For the 120k-line targets Kneser-Ney sees the same tokens as our model: words seen fewer
than ``--min-count`` times in the training lines, and dev words outside that vocabulary,
become one placeholder word in both texts (KenLM refuses ``<unk>`` itself in its input), so
both sides predict the same events, including the unknown-word ones.

``--scale F`` multiplies every budget (e.g. 0.1 for a short end-to-end check); the table
then says so. ``nlmserve train`` gets the text, the budget and nothing else unless a
model flag is given here (``--dim``, ``--lr``, ...): its recipe chooses the rest, and the
table prints what it chose. Training time includes building the vocabulary, the id file
and the classes. Usage:

    .venv/bin/python -m bench.targets                                  # all, full budgets
    .venv/bin/python -m bench.targets --scale 0.05 --only 200k,oxlm-nce --lmplz /path/to/lmplz
    .venv/bin/python -m bench.targets --render docs/performance.md bench/results/targets-200k.json \
        bench/results/targets-full.json                              # the no-flag rows of the page
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import lzma
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import machine, markers, shown_command, write_json, write_section

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
        minutes: the issue's wall-time budget for our model.
        kn: Kneser-Ney dev perplexity typed in from an earlier ``lmplz`` run (used without ``--lmplz``).
        objective: nce or mle.
        min_count: 2 maps singletons to ``<unk>`` (the OxLM set-up).
        dim: embedding width (None: the ``--dim`` flag; the OxLM targets' 256 yields to ``--oxlm-dim``).
        peer: the peer's perplexity to print beside it (OxLM), or None.
        goal: the relative change against Kneser-Ney the target asks for at most (None: none).
    """

    name: str
    lines: int | None
    minutes: float
    kn: float
    objective: str = "nce"
    min_count: int = 1
    dim: int | None = None
    peer: float | None = None
    goal: float | None = None


TARGETS = (
    Target("200k", 200_000, 20.0, 61.1, goal=-0.08),
    Target("full", None, 60.0, 52.4, goal=-0.08),
    Target("oxlm-nce", 120_000, 10.0, 68.5, "nce", 2, 256, 66.7),
    Target("oxlm-mle", 120_000, 20.0, 68.5, "mle", 2, 256, 66.0),
)


@dataclass
class Row:
    target: Target
    minutes: float
    kn_ppl: float
    kn_source: str
    ppl: float | None = None
    ppl_excl_oov: float | None = None
    oov: int | None = None
    steps: int | None = None
    tokens_seen: int | None = None
    train_seconds: float | None = None
    dim: int | None = None
    recipe: str = ""


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


PLACEHOLDER = "UNKWORD"  # stands for <unk> in KenLM's texts (the corpus is lowercased)


def map_rare(text: Path, dev: Path, min_count: int, work: Path,
             placeholder: str = PLACEHOLDER) -> tuple[Path, Path]:
    """Copies of ``text`` and ``dev`` with words outside the min-count vocabulary of ``text``
    replaced by ``placeholder`` (the OxLM set-up: singletons mapped to ``<unk>``; KenLM's
    texts take :data:`PLACEHOLDER`, OxLM's and ours ``<unk>`` itself)."""
    tag = f"min{min_count}" + ("" if placeholder == PLACEHOLDER else ".unk")
    out_text = work / f"{text.stem}.{tag}.txt"
    out_dev = work / f"{dev.stem}.{tag}.{text.stem}.txt"
    if out_text.exists() and out_dev.exists():
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


def kenlm_perplexity(lmplz: Path, query: Path, text: Path, dev: Path, work: Path) -> float:
    """Build a 5-gram with lmplz on ``text`` and return query's dev perplexity (incl. OOVs)."""
    arpa = work / (text.stem + ".kn5.arpa")
    if not arpa.exists():
        with open(text, "rb") as fin, open(arpa.with_suffix(".tmp"), "wb") as fout:
            subprocess.run([str(lmplz), "-o", "5", "-S", "20%", "-T", str(work)], stdin=fin, stdout=fout,
                           stderr=subprocess.DEVNULL, check=True)
        os.replace(arpa.with_suffix(".tmp"), arpa)
    with open(dev, "rb") as fin:
        out = subprocess.run([str(query), "-v", "summary", str(arpa)], stdin=fin, capture_output=True,
                             check=True).stdout.decode()
    m = re.search(r"Perplexity including OOVs:\s*([0-9.eE+-]+)", out)
    if m is None:
        raise RuntimeError(f"no perplexity in the output of {query}: {out[:300]!r}")
    return float(m.group(1))


def train_command(row: Row, args: argparse.Namespace, train_text: Path, out: Path) -> list[str]:
    """The ``nlmserve train`` command of the row: the text, the budget, and only the model
    flags given here (its recipe chooses the others, lm/recipe.py)."""
    from nlmserve.moses_plugin.experiment import nlmserve_command

    t = row.target
    dim = (args.oxlm_dim or t.dim) if t.dim else args.dim
    cmd = nlmserve_command() + [
        "train", "--train", str(train_text), "--valid", str(args.valid), "--out", str(out),
        "--max-minutes", f"{row.minutes:.3f}", "--no-progress",
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


def run_target(row: Row, args: argparse.Namespace, work: Path) -> None:
    """Train our model for the row's budget and evaluate it on the dev text."""
    from nlmserve.moses_plugin.experiment import nlmserve_command

    t = row.target
    train_text = head_lines(TRAIN, t.lines, work / f"train.{t.lines or 'full'}.txt")
    out = work / f"{t.name}.nlm"
    cmd = train_command(row, args, train_text, out)
    log.info("%s: %s", t.name, " ".join(cmd))
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    row.train_seconds = time.monotonic() - t0
    ev = subprocess.run([*nlmserve_command(), "eval", "--model", str(out), "--text", str(DEV),
                         "--json", "--threads", str(args.threads or 0)], check=True, capture_output=True, text=True)
    res = json.loads(ev.stdout)
    row.ppl, row.ppl_excl_oov, row.oov = res["perplexity"], res["perplexity_excl_oov"], res["oov"]
    header = json.loads(_model_header(out))
    row.steps = header["training"]["steps"]
    row.tokens_seen = header["training"]["tokens_seen"]
    row.recipe = header["training"]["train_config"].get("recipe", "")
    row.dim = header["training"]["train_config"]["dim"]


def _model_header(path: Path) -> str:
    from nlmserve.lm.model_file import read_model_file

    mf = read_model_file(path)
    return json.dumps({"training": mf.training})


def format_table(rows: list[Row], scale: float) -> str:
    lines = [
        f"budget scale {scale:g}" + ("" if scale == 1 else " (short runs: NOT the issue's budgets)"),
        "| target | budget (min) | width | KN ppl | KN from | our ppl | excl. OOV | vs KN | steps | tokens seen | wall (s) "
        "| recipe chosen by nlmserve train |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.target
        ours = f"{r.ppl:.1f}" if r.ppl is not None else "n/a"
        excl = f"{r.ppl_excl_oov:.1f}" if r.ppl_excl_oov is not None else "n/a"
        rel = f"{(r.ppl / r.kn_ppl - 1) * 100:+.1f}%" if r.ppl is not None else "n/a"
        if t.peer is not None:
            rel += f" (OxLM {t.peer:g}: {(t.peer / t.kn - 1) * 100:+.1f}%)"
        seen = f"{r.tokens_seen:,}" if r.tokens_seen is not None else ""
        lines.append(f"| {t.name} | {r.minutes:.2f} | {r.dim or ''} | {r.kn_ppl:.1f} | {r.kn_source} | {ours} | {excl} | {rel} "
                     f"| {r.steps or ''} | {seen} | {r.train_seconds or 0:.0f} | {r.recipe} |")
    return "\n".join(lines)


def _minus(number: str) -> str:
    """A signed number as the pages print it (U+2212 for the minus sign)."""
    return number.replace("-", "\u2212")


_TEXT = {"200k": "first 200,000 lines", "full": "all of Europarl (18.25M tokens)"}


def render(results: list[dict[str, Any]]) -> str:
    """The rows of the no-flag targets (``200k``, ``full``) in ``results`` (each a ``--json``
    file: a run's machine, command and rows) as the Markdown table of docs/performance.md."""
    lines = ["| target | measured | verdict | command |", "|---|---|---|---|"]
    for result in results:
        m = result["machine"]
        for r in result["rows"]:
            t = r["target"]
            if t["name"] not in _TEXT or r["ppl"] is None:
                continue
            rel = r["ppl"] / r["kn_ppl"] - 1
            goal = t["goal"]
            kn = "" if r["kn_source"] == "lmplz" else f", {r['kn_source']}"
            recipe = f"`{r['recipe'].split(' (')[0]}`"
            target = (f"{_TEXT[t['name']]}, {t['minutes']:g} minutes, **no training flags** (`nlmserve train` chose "
                      f"the {recipe} recipe): at most {_minus(f'{goal * 100:.0f}')}% against `lmplz -o 5` on the same lines "
                      f"({r['kn_ppl']:.2f}{kn})")
            rate = r["tokens_seen"] / r["train_seconds"]
            measured = (f"{r['ppl']:.2f} (excl. OOVs {r['ppl_excl_oov']:.2f}); {r['steps']:,} steps, "
                        f"{r['tokens_seen'] / 1e6:.1f}M tokens, {rate:,.0f} tokens/s, {r['train_seconds']:,.0f} s")
            verdict = f"{'met' if rel <= goal else 'not met'}, {_minus(f'{rel * 100:+.2f}')}%"
            command = (f"`{shown_command(result['command'])}` ({result['date']}, {m['cpu']}, load average "
                       f"{m['load_average_1m']} at the start)")
            lines.append(f"| {target} | {measured} | {verdict} | {command} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--scale", type=float, default=1.0, help="budget fraction (1: the issue's budgets)")
    p.add_argument("--only", help="comma-separated target names: " + ",".join(t.name for t in TARGETS))
    p.add_argument("--lmplz", type=Path, help="KenLM lmplz: build the Kneser-Ney baselines here")
    p.add_argument("--query", type=Path, help="KenLM query (default: next to lmplz)")
    p.add_argument("--kn", action="append", default=[], metavar="NAME=PPL", help="a given KN perplexity")
    p.add_argument("--work", type=Path, default=Path("runs/targets"), help="texts, models and logs go here")
    p.add_argument("--valid", type=Path, default=DEV, help="validation text for the schedule (default: the dev text)")
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
    p.add_argument("--json", type=Path, help="also write the run (machine, command, rows) as JSON here")
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
    given: dict[str, float] = {}
    for item in args.kn:
        name, _, value = item.partition("=")
        try:
            given[name] = float(value)
        except ValueError:
            p.error(f"--kn expects NAME=PPL, got {item!r}")
    names = args.only.split(",") if args.only else [t.name for t in TARGETS]
    unknown = set(names) - {t.name for t in TARGETS}
    if unknown:
        p.error(f"unknown targets: {sorted(unknown)}")
    if not TRAIN.exists() or not DEV.exists():
        print(f"bench/targets.py: error: the shared Europarl is missing ({TRAIN}, {DEV})", file=sys.stderr)
        return 2
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    query = args.query or (args.lmplz.parent / "query" if args.lmplz else None)
    rows: list[Row] = []
    started = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(["bench/targets.py", *(argv if argv is not None else sys.argv[1:])])}
    for t in TARGETS:
        if t.name not in names:
            continue
        if t.name in given:
            kn, source = given[t.name], "given"
        elif args.lmplz is not None and query is not None:
            kn_text = head_lines(TRAIN, t.lines, work / f"train.{t.lines or 'full'}.txt")
            kn_dev = DEV
            if t.min_count > 1:
                kn_text, kn_dev = map_rare(kn_text, DEV, t.min_count, work)
            kn, source = kenlm_perplexity(args.lmplz, query, kn_text, kn_dev, work), "lmplz"
        else:
            kn, source = t.kn, "typed in"
        row = Row(t, t.minutes * args.scale, kn, source)
        run_target(row, args, work)
        log.info("%s: ppl %.2f against KN %.2f", t.name, row.ppl or float("nan"), kn)
        rows.append(row)
    table = format_table(rows, args.scale)
    print(table)
    if args.json:
        write_json(args.json, {**started, "rows": [dataclasses.asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
