"""The wire contract's n-gram rules (``nlmserve.wire.ngrams``): every case of
proto/contract/canonical_ngrams.tsv, sentence windows, word packing, and the rule module's
imports (numpy only, so that the client and the Moses tooling can use it without torch)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nlmserve.common.errors import InvalidRequestError
from nlmserve.wire.ngrams import BOS_ID, EOS_ID, UNK_ID, canonical_rows, check_sentences, pack_ngrams, sentence_windows

from contract import CONTRACT

GOLDEN = CONTRACT / "canonical_ngrams.tsv"


def golden_cases() -> list[tuple[int, int, list[int], str]]:
    cases = []
    for line in GOLDEN.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        order, vocab_size, ngram, want = line.split("\t")
        ids = [] if ngram == "-" else [int(x) for x in ngram.split()]
        cases.append((int(order), int(vocab_size), ids, want))
    return cases


CASES = golden_cases()


def test_the_golden_file_has_cases_of_every_kind() -> None:
    wants = {want for _, _, _, want in CASES}
    assert len(CASES) >= 30
    assert {"error:empty", "error:too-long", "error:out-of-range", "error:bos-target"} <= wants


@pytest.mark.parametrize("order,vocab_size,ngram,want", CASES,
                         ids=[f"{o}-{v}-{' '.join(map(str, g)) or 'empty'}" for o, v, g, _ in CASES])
def test_golden_case(order: int, vocab_size: int, ngram: list[int], want: str) -> None:
    ids = np.array([ngram], dtype=np.int64).reshape(1, len(ngram))
    if want.startswith("error:"):
        with pytest.raises(InvalidRequestError) as exc:
            canonical_rows(ids, order, vocab_size)
        assert exc.value.kind == want.removeprefix("error:")
        assert exc.value.index == 0
    else:
        row = canonical_rows(ids, order, vocab_size)
        assert row.dtype == np.int64
        assert row.tolist() == [[int(x) for x in want.split()]]
        # canonical rows are a fixed point, and unsigned packed ids (the wire's) give the same
        assert canonical_rows(row, order, vocab_size).tolist() == row.tolist()
        assert canonical_rows(ids.astype(np.uint32), order, vocab_size).tolist() == row.tolist()


def test_the_first_bad_row_is_named() -> None:
    rows = np.array([[3, 4], [5, 6], [7, 1], [1, 1]])
    with pytest.raises(InvalidRequestError, match="item 2: <s> cannot be the predicted word") as exc:
        canonical_rows(rows, 3, 10)
    assert (exc.value.index, exc.value.kind) == (2, "bos-target")
    with pytest.raises(InvalidRequestError) as exc:  # out of range is checked before <s> targets
        canonical_rows(np.array([[3, 1], [3, 10]]), 3, 10)
    assert (exc.value.index, exc.value.kind) == (1, "out-of-range")


def test_shapes_and_types() -> None:
    assert canonical_rows(np.zeros((0, 9), dtype=np.int64), 3, 10).shape == (0, 3)
    with pytest.raises(InvalidRequestError, match="2-D"):
        canonical_rows(np.array([3, 4]), 3, 10)
    with pytest.raises(InvalidRequestError, match="integers"):
        canonical_rows(np.array([[1.5, 2.0]]), 3, 10)


def test_sentence_windows() -> None:
    rows, lengths, counts = sentence_windows([np.array([3, 4]), np.array([], dtype=np.int64), [5]], 3,
                                             bos=True, eos=True)
    assert rows.tolist() == [[1, 1, 3], [1, 3, 4], [3, 4, 2], [1, 1, 2], [1, 1, 5], [1, 5, 2]]
    assert lengths.tolist() == [2, 3, 3, 2, 2, 3]
    assert counts.tolist() == [3, 1, 2]
    rows, lengths, counts = sentence_windows([[3, 4, 5, 6]], 2, bos=False, eos=False)
    assert rows.tolist() == [[1, 3], [3, 4], [4, 5], [5, 6]] and lengths.tolist() == [1, 2, 2, 2]
    rows, lengths, counts = sentence_windows([[], []], 4, eos=False)
    assert rows.shape == (0, 4) and lengths.shape == (0,) and counts.tolist() == [0, 0]
    rows, _, _ = sentence_windows([[3, 4]], 1, eos=True)
    assert rows.tolist() == [[3], [4], [EOS_ID]]


def test_sentences_with_bad_ids_are_named() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        check_sentences([[3], [4, BOS_ID, 5]], 10)
    assert (exc.value.index, exc.value.kind) == (1, "bos-in-sentence")
    with pytest.raises(InvalidRequestError) as exc:
        check_sentences([[3], [], [10]], 10)
    assert (exc.value.index, exc.value.kind) == (2, "out-of-range")


def test_pack_ngrams() -> None:
    index = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID, "a": 3, "b": 4}
    ids, oov = pack_ngrams([["A", "b"], ["zz"], ["b", "zz", "a"]], index, 3, lowercase=True, dtype=np.uint32)
    assert ids.dtype == np.uint32
    assert ids.tolist() == [[1, 3, 4], [1, 1, 0], [4, 0, 3]] and oov.tolist() == [False, True, False]
    ids, oov = pack_ngrams([["A"]], index, 3, lowercase=False)
    assert ids.tolist() == [[1, 1, 0]] and oov.tolist() == [True]
    with pytest.raises(InvalidRequestError, match="item 1: empty n-gram") as exc:
        pack_ngrams([["a"], []], index, 3, lowercase=False)
    assert exc.value.kind == "empty"
    with pytest.raises(InvalidRequestError, match="item 0: n-gram of 4 words is longer than the model order 3"):
        pack_ngrams([["a"] * 4], index, 3, lowercase=False)


def test_rule_module_client_and_rescorer_do_not_import_torch() -> None:
    code = ("import sys; import nlmserve.wire.ngrams, nlmserve.lm.vocab, nlmserve.moses_plugin.rescore, "
            "nlmserve.moses_plugin.kenlm_source, nlmserve.client; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
