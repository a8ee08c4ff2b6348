"""The Moses feature (moses_plugin/cpp/NeuralLMServer.{h,cpp}) compiled against Moses' own headers.

g++ -fsyntax-only with Moses' flags (../shared/moses-src/README.md) checks the translation
unit's syntax and types as Moses' build compiles it, without building Moses. The Moses tree:
$NLMSERVE_MOSES_SRC when set (read only), else ../shared/moses-src/mosesdecoder-34452895.tar.xz
(moses-smt/mosesdecoder @ 34452895) extracted once per test session. The feature's two files
are compiled from a folder of their own next to the client headers that the library installs
(the install(FILES ...) line of client/cpp/CMakeLists.txt), as a Moses build with
--with-nlmserve sees them. With -Wall -Wextra, a warning located in the feature or those
headers fails the test; the warnings of Moses' and boost's own headers are not ours.

The feature's logic that needs no Moses (where it finds its model: a tables file, a server or
both; its n-gram rows, word-id table, prefetch table, error pause) is in nlmserve_decoder.h beside
it (moses_plugin/cpp), tested by nlmserve_decoder_test (tests/test_cpp_client.py). The translation unit compiled here holds
both ways of the feature: the server-free line (``tables=FILE``: the file's vocabulary, facts and
tables, no client) and the server's. Its headers, as the preprocessor lists them, hold none of
gRPC's or protobuf's: the feature compiles without their include path (the client library that
it links is what needs them).

The decode test runs a Moses build with the feature ($NLMSERVE_MOSES: the moses binary, built as
docs/moses.md says; skipped when unset) on the shipped French-English system
(../shared/data/moses-fr-en, its tables filtered to the first sentences of newstest2013, without
its KenLM, which is not shipped): the server-free line (tables=FILE, no server running) gives
the same n-best lists, scores included, as the feature fetching the same model's tables from a
server, and as both together; a file of another model than the server's stops Moses at load.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import MOSES_TARBALL, REPO as _REPO, extract_moses_tree, golden_model, start_server

REPO = Path(__file__).resolve().parent.parent
CPP = REPO / "moses_plugin" / "cpp"
CLIENT_CPP = REPO / "client" / "cpp"
TARBALL = MOSES_TARBALL
# What add_to_moses.py copies (its feature_sources: the feature, and the headers of its folder it includes).
FEATURE = ("NeuralLMServer.h", "NeuralLMServer.cpp", "NeuralLMServerPrefetch.cpp", "NeuralLMServerSearch.h",
           "NeuralLMServerThread.h", "nlmserve_decoder.h", "nlmserve_moses_ini.h")
# Its translation units: moses/LM/Jamfile's block compiles each into an object of its own.
UNITS = ("NeuralLMServer.cpp", "NeuralLMServerPrefetch.cpp")
# Moses' build passes the first two from its Jamfiles; the unit does not compile without them.
MOSES_FLAGS = ["-std=c++11", "-DMAX_NUM_FACTORS=4", "-DKENLM_MAX_ORDER=6", "-DWITH_THREADS", "-DTRACE_ENABLE=1"]
IN_CI = os.environ.get("CI") == "true"
WARNING = re.compile(r"^(?P<path>[^:\n]+):(?P<line>\d+):(?P<col>\d+): warning: (?P<text>.*)$", re.MULTILINE)


def installed_headers() -> list[str]:
    """The headers of client/cpp that `cmake --install` puts into PREFIX/include (the
    generated ones go to PREFIX/include/nlmserve/v1)."""
    text = (CLIENT_CPP / "CMakeLists.txt").read_text(encoding="utf-8")
    found = re.findall(r"install\s*\(\s*FILES\s+([^)]*?)\s+DESTINATION\s+include\s*\)", text)
    assert len(found) == 1, "CMakeLists.txt: one install(FILES ... DESTINATION include) line expected"
    return found[0].split()


def our_warnings(stderr: str, ours: set[Path]) -> list[str]:
    """The warnings of g++'s output whose location is one of `ours`."""
    return [m.group(0) for m in WARNING.finditer(stderr) if Path(m.group("path")).resolve() in ours]


@pytest.fixture(scope="session")
def moses_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NLMSERVE_MOSES_SRC")
    if given:
        tree = Path(given)
        if not (tree / "moses" / "LM" / "SingleFactor.h").is_file():
            pytest.fail(f"NLMSERVE_MOSES_SRC={given} is not a Moses source tree (no moses/LM/SingleFactor.h)")
        return tree
    if not TARBALL.is_file():
        pytest.skip(f"no Moses source tree: neither NLMSERVE_MOSES_SRC nor {TARBALL} "
                    "(../shared/moses-src/README.md)")
    tree = extract_moses_tree(tmp_path_factory.mktemp("moses-src"))
    assert (tree / "moses" / "LM" / "SingleFactor.h").is_file(), f"{TARBALL} holds no mosesdecoder/moses/LM"
    return tree


def _needs_compiler() -> None:
    missing = []
    if shutil.which("g++") is None:
        missing.append("g++ (Debian package g++)")
    if not Path("/usr/include/boost").is_dir():
        missing.append("boost headers in /usr/include/boost (Debian package libboost-dev)")
    if missing:
        message = f"needs {', '.join(missing)}; `make system-deps` installs them"
        if IN_CI:
            pytest.fail(f"CI=true but {message}")
        pytest.skip(message)


def test_warning_filter_keeps_only_our_files(tmp_path: Path) -> None:
    ours = {(tmp_path / "lm" / "NeuralLMServer.cpp").resolve()}
    stderr = (f"./moses/FF/DecodeFeature.h:61:3: warning: unused parameter 'x' [-Wunused-parameter]\n"
              f"In file included from {tmp_path}/lm/NeuralLMServer.cpp:3:\n"
              f"{tmp_path}/lm/NeuralLMServer.cpp:40:7: warning: unused variable 'y' [-Wunused-variable]\n")
    assert our_warnings(stderr, ours) == [
        f"{tmp_path}/lm/NeuralLMServer.cpp:40:7: warning: unused variable 'y' [-Wunused-variable]"]


def _feature_and_headers(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """The feature's files in tmp_path/lm (as add_to_moses.py copies them into moses/LM) and the
    client headers `cmake --install` puts into PREFIX/include, in tmp_path/include."""
    lm = tmp_path / "lm"
    include = tmp_path / "include"  # PREFIX/include of `cmake --install`
    lm.mkdir()
    include.mkdir()
    for name in FEATURE:
        shutil.copy2(CPP / name, lm / name)
    headers = installed_headers()
    assert {"nlmserve_client.h", "nlmserve_tables_file.h"} <= set(headers) and "nlmserve_decoder.h" not in headers
    for name in headers:
        shutil.copy2(CLIENT_CPP / name, include / name)
    return lm, include, headers


def test_feature_compiles_against_moses_headers_without_warnings_of_its_own(moses_tree: Path,
                                                                           tmp_path: Path) -> None:
    _needs_compiler()
    lm, include, headers = _feature_and_headers(tmp_path)
    # -I moses/LM stands for the feature's place in moses/LM/ ("SingleFactor.h"), -I . for Moses' root.
    ours = {(lm / n).resolve() for n in FEATURE} | {(include / n).resolve() for n in headers}
    for unit in UNITS:
        cmd = ["g++", *MOSES_FLAGS, "-fsyntax-only", "-Wall", "-Wextra", "-I.", "-Imoses/LM", f"-I{include}",
               str(lm / unit)]
        done = subprocess.run(cmd, cwd=moses_tree, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-6000:]}"
        mine = our_warnings(done.stderr, ours)
        assert not mine, f"warnings in the feature or the client headers ({unit}):\n" + "\n".join(mine)
        # The compiler ran the warnings on Moses' headers too: the flags were in force.
        assert "warning:" in done.stderr, unit


GRPC_HEADER = re.compile(r"(^|/)(grpc|grpcpp|grpc\+\+|google/protobuf|absl)/")


def test_the_feature_includes_no_grpc_header(moses_tree: Path, tmp_path: Path) -> None:
    """Every header the feature's translation unit includes, as g++ -M lists them: Moses', boost's,
    the system's and the client headers; none of gRPC, protobuf or absl, so the feature (the
    server-free line's code with the server's) compiles without their include path."""
    _needs_compiler()
    lm, include, _ = _feature_and_headers(tmp_path)
    for unit in UNITS:
        cmd = ["g++", *MOSES_FLAGS, "-M", "-I.", "-Imoses/LM", f"-I{include}", str(lm / unit)]
        done = subprocess.run(cmd, cwd=moses_tree, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-6000:]}"
        headers = done.stdout.replace("\\\n", " ").split()[1:]  # "NeuralLMServer.o: SOURCE HEADER ..."
        assert str(include / "nlmserve_tables_file.h") in headers and str(include / "nlmserve_client.h") in headers
        assert any(h.endswith("moses/LM/SingleFactor.h") for h in headers)
        grpc = [h for h in headers if GRPC_HEADER.search(h)]
        assert not grpc, f"the feature ({unit}) includes gRPC or protobuf headers: {grpc[:5]}"


SYSTEM = _REPO.parent / "shared" / "data" / "moses-fr-en"
NEWSTEST = _REPO.parent / "shared" / "data" / "nbest" / "newstest-fr-en" / "newstest2013.src"
DECODE_SENTENCES = 12
STACK = 50  # Moses' -stack: a smaller beam than its 200, the same for every run compared
MAX_PHRASE = 10  # the shipped tables' longest source phrase


def _moses_binary() -> Path:
    given = os.environ.get("NLMSERVE_MOSES")
    if not given:
        pytest.skip("no Moses build: set NLMSERVE_MOSES to a moses binary built with the feature (docs/moses.md)")
    if not (os.path.isfile(given) and os.access(given, os.X_OK)):
        pytest.fail(f"NLMSERVE_MOSES={given} is not an executable")
    if not (SYSTEM / "moses.ini").is_file() or not NEWSTEST.is_file():
        pytest.skip(f"no shipped system: {SYSTEM} or {NEWSTEST} is missing")
    return Path(given)


def _filtered(table: Path, sources: set[str], out: Path) -> Path:
    """The lines of the gzipped Moses table whose source phrase is one of ``sources``."""
    import gzip

    with gzip.open(table, "rt", encoding="utf-8") as f, open(out, "w", encoding="utf-8") as g:
        for line in f:
            if line.split(" ||| ", 1)[0] in sources:
                g.write(line)
    return out


def _system(tmp_path: Path, sentences: list[str]) -> str:
    """The shipped moses.ini without its KenLM (not shipped) and with tables filtered to ``sentences``
    (absolute paths), as text ending in its [weight] section."""
    sources = {" ".join(words[i:j]) for words in (s.split() for s in sentences)
               for i in range(len(words)) for j in range(i + 1, min(i + MAX_PHRASE, len(words)) + 1)}
    phrases = _filtered(SYSTEM / "phrase-table.gz", sources, tmp_path / "phrase-table")
    reordering = _filtered(SYSTEM / "reordering-table.wbe-msd-bidirectional-fe.gz", sources, tmp_path / "reordering")
    text = (SYSTEM / "moses.ini").read_text(encoding="utf-8")
    text = text.replace("path=phrase-table.gz", f"path={phrases}")
    text = text.replace("path=reordering-table.wbe-msd-bidirectional-fe.gz", f"path={reordering}")
    kept = [line for line in text.splitlines() if not line.startswith(("KENLM", "LM0="))]
    assert kept[-1].startswith("UnknownWordPenalty0="), "the shipped moses.ini ends with its [weight] section"
    return "\n".join(kept) + "\n"


def _decode(moses: Path, ini_text: str, feature: str, sentences: list[str], work: Path) -> tuple[int, str, str]:
    """Moses with ``feature`` added to the system: its exit status, its 10-best list and its stderr."""
    work.mkdir()
    ini = work / "moses.ini"
    ini.write_text(ini_text.replace("\n[weight]\n", f"\n{feature}\n\n[weight]\nNLM0= 0.1\n"), encoding="utf-8")
    nbest = work / "nbest"
    done = subprocess.run([str(moses), "-f", str(ini), "-threads", "2", "-stack", str(STACK), "-n-best-list",
                           str(nbest), "10"],
                          input="\n".join(sentences) + "\n", capture_output=True, text=True, timeout=300, cwd=work)
    return done.returncode, nbest.read_text(encoding="utf-8") if nbest.exists() else "", done.stderr


def test_the_server_free_line_decodes_as_the_server_does(tmp_path: Path, tiny_model_path: Path) -> None:
    from nlmserve.cli import main
    from nlmserve.lm.scoring import LanguageModel

    moses = _moses_binary()
    sentences = NEWSTEST.read_text(encoding="utf-8").splitlines()[:DECODE_SENTENCES]
    system = _system(tmp_path, sentences)
    tables = tmp_path / "tiny.nlt"
    assert main(["export-tables", "--model", str(tiny_model_path), "--out", str(tables)]) == 0
    line = "NeuralLMServer name=NLM0 factor=0 order=5 normalized=false"
    served = start_server(LanguageModel.load(tiny_model_path, device="cpu"))
    try:
        code, fetched, err = _decode(moses, system, f"{line} path={served.target} scoring=local", sentences,
                                     tmp_path / "fetched")
        assert code == 0, err[-3000:]
        code, both, err = _decode(moses, system, f"{line} path={served.target} tables={tables}", sentences,
                                  tmp_path / "both")
        assert code == 0, err[-3000:]
    finally:
        served.stop(1.0)
    code, mapped, err = _decode(moses, system, f"{line} tables={tables}", sentences, tmp_path / "mapped")
    assert code == 0, err[-3000:]
    assert f"mapped from {tables} (width 16, self-normalised); no server" in err
    rows = mapped.splitlines()
    assert len({row.split()[0] for row in rows}) == DECODE_SENTENCES and all(" NLM0= " in row for row in rows)
    assert mapped == fetched == both  # the n-best lists, every feature's score included

    other = start_server(LanguageModel.load(golden_model(tmp_path / "golden.nlm"), device="cpu"))
    try:
        code, _, err = _decode(moses, system, f"{line} path={other.target} tables={tables}", sentences[:1],
                               tmp_path / "other")
    finally:
        other.stop(1.0)
    refused = (rf"tables={re.escape(str(tables))} holds model \w+ \(order 5, \d+ words\), but "
               rf"{re.escape(other.target)} serves model \w+ \(order 3, 6 words\)")
    assert code != 0 and re.search(refused, err), err[-3000:]
