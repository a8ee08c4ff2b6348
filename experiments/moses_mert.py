"""MERT (or batch MIRA) with the neural LM inside Moses: Moses' own mert-moses.pl tunes each
system on a dev subset, the tuned moses.ini decodes the test set, and ``nlmserve bleu``
scores it against KENLM alone tuned the same way.

    .venv/bin/python -m experiments.moses_mert --moses-root $MOSES --moses $MOSES/bin/moses \
        --ini ../shared/data/moses-fr-en/moses.ini --kenlm europarl.lc-moses.5gram.trie.bin \
        --dev-src ../shared/data/nbest/newstest-fr-en/newstest2012.src \
        --dev-ref ../shared/data/nbest/newstest-fr-en/newstest2012.ref --dev-every 3 \
        --test-src ../shared/data/nbest/newstest-fr-en/newstest2013.src \
        --test-ref ../shared/data/nbest/newstest-fr-en/newstest2013.ref \
        --system kenlm --system europarl=ep.nlm --system news=ep-news.nlm \
        --seeds 1 2 --workdir runs/moses-mert --json runs/moses-mert/results.json

Each ``--system NAME[=MODEL[,key=value...]]`` is KENLM alone (no model) or KENLM plus
``NeuralLMServer name=NLM0`` asking an ``nlmserve serve`` of MODEL (one server per model, on
127.0.0.1, shared by all seeds; the options after the model are the feature's moses.ini
options, e.g. ``normalized=false``; an ``order=`` there overrides ``--order``; a ``moses=PATH``
there tunes and decodes this system with another Moses binary than ``--moses``, e.g. another
build of the feature). Every system
is tuned once per seed (mert's ``-r SEED``, or kbmira's ``--random-seed SEED`` with
``--tuner mira``), starting from the ini's weights and ``--nlm-weight`` for NLM0. A system
with ``scoring=local`` whose model has no scoring tables is refused before any tuning.

Resumable: a tuning with a finished iteration is continued with mert-moses.pl's
``--continue`` (one stopped inside its first iteration starts again); a finished tuning
(its ``moses.ini`` written) and a finished test decoding (as many lines as the input) are
kept. A workdir holds one tuner's runs: MERT's are refused
to ``--tuner mira`` and the other way round. Results: BLEU of each run, mean ± sd per system, the
difference of the means from the first system, and a paired bootstrap p-value over the runs
joined (run r against run r of the first system), with sacrebleu's signature; the wall time
of each tuning, its iterations and the mean time per iteration (from the n-best lists'
modification times). ``mertdir`` must hold Moses' ``extractor``, ``mert``, ``kbmira``, ``pro``
and ``evaluator`` (built in their bjam folders; ``--mertdir`` finds them under
``--moses-root`` when not given).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _common
from bench._common import machine, write_json
from bench.decoder import feature_line

from nlmserve.common.serve_process import ServerProcess, start_server
from nlmserve.moses_plugin.bleu import BleuConfig, read_references
from nlmserve.moses_plugin.rerank import search_check
from nlmserve.moses_plugin.weights import load_weights
from nlmserve.pipeline import moses_experiment
from nlmserve.pipeline.moses_experiment import (Outputs, bleu_row, compare, count_lines, find_mertdir, retarget,
                                                write_sets)


@dataclass
class System:
    name: str
    model: str | None
    options: dict[str, str]
    moses: str | None = None  # another decoder binary than --moses for this system

    @classmethod
    def parse(cls, text: str) -> "System":
        name, _, rest = text.partition("=")
        if not rest:
            return cls(name, None, {})
        model, *opts = rest.split(",")
        options = {}
        for o in opts:
            k, sep, v = o.partition("=")
            if not sep:
                raise SystemExit(f"--system {text}: {o!r} is not key=value")
            options[k] = v
        return cls(name, model, options, options.pop("moses", None))


def check_local_scoring(systems: list[System]) -> None:
    """Refuse, before any tuning starts, a system with ``scoring=local`` whose model has no
    scoring tables (the decoder would fail at load, after the systems before it had tuned)."""
    for system in systems:
        if system.model is not None and system.options.get("scoring") == "local":
            _common.require_scoring_tables(system.model, f"--system {system.name}")


def tune(args: argparse.Namespace, system: System, seed: int, target: str | None, mertdir: Path,
         dev_src: Path, dev_ref: Path, base: Path) -> dict[str, Any]:
    """One tuning (nlmserve.pipeline.moses_experiment.tune) of ``system``, and the search
    errors of its last iteration."""
    feature = None if system.model is None else feature_line(system.options, str(target), args.order)
    record = moses_experiment.tune(args, feature, system.moses or args.moses, seed, mertdir, dev_src, dev_ref, base,
                                   system.name)
    work = base / "tune"
    nbests = sorted(work.glob("run*.best*.out.gz"), key=lambda p: p.stat().st_mtime)
    # The last iteration's 1-best against every hypothesis of the tuning's lists, under the
    # weights that iteration decoded with (runK.moses.ini beside runK.best*.out.gz).
    last = nbests[-1]
    check = search_check(str(last), [str(p) for p in nbests[:-1]],
                         load_weights(work / f"{last.name.split('.')[0]}.moses.ini"))
    return {**record, "search_errors": round(check.share, 4), "search_error_gap": round(check.mean_gap, 3)}


def finished(base: Path, n_test: int) -> bool:
    """Whether the tuning in ``base`` (one system, one seed) is done and its test set decoded."""
    return (base / "tune" / "moses.ini").exists() and count_lines(base / "test.out") == n_test


def export_ini(tuned: Path, out: Path, system_dir: Path, kenlm: str | None) -> None:
    """A tuned moses.ini as a reader can use it: the system's table folder written
    ``MOSES_FR_EN``, the KenLM file ``LM_PATH`` (as in the shipped ini), and the feature's
    server ``127.0.0.1:50051``; the weights as tuned."""
    text = tuned.read_text(encoding="utf-8").replace(str(system_dir.resolve()), "MOSES_FR_EN")
    if kenlm:
        text = text.replace(str(Path(kenlm).resolve()), "LM_PATH").replace(kenlm, "LM_PATH")
    text = re.sub(r"(NeuralLMServer [^\n]*path=)\S+", r"\g<1>127.0.0.1:50051", text)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)


BEGIN, END = _common.markers("moses_mert.py", room="experiments")


def markers(tuner: str, section: str | None = None) -> tuple[str, str]:
    """The markers of a results section: MERT's main table, batch MIRA's (``--tuner mira``)
    beside it, or a run's own ``--section``."""
    return _common.markers("moses_mert.py", section or (None if tuner == "mert" else f"--tuner {tuner}"), room="experiments")


def _percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def render(result: dict[str, Any]) -> str:
    """The results section (between its tuner's markers) for ``result`` (the --json output)."""
    m = result["machine"]
    begin, end = markers(result["tuner"], result.get("section"))
    at_most = f", at most {result['max_iterations']} iterations" if result.get("max_iterations") else ""
    rows = ["| system | NLM0 | BLEU per seed | mean ± sd | Δ mean, p | iterations | s / iteration | "
            "tuning wall s | test decoding s | search errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    seeds = result["seeds"]
    for r in result["rows"]:
        ran = r.get("seeds", seeds)

        def per_seed(values: list[str]) -> str:
            """One value per seed of the table, — for a seed this row has not finished."""
            return ", ".join(values[ran.index(s)] if s in ran else "—" for s in seeds)

        nlm = "—" if r["model"] is None else (f"`{Path(r['model']).name}` "
                                             + " ".join(f"`{k}={v}`" for k, v in r["options"].items())).strip()
        if r.get("moses"):
            nlm += f" (decoder `{r['moses']}`)"
        sd = "" if r["sd"] is None else f" ± {r['sd']:.2f}"
        delta = "" if "delta" not in r else f"{r['delta']:+.2f}, p {r['p']:.3f}"
        runs = r["runs"]
        rows.append(f"| {r['system']} | {nlm} | {per_seed([f'{b:.2f}' for b in r['bleu']])} | {r['mean']:.2f}{sd} | "
                    f"{delta} | {per_seed([str(x['iterations']) for x in runs])} | "
                    f"{per_seed([str(x['seconds_per_iteration']) for x in runs])} | "
                    f"{per_seed([str(x['tuning_wall_s']) for x in runs])} | "
                    f"{per_seed([str(x['test_decode_s']) for x in runs])} | "
                    f"{per_seed([_percent(x.get('search_errors')) for x in runs])} |")
    inis = [x["exported_ini"] for r in result["rows"] for x in r["runs"] if x.get("exported_ini")]
    # A table made by --finished-only ran no tuning: the load then says nothing about the times.
    load = (f"load average {m['load_average_1m']} at the start" if not result.get("finished_only")
            else "the tunings' times are upper bounds (other work may have run beside them)")
    lines = [begin, "",
             f"Moses' `mert-moses.pl` ({result['tuner']}{at_most}), {result['dev_lines']} dev sentences (every third "
             f"of newstest2012), then all {result['test_lines']} sentences of newstest2013 decoded with each tuned "
             f"moses.ini; seeds {', '.join(str(x) for x in result['seeds'])}; {m['cpu']}, {m['cores']} cores, "
             f"{load}. Δ: the mean's difference from the first row, "
             "p: paired bootstrap over the seeds' outputs joined (the seeds both rows have; —: not finished). Search errors: dev sentences whose 1-best in "
             "the last iteration scores lower, under that iteration's weights, than a hypothesis of one of the "
             "tuning's n-best lists.", "", *rows, "",
             f"BLEU: `{result['rows'][0]['signature']}`."]
    if inis:
        lines.append("Tuned weights: " + ", ".join(f"[{Path(i).name}]({i})" for i in inis) + ".")
    lines += ["", "Command:", "", "    " + _common.shown_command(result["command"]), "", end]
    return "\n".join(lines)


def write_section(doc: Path, text: str, tuner: str = "mert", section: str | None = None) -> None:
    """Replace the text between the markers of ``tuner``'s (or ``section``'s) section in
    ``doc`` (atomically)."""
    _common.write_section(doc, *markers(tuner, section), text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--moses-root", required=True, type=Path, help="Moses checkout (scripts/, mert/)")
    p.add_argument("--moses", required=True, help="moses binary built with the feature")
    p.add_argument("--mertdir", type=Path, help="folder with extractor, mert, kbmira, pro, evaluator")
    p.add_argument("--ini", required=True, type=Path)
    p.add_argument("--kenlm", help="KenLM file put in place of LM_PATH in the ini")
    moses_experiment.add_set_arguments(p, dev_every=3)
    p.add_argument("--system", action="append", required=True, help="NAME or NAME=MODEL[,key=value...]")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tuner", choices=["mert", "mira"], default="mert")
    p.add_argument("--max-iterations", type=int, default=25)
    p.add_argument("--nbest", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--order", type=int, default=5,
                   help="NLM0's order= (the model's order) for systems that give no order= of their own")
    p.add_argument("--nlm-weight", type=float, default=0.1, help="starting weight of NLM0")
    p.add_argument("--serve-args", default="", help="extra arguments of nlmserve serve")
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--finished-only", action="store_true",
                   help="tabulate the tunings already finished (tuned and test decoded), start none; "
                        "Δ and p then pair the seeds a system shares with the first row")
    p.add_argument("--json", type=Path)
    p.add_argument("--export-inis", type=Path, metavar="DIR",
                   help="copy each tuned moses.ini here as SYSTEM.seedN.ini, paths as placeholders")
    p.add_argument("--render", type=Path, metavar="JSON", help="only write JSON's section into --doc")
    p.add_argument("--doc", type=Path, help="document with the results section (default: experiments/results.md)")
    p.add_argument("--section", help="name of this run's own section in --doc (markers "
                                     "'<!-- experiments/moses_mert.py NAME: begin -->' and '... end -->'; default: the "
                                     "tuner's table); with --render, the section to write the JSON's run into")
    return p


def main() -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--render", type=Path)
    pre.add_argument("--doc", type=Path, default=Path(__file__).resolve().parent / "results.md")
    pre.add_argument("--section")
    only, _ = pre.parse_known_args()
    if only.render is not None:
        result = json.loads(only.render.read_text())
        result["section"] = only.section or result.get("section")
        write_section(only.doc, render(result), result["tuner"], result["section"])
        return 0
    args = parser().parse_args()
    systems = [System.parse(s) for s in args.system]
    check_local_scoring(systems)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    mertdir = args.mertdir or find_mertdir(args.moses_root, work)
    sets = write_sets(args, work)

    servers: dict[str, ServerProcess] = {}
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    info = machine()
    try:
        for system in systems:
            target = None
            if system.model is not None:
                if system.model not in servers:
                    servers[system.model] = start_server(Path(system.model), args.serve_args.split())
                target = servers[system.model].target
            for seed in args.seeds:
                base = work / system.name / f"seed{seed}"
                if args.finished_only and not finished(base, sets.test_lines):
                    print(f"{system.name} seed {seed}: not finished, left out", flush=True)
                    continue
                base.mkdir(parents=True, exist_ok=True)
                record = tune(args, system, seed, target, mertdir, sets.dev_src, sets.dev_ref, base)
                tuned = Path(record["ini"]) if target is None else retarget(Path(record["ini"]), base, target)
                record["test_decode_s"] = round(moses_experiment.decode_test(system.moses or args.moses, args.threads, tuned,
                                                                             sets.test_src, base / "test.out",
                                                                             sets.test_lines), 1)
                if args.export_inis is not None:
                    exported = args.export_inis / f"{system.name}.seed{seed}.ini"
                    export_ini(Path(record["ini"]), exported, args.ini.parent, args.kenlm)
                    record["exported_ini"] = os.path.relpath(exported, (args.doc or Path(__file__).resolve().parent / "results.md").parent)
                record["seed"] = seed
                record["output"] = str(base / "test.out")
                runs[system.name].append(record)
                print(f"{system.name} seed {seed}: {record}", flush=True)
    finally:
        for s in servers.values():
            s.stop()

    refs = read_references([str(sets.test_ref)])
    config = BleuConfig()
    base_name = systems[0].name
    rows: list[dict[str, Any]] = []
    outputs = Outputs()
    for system in systems:
        if not runs[system.name]:
            continue
        row: dict[str, Any] = {"system": system.name, "model": system.model, "options": system.options,
                               "moses": system.moses, "seeds": [r["seed"] for r in runs[system.name]],
                               **bleu_row(runs[system.name], refs, outputs, config), "runs": runs[system.name]}
        if system.name != base_name and rows and rows[0]["system"] == base_name:
            compare(row, rows[0], refs, outputs, config)
        rows.append(row)
        delta = "" if "delta" not in row else f" Δ {row['delta']:+.2f} p {row['p']}"
        print(f"{system.name}: BLEU {row['bleu']} mean {row['mean']} ± {row['sd']}{delta}", flush=True)
    if args.json:
        result = {"machine": info, "dev_lines": sets.dev_lines, "test_lines": sets.test_lines, "tuner": args.tuner,
                  "max_iterations": args.max_iterations, "seeds": args.seeds, "rows": rows,
                  "command": " ".join(sys.argv), "section": args.section, "finished_only": args.finished_only}
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
