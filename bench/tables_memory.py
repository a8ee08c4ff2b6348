"""The memory of N Moses decoders on one host with ``scoring=local``: the tables fetched into
each decoder (a copy per process) against one tables file that every decoder maps
(``tables=FILE``, written by ``nlmserve export-tables``). Memory, not time: a busy machine moves no
number here.

    python -m bench.tables_memory --moses MOSES --ini ../shared/data/moses-fr-en/moses.ini \\
        --kenlm KN.bin --model model.nlm [--decoders 4] [--lines 20] [--json J] [--doc docs/performance-tables.md]

One server of MODEL; for each way (fetched, then mapped) N decoders start at once, each
decodes the same LINES source sentences (so the tables' rows it reads are in memory), then,
still running, has its proportional set size read (PSS: a page shared by k processes counts
1/k in each; /proc/PID/smaps_rollup), the tables' own share among it (the mapping of the
file, or the difference from the mapped run), and its resident size; then the decoders end.
Then one decoder at a time, the two ways in turn (``--rounds``): the seconds until its tables
are ready.
``--render DOC JSON`` writes a saved run's table into DOC.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import exit_with, machine, markers, shown_command, write_json, write_section
from bench.decoder import feature_line, rewrite_ini, write_head

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO.parent / "shared" / "data" / "nbest" / "newstest-fr-en" / "newstest2013.src"
BEGIN, END = markers("tables_memory.py")


def smaps_kb(pid: int, mapped_file: Path | None = None) -> dict[str, int]:
    """A live process's Pss and Rss (kB, smaps_rollup), and with ``mapped_file`` the Pss and
    Rss of its mappings of that file (smaps)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Pss", "Rss"):
            out[key.lower()] = int(value.split()[0])
    if mapped_file is not None:
        out["file_pss"] = out["file_rss"] = 0
        inside = False
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(mapped_file))
            elif inside and line.startswith(("Pss:", "Rss:")):
                out["file_" + line[:3].lower()] += int(line.split()[1])
    return out


def run_decoders(moses: str, ini: Path, source: list[str], n: int, work: Path,
                 mapped_file: Path | None) -> list[dict[str, int]]:
    """N decoders of ``ini`` at once; each decodes ``source``, then its memory is read while
    it still runs (its stdin open); then all end."""
    procs = []
    for i in range(n):
        log = open(work / f"decoder{i}.log", "wb")
        procs.append(subprocess.Popen([moses, "-f", str(ini), "-threads", "1", "-v", "1"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, cwd=work, text=True, bufsize=1))
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("".join(source))
            p.stdin.flush()
        for i, p in enumerate(procs):
            assert p.stdout is not None
            for _ in source:
                if not p.stdout.readline():
                    tail = (work / f"decoder{i}.log").read_text(errors="replace").splitlines()[-5:]
                    raise SystemExit(f"decoder {i} ended early:\n" + "\n".join(tail))
        time.sleep(1.0)
        return [smaps_kb(p.pid, mapped_file) for p in procs]
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()


def load_seconds(moses: str, ini: Path, work: Path) -> float:
    """Seconds from starting one decoder of ``ini`` until the feature says it scores locally
    (the tables fetched or mapped; the phrase tables load after it), read from its log."""
    log = work / "load.log"
    with open(log, "wb") as ferr:
        start = time.perf_counter()
        proc = subprocess.Popen([moses, "-f", str(ini), "-threads", "1", "-v", "1"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=ferr, cwd=work)
        try:
            while b"scoring locally with" not in log.read_bytes():
                if proc.poll() is not None:
                    raise SystemExit(f"the decoder ended before its tables were ready: see {log}")
                time.sleep(0.01)
            return time.perf_counter() - start
        finally:
            proc.kill()
            proc.wait()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from nlmserve.common.serve_process import start_server
    from nlmserve.lm.model_file import read_model_header

    work = Path(tempfile.mkdtemp(prefix="tables-memory-", dir=args.work))
    tables_file = work / "model.nlt"
    done = subprocess.run([sys.executable, "-m", "nlmserve", "export-tables", "--model", str(args.model),
                           "--out", str(tables_file)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"nlmserve export-tables: {done.stderr.strip()}")
    order = read_model_header(args.model).config.order
    source = write_head(args.source, args.lines, work / "source.txt")
    result: dict[str, Any] = {"machine": machine(), "command": " ".join(["bench/tables_memory.py", *sys.argv[1:]]),
                              "decoders": args.decoders, "lines": args.lines,
                              "tables_bytes": tables_file.stat().st_size, "runs": {}}
    server = start_server(args.model, stderr=open(work / "server.log", "wb"))
    try:
        for way, option in (("fetched", "scoring=local"), ("mapped", f"tables={tables_file}")):
            line = feature_line({"normalized": "false", "scoring": "local"} if way == "fetched"
                                else {"normalized": "false", "tables": str(tables_file)}, server.target, order)
            ini = work / f"{way}.ini"
            rewrite_ini(args.ini, args.kenlm, ini, line, 0.1)
            print(f"# {args.decoders} decoders, tables {way} ({option})", file=sys.stderr, flush=True)
            result["runs"][way] = run_decoders(args.moses, ini, source, args.decoders, work,
                                               tables_file if way == "mapped" else None)
        # One decoder at a time, the two ways in turn: how long the tables take to be ready.
        result["load_seconds"] = {"fetched": [], "mapped": []}
        for _ in range(args.rounds):
            for way in ("fetched", "mapped"):
                result["load_seconds"][way].append(round(load_seconds(args.moses, work / f"{way}.ini", work), 2))
    finally:
        server.stop()
    return result


def _load_lines(result: dict[str, Any]) -> list[str]:
    """The single-decoder load times, when the run measured them (median of the rounds)."""
    loads = result.get("load_seconds")
    if not loads:
        return []
    med = {way: statistics.median(v) for way, v in loads.items()}
    return ["", f"One decoder alone, from its start until the tables are ready (the feature's log line), "
                f"{len(loads['fetched'])} rounds in turn: fetched {', '.join(f'{x:.2f}' for x in loads['fetched'])} s "
                f"(median {med['fetched']:.2f}), mapped {', '.join(f'{x:.2f}' for x in loads['mapped'])} s "
                f"(median {med['mapped']:.2f})."]


def verdict(result: dict[str, Any]) -> str:
    """"met" when the mapped decoders' share of the tables file is one copy of it (within 5%)."""
    file_mib = result["tables_bytes"] / 2**20
    share = sum(r["file_pss"] for r in result["runs"]["mapped"]) / 1024.0
    return ("met" if share <= 1.05 * file_mib else "not met") + \
        f", the mapped tables count {share:,.0f} MiB in all for a {file_mib:,.0f} MiB file"


def render(result: dict[str, Any]) -> str:
    n, m = result["decoders"], result["machine"]
    mib = 1024.0

    def total(way: str, key: str) -> float:
        return sum(r[key] for r in result["runs"][way]) / mib

    fetched, mapped = total("fetched", "pss"), total("mapped", "pss")
    file_pss = total("mapped", "file_pss")
    lines = [BEGIN, "",
             f"{n} Moses decoders at once on one host, `scoring=local`, each after decoding the same "
             f"{result['lines']} sentences; tables file {result['tables_bytes'] / 2**20:,.0f} MiB. PSS counts a "
             f"page shared by k processes 1/k in each.", "",
             "| tables | PSS of the decoders, all | per decoder | the tables' share | resident per decoder |",
             "|---|---|---|---|---|",
             f"| fetched (a copy each) | {fetched:,.0f} MiB | {fetched / n:,.0f} MiB | "
             f"{(fetched - mapped + file_pss):,.0f} MiB (the difference, plus the file's share below) | "
             f"{total('fetched', 'rss') / n:,.0f} MiB |",
             f"| mapped (`tables=FILE`) | {mapped:,.0f} MiB | {mapped / n:,.0f} MiB | {file_pss:,.0f} MiB "
             f"(the file's mappings) | {total('mapped', 'rss') / n:,.0f} MiB |",
             *_load_lines(result),
             "", f"Saved: {fetched - mapped:,.0f} MiB for {n} decoders ({(fetched - mapped) / n:,.0f} MiB each). "
             f"Verdict: {verdict(result)}. "
             f"Command: `{shown_command(result['command'])}` ({m['cpu']}).", "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moses", help="the Moses binary, built with the NeuralLMServer feature (docs/moses.md)")
    p.add_argument("--ini", type=Path, help="moses.ini (relative table paths; LM_PATH replaced by --kenlm)")
    p.add_argument("--kenlm", help="the KenLM binary that replaces LM_PATH")
    p.add_argument("--model", type=Path, help="a model with scoring tables (NCE class output, or a tree)")
    p.add_argument("--source", type=Path, default=SOURCE, help="source sentences (default: newstest2013.src)")
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--lines", type=int, default=20, help="sentences each decoder decodes before it is measured")
    p.add_argument("--rounds", type=int, default=3, help="single-decoder loads of each way, in turn")
    p.add_argument("--work", type=Path, default=None, help="scratch folder's parent (default: the system's)")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--doc", type=Path, help="render the table into this page's bench/tables_memory.py section")
    p.add_argument("--render", nargs=2, metavar=("DOC", "JSON"), help="render a saved run into DOC and exit")
    args = p.parse_args(argv)
    if args.render:
        import json

        doc, saved = map(Path, args.render)
        write_section(doc, BEGIN, END, render(json.loads(saved.read_text())))
        return 0
    missing = [f"--{k}" for k in ("moses", "ini", "kenlm", "model") if getattr(args, k) is None]
    if missing:
        p.error("needs " + ", ".join(missing) + " (or --render DOC JSON)")
    if not os.access(args.moses, os.X_OK):
        raise SystemExit(f"--moses {args.moses}: not an executable")
    result = measure(args)
    print(render(result))
    if args.json:
        write_json(args.json, result)
    if args.doc:
        write_section(args.doc, BEGIN, END, render(result))
    return 0


if __name__ == "__main__":
    exit_with(main)
