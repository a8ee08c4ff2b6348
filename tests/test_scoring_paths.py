"""The device-agnostic torch path (what a GPU runs) forced on the CPU scores what the CPU
tables score: ``LanguageModel(cpu_tables=False)``, ``NLMSERVE_NO_CPU_TABLES``, and the
server's ``cpu_tables`` setting (``nlmserve serve --no-cpu-tables``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nlmserve.lm.scoring import LanguageModel
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import load_model
from support import dev_ngrams, golden_model

TOL = 1e-5


@pytest.fixture(scope="module")
def golden_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return golden_model(tmp_path_factory.mktemp("golden") / "golden.nlm")


@pytest.mark.parametrize("rows", [20, 500], ids=["tiny-batch", "large-batch"])  # numpy tables, torch tables
@pytest.mark.parametrize("normalized", [True, False])
def test_forced_torch_path_equals_the_cpu_tables(tiny_model_path: Path, rows: int, normalized: bool) -> None:
    tables = LanguageModel.load(tiny_model_path, device="cpu")
    plain = LanguageModel.load(tiny_model_path, device="cpu", cpu_tables=False)
    assert tables._tables() is not None and plain._tables() is None
    ids = dev_ngrams(tables, 0, 60)[:rows].astype(np.int64)
    assert len(ids) == rows
    a = tables.score_ngrams(ids, normalized=normalized)
    b = plain.score_ngrams(ids, normalized=normalized)
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    # the server's pieces take the same path
    ctx, target = plain.prepare_contexts(ids)
    norm = np.full(rows, normalized)
    np.testing.assert_allclose(plain.score_prepared(ctx.numpy(), target.numpy(), norm), a, atol=TOL, rtol=0)


def test_forced_torch_path_on_the_golden_model(golden_path: Path) -> None:
    tables = LanguageModel.load(golden_path, device="cpu")
    plain = LanguageModel.load(golden_path, device="cpu", cpu_tables=False)
    # every n-gram of order 3 the model can score: contexts over all 6 ids, targets but <s>
    grid = np.array([[x, y, w] for x in range(6) for y in range(6) for w in range(6) if w != 1])
    for normalized in (True, False):
        np.testing.assert_allclose(plain.score_ngrams(grid, normalized=normalized),
                                   tables.score_ngrams(grid, normalized=normalized), atol=TOL, rtol=0)
        np.testing.assert_allclose(plain.score_ngrams(grid[:7], normalized=normalized),
                                   tables.score_ngrams(grid[:7], normalized=normalized), atol=TOL, rtol=0)


def test_the_environment_and_the_server_setting_turn_the_tables_off(golden_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NLMSERVE_NO_CPU_TABLES", "1")
    assert not LanguageModel.load(golden_path, device="cpu").cpu_tables
    assert LanguageModel.load(golden_path, device="cpu", cpu_tables=True).cpu_tables  # an explicit choice wins
    monkeypatch.setenv("NLMSERVE_NO_CPU_TABLES", "0")
    assert LanguageModel.load(golden_path, device="cpu").cpu_tables
    monkeypatch.delenv("NLMSERVE_NO_CPU_TABLES")
    lm: Any = load_model(ServerConfig(model=str(golden_path), device="cpu", cpu_tables=False))
    assert not lm.cpu_tables and lm._tables() is None
    lm = load_model(ServerConfig(model=str(golden_path), device="cpu"))
    assert lm.cpu_tables and lm._tables() is not None


def test_serve_has_the_flag() -> None:
    help_text = subprocess.run([sys.executable, "-m", "nlmserve", "serve", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "--no-cpu-tables" in help_text
