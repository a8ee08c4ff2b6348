"""``nlmserve experiment`` (``make demo``): the whole path on shipped data.

train a small NLM (``nlmserve train``, subprocess) → [add a Kneser-Ney feature,
``--kenlm``] → rescore the dev and test n-best lists with it → MERT (or MIRA) on dev
without and with NLM0 → rerank test → BLEU, paired bootstrap p-values → a table
(Markdown, JSON, PNG).

The lists are rescored with the model file in this process (``rescore --model``), with no
server; ``--via-server`` serves the model instead (``nlmserve serve --port 0``, a
subprocess, stopped in ``finally``) and rescores through it, and ``--server TARGET`` uses
a running server. A model file and a server of it give the same lists byte for byte
(``moses_plugin.model_source``); the report's ``source`` says which was used.

Every step writes its output into the work directory and is skipped when that output
exists, so a rerun resumes where an interrupted one stopped (training resumes from its
own checkpoint, rescoring from its sidecar); ``WORKDIR/inputs.json`` records what the
outputs were made from, and a run with other inputs is refused (``workdir.py``). Its steps
once the model is known are ``steps.py``'s; its settings ``config.ExperimentConfig``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import lzma
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Iterator, cast

from ..common.errors import NlmserveError
from ..common.serve_process import ServerProcess, nlmserve_command, start_server
from .config import ExperimentConfig

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..common.flags import int_at_least, positive_float
    from ..moses_plugin.nbest import feature_name

    d = ExperimentConfig()
    p.add_argument("--workdir", default=d.workdir, help=f"outputs, reused on a rerun (default {d.workdir})")
    p.add_argument("--train-text", nargs="+", default=list(d.train_text),
                   help="NLM training text: one or more files, read in order (name a file twice to count it twice)")
    p.add_argument("--valid-text", default=d.valid_text, help="NLM validation text")
    p.add_argument("--dev-nbest", default=d.dev_nbest, help="tuning n-best list")
    p.add_argument("--dev-ref", nargs="+", default=list(d.dev_ref), help="tuning references")
    p.add_argument("--test-nbest", default=d.test_nbest, help="test n-best list")
    p.add_argument("--test-ref", nargs="+", default=list(d.test_ref), help="test references")
    p.add_argument("--steps", type=int_at_least(0), default=d.steps,
                   help=f"training budget in optimiser steps: the same steps train the same model on any machine "
                        f"(default {d.steps}; 0: none, --minutes bounds the training)")
    p.add_argument("--minutes", type=positive_float, default=d.minutes,
                   help=f"wall-time safety limit on training (default {d.minutes}); a run it stops is not reproducible")
    p.add_argument("--train-args", default=" ".join(d.train_args), help="extra `nlmserve train` flags (one string)")
    p.add_argument("--model", help="use this model file (no training)")
    served = p.add_mutually_exclusive_group()
    served.add_argument("--server", help="rescore through this running server HOST:PORT, or replicas "
                                         "HOST:PORT,HOST:PORT or dns:///NAME:PORT (no model, no training)")
    served.add_argument("--via-server", action="store_true",
                        help="serve the model (nlmserve serve, a subprocess) and rescore through it, instead of "
                             "scoring it in this process")
    p.add_argument("--tuner", choices=("mert", "mira"), default=d.tuner,
                   help="mert (Och's line search) or mira (batch k-best MIRA, as Moses' kbmira) (default mert)")
    p.add_argument("--kenlm", help="a Kneser-Ney model (ARPA or KenLM binary) added as a second LM feature "
                                   "before NLM0: the table compares TUNER, TUNER+KN1 and TUNER+KN1+NLM0")
    p.add_argument("--kenlm-name", type=feature_name, default=d.kenlm_name, help=f"its feature name (default {d.kenlm_name})")
    p.add_argument("--restarts", type=int_at_least(0), default=d.restarts, help="MERT random restarts")
    p.add_argument("--seed", type=int, default=d.seed, help="tuning seed")
    runs = p.add_argument("--runs", dest="mert_runs", type=int_at_least(1), default=d.mert_runs,
                          help="tune each system N times (seeds SEED..SEED+N-1); the table gives mean ± sd and "
                               "a p-value over the runs (default 1)")
    from ..common.flags import deprecated_spelling

    deprecated_spelling(p, "--mert-runs", runs)
    p.add_argument("--samples", type=int_at_least(1), default=d.samples, help="paired bootstrap resamples")
    p.add_argument("--lowercase", action="store_true", help="lowercase hypotheses (LM and BLEU)")
    from ..client.cli import add_security_flags

    add_security_flags(p)  # for --server; a server started by --via-server is plaintext on 127.0.0.1


def run_from_args(args: argparse.Namespace) -> int:
    config = ExperimentConfig(
        workdir=args.workdir, train_text=tuple(args.train_text), valid_text=args.valid_text,
        dev_nbest=args.dev_nbest, dev_ref=tuple(args.dev_ref), test_nbest=args.test_nbest,
        test_ref=tuple(args.test_ref), steps=args.steps, minutes=args.minutes, train_args=tuple(args.train_args.split()),
        model=args.model, server=args.server, via_server=args.via_server, tuner=args.tuner, kenlm=args.kenlm,
        kenlm_name=args.kenlm_name, restarts=args.restarts, seed=args.seed,
        mert_runs=args.mert_runs, samples=args.samples, lowercase=args.lowercase,
    )
    from .report import format_table

    from ..client.cli import security_kwargs

    report = run(config, security_kwargs(args))
    print(format_table(report))
    print(f"wrote {report['files']['markdown']}, {report['files']['json']} and {report['files']['chart']}")
    return 0


def training_text(paths: tuple[str, ...], work: Path) -> str:
    """The one training text, or ``work/train.txt``: the files' lines one after the other.

    The joined file is written under a temporary name and renamed when complete, and reused
    when it exists (as the model is), so a rerun does not join again.
    """
    if not paths:
        raise NlmserveError("no training text")
    if len(paths) == 1:
        return paths[0]
    out = work / "train.txt"
    if out.exists():
        return str(out)
    tmp = work / f".train.txt.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as dst:
            for name in paths:
                for line in _binary_lines(name):
                    dst.write(line if line.endswith(b"\n") else line + b"\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("training text: %s joined into %s", " + ".join(paths), out)
    return str(out)


def _binary_lines(name: str) -> Iterator[bytes]:
    try:
        opened = cast(IO[bytes], gzip.open(name, "rb") if name.endswith(".gz")
                      else lzma.open(name, "rb") if name.endswith(".xz") else open(name, "rb"))
    except OSError as exc:
        raise NlmserveError(f"training text {name}: {exc.strerror or exc}") from exc
    with opened as handle:
        try:
            yield from handle
        except (OSError, EOFError, lzma.LZMAError) as exc:
            raise NlmserveError(f"training text {name}: damaged or unreadable: {exc}") from exc


def training_flags(config: ExperimentConfig) -> list[str]:
    """The budget flags of ``nlmserve train``, then ``train_args``: bounded by steps (wall
    time only as a safety limit), or by ``minutes`` alone when ``steps`` is 0."""
    if config.steps < 0:
        raise NlmserveError(f"--steps must be 0 (no step budget) or more, not {config.steps}")
    budget = ["--max-steps", str(config.steps)] if config.steps else []
    return [*budget, "--max-minutes", str(config.minutes), *config.train_args]


def training_command(config: ExperimentConfig, train: str, out: Path) -> list[str]:
    """``nlmserve train`` as the experiment runs it (resuming its own checkpoint)."""
    return [*nlmserve_command(), "train", "--train", train, "--valid", config.valid_text, "--out", str(out),
            "--resume", *training_flags(config)]


def training_end(out: Path) -> dict[str, Any]:
    """The ``end`` record of ``out``'s training log (``stopped``, ``step``, ``best_ppl``), or {}."""
    end: dict[str, Any] = {}
    try:
        with open(f"{out}.log.jsonl", encoding="utf-8") as handle:
            for line in handle:
                if '"end"' in line:
                    record = json.loads(line)
                    if record.get("event") == "end":
                        end = record
    except (OSError, ValueError):
        return {}
    return end


def train_model(config: ExperimentConfig, out: Path) -> Path:
    """``nlmserve train`` in a subprocess (resuming its checkpoint); skipped when ``out`` exists."""
    if out.exists():
        log.info("model %s exists; not training", out)
        return out
    cmd = training_command(config, training_text(config.train_text, out.parent), out)
    log.info("training: %s", " ".join(cmd))
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        raise NlmserveError(f"training failed (exit {done.returncode}): {' '.join(cmd)}")
    end = training_end(out)
    if end.get("stopped") == "max minutes" and config.steps:
        log.warning("training hit the --minutes %g safety limit at step %s of %d: this model (and the table) "
                    "differ from a run that trains all the steps; on a busy machine raise --minutes and use a "
                    "new --workdir", config.minutes, end.get("step"), config.steps)
    return out


def check_files(config: ExperimentConfig) -> None:
    """The work directory, then every input the experiment will read, checked before any
    work (``nlmserve.common.paths``): InputError naming the first that cannot be used."""
    from ..common.paths import ANY, LIST, MODEL, TEXT, check_input, check_output_dir

    check_output_dir(config.workdir)
    trains = config.model is None and config.server is None
    for path in config.train_text if trains else ():
        check_input(path, TEXT, empty_ok=False)
    if trains:
        check_input(config.valid_text, TEXT, empty_ok=False)
    if config.model is not None:
        check_input(config.model, MODEL)
    for path in (config.dev_nbest, *config.dev_ref, config.test_nbest, *config.test_ref):
        check_input(path, LIST, empty_ok=False)
    if config.kenlm:
        check_input(config.kenlm, ANY)


def run(config: ExperimentConfig, client_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run (or resume) the experiment; returns the report also saved as JSON.

    ``client_kwargs``: TLS and token arguments of ``LMClient`` for ``config.server``.
    """
    from ..moses_plugin.nbest import check_feature_name
    from .steps import FEATURE, TUNERS, NlmSource, Pipeline

    if config.mert_runs < 1:
        raise NlmserveError(f"--runs must be at least 1, not {config.mert_runs}")
    if config.server is not None and config.via_server:
        raise NlmserveError("--via-server serves the experiment's model; --server names a running server: give one")
    if config.tuner not in TUNERS:
        raise NlmserveError(f"unknown tuner {config.tuner!r}: use one of {', '.join(TUNERS)}")
    if config.kenlm:
        try:
            check_feature_name(config.kenlm_name)
        except ValueError as e:
            raise NlmserveError(f"--kenlm-name: {e}") from e
        if config.kenlm_name == FEATURE:
            raise NlmserveError(f"--kenlm-name {FEATURE} is the neural model's feature: choose another name")
    check_files(config)
    work = Path(config.workdir)
    work.mkdir(parents=True, exist_ok=True)
    from .workdir import check_workdir

    check_workdir(config, work, trains=config.model is None and config.server is None)
    started = time.monotonic()
    server: ServerProcess | None = None
    try:
        if config.server is not None:
            source = NlmSource.server(config.server, client_kwargs)
        else:
            model = Path(config.model) if config.model else train_model(config, work / "nlm.model")
            if config.via_server:
                server = start_server(model)
                source = NlmSource.server(server.target, started=True)
            else:
                source = NlmSource.model_file(model)
        report = Pipeline(config, work, source).run()
    finally:
        if server is not None:
            server.stop()
    report["seconds"] = time.monotonic() - started
    report["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
    from .report import save_report

    save_report(report, work)
    return report
