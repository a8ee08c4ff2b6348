"""The C++ client (client/cpp) against a real ``nlmserve serve`` on the tiny model.

Builds the client library and its driver ``nlmserve_client_test`` with cmake into
build/cpp (incremental: the generated gRPC code compiles once), installs its CMake package
and builds server/native's and bench/cpp's own projects on it (as ``make cpp``), then talks to the driver
over its stdin/stdout protocol (documented at the top of nlmserve_client_test.cpp).
Without cmake or Debian's gRPC packages the module is skipped, except under CI=true
where .ci/run installs them and a missing tool chain is a failure.
"""

from __future__ import annotations

import json
import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np
import pytest

from support import DEV, REPO, serve_subprocess

CPP_SRC = REPO / "client" / "cpp"
BUILD = REPO / "build" / "cpp"
PREFIX = REPO / "build" / "cpp-prefix"  # `make cpp` installs the client's CMake package here ...
NATIVE_SRC = REPO / "server" / "native"
NATIVE = REPO / "build" / "native"  # ... and builds the front end against it here
BENCH_SRC = REPO / "bench" / "cpp"
LOAD = REPO / "build" / "bench" / "nlmserve_load"  # the load generator, on the same package
DRIVER = BUILD / "nlmserve_client_test"
UNIT = BUILD / "nlmserve_unit_test"
DECODER_TEST = BUILD / "nlmserve_decoder_test"  # built from moses_plugin/cpp by the same project
CONTRACT_TEST = BUILD / "nlmserve_contract_test"
CONTRACT = REPO / "proto" / "contract"
GOLDEN = CONTRACT / "canonical_ngrams.tsv"
# `nlmserve serve` through the server room's own CLI module, so this test depends on the
# serve subcommand only (not on every room's parser being importable).
SERVE = [sys.executable, "-c",
         "import argparse, sys\n"
         "from nlmserve.server import cli\n"
         "parser = argparse.ArgumentParser(prog='nlmserve')\n"
         "cli.register(parser.add_subparsers())\n"
         "args = parser.parse_args(sys.argv[1:])\n"
         "sys.exit(args.func(args))\n"]
SYSTEM_DEPS = "cmake g++ pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler"


def _toolchain_missing() -> str | None:
    for tool in ("cmake", "g++", "protoc", "grpc_cpp_plugin", "pkg-config"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], capture_output=True)
    if probe.returncode != 0:
        return "pkg-config finds no grpc++/protobuf"
    return None


@pytest.fixture(scope="module")
def driver() -> Path:
    missing = _toolchain_missing()
    if missing is not None:
        message = f"C++ client tool chain absent ({missing}); install with `make system-deps` ({SYSTEM_DEPS})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    # The client's project, its installed package, and the native front end's and the load
    # generator's own projects on it.
    for cmd in (["cmake", "-S", str(CPP_SRC), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(BUILD), "-j2"],
                ["cmake", "--install", str(BUILD), "--prefix", str(PREFIX)],
                ["cmake", "-S", str(NATIVE_SRC), "-B", str(NATIVE), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={PREFIX}"],
                ["cmake", "--build", str(NATIVE), "-j2"],
                ["cmake", "-S", str(BENCH_SRC), "-B", str(LOAD.parent), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={PREFIX}"],
                ["cmake", "--build", str(LOAD.parent), "-j2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert DRIVER.exists()
    return DRIVER


class LineReader:
    """Reads lines from a subprocess pipe with a timeout (raw fd, own buffer)."""

    def __init__(self, stream: IO[bytes], what: str) -> None:
        self.fd = stream.fileno()
        self.what = what
        self.buffer = b""

    def read(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(left, 0.0))
            if not ready:
                raise TimeoutError(f"no answer from {self.what} within {timeout} s")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError(f"{self.what} closed its output")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("utf-8")


class Server:
    """A real ``nlmserve serve`` subprocess on 127.0.0.1."""

    def __init__(self, model: Path, log_path: Path, port: int = 0) -> None:
        server = serve_subprocess(model, "--device", "cpu", port=port, log=log_path, command=SERVE, timeout=120.0)
        self.proc = server.process
        self.port = server.port
        self.target = server.target

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


class Driver:
    """The C++ driver process: one command in, one answer (block) out."""

    def __init__(self, path: Path, target: str, *extra: str) -> None:
        self.proc = subprocess.Popen([str(path), target, *extra], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout, "nlmserve_client_test")  # type: ignore[arg-type]
        first = self.read(60.0)
        assert first == "ready", first

    def read(self, timeout: float = 60.0) -> str:
        return self.reader.read(timeout)

    def ask(self, command: str, timeout: float = 60.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def scores(self, path: Path) -> np.ndarray:
        head = self.ask(f"file {path}")
        assert head.startswith("ok "), head
        return np.array([float(self.read()) for _ in range(int(head.split()[1]))], dtype=np.float64)

    def stats(self) -> dict[str, int]:
        answer = self.ask("stats")
        assert answer.startswith("ok "), answer
        return {k: int(v) for k, v in (item.split("=") for item in answer.split()[1:])}

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _ngrams(lines: int = 40, order: int = 5) -> list[list[str]]:
    """Every n-gram (1..order words) of the first dev sentences with <s>/</s>, plus OOVs."""
    out: list[list[str]] = []
    with open(DEV, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= lines:
                break
            words = ["<s>"] + line.split() + ["</s>"]
            for end in range(1, len(words)):
                for n in range(1, order + 1):
                    if end - n + 1 >= 0:
                        out.append(words[end - n + 1:end + 1])
    out += [["zzqx-not-a-word"], ["the", "zzqx-not-a-word"], ["zzqx-not-a-word", "of", "the"],
            ["<s>", "<s>", "<s>", "<s>", "the"], ["the"], ["of", "<s>", "the"]]
    return out


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tiny_model_path, tmp_path_factory.mktemp("cpp-server") / "server.log")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def ngram_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    ngrams = _ngrams()
    path = tmp_path_factory.mktemp("cpp-ngrams") / "ngrams.txt"
    path.write_text("".join(" ".join(g) + "\n" for g in ngrams), encoding="utf-8")
    return path, ngrams


def test_unit_checks_of_cache_rules_and_scoring_tables(driver: Path) -> None:
    """nlmserve_unit_test, no server: the id-keyed cache (LRU eviction in a window, rows
    sharing a home slot, 0.0 as a hit, clear, the capacity in entries, eight threads, batched
    lookups and inserts equal to row-by-row ones), the
    rules on other ids and types, rows widened to a batch's order (WidenRows),
    lowercasing and target parsing, and the scoring tables' arithmetic (hand-computed, each
    activation, the kept context prefix sums, the direct n-gram features' hashes and slots,
    the no-word, a tree output's paths, a batch longer than the read-ahead scored as each
    row alone), and on a CPU with AVX2 and F16C its kernels against the portable loops, bit
    for bit, in each form."""
    done = subprocess.run([str(UNIT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if platform.machine() == "x86_64" and {"avx2", "f16c"} <= flags:
        assert done.stdout.strip() == "unit: 135 passed, 0 failed", done.stderr
    else:
        assert done.stdout.strip().endswith("unit: 132 passed, 0 failed"), done.stdout


def test_unit_checks_of_the_moses_features_own_parts(driver: Path) -> None:
    """nlmserve_decoder_test (moses_plugin/cpp, beside the feature), no Moses, no server:
    nlmserve_decoder.h's phrase and boundary rows (hand-computed), word-id table, expansion
    scores (in order at the cursor, or looked up), error pause, the order= rule, and where
    the feature finds its model (tables=, path=, both)."""
    done = subprocess.run([str(DECODER_TEST)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "decoder: 54 passed, 0 failed", done.stderr


def test_scoring_tables_are_filled_into_huge_pages(driver: Path) -> None:
    """The client reserves the scoring tables, advises huge pages, then writes them: 32 MB
    filled that way sit in huge pages where the kernel offers them on advice (Linux's
    transparent huge pages, mode "always" or "madvise"), where 4 KB pages would make nearly
    every random row read a TLB miss."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel offers no transparent huge pages")
    done = subprocess.run([str(UNIT), "--huge-pages"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kb = int(done.stdout.split("huge pages:")[1].split()[0])
    assert kb >= 2048, done.stdout  # at least one 2 MB page of the 15 whole ones inside


def test_golden_ngram_rules_through_the_cpp_owner(driver: Path) -> None:
    """Every case of proto/contract/canonical_ngrams.tsv through nlmserve::CanonicalRow, the
    function the client's requests, the load generator and the Moses feature all call."""
    cases = [line.split("\t") for line in GOLDEN.read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(cases) >= 30 and all(len(c) == 4 for c in cases)
    kinds = {want for *_, want in cases if want.startswith("error:")}
    assert kinds == {"error:empty", "error:too-long", "error:out-of-range", "error:bos-target"}
    done = subprocess.run([str(UNIT), "--canonical"], input="".join("\t".join(c[:3]) + "\n" for c in cases),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = done.stdout.splitlines()
    assert len(got) == len(cases)
    wrong = [(case, answer) for case, answer in zip(cases, got) if answer != case[3]]
    assert not wrong, wrong


def test_every_contract_file_through_the_cpp_owners(driver: Path) -> None:
    """nlmserve_contract_test reads every golden file of proto/contract (tests/test_contract.py
    runs the Python owners on the same files) and passes each case: canonical rows, token
    files, server targets, lowercasing, feature hashes, retry and status codes, and the
    scoring tables of a tiny model scored with no server as nlmserve.lm scores them, as text and
    mapped from the tables file."""
    done = subprocess.run([str(CONTRACT_TEST), str(CONTRACT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *files, total = done.stdout.splitlines()
    counts = {line.split(": ")[0]: int(line.split(": ")[1].split()[0]) for line in files}
    golden = {p.name for p in CONTRACT.iterdir() if p.suffix in (".tsv", ".txt", ".nlt")}
    # The native front end's own frames: its check reads them (tests/test_local_frames.py).
    golden.discard("local_frames.tsv")
    assert set(counts) == golden and all(n > 0 for n in counts.values()), counts
    assert total == f"contract: {sum(counts.values())} passed, 0 failed"


@pytest.mark.parametrize("normalized", [True, False])
def test_scores_equal_python_client(driver: Path, server: Server, ngram_file: tuple[Path, list[list[str]]],
                                    normalized: bool) -> None:
    from nlmserve.client import LMClient

    path, ngrams = ngram_file
    cpp = Driver(driver, server.target, *([] if normalized else ["--unnormalized"]))
    try:
        info = cpp.ask("info")
        got = cpp.scores(path)
        one = cpp.ask("score of the")
    finally:
        cpp.close()
    with LMClient(server.target) as py:
        assert f"order={py.order}" in info and f"hash={py.info.model_hash}" in info
        packed = py.score_ngrams(ngrams, log_base="log10", normalized=normalized).log_probs
    with LMClient(server.target, pack_ids=False) as py_strings:
        strings = py_strings.score_ngrams(ngrams, log_base="log10", normalized=normalized).log_probs
    assert got.shape == (len(ngrams),)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, packed, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got, strings, rtol=0, atol=1e-5)
    assert one.startswith("ok ")
    assert abs(float(one.split()[1]) - got[ngrams.index(["of", "the"])]) < 1e-6
    # A shorter context is <s>-padded; everything left of the newest <s> is <s>.
    assert got[ngrams.index(["<s>", "<s>", "<s>", "<s>", "the"])] == got[ngrams.index(["the"])]
    assert got[ngrams.index(["of", "<s>", "the"])] == got[ngrams.index(["the"])]


def _local_scores_are_the_servers(driver: Path, target: str, path: Path, ngrams: list[list[str]],
                                  tables_file: Path | None = None) -> dict[str, str]:
    """Asks the C++ process (``tables PATH [FILE]``) for the scores it computes from
    GetScoringTables, or from the tables file it maps (self-normalised, or a tree's exact
    ones), and checks them against the server's of the same kind (natural log, within float
    rounding), the model hash and the scratch's reuse → the answer's fields."""
    from nlmserve.client import LMClient

    cpp = Driver(driver, target)
    try:
        head = cpp.ask(f"tables {path}" + (f" {tables_file}" if tables_file else ""))
        assert head.startswith("ok "), head
        got = np.array([float(cpp.read()) for _ in range(int(head.split()[1]))])
    finally:
        cpp.close()
    fields = dict(item.split("=") for item in head.split()[2:])
    with LMClient(target) as py:
        want = py.score_ngrams(ngrams, log_base="ln", normalized=fields["normalized"] == "1").log_probs
        assert fields["hash"] == py.info.model_hash
    assert fields["differ"] == "0" and fields["mapped"] == ("1" if tables_file else "0")
    assert got.shape == (len(ngrams),)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    return fields


def test_scoring_tables_give_the_servers_self_normalised_scores(driver: Path, server: Server,
                                                               ngram_file: tuple[Path, list[list[str]]]) -> None:
    """Client::GetScoringTables and ScoringTables::Score (the Moses feature's scoring=local):
    the trained model's self-normalised scores computed in the C++ process are the server's
    (natural log) within float rounding, and asking one by one in another order changes none."""
    path, ngrams = ngram_file
    _local_scores_are_the_servers(driver, server.target, path, ngrams)


def _served_tables_agree(driver: Path, model_path: Path, tmp_path: Path,
                         mapped: bool = False) -> tuple[dict[str, str], Any]:
    """``model_path`` served for real, its n-grams of the test set up to its order scored
    by the C++ process from the tables (with ``mapped``, from the file ``nlmserve export-tables``
    writes) and checked against the server (:func:`_local_scores_are_the_servers`) → the
    answer's fields and the model."""
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(model_path, device="cpu")
    ngrams = [g for g in _ngrams(order=lm.order) if len(g) <= lm.order]
    path = tmp_path / "ngrams.txt"
    path.write_text("".join(" ".join(g) + "\n" for g in ngrams), encoding="utf-8")
    tables_file = None
    if mapped:
        tables_file = tmp_path / "model.nlt"
        done = subprocess.run([sys.executable, "-m", "nlmserve", "export-tables", "--model", str(model_path),
                               "--out", str(tables_file)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and f"model {lm.model_hash}" in done.stdout, done.stderr
    server = Server(model_path, tmp_path / "server.log")
    try:
        return _local_scores_are_the_servers(driver, server.target, path, ngrams, tables_file), lm
    finally:
        server.kill()


@pytest.mark.parametrize("kind", ["features", "tree"])
def test_a_mapped_tables_file_gives_the_fetched_tables_scores(driver: Path, feature_model_path: Path,
                                                              tree_model_path: Path, tmp_path: Path,
                                                              kind: str) -> None:
    """``nlmserve export-tables`` writes the file the Moses feature maps (tables=FILE): mapped in
    the C++ process (MapTablesFile), it gives the server's scores, the model's hash and the
    size of the fetched tables, for a class output with direct features and for a tree."""
    model_path = feature_model_path if kind == "features" else tree_model_path
    (tmp_path / "fetched").mkdir()
    (tmp_path / "mapped").mkdir()
    fetched, lm = _served_tables_agree(driver, model_path, tmp_path / "fetched")
    mapped, _ = _served_tables_agree(driver, model_path, tmp_path / "mapped", mapped=True)
    assert mapped["hash"] == fetched["hash"] == lm.model_hash
    assert mapped["bytes"] == fetched["bytes"] and mapped["normalized"] == fetched["normalized"]


@pytest.mark.parametrize("kind", ["tiny", "features", "tree"])
def test_a_tables_file_round_trips_in_every_form(driver: Path, tiny_model_path: Path, feature_model_path: Path,
                                                 tree_model_path: Path, tmp_path: Path, kind: str) -> None:
    """Python writes a tables file in each form (export-tables --quantize none|fp16|int8);
    the C++ reader (MapTablesFile, through nlmserve_contract_test --score and --words) and
    the Python one (nlmserve.lm.tables_scorer) read it: the same facts, float32's scores the
    model's (float rounding apart), each quantised form's within the bound the file records
    of them, in both languages; and every word of the vocabulary maps to its id in C++,
    lowercased first when the model lowercases."""
    from nlmserve.wire.ngrams import sentence_rows
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import FlatTables, read_tables_file, write_tables_file
    from nlmserve.lm.tables_scorer import TablesScorer

    model = {"tiny": tiny_model_path, "features": feature_model_path, "tree": tree_model_path}[kind]
    lm = LanguageModel.load(model, device="cpu")
    rows, _, _, _ = sentence_rows([line.split() for line in DEV.read_text(encoding="utf-8").splitlines()[:50]],
                                  lm.vocab.index, lm.order, lowercase=lm.lowercase)
    want = lm.score_ngrams(rows, normalized=kind == "tree")
    stdin = "".join(" ".join(map(str, row)) + "\n" for row in rows.tolist())
    flat = FlatTables.of(lm.scoring_tables())
    for quantization in ("none", "fp16", "int8"):
        path = tmp_path / f"{quantization}.nlt"
        write_tables_file(path, flat, order=lm.order, words=lm.vocab.words, lowercase=lm.lowercase,
                          model_hash=lm.model_hash, quantization=quantization)
        bound = read_tables_file(path).header.error_bound
        done = subprocess.run([str(CONTRACT_TEST), "--score", str(path)], input=stdin, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        head, *lines = done.stdout.splitlines()
        facts = dict(field.split("=") for field in head.split()[2:])
        assert head.split()[:2] == ["ok", str(len(rows))] and float(facts.pop("bound")) == bound
        assert facts == {"quantization": quantization, "lowercase": str(int(lm.lowercase)), "hash": lm.model_hash,
                         "normalized": str(int(kind == "tree"))}
        cpp = np.array([float(x) for x in lines])
        python = TablesScorer.open(path).score_rows(rows)
        np.testing.assert_allclose(cpp, python, rtol=0, atol=1e-5)
        assert np.abs(cpp - want).max() <= bound + 1e-4 and np.abs(python - want).max() <= bound + 1e-4
        assert (bound == 0) == (quantization == "none")
    words = lm.vocab.words + ["zzqx-not-a-word"] + [w.upper() for w in lm.vocab.words[3:50]]
    done = subprocess.run([str(CONTRACT_TEST), "--words", str(tmp_path / "int8.nlt")], input="\n".join(words) + "\n",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    index = lm.vocab.index
    assert done.stdout.splitlines() == [str(index[w.lower() if lm.lowercase else w]) if (w.lower() if lm.lowercase
                                        else w) in index else "unknown" for w in words]


def test_scoring_tables_with_direct_ngram_features(driver: Path, feature_model_path: Path, tmp_path: Path) -> None:
    """A model with direct n-gram features (the recipe's default) served for real: the C++
    process adds the hashed features to the tables' score as the server does (natural log,
    self-normalised), and the tables' size counts the word classes and the two tables."""
    fields, lm = _served_tables_agree(driver, feature_model_path, tmp_path)
    cfg = lm.config
    V, D = cfg.vocab_size, cfg.dim
    assert int(fields["bytes"]) == 4 * (cfg.order * V * D + V + V + 1024 + 4096) + 4 * V


def test_scoring_tables_of_a_tree_output_give_exact_scores(driver: Path, tree_model_path: Path,
                                                           tmp_path: Path) -> None:
    """A tree-output model (Huffman codes) served for real: its tables carry the node
    vectors and every word's path, and the C++ process computes the exact log-probabilities
    the server answers for normalized=true (which the feature then takes with scoring=local
    and normalized=true); the tables' size counts the paths."""
    fields, lm = _served_tables_agree(driver, tree_model_path, tmp_path)
    cfg = lm.config
    assert fields["normalized"] == "1"
    V, D, tree = cfg.vocab_size, cfg.dim, lm.scoring_tables().tree
    assert tree is not None
    codes, steps = tree.sizes
    K = cfg.tree_nodes
    assert int(fields["bytes"]) == 4 * ((cfg.order - 1) * V * D + K * D + K + (V + 1) + (codes + 1) + steps)


def _phrase_scores_agree(driver: Path, target: str, model_path: Path, phrases: list[str]) -> None:
    """Through the driver's ``phrase``: the rows PhraseRows makes of each phrase have the
    no-word (id V) where the words before the phrase would be; their natural-log scores
    from the tables in the C++ process equal the server's (the wire carries the no-word)
    and the Python owner's, and differ from the same n-grams padded with <s>."""
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(model_path, device="cpu")
    V, order = len(lm.vocab), lm.order
    cpp = Driver(driver, target, "--unnormalized")
    try:
        for phrase in phrases:
            words = phrase.split()
            head = cpp.ask(f"phrase {phrase}")
            assert head == f"ok {len(words)}", head
            lines = [cpp.read().split() for _ in words]
            rows = np.array([[int(x) for x in line[:order]] for line in lines])
            local = np.array([float(line[order]) for line in lines])
            served = np.array([float(line[order + 1]) for line in lines]) * np.log(10)
            ids = [lm.vocab.id(w) for w in words]
            for i, row in enumerate(rows):  # word i predicted from the i words before it
                known = min(i, order - 1)
                assert row.tolist() == [V] * (order - 1 - known) + ids[i - known:i + 1], (phrase, i, row)
            np.testing.assert_allclose(local, served, rtol=0, atol=1e-5)
            np.testing.assert_allclose(local, lm.score_ngrams(rows, normalized=False), rtol=0, atol=1e-5)
            padded = lm.score_ngrams(np.where(rows == V, 1, rows), normalized=False)
            assert np.abs(local - padded)[0] > 1e-3, (phrase, local, padded)
    finally:
        cpp.close()


def test_phrase_rows_score_the_words_before_a_phrase_as_unknown(driver: Path, server: Server,
                                                                 tiny_model_path: Path) -> None:
    """A target phrase scored on its own (the Moses feature's phrase scores and future-cost
    estimates, Moses' LanguageModelImplementation::CalcScore): its first words are predicted
    from the phrase's words alone, the words before it being the no-word, not <s>."""
    _phrase_scores_agree(driver, server.target, tiny_model_path,
                         ["of the european union", "the", "and , in particular , the commission"])


def test_phrase_rows_with_direct_ngram_features(driver: Path, feature_model_path: Path, tmp_path: Path) -> None:
    """The same with a model with direct n-gram features: a suffix that holds the no-word
    has no feature, in the tables here as in the server."""
    server = Server(feature_model_path, tmp_path / "server.log")
    try:
        _phrase_scores_agree(driver, server.target, feature_model_path, ["of the european union", "the"])
    finally:
        server.kill()


def test_invalid_ngrams_are_errors_not_crashes(driver: Path, server: Server) -> None:
    cpp = Driver(driver, server.target)
    try:
        assert cpp.ask("score the <s>").startswith("error 3 ")
        assert cpp.ask("ids 4000000000").startswith("error 3 ")
        assert cpp.ask("score a b c d e f").startswith("error 3 ")  # longer than order 5
        assert cpp.ask("score of the").startswith("ok ")
        # ScoreRows takes rows as CanonicalRow writes them, and refuses what the server would.
        info = dict(item.split("=", 1) for item in cpp.ask("info").split()[1:])
        b, v = info["bos"], info["vocab"]
        assert cpp.ask(f"raw {b} {b} {b} 7") == "error 3 rows of 4 ids given; the model's rows have 5"
        assert cpp.ask(f"raw {b} {b} {b} {b} {v}") == f"error 3 n-gram 0 has id {v} outside the vocabulary of {v}"
        assert cpp.ask(f"raw {b} {b} {b} 7 {b}") == "error 3 n-gram 0 predicts <s>, which is never predicted"
        the = cpp.ask("row the").split()[-1]
        assert cpp.ask(f"raw {b} {b} {b} {b} {the}") == cpp.ask("score the") == cpp.ask("score <s> <s> the")
    finally:
        cpp.close()


def test_canonical_rows_are_the_ones_sent(driver: Path, server: Server) -> None:
    from nlmserve.client import LMClient

    with LMClient(server.target) as py:
        vocab = py.vocabulary()
        bos, of, the = py.info.bos_id, vocab["of"], vocab["the"]
    cpp = Driver(driver, server.target)
    try:
        assert cpp.ask("row the") == f"ok {bos} {bos} {bos} {bos} {the}"
        assert cpp.ask("row of the") == f"ok {bos} {bos} {bos} {of} {the}"
        assert cpp.ask("row of <s> of the") == f"ok {bos} {bos} {bos} {of} {the}"
        assert cpp.ask("row of of of of the") == f"ok {of} {of} {of} {of} {the}"
        assert cpp.ask("row of of of of of the").startswith("error 3 n-gram 0 has 6 words")
    finally:
        cpp.close()


def test_eight_threads_consistent(driver: Path, server: Server, ngram_file: tuple[Path, list[list[str]]]) -> None:
    path, _ = ngram_file
    cpp = Driver(driver, server.target)
    try:
        answer = cpp.ask(f"threads 8 {path} 4", timeout=120.0)
        stats = cpp.stats()
    finally:
        cpp.close()
    fields = dict(item.split("=") for item in answer.split()[1:])
    # Every answer of every thread equals the single-threaded reference within 1e-5
    # (the server's float sums may differ in the last bits with the composition of its
    # micro-batches, so bit-equality is not promised) and no call failed.
    assert answer.startswith("ok ") and fields["far"] == "0" and fields["errors"] == "0", answer
    assert float(fields["max_diff"]) <= 1e-5
    assert int(fields["calls"]) > 8
    # The cache was cleared between rounds, so the threads went to the server too.
    assert stats["round_trips"] > 1 and stats["hits"] > 0


def test_cache_is_hit(driver: Path, server: Server, ngram_file: tuple[Path, list[list[str]]]) -> None:
    path, ngrams = ngram_file
    unique = len({tuple(g) for g in ngrams})
    cpp = Driver(driver, server.target)
    try:
        first = cpp.scores(path)
        after_first = cpp.stats()
        second = cpp.scores(path)
        after_second = cpp.stats()
    finally:
        cpp.close()
    # First pass: each distinct canonical n-gram (padding-equivalent ones share a key)
    # missed the cache once and went to the server, all in one request.
    assert after_first["round_trips"] == 1 and after_first["hits"] == 0
    assert 0 < after_first["sent"] == after_first["misses"] <= unique
    # Second pass: every n-gram from the cache, no request, identical values.
    assert after_second["round_trips"] == 1
    assert after_second["hits"] == len(ngrams)
    assert after_second["misses"] == after_first["misses"]
    assert after_second["entries"] == after_first["sent"]
    np.testing.assert_array_equal(first, second)


def test_flat_rows_send_each_distinct_row_once(driver: Path, server: Server,
                                              ngram_file: tuple[Path, list[list[str]]]) -> None:
    """ScoreRows over one flat buffer of canonical rows: the same values as the vector API,
    and the batch's misses de-duplicated before sending: exactly the distinct canonical rows
    (the Python owner's, nlmserve.wire.ngrams) go to the server, in one request."""
    from nlmserve.client import LMClient
    from nlmserve.wire.ngrams import canonical_rows

    path, ngrams = ngram_file
    with LMClient(server.target) as py:
        vocab = py.vocabulary()
        ids = [[vocab.get(w, py.info.unk_id) for w in g] for g in ngrams]
        order, size = py.order, py.info.vocab_size
    distinct = {tuple(canonical_rows(np.array([g]), order, size)[0]) for g in ids}
    assert len(distinct) < len(ngrams)  # the file repeats rows: <s>-padding equivalents, repeated n-grams
    cpp = Driver(driver, server.target)
    try:
        def rows() -> tuple[dict[str, int], np.ndarray]:
            head = cpp.ask(f"rows {path}")
            assert head.startswith("ok "), head
            fields = {k: int(v) for k, v in (item.split("=") for item in head.split()[2:])}
            return fields, np.array([float(cpp.read()) for _ in range(int(head.split()[1]))])

        first_counts, first = rows()
        second_counts, second = rows()
        vector_api = cpp.scores(path)
    finally:
        cpp.close()
    assert first_counts == {"hits": 0, "misses": len(distinct), "sent": len(distinct), "round_trips": 1}
    assert second_counts == {"hits": len(ngrams), "misses": 0, "sent": 0, "round_trips": 0}
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, vector_api)


def test_killed_server_gives_error_then_retry_after_restart(
        driver: Path, tiny_model_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    first = Server(tiny_model_path, log)
    port = first.port
    cpp = Driver(driver, first.target, "--connect-timeout-ms", "1000", "--retries", "1",
                 "--deadline-ms", "5000")
    second: Server | None = None
    try:
        before = cpp.ask("score of the european union")
        assert before.startswith("ok "), before
        first.kill()
        t0 = time.monotonic()
        failed = cpp.ask("score the european parliament", timeout=60.0)
        # UNAVAILABLE (or DEADLINE_EXCEEDED while reconnecting), reported, not a crash.
        assert failed.startswith(("error 14 ", "error 4 ")), failed
        assert time.monotonic() - t0 < 30.0
        assert cpp.proc.poll() is None
        second = Server(tiny_model_path, log, port=port)
        cpp.ask("clear")
        after = cpp.ask("score of the european union", timeout=60.0)
        assert after.startswith("ok "), after
        assert after == before
        again = cpp.ask("score the european parliament", timeout=60.0)
        assert again.startswith("ok "), again
        stats = cpp.stats()
        assert stats["failed"] >= 1 and stats["reconnects"] >= 1
    finally:
        cpp.close()
        if second is not None:
            second.kill()


def test_lowercase_option(driver: Path, server: Server) -> None:
    plain = Driver(driver, server.target)
    lower = Driver(driver, server.target, "--lowercase")
    try:
        expected = plain.ask("score of the european union")
        mixed = plain.ask("score Of THE European Union")  # unknown as cased words
        folded = lower.ask("score Of THE European Union")
    finally:
        plain.close()
        lower.close()
    assert expected.startswith("ok ") and folded == expected
    assert mixed != expected


@pytest.mark.parametrize("mode", ["threads", "async"])
def test_load_generator_counts_answered_requests(driver: Path, server: Server, mode: str,
                                                 ngram_file: tuple[Path, list[list[str]]]) -> None:
    """bench/serve.py's load generator: every request it counts was answered with a score."""
    path, _ = ngram_file
    done = subprocess.run([str(LOAD), server.target, str(path), "--clients", "4", "--batch", "3",
                           "--seconds", "0.5", "--warmup", "0.2", "--mode", mode],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["mode"] == mode and r["clients"] == 4 and r["failed"] == 0
    assert r["requests"] > 10 and r["ngrams_per_s"] == pytest.approx(3 * r["requests_per_s"], rel=1e-3)
    assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]


def test_load_generator_refuses_ngrams_longer_than_the_order(driver: Path, server: Server, tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_text("a b c d e f g\n", encoding="utf-8")
    done = subprocess.run([str(LOAD), server.target, str(path), "--mode", "async"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "n-gram 0 has 7 words; the model takes 1 to 5" in done.stderr


def test_ngram_files_skip_blank_lines_and_split_on_any_white_space(driver: Path, server: Server,
                                                                    tmp_path: Path) -> None:
    """nlmserve::ReadNgramFile (the load generator's and the client test's reader)."""
    def load(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(LOAD), server.target, str(path), "--mode", "async"],
                              capture_output=True, text=True, timeout=120)

    path = tmp_path / "ngrams.txt"
    path.write_text("\n  the house \n\n\ta b\tc d  e f g\t\n", encoding="utf-8")
    done = load(path)
    # the second n-gram is number 1: blank lines are not n-grams, tabs and runs of spaces split
    assert done.returncode == 2 and "n-gram 1 has 7 words; the model takes 1 to 5" in done.stderr
    path.write_text("\n \t\n", encoding="utf-8")
    done = load(path)
    assert done.returncode == 2 and f"nlmserve_load: no n-grams in {path}" in done.stderr
    done = load(tmp_path / "missing.txt")
    assert done.returncode == 2 and f"nlmserve_load: cannot read {tmp_path / 'missing.txt'}" in done.stderr


def test_golden_model_through_the_cpp_client(driver: Path, tmp_path: Path) -> None:
    """The fixed-weight golden model (tests/test_golden_model.py has the arithmetic) served
    for real and asked by the C++ client: each n-gram's log10 probability is the hand-computed
    one, exact and self-normalised."""
    from support import golden_model
    from test_golden_model import CASES

    model = golden_model(tmp_path / "golden.nlm")
    server = Server(model, tmp_path / "server.log")
    path = tmp_path / "ngrams.txt"
    path.write_text("".join(" ".join(words) + "\n" for words, _, _, _ in CASES), encoding="utf-8")
    try:
        for normalized in (True, False):
            cpp = Driver(driver, server.target, *([] if normalized else ["--unnormalized"]))
            try:
                got = cpp.scores(path)
            finally:
                cpp.close()
            want = np.array([(ln_p if normalized else raw) / math.log(10.0) for _, _, ln_p, raw in CASES])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        # The same self-normalised scores (natural log) from the tables, in the C++ process.
        cpp = Driver(driver, server.target)
        try:
            head = cpp.ask(f"tables {path}")
            assert head.startswith(f"ok {len(CASES)} dim=2 bytes={(3 * 6 * 2 + 6) * 4} "), head
            local = [float(cpp.read()) for _ in CASES]
        finally:
            cpp.close()
        np.testing.assert_allclose(local, [raw for _, _, _, raw in CASES], rtol=0, atol=1e-5)
    finally:
        server.kill()
    # A model that is not self-normalised has no tables: the server's reason reaches the caller.
    server = Server(golden_model(tmp_path / "mle.nlm", objective="mle"), tmp_path / "server-mle.log")
    try:
        cpp = Driver(driver, server.target)
        try:
            answer = cpp.ask(f"tables {path}")
        finally:
            cpp.close()
        assert answer.startswith("error 9 ") and "not self-normalised" in answer, answer
    finally:
        server.kill()
