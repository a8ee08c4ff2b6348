#!/usr/bin/env python3
"""EMS's ``custom-training`` for nlmserve's neural LM: ``nlmserve train``, then ``nlmserve
export-tables``, as Moses' ``train-neurallm.py`` is NPLM's.

experiment.perl runs an ``[LM:...]`` section's ``custom-training`` value as

    CUSTOM-TRAINING -text IN -lm OUT

(experiment.meta, step ``train-custom``): IN is the section's prepared text, OUT the step's
output. This script trains a model on IN into DIR/model.nlm, writes its tables file
DIR/model.nlt (the file the section's ``config-feature-line`` names: ``tables=DIR/model.nlt``),
writes what ``nlmserve moses-ini --tables`` prints for that file into DIR/moses-ini.txt (the
line to compare with ``config-feature-line``), and links OUT to the tables file. Every option
it does not know goes to ``nlmserve train`` unchanged (``--order 5 --max-minutes 60 --valid
dev.en``, ...); ``--train`` and ``--out`` are its own.

EMS runs a step as a shell script without ``set -e`` and takes it for crashed only when the
step's stderr holds one of its error words (``error``, ``exception``, ``killed``, ``abort``,
...: experiment.perl's ``check_if_crashed``). So nlmserve's own log lines go to DIR/train.log,
DIR/export-tables.log and DIR/moses-ini.log, never to stderr, where a word of a long training
log could match; stderr gets one line per finished command, and for a failed one a line that
begins ``ERROR:`` with the last lines of its log; the exit status is then the command's.
nlmserve's results (stdout) go to stdout, which EMS keeps in the step's ``.STDOUT`` file.

Standard library only: EMS's machine needs Python 3.8 or later and the nlmserve program
(``--nlmserve``, default ``nlmserve`` on PATH). Exit status: 0 done, 2 a usage error, else
that of the nlmserve command that failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import IO

#: The names of what the script writes into DIR.
MODEL = "model.nlm"
TABLES = "model.nlt"
LINE = "moses-ini.txt"

#: How many of a failed command's last log lines go to stderr.
TAIL_LINES = 20

#: ``nlmserve train`` flags that the script sets itself.
OWN_TRAIN_FLAGS = ("--train", "--out")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's own options and the rest, for ``nlmserve train``."""
    p = argparse.ArgumentParser(
        prog="train-nlm.py", allow_abbrev=False,
        description="EMS custom-training: nlmserve train, then export-tables; options it does not know "
                    "go to nlmserve train",
        usage="%(prog)s --dir DIR [--nlmserve PATH] [--quantize none|fp16|int8] [nlmserve train flags] "
              "-text IN -lm OUT")
    p.add_argument("--dir", required=True, help="where the model, its tables file and the logs go")
    p.add_argument("--nlmserve", default="nlmserve", help="the nlmserve program (default: nlmserve on PATH)")
    p.add_argument("--quantize", choices=("none", "fp16", "int8"), default="none",
                   help="export-tables --quantize (default none: float32)")
    p.add_argument("-text", dest="text", required=True, help="the training text (EMS's IN)")
    p.add_argument("-lm", dest="lm", required=True, help="the step's output (EMS's OUT): linked to the tables file")
    args, train_flags = p.parse_known_args(argv)
    own = [f for f in train_flags if f.split("=", 1)[0] in OWN_TRAIN_FLAGS]
    if own:
        p.error(f"{' '.join(own)}: set by this script (-text is the training text, --dir where the model goes)")
    return args, train_flags


def run(name: str, command: list[str], log: str, stdout: IO[bytes] | None = None) -> None:
    """Run ``command`` with its stderr in ``log``; on failure say so on stderr (a line that begins
    ERROR:, then the log's last lines) and exit with its status."""
    with open(log, "wb") as err:
        try:
            status = subprocess.call(command, stdout=stdout, stderr=err)
        except OSError as e:
            sys.stderr.write(f"ERROR: train-nlm.py: cannot run {command[0]}: {e.strerror} "
                             "(give the nlmserve program with --nlmserve)\n")
            sys.exit(127)
    if status != 0:
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-TAIL_LINES:]
        sys.stderr.write(f"ERROR: train-nlm.py: nlmserve {name} failed with exit status {status}; "
                         f"its log, {log}, ends:\n" + "".join(tail))
        sys.exit(status if 0 < status < 256 else 1)
    sys.stderr.write(f"train-nlm.py: nlmserve {name} done (log: {log})\n")


def link(target: str, name: str) -> None:
    """``name`` a symbolic link to ``target`` (a link already there is replaced)."""
    tmp = name + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, name)


def main(argv: list[str] | None = None) -> int:
    args, train_flags = parse(sys.argv[1:] if argv is None else argv)
    folder = os.path.abspath(args.dir)
    os.makedirs(folder, exist_ok=True)
    model, tables, line = (os.path.join(folder, name) for name in (MODEL, TABLES, LINE))
    run("train", [args.nlmserve, "train", "--train", args.text, "--out", model, *train_flags],
        os.path.join(folder, "train.log"))
    run("export-tables", [args.nlmserve, "export-tables", "--model", model, "--out", tables,
                          "--quantize", args.quantize], os.path.join(folder, "export-tables.log"))
    with open(line, "wb") as out:
        run("moses-ini", [args.nlmserve, "moses-ini", "--tables", tables], os.path.join(folder, "moses-ini.log"),
            stdout=out)
    link(tables, os.path.abspath(args.lm))
    with open(line, encoding="utf-8") as f:
        feature = [x.strip() for x in f if x.startswith("NeuralLMServer ")]
    sys.stderr.write(f"train-nlm.py: {args.lm} -> {tables}; the feature line for it: {' '.join(feature)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
