"""A vocabulary of WMT size on the decoder's side: a model of 100,000 words or more beside a
small-vocabulary model of the same shape, in one run. For each form of its tables file
(``export-tables --quantize none|fp16|int8``): the file's size; the seconds until a Moses
decoder's tables are ready; the PSS of N decoders mapping it at once (``tables=FILE`` with no
``path=``: no server anywhere); and the nanoseconds per n-gram of the decoder's own scorer (the
C++ ``nlmserve_tables.h``, driven by bench/cpp/nlmserve_tables_speed.cpp), the small model's
files timed in the same rounds, interleaved.

    python -m bench.vocab_scale --model LARGE.nlm --small SMALL.nlm --text HELD_OUT.txt \\
        [--moses MOSES --ini ../shared/data/moses-fr-en/moses.ini --kenlm KN.bin] [--decoders 4] \\
        [--lines 20] [--rounds 5] [--load-rounds 3] [--work DIR] [--json J] [--doc docs/performance-tables.md]
    python -m bench.vocab_scale --render DOC JSON

The scorer: each file's driver process maps it, looks TEXT's words up in the file's vocabulary,
then scores every n-gram of TEXT one sentence's n-grams a call, 1 + ``--passes`` times, each
pass with a new scratch (nothing remembered across passes): the first pass touches each page
of the tables for the first time in the process, the later ones (their median is the number)
find them mapped. Rounds go small none, small fp16, small int8, large none, ... and again; the
ratio large / small is taken within each round, then its median over the rounds (the machine
is shared: only ratios measured side by side mean anything).

The decoders (with ``--moses``; the helpers of bench/tables_memory.py): for the small model's
float32 file and each of the large model's files, N decoders start at once with the server-free
line, each decodes the same LINES sentences, then its PSS and resident size, and those of its
mapping of the file, are read while it runs. Then one decoder at a time, the files in turn
(``--load-rounds``): the seconds from its start until the feature's "scoring locally" line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._common import exit_with, machine, markers, shown_command, write_json, write_section

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "bench" / "cpp" / "nlmserve_tables_speed.cpp"
SOURCE = REPO.parent / "shared" / "data" / "nbest" / "newstest-fr-en" / "newstest2013.src"
FORMS = ("none", "fp16", "int8")
MODELS = ("small", "large")
CXXFLAGS = ["-O3", "-std=c++11"]
BEGIN, END = markers("vocab_scale.py")


def model_facts(path: Path) -> dict[str, Any]:
    """What the page says of a model: its shape and what its training recorded of its length."""
    from nlmserve.lm.model_file import read_model_header

    head = read_model_header(path)
    c = head.config
    t = head.training
    return {"path": str(path), "bytes": path.stat().st_size, "vocab_size": c.vocab_size, "order": c.order,
            "dim": c.dim, "output": c.output, "objective": head.objective, "lowercase": head.lowercase,
            "num_classes": c.num_classes,
            "ngram_features": bool(c.ngram_class_table or c.ngram_word_table), "hash": head.sha256[:12],
            "training": {k: t[k] for k in ("steps", "tokens_seen", "valid_perplexity", "stopped", "train") if k in t}}


def export(model: Path, out: Path, quantize: str) -> int:
    done = subprocess.run([sys.executable, "-m", "nlmserve", "export-tables", "--model", str(model), "--out", str(out),
                           "--quantize", quantize], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"nlmserve export-tables --model {model} --quantize {quantize}: {done.stderr.strip()}")
    return out.stat().st_size


def build_driver(work: Path) -> tuple[Path, str]:
    """The scorer's driver, compiled into ``work``; (binary, the compiler's first line)."""
    binary = work / "nlmserve_tables_speed"
    cxx = os.environ.get("CXX", "g++")
    done = subprocess.run([cxx, *CXXFLAGS, "-I", str(REPO / "client" / "cpp"), str(DRIVER), "-o", str(binary)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{cxx} {DRIVER}: {done.stderr.strip()[-2000:]}")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()
    return binary, (version[0] if version else cxx)


def time_scorer(binary: Path, tables: Path, text: Path, passes: int) -> dict[str, Any]:
    done = subprocess.run([str(binary), str(tables), str(text), str(passes)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{binary.name} {tables}: {done.stderr.strip()}")
    out: dict[str, Any] = json.loads(done.stdout)
    out["median_ns_per_row"] = statistics.median(out["ns_per_row"])
    return out


def server_free_line(tables: Path, order: int) -> str:
    """The feature line `nlmserve moses-ini --tables FILE` prints: no server."""
    return f"NeuralLMServer name=NLM0 factor=0 order={order} normalized=false tables={tables}"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="vocab-scale-", dir=args.work))
    models = {"small": Path(args.small), "large": Path(args.model)}
    result: dict[str, Any] = {"machine": machine(), "command": " ".join(["bench/vocab_scale.py", *sys.argv[1:]]),
                              "text": str(args.text), "models": {}, "files": {}}
    files: dict[tuple[str, str], Path] = {}
    for name, model in models.items():
        result["models"][name] = model_facts(model)
        result["files"][name] = {}
        for q in FORMS:
            files[name, q] = work / f"{name}.{q}.nlt"
            result["files"][name][q] = {"bytes": export(model, files[name, q], q)}
    if result["models"]["large"]["vocab_size"] < 100_000:
        print(f"# note: {args.model} has {result['models']['large']['vocab_size']:,} words, under 100,000",
              file=sys.stderr)

    # The scorer, every file in each round.
    binary, compiler = build_driver(work)
    result["scorer"] = {"compiler": compiler, "flags": " ".join(CXXFLAGS), "passes": args.passes,
                        "rounds": args.rounds, "runs": {n: {q: [] for q in FORMS} for n in MODELS}}
    for r in range(args.rounds):
        print(f"# scorer round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name in MODELS:
            for q in FORMS:
                result["scorer"]["runs"][name][q].append(time_scorer(binary, files[name, q], args.text.resolve(),
                                                                     args.passes))

    if args.moses:
        from bench.tables_memory import load_seconds, run_decoders
        from bench.decoder import rewrite_ini, write_head

        source = write_head(args.source, args.lines, work / "source.txt")
        configs = [("small", "none")] + [("large", q) for q in FORMS]
        result["decoders"] = {"n": args.decoders, "lines": args.lines, "runs": {}, "load_seconds": {}}
        for name, q in configs:
            key = f"{name} {q}"
            ini = work / f"{name}.{q}.ini"
            rewrite_ini(args.ini, args.kenlm, ini, server_free_line(files[name, q], result["models"][name]["order"]),
                        0.1)
            print(f"# {args.decoders} decoders, {key}", file=sys.stderr, flush=True)
            result["decoders"]["runs"][key] = run_decoders(args.moses, ini, source, args.decoders, work,
                                                           files[name, q])
            result["decoders"]["load_seconds"][key] = []
        for _ in range(args.load_rounds):
            for name, q in configs:
                result["decoders"]["load_seconds"][f"{name} {q}"].append(
                    round(load_seconds(args.moses, work / f"{name}.{q}.ini", work), 3))
    result["load_average_end_1m"] = round(os.getloadavg()[0], 2)
    return result


def scorer_rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per form: each model's median ns per n-gram (of its rounds' medians), first pass too,
    in-process map time, and the median over rounds of large / small with its quartiles."""
    runs = result["scorer"]["runs"]
    out = {}
    for q in FORMS:
        small, large = runs["small"][q], runs["large"][q]
        out[q] = {"small_ns": statistics.median(x["median_ns_per_row"] for x in small),
                  "large_ns": statistics.median(x["median_ns_per_row"] for x in large),
                  "small_first_ns": statistics.median(x["first_ns_per_row"] for x in small),
                  "large_first_ns": statistics.median(x["first_ns_per_row"] for x in large),
                  "ratio": statistics.median(b["median_ns_per_row"] / a["median_ns_per_row"]
                                             for a, b in zip(small, large)),
                  "ratios": [round(b["median_ns_per_row"] / a["median_ns_per_row"], 3) for a, b in zip(small, large)],
                  "ratio_q1": 0.0, "ratio_q3": 0.0,
                  "small_map_ms": 1000 * statistics.median(x["map_s"] for x in small),
                  "large_map_ms": 1000 * statistics.median(x["map_s"] for x in large),
                  "small_lookup_ns": statistics.median(x["lookup_ns_per_word"] for x in small),
                  "large_lookup_ns": statistics.median(x["lookup_ns_per_word"] for x in large)}
        ratios = [b["median_ns_per_row"] / a["median_ns_per_row"] for a, b in zip(small, large)]
        if len(ratios) > 1:
            out[q]["ratio_q1"], _, out[q]["ratio_q3"] = statistics.quantiles(ratios, n=4, method="inclusive")
        else:
            out[q]["ratio_q1"] = out[q]["ratio_q3"] = ratios[0]
    return out


def _mib(kb: float) -> str:
    return f"{kb / 1024:,.0f}"


def render(result: dict[str, Any]) -> str:
    m, sm, lg = result["machine"], result["models"]["small"], result["models"]["large"]
    s = result["scorer"]
    first = s["runs"]["large"]["none"][0]
    rows = scorer_rows(result)
    out = [BEGIN, "",
           f"`{shown_command(result['command'])}`", "",
           f"{m['cpu']}, {m['cores']} cores, shared (load {m['load_average_1m']} at the start, "
           f"{result['load_average_end_1m']} at the end). Large: `{Path(lg['path']).name}`, "
           f"{lg['vocab_size']:,} words, order {lg['order']}, width {lg['dim']}, {lg['objective'].upper()} "
           f"{lg['output']} output"
           f"{', direct n-gram features' if lg['ngram_features'] else ''}; small: `{Path(sm['path']).name}`, "
           f"{sm['vocab_size']:,} words, order {sm['order']}, width {sm['dim']}, {sm['objective'].upper()} "
           f"{sm['output']} output{', direct n-gram features' if sm['ngram_features'] else ''}.", ""]
    out += ["| tables file | small (MB) | large (MB) | mapped in-process, small / large (ms) "
            "| ns per n-gram, small | large | large ÷ small (the middle half of the rounds) "
            "| first pass, small / large (ns) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for q in FORMS:
        r = rows[q]
        out.append(f"| `--quantize {q}` | {result['files']['small'][q]['bytes'] / 1e6:,.1f} | "
                   f"{result['files']['large'][q]['bytes'] / 1e6:,.1f} | "
                   f"{r['small_map_ms']:.2f} / {r['large_map_ms']:.2f} | "
                   f"{r['small_ns']:.0f} | {r['large_ns']:.0f} | {r['ratio']:.2f} "
                   f"({r['ratio_q1']:.2f}–{r['ratio_q3']:.2f}) | {r['small_first_ns']:.0f} / "
                   f"{r['large_first_ns']:.0f} |")
    small_first = s["runs"]["small"]["none"][0]
    out += ["", f"The scorer: bench/cpp/nlmserve_tables_speed.cpp ({s['compiler']}, `{s['flags']}`), "
                f"{first['rows']:,} n-grams of `{shown_command(result['text'])}` ({first['words']:,} words, "
                f"{small_first['unknown']:,} unknown to the small model, {first['unknown']:,} to the large), one "
                f"sentence's n-grams a call, {s['rounds']} interleaved rounds (every round's times in the JSON); "
                f"a round's number is the median of {s['passes']} passes after the first, each with a new "
                f"scratch; the first pass reads each page "
                f"of the tables in the process for the first time (the file in the page cache). A word looked up "
                f"in the file's vocabulary (float32 file; pages already faulted in): "
                f"{rows['none']['small_lookup_ns']:.0f} ns small, {rows['none']['large_lookup_ns']:.0f} ns large"
                f"{' (which lowercases each word first)' if lg['lowercase'] and not sm['lowercase'] else ''}."]
    d = result.get("decoders")
    if d:
        n = d["n"]
        out += ["", f"{n} Moses decoders at once, each with `NeuralLMServer ... tables=FILE` and no `path=` (no "
                    f"server), after decoding the same {d['lines']} sentences; then one decoder alone, the files "
                    f"in turn, from its start until the feature's \"scoring locally\" line. PSS counts a page "
                    f"shared by k processes 1/k in each.", "",
                "| tables file | file (MB) | PSS of the decoders, all (MiB) | per decoder | the file's share, all "
                "(MiB) | the file resident per decoder (MiB) | ready in (s, rounds) |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for key, procs in d["runs"].items():
            name, q = key.split()
            pss = sum(p["pss"] for p in procs)
            loads = d["load_seconds"][key]
            out.append(f"| {name} `{q}` | {result['files'][name][q]['bytes'] / 1e6:,.1f} | {_mib(pss)} | "
                       f"{_mib(pss / n)} | {_mib(sum(p['file_pss'] for p in procs))} | "
                       f"{_mib(sum(p['file_rss'] for p in procs) / n)} | "
                       f"{statistics.median(loads):.2f} ({', '.join(f'{x:.2f}' for x in loads)}) |")
    return "\n".join(out + ["", END])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the large-vocabulary model (scoring tables: NCE class output, or a tree)")
    p.add_argument("--small", help="a small-vocabulary model of the same shape, timed beside it")
    p.add_argument("--text", type=Path, help="held-out text whose n-grams the scorer scores (one sentence a line)")
    p.add_argument("--passes", type=int, default=5, help="scorer passes after the first, per run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved scorer rounds")
    p.add_argument("--moses", help="the Moses binary, built with the NeuralLMServer feature (docs/moses.md)")
    p.add_argument("--ini", type=Path, help="moses.ini (relative table paths; LM_PATH replaced by --kenlm)")
    p.add_argument("--kenlm", help="the KenLM binary that replaces LM_PATH")
    p.add_argument("--source", type=Path, default=SOURCE, help="source sentences (default: newstest2013.src)")
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--lines", type=int, default=20, help="sentences each decoder decodes before it is measured")
    p.add_argument("--load-rounds", type=int, default=3, help="single-decoder loads of each file, in turn")
    p.add_argument("--work", type=Path, default=None, help="scratch folder's parent (default: the system's)")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--doc", type=Path, help="render into this page's bench/vocab_scale.py section")
    p.add_argument("--render", nargs=2, metavar=("DOC", "JSON"), help="render a saved run into DOC and exit")
    args = p.parse_args(argv)
    if args.render:
        doc, saved = map(Path, args.render)
        write_section(doc, BEGIN, END, render(json.loads(saved.read_text())))
        return 0
    missing = [f"--{k}" for k in ("model", "small", "text") if getattr(args, k) is None]
    if missing:
        p.error("needs " + ", ".join(missing) + " (or --render DOC JSON)")
    if args.moses:
        if args.ini is None or args.kenlm is None:
            p.error("--moses needs --ini and --kenlm")
        if not os.access(args.moses, os.X_OK):
            raise SystemExit(f"--moses {args.moses}: not an executable")
    result = measure(args)
    text = render(result)
    if args.json:
        write_json(args.json, result)
    if args.doc:
        write_section(args.doc, BEGIN, END, text)
    print(text)
    return 0


if __name__ == "__main__":
    exit_with(main)
