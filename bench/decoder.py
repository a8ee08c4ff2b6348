"""The neural LM inside the Moses decoder: decoding time with ``NeuralLMServer`` against
KENLM alone, on a real system, measured side by side in one run.

    .venv/bin/python -m bench.decoder --moses /path/to/bin/moses \
        --ini ../shared/data/moses-fr-en/moses.ini --kenlm europarl.lc-moses.5gram.trie.bin \
        --model nlm.model --input ../shared/data/nbest/newstest-fr-en/newstest2013.src \
        --lines 500 --threads 2 --rounds 2 --json bench-decoder.json

Every configuration decodes the same first ``--lines`` sentences with ``moses -threads T``;
the rounds are interleaved (KENLM alone, then each feature configuration, then again), so a
change of the machine's load hits them alike. One ``nlmserve serve`` per model runs on
127.0.0.1 for the whole benchmark (``--model``, and any other a configuration names with
``model=PATH``), and the feature line added to the ini is

    NeuralLMServer name=NLM0 factor=0 order=ORDER path=127.0.0.1:PORT <configuration's options>

with the weight ``--nlm-weight`` (the KENLM weights stay as the ini has them). A
configuration's ``moses=PATH`` decodes it with another binary: two builds of the feature
side by side, e.g.

    --configs kenlm local:normalized=false,scoring=local \
              local-old:normalized=false,scoring=local,moses=/path/to/old/moses

and ``model=`` two models (with and without direct n-gram features, say). A configuration
with ``tables=FILE`` is server-free: its line has no ``path=``, no server runs for it, and the
decoder maps the file (``nlmserve export-tables``), e.g. one per quantisation:

    --configs kenlm none:normalized=false,tables=m.nlt fp16:normalized=false,tables=m.fp16.nlt \
              int8:normalized=false,tables=m.int8.nlt

Measured per
run: wall time of the decoder process (loading included, and reported on its own: Moses'
"Created input-output object" time, which with the feature's default ``phrase-scores=load``
includes the phrase table's NLM scores), its CPU time (user + system, from wait4), the server's CPU time over the run
(the process tree, so the native front end counts), round trips per sentence (the feature's
``-v 1`` line per sentence), and n-grams sent and the client cache's hit rate (the feature's
closing line). The ratios printed are medians over the rounds against KENLM alone.

Same translations: the 1-best output of each configuration is compared across rounds, and
``--prefetch-check N`` decodes the first N sentences once with every prefetch mode
(stack, hypothesis, false) of each scoring (normalised, self-normalised) and checks that the
outputs are byte-identical within each scoring.

The ini is rewritten into the work folder with absolute table paths; ``LM_PATH`` in it is
replaced by ``--kenlm`` (the shipped system's ini has that placeholder). A ``scoring=local``
configuration with a ``--model`` that has no scoring tables (one trained with MLE, say) is
refused before the first round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import _common
from bench._common import exit_with, machine, tree_cpu_seconds, write_json

from nlmserve.common.serve_process import ServerProcess, start_server
from nlmserve.moses_plugin.moses_ini import line_of, rewrite_ini, weight_line  # noqa: F401  (the ini rules' owner)
from nlmserve.pipeline.moses_experiment import run_watched

#: Configurations measured by default: name, then the feature's options (None: KENLM alone).
DEFAULT_CONFIGS = ["kenlm", "exact:normalized=true", "selfnorm:normalized=false",
                   "local:normalized=false,scoring=local"]
PREFETCH_MODES = ["stack", "hypothesis", "false"]
#: Targets: wall time with the feature against KENLM alone, by the scores it decodes with:
#: exact (normalized=true, the feature's default, from the server or a tree model's
#: tables) and self-normalised (normalized=false); self-normalised and mapped from a tables
#: file (tables=FILE, no server: the decoder's KenLM-like form), the tighter one.
TARGETS = {"exact": 2.0, "self-normalised": 1.5, "mapped": 1.2}


def exact_config(options: dict[str, str] | None) -> bool:
    """A feature configuration that decodes with exact scores (the feature's default
    normalized=true; with scoring=local, the tables of a tree-output model)."""
    return options is not None and options.get("normalized") != "false"


def target_of(options: dict[str, str]) -> float:
    """The target of a feature configuration (its options)."""
    if exact_config(options):
        return TARGETS["exact"]
    return TARGETS["self-normalised" if served(options) else "mapped"]


def set_target(row: dict[str, Any]) -> None:
    """A summary row of a feature configuration gets its target and whether it met it."""
    if row.get("options") is not None and row.get("wall_ratio") is not None:
        row["target"] = target_of(row["options"])
        row["met"] = row["wall_ratio"] <= row["target"]

_SENTENCE = re.compile(r"NeuralLMServer \S+: sentence \d+ took (\d+) round trips")
_CLOSING = re.compile(r"(\d+) n-grams sent, (\d+) cache hits, (\d+) misses")
_LOCAL = re.compile(r"(\d+) n-grams scored locally"
                    r"(?: \((?:(\d+) remembered, )?(\d+) position rows summed(?:, (\d+) tree nodes computed)?\))?")
_LOADED = re.compile(r"Created input-output object : \[([\d.]+)\] seconds")


#: Keys of a configuration that are the benchmark's, not the feature's moses.ini options.
BENCH_KEYS = ("model", "moses")


@dataclass
class Config:
    name: str
    options: dict[str, str] | None  # None: KENLM alone
    model: str | None = None  # None: --model
    moses: str | None = None  # None: --moses
    text: str = ""  # as given to --configs

    @classmethod
    def parse(cls, text: str) -> "Config":
        """``kenlm`` or ``NAME:key=value,key=value``: the feature's moses.ini options (an
        ``order=`` there replaces ``--order``), and ``model=PATH`` (served by a server of its
        own) or ``moses=PATH`` (another decoder binary) for this configuration alone."""
        name, _, rest = text.partition(":")
        options: dict[str, str] = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"--configs: {item!r} in {text!r} is not key=value")
            options[key] = value
        model, moses = options.pop("model", None), options.pop("moses", None)
        if name == "kenlm":
            if model is not None or options:
                raise SystemExit(f"--configs {text!r}: KENLM alone takes no feature options or model")
            return cls("kenlm", None, moses=moses, text=text)
        return cls(name, options, model, moses, text)


@dataclass
class Run:
    config: str
    round: int
    lines: int
    wall_s: float
    decoder_cpu_s: float
    server_cpu_s: float
    round_trips: int | None = None
    ngrams_sent: int | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    output_sha: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    ngrams_local: int | None = None
    rows_summed: int | None = None  # scoring=local: position rows summed for the contexts
    nodes_computed: int | None = None  # scoring=local with a tree: node dot products computed
    rows_remembered: int | None = None  # scoring=local: scores the tables kept (every output)
    load_s: float | None = None


def feature_line(options: dict[str, str], target: str | None, order: int) -> str:
    """The ``NeuralLMServer`` line of a configuration: its options after the server's
    address (none for a server-free configuration, ``tables=FILE``); an ``order=`` among them
    replaces ``order``. Written by moses_ini.line_of, the one writer of the line."""
    where = {"path": target} if target is not None else {}
    return line_of({"name": "NLM0", "factor": "0", "order": options.get("order", str(order)), **where,
                    **{k: v for k, v in options.items() if k != "order"}})


def served(options: dict[str, str] | None) -> bool:
    """A feature configuration that asks a server: every one but the server-free ``tables=FILE``
    without ``path=`` (the decoder maps the file; no server runs for it)."""
    return options is not None and "tables" not in options


def write_head(source: Path, n: int, out: Path) -> list[str]:
    """The first ``n`` lines of ``source`` (the sentences every run decodes), written to ``out``."""
    with open(source, encoding="utf-8") as f:
        chosen = [line for _, line in zip(range(n), f)]
    out.write_text("".join(chosen), encoding="utf-8")
    return chosen


def decode(moses: str, ini: Path, src: Path, threads: int, out: Path, log: Path) -> tuple[float, float]:
    """Run the decoder (the pipelines' loop, ``run_watched``); returns (wall seconds, CPU
    seconds of the decoder process)."""
    with open(src, "rb") as fin, open(out, "wb") as fout, open(log, "wb") as ferr:
        ran = run_watched([moses, "-f", str(ini), "-threads", str(threads), "-v", "1"], lambda: None,
                          stdin=fin, stdout=fout, stderr=ferr, cwd=ini.parent)
    if ran.code != 0:
        tail = log.read_text(errors="replace").splitlines()[-5:]
        raise SystemExit(f"moses exited with {ran.code} ({ini}); last lines of {log}:\n" + "\n".join(tail))
    return ran.wall, ran.cpu


def feature_counts(log: Path) -> dict[str, int | None]:
    trips: list[int] = []
    closing: tuple[int, int, int] | None = None
    local: int | None = None
    summed: int | None = None
    nodes: int | None = None
    remembered: int | None = None
    for line in log.read_text(errors="replace").splitlines():
        lo = _LOCAL.search(line)
        if lo:
            local = int(lo.group(1))
            remembered = int(lo.group(2)) if lo.group(2) else None
            summed = int(lo.group(3)) if lo.group(3) else None
            nodes = int(lo.group(4)) if lo.group(4) else None
        m = _SENTENCE.search(line)
        if m:
            trips.append(int(m.group(1)))
        c = _CLOSING.search(line)
        if c:
            closing = (int(c.group(1)), int(c.group(2)), int(c.group(3)))
    return {"round_trips": sum(trips) if trips else None,
            "ngrams_sent": closing[0] if closing else None,
            "cache_hits": closing[1] if closing else None,
            "cache_misses": closing[2] if closing else None,
            "ngrams_local": local, "rows_summed": summed, "nodes_computed": nodes,
            "rows_remembered": remembered}


def load_seconds(log: Path) -> float | None:
    """Moses' loading time (its ``-v 1`` line "Created input-output object : [S] seconds"):
    the tables, the features and, with ``phrase-scores=load``, the phrase scores."""
    for line in log.read_text(errors="replace").splitlines():
        m = _LOADED.search(line)
        if m:
            return float(m.group(1))
    return None


def nbest_check(moses: str, ini: Path, src: Path, threads: int, model: str, work: Path, size: int = 10) -> dict[str, Any]:
    """Decode ``src`` writing a ``size``-best list, and compare each hypothesis' NLM0 with the
    model's own score of its words: Moses converts each token's log10 score to ln and floors it
    at -100 (TransformLMScore, FloorScore), then sums the tokens and ``</s>``."""
    import math

    from nlmserve.lm.scoring import LanguageModel

    nbest = work / "nbest-check.txt"
    with open(src, "rb") as fin, open(work / "nbest-check.out", "wb") as fout, \
            open(work / "nbest-check.log", "wb") as ferr:
        r = subprocess.run([moses, "-f", str(ini), "-threads", str(threads), "-n-best-list", str(nbest), str(size)],
                           stdin=fin, stdout=fout, stderr=ferr, cwd=ini.parent)
    if r.returncode != 0:
        raise SystemExit(f"n-best check: moses exited with {r.returncode} (see {work / 'nbest-check.log'})")
    lm = LanguageModel.load(model)
    hyps, values = [], []
    for line in nbest.read_text(encoding="utf-8").splitlines():
        fields = line.split(" ||| ")
        scores = fields[2].split()
        values.append(float(scores[scores.index("NLM0=") + 1]))
        hyps.append(fields[1].split())
    ln10 = math.log(10.0)
    diffs = []
    for words, value, scored in zip(hyps, values, lm.score_sentences(hyps, log10=True)):
        want = sum(max(ln10 * float(x), -100.0) for x in scored.token_log_probs)
        diffs.append(abs(want - value))
    return {"hypotheses": len(hyps), "max_abs_diff": round(max(diffs), 6) if diffs else None,
            "mean_abs_diff": round(sum(diffs) / len(diffs), 6) if diffs else None}


def read_journal(path: Path) -> dict[str, Run]:
    """The runs a --workdir's runs.jsonl recorded, by their key (the last of each key); a
    line cut short by a crash is skipped."""
    kept: dict[str, Run] = {}
    if not path.exists():
        return kept
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            kept[record["key"]] = Run(**record["run"])
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def commit() -> str | None:
    """The checkout's commit (the code measured), when this is a git checkout."""
    r = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def summarise(runs: list[Run], configs: list[Config]) -> list[dict[str, Any]]:
    by = {c.name: [r for r in runs if r.config == c.name] for c in configs}
    base = statistics.median(r.wall_s for r in by["kenlm"]) if by.get("kenlm") else None
    base_cpu = statistics.median(r.decoder_cpu_s + r.server_cpu_s for r in by["kenlm"]) if by.get("kenlm") else None
    rows = []
    for c in configs:
        rs = by[c.name]
        if not rs:
            continue
        wall = statistics.median(r.wall_s for r in rs)
        cpu = statistics.median(r.decoder_cpu_s + r.server_cpu_s for r in rs)
        lines = rs[0].lines
        row: dict[str, Any] = {
            "config": c.name, "options": c.options, "walls_s": [round(r.wall_s, 2) for r in rs],
            "wall_s": round(wall, 2), "wall_ratio": round(wall / base, 2) if base else None,
            "load_s": (round(statistics.median(r.load_s for r in rs if r.load_s is not None), 1)
                       if any(r.load_s is not None for r in rs) else None),
            "decoder_cpu_s": round(statistics.median(r.decoder_cpu_s for r in rs), 2),
            "server_cpu_s": round(statistics.median(r.server_cpu_s for r in rs), 2),
            "cpu_ratio": round(cpu / base_cpu, 2) if base_cpu else None,
            "same_output_every_round": len({r.output_sha for r in rs}) == 1,
        }
        for key in BENCH_KEYS:
            if getattr(c, key) is not None:
                row[key] = getattr(c, key)
        trips = [r.round_trips for r in rs if r.round_trips is not None]
        sent = [r.ngrams_sent for r in rs if r.ngrams_sent is not None]
        hits = [(r.cache_hits, r.cache_misses) for r in rs if r.cache_hits is not None and r.cache_misses is not None]
        if trips:
            row["round_trips_per_sentence"] = round(statistics.median(trips) / lines, 1)
        if sent:
            row["ngrams_sent_per_sentence"] = round(statistics.median(sent) / lines)
        local = [r.ngrams_local for r in rs if r.ngrams_local is not None]
        if local:
            row["ngrams_local_per_sentence"] = round(statistics.median(local) / lines)
        summed = [r.rows_summed / r.ngrams_local for r in rs if r.rows_summed is not None and r.ngrams_local]
        if summed:
            row["rows_summed_per_ngram"] = round(statistics.median(summed), 3)
        nodes = [r.nodes_computed / r.ngrams_local for r in rs if r.nodes_computed is not None and r.ngrams_local]
        if nodes:
            row["nodes_per_ngram"] = round(statistics.median(nodes), 2)
        kept = [r.rows_remembered / r.ngrams_local for r in rs if r.rows_remembered is not None and r.ngrams_local]
        if kept:
            row["remembered_share"] = round(statistics.median(kept), 3)
        first = {r.config: r.output_sha for r in runs if r.round == 0}
        if c.options is not None:
            row["same_output_as"] = sorted(name for name, sha_ in first.items()
                                           if name != c.name and sha_ == first.get(c.name))
        if hits and hits[0][0] + hits[0][1]:
            h, m = hits[0]
            row["cache_hit_rate"] = round(h / (h + m), 4) if h + m else None
            row["lookups_per_sentence"] = round((h + m) / lines)
        set_target(row)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| configuration | wall s (rounds) | median | × KENLM wall | loading s | decoder CPU s | server CPU s | "
           "× KENLM CPU | round trips / sent. | n-grams sent / sent. | cache hit rate | "
           "n-grams scored in the decoder / sent. | target |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        opts = "KENLM alone" if r["options"] is None else ("+ NLM0 " + " ".join(
            f"`{k}={Path(v).name if k == 'tables' else v}`" for k, v in r["options"].items()))
        opts += "".join(f" ({key} `{shown(r[key])}`)" for key in BENCH_KEYS if r.get(key))
        target = "" if "target" not in r else f"≤ {r['target']}×: {'met' if r['met'] else '**not met**'}"
        out.append(f"| {opts} | {', '.join(str(w) for w in r['walls_s'])} | {r['wall_s']} | {r['wall_ratio']} | "
                   f"{'' if r.get('load_s') is None else r['load_s']} | {r['decoder_cpu_s']} | {r['server_cpu_s']} | {r['cpu_ratio']} | "
                   f"{r.get('round_trips_per_sentence', '')} | {r.get('ngrams_sent_per_sentence', '')} | "
                   f"{r.get('cache_hit_rate', '')} | {local_cell(r)} | {target} |")
    return out


def shown(path: str) -> str:
    """A model or Moses binary as the table names it: the file's name, or for a binary inside
    a Moses tree (ROOT/moses-cmd/bin/...), the tree's folder, which tells builds apart."""
    parts = Path(path).parts
    return parts[parts.index("moses-cmd") - 1] if "moses-cmd" in parts[1:] else Path(path).name


def local_cell(row: dict[str, Any]) -> str:
    """The n-grams scored in the decoder per sentence, the share whose score the tables
    remembered, the position rows summed per n-gram for their contexts (order-1 without
    reuse) and, with a tree, the node dot products computed per n-gram, where the feature
    reported them."""
    cell = str(row.get("ngrams_local_per_sentence", ""))
    if row.get("rows_summed_per_ngram") is not None:
        kept = (f"{100 * row['remembered_share']:.1f}% remembered, "
                if row.get("remembered_share") is not None else "")
        nodes = f", {row['nodes_per_ngram']} tree nodes" if row.get("nodes_per_ngram") is not None else ""
        cell += f" ({kept}{row['rows_summed_per_ngram']} position rows summed{nodes} each)"
    return cell


BEGIN, END = _common.markers("decoder.py")


def markers(section: str | None = None) -> tuple[str, str]:
    """The markers of a results section: the main table's, or another run's (``--section``)
    beside it in the same document."""
    return _common.markers("decoder.py", section)


def after_loads(runs: list[dict[str, Any]]) -> str:
    """"; the 1-minute load average after each run: ..." where the runs recorded it."""
    if not any("load_average_1m_after" in r.get("extra", {}) for r in runs):
        return ""
    return "; the 1-minute load average after each run: " + ", ".join(
        f"{r['config']} r{r['round']} {r['extra'].get('load_average_1m_after', '?')}" for r in runs)


def render(result: dict[str, Any]) -> str:
    """The results page's section for one run (the JSON that --json writes)."""
    m = result["machine"]
    begin, end = markers(result.get("section"))
    serve = " ".join(["nlmserve serve --model MODEL", result["serve_args"]]).strip()
    where = (f"the server on the same machine (`{serve}`)" if any(served(r["options"]) for r in result["rows"])
             else "no server (each feature configuration maps its tables file)")
    lines = [begin, "",
             f"{result['lines']} sentences of `{Path(result['input']).name}`, `moses -threads {result['threads']}`, "
             f"{result['rounds']} interleaved rounds, {where}; NLM0 weight {result['nlm_weight']}; "
             f"{_common.machine_line(m)}. "
             "Wall and CPU times include loading (Moses' \"Created input-output object\" time, "
             "column \"loading s\": the tables and, with the feature's default `phrase-scores=load`, "
             "the phrase table's NLM scores)" + after_loads(result.get("runs", [])) + ".",
             "", *table(result["rows"]), ""]
    same = [r["config"] for r in result["rows"] if not r["same_output_every_round"]]
    lines.append("Same translations in every round: " + ("yes, every configuration." if not same else
                 "no for " + ", ".join(same) + "."))
    alike = [f"{r['config']} = {', '.join(r['same_output_as'])}" for r in result["rows"] if r.get("same_output_as")]
    if alike:
        lines.append("Same translations across configurations (first round): " + "; ".join(alike) + ".")
    checks = {k.split("/")[0]: ("identical output" if v else "**outputs differ**") if k.endswith("/identical")
              else f"no answer ({v})"
              for k, v in result.get("prefetch_check", {}).items() if k.endswith(("/identical", "/error"))}
    if checks:
        n = result.get("prefetch_lines", 0)
        lines.append("Prefetch modes (`stack`, `hypothesis`, `false`) on "
                     + ("the first sentence" if n == 1 else f"the first {n} sentences") + ": " + "; ".join(
                         f"{name}: {what}" for name, what in checks.items()) + ".")
    nb = result.get("nbest_check") or {}
    if nb.get("error"):
        lines.append(f"NLM0 in Moses' n-best lists: no answer ({nb['error']}).")
    elif nb:
        of = f" (`{Path(nb['model']).name}`)" if nb.get("model") else ""
        lines.append(f"NLM0{of} in Moses' 10-best lists of the first {nb['lines']} sentences ({nb['hypotheses']} "
                     f"hypotheses, exact scores) against the model's own sentence scores (ln 10 × each token's "
                     f"log10, floored at −100, summed with `</s>`): largest difference {nb['max_abs_diff']}, "
                     f"mean {nb['mean_abs_diff']} (Moses prints six significant digits).")
    at = f" (code at commit {result['commit']})" if result.get("commit") else ""
    lines += ["", f"Command{at}:", "", "    " + _common.shown_command(result["command"]), "", end]
    return "\n".join(lines)


def write_section(doc: Path, text: str, section: str | None = None) -> None:
    """Replace the text between the markers of ``section`` in ``doc`` (atomically)."""
    _common.write_section(doc, *markers(section), text)


DEFAULT_DOC = Path(__file__).resolve().parent.parent / "docs" / "performance-decoder.md"


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--moses", required=True, help="the moses binary built with the feature")
    p.add_argument("--ini", required=True, type=Path, help="moses.ini of the system (KENLM as LM0)")
    p.add_argument("--kenlm", help="KenLM file put in place of LM_PATH in the ini")
    p.add_argument("--model", help="nlmserve model file to serve (or --server)")
    p.add_argument("--server", help="use this running server (HOST:PORT) instead of starting one")
    p.add_argument("--serve-args", default="", help="extra arguments of nlmserve serve, e.g. '--frontend native'")
    p.add_argument("--input", required=True, type=Path, help="source sentences, one per line")
    p.add_argument("--lines", type=int, default=500, help="first N sentences decoded")
    p.add_argument("--threads", type=int, default=2, help="moses -threads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--order", type=int, default=5, help="order= of the feature line")
    p.add_argument("--nlm-weight", type=float, default=0.1, help="weight of NLM0")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                   help="'kenlm' or NAME:key=value,... (feature options)")
    p.add_argument("--prefetch-check", type=int, default=0, metavar="N",
                   help="decode the first N sentences with every prefetch mode and compare")
    p.add_argument("--nbest-check", type=int, default=0, metavar="N",
                   help="decode the first N sentences with a 10-best list (exact scores) and compare every "
                        "NLM0 with the model's own sentence score (--model, else the first configuration's "
                        "model=)")
    p.add_argument("--workdir", type=Path, help="keep inis, outputs and logs here (default: a temporary folder); "
                                                "every finished run is recorded in its runs.jsonl")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs that --workdir's runs.jsonl holds for the same configuration, round, "
                        "sentences, binaries and system, and measure only the others")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="only write the section of --doc from a JSON file of an earlier run")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC,
                   help="page whose bench/decoder.py section --render replaces")
    p.add_argument("--section", help="name of this run's section in --doc (its markers are "
                                     "'<!-- bench/decoder.py NAME: begin -->' and '... end -->'; default: the main "
                                     "table); with --render, the section to write the JSON's run into")
    return p


def render_only(argv: list[str] | None) -> bool:
    """``--render JSON``: no decoding, the section of --doc from an earlier run's JSON (read
    before the full command line, whose required arguments it does not need). True when it
    was given and the section is written."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--render", type=Path)
    pre.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    pre.add_argument("--section")
    only, _ = pre.parse_known_args(argv)
    if only.render is None:
        return False
    result = json.loads(only.render.read_text())
    result["section"] = only.section or result.get("section")
    for row in result["rows"]:  # the targets as TARGETS states them now
        set_target(row)
    write_section(only.doc, render(result), result["section"])
    return True


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace,
                    configs: list[Config]) -> tuple[Config | None, str | None]:
    """Refuse what cannot run (through ``p.error``), before the first round; returns the
    configuration the n-best check decodes with and the model file it compares with."""
    if args.model is not None and args.server is not None:
        p.error("give --model or --server, not both")
    if args.server is not None and any(c.model for c in configs):
        p.error("a configuration's model= needs a server of its own: leave out --server")
    if args.model is None and args.server is None and any(served(c.options) and c.model is None for c in configs):
        p.error("give --model or --server (or model= in every feature configuration)")
    # The n-best check compares with the model file's own scores: --model's, else the first
    # configuration's model=.
    checked = next((c for c in configs if c.options is not None and (c.model or args.model)), None)
    check_model = checked.model or args.model if checked else None
    if args.nbest_check and check_model is None:
        p.error("--nbest-check compares with the model file's own scores: give --model or a configuration's model=")
    if args.resume and args.workdir is None:
        p.error("--resume needs the --workdir of the run to resume")
    for binary in {args.moses, *(c.moses for c in configs if c.moses)}:
        if shutil.which(binary) is None and not Path(binary).is_file():
            p.error(f"moses binary {binary}: not found")
    local: dict[str, list[str]] = {}
    for c in configs:
        if served(c.options) and c.options.get("scoring") == "local" and (c.model or args.model):
            local.setdefault(c.model or args.model, []).append(c.name)
    for model, names in local.items():
        _common.require_scoring_tables(model, f"--configs {' '.join(names)}")
    return checked, check_model


@dataclass
class Bench:
    """One benchmark's work folder, its sentences and its servers (model path -> server)."""

    args: argparse.Namespace
    work: Path
    chosen: list[str]  # the sentences every run decodes
    servers: dict[str, ServerProcess] = field(default_factory=dict)

    @classmethod
    def prepare(cls, args: argparse.Namespace) -> "Bench":
        """The work folder (--workdir, else a temporary one) with the first --lines sentences."""
        work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-decoder-"))
        work.mkdir(parents=True, exist_ok=True)
        return cls(args, work, write_head(args.input, args.lines, work / "input.txt"))

    @property
    def src(self) -> Path:
        return self.work / "input.txt"

    @property
    def lines(self) -> int:
        return len(self.chosen)

    @property
    def journal(self) -> Path:
        return self.work / "runs.jsonl"

    def start_servers(self, configs: list[Config]) -> None:
        """One ``nlmserve serve`` per model the feature configurations name."""
        for model in dict.fromkeys(c.model or self.args.model for c in configs if served(c.options)):
            if model is not None:
                self.servers[model] = start_server(Path(model), self.args.serve_args.split())

    def stop_servers(self) -> None:
        for server in self.servers.values():
            server.stop()

    def head(self, name: str, n: int) -> Path:
        """The first ``n`` sentences, written to ``name`` in the work folder."""
        path = self.work / name
        path.write_text("".join(self.chosen[:n]), encoding="utf-8")
        return path

    def run_key(self, c: Config, rnd: int) -> str:
        """What a recorded run must share with this one to be kept by --resume."""
        args = self.args
        return json.dumps({"config": c.text, "round": rnd, "lines": self.lines, "input": str(args.input),
                           "moses": c.moses or args.moses, "model": c.model or args.model, "ini": str(args.ini),
                           "kenlm": args.kenlm, "order": args.order, "nlm_weight": args.nlm_weight,
                           "threads": args.threads, "serve_args": args.serve_args}, sort_keys=True)

    def ini_for(self, name: str, options: dict[str, str] | None, model: str | None = None) -> Path:
        """The system's ini rewritten into the work folder, with the feature's line when
        ``options`` is given (served by the server of ``model``, else of --model, else --server)."""
        args = self.args
        path = self.work / f"{name}.ini"
        feature = None
        if options is not None and not served(options):  # the file's path as the decoder's folder sees it
            feature = feature_line({**options, "tables": str(Path(options["tables"]).resolve())}, None, args.order)
        elif options is not None:
            target = self.servers[model or args.model].target if (model or args.model) else args.server
            feature = feature_line(options, target, args.order)
        rewrite_ini(args.ini, args.kenlm, path, feature, args.nlm_weight)
        return path

    def measure(self, c: Config, options: dict[str, str] | None, rnd: int, source: Path, n: int,
                name: str | None = None) -> Run:
        """Decode ``source`` (``n`` sentences) once with ``c``'s decoder and ``options``."""
        args = self.args
        name = name or c.name
        ini = self.ini_for(name, options, c.model)
        out, log = self.work / f"{name}.r{rnd}.out", self.work / f"{name}.r{rnd}.log"
        server = self.servers.get(c.model or args.model or "") if served(options) else None
        before = tree_cpu_seconds(server.process.pid) if server else 0.0
        wall, cpu = decode(c.moses or args.moses, ini, source, args.threads, out, log)
        after = tree_cpu_seconds(server.process.pid) if server else 0.0
        run = Run(name, rnd, n, wall, cpu, after - before, output_sha=sha(out), **feature_counts(log),
                  load_s=load_seconds(log),
                  extra={"load_average_1m_after": round(os.getloadavg()[0], 2)})
        print(f"round {rnd} {name}: {wall:.1f} s wall, decoder {cpu:.1f} s CPU, server {after - before:.1f} s CPU",
              flush=True)
        return run


def run_rounds(bench: Bench, configs: list[Config], kept: dict[str, Run]) -> list[Run]:
    """The interleaved rounds (every configuration in turn, --rounds times); a run --resume
    kept is not measured again, and every measured one is recorded in the journal."""
    runs: list[Run] = []
    for rnd in range(bench.args.rounds):
        for c in configs:
            key = bench.run_key(c, rnd)
            if key in kept:
                runs.append(kept[key])
                print(f"round {rnd} {c.name}: kept from {bench.journal}", flush=True)
                continue
            run = bench.measure(c, c.options, rnd, bench.src, bench.lines)
            with open(bench.journal, "a", encoding="utf-8") as f:  # one line per finished run
                f.write(json.dumps({"key": key, "run": asdict(run)}) + "\n")
            runs.append(run)
    return runs


def prefetch_check(bench: Bench, configs: list[Config]) -> dict[str, Any]:
    """--prefetch-check N: the first N sentences once with every prefetch mode of each feature
    configuration; whether the outputs are identical, or why the check has no answer."""
    n = bench.args.prefetch_check
    head = bench.head("prefetch-input.txt", n)
    prefetch: dict[str, Any] = {}
    for c in configs:
        if c.options is None:
            continue
        shas = {}
        try:
            for mode in PREFETCH_MODES:
                opts = {**c.options, "prefetch": mode}
                r = bench.measure(c, opts, 0, head, n, name=f"{c.name}-prefetch-{mode}")
                shas[mode] = r.output_sha
                prefetch[f"{c.name}/{mode}"] = {"wall_s": round(r.wall_s, 2), "round_trips": r.round_trips}
        except SystemExit as e:  # the measured rounds stay; the check says why it has no answer
            prefetch[f"{c.name}/error"] = str(e)
            print(f"prefetch check {c.name}: {e}", file=sys.stderr)
            continue
        prefetch[f"{c.name}/identical"] = len(set(shas.values())) == 1
    return prefetch


def run_nbest_check(bench: Bench, checked: Config, check_model: str) -> dict[str, Any]:
    """--nbest-check N: the first N sentences with a 10-best list, exact scores, every NLM0
    against ``check_model``'s own sentence scores (nbest_check), or why there is no answer."""
    n = bench.args.nbest_check
    head = bench.head("nbest-input.txt", n)
    # exact scores, at the order the checked configuration decodes with, and computed
    # where it computes them when they are exact there (a tree model's scoring=local)
    exact = {"normalized": "true", **{k: v for k, v in (checked.options or {}).items()
                                      if k == "order" or (k == "scoring" and exact_config(checked.options))}}
    nbest: dict[str, Any]
    try:
        nbest = nbest_check(checked.moses or bench.args.moses, bench.ini_for("nbest", exact, check_model), head,
                            bench.args.threads, check_model, bench.work)
    except SystemExit as e:
        nbest = {"error": str(e)}
        print(f"n-best check: {e}", file=sys.stderr)
    nbest["lines"] = n
    nbest["model"] = check_model
    return nbest


def print_summary(args: argparse.Namespace, lines: int, info: dict[str, Any], rows: list[dict[str, Any]],
                  prefetch: dict[str, Any], nbest: dict[str, Any]) -> None:
    """The run's table and checks on the terminal."""
    print()
    print(f"{lines} sentences of {args.input.name}, moses -threads {args.threads}, {args.rounds} interleaved rounds; "
          f"machine: {info['cpu']}, {info['cores']} cores, load {info['load_average_1m']} at start")
    print("\n".join(table(rows)))
    for key, value in prefetch.items():
        print(f"prefetch check {key}: {value}")
    if nbest:
        print(f"n-best check: {nbest}")


def result_of(args: argparse.Namespace, lines: int, info: dict[str, Any], rows: list[dict[str, Any]],
              prefetch: dict[str, Any], nbest: dict[str, Any], runs: list[Run]) -> dict[str, Any]:
    """What --json writes (and --render reads back)."""
    return {"machine": info, "lines": lines, "input": str(args.input), "threads": args.threads,
            "rounds": args.rounds, "nlm_weight": args.nlm_weight, "prefetch_lines": args.prefetch_check,
            "serve_args": args.serve_args, "model": args.model, "rows": rows, "prefetch_check": prefetch,
            "nbest_check": nbest, "runs": [asdict(r) for r in runs], "command": " ".join(sys.argv),
            "commit": commit(), "section": args.section}


def main(argv: list[str] | None = None) -> int:
    if render_only(argv):
        return 0
    p = parser()
    args = p.parse_args(argv)
    configs = [Config.parse(c) for c in args.configs]
    checked, check_model = check_arguments(p, args, configs)
    bench = Bench.prepare(args)
    kept = read_journal(bench.journal) if args.resume else {}
    info = machine()
    try:
        bench.start_servers(configs)
        runs = run_rounds(bench, configs, kept)
        rows = summarise(runs, configs)
        prefetch = prefetch_check(bench, configs) if args.prefetch_check else {}
        nbest: dict[str, Any] = {}
        if args.nbest_check and checked is not None and check_model is not None:
            nbest = run_nbest_check(bench, checked, check_model)
    finally:
        bench.stop_servers()
    print_summary(args, bench.lines, info, rows, prefetch, nbest)
    if args.json:
        write_json(args.json, result_of(args, bench.lines, info, rows, prefetch, nbest, runs))
    return 0


if __name__ == "__main__":
    exit_with(main)
