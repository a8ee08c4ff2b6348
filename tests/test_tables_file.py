"""``nlmserve export-tables``: a model's scoring tables, its vocabulary and its facts as the one file
every decoder on a host maps (nlmserve.lm.tables_file, version 2; quantised by nlmserve.lm.quantize);
``nlmserve info`` of it; what is refused. The C++ reader (MapTablesFile) is tested against
proto/contract/scoring_tables*.nlt by nlmserve_contract_test and against these files in
test_cpp_client.py; ``query --tables`` in test_query_tables.py."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from contract import CONTRACT
from support import dev_sentences

ROUNDING = 1e-4  # float32's own rounding between two evaluations of a score (nats)


def _tables(model: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nlmserve", "export-tables", "--model", str(model), "--out", str(out),
                           *flags], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], Path]:
    """The tables file of a model in a quantisation, written once in this process (as
    export-tables writes it)."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import FlatTables, write_tables_file

    folder = tmp_path_factory.mktemp("exported")
    done: dict[tuple[Path, str], Path] = {}

    def export(model: Path, quantization: str) -> Path:
        if (model, quantization) not in done:
            lm = LanguageModel.load(model, device="cpu")
            out = folder / f"{model.stem}.{quantization}.nlt"
            write_tables_file(out, FlatTables.of(lm.scoring_tables()), order=lm.order, words=lm.vocab.words,
                              lowercase=lm.lowercase, model_hash=lm.model_hash, quantization=quantization)
            done[model, quantization] = out
        return done[model, quantization]

    return export


def _dev_rows(lm: Any, count: int = 60) -> np.ndarray:
    from nlmserve.wire.ngrams import sentence_rows

    rows, _, _, _ = sentence_rows([s.split() for s in dev_sentences(0, count)], lm.vocab.index, lm.order,
                                  lowercase=lm.lowercase)
    return rows


@pytest.mark.parametrize("fixture", ["tiny_model_path", "feature_model_path", "tree_model_path"])
def test_the_file_holds_the_tables_the_vocabulary_and_the_facts(fixture: str, request: pytest.FixtureRequest,
                                                                tmp_path: Path) -> None:
    """The array the server streams (the same FlatTables), the vocabulary by id and through
    the file's probing table, and what GetModelInfo answers (order, vocabulary size, hash,
    lowercase, the special ids); nothing else is left behind."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import FlatTables, read_tables_file

    model: Path = request.getfixturevalue(fixture)
    out = tmp_path / "model.nlt"
    done = _tables(model, out)
    assert done.returncode == 0, done.stderr
    lm = LanguageModel.load(model, device="cpu")
    want = FlatTables.of(lm.scoring_tables())
    assert done.stdout.strip() == (f"{out}: {out.stat().st_size:,} bytes, {want.output} output, order {lm.order}, "
                                   f"{len(lm.vocab):,} words, width {want.dim}, none (scores within 0 nats of "
                                   f"float32's), model {lm.model_hash}")
    t = read_tables_file(out, verify=True)
    h = t.header
    assert (h.version, h.order, h.vocab_size, h.model_hash, h.lowercase, h.quantization, h.error_bound) == \
        (2, lm.order, len(lm.vocab), lm.model_hash, lm.lowercase, "none", 0.0)
    assert (h.unk_id, h.bos_id, h.eos_id) == (lm.vocab.id("<unk>"), lm.vocab.id("<s>"), lm.vocab.id("</s>"))
    got = t.flat()
    assert (got.dim, got.activation, got.feature_order, got.ngram_class_table, got.ngram_word_table, got.output,
            got.tree_nodes, got.tree_codes, got.tree_steps) == \
        (want.dim, want.activation, want.feature_order, want.ngram_class_table, want.ngram_word_table, want.output,
         want.tree_nodes, want.tree_codes, want.tree_steps)
    np.testing.assert_array_equal(got.data, want.data)
    assert t.words == lm.vocab.words and t.index == dict(lm.vocab.index)
    assert all(t.lookup(w) == i for i, w in enumerate(lm.vocab.words))
    assert t.lookup("qqq-not-a-word") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.nlt"]  # the temporary file was renamed


def test_the_contract_file_is_the_text_fixtures_tables() -> None:
    """proto/contract/scoring_tables.nlt (which the C++ test maps) read by the Python owner:
    the shape and the floats of scoring_tables.txt, byte for byte at the documented offsets."""
    from nlmserve.lm.tables_file import HEADER_BYTES, MAGIC, read_tables_file, word_key

    t = read_tables_file(CONTRACT / "scoring_tables.nlt", verify=True)
    words = [w for line in (CONTRACT / "scoring_tables.txt").read_text(encoding="utf-8").splitlines()
             if not line.startswith("#") for w in line.split()]
    n = int(words[words.index("floats") + 1])
    floats = np.array([float(x) for x in words[words.index("floats") + 2:][:n]], dtype=np.float32)
    h = t.header
    assert (h.order, h.vocab_size, h.dim, h.activation, h.feature_order, h.ngram_class_table,
            h.ngram_word_table, h.lowercase) == (3, 8, 3, "tanh", 3, 7, 16, True)
    np.testing.assert_array_equal(t.flat().data, floats)
    raw = (CONTRACT / "scoring_tables.nlt").read_bytes()
    assert raw[:8] == MAGIC and struct.unpack_from("<IIII", raw, 8) == (2, 3, 8, 3)
    assert raw[80:85] == b"class" and raw[96:100] == b"tanh" and raw[112:127] == b"scoring_fixture"
    position, size = struct.unpack_from("<QQ", raw, 256)
    assert position == HEADER_BYTES and size == 2 * 8 * 3 * 4  # (order-1)·V·D floats, page-aligned
    assert np.frombuffer(raw, dtype="<f4", count=size // 4, offset=position).tolist() == floats[:size // 4].tolist()
    assert raw[176:240].decode() == hashlib.sha256(raw[HEADER_BYTES:]).hexdigest()
    check = struct.unpack_from("<Q", raw, 248)[0]
    assert check == word_key(raw[:248] + bytes(8) + raw[256:HEADER_BYTES])
    assert [t.lookup(w) for w in ("the", "The", "ΟΔΟΣ", "İstanbul", "istanbul")] == [3, 3, 6, 7, None]


@pytest.mark.parametrize("fixture", ["feature_model_path", "tree_model_path", "tiny_model_path"])
@pytest.mark.parametrize("quantization", ["fp16", "int8"])
def test_a_quantised_file_scores_within_the_bound_it_records(fixture: str, quantization: str,
                                                             request: pytest.FixtureRequest,
                                                             exported: Callable[[Path, str], Path]) -> None:
    """fp16 halves the position and output rows and int8 quarters them (plus a scale per row);
    every dev n-gram's score from them lies within the file's bound of the float32 file's
    (and of the model's own), the bound is not zero, and the rest of the file is the same."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import read_tables_file
    from nlmserve.lm.tables_scorer import TablesScorer

    model: Path = request.getfixturevalue(fixture)
    f32, q = read_tables_file(exported(model, "none")), read_tables_file(exported(model, quantization), verify=True)
    bound = q.header.error_bound
    assert q.header.quantization == quantization and 0 < bound < 1e3
    row_bytes = {"fp16": 2, "int8": 1}[quantization]
    assert q.position.nbytes * 4 == f32.position.nbytes * row_bytes and q.output.dtype.itemsize == row_bytes
    assert (q.position_scale is not None) == (quantization == "int8")
    np.testing.assert_array_equal(q.rest, f32.rest)
    assert q.words == f32.words
    lm = LanguageModel.load(model, device="cpu")
    rows = _dev_rows(lm)
    exact = TablesScorer(f32).score_rows(rows).astype(np.float64)
    np.testing.assert_allclose(exact, lm.score_ngrams(rows, normalized=lm.config.output == "tree"), atol=1e-5)
    moved = np.abs(TablesScorer(q).score_rows(rows) - exact)
    assert moved.max() <= bound + ROUNDING, (moved.max(), bound)
    assert moved.max() > 0  # the rows are quantised


@pytest.mark.parametrize("activation", ["none", "tanh", "relu"])
@pytest.mark.parametrize("quantization", ["fp16", "int8"])
def test_the_bound_holds_for_every_row_of_random_tables(activation: str, quantization: str, tmp_path: Path) -> None:
    """The bound derived in nlmserve.lm.quantize, checked: tables of random values of several
    sizes (a few rows large), every canonical row of a 20-word, order-3 model, in each
    activation: no score moves by more than the bound the file records."""
    from nlmserve.lm.tables_file import FlatTables, read_tables_file, write_tables_file
    from nlmserve.lm.tables_scorer import TablesScorer

    rng = np.random.default_rng(62)
    V, D, order = 20, 24, 3
    position = rng.normal(0, 0.3, (order - 1, V, D)) * rng.uniform(0.1, 3.0, (order - 1, V, 1))
    output = rng.normal(0, 0.3, (V, D)) * rng.uniform(0.1, 3.0, (V, 1))
    data = np.concatenate([position.reshape(-1), output.reshape(-1), rng.normal(-3, 1, V)]).astype(np.float32)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(V - 3)]
    flat = FlatTables(data, D, activation)
    for kind in ("none", quantization):
        write_tables_file(tmp_path / f"{kind}.nlt", flat, order=order, words=words, lowercase=False,
                          model_hash="random", quantization=kind)
    grid = np.stack(np.meshgrid(*[np.arange(V + 1)] * (order - 1), np.arange(V), indexing="ij"), -1).reshape(-1, order)
    grid = grid[(grid[:, -1] != 1) & (grid[:, -1] != V)]
    exact = TablesScorer.open(tmp_path / "none.nlt").score_rows(grid)
    q = read_tables_file(tmp_path / f"{quantization}.nlt")
    moved = np.abs(TablesScorer(q).score_rows(grid).astype(np.float64) - exact)
    assert 0 < moved.max() <= q.header.error_bound + ROUNDING, (moved.max(), q.header.error_bound)


def test_the_bound_is_reached_when_every_error_is_aligned(tmp_path: Path) -> None:
    """The bound is the worst case, and no looser: width 1, no activation, every position
    value 100.05 and every output value 50.02, which fp16 rounds up (to 100.0625, 50.03125),
    so that both terms add with their full size: (r~ - r).O and r~.(O~ - O). A row of two
    known context words moves by the bound; a row with the no-word and one word by half of it."""
    from nlmserve.lm.tables_file import FlatTables, read_tables_file, write_tables_file
    from nlmserve.lm.tables_scorer import TablesScorer

    x, y = 100.05, 50.02
    assert np.float16(x) > np.float32(x) and np.float16(y) > np.float32(y)
    V, order = 5, 3
    data = np.concatenate([np.full((order - 1) * V, x), np.full(V, y), np.zeros(V)]).astype(np.float32)
    words = ["<unk>", "<s>", "</s>", "a", "b"]
    for kind in ("none", "fp16"):
        write_tables_file(tmp_path / f"{kind}.nlt", FlatTables(data, 1, "none"), order=order, words=words,
                          lowercase=False, model_hash="aligned", quantization=kind)
    bound = read_tables_file(tmp_path / "fp16.nlt").header.error_bound
    xq, yq = float(np.float16(x)), float(np.float16(y))
    x32, y32 = float(np.float32(x)), float(np.float32(y))
    assert bound == pytest.approx(2 * (xq - x32) * y32 + 2 * xq * (yq - y32), rel=1e-12)
    rows = np.array([[3, 4, 0], [V, 4, 2]])
    moved = TablesScorer.open(tmp_path / "fp16.nlt").score_rows(rows).astype(np.float64) \
        - TablesScorer.open(tmp_path / "none.nlt").score_rows(rows)
    assert moved[0] == pytest.approx(bound, rel=1e-3)  # float32 rounding of scores near 10^4 apart
    assert moved[1] == pytest.approx(bound / 2, rel=1e-3)


def test_fp16_refuses_a_value_it_cannot_hold(tmp_path: Path) -> None:
    from nlmserve.common.errors import UnsupportedModelError
    from nlmserve.lm.tables_file import FlatTables, write_tables_file

    data = np.zeros(2 * 4 * 2 + 4 * 2 + 4, dtype=np.float32)
    data[3] = 70000.0
    with pytest.raises(UnsupportedModelError, match="beyond fp16's 65504: use --quantize int8 or none"):
        write_tables_file(tmp_path / "big.nlt", FlatTables(data, 2, "none"), order=3, words=["<unk>", "<s>", "</s>", "a"],
                          lowercase=False, model_hash="big", quantization="fp16")
    assert not list(tmp_path.iterdir())


def test_the_quantize_choices_are_the_quantisations() -> None:
    from nlmserve.lm.cli import QUANTIZE_CHOICES
    from nlmserve.lm.quantize import QUANTIZATIONS

    assert QUANTIZE_CHOICES == QUANTIZATIONS


def test_a_large_vocabulary_is_found_through_the_table(tmp_path: Path) -> None:
    """100,000 words (ASCII, accented, one of 300 bytes, words that differ in one byte) through
    the probing table the file lays out: each found with its id, others not; the table's
    buckets are the least power of two of at least 1.5 per word."""
    from nlmserve.lm.tables_file import FlatTables, read_tables_file, write_tables_file

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(60_000)] + [f"été{i}" for i in range(39_996)] + ["x" * 300]
    V, D = len(words), 1
    flat = FlatTables(np.zeros((2 * V + V) * D + V, dtype=np.float32), D, "none")
    write_tables_file(tmp_path / "big.nlt", flat, order=3, words=words, lowercase=False, model_hash="big")
    t = read_tables_file(tmp_path / "big.nlt", verify=True)
    assert t.header.vocab_buckets == 1 << 18 and t.words == words
    for i in list(range(0, V, 997)) + [V - 1]:
        assert t.lookup(words[i]) == i
    assert [t.lookup(w) for w in ("w60000", "été39996", "x" * 299, "W1", "")] == [None] * 5


# ---------------------------------------------------------------------- what is refused
def _v1(raw: bytes) -> bytes:
    """A version-1 file's bytes: the magic, version 1, its fields, the array after a page."""
    return b"NLMTABLE" + struct.pack("<IIII", 1, 3, 8, 3) + raw[24:]


def _apart(raw: bytes) -> bytes:
    """A header whose check passes but whose position rows lie off their alignment."""
    from nlmserve.lm.tables_file import word_key

    head = bytearray(raw[:4096])
    struct.pack_into("<Q", head, 256, 4097)
    struct.pack_into("<Q", head, 248, 0)
    struct.pack_into("<Q", head, 248, word_key(bytes(head)))
    return bytes(head) + raw[4096:]


def _flip(raw: bytes, at: int) -> bytes:
    damaged = bytearray(raw)
    damaged[at] ^= 0x01
    return bytes(damaged)


REFUSED = {
    "version 1": (_v1, "a tables file of version 1, which holds no vocabulary and is read no more: write it again "
                       "with `nlmserve export-tables --model MODEL --out {path}`"),
    "damaged header": (lambda raw: _flip(raw, 20), "its header is damaged (its check does not match): write it again "
                                                   "with `nlmserve export-tables --model MODEL --out {path}`"),
    "header apart": (_apart, "its header does not hold together (the position section's offset 4097): write it again"),
    "cut short": (lambda raw: raw[:-4], "cut short ("),
    "a page alone": (lambda raw: raw[:4096], "cut short (4096 bytes; its header says "),
    "newer version": (lambda raw: raw[:8] + struct.pack("<I", 3) + raw[12:], "tables file version 3; this nlmserve "
                                                                            "reads version 2"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_file_that_is_not_a_version_2_tables_file_is_refused_in_one_line(kind: str, tmp_path: Path) -> None:
    """The Python reader, ``info`` (with and without --verify) and ``query --tables`` refuse it
    with one line that names the file and says why (and, where writing it again helps, how);
    the C++ reader says the same (nlmserve_contract_test)."""
    from nlmserve.common.errors import ModelFileError
    from nlmserve.lm.tables_file import read_tables_file

    make, says = REFUSED[kind]
    path = tmp_path / "bad.nlt"
    path.write_bytes(make((CONTRACT / "scoring_tables.nlt").read_bytes()))
    message = says.format(path=path)
    with pytest.raises(ModelFileError) as caught:
        read_tables_file(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)
    for argv in (["info", str(path)], ["info", str(path), "--verify", "--json"], ["query", "--tables", str(path)]):
        done = subprocess.run([sys.executable, "-m", "nlmserve", *argv], input="a b\n", capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and done.stdout == "", (argv, done)
        assert len(done.stderr.splitlines()) == 1 and message in done.stderr, (argv, done.stderr)


def test_what_is_not_a_tables_file_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    from nlmserve.common.errors import ModelFileError
    from nlmserve.lm.tables_file import read_tables_file

    with pytest.raises(ModelFileError, match="not an nlmserve export-tables file"):
        read_tables_file(tiny_model_path)
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
    """``nlmserve info FILE.nlt`` reads the header; ``--verify`` checks every byte after it
    against the sha256 the header records, and a flipped byte in the tables or in the
    vocabulary is found and named."""
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.tables_file import HEADER_BYTES

    out = tmp_path / "model.nlt"
    done = _tables(tiny_model_path, out, "--quantize", "int8")
    assert done.returncode == 0, done.stderr
    raw = out.read_bytes()
    info = subprocess.run([sys.executable, "-m", "nlmserve", "info", str(out), "--json", "--verify"],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    got = json.loads(info.stdout)
    lm = LanguageModel.load(tiny_model_path, device="cpu")
    assert got["kind"] == "tables file" and got["verified"] is True and got["version"] == 2
    assert (got["order"], got["vocab_size"], got["model_hash"], got["lowercase"]) == \
        (lm.order, len(lm.vocab), lm.model_hash, lm.lowercase)
    assert got["quantization"] == "int8" and got["error_bound"] > 0 and got["ids"] == "<unk> 0, <s> 1, </s> 2"
    assert f"int8 (scores within {got['error_bound']:.3g} nats of float32's)" in done.stdout
    assert got["sha256"] == hashlib.sha256(raw[HEADER_BYTES:]).hexdigest() and got["file_bytes"] == len(raw)
    for at in (HEADER_BYTES + 1000, len(raw) - 20):  # a table's byte, the vocabulary table's
        out.write_bytes(_flip(raw, at))
        plain = subprocess.run([sys.executable, "-m", "nlmserve", "info", str(out)], capture_output=True, text=True,
                               timeout=120)
        assert plain.returncode == 0 and "kind\ttables file" in plain.stdout  # the header alone is intact
        checked = subprocess.run([sys.executable, "-m", "nlmserve", "info", str(out), "--verify"],
                                 capture_output=True, text=True, timeout=120)
        assert checked.returncode == 1 and "do not match the checksum" in checked.stderr, checked.stderr
        assert len(checked.stderr.splitlines()) == 1
