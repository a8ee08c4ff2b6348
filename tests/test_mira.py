"""Batch k-best MIRA: its sentence BLEU against sacrebleu, a hand-computed update, real lists, CLI."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from sacrebleu.metrics.bleu import BLEU

from nlmserve.cli import main
from nlmserve.common.errors import InputError
from nlmserve.moses_plugin import mert, mira
from nlmserve.moses_plugin.bleu import BleuConfig, SentenceStats, corpus_bleu, read_references
from nlmserve.moses_plugin.rerank import first_best, rerank
from nlmserve.moses_plugin.weights import Weights, load_weights

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "nbest" / "europarl-10x100-5iter"
LISTS = [str(FIXTURE / f"nbest.{i}.gz") for i in range(1, 6)]
REF = str(FIXTURE / "reference")


def test_background_bleu_is_sacrebleus_unsmoothed_bleu_times_the_reference_length() -> None:
    scorer = SentenceStats(BleuConfig(), [["the cat sat on the mat today"]])
    hyps = ["the cat sat on the mat today", "the cat sat on a mat", "a dog", "the the the the the the the the the"]
    stats = scorer.stats(0, hyps)
    rng = np.random.default_rng(0)
    for bg in (np.ones(10, dtype=np.int64), 1 + rng.integers(0, 40, 10)):  # integers: sacrebleu formats lengths as %d
        got = mira.background_bleu(stats, bg.astype(np.float64))
        for row, value in zip((stats + bg).tolist(), got):
            expected = BLEU.compute_bleu(correct=row[2:6], total=row[6:10], sys_len=row[0],
                                         ref_len=row[1], smooth_method="none").score / 100 * row[1]
            assert value == pytest.approx(expected, rel=1e-12)


def _one_sentence() -> tuple[mert.MertData, SentenceStats]:
    scorer = SentenceStats(BleuConfig(), [["a b c d"]])
    data = mert.MertData((("F", 1), ("G", 1)))
    hyps = ["a b c d", "x y z w"]
    data.add(0, np.array([[0.0, 1.0], [1.0, 0.0]]), scorer.stats(0, hyps), hyps)
    return data, scorer


def test_one_update_by_hand() -> None:
    # Background ones: the perfect hypothesis has precisions 5/5 4/4 3/3 2/2 and reference
    # length 5 → 5; "x y z w" has 1/5 1/4 1/3 1/2 → 5·120^(-1/4) = 1.51066. With w = (1, 0)
    # the model prefers "x y z w" (1 > 0): hope = the perfect one, fear = "x y z w",
    # Δf = (-1, 1), loss = (5 - 1.51066) - w·Δf = 4.48934, ‖Δf‖² = 2.
    data, scorer = _one_sentence()
    init = Weights((("F", (1.0,)), ("G", (0.0,))))
    assert mira.background_bleu(data.stats[0], np.ones(10)) == pytest.approx([5.0, 5 * 120 ** -0.25])
    loss = 5 - 5 * 120 ** -0.25 + 1
    # A large C takes the whole step loss/‖Δf‖²: w = (1 - η, η), averaged with the start
    # ((2 - η)/2, η/2), which prefers the perfect hypothesis: BLEU 100.
    eta = loss / 2
    free = mira.tune(data, scorer, init, config=mira.MiraConfig(iterations=1, c=10.0, normalize=False))
    assert free.weights.flat() == pytest.approx([(2 - eta) / 2, eta / 2])
    assert free.updates == 1 and free.bleu == pytest.approx(100.0) and free.epochs == (free.bleu,)
    # C = 1 caps the step at 1: w = (0, 1), averaged (0.5, 0.5); the tie goes to the first hypothesis.
    capped = mira.tune(data, scorer, init, config=mira.MiraConfig(iterations=1, c=1.0, normalize=False))
    assert capped.weights.flat() == pytest.approx([0.5, 0.5]) and capped.bleu == pytest.approx(100.0)
    # C = 0.01: averaged (0.995, 0.005) still picks the wrong one (BLEU 0, as the start):
    # no epoch beats the start, so the start is the result.
    small = mira.tune(data, scorer, init, config=mira.MiraConfig(iterations=1, normalize=False))
    assert small.epochs == (0.0,) and small.start_bleu == 0.0 and small.weights.flat() == [1.0, 0.0]


def test_mira_on_real_lists_beats_the_lists_own_one_best() -> None:
    refs = read_references([REF])
    scorer = SentenceStats(BleuConfig(), refs)
    data = mert.load_nbest_data(LISTS, scorer)
    own = max(corpus_bleu(first_best(p), refs, BleuConfig())[0].score for p in LISTS)
    init, _ = mert.weights_from_totals(LISTS[-1:], data.layout)
    result = mira.tune(data, scorer, init, config=mira.MiraConfig(seed=1))
    assert result.bleu > own and result.bleu == max(result.epochs) > result.start_bleu and len(result.epochs) == 60
    assert sum(abs(v) for v in result.weights.flat()) == pytest.approx(1.0)
    # The reported BLEU is what reranking the union with the weights gives.
    packed = mert.PackedData(data)
    assert scorer.score(packed.corpus_stats(np.asarray(result.weights.flat()))).score == pytest.approx(result.bleu)
    again = mira.tune(data, scorer, init, config=mira.MiraConfig(seed=1))
    assert again.weights == result.weights  # seeded sentence order: repeatable
    other = mira.tune(data, scorer, init, config=mira.MiraConfig(seed=2))
    assert other.epochs != result.epochs


def test_fixed_features_and_bounds_hold() -> None:
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    data = mert.load_nbest_data(LISTS[:2], scorer)
    init, _ = mert.weights_from_totals(LISTS[:1], data.layout)
    start = init.flat()
    start[8:13] = [min(max(v, 0.0), 0.05) for v in start[8:13]]  # tm: columns 8-12
    ranges = mert.fix_features(mert.parse_ranges(["tm=0..0.05"], data.layout), ["lm"], data.layout)
    result = mira.tune(data, scorer, Weights.from_flat(data.layout, start), ranges,
                       mira.MiraConfig(iterations=5, c=1.0, normalize=False))
    out = result.weights.as_dict()
    assert all(0.0 <= v <= 0.05 for v in out["tm"])
    assert out["lm"] == pytest.approx([start[7]])
    assert result.updates > 0 and out != init.as_dict()
    with pytest.raises(InputError, match="ranges for"):
        mira.tune(data, scorer, init, ranges[:3])


@pytest.mark.parametrize("field, value, message", [
    ("c", 0.0, "C must be positive"), ("iterations", 0, "at least 1"), ("decay", 1.5, "decay must be in"),
])
def test_bad_settings_are_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(InputError, match=message):
        mira.MiraConfig(**{field: value})


def test_tune_cli_with_mira(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w"
    assert main(["tune", "--tuner", "mira", "--nbest", *LISTS, "--ref", REF, "--out", str(out),
                 "--iterations", "10", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "10 MIRA epochs" in printed and "[weight]" in printed
    weights = load_weights(str(out) + ".ini")
    assert load_weights(str(out) + ".txt", weights.layout) == weights
    tuned = float(printed.split()[1])
    refs = read_references([REF])
    # Reranking the last list with the weights gives a BLEU; the union's is what tune printed.
    scorer = SentenceStats(BleuConfig(), refs)
    data = mert.load_nbest_data(LISTS, scorer)
    packed = mert.PackedData(data)
    assert scorer.score(packed.corpus_stats(np.asarray(weights.flat()))).score == pytest.approx(tuned, abs=0.005)
    assert len(rerank(LISTS[-1], weights).hyps) == 10
    with pytest.raises(SystemExit) as stop:  # a usage error, found as the flags are parsed
        main(["tune", "--tuner", "mira", "--nbest", LISTS[0], "--ref", REF, "--out", str(out), "--mira-c", "-1"])
    assert stop.value.code == 2 and "argument --mira-c: must be more than 0, not -1" in capsys.readouterr().err
    assert not math.isnan(tuned)


def test_the_old_spelling_of_the_tuner_still_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--nbest", LISTS[0], "--ref", REF, "--iterations", "5", "--seed", "1"]
    assert main(["tune", "--tuner", "mira", *common, "--out", str(tmp_path / "new")]) == 0
    new = capsys.readouterr()
    assert main(["tune", "--algorithm", "mira", *common, "--out", str(tmp_path / "old")]) == 0
    old = capsys.readouterr()
    assert "5 MIRA epochs" in old.out
    assert (tmp_path / "old.ini").read_bytes() == (tmp_path / "new.ini").read_bytes()
    assert new.err == ""
    assert old.err == "nlmserve tune: warning: --algorithm is deprecated; use --tuner\n"
