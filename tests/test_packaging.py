"""`pip install .` on a fresh clone: the build itself generates nlmserve.proto (setup.py).

A copy of the checkout as git would give it (tracked and new unignored files, no generated
stubs, no egg-info) is built into a wheel, and the wheel is installed into a new virtual environment
with ``--no-deps``; the dependencies are reached through a ``.pth`` line to this
environment's site-packages, so nothing is downloaded (the builds use this environment's
setuptools and grpcio-tools: ``--no-build-isolation``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import ModuleType


REPO = Path(__file__).resolve().parent.parent

PROTO_FILES = ("__init__.py", "lm_pb2.py", "lm_pb2.pyi", "lm_pb2_grpc.py", "lm_pb2_grpc.pyi", "py.typed")
PIP = [sys.executable, "-m", "pip"]


def load_setup_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nlmserve_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the build step; setup() runs only as __main__
    return module


def clean_copy(dest: Path) -> Path:
    """The files of a fresh clone of the working tree (uncommitted edits included)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is not in a clone either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    assert not (dest / "proto" / "lm_pb2.py").exists() and (dest / "setup.py").is_file()
    return dest


def fresh_venv(path: Path) -> Path:
    """A new environment without pip whose dependencies are this environment's (a .pth line)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps-of-the-test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run(args: list[str | Path], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


def test_rewrite_imports_targets_the_installed_module_only() -> None:
    setup_py = load_setup_py()
    text = ("from nlmserve.v1 import lm_pb2 as nlmserve_dot_v1_dot_lm__pb2\n"
            "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'nlmserve.v1.lm_pb2', _globals)\n"
            "'/nlmserve.v1.LanguageModel/ScoreNgrams'\n")
    assert setup_py.rewrite_imports(text) == (
        "from nlmserve.proto import lm_pb2 as nlmserve_dot_v1_dot_lm__pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'nlmserve.proto.lm_pb2', _globals)\n"
        "'/nlmserve.v1.LanguageModel/ScoreNgrams'\n")  # the wire names stay


def test_installed_stubs_are_what_the_build_generates_from_the_proto(tmp_path: Path) -> None:
    """The development install is current: lm.proto has not changed since it was built."""
    import nlmserve.proto

    load_setup_py().generate_stubs(tmp_path)
    installed = Path(nlmserve.proto.__file__).parent
    for name in PROTO_FILES:
        assert (tmp_path / name).read_text() == (installed / name).read_text(), f"{name}: run make install"


def test_wheel_from_a_fresh_clone_installs_and_runs(tmp_path: Path) -> None:
    src = clean_copy(tmp_path / "src")
    run([*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("nlmserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert {f"nlmserve/proto/{n}" for n in PROTO_FILES} <= names
        # the checkout's root is the package: its rooms and nothing of the build, tests or bench
        assert {"nlmserve/__init__.py", "nlmserve/__main__.py", "nlmserve/common/errors.py",
                "nlmserve/wire/ngrams.py", "nlmserve/server/engine.py", "nlmserve/cli.py",
                "nlmserve/pipeline/steps.py"} <= names
        assert not [n for n in names if n.startswith(("nlmserve/setup.py", "nlmserve/tests/", "nlmserve/bench/",
                                                      "nlmserve/experiments/", "nlmserve/proto/contract/"))]
        grpc_py = zf.read("nlmserve/proto/lm_pb2_grpc.py").decode()
        pb2_py = zf.read("nlmserve/proto/lm_pb2.py").decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "from nlmserve.proto import lm_pb2" in grpc_py and "nlmserve.v1 import" not in grpc_py
    assert "'nlmserve.proto.lm_pb2'" in pb2_py
    # the wheel asks for a protobuf runtime at least as new as the code its protoc wrote
    gencode = re.search(r"^# Protobuf Python Version: ([\d.]+)", pb2_py, re.M)
    floor = re.search(r"^Requires-Dist: protobuf>=([\d.]+)", metadata, re.M)
    assert floor is not None
    if gencode is not None:
        as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
        assert as_tuple(floor.group(1)) >= as_tuple(gencode.group(1))

    python = fresh_venv(tmp_path / "venv")
    run([*PIP, "--python", python, "install", "-q", "--no-deps", wheel], cwd=tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = run([python, "-c", "from nlmserve.client import LMClient; import nlmserve.proto.lm_pb2_grpc as g; "
                 "print(g.__file__); print(LMClient.__module__)"], cwd=outside)
    assert where.splitlines()[0].startswith(str(tmp_path / "venv")), where  # the wheel's copy, not the checkout
    help_text = run([tmp_path / "venv" / "bin" / "nlmserve", "--help"], cwd=outside)
    assert "serve" in help_text and "train" in help_text


def test_strict_editable_install_of_a_fresh_clone_sees_the_generated_stubs(tmp_path: Path) -> None:
    """``make install``'s command: the stubs are generated into proto/ and linked."""
    src = clean_copy(tmp_path / "src")
    python = fresh_venv(tmp_path / "venv")
    run([*PIP, "--python", python, "install", "-q", "--no-deps", "--no-build-isolation", "-e", src,
         "--config-settings", "editable_mode=strict"], cwd=src)
    assert set(PROTO_FILES) <= {p.name for p in (src / "proto").iterdir()}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = run([python, "-c", "import os, nlmserve.proto.lm_pb2 as m; print(os.path.realpath(m.__file__))"],
                cwd=outside)
    assert where.strip() == str(src / "proto" / "lm_pb2.py")
