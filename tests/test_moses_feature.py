"""The Moses feature (moses_plugin/cpp/NeuralLMServer.{h,cpp}) compiled against Moses' own headers.

g++ -fsyntax-only with Moses' flags (../shared/moses-src/README.md) checks the translation
unit's syntax and types as Moses' build compiles it, without building Moses. The Moses tree:
$NLMSERVE_MOSES_SRC when set (read only), else ../shared/moses-src/mosesdecoder-34452895.tar.xz
(moses-smt/mosesdecoder @ 34452895) extracted once per test session. The feature's two files
are compiled from a folder of their own next to the client headers that the library installs
(the install(FILES ...) line of client/cpp/CMakeLists.txt), as a Moses build with
--with-nlmserve sees them. With -Wall -Wextra, a warning located in the feature or those
headers fails the test; the warnings of Moses' and boost's own headers are not ours.

The feature's logic that needs no Moses (its n-gram rows, word-id table, prefetch table, error
pause) is in nlmserve_decoder.h, tested by nlmserve_unit_test (tests/test_cpp_client.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import MOSES_TARBALL, extract_moses_tree

REPO = Path(__file__).resolve().parent.parent
CPP = REPO / "moses_plugin" / "cpp"
CLIENT_CPP = REPO / "client" / "cpp"
TARBALL = MOSES_TARBALL
FEATURE = ("NeuralLMServer.h", "NeuralLMServer.cpp", "NeuralLMServerSearch.h")  # what add_to_moses.py copies
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


def test_feature_compiles_against_moses_headers_without_warnings_of_its_own(moses_tree: Path,
                                                                           tmp_path: Path) -> None:
    _needs_compiler()
    lm = tmp_path / "lm"
    include = tmp_path / "include"  # PREFIX/include of `cmake --install`
    lm.mkdir()
    include.mkdir()
    for name in FEATURE:
        shutil.copy2(CPP / name, lm / name)
    headers = installed_headers()
    assert {"nlmserve_client.h", "nlmserve_decoder.h"} <= set(headers)
    for name in headers:
        shutil.copy2(CLIENT_CPP / name, include / name)
    # -I moses/LM stands for the feature's place in moses/LM/ ("SingleFactor.h"), -I . for Moses' root.
    cmd = ["g++", *MOSES_FLAGS, "-fsyntax-only", "-Wall", "-Wextra", "-I.", "-Imoses/LM", f"-I{include}",
           str(lm / "NeuralLMServer.cpp")]
    done = subprocess.run(cmd, cwd=moses_tree, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-6000:]}"
    ours = {(lm / n).resolve() for n in FEATURE} | {(include / n).resolve() for n in headers}
    mine = our_warnings(done.stderr, ours)
    assert not mine, "warnings in the feature or the client headers:\n" + "\n".join(mine)
    # The compiler ran the warnings on Moses' headers too: the flags were in force.
    assert "warning:" in done.stderr
