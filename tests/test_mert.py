"""MERT: exact line search (hand-built example), optimum checks on real lists, formats, CLI."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from nlmserve.cli import main
from nlmserve.common.errors import InputError
from nlmserve.moses_plugin import extractor, mert
from nlmserve.moses_plugin.bleu import BleuConfig, SentenceStats, corpus_bleu, read_references
from nlmserve.moses_plugin.nbest import iter_sentences, read_lines
from nlmserve.moses_plugin.rerank import first_best, rerank
from nlmserve.moses_plugin.weights import (
    Weights,
    layout_from_names,
    layout_names,
    load_weights,
    parse_moses_ini,
    parse_weights_txt,
    to_moses_ini,
    to_weights_txt,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "nbest"
FIXTURE = DATA / "europarl-10x100-5iter"
LISTS = [str(FIXTURE / f"nbest.{i}.gz") for i in range(1, 6)]
REF = str(FIXTURE / "reference")


# Two sentences, two features. Along w = (1, 0) + γ (0, 1) the model scores are
#   sentence 0: h0 "a b c d" (perfect)  0 + 1γ;  h1 "x y z w" (no match)  1 + 0γ   → h0 for γ > 1
#   sentence 1: h0 "e f g h" (perfect)  0 + 2γ;  h1 "e f x y"  1 + 0γ;  h2 "q r s t" -3 + 4γ
#               → h1 for γ < 0.5, h0 for 0.5 < γ < 1.5, h2 for γ > 1.5
# so both sentences are perfect exactly on (1, 1.5): BLEU 100 at its midpoint γ = 1.25.
def _toy() -> tuple[mert.MertData, SentenceStats]:
    scorer = SentenceStats(BleuConfig(), [["a b c d", "e f g h"]])
    data = mert.MertData((("F", 1), ("G", 1)))
    hyps0, hyps1 = ["a b c d", "x y z w"], ["e f g h", "e f x y", "q r s t"]
    data.add(0, np.array([[0.0, 1.0], [1.0, 0.0]]), scorer.stats(0, hyps0), hyps0)
    data.add(1, np.array([[0.0, 2.0], [1.0, 0.0], [-3.0, 4.0]]), scorer.stats(1, hyps1), hyps1)
    return data, scorer


def test_envelope_thresholds_by_hand() -> None:
    data, scorer = _toy()
    packed = mert.PackedData(data)
    w, d = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    start, xs, diffs = mert.envelope_events(packed.feats @ w, packed.feats @ d, packed.mask, packed.stats)
    assert sorted(xs.tolist()) == [0.5, 1.0, 1.5]
    # At γ → -∞: sentence 0 "x y z w" (0 matches), sentence 1 "e f x y" (c1 = 2, c2 = 1).
    assert start.tolist() == [8, 8, 2, 1, 0, 0, 8, 6, 4, 2]
    assert diffs.sum(axis=0).tolist() == (data.stats[0][0] - data.stats[0][1] + data.stats[1][2] - data.stats[1][1]).tolist()


def test_line_search_finds_the_exact_optimum() -> None:
    data, scorer = _toy()
    packed = mert.PackedData(data)
    result = mert.line_search(packed, scorer, np.array([1.0, 0.0]), np.array([0.0, 1.0]))
    assert result.interval == (1.0, 1.5)
    assert result.gamma == 1.25
    assert result.bleu == pytest.approx(100.0)
    # A bound inside the optimal interval: the optimum is the midpoint of what is left.
    bounded = mert.line_search(packed, scorer, np.array([1.0, 0.0]), np.array([0.0, 1.0]), hi=1.2)
    assert bounded.interval == (1.0, 1.2) and bounded.gamma == pytest.approx(1.1)
    # Bounded away from the optimum: the best reachable interval.
    low = mert.line_search(packed, scorer, np.array([1.0, 0.0]), np.array([0.0, 1.0]), hi=0.9)
    assert low.interval == (0.5, 0.9) and low.bleu < 100


def test_tune_reaches_the_optimum_and_normalises() -> None:
    data, scorer = _toy()
    result = mert.tune(data, scorer, Weights((("F", (1.0,)), ("G", (0.0,)))), config=mert.MertConfig(restarts=2))
    assert result.bleu == pytest.approx(100.0)
    f, g = result.weights.flat()
    assert abs(f) + abs(g) == pytest.approx(1.0)
    assert 1.0 < g / f < 1.5  # the optimal ratio found by the line search


def _brute_force(packed: mert.PackedData, scorer: SentenceStats, w: np.ndarray, d: np.ndarray, gammas: np.ndarray) -> np.ndarray:
    return np.array([scorer.score(packed.corpus_stats(w + g * d)).score for g in gammas])


def test_line_search_matches_brute_force_on_real_lists() -> None:
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    data = mert.load_nbest_data(LISTS[:2], scorer)
    packed = mert.PackedData(data)
    rng = np.random.default_rng(3)
    w = np.asarray(mert.weights_from_totals(LISTS[:1], data.layout)[0].flat())
    for _ in range(3):
        d = rng.standard_normal(data.dim) * np.abs(w).mean()
        result = mert.line_search(packed, scorer, w, d)
        at_gamma = scorer.score(packed.corpus_stats(w + result.gamma * d)).score
        assert at_gamma == pytest.approx(result.bleu)
        grid = _brute_force(packed, scorer, w, d, np.linspace(-3, 3, 301))
        assert grid.max() <= result.bleu + 1e-9


def test_moses_weights_are_recovered_from_the_totals() -> None:
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    data = mert.load_nbest_data(LISTS[:1], scorer)
    for path in LISTS:
        weights, residual = mert.weights_from_totals([path], data.layout)
        assert residual < 1e-3  # totals are printed with 6 significant digits
        # Reranking with the recovered weights gives the list's own 1-best.
        assert rerank(path, weights).hyps == first_best(path)


def test_a_column_the_totals_do_not_count_starts_at_exactly_zero(tmp_path: Path) -> None:
    # rescore appends NLM0 to every hypothesis and leaves the decoder's total as it was:
    # the fit cannot tell its weight from 0, so it is 0 (not a least-squares -4e-08), and
    # the decoder's own weights are those fitted without the column.
    rng = np.random.default_rng(7)
    lines = []
    for line in read_lines(LISTS[0]):
        fields = line.split("|||")
        fields[2] = f"{fields[2].rstrip()} NLM0= {rng.uniform(-60.0, -5.0):.4f} "
        lines.append("|||".join(fields))
    path = tmp_path / "with-nlm.nbest"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    layout = mert.load_nbest_data([str(path)], scorer).layout
    assert layout[-1] == ("NLM0", 1)
    weights, residual = mert.weights_from_totals([str(path)], layout)
    own, own_residual = mert.weights_from_totals(LISTS[:1], layout[:-1])
    assert weights.get("NLM0") == (0.0,)
    assert weights.for_layout(layout[:-1]) == own and residual == own_residual < 1e-3


def test_a_selection_of_features_starts_from_the_full_totals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # tune --features drops the other columns; the start is still the decoder's weights,
    # fitted with every column its totals count, and kept for the selected ones.
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    full = mert.load_nbest_data(LISTS[:1], scorer).layout
    sub = tuple(g for g in full if g[0] != "lm")
    assert mert.load_nbest_data(LISTS[:1], scorer, features=["d", "tm", "w"]).layout == sub
    whole, _ = mert.weights_from_totals(LISTS[:1], full)
    part, residual = mert.weights_from_totals(LISTS[:1], sub)
    assert residual < 1e-3
    assert part == whole.for_layout(sub) and whole.get("lm") is not None
    out = tmp_path / "w"
    assert main(["tune", "--nbest", LISTS[0], "--ref", REF, "--out", str(out), "--restarts", "0",
                 "--features", "d", "tm", "w"]) == 0
    capsys.readouterr()
    assert load_weights(str(out) + ".ini").layout == sub


def test_mert_reaches_at_least_the_lists_own_one_best() -> None:
    refs = read_references([REF])
    scorer = SentenceStats(BleuConfig(), refs)
    data = mert.load_nbest_data(LISTS, scorer)
    assert data.n_hypotheses < 5000  # the union removed duplicates
    own = max(corpus_bleu(first_best(p), refs, BleuConfig())[0].score for p in LISTS)
    init, _ = mert.weights_from_totals(LISTS[-1:], data.layout)
    result = mert.tune(data, scorer, init, config=mert.MertConfig(restarts=2, seed=1))
    assert result.bleu >= own
    assert result.bleu >= result.start_bleu
    assert sum(abs(v) for v in result.weights.flat()) == pytest.approx(1.0)
    # The reported BLEU is what reranking the union with the weights gives.
    packed = mert.PackedData(data)
    flat = np.asarray(result.weights.flat())
    assert scorer.score(packed.corpus_stats(flat)).score == pytest.approx(result.bleu)
    again = mert.tune(data, scorer, init, config=mert.MertConfig(restarts=2, seed=1))
    assert again.weights == result.weights  # seeded: repeatable


def test_ranges_and_fixed_features_are_respected() -> None:
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    data = mert.load_nbest_data(LISTS[:2], scorer)
    init, _ = mert.weights_from_totals(LISTS[:1], data.layout)
    ranges = mert.parse_ranges(["tm=0..0.05", "w:0=-0.2..0.2"], data.layout)
    ranges = mert.fix_features(ranges, ["lm"], data.layout)
    cfg = mert.MertConfig(restarts=1, normalize=False)
    start = init.flat()
    start[8:13] = [min(max(v, 0.0), 0.05) for v in start[8:13]]  # tm: columns 8-12
    result = mert.tune(data, scorer, Weights.from_flat(data.layout, start), ranges, cfg)
    out = result.weights.as_dict()
    assert all(0.0 <= v <= 0.05 for v in out["tm"])
    assert -0.2 <= out["w"][0] <= 0.2
    assert out["lm"] == [start[7]]
    with pytest.raises(InputError, match="no feature 'nope'"):
        mert.parse_ranges(["nope=0..1"], data.layout)


def test_extractor_text_round_trip(tmp_path: Path) -> None:
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    data = mert.load_nbest_data(LISTS[:2], scorer)
    ffile, sfile = tmp_path / "FEATSTAT", tmp_path / "SCORESTAT"
    extractor.save(data, str(ffile), str(sfile))
    lines = ffile.read_text().splitlines()
    names = "d_0 d_1 d_2 d_3 d_4 d_5 d_6 lm_0 tm_0 tm_1 tm_2 tm_3 tm_4 w_0 "
    assert lines[0] == f"FEATURES_TXT_BEGIN_0 0 {len(data.feats[0])} 14 {names}"
    assert lines[1] == "0 -3.30693 0 0 -2.83036 0 0 -47.2982 -36.7163 -58.3679 -12.6473 -17.133 7.99917 -14 "
    scores = sfile.read_text().splitlines()
    assert scores[0] == f"SCORES_TXT_BEGIN_0 0 {len(data.feats[0])} 9 BLEU"
    assert scores[1].endswith(" ") and len(scores[1].split()) == 9
    loaded = extractor.load(str(ffile), str(sfile))
    assert loaded.layout == data.layout
    for sent in data.feats:
        assert np.allclose(loaded.feats[sent], data.feats[sent], rtol=1e-5)
        assert (loaded.stats[sent] == data.stats[sent]).all()
    assert extractor.features_text(loaded) == ffile.read_text()
    assert mert.merge(loaded, data) == 0  # nothing new


def test_extractor_errors_name_file_and_line(tmp_path: Path) -> None:
    ffile, sfile = tmp_path / "F", tmp_path / "S"
    ffile.write_text("FEATURES_TXT_BEGIN_0 0 2 1 a_0 \n1 \n")
    sfile.write_text("SCORES_TXT_BEGIN_0 0 2 9 BLEU\n1 1 1 1 1 1 1 1 1 \n1 1 1 1 1 1 1 1 1 \nSCORES_TXT_END_0\n")
    with pytest.raises(InputError, match=f"{ffile}:1: block of sentence 0 ends early"):
        extractor.load(str(ffile), str(sfile))


def test_weights_round_trip(tmp_path: Path) -> None:
    ini = parse_moses_ini((DATA / "newstest-fr-en" / "baseline-weights.ini").read_text())
    assert ini.get("LM0") == (0.107688,) and ini.get("UnknownWordPenalty0") == (1.0,)
    assert len(ini.get("LexicalReordering0") or ()) == 6
    assert parse_moses_ini(to_moses_ini(ini)) == ini
    assert parse_weights_txt(to_weights_txt(ini), ini.layout) == ini
    path = tmp_path / "weights.txt"
    path.write_text(to_weights_txt(ini))
    assert load_weights(path, ini.layout) == ini
    assert layout_from_names(layout_names(ini.layout)) == ini.layout
    with pytest.raises(InputError, match="has 3 weights but the n-best list has"):
        parse_weights_txt("1 2 3\n", ini.layout, "w.txt")
    with pytest.raises(InputError, match="x.ini:2: weight of 'LM0' is not a number"):
        parse_moses_ini("[weight]\nLM0= abc\n", "x.ini")


def test_tune_rerank_bleu_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "weights"
    ffile, sfile = tmp_path / "f.dat", tmp_path / "s.dat"
    code = main(["tune", "--nbest", *LISTS[:3], "--ref", REF, "--out", str(out), "--restarts", "1",
                 "--ffile", str(ffile), "--scfile", str(sfile)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "signature nrefs:1|case:mixed|eff:no|tok:none" in printed and "|weights:" in printed
    tuned_bleu = float(printed.split()[1])
    ini = load_weights(tmp_path / "weights.ini")
    assert load_weights(tmp_path / "weights.txt", ini.layout) == ini
    # Merge Moses-format statistics of the earlier lists with the last two lists.
    code = main(["tune", "--nbest", *LISTS[3:], "--ref", REF, "--out", str(tmp_path / "w2"), "--restarts", "0",
                 "--prev-ffile", str(ffile), "--prev-scfile", str(sfile), "--init", str(tmp_path / "weights.ini")])
    assert code == 0
    capsys.readouterr()
    one_best = tmp_path / "1best"
    assert main(["rerank", "--nbest", LISTS[0], "--weights", str(tmp_path / "weights.txt"), "--out", str(one_best)]) == 0
    assert len(read_lines(one_best)) == 10
    capsys.readouterr()
    assert main(["bleu", "--hyp", str(one_best), "--ref", REF]) == 0
    assert capsys.readouterr().out.startswith("BLEU = ")
    assert not math.isnan(tuned_bleu)


def test_bad_layout_in_union_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "other.nbest"
    path.write_text("0 ||| a b ||| F0= 1 ||| 1\n")
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    with pytest.raises(InputError, match=f"{path}:1: features"):
        mert.load_nbest_data([LISTS[0], str(path)], scorer)
    assert sum(1 for _ in iter_sentences(LISTS[0])) == 10


def test_select_features_matches_loading_fewer_features() -> None:
    scorer = SentenceStats(BleuConfig(), read_references([REF]))
    full = mert.load_nbest_data(LISTS[:2], scorer)
    some = mert.load_nbest_data(LISTS[:2], scorer, features=["lm", "w"])
    picked = mert.select_features(full, ["lm", "w"])
    assert picked.layout == some.layout == (("lm", 1), ("w", 1))
    assert picked.n_hypotheses == some.n_hypotheses < full.n_hypotheses
    for sent in some.feats:
        assert (picked.feats[sent] == some.feats[sent]).all() and (picked.stats[sent] == some.stats[sent]).all()
