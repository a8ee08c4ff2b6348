"""Model files: round trip, and every kind of damage gives a ModelFileError."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from nlmserve.common.errors import ModelFileError
from nlmserve.lm.model_file import FORMAT_VERSION, MAGIC, read_model_file, save_model
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
    assert magic == MAGIC and version == 1  # class models are still written as version 1
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
