"""The Makefile's torch choice, as make expands it (``make -n``: printed, nothing run).

``make`` installs the CPU wheel from PyTorch's CPU index (the one docker/Dockerfile.cpu
uses), ``TORCH=cuda`` and ``TORCH=pypi`` the wheel of the configured index (PyPI's is the
CUDA build on Linux), any other value stops make; .ci/run passes ``pypi`` unless told.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _torch_install(*args: str) -> subprocess.CompletedProcess[str]:
    """What ``make`` would run to install the dependencies (``-B``: as on a fresh clone).

    Run under ``make test TORCH=pypi`` (.ci/run), the choice also reaches this make through
    MAKEFLAGS, so neither it nor the outer make's other variables are passed on.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-n", "-B", ".venv/.deps-stamp", *args], cwd=REPO, text=True,
                          capture_output=True, env=env, check=False)


def _torch_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "install" in x and "torch==" in x]
    return line


def test_the_default_is_the_cpu_wheel() -> None:
    line = _torch_line(_torch_install())
    assert line.endswith(f"torch==2.13.0 {CPU_INDEX}")
    dockerfile = (REPO / "docker" / "Dockerfile.cpu").read_text()
    # the image installs the same wheel by default (its TORCH_INDEX, tests/test_docker_files.py)
    assert "torch==2.13.0 " in dockerfile and f"ARG TORCH_INDEX={CPU_INDEX.split()[-1]}\n" in dockerfile


@pytest.mark.parametrize("choice", ["cuda", "pypi"])
def test_cuda_and_pypi_take_the_configured_index(choice: str) -> None:
    line = _torch_line(_torch_install(f"TORCH={choice}"))
    assert line.rstrip().endswith("torch==2.13.0") and "--index-url" not in line


def test_another_choice_stops_make() -> None:
    done = _torch_install("TORCH=rocm")
    assert done.returncode != 0 and "TORCH must be cpu, cuda or pypi, not 'rocm'" in done.stderr


def test_ci_takes_the_mirrors_wheel_unless_told() -> None:
    text = (REPO / ".ci" / "run").read_text()
    assert re.search(r'^make test TORCH="\$\{TORCH:-pypi\}"$', text, re.M)
