"""Interpolation with Kneser-Ney: a tiny ARPA file whose probabilities are worked out by
hand (back-off included), the mix, the tuned weight, and ``nlmserve eval --kenlm``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nlmserve.common.errors import InputError
from nlmserve.lm.interpolate import interpolate, load_kn, mix_log10, score_text, tune_weight

from support import TINY_ARPA as ARPA
from support import TINY_ARPA_GOLDEN as GOLDEN
from support import TINY_ARPA_GOLDEN_OOV as GOLDEN_OOV
from support import TINY_ARPA_TEXT as TEXT


@pytest.fixture
def arpa(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.arpa"
    p.write_text(ARPA)
    return p


@pytest.fixture
def text(tmp_path: Path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def test_kenlm_reads_the_tiny_arpa_as_computed_by_hand(arpa: Path, text: Path, tiny_lm: Any) -> None:
    scores = score_text(tiny_lm, load_kn(arpa), text)
    np.testing.assert_allclose(scores.kn, GOLDEN, atol=1e-5)
    assert scores.oov_kn.tolist() == GOLDEN_OOV
    want = np.concatenate([s.token_log_probs for s in tiny_lm.score_sentences(
        [line.split() for line in TEXT.splitlines()], log10=True)])
    np.testing.assert_allclose(scores.nlm, want, atol=1e-6)
    assert scores.oov_nlm.tolist() == [tiny_lm.vocab.encode([w])[0] == 0 and w != "<unk>"
                                       for w in "the of the </s> of zebra </s>".split()]


def test_mix_by_hand() -> None:
    nlm = np.array([-1.0, -2.0])
    kn = np.array([-2.0, -1.0])
    got = mix_log10(nlm, kn, 0.3)
    want = [math.log10(0.3 * 0.1 + 0.7 * 0.01), math.log10(0.3 * 0.01 + 0.7 * 0.1)]
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_array_equal(mix_log10(nlm, kn, 0.0), kn)
    np.testing.assert_array_equal(mix_log10(nlm, kn, 1.0), nlm)


def test_interpolated_perplexity_and_tuned_weight(arpa: Path, text: Path, tiny_lm: Any) -> None:
    nlm = np.concatenate([s.token_log_probs for s in tiny_lm.score_sentences(
        [line.split() for line in TEXT.splitlines()], log10=True)]).astype(np.float64)
    mix = [math.log10(0.4 * 10 ** a + 0.6 * 10 ** b) for a, b in zip(nlm, GOLDEN)]
    r = interpolate(tiny_lm, arpa, text, weight=0.4)
    assert r.perplexity == pytest.approx(10 ** (-sum(mix) / 7), rel=1e-6)
    assert r.kn_perplexity == pytest.approx(10 ** (-sum(GOLDEN) / 7), rel=1e-6)
    keep = [i for i in range(7) if not GOLDEN_OOV[i]]  # "zebra" is OOV to KN (and to the tiny model)
    assert r.tokens == 7 and r.oov == 1
    assert r.perplexity_excl_oov == pytest.approx(10 ** (-sum(mix[i] for i in keep) / 6), rel=1e-6)
    tuned = interpolate(tiny_lm, arpa, text, tune_text=text)
    assert tuned.tuned and 0.0 <= tuned.weight <= 1.0
    grid = [interpolate(tiny_lm, arpa, text, weight=w).perplexity for w in np.linspace(0, 1, 21)]
    assert tuned.perplexity <= min(grid) + 1e-9
    s = score_text(tiny_lm, load_kn(arpa), text)
    assert tune_weight(s) == pytest.approx(tuned.weight, abs=1e-9)


def test_bad_kn_file_is_an_input_error(tmp_path: Path, text: Path, tiny_lm: Any) -> None:
    bad = tmp_path / "bad.arpa"
    bad.write_text("not an arpa file\n")
    with pytest.raises(InputError, match="bad.arpa"):
        interpolate(tiny_lm, bad, text, weight=0.5)
    with pytest.raises(InputError, match="no such"):
        load_kn(tmp_path / "missing.arpa")


def test_eval_cli_with_kn(arpa: Path, text: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.cli import main

    assert main(["eval", "--model", str(tiny_model_path), "--text", str(text), "--kenlm", str(arpa),
                 "--mix-weight", "0.4", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["interpolation"]["weight"] == 0.4 and out["interpolation"]["tokens"] == 7
    assert main(["eval", "--model", str(tiny_model_path), "--text", str(text), "--kenlm", str(arpa),
                 "--device", "cpu"]) == 2
    assert "--kenlm needs --mix-weight or --tune-mix-weight" in capsys.readouterr().err
    # The old spellings still work, each with one line on stderr.
    assert main(["eval", "--model", str(tiny_model_path), "--text", str(text), "--kn", str(arpa),
                 "--kn-weight", "0.4", "--json", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == out
    assert captured.err.splitlines() == ["nlmserve eval: warning: --kn is deprecated; use --kenlm",
                                         "nlmserve eval: warning: --kn-weight is deprecated; use --mix-weight"]
