"""Model files: round trip, and every kind of damage gives a ModelFileError."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from nlmserve.common.errors import ModelFileError
from nlmserve.lm import model_file
from nlmserve.lm.model_file import FORMAT_VERSION, MAGIC, read_model_descriptor, read_model_file, save_model
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.vocab import BOS_ID


def _rows(lm: LanguageModel) -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = rng.integers(0, len(lm.vocab), size=(300, 5))
    rows[:, -1] = np.where(rows[:, -1] == BOS_ID, 3, rows[:, -1])
    return rows


def test_round_trip_gives_identical_scores(tiny_lm: LanguageModel, tmp_path: Path) -> None:
    mf = tiny_lm.model_file
    out = tmp_path / "copy.nlm"
    digest = save_model(out, tiny_lm.net, mf.vocab, mf.classes, objective=mf.objective,
                        lowercase=mf.lowercase, training=mf.training, unigram_counts=tiny_lm.unigram_counts)
    assert digest == tiny_lm.model_hash  # same content, same hash
    again = LanguageModel.load(out, device="cpu")
    rows = _rows(tiny_lm)
    assert np.array_equal(again.score_ngrams(rows), tiny_lm.score_ngrams(rows))
    assert again.vocab == tiny_lm.vocab and again.classes == tiny_lm.classes
    assert again.config == tiny_lm.config and again.training == tiny_lm.training
    assert np.array_equal(again.unigram_counts, tiny_lm.unigram_counts)


def test_header_is_self_describing(tiny_model_path: Path) -> None:
    blob = tiny_model_path.read_bytes()
    magic, version, hlen = struct.unpack_from("<8sIQ", blob)
    assert magic == MAGIC and version == 3  # every file is written as version 3 (provenance outside the hash)
    header = json.loads(blob[20 : 20 + hlen])
    assert header["config"]["order"] == 5 and header["objective"] == "nce"
    assert header["vocabulary"][:3] == ["<unk>", "<s>", "</s>"]
    assert header["classes"]["method"] == "frequency"
    assert header["training"]["steps"] > 0
    assert set(header["tensors"]) >= {"embed.weight", "ctx_weight", "word_embed", "class_embed", "unigram_counts"}
    assert len(header["sha256"]) == 64
    assert b"\x80\x04" not in blob[:4]  # not a pickle


def _expect_error(path: Path, match: str) -> None:
    with pytest.raises(ModelFileError, match=match) as exc:
        LanguageModel.load(path, device="cpu")
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("keep", [5, 19, 400, -1])
def test_truncated_file(tiny_model_path: Path, tmp_path: Path, keep: int) -> None:
    blob = tiny_model_path.read_bytes()
    bad = tmp_path / "truncated.nlm"
    bad.write_bytes(blob[:keep] if keep > 0 else blob[: len(blob) - 100])
    _expect_error(bad, "truncated")


def test_foreign_file(tmp_path: Path) -> None:
    bad = tmp_path / "foreign.nlm"
    bad.write_bytes(b"\x80\x04\x95" + b"pickled stuff, not a model" * 4)
    _expect_error(bad, "not an nlmserve model file")
    empty = tmp_path / "empty.nlm"
    empty.write_bytes(b"")
    _expect_error(empty, "not an nlmserve model file")


def test_newer_format_version(tiny_model_path: Path, tmp_path: Path) -> None:
    blob = bytearray(tiny_model_path.read_bytes())
    struct.pack_into("<I", blob, 8, FORMAT_VERSION + 1)
    bad = tmp_path / "newer.nlm"
    bad.write_bytes(bytes(blob))
    _expect_error(bad, f"format version {FORMAT_VERSION + 1} is newer")


def test_tampered_weights_and_header(tiny_model_path: Path, tmp_path: Path) -> None:
    blob = bytearray(tiny_model_path.read_bytes())
    blob[-3000] ^= 0x01  # one bit of one weight
    bad = tmp_path / "tampered.nlm"
    bad.write_bytes(bytes(blob))
    _expect_error(bad, "content hash mismatch")
    text = tiny_model_path.read_bytes()
    swapped = text.replace(b'"objective":"nce"', b'"objective":"mle"', 1)
    assert swapped != text
    bad.write_bytes(swapped)
    _expect_error(bad, "content hash mismatch")


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope.nlm", "cannot read")


def test_read_model_file_exposes_metadata(tiny_model_path: Path, tmp_path: Path) -> None:
    mf = read_model_file(tiny_model_path)
    assert mf.training["stopped"] == "max steps"
    assert mf.tensors["unigram_counts"].dtype == np.int64
    copy = tmp_path / "same.nlm"
    shutil.copy(tiny_model_path, copy)
    assert read_model_file(copy).sha256 == mf.sha256


def test_a_foreign_file_is_refused_without_its_bytes(tmp_path: Path) -> None:
    """The refusal names the file and says why, never what the file holds (it may be any
    file the reader can open: a key, /proc/self/environ)."""
    bad = tmp_path / "secret.nlm"
    bad.write_bytes(b"SHELL=/bin/bash\nTOKEN=abc123\n")
    with pytest.raises(ModelFileError) as exc:
        read_model_file(bad)
    assert str(exc.value) == f"{bad}: not an nlmserve model file (bad magic bytes)"


def test_a_read_stops_at_max_bytes_and_at_the_declared_data(tiny_model_path: Path, tmp_path: Path) -> None:
    """A file larger than ``max_bytes`` is refused before it is read; a file longer than its
    header says is refused with ``exact_size`` and otherwise read up to its declared data
    only; read in chunks (here of 4 KiB), the data gives the same digest."""
    size = tiny_model_path.stat().st_size
    with pytest.raises(ModelFileError, match=f"has {size} bytes, more than the {size - 1} allowed"):
        read_model_file(tiny_model_path, max_bytes=size - 1)
    longer = tmp_path / "longer.nlm"
    longer.write_bytes(tiny_model_path.read_bytes() + b"\xff" * 100_000)
    fd = os.open(longer, os.O_RDONLY)
    try:
        with pytest.raises(ModelFileError, match="its header says"):
            read_model_descriptor(fd, str(longer), exact_size=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_file, "READ_CHUNK_BYTES", 4096)
            assert read_model_descriptor(fd, str(longer)).sha256 == read_model_file(tiny_model_path).sha256
    finally:
        os.close(fd)


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match="not a regular file"):
        read_model_file(fifo)
