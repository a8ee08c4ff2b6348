"""moses_plugin/cpp/add_to_moses.py on the real moses/LM/Jamfile and moses/FF/Factory.cpp.

The files come from ../shared/moses-src/mosesdecoder-34452895.tar.xz (Moses @ 34452895,
the commit moses_plugin/README.md names), extracted once per module; each test works on
its own copy. The script runs as users run it, ``python3 -S add_to_moses.py DIR`` (``-S``:
no site-packages, so it must need the standard library only).

The compile check runs g++ -fsyntax-only on the patched Factory.cpp with and without
LM_NLMSERVE (the define --with-nlmserve gives it), and reads the preprocessed text of
both runs: the registration is there only with the define. The tarball lacks OnDiskPt/ and phrase-extract/, which two of
Factory.cpp's features (PhraseDictionaryOnDisk, PhraseOrientationFeature) include; while
they are missing, the compiled file is a copy of the patched Factory.cpp without those two
includes and registrations (everything else, the nlmserve lines included, as patched).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from support import MOSES_TARBALL, extract_moses_tree

REPO = Path(__file__).resolve().parent.parent
CPP = REPO / "moses_plugin" / "cpp"
SCRIPT = CPP / "add_to_moses.py"
TARBALL = MOSES_TARBALL
IN_CI = os.environ.get("CI") == "true"

JAMFILE = "moses/LM/Jamfile"
MOSES_JAMFILE = "moses/Jamfile"
FACTORY = "moses/FF/Factory.cpp"
FEATURE = ("NeuralLMServer.h", "NeuralLMServer.cpp", "NeuralLMServerPrefetch.cpp")

# The contract: the lines a Moses build depends on, as they must appear once each.
JAM_FEATURE = [
    'local with-nlmserve = [ option.get "with-nlmserve" ] ;',
    "if $(with-nlmserve) {",
    "  lib nlmserve_client : : <search>$(with-nlmserve)/lib <link>shared ;",
    "  obj NeuralLMServer.o : NeuralLMServer.cpp ..//headers : <include>$(with-nlmserve)/include ;",
    "  obj NeuralLMServerPrefetch.o : NeuralLMServerPrefetch.cpp ..//headers : <include>$(with-nlmserve)/include ;",
    "  alias nlmserve : NeuralLMServer.o NeuralLMServerPrefetch.o nlmserve_client : : : "
    "<linkflags>-Wl,-rpath,$(with-nlmserve)/lib <define>LM_NLMSERVE ;",
    "  dependencies += nlmserve ;",
    "  lmmacros += LM_NLMSERVE ;",
    "}",
]
JAM_TOP = "#Top-level LM library.  If you've added a file that doesn't depend on external"
LM_LOG_OLD = "for local i in srilm irstlm randlm {"
LM_LOG_NEW = "for local i in srilm irstlm randlm nlmserve {"
FACTORY_INCLUDE = ["#ifdef LM_NLMSERVE", '#include "moses/LM/NeuralLMServer.h"', "#endif"]
FACTORY_REGISTRATION = ["#ifdef LM_NLMSERVE", "  MOSES_FNAME(NeuralLMServer);", "#endif"]
INCLUDE_ANCHOR = '#include "moses/LM/ExampleLM.h"'
REGISTRATION_ANCHOR = "  MOSES_FNAME(ExampleLM);"

# Factory.cpp lines that need OnDiskPt/ or phrase-extract/ (not in the tarball).
NEEDS_MISSING_DIRS = {
    '#include "moses/TranslationModel/RuleTable/PhraseDictionaryOnDisk.h"': "OnDiskPt/OnDiskWrapper.h",
    "  MOSES_FNAME(PhraseDictionaryOnDisk);": "OnDiskPt/OnDiskWrapper.h",
    '#include "moses/FF/PhraseOrientationFeature.h"': "phrase-extract/PhraseOrientation.h",
    "  MOSES_FNAME(PhraseOrientationFeature);": "phrase-extract/PhraseOrientation.h",
}
GXX_FLAGS = ["-std=c++11", "-DMAX_NUM_FACTORS=4", "-DKENLM_MAX_ORDER=6", "-DWITH_THREADS",
             "-DTRACE_ENABLE=1", "-I."]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("add_to_moses", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("add_to_moses", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-S", str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")


def count_run(haystack: list[str], needle: list[str]) -> list[int]:
    """Indices where ``needle`` occurs as consecutive lines of ``haystack``."""
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i:i + len(needle)] == needle]


def snapshot(tree: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file of ``tree``: bytes, mtime in ns, mode."""
    out = {}
    for p in sorted(tree.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(tree))] = (p.read_bytes(), st.st_mtime_ns, st.st_mode)
    return out


def without_blocks(text: str) -> str:
    """``text`` with the script's marked blocks taken out and replaced lines put back."""
    out: list[str] = []
    block: list[str] | None = None
    for line in text.split("\n"):
        s = line.strip()
        if block is None and (s.startswith("# >>> nlmserve") or s.startswith("// >>> nlmserve")):
            block = []
        elif block is not None and (s.startswith("# <<< nlmserve") or s.startswith("// <<< nlmserve")):
            out += [b.removeprefix("# The line was: ") for b in block if b.startswith("# The line was: ")]
            block = None
        elif block is not None:
            block.append(line)
        else:
            out.append(line)
    assert block is None, "a block without its end marker"
    return "\n".join(out)


@pytest.fixture(scope="module")
def moses_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tarball's tree, extracted once per module; tests copy it and leave it as it is."""
    if not TARBALL.is_file():
        pytest.skip(f"needs {TARBALL.name} in ../shared/moses-src (a Moses source tree; "
                    "../shared/moses-src/README.md)")
    return extract_moses_tree(tmp_path_factory.mktemp("moses-src"))


@pytest.fixture
def moses(moses_src: Path, tmp_path: Path) -> Path:
    """The two files the script edits, as in Moses, in a fresh tree."""
    tree = tmp_path / "mosesdecoder"
    for rel in (JAMFILE, MOSES_JAMFILE, FACTORY):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(moses_src / rel, tree / rel)
    return tree


def test_applies_once(moses: Path, moses_src: Path) -> None:
    r = run(moses)
    assert r.returncode == 0, r.stderr
    copied = _script().feature_sources()
    assert copied[:3] == list(FEATURE)
    for name in copied:
        assert (moses / "moses" / "LM" / name).read_bytes() == (CPP / name).read_bytes(), name
    assert sorted(p.name for p in (moses / "moses" / "LM").iterdir()) == sorted(["Jamfile", *copied])

    jam = lines(moses / JAMFILE)
    (feature,) = count_run(jam, JAM_FEATURE)
    assert feature < jam.index(JAM_TOP) < next(i for i, s in enumerate(jam) if s.startswith("alias LM :"))
    # FF_Factory.o, and only it, depends on bin/lm.log, which records the options of this loop.
    top = lines(moses / MOSES_JAMFILE)
    assert top.count(LM_LOG_NEW) == 1 and LM_LOG_OLD not in top
    assert "# The line was: " + LM_LOG_OLD in top
    assert sum("<dependency>$(LM-LOG)" in s for s in top) == 1
    assert any(s.startswith("obj FF_Factory.o :") and "<dependency>$(LM-LOG)" in s for s in top)

    factory = lines(moses / FACTORY)
    (inc,) = count_run(factory, FACTORY_INCLUDE)
    (reg,) = count_run(factory, FACTORY_REGISTRATION)
    # Right after their anchors (the marker and comment lines between).
    assert 0 < inc - factory.index(INCLUDE_ANCHOR) <= 4
    assert 0 < reg - factory.index(REGISTRATION_ANCHOR) <= 2
    assert sum("NeuralLMServer" in s and not s.lstrip().startswith("//") for s in factory) == 2

    # Nothing else changed: without the blocks the files are Moses' again, byte for byte.
    for rel in (JAMFILE, MOSES_JAMFILE, FACTORY):
        assert without_blocks((moses / rel).read_text(encoding="utf-8")) == \
            (moses_src / rel).read_text(encoding="utf-8"), rel
    assert f"{3 + len(copied)} file(s) changed" in r.stdout and "--with-nlmserve=PREFIX" in r.stdout


def test_second_run_changes_nothing(moses: Path) -> None:
    assert run(moses).returncode == 0
    before = snapshot(moses)
    r = run(moses)
    assert r.returncode == 0, r.stderr
    assert "nothing to change" in r.stdout
    assert snapshot(moses) == before  # bytes, mtimes, modes; no temporary files left


def test_refreshes_a_copy_that_differs_and_only_it(moses: Path) -> None:
    assert run(moses).returncode == 0
    stale = moses / "moses" / "LM" / "NeuralLMServer.cpp"
    stale.write_bytes(stale.read_bytes() + b"// an older version\n")
    before = snapshot(moses)
    r = run(moses)
    assert r.returncode == 0, r.stderr
    assert stale.read_bytes() == (CPP / "NeuralLMServer.cpp").read_bytes()
    after = snapshot(moses)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"moses/LM/NeuralLMServer.cpp"}
    assert "moses/LM/NeuralLMServer.cpp: replaced by" in r.stdout and "1 file(s) changed" in r.stdout


def test_a_block_that_differs_is_replaced(moses: Path) -> None:
    """A block from another version of the script (here: edited) is rewritten in place."""
    assert run(moses).returncode == 0
    fresh = (moses / FACTORY).read_bytes()
    factory = moses / FACTORY
    factory.write_text(factory.read_text(encoding="utf-8").replace(
        "  MOSES_FNAME(NeuralLMServer);", "  MOSES_FNAME2(\"NeuralLMServer\", NeuralLMServer);"), encoding="utf-8")
    r = run(moses)
    assert r.returncode == 0, r.stderr
    assert "block 'nlmserve registration' replaced" in r.stdout
    assert factory.read_bytes() == fresh


@pytest.mark.parametrize("rel, anchor", [
    (JAMFILE, JAM_TOP),
    (MOSES_JAMFILE, LM_LOG_OLD),
    (FACTORY, INCLUDE_ANCHOR),
    (FACTORY, REGISTRATION_ANCHOR),
])
@pytest.mark.parametrize("how", ["changed", "doubled"])
def test_an_anchor_not_found_once_changes_nothing(moses: Path, rel: str, anchor: str, how: str) -> None:
    path = moses / rel
    text = path.read_text(encoding="utf-8")
    assert text.count(anchor + "\n") == 1
    new = anchor.replace("ExampleLM", "ExampleLM2").replace("randlm", "rand-lm").replace("Top-level", "Top level")
    assert new != anchor
    path.write_text(text.replace(anchor + "\n", new + "\n" if how == "changed" else 2 * (anchor + "\n")),
                    encoding="utf-8")
    before = snapshot(moses)
    r = run(moses)
    assert r.returncode == 2
    assert str(path) in r.stderr and anchor.strip() in r.stderr
    assert ("occurs 0 times" if how == "changed" else "occurs 2 times") in r.stderr
    assert snapshot(moses) == before  # not even the feature files were copied


def test_hand_made_lines_are_refused(moses: Path) -> None:
    """The lines the README used to ask for by hand, without the markers: the script does not add a second copy."""
    factory = moses / FACTORY
    text = factory.read_text(encoding="utf-8")
    factory.write_text(text.replace(REGISTRATION_ANCHOR + "\n", REGISTRATION_ANCHOR + "\n"
                                    + "\n".join(FACTORY_REGISTRATION) + "\n"), encoding="utf-8")
    before = snapshot(moses)
    r = run(moses)
    assert r.returncode == 2
    line = lines(factory).index("#ifdef LM_NLMSERVE") + 1
    assert f"{factory}, line {line}: '#ifdef LM_NLMSERVE'" in r.stderr and "by hand" in r.stderr
    assert snapshot(moses) == before


def test_missing_directory_or_not_moses(tmp_path: Path) -> None:
    r = run(tmp_path / "no-such-moses")
    assert r.returncode == 2
    assert f"{tmp_path / 'no-such-moses'}: no such directory" in r.stderr
    r = run(tmp_path)
    assert r.returncode == 2
    assert f"{tmp_path} is not a Moses source tree: {tmp_path / JAMFILE} is missing" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_check_changes_nothing(moses: Path) -> None:
    before = snapshot(moses)
    r = run(moses, "--check")
    assert r.returncode == 1, r.stderr
    assert snapshot(moses) == before
    for what in ("moses/LM/NeuralLMServer.h: would be copied", "moses/LM/NeuralLMServer.cpp: would be copied",
                 "moses/LM/NeuralLMServerPrefetch.cpp: would be copied",
                 "moses/LM/Jamfile: block 'nlmserve feature' would be added before line",
                 "moses/Jamfile: block 'nlmserve Factory.o dependency' would be added in place of line",
                 "moses/FF/Factory.cpp: block 'nlmserve include' would be added after line",
                 "moses/FF/Factory.cpp: block 'nlmserve registration' would be added after line",
                 f"{3 + len(_script().feature_sources())} file(s) would change"):
        assert what in r.stdout
    assert run(moses).returncode == 0
    applied = snapshot(moses)
    r = run(moses, "--check")
    assert r.returncode == 0 and "nothing to change" in r.stdout
    assert snapshot(moses) == applied


def test_copies_the_local_headers_the_feature_includes(tmp_path: Path) -> None:
    """Headers of moses_plugin/cpp that the feature includes go along; those client/cpp installs and
    Moses' own do not."""
    script = _script()
    installed = script.installed_headers()
    assert "nlmserve_client.h" in installed
    sources = script.feature_sources()
    assert sources[:3] == list(FEATURE)
    assert all((CPP / name).is_file() and name not in installed for name in sources)
    src = tmp_path / "cpp"
    src.mkdir()
    (src / "NeuralLMServer.h").write_text('#include "SingleFactor.h"\n#include "ngram_key.h"\n')
    (src / "NeuralLMServer.cpp").write_text('#include "NeuralLMServer.h"\n#include "nlmserve_client.h"\n')
    (src / "NeuralLMServerPrefetch.cpp").write_text('#include "NeuralLMServer.h"\n#include "thread_buffers.h"\n')
    (src / "thread_buffers.h").write_text('#include "ngram_key.h"\n')
    (src / "ngram_key.h").write_text('#include "lru_cache.h"\n')
    (src / "lru_cache.h").write_text("\n")
    (src / "nlmserve_client.h").write_text("\n")
    assert script.feature_sources(src) == ["NeuralLMServer.h", "NeuralLMServer.cpp", "NeuralLMServerPrefetch.cpp",
                                          "ngram_key.h", "thread_buffers.h", "lru_cache.h"]


def _needs_compiler() -> None:
    missing = []
    if shutil.which("g++") is None:
        missing.append("g++ (Debian package g++)")
    if not Path("/usr/include/boost").is_dir():
        missing.append("boost headers (Debian package libboost-dev)")
    if missing:
        if IN_CI:
            pytest.fail(f"CI=true but {', '.join(missing)} missing: make system-deps installs them")
        pytest.skip(f"needs {', '.join(missing)}; make system-deps installs them")


def test_patched_factory_compiles_with_and_without_the_define(moses_src: Path, tmp_path: Path) -> None:
    _needs_compiler()
    tree = tmp_path / "mosesdecoder"
    shutil.copytree(moses_src, tree)
    r = run(tree)
    assert r.returncode == 0, r.stderr

    factory = tree / FACTORY
    source = factory
    dropped = [line for line, header in NEEDS_MISSING_DIRS.items() if not (tree / header).is_file()]
    if dropped:
        patched = lines(factory)
        for line in dropped:
            assert patched.count(line) == 1, line
        source = factory.with_name("Factory_check.cpp")  # same folder: same relative includes
        source.write_text("\n".join(s for s in patched if s not in dropped), encoding="utf-8")
    rel = str(source.relative_to(tree))

    # As bjam compiles FF_Factory.o: the define, and no include path of the client library
    # (only NeuralLMServer.o gets PREFIX/include), so the feature's header must need only Moses'.
    with_define = ["-DLM_NLMSERVE"]
    # -save-temps keeps the preprocessed text (a .ii file in the -o folder) of the same run.
    runs = {}
    for name, extra in (("plain", []), ("with LM_NLMSERVE", with_define)):
        out = tmp_path / name.replace(" ", "-")
        out.mkdir()
        runs[name] = out, subprocess.Popen(
            ["g++", *GXX_FLAGS, *extra, "-fsyntax-only", "-save-temps=obj", "-o", str(out / "check"), rel],
            cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    preprocessed = {}
    for name, (out, p) in runs.items():
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, f"{name}: {rel} does not compile:\n{err[-4000:]}"
        (ii,) = out.glob("*.ii")
        preprocessed[name] = ii.read_text(encoding="utf-8", errors="replace")

    registration = 'Add("NeuralLMServer", new DefaultFeatureFactory< NeuralLMServer >());'
    assert preprocessed["with LM_NLMSERVE"].count(registration) == 1
    assert 'Add("ExampleLM", new DefaultFeatureFactory< ExampleLM >());' in preprocessed["plain"]
    assert "NeuralLMServer" not in preprocessed["plain"]
