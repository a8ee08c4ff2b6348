"""``nlmserve eval``: perplexities as KenLM's query computes them, bands, JSON output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nlmserve.cli import main
from nlmserve.lm.evaluate import evaluate
from nlmserve.lm.scoring import LanguageModel


@pytest.fixture()
def small_text(tmp_path: Path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text("the european parliament\n\nqwertyuiop is an oov word .\nthe commission\n", encoding="utf-8")
    return p


def test_perplexities_match_a_hand_computation(tiny_lm: LanguageModel, small_text: Path) -> None:
    sents = [line.split() for line in small_text.read_text().splitlines() if line.strip()]
    scored = tiny_lm.score_sentences(sents, log10=True)
    lp = np.concatenate([s.token_log_probs for s in scored]).astype(np.float64)
    oov = np.concatenate([s.oov for s in scored])
    r = evaluate(tiny_lm, small_text)
    assert r.sentences == 3  # the empty line is skipped
    assert r.tokens == (3 + 1) + (6 + 1) + (2 + 1) == len(lp)
    assert r.oov == int(oov.sum()) >= 1
    assert r.perplexity == pytest.approx(10 ** (-lp.sum() / len(lp)), rel=1e-9)
    assert r.perplexity_excl_oov == pytest.approx(10 ** (-lp[~oov].sum() / (~oov).sum()), rel=1e-9)
    assert r.log10_prob == pytest.approx(lp.sum(), rel=1e-9)
    assert r.entropy_bits == pytest.approx(-lp.mean() / math.log10(2), rel=1e-9)


def test_bands_cover_every_token(tiny_lm: LanguageModel, dev_small_path: Path) -> None:
    r = evaluate(tiny_lm, dev_small_path)
    assert sum(b.tokens for b in r.bands) == r.tokens
    assert sum(b.share for b in r.bands) == pytest.approx(1.0)
    by = {b.label: b for b in r.bands}
    assert by["OOV"].tokens == r.oov
    # frequent words are easier to predict than rare ones
    assert by[">1000"].entropy_bits < by["11-100"].entropy_bits < by["2-10"].entropy_bits
    weighted = sum(b.tokens * b.entropy_bits for b in r.bands if b.tokens) / r.tokens
    assert weighted == pytest.approx(r.entropy_bits, rel=1e-9)


def test_cli_json_and_text(tiny_model_path: Path, small_text: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--model", str(tiny_model_path), "--text", str(small_text), "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"perplexity", "perplexity_excl_oov", "tokens", "oov", "bands", "model_hash"} <= set(out)
    assert out["tokens"] == 14
    assert main(["eval", "--model", str(tiny_model_path), "--text", str(small_text), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "Perplexity including OOVs:" in text and "Perplexity excluding OOVs:" in text
    assert f"{out['perplexity']:.4f}" in text


def test_cli_errors(tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--model", str(tmp_path / "none.nlm"), "--text", str(tmp_path / "t")]) == 1
    assert "none.nlm" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\n")
    assert main(["eval", "--model", str(tiny_model_path), "--text", str(bad), "--device", "cpu"]) == 1
    assert f"{bad}:2" in capsys.readouterr().err


def test_lowercase_flag(tiny_lm: LanguageModel, tmp_path: Path) -> None:
    upper = tmp_path / "upper.txt"
    upper.write_text("The European Parliament\n", encoding="utf-8")
    lower = tmp_path / "lower.txt"
    lower.write_text("the european parliament\n", encoding="utf-8")
    assert evaluate(tiny_lm, upper, lowercase=True).perplexity == pytest.approx(evaluate(tiny_lm, lower).perplexity)
    assert evaluate(tiny_lm, upper).oov == 3


def test_self_normalisation_is_reported_for_nce(tiny_lm: LanguageModel, dev_small_path: Path) -> None:
    r = evaluate(tiny_lm, dev_small_path)
    assert r.log_z_mean is not None and r.log_z_std is not None
    sents = [line.split() for line in dev_small_path.read_text().splitlines() if line.strip()]
    ids, _, _, _ = tiny_lm.sentence_ngrams(sents)
    d = tiny_lm.score_ngrams(ids, normalized=False).astype(np.float64) - tiny_lm.score_ngrams(ids)
    assert r.log_z_mean == pytest.approx(d.mean(), abs=1e-6)
    assert r.log_z_std == pytest.approx(d.std(), abs=1e-6)
    assert abs(r.log_z_mean) < 1.0  # NCE keeps it near 0 even after 300 steps
