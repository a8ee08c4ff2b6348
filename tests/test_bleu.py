"""BLEU from sacrebleu statistics equals sacrebleu's corpus BLEU; Moses layout; bootstrap; CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sacrebleu

from nlmserve.common.cli import main
from nlmserve.moses_plugin.bleu import (
    BleuConfig,
    SentenceStats,
    corpus_bleu,
    from_moses,
    full_signature,
    paired_bootstrap,
    read_references,
    to_moses,
)
from nlmserve.moses_plugin.nbest import read_lines

NEWS = Path(__file__).resolve().parent.parent / "data" / "nbest" / "newstest-fr-en"
EURO = Path(__file__).resolve().parent.parent / "data" / "nbest" / "europarl-100x100"
HYP = NEWS / "newstest2013.300.moses-1best"
REF = NEWS / "newstest2013.300.ref"


@pytest.mark.parametrize("tokenize", ["none", "13a"])
@pytest.mark.parametrize("lowercase", [False, True])
def test_summed_statistics_equal_sacrebleu_corpus_bleu(tokenize: str, lowercase: bool) -> None:
    hyps, refs = read_lines(HYP), read_references([str(REF)])
    config = BleuConfig(lowercase=lowercase, tokenize=tokenize)
    stats = SentenceStats(config, refs)
    rows = np.vstack([stats.stats(i, [h]) for i, h in enumerate(hyps)])
    ours = stats.score(rows.sum(axis=0)).score
    theirs = sacrebleu.corpus_bleu(hyps, refs, tokenize=tokenize, lowercase=lowercase).score
    assert ours == theirs
    assert corpus_bleu(hyps, refs, config)[0].score == theirs


def test_cased_references_lowercased() -> None:
    # europarl-100x100 references are cased, the hypotheses lowercased.
    refs = read_references([str(EURO / "reference.txt")])
    hyps = [h.lower() for h in refs[0][:100]]
    cased = corpus_bleu(hyps, [refs[0][:100]], BleuConfig())[0].score
    lower, signature = corpus_bleu(hyps, [refs[0][:100]], BleuConfig(lowercase=True))
    assert lower.score == pytest.approx(100.0) and cased < 90
    assert "case:lc" in signature and "tok:none" in signature


def test_multiple_references() -> None:
    hyps = read_lines(HYP)
    refs = [read_lines(REF), hyps]  # the output itself as a second reference
    config = BleuConfig()
    stats = SentenceStats(config, refs)
    rows = np.vstack([stats.stats(i, [h]) for i, h in enumerate(hyps)])
    assert stats.score(rows.sum(axis=0)).score == pytest.approx(100.0)
    assert stats.score(rows.sum(axis=0)).score == sacrebleu.corpus_bleu(hyps, refs, tokenize="none").score


def test_hand_statistics_and_moses_layout() -> None:
    stats = SentenceStats(BleuConfig(), [["a b c e"]]).stats(0, ["a b c d", ""])
    assert stats[0].tolist() == [4, 4, 3, 2, 1, 0, 4, 3, 2, 1]
    assert to_moses(stats)[0].tolist() == [3, 4, 2, 3, 1, 2, 0, 1, 4]
    assert stats[1].tolist() == [0, 4, 0, 0, 0, 0, 0, 0, 0, 0]
    assert (from_moses(to_moses(stats)) == stats).all()


def test_paired_bootstrap_detects_a_real_difference() -> None:
    hyps, refs = read_lines(HYP), read_references([str(REF)])
    worse = [" ".join(h.split()[: len(h.split()) // 2]) if i % 2 else h for i, h in enumerate(hyps)]
    result = paired_bootstrap(worse, hyps, refs, BleuConfig(), n_samples=200)
    assert result.system_bleu > result.baseline_bleu + 3
    assert result.p_value < 0.05
    assert "bs:200" in result.signature and "seed:12345" in result.signature
    # One sentence cut short: a difference of chance size, not significant.
    nearly = [h if i != 5 else "" for i, h in enumerate(hyps)]
    small = paired_bootstrap(nearly, hyps, refs, BleuConfig(), n_samples=200)
    assert 0 < small.system_bleu - small.baseline_bleu < 0.5
    assert small.p_value > 0.05
    same = paired_bootstrap(hyps, hyps, refs, BleuConfig(), n_samples=200)
    assert same.p_value == 1.0 and same.system_bleu == same.baseline_bleu


def test_full_signature_names_weights_and_model() -> None:
    sig = full_signature("nrefs:1|tok:none", {"LM0": [0.5], "NLM0": [0.25]}, "abc123")
    assert sig.startswith("nrefs:1|tok:none|weights:") and sig.endswith("|model:abc123")
    assert sig != full_signature("nrefs:1|tok:none", {"LM0": [0.5], "NLM0": [0.2]}, "abc123")


def test_bleu_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bleu", "--hyp", str(HYP), "--ref", str(REF)]) == 0
    out = capsys.readouterr().out
    expected = sacrebleu.corpus_bleu(read_lines(HYP), [read_lines(REF)], tokenize="none")
    assert out.startswith(f"BLEU = {expected.score:.2f}") and "nrefs:1|case:mixed|eff:no|tok:none" in out
    worse = tmp_path / "worse.txt"
    worse.write_text("".join(" ".join(h.split()[:3]) + "\n" for h in read_lines(HYP)))
    assert main(["bleu", "--hyp", str(HYP), "--ref", str(REF), "--baseline", str(worse), "--samples", "100"]) == 0
    out = capsys.readouterr().out
    assert "paired bootstrap p = 0.0099" in out


def test_bleu_cli_length_mismatch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("a b c\n")
    assert main(["bleu", "--hyp", str(short), "--ref", str(REF)]) == 1
    assert "1 hypotheses but 300 reference lines" in capsys.readouterr().err
