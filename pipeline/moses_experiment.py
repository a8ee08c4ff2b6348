"""``nlmserve moses-experiment``: the neural LM inside Moses, end to end, as Moses' EMS runs
a baseline: (train a model →) write its tables file → tune each system with Moses' own
``mert-moses.pl`` (MERT or batch MIRA) on a dev set → decode the test set with each tuned
moses.ini → BLEU of each, with a paired bootstrap p-value against KENLM alone.

The systems: ``moses``, the given moses.ini as it is (KENLM alone), and one more per model,
the same ini plus the ``NeuralLMServer`` line ``nlmserve moses-ini`` derives from the model
(its order and scoring) and NLM0's starting weight. A model with scoring tables is decoded
from its tables file (``nlmserve export-tables``, written into the workdir once): the
server-free line ``tables=FILE``, no server started. A model without tables, or any model
with ``--serve``, is served by ``nlmserve serve`` for its tunings and decodings (``path=``).
Each system is tuned once per seed. Resumable: a tuning with a finished iteration continues
(mert-moses.pl ``--continue``), a finished tuning and a finished test decoding are kept (and
said to be); the workdir holds one tuner's runs. While mert-moses.pl and Moses run, a line
every :data:`PROGRESS_EVERY_S` seconds says where they are (the tuning's iteration and the
dev BLEU of each finished one, the test sentences decoded). Results: ``results.json`` and
``results.md`` in the workdir, and the table on stdout, with the feature line each system ran
and a note where the tuning stopped at ``--max-iterations`` while its dev BLEU still rose.

The steps that the research harness (experiments/moses_mert.py) shares are owned here:
subsets of the dev and test sets, the mert tools, one tuning, one test decoding, a tuned
moses.ini pointed at a restarted server, and the table's rows (each run's BLEU, the mean,
and Δ and the paired bootstrap against the first system over the seeds both have).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Protocol

from ..common.errors import InputError
from ..common.flags import int_at_least, positive_float

if TYPE_CHECKING:
    from ..moses_plugin.bleu import BleuConfig

log = logging.getLogger(__name__)

MERT_TOOLS = ("extractor", "mert", "kbmira", "pro", "evaluator")

#: Seconds between two progress lines while mert-moses.pl or Moses runs (a line is written only
#: when there is news).
PROGRESS_EVERY_S = 30.0


class TuneSettings(Protocol):
    """What a tuning reads of the command line (argparse's namespace has these)."""

    moses_root: Path
    ini: Path
    kenlm: str | None
    tuner: str
    nbest: int
    threads: int
    max_iterations: int
    nlm_weight: float


def tuned_with(work: Path) -> str | None:
    """The tuner of mert-moses.pl's finished first iteration in ``work`` (batch MIRA leaves
    ``run1.mira.out`` beside ``run1.mert.out``), None before it: the working folder's layout
    does not name the tuner, so a workdir of MERT runs must not be continued or reported as
    MIRA's."""
    if (work / "run1.mira.out").exists():
        return "mira"
    return "mert" if (work / "run1.mert.out").exists() else None


def can_continue(work: Path) -> bool:
    """Whether mert-moses.pl's ``--continue`` can resume the tuning in ``work``: it needs the
    ``finished_step.txt`` written after each finished iteration."""
    return (work / "finished_step.txt").exists()


def find_mertdir(root: Path, work: Path) -> Path:
    """A folder of links to the mert tools found under ``root`` (bjam leaves each in its bin/)."""
    out = work / "mertdir"
    out.mkdir(parents=True, exist_ok=True)
    for tool in MERT_TOOLS:
        link = out / tool
        if link.exists():
            continue
        found = sorted(p for p in (root / "mert" / "bin").rglob(tool) if p.is_file() and os.access(p, os.X_OK))
        if not found:
            raise InputError(f"{tool} not found under {root / 'mert' / 'bin'}: build it with "
                             f"./bjam mert//{tool} (or give --mertdir)")
        link.symlink_to(found[0])
    return out


def find_moses(root: Path) -> Path:
    """The moses binary of a Moses checkout: bin/moses after a full build, else the one bjam
    left under moses-cmd/bin."""
    if (root / "bin" / "moses").is_file():
        return root / "bin" / "moses"
    found = sorted(p for p in (root / "moses-cmd" / "bin").rglob("moses") if p.is_file() and os.access(p, os.X_OK))
    if not found:
        raise InputError(f"no moses binary under {root} (bin/ or moses-cmd/bin/): build it as docs/moses.md "
                         "says, or give --moses")
    return found[0]


def subset(src: Path, every: int, limit: int | None, out: Path) -> int:
    """Every ``every``-th line of ``src`` (at most ``limit``) into ``out`` (rewritten only
    when it changes) → how many."""
    with open(src, encoding="utf-8") as f:
        lines = [line for i, line in enumerate(f) if i % every == 0]
    if limit is not None:
        lines = lines[:limit]
    if not out.exists() or out.read_text(encoding="utf-8") != "".join(lines):
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(lines), encoding="utf-8")
        tmp.replace(out)
    return len(lines)


def count_lines(path: Path) -> int:
    """Lines of ``path``, -1 when it does not exist."""
    if not path.exists():
        return -1
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@dataclass(frozen=True)
class Finished:
    """A command run to its end: its exit status, wall seconds, CPU seconds (user + system)
    and largest resident set in bytes, of the process and the children it waited for (Linux
    counts the caller's resident set at the fork too, until the command's exec)."""

    code: int
    wall: float
    cpu: float
    maxrss: int


def run_watched(cmd: list[str], progress: Callable[[], str | None], *, stdout: IO[bytes],
                stdin: IO[bytes] | None = None, stderr: IO[bytes] | int | None = subprocess.STDOUT,
                cwd: Path | None = None) -> Finished:
    """Run ``cmd`` to its end → its :class:`Finished`; meanwhile, every :data:`PROGRESS_EVERY_S`
    seconds, log what ``progress()`` says when it says something new (a tuning or a decoding
    takes minutes, and a command that is silent for minutes looks stuck). The decoding
    loop of the pipelines and of bench/decoder.py, which times Moses by it."""
    stop = threading.Event()

    def watch() -> None:
        last: str | None = None
        while not stop.wait(PROGRESS_EVERY_S):
            now = progress()
            if now is not None and now != last:
                log.info("%s", now)
                last = now

    watcher = threading.Thread(target=watch, name="progress", daemon=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd)
    watcher.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
    except BaseException:  # interrupted: the command does not outlive its caller
        proc.kill()
        proc.wait()
        raise
    finally:
        stop.set()
        watcher.join()
    return Finished(proc.returncode, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)  # Linux: KiB


class DevBleu:
    """The dev BLEU of each iteration of a tuning: the BLEU of mert-moses.pl's ``run{i}.out``
    (the 1-best of the dev set decoded with iteration i's weights) against the dev reference,
    each file scored once."""

    def __init__(self, work: Path, dev_ref: Path) -> None:
        self.work = work
        self.dev_ref = dev_ref
        self.refs: list[list[str]] = []  # read when first needed
        self.scores: list[float] = []

    def decoded(self, i: int) -> int:
        """Dev sentences decoded so far in iteration ``i`` (-1: not started)."""
        return count_lines(self.work / f"run{i}.out")

    def sentences(self) -> int:
        """The dev set's sentences."""
        from ..moses_plugin.bleu import read_references

        if not self.refs:
            self.refs = read_references([str(self.dev_ref)])
        return len(self.refs[0])

    def __call__(self) -> list[float]:
        """The BLEU of every iteration decoded in full so far, first to last."""
        from ..moses_plugin.bleu import BleuConfig, corpus_bleu

        n = self.sentences()
        while self.decoded(len(self.scores) + 1) == n:
            path = self.work / f"run{len(self.scores) + 1}.out"
            hyps = path.read_text(encoding="utf-8").splitlines()
            self.scores.append(round(corpus_bleu(hyps, self.refs, BleuConfig())[0].score, 2))
        return self.scores


def still_rising(record: dict[str, Any], max_iterations: int) -> bool:
    """Whether a tuning stopped at ``max_iterations`` while its dev BLEU still rose (its last
    iteration's 1-best better than the one before)."""
    bleu = record.get("dev_bleu") or []
    return record["iterations"] >= max_iterations and len(bleu) >= 2 and bleu[-1] > bleu[-2]


def tune(settings: TuneSettings, feature: str | None, moses: str, seed: int, mertdir: Path, dev_src: Path,
         dev_ref: Path, base: Path, label: str) -> dict[str, Any]:
    """One tuning of the system ``settings.ini`` (+ the ``feature`` line of NLM0 when given)
    with mert-moses.pl in ``base/tune``, continued where a finished iteration allows →
    iterations, wall time and the tuned ini."""
    from ..moses_plugin.moses_ini import rewrite_ini

    work = base / "tune"
    done_with = tuned_with(work)
    if done_with not in (None, settings.tuner):
        raise InputError(f"{work} was tuned with {done_with}, not {settings.tuner}: "
                         f"give --tuner {done_with}, or another --workdir for {settings.tuner}")
    tuned = work / "moses.ini"
    ini = base / "start.ini"
    # When the tuning first started (the ini is rewritten by every invocation: a restarted
    # server has another port, and mert-moses.pl --continue builds each run's ini from it).
    first = base / "tune.started"
    if work.exists() and not tuned.exists() and not can_continue(work):
        # Stopped inside its first iteration: mert-moses.pl --continue would die on the
        # missing finished_step.txt, so the tuning starts again, its clock too.
        shutil.rmtree(work)
        first.unlink(missing_ok=True)
    if not first.exists():
        first.write_text(f"{ini.stat().st_mtime if ini.exists() else time.time():.3f}\n")
    first_start = float(first.read_text())
    rewrite_ini(settings.ini, settings.kenlm, ini, feature, settings.nlm_weight)
    started = time.monotonic()
    if not tuned.exists():
        cmd = ["perl", str(settings.moses_root / "scripts" / "training" / "mert-moses.pl"),
               str(dev_src.resolve()), str(dev_ref.resolve()), str(Path(moses).resolve()), str(ini.resolve()),
               "--mertdir", str(mertdir.resolve()), "--working-dir", str(work.resolve()),
               "--no-filter-phrase-table", "--nbest", str(settings.nbest),
               "--decoder-flags", f"-threads {settings.threads}",
               "--maximum-iterations", str(settings.max_iterations)]
        if settings.tuner == "mira":
            cmd += ["--batch-mira", "--batch-mira-args", f"--random-seed {seed}"]
        else:
            cmd += ["--mertargs", f"-r {seed}"]
        if can_continue(work):
            cmd.append("--continue")
        mert_log = base / "mert.log"
        log.info("%s seed %s: tuning with %s, at most %d iterations (log: %s)", label, seed, settings.tuner,
                 settings.max_iterations, mert_log)
        bleu = DevBleu(work, dev_ref)

        def progress() -> str:
            done = bleu()
            running = len(done) + 1
            decoded = bleu.decoded(running)
            if running > settings.max_iterations:  # mert-moses.pl optimises the last one and stops
                now = (f"{label} seed {seed}: tuning: all {settings.max_iterations} iterations decoded, "
                       "optimising the last one's weights and writing the tuned moses.ini")
            else:
                now = (f"{label} seed {seed}: tuning iteration {running} of at most {settings.max_iterations}, "
                       f"{max(decoded, 0)} of {bleu.sentences()} dev sentences decoded")
            finished = "iteration 1" if len(done) == 1 else f"iterations 1-{len(done)}"
            return now + (f"; dev BLEU of {finished}: {', '.join(f'{b:.2f}' for b in done)}" if done else "")

        with open(mert_log, "ab") as f:
            code = run_watched(cmd, progress, stdout=f, cwd=base).code
        if code != 0 or not tuned.exists():
            raise InputError(f"mert-moses.pl failed ({code}) for {label} seed {seed}: see {mert_log}")
    else:
        log.info("%s seed %s: tuned before, reusing %s", label, seed, tuned)
    nbests = sorted(work.glob("run*.best*.out.gz"), key=lambda p: p.stat().st_mtime)
    times = [p.stat().st_mtime for p in nbests]
    steps = [b - a for a, b in zip([first_start, *times[:-1]], times)]
    dev_bleu = DevBleu(work, dev_ref)()
    record: dict[str, Any] = {"iterations": len(nbests), "tuning_wall_s": round(tuned.stat().st_mtime - first_start, 1),
                              "seconds_per_iteration": round(statistics.mean(steps), 1) if steps else None,
                              "this_invocation_s": round(time.monotonic() - started, 1), "ini": str(tuned),
                              "dev_bleu": dev_bleu}
    if still_rising(record, settings.max_iterations):
        log.warning("%s seed %s: stopped at --max-iterations %d while its dev BLEU still rose (%s): more "
                    "iterations may move its test BLEU", label, seed, settings.max_iterations,
                    ", ".join(f"{b:.2f}" for b in dev_bleu[-3:]))
    return record


def decode_test(moses: str, threads: int, tuned_ini: Path, test_src: Path, out: Path, n: int,
                label: str = "") -> float:
    """Decode ``test_src`` into ``out`` → seconds it took (a finished decoding is kept, and its
    time read back from ``out``.seconds); ``label`` starts its progress lines."""
    seconds = out.with_suffix(".seconds")
    if count_lines(out) == n:
        log.info("%stest set decoded before, reusing %s", label, out)
        return float(seconds.read_text()) if seconds.exists() else 0.0
    tmp = out.with_name(out.name + ".tmp")
    start = time.monotonic()
    log.info("%sdecoding %d test sentences (log: %s)", label, n, out.with_suffix(".log"))

    def progress() -> str:
        return f"{label}{max(count_lines(tmp), 0)} of {n} test sentences decoded in {time.monotonic() - start:.0f} s"

    with open(test_src, "rb") as fin, open(tmp, "wb") as fout, open(out.with_suffix(".log"), "wb") as ferr:
        code = run_watched([moses, "-f", str(tuned_ini), "-threads", str(threads)], progress, stdin=fin, stdout=fout,
                           stderr=ferr).code
    if code != 0 or count_lines(tmp) != n:
        raise InputError(f"decoding {test_src} with {tuned_ini} failed: see {out.with_suffix('.log')}")
    took = time.monotonic() - start
    seconds.write_text(f"{took:.1f}\n")
    tmp.replace(out)
    return took


@dataclass(frozen=True)
class Sets:
    """The tuning and test sets of one run, as written into its workdir by :func:`write_sets`."""

    dev_src: Path
    dev_ref: Path
    dev_lines: int
    test_src: Path
    test_ref: Path
    test_lines: int


def write_sets(args: argparse.Namespace, work: Path) -> Sets:
    """The subsets :func:`add_set_arguments`' flags choose, written into ``work`` (``dev.src``,
    ``dev.ref``, ``test.src``, ``test.ref``); InputError when a source and its reference hold
    different numbers of sentences."""
    dev_src, dev_ref = work / "dev.src", work / "dev.ref"
    n_dev = subset(args.dev_src, args.dev_every, args.dev_lines, dev_src)
    if subset(args.dev_ref, args.dev_every, args.dev_lines, dev_ref) != n_dev:
        raise InputError(f"{args.dev_src} and {args.dev_ref} hold different numbers of sentences")
    test_src, test_ref = work / "test.src", work / "test.ref"
    n_test = subset(args.test_src, 1, args.test_lines, test_src)
    if subset(args.test_ref, 1, args.test_lines, test_ref) != n_test:
        raise InputError(f"{args.test_src} and {args.test_ref} hold different numbers of sentences")
    return Sets(dev_src, dev_ref, n_dev, test_src, test_ref, n_test)


def retarget(tuned: Path, base: Path, target: str) -> Path:
    """``tuned`` (a tuned moses.ini) asking the server at ``target``, as ``base/tuned.ini``: a
    server started again for the test decoding may listen on another port than the tuning's."""
    from ..moses_plugin.moses_ini import with_server

    out = base / "tuned.ini"
    out.write_text(with_server(tuned.read_text(encoding="utf-8"), target), encoding="utf-8")
    return out


class Outputs:
    """Each run's test output (the file its record's ``output`` names), read once."""

    def __init__(self) -> None:
        self.read: dict[str, list[str]] = {}

    def __call__(self, run: dict[str, Any]) -> list[str]:
        if run["output"] not in self.read:
            self.read[run["output"]] = Path(run["output"]).read_text(encoding="utf-8").splitlines()
        return self.read[run["output"]]


def bleu_row(runs: list[dict[str, Any]], refs: list[list[str]], outputs: Outputs,
             config: "BleuConfig") -> dict[str, Any]:
    """The test BLEU of each of a system's runs (also written into each run as ``bleu``),
    their mean, standard deviation (None for one run) and sacrebleu's signature."""
    from ..moses_plugin.bleu import corpus_bleu

    scores, signature = [], ""
    for r in runs:
        score, signature = corpus_bleu(outputs(r), refs, config)
        r["bleu"] = round(score.score, 2)
        scores.append(score.score)
    return {"bleu": [round(x, 2) for x in scores], "mean": round(statistics.mean(scores), 2),
            "sd": round(statistics.stdev(scores), 2) if len(scores) > 1 else None, "signature": signature}


def same_seeds(baseline: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(baseline run, run) for each seed both have, in the order of ``runs``: the outputs the
    paired bootstrap joins."""
    by_seed = {b["seed"]: b for b in baseline}
    return [(by_seed[r["seed"]], r) for r in runs if r["seed"] in by_seed]


def compare(row: dict[str, Any], baseline: dict[str, Any], refs: list[list[str]], outputs: Outputs,
            config: "BleuConfig") -> None:
    """``row``'s ``delta`` (its mean BLEU less ``baseline``'s) and ``p`` (sacrebleu's paired
    bootstrap over the seeds both rows have, each run's output joined after the one before
    and paired with the baseline's run of the same seed); nothing when they share no seed."""
    from ..moses_plugin.bleu import paired_bootstrap

    pairs = same_seeds(baseline["runs"], row["runs"])
    if not pairs:
        return
    joined = [line for _, r in pairs for line in outputs(r)]
    base = [line for b, _ in pairs for line in outputs(b)]
    paired = paired_bootstrap(base, joined, [list(col) * len(pairs) for col in refs], config)
    row["delta"] = round(row["mean"] - baseline["mean"], 2)
    row["p"] = paired.p_value


@dataclass
class System:
    """A system of the experiment: its name, and the model of NLM0 (None: KENLM alone)."""

    name: str
    model: str | None


def parse_models(values: list[str]) -> list[System]:
    """``--model [NAME=]FILE`` → the systems: ``moses`` first, then one per model (named by
    NAME or the file's stem); a name used twice, or ``moses``, is refused."""
    systems = [System("moses", None)]
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).stem, value
        if not name or name in {s.name for s in systems} or "/" in name:
            raise InputError(f"--model {value}: give each model a name of its own (NAME=FILE), not {name!r}")
        if not Path(path).is_file():
            raise InputError(f"--model {value}: no such file")
        systems.append(System(name, path))
    return systems


def add_set_arguments(p: argparse.ArgumentParser, dev_every: int = 1) -> None:
    """The tuning and test sets' flags (for :func:`subset`)."""
    p.add_argument("--dev-src", required=True, type=Path)
    p.add_argument("--dev-ref", required=True, type=Path)
    p.add_argument("--dev-every", type=int_at_least(1), default=dev_every, help="tune on every k-th dev sentence")
    p.add_argument("--dev-lines", type=int_at_least(1), help="at most this many dev sentences")
    p.add_argument("--test-src", required=True, type=Path)
    p.add_argument("--test-ref", required=True, type=Path)
    p.add_argument("--test-lines", type=int_at_least(1), help="only the first N test sentences")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moses-root", required=True, type=Path,
                   help="the Moses checkout the feature was built into (scripts/training/mert-moses.pl, mert/)")
    p.add_argument("--moses", help="the moses binary (default: the one under --moses-root)")
    p.add_argument("--mertdir", type=Path, help="extractor, mert, kbmira, pro, evaluator (default: found under "
                                                "--moses-root's mert/bin)")
    p.add_argument("--ini", required=True, type=Path, help="the system's moses.ini (KENLM alone; relative table "
                                                           "paths are taken from its folder)")
    p.add_argument("--kenlm", help="KenLM file put in place of LM_PATH in the ini, when it has one")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", action="append", metavar="[NAME=]FILE",
                       help="a model file: the system KENLM + NLM0 of it (repeat for more systems)")
    model.add_argument("--train-text", nargs="+", metavar="TEXT",
                       help="train the model first (`nlmserve train`, its recipe) on these texts")
    p.add_argument("--valid-text", help="with --train-text: its validation text")
    p.add_argument("--minutes", type=positive_float, default=20.0, help="with --train-text: the training budget")
    add_set_arguments(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="one tuning of each system per seed")
    p.add_argument("--tuner", choices=["mert", "mira"], default="mert")
    p.add_argument("--max-iterations", type=int_at_least(1), default=25)
    p.add_argument("--nbest", type=int_at_least(1), default=100)
    p.add_argument("--threads", type=int_at_least(1), default=2, help="decoder threads")
    p.add_argument("--nlm-weight", type=float, default=None,
                   help="NLM0's starting weight (default: moses-ini's, a tenth of the ini's weights' L1 norm)")
    p.add_argument("--serve", action="store_true",
                   help="serve each model with nlmserve serve and give the feature its address (path=), instead "
                        "of the server-free line that maps the model's tables file (tables=FILE, the default for "
                        "a model with scoring tables; a model without them is always served)")
    p.add_argument("--serve-args", default="", help="extra arguments of nlmserve serve")
    p.add_argument("--workdir", default="runs/moses-experiment", type=Path,
                   help="outputs, reused on a rerun (default runs/moses-experiment)")


def _train(args: argparse.Namespace, work: Path) -> str:
    from ..common.serve_process import nlmserve_command
    from .experiment import training_text

    out = work / "nlm.model"
    if out.exists():
        return str(out)
    train = training_text(tuple(args.train_text), work)  # several texts: joined, one after the other
    cmd = [*nlmserve_command(), "train", "--train", train, "--out", str(out), "--max-minutes", str(args.minutes)]
    if args.valid_text:
        cmd += ["--valid", args.valid_text]
    print(f"training: {' '.join(cmd)}", flush=True)
    if subprocess.run(cmd).returncode != 0 or not out.exists():
        raise InputError("nlmserve train failed (its messages are above)")
    return str(out)


def tables_file(model: str, model_hash: str, out: Path) -> Path:
    """The tables file of ``model`` at ``out``: written with ``nlmserve export-tables``, or kept
    when a file of this model is there already."""
    from ..common.errors import NlmserveError
    from ..common.serve_process import nlmserve_command
    from ..lm.tables_file import read_tables_file

    if out.exists():
        try:
            if read_tables_file(out).model_hash == model_hash:
                log.info("tables of %s written before, reusing %s", model, out)
                return out
        except NlmserveError:
            pass  # not a tables file of this version: written again
    cmd = [*nlmserve_command(), "export-tables", "--model", model, "--out", str(out)]
    log.info("writing the tables file: %s", " ".join(cmd))
    # Its summary line would land in the middle of this command's stdout, the results table;
    # its log (on stderr) says what it wrote.
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0 or not out.exists():
        raise InputError("nlmserve export-tables failed (its messages are above)", model)
    return out


def check_files(args: argparse.Namespace) -> None:
    """The work directory, then every input, checked before any work (``nlmserve.common.paths``):
    InputError naming the first that cannot be used."""
    from ..common.paths import ANY, MODEL, PLAIN, TEXT, check_input, check_output_dir

    check_output_dir(args.workdir)
    if not args.moses_root.is_dir():
        raise InputError("not a directory: --moses-root is the Moses checkout", str(args.moses_root))
    if args.moses:
        check_input(args.moses)
    else:
        find_moses(args.moses_root)
    for path in (args.ini, args.dev_src, args.dev_ref, args.test_src, args.test_ref):
        check_input(path, PLAIN, empty_ok=False)
    for value in args.model or ():
        check_input(value.partition("=")[2] or value, MODEL)
    for path in args.train_text or ():
        check_input(path, TEXT, empty_ok=False)
    if args.valid_text:
        check_input(args.valid_text, TEXT, empty_ok=False)
    if args.kenlm:
        check_input(args.kenlm, ANY)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole experiment → the result (also written to the workdir)."""
    from ..common.serve_process import ServerProcess, start_server
    from ..moses_plugin import moses_ini
    from ..moses_plugin.bleu import BleuConfig, read_references

    work: Path = args.workdir
    check_files(args)
    work.mkdir(parents=True, exist_ok=True)
    moses = args.moses or str(find_moses(args.moses_root))
    systems = parse_models(args.model) if args.model else [System("moses", None), System("nlm", _train(args, work))]
    facts = {s.name: moses_ini.facts_of_file(s.model) for s in systems if s.model is not None}
    if args.nlm_weight is None:
        args.nlm_weight = moses_ini.start_weight(moses_ini.tuneable_l1_norm(args.ini.read_text(encoding="utf-8"),
                                                                            str(args.ini)))
    mertdir = args.mertdir or find_mertdir(args.moses_root, work)
    sets = write_sets(args, work)

    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    lines: dict[str, str] = {}
    for system in systems:
        server: ServerProcess | None = None
        try:
            feature = None
            if system.model is not None:
                model_facts = facts[system.name]
                if model_facts.tables_missing is None and not args.serve:
                    (work / system.name).mkdir(parents=True, exist_ok=True)
                    tables = tables_file(system.model, model_facts.model_hash, work / system.name / "model.nlt")
                    feature = moses_ini.feature_line(model_facts, None, extra={"tables": str(tables.resolve())})
                else:
                    server = start_server(Path(system.model), args.serve_args.split())
                    feature = moses_ini.feature_line(model_facts, server.target)
                lines[system.name] = feature
            for seed in args.seeds:
                base = work / system.name / f"seed{seed}"
                base.mkdir(parents=True, exist_ok=True)
                record = tune(args, feature, moses, seed, mertdir, sets.dev_src, sets.dev_ref, base, system.name)
                tuned = Path(record["ini"]) if server is None else retarget(Path(record["ini"]), base, server.target)
                record["test_decode_s"] = round(decode_test(moses, args.threads, tuned, sets.test_src,
                                                            base / "test.out", sets.test_lines,
                                                            f"{system.name} seed {seed}: "), 1)
                record["seed"] = seed
                record["output"] = str(base / "test.out")
                runs[system.name].append(record)
        finally:
            if server is not None:
                server.stop()

    refs = read_references([str(sets.test_ref)])
    config = BleuConfig()
    outputs = Outputs()
    rows: list[dict[str, Any]] = []
    for system in systems:
        row: dict[str, Any] = {"system": system.name, "model": system.model, "line": lines.get(system.name),
                               **bleu_row(runs[system.name], refs, outputs, config), "runs": runs[system.name]}
        if rows:  # against KENLM alone, run r against run r (the same seed)
            compare(row, rows[0], refs, outputs, config)
        rows.append(row)
    result = {"dev_lines": sets.dev_lines, "test_lines": sets.test_lines, "tuner": args.tuner, "seeds": args.seeds,
              "max_iterations": args.max_iterations, "rows": rows, "command": " ".join(sys.argv)}
    tmp = work / "results.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(work / "results.json")
    (work / "results.md").write_text(render(result) + "\n", encoding="utf-8")
    return result


def render(result: dict[str, Any]) -> str:
    """The table of a result: one row per system."""
    out = [f"{result['tuner'].upper()} inside Moses (mert-moses.pl, at most {result['max_iterations']} iterations) on "
           f"{result['dev_lines']} dev sentences, {result['test_lines']} test sentences decoded with each tuned "
           f"moses.ini; seeds {', '.join(map(str, result['seeds']))}. Δ and p (paired bootstrap) against `moses`.", "",
           "| system | test BLEU per seed | mean | Δ, p | iterations | tuning s | test decoding s |",
           "|---|---|---|---|---|---|---|"]
    cap = result["max_iterations"]
    rising: list[str] = []
    for r in result["rows"]:
        sd = "" if r["sd"] is None else f" ± {r['sd']:.2f}"
        delta = f"{r['delta']:+.2f}, p {r['p']:.3f}" if "delta" in r else ""
        runs = r["runs"]
        iterations = []
        for x in runs:
            if still_rising(x, cap):
                iterations.append(f"{x['iterations']} (cap; dev BLEU rising)")
                rising.append(f"`{r['system']}` seed {x['seed']}" if "seed" in x else f"`{r['system']}`")
            else:
                iterations.append(f"{x['iterations']} (cap)" if x["iterations"] >= cap else str(x["iterations"]))
        out.append(f"| {r['system']} | {', '.join(f'{b:.2f}' for b in r['bleu'])} | {r['mean']:.2f}{sd} | {delta} | "
                   f"{', '.join(iterations)} | "
                   f"{', '.join(str(x['tuning_wall_s']) for x in runs)} | "
                   f"{', '.join(str(x['test_decode_s']) for x in runs)} |")
    out += ["", f"BLEU: `{result['rows'][0]['signature']}`."]
    if rising:
        out.append(f"{', '.join(rising)}: stopped at the cap of {cap} iterations while the dev BLEU still rose "
                   "(results.json has it per iteration): more iterations may move the test BLEU.")
    out += [f"`{r['system']}`: `{r['line']}`" for r in result["rows"] if r.get("line")]
    return "\n".join(out)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    print(render(result))
    print(f"wrote {args.workdir / 'results.md'} and {args.workdir / 'results.json'}")
    return 0
