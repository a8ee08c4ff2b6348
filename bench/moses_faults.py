"""What the Moses decoder does when the nlmserve server dies under it, on a real system.

    .venv/bin/python -m bench.moses_faults --moses /path/to/bin/moses \
        --ini ../shared/data/moses-fr-en/moses.ini --kenlm europarl.lc-moses.5gram.trie.bin \
        --model nlm.model --input ../shared/data/nbest/newstest-fr-en/newstest2013.src \
        --lines 40 --json faults.json --doc docs/performance-serving.md

Each case decodes the first ``--lines`` sentences (``moses -threads T -v 1``) with NLM0
asked of a server of its own, and kills that server (SIGKILL) ``--kill-after`` seconds
after Moses has loaded (its "Created input-output object" line):

- ``fail``: ``scoring=server`` with the default ``on-error=fail``: Moses must stop with the
  feature's message naming the server and the gRPC status, having written the sentences
  before the failure and no others;
- ``floor``: ``on-error=floor``: every sentence is written, exit status 0, the failed and
  floored requests counted in the feature's closing line;
- ``restart``: the default ``on-error=fail``, and a new server on the same port
  ``--restart-after`` seconds after the kill: every sentence, no failed request, the output
  byte-identical to an undisturbed run;
- ``local``: ``scoring=local``: the tables were fetched at load, so the dead server costs
  nothing: every sentence, byte-identical to an undisturbed run.

``normalized=false`` throughout (self-normalised scores; ``local`` needs a model with scoring
tables). The undisturbed runs decode the same sentences with the same scoring and a server
of their own that nobody kills. These are behaviours, not timings: the seconds reported, from
the kill to the decoder's exit, are for ``fail`` those of the feature's timeouts and retries
(``connect-timeout-ms``, ``retries``), for the others the rest of the decoding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench._common import exit_with, machine, markers, require_scoring_tables, shown_command, write_json, write_section
from bench.decoder import commit, feature_line, rewrite_ini, write_head

from nlmserve.common.serve_process import ServerProcess, start_server

#: name -> (the feature's options besides normalized=false, whether the server comes back)
CASES: dict[str, tuple[dict[str, str], bool]] = {
    "fail": ({"scoring": "server"}, False),
    "floor": ({"scoring": "server", "on-error": "floor"}, False),
    "restart": ({"scoring": "server"}, True),
    "local": ({"scoring": "local"}, False),
}

_LOADED = "Created input-output object"
_CLOSING = re.compile(r"NeuralLMServer \S+: (\d+) sentences, (\d+) round trips, (\d+) failed requests, "
                      r"(\d+) requests floored")
_FAILED = re.compile(r"NeuralLMServer \S+: nlmserve \S+ at \S+ failed: .*")


def log_facts(log: str) -> dict[str, Any]:
    """What the decoder's stderr says of the server: the feature's closing counts (absent
    when the process stopped on an error) and its first failure message, if any."""
    facts: dict[str, Any] = {"failed_requests": None, "floored_requests": None, "message": None}
    m = _CLOSING.search(log)
    if m:
        facts["failed_requests"], facts["floored_requests"] = int(m.group(3)), int(m.group(4))
    m = _FAILED.search(log)
    if m:
        facts["message"] = m.group(0).split("; scoring ")[0].strip()
    return facts


def verdict(case: str, run: dict[str, Any], lines: int) -> tuple[bool, str]:
    """Whether a case behaved as the module's docstring says, and why not."""
    if case == "fail":
        if run["exit_status"] == 0:
            return False, "the decoder did not stop"
        if not run["message"]:
            return False, "no message from the feature naming the failure"
        if run["sentences_written"] >= lines:
            return False, "the server died after the last sentence (raise --lines or lower --kill-after)"
        if not run["prefix_identical"]:
            return False, "the sentences written differ from the undisturbed run's"
        return True, ""
    if run["exit_status"] != 0:
        return False, f"exit status {run['exit_status']}"
    if run["sentences_written"] != lines:
        return False, f"{run['sentences_written']} of {lines} sentences written"
    if case == "floor":
        if not run["floored_requests"]:
            return False, "no request floored: the server died after the last request"
        return True, ""
    if run["failed_requests"]:
        return False, f"{run['failed_requests']} failed requests"
    if not run["identical"]:
        return False, "the output differs from the undisturbed run's"
    return True, ""


def decode(moses: str, ini: Path, src: Path, threads: int, out: Path, log: Path,
           on_loaded: Any = None) -> tuple[int, float]:
    """Run the decoder; ``on_loaded()`` is called when it has loaded. Returns its exit status
    and the time it exited (time.monotonic())."""
    with open(src, "rb") as fin, open(out, "wb") as fout, open(log, "w", encoding="utf-8") as ferr:
        proc = subprocess.Popen([moses, "-f", str(ini), "-threads", str(threads), "-v", "1"], stdin=fin,
                                stdout=fout, stderr=subprocess.PIPE, text=True, errors="replace", cwd=ini.parent)
        assert proc.stderr is not None
        for line in proc.stderr:
            ferr.write(line)
            if on_loaded is not None and _LOADED in line:
                on_loaded()
                on_loaded = None
        status = proc.wait()
    return status, time.monotonic()


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)  # --render needs none of the decoding flags
    pre.add_argument("--render", type=Path)
    pre.add_argument("--doc", type=Path)
    only, _ = pre.parse_known_args(argv)
    if only.render is not None:
        text = render(json.loads(only.render.read_text()))
        if only.doc:
            write_section(only.doc, *markers("moses_faults.py"), text)
        print(text)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--moses", required=True, help="moses binary built with the feature")
    ap.add_argument("--ini", type=Path, required=True)
    ap.add_argument("--kenlm", help="KenLM file put in place of LM_PATH in the ini")
    ap.add_argument("--model", type=Path, required=True, help="a self-normalised model with scoring tables")
    ap.add_argument("--order", type=int, default=5, help="NLM0's order= (the model's)")
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nlm-weight", type=float, default=0.1)
    ap.add_argument("--kill-after", type=float, default=2.0, help="seconds after Moses has loaded")
    ap.add_argument("--restart-after", type=float, default=1.0, help="seconds after the kill (case restart)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/nlmserve-moses-faults"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--render", type=Path, help="only write this JSON's table into --doc")
    ap.add_argument("--doc", type=Path, help="document with this script's section (markers "
                                              "'<!-- bench/moses_faults.py: begin -->' and '... end -->')")
    args = ap.parse_args(argv)
    if "local" in args.cases:
        require_scoring_tables(args.model, "case local")

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = work / "input.txt"
    lines = len(write_head(args.input, args.lines, src))
    info = machine()

    def ini_for(name: str, options: dict[str, str], target: str) -> Path:
        ini = work / f"{name}.ini"
        feature = feature_line({"normalized": "false", **options, "order": str(args.order)}, target, args.order)
        rewrite_ini(args.ini, args.kenlm, ini, feature, args.nlm_weight)
        return ini

    def output(path: Path) -> list[str]:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()

    undisturbed: dict[str, list[str]] = {}
    results: dict[str, Any] = {}
    for case in args.cases:
        options, comes_back = CASES[case]
        scoring = options["scoring"]
        if scoring not in undisturbed:
            server = start_server(args.model)
            try:
                out = work / f"undisturbed-{scoring}.out"
                status, _ = decode(args.moses, ini_for(f"undisturbed-{scoring}", {"scoring": scoring}, server.target),
                                   src, args.threads, out, work / f"undisturbed-{scoring}.log")
            finally:
                server.stop()
            if status != 0:
                raise SystemExit(f"the undisturbed {scoring} run failed (exit {status}): {work}/undisturbed-{scoring}.log")
            undisturbed[scoring] = output(out)
        server = start_server(args.model)
        port = server.target.rsplit(":", 1)[1]
        servers: list[ServerProcess] = [server]
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(args.kill_after)
            servers[0].process.kill()
            servers[0].process.wait()
            killed_at.append(time.monotonic())
            if comes_back:
                time.sleep(args.restart_after)
                servers.append(start_server(args.model, ["--port", port]))

        def on_loaded() -> None:
            threading.Thread(target=kill, daemon=True).start()

        out, log = work / f"{case}.out", work / f"{case}.log"
        print(f"{case}: decoding {lines} sentences, the server killed {args.kill_after} s after loading", flush=True)
        try:
            status, ended = decode(args.moses, ini_for(case, options, server.target), src, args.threads, out, log,
                                   on_loaded)
        finally:
            for s in servers:
                s.stop()
        got, want = output(out), undisturbed[scoring]
        run: dict[str, Any] = {
            "options": {"normalized": "false", **options}, "server_restarted": comes_back,
            "exit_status": status, "sentences_written": len(got),
            "identical": got == want, "prefix_identical": got == want[: len(got)],
            "killed": bool(killed_at),
            "seconds_from_kill_to_exit": round(ended - killed_at[0], 1) if killed_at else None,
            "output_sha256": hashlib.sha256("\n".join(got).encode()).hexdigest(),
            **log_facts(log.read_text(encoding="utf-8", errors="replace")),
        }
        if not killed_at:
            run["ok"], run["why"] = False, "the decoder finished before the kill (raise --lines)"
        else:
            run["ok"], run["why"] = verdict(case, run, lines)
        results[case] = run
        print(f"{case}: {'as expected' if run['ok'] else 'NOT as expected: ' + run['why']}: {run}", flush=True)

    result = {"machine": info, "commit": commit(), "argv": sys.argv[1:] if argv is None else argv,
              "lines": lines, "threads": args.threads, "kill_after_s": args.kill_after,
              "restart_after_s": args.restart_after, "cases": results}
    if args.json:
        write_json(args.json, result)
    text = render(result)
    if args.doc:
        write_section(args.doc, *markers("moses_faults.py"), text)
    print(text)
    return 0 if all(r["ok"] for r in results.values()) else 1


WHAT = {
    "fail": "`scoring=server`, `on-error=fail` (the default)",
    "floor": "`scoring=server`, `on-error=floor`",
    "restart": "`scoring=server`, `on-error=fail`; a new server on the same port {restart} s after the kill",
    "local": "`scoring=local`",
}


def exit_text(status: int) -> str:
    """An exit status as a shell would report it: a process ended by signal N as 128 + N."""
    if status >= 0:
        return str(status)
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    return f"{128 - status} ({name})"


def render(result: dict[str, Any]) -> str:
    """The section of this run: one row per case, the command last."""
    begin, end = markers("moses_faults.py")
    m = result["machine"]
    out = [begin, "",
           f"The first {result['lines']} sentences of `newstest2013.src`, `moses -threads {result['threads']}`, "
           f"`normalized=false`; the server killed (SIGKILL) {result['kill_after_s']} s after Moses loaded; "
           f"{m['cpu']}, {m['cores']} cores. Seconds: from the kill to the decoder's exit (`fail`: the "
           "feature's timeouts and retries at their defaults; the others: the rest of the decoding).", "",
           "| case | exit status | sentences written | failed / floored requests | seconds from the kill | "
           "output | as expected |",
           "|---|---|---|---|---|---|---|"]
    for case, r in result["cases"].items():
        what = WHAT[case].format(restart=result["restart_after_s"])
        counts = "—" if r["failed_requests"] is None else f"{r['failed_requests']} / {r['floored_requests']}"
        if r["identical"]:
            same = "identical to the undisturbed run"
        elif r["prefix_identical"]:
            same = "the undisturbed run's first lines"
        else:
            same = "differs from the undisturbed run"
        ok = "yes" if r["ok"] else f"**no**: {r['why']}"
        out.append(f"| {what} | {exit_text(r['exit_status'])} | {r['sentences_written']} of {result['lines']} | {counts} | "
                   f"{r['seconds_from_kill_to_exit']} | {same} | {ok} |")
    messages = [f"`{r['message']}`" for r in result["cases"].values() if r.get("message")]
    if messages:
        out += ["", "The feature's message: " + messages[0]]
    cmd = shown_command(" ".join(["bench/moses_faults.py", *result["argv"]]))
    out += ["", f"Command (code at commit {result['commit']}):", "", f"    {cmd}", "", end]
    return "\n".join(out)


if __name__ == "__main__":
    exit_with(main)
