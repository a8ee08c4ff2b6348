"""experiments/estimates.py: the rows it makes of every phrase start (by hand) and its measures
on the fixed-weight golden model (tests/test_golden_model.py), by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from support import TINY_ARPA, golden_model

from experiments import estimates


def test_phrase_rows_by_hand() -> None:
    # Sentence 5 6 7, order 3 (V = 9): phrases start at 6 and at 7; the first two words of
    # the first are predicted from 0 and 1 of the phrase's words, the one of the second from 0.
    rows = estimates.phrase_rows([np.array([5, 6, 7])], order=3, vocab_size=9)
    assert rows["context"].tolist() == [[1, 5, 6], [5, 6, 7], [5, 6, 7]]
    assert rows["<s>"].tolist() == [[1, 1, 6], [1, 6, 7], [1, 1, 7]]
    assert rows["no-word"].tolist() == [[9, 9, 6], [9, 6, 7], [9, 9, 7]]
    assert rows["known"].tolist() == [0, 1, 0]


def test_measures_on_the_golden_model_by_hand(tmp_path: Path) -> None:
    # "a b a": b after <s> a is 1/8 in context and 1/4 from nothing (r = 0); a after a b is
    # 24/91 in context, 2/13 from b alone (r = 2 q(b)), 1/4 from nothing. (q(<s>) = 0 in
    # this model, so both rules give the same.)
    text = tmp_path / "text.txt"
    text.write_text("a b a\n", encoding="utf-8")
    got = estimates.measure(str(golden_model(tmp_path / "golden.nlm")), text, 10, normalized=True)
    d = [math.log10(2), math.log10((2 / 13) / (24 / 91)), math.log10((1 / 4) / (24 / 91))]
    assert got["words"] == 3 and got["sentences"] == 1
    for rule in ("<s>", "no-word"):
        r = got["rules"][rule]
        assert r["bias"] == pytest.approx(sum(d) / 3, abs=1e-6)
        assert r["mae"] == pytest.approx(sum(abs(x) for x in d) / 3, abs=1e-6)
        assert [(p["k"], p["n"]) for p in r["per_k"]] == [(0, 2), (1, 1)]
        assert r["per_k"][0]["bias"] == pytest.approx((d[0] + d[2]) / 2, abs=1e-6)
        assert r["per_k"][1]["mae"] == pytest.approx(abs(d[1]), abs=1e-6)
    table = estimates.render({"text": str(text), "lines": 10, "normalized": True, "models": [got]})
    assert table.startswith("<!-- experiments/estimates.py: begin -->") and "| `no-word` | +0.01 | 0.19 | 0.16 | 0.23 | — | — |" in table



def test_kenlm_estimates_by_hand(tmp_path: Path) -> None:
    # "the of the" with tests/support.py's bigram TINY_ARPA: in context "of" is -0.39794
    # (the of) and "the" -0.1 - 0.69897 (back-off of "of", then the unigram); from the null
    # context -0.60206 and -0.69897: differences -0.20412 and +0.1.
    pytest.importorskip("kenlm")
    arpa = tmp_path / "lm.arpa"
    arpa.write_text(TINY_ARPA, encoding="utf-8")
    text = tmp_path / "text.txt"
    text.write_text("the of the\n", encoding="utf-8")
    got = estimates.measure_kenlm(str(arpa), text, 10, order=5)
    r = got["rules"]["KenLM lower orders"]
    assert got["order"] == 2 and got["words"] == 2
    assert r["bias"] == pytest.approx((-0.20412 + 0.1) / 2, abs=1e-5)
    assert r["mae"] == pytest.approx((0.20412 + 0.1) / 2, abs=1e-5)
    assert [p["k"] for p in r["per_k"]] == [0]
