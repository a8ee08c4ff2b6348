"""``nlmserve export-tables``: a model's scoring tables as the file every decoder on a host maps
(nlmserve.lm.tables_file; the C++ reader, MapTablesFile, is tested in test_cpp_client.py and
against proto/contract/scoring_tables.nlt)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contract import CONTRACT


def _tables(model: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nlmserve", "export-tables", "--model", str(model), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fixture", ["tiny_model_path", "feature_model_path", "tree_model_path"])
def test_the_file_holds_what_get_scoring_tables_streams(fixture: str, request: pytest.FixtureRequest,
                                                        tmp_path: Path) -> None:
    """The array the server streams (the same FlatTables), behind a page of header that says
    the model's order, vocabulary, hash and the tables' shape; nothing else is left behind."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import DATA_OFFSET, FlatTables, read_tables_file

    model: Path = request.getfixturevalue(fixture)
    out = tmp_path / "model.nlt"
    done = _tables(model, out)
    assert done.returncode == 0, done.stderr
    lm = LanguageModel.load(model, device="cpu")
    want = FlatTables.of(lm.scoring_tables())
    assert done.stdout.strip() == (f"{out}: {DATA_OFFSET + 4 * want.data.size:,} bytes, {want.output} output, "
                                   f"order {lm.order}, {len(lm.vocab):,} words, width {want.dim}, model {lm.model_hash}")
    head = read_tables_file(out)
    assert (head.order, head.vocab_size, head.model_hash) == (lm.order, len(lm.vocab), lm.model_hash)
    got = head.tables
    assert (got.dim, got.activation, got.feature_order, got.ngram_class_table, got.ngram_word_table, got.output,
            got.tree_nodes, got.tree_codes, got.tree_steps) == \
        (want.dim, want.activation, want.feature_order, want.ngram_class_table, want.ngram_word_table, want.output,
         want.tree_nodes, want.tree_codes, want.tree_steps)
    np.testing.assert_array_equal(np.asarray(got.data), want.data)
    assert out.stat().st_size == DATA_OFFSET + 4 * want.data.size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.nlt"]  # the temporary file was renamed


def test_the_contract_file_is_the_text_fixtures_tables() -> None:
    """proto/contract/scoring_tables.nlt (which the C++ test maps) read by the Python owner:
    the shape and the floats of scoring_tables.txt, byte for byte at the documented offsets."""
    from nlmserve.lm.tables_file import DATA_OFFSET, MAGIC, read_tables_file

    head = read_tables_file(CONTRACT / "scoring_tables.nlt")
    words = [w for line in (CONTRACT / "scoring_tables.txt").read_text(encoding="utf-8").splitlines()
             if not line.startswith("#") for w in line.split()]
    n = int(words[words.index("floats") + 1])
    floats = np.array([float(x) for x in words[words.index("floats") + 2:][:n]], dtype=np.float32)
    assert (head.order, head.vocab_size, head.tables.dim, head.tables.activation, head.tables.feature_order,
            head.tables.ngram_class_table, head.tables.ngram_word_table) == (3, 8, 3, "tanh", 3, 7, 16)
    np.testing.assert_array_equal(np.asarray(head.tables.data), floats)
    raw = (CONTRACT / "scoring_tables.nlt").read_bytes()
    assert raw[:8] == MAGIC and struct.unpack_from("<IIII", raw, 8) == (1, 3, 8, 3)
    assert struct.unpack_from("<Q", raw, 56) == (n,) and raw[64:68] == b"tanh"
    assert np.frombuffer(raw, dtype="<f4", offset=DATA_OFFSET).tolist() == floats.tolist()


def test_what_is_not_a_tables_file_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    from nlmserve.common.errors import ModelFileError
    from nlmserve.lm.tables_file import read_tables_file

    with pytest.raises(ModelFileError, match="not an nlmserve export-tables file"):
        read_tables_file(tiny_model_path)
    out = tmp_path / "model.nlt"
    assert _tables(tiny_model_path, out).returncode == 0
    cut = tmp_path / "cut.nlt"
    cut.write_bytes(out.read_bytes()[:-4])
    with pytest.raises(ModelFileError, match="cut short"):
        read_tables_file(cut)
    with pytest.raises(ModelFileError, match="missing.nlt"):
        read_tables_file(tmp_path / "missing.nlt")


def test_a_model_without_tables_is_refused_with_the_reason(train_small_path: Path, dev_small_path: Path,
                                                          tmp_path: Path) -> None:
    """An exact (MLE) class model has no self-normalised score to tabulate: the command says
    so and writes nothing."""
    from nlmserve.lm.train import TrainConfig, train

    model = tmp_path / "mle.nlm"
    train(TrainConfig(train=str(train_small_path), valid=str(dev_small_path), out=str(model), order=3, dim=8,
                      classes=8, objective="mle", min_count=2, max_steps=20, batch_size=64, valid_every=20,
                      threads=1, seed=1, progress=False, learning_curve=False, checkpoint_every=0))
    out = tmp_path / "mle.nlt"
    done = _tables(model, out)
    assert done.returncode != 0 and "not self-normalised" in done.stderr, done.stderr
    assert not out.exists() and not (tmp_path / "mle.nlt.tmp").exists()


def test_info_describes_a_tables_file_and_verify_finds_a_damaged_one(tiny_model_path: Path, tmp_path: Path) -> None:
    """``nlmserve info FILE.nlt`` reads the header; ``--verify`` checks the array against the
    sha256 the header records, and a flipped byte in the array is found and named."""
    import hashlib
    import json

    from nlmserve.lm.tables_file import DATA_OFFSET

    out = tmp_path / "model.nlt"
    assert _tables(tiny_model_path, out).returncode == 0
    raw = out.read_bytes()
    info = subprocess.run([sys.executable, "-m", "nlmserve", "info", str(out), "--json", "--verify"],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    got = json.loads(info.stdout)
    assert got["kind"] == "tables file" and got["verified"] is True and got["order"] == 5
    assert got["sha256"] == hashlib.sha256(raw[DATA_OFFSET:]).hexdigest() and got["file_bytes"] == len(raw)
    damaged = bytearray(raw)
    damaged[DATA_OFFSET + 1000] ^= 0x40
    out.write_bytes(bytes(damaged))
    plain = subprocess.run([sys.executable, "-m", "nlmserve", "info", str(out)], capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 0 and "kind\ttables file" in plain.stdout  # the header alone is intact
    checked = subprocess.run([sys.executable, "-m", "nlmserve", "info", str(out), "--verify"],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode != 0 and "do not match the checksum" in checked.stderr, checked.stderr

