"""BLEU from sacrebleu statistics equals sacrebleu's corpus BLEU; Moses layout; bootstrap; CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sacrebleu

from nlmserve.cli import main
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


#: The private methods of sacrebleu's BLEU that moses_plugin/bleu.py calls (setup.py pins
#: sacrebleu below its next major version for them).
PRIVATE = {"_cache_references", "_preprocess_segment", "_compute_segment_statistics", "_compute_score_from_stats"}


def test_the_private_sacrebleu_methods_relied_on_give_hand_computed_results() -> None:
    """Each private method moses_plugin/bleu.py calls, on a case small enough to count by hand.
    Against "the cat sat on the mat", "the cat sat on a mat" matches 5 of 6 words, 3 of 5
    bigrams, 2 of 4 trigrams, 1 of 3 4-grams; BLEU = 100 (5/6 · 3/5 · 2/4 · 1/3)^(1/4) =
    100 (1/12)^(1/4). With no 3- and 4-gram matched, "exp" smoothing gives them 1/(2 t3) and
    1/(4 t4); a hypothesis of 4 words against 6 has the brevity penalty exp(1 - 6/4)."""
    import math
    import re

    root = Path(__file__).resolve().parent.parent
    assert set(re.findall(r"metric\.(_\w+)\(", (root / "moses_plugin" / "bleu.py").read_text())) == PRIVATE
    # the installed sacrebleu is within the declared range, and the next major version is not
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    (declared,) = re.findall(r'"sacrebleu([^"]*)"', (root / "setup.py").read_text())
    assert version("sacrebleu") in SpecifierSet(declared) and "3.0.0" not in SpecifierSet(declared)
    metric = BleuConfig().metric()  # tokenize none, cased, exp smoothing
    (cached,) = metric._cache_references([["the cat sat on the mat"]])
    assert cached["ref_lens"] == [6] and cached["ref_ngrams"][("the",)] == 2
    assert cached["ref_ngrams"][("sat", "on", "the", "mat")] == 1 and len(cached["ref_ngrams"]) == 17
    hyp = metric._preprocess_segment("the cat sat on a mat")
    assert hyp == "the cat sat on a mat"
    assert metric._compute_segment_statistics(hyp, cached) == [6, 6, 5, 3, 2, 1, 6, 5, 4, 3]
    assert metric._compute_score_from_stats([6, 6, 5, 3, 2, 1, 6, 5, 4, 3]).score == \
        pytest.approx(100 * (1 / 12) ** 0.25, rel=1e-12)
    # 3/4 · 1/3 · 1/(2·2) · 1/(4·1) = 1/64
    assert metric._compute_score_from_stats([4, 6, 3, 1, 0, 0, 4, 3, 2, 1]).score == \
        pytest.approx(100 * math.exp(1 - 6 / 4) * (1 / 64) ** 0.25, rel=1e-12)
    # two references: counts clipped by the larger reference count, the closest reference length
    (both,) = metric._cache_references([["the cat sat on the mat"], ["a cat sat"]])
    assert both["ref_lens"] == [6, 3]
    assert metric._compute_segment_statistics("the cat sat on a mat", both) == [6, 6, 6, 3, 2, 1, 6, 5, 4, 3]
    assert metric._compute_segment_statistics("a cat", both) == [2, 3, 2, 1, 0, 0, 2, 1, 0, 0]
    # the preprocessing a configuration asks for: lowercasing and 13a tokenisation
    assert BleuConfig(lowercase=True, tokenize="13a").metric()._preprocess_segment("The Cat, sat.") == "the cat , sat ."


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
