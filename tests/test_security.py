"""A model file that carries a malicious pickle must not execute anything when loaded, and
must get a clear ModelFileError. The payload creates a marker file if it is ever unpickled;
the test proves it works by unpickling it on purpose first."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nlmserve.common.errors import ModelFileError
from nlmserve.lm.model_file import FORMAT_VERSION, MAGIC
from nlmserve.lm.scoring import LanguageModel


class Payload:
    """Unpickling this runs ``os.system`` (it touches the marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def torch_checkpoint(path: Path, marker: Path) -> None:
    """A classic torch.save checkpoint whose pickle runs a command when loaded unsafely."""
    torch.save({"state_dict": {"w": torch.zeros(2)}, "evil": Payload(marker)}, path)


def nlmserve_lookalike(path: Path, marker: Path) -> None:
    """Our own magic and version, with a pickle where the JSON header should be."""
    blob = pickle.dumps(Payload(marker))
    path.write_bytes(struct.pack("<8sIQ", MAGIC, FORMAT_VERSION, len(blob)) + blob)


def pickle_in_tensor_bytes(path: Path, marker: Path, model: Path) -> None:
    """A real model file whose first tensor's bytes are replaced by a pickle (hash left stale)."""
    raw = bytearray(model.read_bytes())
    (header_len,) = struct.unpack_from("<Q", raw, 12)
    header = json.loads(raw[20 : 20 + header_len])
    data_start = (20 + header_len + 63) // 64 * 64
    first = min(header["tensors"].values(), key=lambda t: t["offset"])
    blob = pickle.dumps(Payload(marker))
    assert len(blob) <= first["nbytes"]
    raw[data_start + first["offset"] : data_start + first["offset"] + len(blob)] = blob
    path.write_bytes(bytes(raw))


def test_payload_is_live(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("kind", ["torch_checkpoint", "lookalike", "tensor_bytes"])
def test_malicious_pickle_is_never_executed(kind: str, tmp_path: Path, tiny_model_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / f"{kind}.nlm"
    if kind == "torch_checkpoint":
        torch_checkpoint(path, marker)
    elif kind == "lookalike":
        nlmserve_lookalike(path, marker)
    else:
        pickle_in_tensor_bytes(path, marker, tiny_model_path)
    with pytest.raises(ModelFileError) as excinfo:
        LanguageModel.load(path, device="cpu")
    assert str(path.name) in str(excinfo.value)
    assert not marker.exists()


def test_serve_refuses_a_malicious_file_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.nlm"
    torch_checkpoint(path, marker)
    proc = subprocess.run(
        [sys.executable, "-m", "nlmserve", "serve", "--model", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "evil.nlm" in proc.stderr
    assert not marker.exists()


def test_magic_then_a_pickle_is_corrupt_not_a_newer_version(tmp_path: Path) -> None:
    """Our magic bytes straight followed by a pickle: the version field then reads as a huge
    number, which must not be reported as a newer format to upgrade for."""
    marker = tmp_path / "pwned"
    path = tmp_path / "magic-pickle.nlm"
    path.write_bytes(MAGIC + pickle.dumps(Payload(marker)))
    with pytest.raises(ModelFileError) as excinfo:
        LanguageModel.load(path, device="cpu")
    message = str(excinfo.value)
    assert message.startswith(f"{path}: corrupt or not an nlmserve model file")
    assert "newer" not in message and "upgrade" not in message
    assert not marker.exists()
