"""What an experiment's work directory was made from (``WORKDIR/inputs.json``).

The experiment reuses every output it finds in its work directory, so a rerun resumes
where an interrupted one stopped. That is only right when the outputs came from the same
inputs: a model trained on other text, or lists rescored from other n-best files, would
be reused silently and the table would mix two experiments. The first run therefore
records its inputs — the SHA-256 of every list, reference and training text, the training
settings — and each later run compares its own with them before any work:

* ``lists``: dev and test n-best lists and references, and ``lowercase``; always checked.
* ``training``: training texts (in order), validation text, steps, minutes and ``train_args``;
  recorded when the experiment trains the model and checked when it would train again.
  A run given ``--model`` or ``--server`` does not train; the model hash that rescoring
  records (``*.rescore.json``) already ties the rescored lists to one model.

A work directory that holds outputs but no record (made by a version that kept none) is
refused as well: nothing says what those outputs were made from. A record made with other
training settings (e.g. ``make demo`` after an update changed the demo's recipe) is refused
with what differs, recorded and now, and the two ways on: remove the directory, or name a
new one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..common.errors import NlmserveError
from .config import ExperimentConfig
from ..moses_plugin.nbest import file_sha256, write_text_atomic

RECORD = "inputs.json"
# Outputs whose presence without a record means an earlier, unrecorded run.
_OUTPUTS = ("nlm.model", "dev.nlm.nbest.gz", "test.nlm.nbest.gz", "test.mert.1best", "test.mira.1best")


def _digest(path: str, what: str) -> str:
    try:
        return file_sha256(path)
    except OSError as exc:
        raise NlmserveError(f"{what} {path}: {exc.strerror or exc}") from exc


def inputs_of(config: ExperimentConfig, trains: bool) -> dict[str, dict[str, Any]]:
    """The record of ``config``'s inputs (``training`` only when this run trains the model)."""
    record: dict[str, dict[str, Any]] = {"lists": {
        "dev_nbest": _digest(config.dev_nbest, "dev n-best list"),
        "dev_ref": [_digest(r, "dev reference") for r in config.dev_ref],
        "test_nbest": _digest(config.test_nbest, "test n-best list"),
        "test_ref": [_digest(r, "test reference") for r in config.test_ref],
        "lowercase": config.lowercase,
    }}
    if trains:
        record["training"] = {
            "train_text": [_digest(t, "training text") for t in config.train_text],
            "valid_text": _digest(config.valid_text, "validation text"),
            "steps": config.steps,
            "minutes": config.minutes,
            "train_args": list(config.train_args),
        }
    return record


def _shown(value: Any) -> str:
    """A recorded value as the refusal shows it: digests shortened, flags as typed."""
    if value is None:
        return "none"
    if isinstance(value, str) and len(value) == 64:
        return f"file {value[:12]}"
    if isinstance(value, list):
        return "[" + " ".join(_shown(v) if isinstance(v, str) and len(v) == 64 else str(v) for v in value) + "]"
    return str(value)


def check_workdir(config: ExperimentConfig, work: Path, trains: bool) -> None:
    """Record the inputs in a new work directory, or check them against its record.

    Raises :class:`NlmserveError` naming every input that differs, or when the directory
    holds outputs without a record; writes nothing then.
    """
    current = inputs_of(config, trains)
    path = work / RECORD
    if not path.exists():
        found = [name for name in _OUTPUTS if (work / name).exists()]
        if found:
            raise NlmserveError(f"{work} holds results ({', '.join(found)}) with no record of what they were made "
                                f"from ({RECORD}, written since): remove it or choose another --workdir")
        write_text_atomic(path, json.dumps(current, indent=2, sort_keys=True) + "\n")
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NlmserveError(f"{path}: unreadable record of the work directory's inputs ({exc})") from exc
    changed = [(f"{section}.{key}", saved[section].get(key), value) for section, values in current.items()
               if section in saved for key, value in values.items() if saved[section].get(key) != value]
    if changed:
        what = "; ".join(f"{name}: {_shown(old)} recorded, {_shown(new)} now" for name, old, new in changed)
        raise NlmserveError(f"{work} was made from other inputs ({', '.join(n for n, _, _ in changed)} differ from "
                            f"{work / RECORD}: {what}); its outputs would be reused, so nothing was run. "
                            f"Remove it to start over (rm -r {work}), or choose another --workdir "
                            f"(e.g. {work.parent / (work.name + '-2')})")
    if "training" in current and "training" not in saved:
        saved["training"] = current["training"]
        write_text_atomic(path, json.dumps(saved, indent=2, sort_keys=True) + "\n")
