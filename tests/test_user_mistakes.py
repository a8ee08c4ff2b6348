"""What a user's mistake gets (docs/reference.md, its opening): every subcommand, run as a real process, with
the mistakes a new user makes: one line on stderr naming the file or flag, no traceback,
exit status 2 for usage and 1 at run time, and nothing left in the folder it ran in (no
temporary file, checkpoint, work folder or half-written output beside a refused one).
A closed pipe on stdout ends the process by SIGPIPE, silently, as coreutils' do."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import NEWS_NBEST, REPO, golden_model, nbest_head

NEWS = REPO / "data" / "nbest" / "newstest-fr-en"
NLMSERVE = [sys.executable, "-m", "nlmserve"]

# (case, argv, exit status, what the one line says). Placeholders name the inputs of the
# `inputs` fixture; `dir` is a directory and `missing/` a folder that does not exist, both
# in the folder each case runs in, and `fifo` a FIFO there with no writer.
CASES: list[tuple[str, str, int, str]] = [
    # train
    ("train-order-0", "train --train {text} --out m.nlm --order 0", 2, "argument --order: must be 2 or more, not 0"),
    ("train-dim-negative", "train --train {text} --out m.nlm --dim -5", 2, "argument --dim: must be 1 or more"),
    ("train-bits-40", "train --train {text} --out m.nlm --ngram-class-bits 40", 2, "--ngram-class-bits"),
    ("train-lr-text", "train --train {text} --out m.nlm --lr fast", 2, "argument --lr: not a number"),
    ("train-no-out", "train --train {text}", 2, "required: --out"),
    ("train-unknown-flag", "train --train {text} --out m.nlm --epoks 3", 2, "unrecognized arguments: --epoks"),
    ("train-out-dir", "train --train {text} --out dir", 1, "dir: the output is a directory"),
    ("train-out-missing-folder", "train --train {text} --out missing/m.nlm", 1, "does not exist"),
    ("train-text-missing", "train --train nope.txt --out m.nlm", 1, "nope.txt: no such file"),
    ("train-text-dir", "train --train dir --out m.nlm", 1, "dir: a directory, not a file"),
    ("train-text-binary", "train --train {binary} --out m.nlm", 1, "a binary file?"),
    ("train-text-empty", "train --train {empty} --out m.nlm", 1, "empty"),
    ("train-text-gz-name", "train --train {text_gz_named_txt} --out m.nlm", 1, "gzip-compressed"),
    ("train-valid-missing", "train --train {text} --valid nope.txt --out m.nlm", 1, "nope.txt: no such file"),
    ("train-workdir-file", "train --train {text} --out m.nlm --workdir {text}", 1, "not a directory"),
    # eval, query, info, export-tables, normalize
    ("eval-text-empty", "eval --model {model} --text {empty}", 1, "empty"),
    ("eval-text-missing", "eval --model {model} --text nope.txt", 1, "nope.txt: no such file"),
    ("eval-model-text", "eval --model {text} --text {text}", 1, "not an nlmserve model file"),
    ("eval-model-dir", "eval --model dir --text {text}", 1, "dir: a directory, not a file"),
    ("eval-kenlm-no-weight", "eval --model {model} --text {text} --kenlm {text}", 2, "--kenlm needs --mix-weight"),
    ("eval-mix-weight-2", "eval --model {model} --text {text} --kenlm {text} --mix-weight 2", 2, "--mix-weight"),
    ("eval-threads-negative", "eval --model {model} --text {text} --threads -1", 2, "argument --threads"),
    ("query-model-missing", "query --model nope.nlm", 1, "nope.nlm: no such file"),
    ("query-model-tables", "query --model {tables}", 1, "not an nlmserve model file: it is a tables file"),
    ("info-missing", "info nope.nlm", 1, "nope.nlm: no such file"),
    ("info-dir", "info dir", 1, "dir: a directory, not a file"),
    # a FIFO is refused at once, never waited on (open() of a FIFO blocks until a writer comes)
    ("info-fifo", "info fifo", 1, "fifo: a FIFO, not a regular file"),
    ("query-tables-fifo", "query --tables fifo", 1, "fifo: a FIFO, not a regular file"),
    ("tables-model-fifo", "export-tables --model fifo --out m.nlt", 1, "fifo: a FIFO, not a regular file"),
    ("eval-model-fifo", "eval --model fifo --text {text}", 1, "fifo: a FIFO, not a regular file"),
    ("info-text", "info {text}", 1, "not an nlmserve model file nor a tables file"),
    ("tables-out-dir", "export-tables --model {model} --out dir", 1, "dir: the output is a directory"),
    ("tables-out-missing-folder", "export-tables --model {model} --out missing/m.nlt", 1, "does not exist"),
    ("tables-model-text", "export-tables --model {text} --out m.nlt", 1, "not an nlmserve model file"),
    ("normalize-no-form", "normalize --in {text} --out o.txt", 2, "choose --lc-moses"),
    ("normalize-out-dir", "normalize --in {text} --out dir --lowercase", 1, "dir: the output is a directory"),
    ("normalize-in-missing", "normalize --in nope.txt --out o.txt --lowercase", 1, "nope.txt: no such file"),
    # serve, score, reload (the port taken: its own test below)
    ("serve-model-missing", "serve --model nope.nlm --port 0", 1, "nope.nlm"),
    ("serve-model-dir", "serve --model dir --port 0", 1, "dir"),
    ("score-timeout-0", "score --server 127.0.0.1:1 --timeout 0", 2, "argument --timeout: must be more than 0"),
    ("reload-timeout-text", "reload --server 127.0.0.1:1 --timeout soon", 2, "argument --timeout: not a number"),
    # rescore
    ("rescore-nbest-missing", "rescore --model {model} --nbest nope.gz --out o.gz", 1, "nope.gz: no such file"),
    ("rescore-nbest-dir", "rescore --model {model} --nbest dir --out o.gz", 1, "dir: a directory, not a file"),
    ("rescore-nbest-binary", "rescore --model {model} --nbest {binary} --out o.gz", 1, "a binary file?"),
    ("rescore-nbest-empty", "rescore --model {model} --nbest {empty} --out o.gz", 1, "no hypotheses"),
    ("rescore-out-dir", "rescore --model {model} --nbest {nbest} --out dir", 1, "dir: the output is a directory"),
    ("rescore-out-missing-folder", "rescore --model {model} --nbest {nbest} --out missing/o.gz", 1,
     "does not exist"),
    ("rescore-feature-underscore", "rescore --model {model} --nbest {nbest} --out o.gz --feature-name NLM_0", 2,
     "argument --feature-name: feature name 'NLM_0'"),
    ("rescore-model-text", "rescore --model {text} --nbest {nbest} --out o.gz", 1, "not an nlmserve model file"),
    ("rescore-batch-0", "rescore --model {model} --nbest {nbest} --out o.gz --batch-ngrams 0", 2,
     "argument --batch-ngrams"),
    ("rescore-two-sources", "rescore --model {model} --kenlm {text} --nbest {nbest} --out o.gz", 2,
     "not allowed with argument"),
    # tune, rerank, search-errors, bleu
    ("tune-nbest-missing", "tune --nbest nope.gz --ref {ref} --out w", 1, "nope.gz: no such file"),
    ("tune-nbest-dir", "tune --nbest dir --ref {ref} --out w", 1, "dir: a directory, not a file"),
    ("tune-ref-missing", "tune --nbest {nbest} --ref nope.ref --out w", 1, "nope.ref: no such file"),
    ("tune-out-missing-folder", "tune --nbest {nbest} --ref {ref} --out missing/w", 1,
     "missing/w.ini: cannot write the output: its folder"),
    ("tune-out-dir", "tune --nbest {nbest} --ref {ref} --out dir/w --ffile dir", 1, "dir: the output is a directory"),
    ("tune-init-binary", "tune --nbest {nbest} --ref {ref} --out w --init {binary}", 1, "a binary file?"),
    ("tune-prev-alone", "tune --nbest {nbest} --ref {ref} --out w --prev-ffile {text}", 2,
     "--prev-ffile and --prev-scfile go together"),
    ("tune-restarts-negative", "tune --nbest {nbest} --ref {ref} --out w --restarts -1", 2, "argument --restarts"),
    ("tune-tuner-unknown", "tune --nbest {nbest} --ref {ref} --out w --tuner pro", 2, "argument --tuner"),
    ("rerank-nbest-missing", "rerank --nbest nope.gz --weights {weights} --out o.txt", 1, "nope.gz: no such file"),
    ("rerank-nbest-dir", "rerank --nbest dir --weights {weights} --out o.txt", 1, "dir: a directory, not a file"),
    ("rerank-weights-binary", "rerank --nbest {nbest} --weights {binary} --out o.txt", 1, "a binary file?"),
    ("rerank-weights-model", "rerank --nbest {nbest} --weights {model} --out o.txt", 1, "a model file"),
    ("rerank-out-dir", "rerank --nbest {nbest} --weights {weights} --out dir", 1, "dir: the output is a directory"),
    ("rerank-out-missing-folder", "rerank --nbest {nbest} --weights {weights} --out missing/o.txt", 1,
     "does not exist"),
    ("search-errors-nbest-dir", "search-errors --nbest dir --weights {weights}", 1, "dir: a directory, not a file"),
    ("search-errors-weights-missing", "search-errors --nbest {nbest} --weights nope.ini", 1, "nope.ini: no such file"),
    ("search-errors-earlier-missing", "search-errors --nbest {nbest} --weights {weights} --earlier nope.gz", 1,
     "nope.gz: no such file"),
    ("search-errors-margin-negative", "search-errors --nbest {nbest} --weights {weights} --margin -1", 2,
     "argument --margin"),
    ("bleu-hyp-missing", "bleu --hyp nope.txt --ref {ref}", 1, "nope.txt: no such file"),
    ("bleu-ref-dir", "bleu --hyp {ref} --ref dir", 1, "dir: a directory, not a file"),
    ("bleu-samples-0", "bleu --hyp {ref} --ref {ref} --baseline {ref} --samples 0", 2, "argument --samples"),
    # moses-ini
    ("moses-ini-model-missing", "moses-ini --model nope.nlm", 1, "nope.nlm: no such file"),
    ("moses-ini-name-underscore", "moses-ini --model {model} --name NLM_0", 2, "argument --name"),
    ("moses-ini-ini-binary", "moses-ini --model {model} --ini {binary}", 1, "a binary file?"),
    ("moses-ini-tables-model", "moses-ini --model {model} --tables {model}", 1,
     "not an nlmserve export-tables file: it is a model file"),
    ("moses-ini-token-with-model", "moses-ini --model {model} --token-file {text}", 2, "go with --server"),
    # experiment, moses-experiment
    ("experiment-workdir-file", "experiment --workdir {text} --model {model}", 1, "not a directory"),
    ("experiment-model-text", "experiment --workdir w --model {text}", 1, "not an nlmserve model file"),
    ("experiment-dev-missing", "experiment --workdir w --model {model} --dev-nbest nope.gz", 1,
     "nope.gz: no such file"),
    ("experiment-train-missing", "experiment --workdir w --train-text nope.txt", 1, "nope.txt: no such file"),
    ("experiment-runs-0", "experiment --workdir w --model {model} --runs 0", 2, "argument --runs: must be 1 or more"),
    ("experiment-kenlm-name", "experiment --workdir w --model {model} --kenlm-name KN_1", 2, "argument --kenlm-name"),
    ("experiment-steps-negative", "experiment --workdir w --steps -1", 2, "argument --steps"),
    ("moses-experiment-root-missing", "moses-experiment --moses-root nope --ini {text} --model {model} "
     "--dev-src {text} --dev-ref {text} --test-src {text} --test-ref {text} --workdir w", 1, "nope: not a directory"),
    ("moses-experiment-no-moses", "moses-experiment --moses-root dir --ini {text} --model {model} "
     "--dev-src {text} --dev-ref {text} --test-src {text} --test-ref {text} --workdir w", 1, "no moses binary under"),
    ("moses-experiment-ini-missing", "moses-experiment --moses-root dir --moses {text} --ini nope.ini --model {model} "
     "--dev-src {text} --dev-ref {text} --test-src {text} --test-ref {text} --workdir w", 1, "nope.ini: no such file"),
    ("moses-experiment-workdir-file", "moses-experiment --moses-root dir --moses {text} --ini {text} --model {model} "
     "--dev-src {text} --dev-ref {text} --test-src {text} --test-ref {text} --workdir {text}", 1, "not a directory"),
    ("moses-experiment-dev-every-0", "moses-experiment --moses-root dir --ini {text} --model {model} "
     "--dev-src {text} --dev-ref {text} --test-src {text} --test-ref {text} --dev-every 0", 2, "argument --dev-every"),
    # the top level
    ("unknown-command", "trian --train {text}", 2, "invalid choice: 'trian'"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The files the mistakes are made with: a model (the golden one), its tables, texts
    (plain, empty, binary, gzip under a .txt name), a small real n-best list, its references
    and the decoder's weights."""
    folder = tmp_path_factory.mktemp("inputs")
    model = golden_model(folder / "model.nlm")
    text = folder / "text.txt"
    text.write_text("a b c\nb a\n", encoding="utf-8")
    (folder / "empty.txt").write_bytes(b"")
    (folder / "binary.dat").write_bytes(b"\xb7\xfde\xb6" + bytes(range(256)))
    (folder / "gz.txt").write_bytes(gzip.compress(b"a b c\n"))
    nbest = nbest_head(folder / "list.nbest.gz", 3, NEWS_NBEST)
    ref = folder / "ref.txt"
    ref.write_text("".join((NEWS / "newstest2013.300.ref").read_text(encoding="utf-8").splitlines(True)[:3]))
    tables = folder / "model.nlt"
    done = subprocess.run([*NLMSERVE, "export-tables", "--model", str(model), "--out", str(tables)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {"model": str(model), "text": str(text), "empty": str(folder / "empty.txt"),
            "binary": str(folder / "binary.dat"), "text_gz_named_txt": str(folder / "gz.txt"), "nbest": str(nbest),
            "ref": str(ref), "weights": str(NEWS / "baseline-weights.ini"), "tables": str(tables)}


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("argv", "code", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_with_its_status_and_leaves_nothing(argv: str, code: int, says: str,
                                                                   inputs: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    before = _listing(tmp_path)
    args = argv.format(**inputs).split()
    done = subprocess.run([*NLMSERVE, *args], cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)
    command = "nlmserve" if args[0] == "trian" else f"nlmserve {args[0]}"
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{command}: error: ") and says in lines[0], done.stderr
    assert done.returncode == code, done.stderr
    assert done.stdout == ""
    assert _listing(tmp_path) == before  # nothing written, nothing left


def test_verbose_adds_the_traceback(inputs: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run([*NLMSERVE, "-v", "rerank", "--nbest", "nope.gz", "--weights", inputs["weights"],
                           "--out", "o.txt"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert done.stderr.splitlines()[-1] == "nlmserve rerank: error: nope.gz: no such file"


def test_serve_says_a_taken_port_is_in_use(inputs: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([*NLMSERVE, "serve", "--model", inputs["model"], "--port", str(port)], cwd=tmp_path,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [f"nlmserve serve: error: port {port} is in use (127.0.0.1:{port}): stop what "
                                        "holds it, or choose another port (0 picks a free one)"]


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["plain", "json"])
def test_a_closed_pipe_ends_query_by_sigpipe_without_a_word(flags: list[str], inputs: dict[str, str],
                                                            tmp_path: Path) -> None:
    """`nlmserve query --model M < text | head -1`: the output (a few hundred KB, more than
    a pipe holds) meets a closed pipe; the process dies of SIGPIPE (the shell's 141)."""
    text = tmp_path / "many.txt"
    text.write_text("a b c a b zz\n" * 5000, encoding="utf-8")
    with open(text, "rb") as stdin:
        proc = subprocess.Popen([*NLMSERVE, "query", "--model", inputs["model"], *flags], stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # as head -1 exits
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
    assert first.startswith(b"a=3 ") or first.startswith(b'{"tokens"')
    assert proc.returncode == -signal.SIGPIPE, err
    assert err == ""


def test_info_verify_into_head(inputs: dict[str, str]) -> None:
    """`nlmserve info --verify M | head -3`: three lines, and no word on stderr whether the
    pipe closed before the output was written (SIGPIPE) or after (exit 0)."""
    done = subprocess.run(f"{' '.join(NLMSERVE)} info --verify {inputs['model']} | head -3; "
                          "echo status ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash",
                          capture_output=True, text=True, timeout=60)
    assert len(done.stdout.splitlines()) == 3
    assert done.stderr.strip() in ("status 0", "status 141"), done.stderr
