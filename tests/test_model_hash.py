"""A model's hash names the model, not the folder it was trained in (lm/model_file.py,
version 3): the same training in two folders gives one hash, the paths stay in the file as
provenance outside the hash, and files written before keep loading with the hash they store."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from nlmserve.cli import main
from nlmserve.common.errors import ModelFileError
from nlmserve.common.serve_process import nlmserve_command
from nlmserve.lm.model_file import MAGIC, read_model_file

# The experiment's own training command (pipeline/experiment.py) on a small budget.
_TRAIN_ARGS = ("--recipe", "none", "--order", "3", "--dim", "8", "--classes", "8", "--min-count", "2",
               "--threads", "1", "--batch-size", "128", "--valid-every", "10", "--no-progress")
_STEPS = 20


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    blob = path.read_bytes()
    _, version, length = struct.unpack_from("<8sIQ", blob)
    return version, json.loads(blob[20 : 20 + length])


def _rewrite(path: Path, out: Path, version: int, header: dict[str, Any]) -> None:
    """``path``'s data under ``header`` (its sha256 as given) and ``version``, laid out as a
    writer of that version does."""
    blob = path.read_bytes()
    _, _, length = struct.unpack_from("<8sIQ", blob)
    data_start = (20 + length + 63) // 64 * 64
    data = blob[data_start:]
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    prefix = struct.pack("<8sIQ", MAGIC, version, len(text))
    pad = (len(prefix) + len(text) + 63) // 64 * 64 - len(prefix) - len(text)
    out.write_bytes(prefix + text + b"\0" * pad + data)


@pytest.fixture(scope="module")
def two_trainings(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path,
                  dev_small_path: Path) -> tuple[Path, Path]:
    """The experiment's training, with the same settings, in two work folders: each joins
    the same two texts into its own train.txt and writes its own nlm.model."""
    from nlmserve.pipeline.experiment import training_command, training_text
    from nlmserve.pipeline.config import ExperimentConfig

    models = []
    for name in ("demo", "demo-2"):
        work = tmp_path_factory.mktemp(name)
        config = ExperimentConfig(workdir=str(work), train_text=(str(train_small_path), str(dev_small_path)),
                                  valid_text=str(dev_small_path), steps=_STEPS, train_args=_TRAIN_ARGS)
        cmd = training_command(config, training_text(config.train_text, work), work / "nlm.model")
        assert main(cmd[len(nlmserve_command()):]) == 0
        models.append(work / "nlm.model")
    return models[0], models[1]


def test_the_same_training_in_two_folders_has_one_hash(two_trainings: tuple[Path, Path]) -> None:
    first, second = (read_model_file(p) for p in two_trainings)
    assert first.training["train"] != second.training["train"]  # the paths differ, and are kept
    assert first.training["train_config"]["out"] == str(two_trainings[0])
    assert first.sha256 == second.sha256
    # what makes the weights is inside the hash: the settings, the steps, the data's bytes
    version, header = _header(two_trainings[0])
    assert version == 3 and "train" not in header["training"] and header["provenance"]["train"]
    assert header["training"]["train_config"]["seed"] == 1 and header["training"]["steps"] == _STEPS
    assert "out" not in header["training"]["train_config"]


def test_the_tables_files_and_info_report_that_hash(two_trainings: tuple[Path, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.lm.tables_file import read_tables_file

    model_hash = read_model_file(two_trainings[0]).sha256
    for i, model in enumerate(two_trainings):
        assert main(["export-tables", "--model", str(model), "--out", str(tmp_path / f"{i}.nlt")]) == 0
        assert read_tables_file(tmp_path / f"{i}.nlt").model_hash == model_hash
        assert main(["info", str(tmp_path / f"{i}.nlt"), "--json"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["model_hash"] == model_hash


def test_provenance_is_outside_the_hash_and_the_model_inside(two_trainings: tuple[Path, Path],
                                                             tmp_path: Path) -> None:
    model = two_trainings[0]
    version, header = _header(model)
    stored = header["sha256"]
    moved = json.loads(json.dumps(header))
    moved["provenance"]["train_config"]["out"] = "/elsewhere/nlm.model"
    _rewrite(model, tmp_path / "moved.nlm", version, moved)
    assert read_model_file(tmp_path / "moved.nlm").sha256 == stored  # verified: the hash holds
    changed = json.loads(json.dumps(header))
    changed["training"]["train_config"]["seed"] = 2
    _rewrite(model, tmp_path / "changed.nlm", version, changed)
    with pytest.raises(ModelFileError, match="content hash mismatch"):
        read_model_file(tmp_path / "changed.nlm")


def test_a_file_of_the_old_rule_loads_and_reports_its_stored_hash(two_trainings: tuple[Path, Path],
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A version 1 file (as written before version 3: the paths inside the hashed header)."""
    from nlmserve.lm.scoring import LanguageModel

    model = two_trainings[0]
    _, header = _header(model)
    new = read_model_file(model)
    old = {key: value for key, value in header.items() if key not in ("provenance", "sha256")}
    old["training"] = new.training  # the whole record, paths included, as version 1 wrote it
    blob = model.read_bytes()
    _, _, length = struct.unpack_from("<8sIQ", blob)
    digest = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    digest.update(blob[(20 + length + 63) // 64 * 64 :])
    old["sha256"] = digest.hexdigest()
    assert old["sha256"] != new.sha256  # the old rule hashed the paths
    path = tmp_path / "old.nlm"
    _rewrite(model, path, 1, old)
    lm = LanguageModel.load(path, device="cpu")
    assert lm.model_hash == old["sha256"] and lm.format_version == 1 and lm.training == new.training
    assert main(["info", str(path), "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_hash"] == old["sha256"] and info["training"]["train"] == new.training["train"]
