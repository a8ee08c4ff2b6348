"""Reranking: argmax of w·f per sentence, first on ties, gaps, weights that do not fit."""

from __future__ import annotations

from pathlib import Path

import gzip
import json

import pytest
from support import NEWS_NBEST

from nlmserve.cli import main
from nlmserve.common.errors import InputError
from nlmserve.moses_plugin.rerank import first_best, rerank, search_check
from nlmserve.moses_plugin.weights import Weights, load_weights

LIST = (
    "0 ||| a ||| F0= 1 G0= 0 0 ||| 0\n"
    "0 ||| b ||| F0= 0 G0= 1 1 ||| 0\n"
    "0 ||| c ||| F0= 0 G0= 1 1 ||| 0\n"
    "2 ||| d ||| F0= 1 G0= 0 0 ||| 0\n"
    "2 ||| e ||| F0= 0 G0= 2 -1 ||| 0\n"
)


@pytest.fixture()
def nbest(tmp_path: Path) -> Path:
    path = tmp_path / "list.nbest"
    path.write_text(LIST)
    return path


@pytest.mark.parametrize(
    ("f", "g", "expected"),
    [
        (1.0, (0.4, 0.4), ["a", "", "d"]),  # a 1 > b 0.8; d 1 > e 0.4
        (1.0, (0.5, 0.5), ["a", "", "d"]),  # a = b = 1 → a, the first; d 1 > e 0.5
        (0.5, (0.5, 0.5), ["b", "", "d"]),  # b = c = 1 → b; d = e = 0.5 → d
        (-1.0, (0.0, 0.0), ["b", "", "e"]),  # a -1 < b 0; d -1 < e 0
    ],
)
def test_argmax_with_first_on_ties(nbest: Path, f: float, g: tuple[float, float], expected: list[str]) -> None:
    weights = Weights((("F0", (f,)), ("G0", g), ("Unused0", (3.0,))))
    result = rerank(str(nbest), weights)
    assert result.hyps == expected
    assert result.missing == [1]


def test_padding_and_missing_weights(nbest: Path) -> None:
    weights = Weights((("F0", (1.0,)), ("G0", (0.0, 0.0))))
    assert rerank(str(nbest), weights, n_sentences=5).hyps == ["a", "", "d", "", ""]
    with pytest.raises(InputError, match="more than the 2 expected"):
        rerank(str(nbest), weights, n_sentences=2)
    with pytest.raises(InputError, match="no weight for feature 'G0'"):
        rerank(str(nbest), Weights((("F0", (1.0,)),)))
    with pytest.raises(InputError, match="has 2 values but 1 weights"):
        rerank(str(nbest), Weights((("F0", (1.0,)), ("G0", (1.0,)))))
    assert first_best(str(nbest)) == ["a", "", "d"]


def test_split_sentence_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "split.nbest"
    path.write_text(LIST + "0 ||| z ||| F0= 9 G0= 0 0 ||| 0\n")
    with pytest.raises(InputError, match=":6: sentence id 0 after sentence 2: an n-best list holds its sentences in "
                       "increasing id order"):  # the reader's rule (moses_plugin.nbest.iter_sentences)
        rerank(str(path), Weights((("F0", (1.0,)), ("G0", (0.0, 0.0)))))


def test_search_check_counts_a_1best_beaten_by_an_earlier_hypothesis(tmp_path: Path) -> None:
    # Under F0=1, G0=(0.5, 0.5): the decoder's 1-best of sentence 0 is "a" (1.0); an earlier
    # list holds "x" at 1 + 0.5 * 0.5 = 1.25 (gap 0.25). Sentence 2: "d" (1.0) against the
    # earlier "y" at 0.5 * 1.0005 + 0.5 * 1 = 1.00025, within the margin of 0.001; sentence 5
    # is not in the decoder's list and does not count.
    decoder = tmp_path / "run2.nbest"
    decoder.write_text(LIST)
    earlier = tmp_path / "run1.nbest"
    earlier.write_text(
        "0 ||| x ||| F0= 1 G0= 0.5 0 ||| 0\n"
        "2 ||| y ||| F0= 0 G0= 1.0005 1 ||| 0\n"
        "5 ||| z ||| F0= 9 G0= 0 0 ||| 0\n"
    )
    weights = Weights((("F0", (1.0,)), ("G0", (0.5, 0.5))))
    check = search_check(str(decoder), [str(earlier)], weights)
    assert (check.sentences, check.beaten) == (2, 1)
    assert check.mean_gap == pytest.approx(0.25)
    # A 1-best that is not the best of its own list counts too: under G0=(1, 0.5),
    # a 1.0 < b 1.5 and d 1.0 < e 1.5.
    check = search_check(str(decoder), [], Weights((("F0", (1.0,)), ("G0", (1.0, 0.5)))))
    assert (check.sentences, check.beaten) == (2, 2)
    assert check.mean_gap == pytest.approx(0.5)
    # A margin wider than every gap: nothing counts.
    assert search_check(str(decoder), [str(earlier)], weights, margin=0.3).beaten == 0


def test_search_check_on_moses_own_list() -> None:
    # Moses sorts each sentence's list by its model score: under the weights it decoded
    # with, no 1-best is beaten. Under other weights (word penalty reversed) many are.
    decoded = load_weights(NEWS_NBEST.parent / "baseline-weights.ini")
    check = search_check(str(NEWS_NBEST), [], decoded)
    assert (check.sentences, check.beaten) == (300, 0)
    other = Weights(tuple((n, tuple(-v for v in vs) if n == "WordPenalty0" else vs) for n, vs in decoded.groups))
    assert search_check(str(NEWS_NBEST), [], other).beaten > 100


def test_search_errors_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = NEWS_NBEST.parent / "baseline-weights.ini"
    assert main(["search-errors", "--nbest", str(NEWS_NBEST), "--weights", str(weights)]) == 0
    assert capsys.readouterr().out.startswith("0 of 300 sentences (0.0%)")
    # Sentence 0's 1-best (PhrasePenalty0= 6) against the same features with PhrasePenalty0= 16
    # in another list: 10 x the weight 0.0268079 higher.
    first = next(line for line in gzip.open(NEWS_NBEST, "rt"))
    fields = first.split(" ||| ")
    better = tmp_path / "earlier.nbest"
    better.write_text(" ||| ".join([fields[0], "better", fields[2].replace("PhrasePenalty0= ", "PhrasePenalty0= 1"), "0"]) + "\n")
    assert main(["search-errors", "--nbest", str(NEWS_NBEST), "--weights", str(weights),
                 "--earlier", str(better), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["sentences"], report["beaten"]) == (300, 1)
    assert report["mean_gap"] == pytest.approx(0.268079, abs=1e-6)
