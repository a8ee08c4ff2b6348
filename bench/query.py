"""KenLM's ``query`` beside nlmserve's: start-up and n-grams per second of ``nlmserve query
--model``, ``nlmserve query --tables`` of each quantisation and KenLM's ``query`` of a KenLM
binary, on the same text, in one run; and the time to open a tables file of a 100,000-word
vocabulary (the vocabulary's table lies in the file). With ``--errors``, instead, how far each
quantisation moves the scores of held-out texts' n-grams from float32's (no clock).

    python -m bench.query --model M --text T [--kenlm-query BIN --kenlm LM.binary] [--rounds 3]
        [--json J] [--doc docs/performance-tables.md]
    python -m bench.query --model M --errors T1 [T2 ...] [--json J] [--doc docs/interfaces.md]

Speed: every command runs alone on one thread (OMP_NUM_THREADS=1 and the like; --threads 1
for --model), its output to /dev/null, the rounds interleaved. Start-up: the wall seconds of
a one-line input. Speed: the n-grams of TEXT (its tokens and one </s> a line) over the wall
seconds of TEXT less the start-up. The median of the rounds. The tables files are written
first (export-tables --quantize none|fp16|int8, into a scratch folder).

Errors: |score − float32's| over every n-gram of each text (mean, 99th percentile, largest),
the bound the file records, and the perplexity of the self-normalised scores; for fp16, int8
(a scale per row, what export-tables writes) and, as the alternative it was chosen over,
KenLM's bins (lm/quantize.hh: per table 256 values, each the mean of an equal share of the
table's values sorted, every value replaced by the nearest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import exit_with, machine, markers, shown_command, write_json, write_section

REPO = Path(__file__).resolve().parent.parent
NLMSERVE = [sys.executable, "-m", "nlmserve"]
CONTRACT_TEST = REPO / "build" / "cpp" / "nlmserve_contract_test"
BEGIN, END = markers("query.py")
ERRORS_BEGIN, ERRORS_END = markers("query.py", "errors")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
VOCABULARY = 100_000


def wall(argv: list[str], stdin: Path) -> float:
    """Seconds ``argv < stdin > /dev/null`` takes (SystemExit when it fails)."""
    with open(stdin, "rb") as f:
        start = time.perf_counter()
        done = subprocess.run(argv, stdin=f, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, **ONE_THREAD})
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.decode(errors='replace')[-500:]}")
    return seconds


def vocabulary_open(folder: Path) -> dict[str, float]:
    """A tables file of VOCABULARY words (width 8, order 5): Python's open and first word
    through the file's table, and its dict of every word; the C++ reader's whole process
    (map, one lookup) against the same for the 8-word contract fixture."""
    import numpy as np

    from nlmserve.lm.tables_file import FlatTables, read_tables_file, write_tables_file

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCABULARY - 3)]
    V, D, order = len(words), 8, 5
    path = folder / "vocabulary.nlt"
    write_tables_file(path, FlatTables(np.zeros((order * V) * D + V, dtype=np.float32), D, "none"), order=order,
                      words=words, lowercase=False, model_hash="vocabulary")
    start = time.perf_counter()
    t = read_tables_file(path)
    assert t.lookup("w12345") == 12348
    opened = time.perf_counter() - start
    start = time.perf_counter()
    assert t.index["w12345"] == 12348
    indexed = time.perf_counter() - start
    out = {"python_open_lookup_ms": 1000 * opened, "python_dict_ms": 1000 * indexed}
    if CONTRACT_TEST.exists():
        word = folder / "word.txt"
        word.write_text("w12345\n")
        big = statistics.median(wall([str(CONTRACT_TEST), "--words", str(path)], word) for _ in range(5))
        small = statistics.median(wall([str(CONTRACT_TEST), "--words", str(REPO / "proto" / "contract" /
                                                                          "scoring_tables.nlt")], word)
                                  for _ in range(5))
        out.update(cpp_process_ms=1000 * big, cpp_fixture_process_ms=1000 * small)
    return out


def binned(values: Any) -> Any:
    """KenLM's bins for each table of ``values`` (T, R, D): 256 centres, each the mean of an
    equal share of the table's values in order, every value replaced by the nearest."""
    import numpy as np

    out = np.empty_like(values)
    for t in range(values.shape[0]):
        x = values[t].reshape(-1)
        centres = np.array([x[part].mean() for part in np.array_split(np.argsort(x, kind="stable"), 256)],
                           dtype=np.float32)
        out[t] = centres[np.searchsorted((centres[1:] + centres[:-1]) / 2, x)].reshape(values[t].shape)
    return out


def errors(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-query-errors-") as tmp:
        return _errors(args, Path(tmp))


def _errors(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import numpy as np

    from nlmserve.wire.ngrams import sentence_rows
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import FlatTables, write_tables_file
    from nlmserve.lm.tables_scorer import TablesScorer

    lm = LanguageModel.load(args.model, device="cpu")
    flat = FlatTables.of(lm.scoring_tables())
    V, D, n1 = len(lm.vocab), flat.dim, lm.order - 1
    files, bounds = {}, {}
    for q in ("none", "fp16", "int8"):
        files[q] = folder / f"{q}.nlt"
        bounds[q] = write_tables_file(files[q], flat, order=lm.order, words=lm.vocab.words, lowercase=lm.lowercase,
                                      model_hash=lm.model_hash, quantization=q).error_bound
    rows_end = (n1 * V + V) * D
    data = flat.data
    kenlm_bins = np.concatenate([binned(data[:n1 * V * D].reshape(n1, V, D)).reshape(-1),
                                 binned(data[n1 * V * D:rows_end].reshape(1, V, D)).reshape(-1), data[rows_end:]])
    files["int8, KenLM's bins"] = folder / "bins.nlt"
    write_tables_file(files["int8, KenLM's bins"], FlatTables(kenlm_bins.astype(np.float32), D, flat.activation,
                                                              flat.feature_order, flat.ngram_class_table,
                                                              flat.ngram_word_table),
                      order=lm.order, words=lm.vocab.words, lowercase=lm.lowercase, model_hash=lm.model_hash)
    bounds["int8, KenLM's bins"] = float("nan")
    texts = {}
    for text in args.errors:
        sentences = [line.split() for line in Path(text).read_text(encoding="utf-8").splitlines()]
        rows, _, _, _ = sentence_rows(sentences, lm.vocab.index, lm.order, lowercase=lm.lowercase)
        exact = TablesScorer.open(files["none"]).score_rows(rows).astype(np.float64)
        forms = {}
        for name in ("fp16", "int8", "int8, KenLM's bins"):
            got = TablesScorer.open(files[name]).score_rows(rows).astype(np.float64)
            moved = np.abs(got - exact)
            # The bins' file would be int8's with 256 floats per table instead of a scale per row.
            size = files[name].stat().st_size if name != "int8, KenLM's bins" else \
                files["int8"].stat().st_size - 4 * (n1 + 1) * V + 4 * 256 * (n1 + 1)
            forms[name] = {"mean": float(moved.mean()), "p99": float(np.quantile(moved, 0.99)),
                           "max": float(moved.max()), "bound": bounds[name],
                           "perplexity": float(np.exp(-got.mean())), "bytes": size}
        texts[text] = {"ngrams": int(len(rows)), "perplexity": float(np.exp(-exact.mean())),
                       "bytes": files["none"].stat().st_size, "forms": forms}
    return {"command": " ".join(sys.argv), "model": args.model, "texts": texts}


def render_errors(result: dict[str, Any]) -> str:
    out = [ERRORS_BEGIN, "", f"`{shown_command(result['command'])}`", ""]
    for text, t in result["texts"].items():
        out += [f"{t['ngrams']:,} n-grams of `{shown_command(text)}`; float32: {t['bytes'] / 1e6:.1f} MB, "
                f"perplexity of the self-normalised scores {t['perplexity']:.2f}.", "",
                "| form | file (MB) | mean error (nats) | 99th pct | largest | bound | perplexity |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for name, f in t["forms"].items():
            bound = "-" if f["bound"] != f["bound"] else f"{f['bound']:.3g}"
            out.append(f"| {name} | {f['bytes'] / 1e6:.1f} | {f['mean']:.5f} | {f['p99']:.4f} | {f['max']:.4f} | "
                       f"{bound} | {f['perplexity']:.2f} |")
        out.append("")
    return "\n".join(out + [ERRORS_END]) + "\n"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-query-") as tmp:
        return _measure(args, Path(tmp))


def _measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    one = folder / "one.txt"
    one.write_text("the european union\n", encoding="utf-8")
    lines = Path(args.text).read_text(encoding="utf-8").splitlines()
    ngrams = sum(len(line.split()) + 1 for line in lines)
    commands: dict[str, list[str]] = {"query --model": [*NLMSERVE, "query", "--model", args.model, "--device", "cpu",
                                                        "--threads", "1", "--unnormalized"]}
    sizes: dict[str, int] = {"query --model": Path(args.model).stat().st_size}
    for quantization in ("none", "fp16", "int8"):
        tables = folder / f"model.{quantization}.nlt"
        subprocess.run([*NLMSERVE, "export-tables", "--model", args.model, "--out", str(tables), "--quantize",
                        quantization], check=True, capture_output=True)
        name = f"query --tables ({quantization})"
        commands[name] = [*NLMSERVE, "query", "--tables", str(tables), "--unnormalized"]
        sizes[name] = tables.stat().st_size
    if args.kenlm_query:
        commands["KenLM query"] = [args.kenlm_query, args.kenlm]
        sizes["KenLM query"] = Path(args.kenlm).stat().st_size
    started = machine()
    runs: dict[str, dict[str, list[float]]] = {name: {"start": [], "text": []} for name in commands}
    for _ in range(args.rounds):
        for name, argv in commands.items():
            runs[name]["start"].append(wall(argv, one))
            runs[name]["text"].append(wall(argv, Path(args.text)))
    rows = {}
    for name, r in runs.items():
        start, text = statistics.median(r["start"]), statistics.median(r["text"])
        rows[name] = {"start_s": start, "text_s": text, "ngrams_per_s": ngrams / max(text - start, 1e-9),
                      "file_bytes": sizes[name]}
    return {"machine": started, "command": " ".join(sys.argv), "text": args.text, "lines": len(lines),
            "ngrams": ngrams, "rounds": args.rounds, "rows": rows, "vocabulary": vocabulary_open(folder),
            "load_average_end_1m": round(os.getloadavg()[0], 2)}


def render(result: dict[str, Any]) -> str:
    m = result["machine"]
    out = [BEGIN, "", f"`{shown_command(result['command'])}`", "",
           f"{m['cpu']}, {m['cores']} cores, load {m['load_average_1m']} at the start and "
           f"{result['load_average_end_1m']} at the end; {result['lines']:,} lines, {result['ngrams']:,} n-grams "
           f"(`{shown_command(result['text'])}`); median of {result['rounds']} interleaved rounds, one thread each.", "",
           "| command | file (MB) | start-up (s) | text (s) | n-grams/s |", "|---|---:|---:|---:|---:|"]
    for name, r in result["rows"].items():
        out.append(f"| {name} | {r['file_bytes'] / 1e6:.1f} | {r['start_s']:.2f} | {r['text_s']:.2f} | "
                   f"{r['ngrams_per_s']:,.0f} |")
    v = result["vocabulary"]
    out += ["", f"A tables file of {VOCABULARY:,} words: Python opens it and finds a word through the file's table "
                f"in {v['python_open_lookup_ms']:.1f} ms, and builds the dict of every word "
                f"(what `query --tables` looks words up in) in {v['python_dict_ms']:.0f} ms."]
    if "cpp_process_ms" in v:
        out[-1] += (f" The C++ reader's whole process (start, map, one lookup: `nlmserve_contract_test --words`) "
                    f"takes {v['cpp_process_ms']:.1f} ms, against {v['cpp_fixture_process_ms']:.1f} ms for the "
                    "8-word contract fixture: mapping builds nothing per word.")
    return "\n".join(out + ["", END]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model file with scoring tables")
    p.add_argument("--text", help="one tokenised sentence per line (the speed)")
    p.add_argument("--errors", nargs="+", metavar="TEXT", help="instead: the quantisations' errors on these texts")
    p.add_argument("--kenlm-query", help="KenLM's query binary")
    p.add_argument("--kenlm", help="a KenLM model for it (a binary, as build_binary writes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the run here")
    p.add_argument("--doc", type=Path, help="replace this page's bench/query.py section with the table")
    args = p.parse_args(argv)
    if bool(args.kenlm_query) != bool(args.kenlm):
        p.error("--kenlm-query and --kenlm go together")
    if bool(args.text) == bool(args.errors):
        p.error("give --text (the speed) or --errors (the quantisations' errors)")
    result = errors(args) if args.errors else measure(args)
    if args.json:
        write_json(args.json, result)
    text = render_errors(result) if args.errors else render(result)
    if args.doc:
        write_section(args.doc, *((ERRORS_BEGIN, ERRORS_END) if args.errors else (BEGIN, END)), text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    exit_with(main)
