"""The fixed-weight golden model (tests/support.py ``golden_model``): log-probabilities worked
out by hand, checked in process and through a real server on 127.0.0.1 over gRPC.

The model (order 3, ids <unk> 0, <s> 1, </s> 2, a 3, b 4, c 5), from ``golden_model``:

    r(x, y) = q(x) + 2 q(y)  for the context x y (oldest first), q(a) = (1, 0), q(b) = (0, 1),
                             every other q = (0, 0)
    class 0 = {<unk>, <s>, </s>}: exp s_c0 = 1;  class 1 = {a, b, c}: exp s_c1 = 3 * 2^r2
    in class 1: exp s_a = 2^r1, exp s_b = 2^r2, exp s_c = 1
    in class 0: exp s_<unk> = exp s_</s> = 1, <s> never (masked)

    p(w | x y) = exp s_class / (1 + 3 * 2^r2) * exp s_w / (sum of exp s_v over w's class)

The unnormalised (self-normalised NCE) score is s_class + s_w.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.client import LMClient
from nlmserve.common.errors import UnsupportedModelError
from nlmserve.lm.scoring import LanguageModel
from support import golden_model, start_server

A, B, C, UNK, BOS, EOS = 3, 4, 5, 0, 1, 2
LN10 = math.log(10.0)
LN2 = math.log(2.0)
TOL = 1e-5

# (n-gram as words, as ids, ln p by hand, unnormalised score by hand)
CASES = [
    # <s> <s> a: r = 0; class 1: 3 / (1 + 3) = 3/4; in class 1: 1 / (1 + 1 + 1) = 1/3
    # p = 3/4 * 1/3 = 1/4; unnormalised s_c1 + s_a = ln 3 + 0
    (["a"], [A], -1.3862943611198906, 1.0986122886681098),
    # <s> a b: r = q(<s>) + 2 q(a) = (2, 0); class 1: 3 * 2^0 = 3 -> 3/4;
    # in class 1: 2^0 / (2^2 + 2^0 + 1) = 1/6; p = 3/4 * 1/6 = 1/8; unnormalised ln 3 + 0
    (["<s>", "a", "b"], [BOS, A, B], -2.0794415416798357, 1.0986122886681098),
    # a b a: r = q(a) + 2 q(b) = (1, 2); class 1: 3 * 2^2 = 12 -> 12/13;
    # in class 1: 2^1 / (2^1 + 2^2 + 1) = 2/7; p = 12/13 * 2/7 = 24/91; unnormalised ln 12 + ln 2 = ln 24
    (["a", "b", "a"], [A, B, A], -1.3328056761689044, 3.1780538303479458),
    # a b </s>: r = (1, 2); class 0: 1 / 13; in class 0: 1 / (1 + 0 + 1) = 1/2; p = 1/26; unnormalised 0
    (["a", "b", "</s>"], [A, B, EOS], -3.258096538021482, 0.0),
    # b a c: r = q(b) + 2 q(a) = (2, 1); class 1: 3 * 2^1 = 6 -> 6/7;
    # in class 1: 1 / (2^2 + 2^1 + 1) = 1/7; p = 6/7 * 1/7 = 6/49; unnormalised ln 6 + 0
    (["b", "a", "c"], [B, A, C], -2.1000608288825715, 1.791759469228055),
    # b <s> a: everything left of the newest <s> is <s>, so <s> <s> a: 1/4 as above
    (["b", "<s>", "a"], [B, BOS, A], -1.3862943611198906, 1.0986122886681098),
    # c a: padded to <s> c a, r = 2 q(c) = 0: 1/4 as above
    (["c", "a"], [C, A], -1.3862943611198906, 1.0986122886681098),
    # <s> <s> <unk>: r = 0; class 0: 1/4; in class 0: 1/2; p = 1/8; unnormalised 0
    (["<unk>"], [UNK], -2.0794415416798357, 0.0),
]

# Sentences (with <s> before and </s> after), each token's n-gram and p by hand:
SENTENCES = [
    # a: 1/4 (<s> <s> a); b: 1/8 (<s> a b); </s>: 1/26 (a b </s>); total 1/832
    ("a b", [-1.3862943611198906, -2.0794415416798357, -3.258096538021482], -6.723832440821209),
    # b: <s> <s> b, r = 0: 3/4 * 1/3 = 1/4
    # a: <s> b a, r = 2 q(b) = (0, 2): class 1: 3 * 2^2 = 12 -> 12/13; in class 1:
    #    2^0 / (2^0 + 2^2 + 1) = 1/6; p = 12/13 * 1/6 = 2/13
    # c: b a c: 6/49 (above)
    # </s>: a c </s>, r = q(a) + 2 q(c) = (1, 0): class 0: 1 / (1 + 3) = 1/4; in class 0: 1/2; p = 1/8
    # total 1/4 * 2/13 * 6/49 * 1/8 = 3/5096
    ("b a c", [-1.3862943611198906, -1.8718021769015913, -2.1000608288825715, -2.0794415416798357],
     -7.437598908583889),
]


@pytest.fixture(scope="module")
def golden_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return golden_model(tmp_path_factory.mktemp("golden") / "golden.nlm")


@pytest.fixture(scope="module")
def golden(golden_path: Path) -> LanguageModel:
    return LanguageModel.load(golden_path, device="cpu")


@pytest.fixture(scope="module")
def client(golden: LanguageModel) -> Iterator[LMClient]:
    running = start_server(golden)
    try:
        with LMClient(running.target) as c:
            yield c
    finally:
        running.stop(1.0)


def test_the_golden_model(golden: LanguageModel) -> None:
    assert (golden.order, len(golden.vocab), golden.num_classes, golden.self_normalized) == (3, 6, 2, True)
    assert golden.vocab.words == ["<unk>", "<s>", "</s>", "a", "b", "c"]


def test_the_file_is_the_same_byte_for_byte_every_time(golden_path: Path, tmp_path: Path) -> None:
    assert golden_model(tmp_path / "again.nlm").read_bytes() == golden_path.read_bytes()


@pytest.mark.parametrize("rows", [1, 40], ids=["one-row", "40-rows"])  # the numpy and the torch path
def test_hand_computed_log_probabilities_in_process(golden: LanguageModel, rows: int) -> None:
    ids = np.array([[BOS] * (3 - len(i)) + i for _, i, _, _ in CASES])
    want = np.array([ln for _, _, ln, _ in CASES])
    want_raw = np.array([raw for _, _, _, raw in CASES])
    for k, (_, row, _, _) in enumerate(CASES):  # as given, unpadded
        batch = np.tile(np.array([row]), (rows, 1))
        assert golden.score_ngrams(batch)[0] == pytest.approx(want[k], abs=TOL)
    batch = np.tile(ids, (rows, 1))
    np.testing.assert_allclose(golden.score_ngrams(batch), np.tile(want, rows), atol=TOL, rtol=0)
    np.testing.assert_allclose(golden.score_ngrams(batch, log10=True), np.tile(want / LN10, rows), atol=TOL, rtol=0)
    np.testing.assert_allclose(golden.score_ngrams(batch, normalized=False), np.tile(want_raw, rows), atol=TOL, rtol=0)


def test_hand_computed_sentences_in_process(golden: LanguageModel) -> None:
    got = golden.score_sentences([text.split() for text, _, _ in SENTENCES])
    for result, (_, tokens, total) in zip(got, SENTENCES):
        np.testing.assert_allclose(result.token_log_probs, tokens, atol=TOL, rtol=0)
        assert result.total == pytest.approx(total, abs=TOL)


@pytest.mark.parametrize("pack_ids", [True, False])
def test_hand_computed_log_probabilities_through_the_server(golden: LanguageModel, client: LMClient,
                                                            pack_ids: bool) -> None:
    client.pack_ids = pack_ids
    try:
        ngrams = [words for words, _, _, _ in CASES]
        want = np.array([ln for _, _, ln, _ in CASES])
        got = client.score_ngrams(ngrams)  # log10, the client's default
        np.testing.assert_allclose(got.log_probs, want / LN10, atol=TOL, rtol=0)
        assert got.model_hash == golden.model_hash
        assert got.oov.tolist() == [words == ["<unk>"] for words in ngrams]  # the wire flags <unk> itself
        np.testing.assert_allclose(client.score_ngrams(ngrams, log_base="ln").log_probs, want, atol=TOL, rtol=0)
        raw = client.score_ngrams(ngrams, log_base="ln", normalized=False)
        assert not raw.normalized
        np.testing.assert_allclose(raw.log_probs, [r for _, _, _, r in CASES], atol=TOL, rtol=0)
        # An unknown predicted word scores as <unk> and is flagged OOV: <s> a <unk>,
        # r = (2, 0), class 0: 1 / (1 + 3 * 2^0) = 1/4, in class 0: 1/2, p = 1/8.
        oov = client.score_ngrams([["a", "zzz"]], log_base="ln")
        assert oov.log_probs[0] == pytest.approx(-2.0794415416798357, abs=TOL) and oov.oov.tolist() == [True]
    finally:
        client.pack_ids = True


def test_hand_computed_ids_through_the_server(client: LMClient) -> None:
    ids = np.array([[BOS] * (3 - len(i)) + i for _, i, _, _ in CASES], dtype=np.uint32)
    got = client.score_ids(ids, log_base="ln")
    np.testing.assert_allclose(got.log_probs, [ln for _, _, ln, _ in CASES], atol=TOL, rtol=0)


def test_the_no_word_adds_nothing(golden: LanguageModel, client: LMClient) -> None:
    """The id V = 6 in a context (a word that is not known: the words before a phrase
    scored on its own) has no q and no position row, and everything left of it is the
    no-word too: ? a b has r = 2 q(a) = (2, 0) and p = 1/8 as <s> a b; a ? b is ? ? b, r = 0,
    p(b) = 3/4 * 1/3 = 1/4; ? ? a 1/4. In process, from the tables and through the server;
    the no-word predicted is an error."""
    NO = 6
    rows = np.array([[NO, A, B], [A, NO, B], [NO, NO, A]])
    ln = [-2.0794415416798357, -1.3862943611198906, -1.3862943611198906]
    raw = [1.0986122886681098, 1.0986122886681098, 1.0986122886681098]  # ln 3 + s_w, s_w = 0, 0, 0
    assert golden.canonical_rows(rows)[1].tolist() == [NO, NO, B]
    np.testing.assert_allclose(golden.score_ngrams(rows), ln, atol=TOL, rtol=0)
    np.testing.assert_allclose(golden.score_ngrams(rows, normalized=False), raw, atol=TOL, rtol=0)
    np.testing.assert_allclose(golden.scoring_tables().score(golden.canonical_rows(rows)), raw, atol=TOL, rtol=0)
    np.testing.assert_allclose(client.score_ids(rows.astype(np.uint32), log_base="ln").log_probs, ln, atol=TOL, rtol=0)
    with pytest.raises(Exception, match="out of range"):
        client.score_ids(np.array([[A, B, NO]], dtype=np.uint32), log_base="ln")


def test_hand_computed_sentences_through_the_server(client: LMClient) -> None:
    got = client.score_sentences([text for text, _, _ in SENTENCES], log_base="ln")
    for result, (_, tokens, total) in zip(got, SENTENCES):
        np.testing.assert_allclose(result.token_log_probs, tokens, atol=TOL, rtol=0)
        assert result.total == pytest.approx(total, abs=TOL)
    # the KenLM surface: log10, n-gram lengths counting <s>, capped at the order
    assert client.score("a b") == pytest.approx(-6.723832440821209 / LN10, abs=TOL)
    triples: list[Any] = list(client.full_scores("b a c"))
    assert [n for _, n, _ in triples] == [2, 3, 3, 3]
    np.testing.assert_allclose([lp for lp, _, _ in triples], np.array(SENTENCES[1][1]) / LN10, atol=TOL, rtol=0)


def test_scoring_tables_hold_the_hand_computed_self_normalised_scores(golden: LanguageModel,
                                                                     tmp_path: Path) -> None:
    """The tables a client evaluates itself (GetScoringTables, the Moses feature's
    scoring=local): r = q(x) + 2 q(y) from the two position tables, then one output row
    and bias per word, s_c + s_w of the case by hand."""
    tables = golden.scoring_tables()
    assert tables.position.shape == (2, 6, 2) and tables.output.shape == (6, 2) and tables.activation == "none"
    np.testing.assert_allclose(tables.position[1, A], [2, 0], atol=0)  # c_1 ⊙ q(a)
    np.testing.assert_allclose(tables.output[B], [0, 2 * LN2], atol=1e-7)  # (0, ln 2) + class 1's (0, ln 2)
    ids = np.array([[BOS] * (3 - len(i)) + i for _, i, _, _ in CASES])
    np.testing.assert_allclose(tables.score(golden.canonical_rows(ids)), [r for _, _, _, r in CASES], atol=TOL, rtol=0)
    assert tables.flat().size == 2 * 6 * 2 + 6 * 2 + 6
    with pytest.raises(UnsupportedModelError, match="not self-normalised"):
        LanguageModel.load(golden_model(tmp_path / "mle.nlm", objective="mle")).scoring_tables()


def test_scoring_tables_through_the_server(golden: LanguageModel, client: LMClient, tmp_path: Path) -> None:
    """GetScoringTables streams the tables as one little-endian float32 array in chunks; a
    model without tables answers FAILED_PRECONDITION with the reason."""
    import grpc

    from nlmserve.proto import lm_pb2, lm_pb2_grpc

    want = golden.scoring_tables().flat()
    with grpc.insecure_channel(client.target) as channel:
        chunks = list(lm_pb2_grpc.LanguageModelStub(channel).GetScoringTables(
            lm_pb2.GetScoringTablesRequest(chunk_floats=7)))
    head = chunks[0]
    assert (head.model_hash, head.order, head.vocab_size, head.dim, head.activation, head.total_floats) == (
        golden.model_hash, 3, 6, 2, "none", want.size)
    assert (head.feature_order, head.ngram_class_table, head.ngram_word_table) == (0, 0, 0)
    assert [c.offset for c in chunks] == list(range(0, want.size, 7))
    got = np.frombuffer(b"".join(c.data for c in chunks), dtype="<f4")
    np.testing.assert_array_equal(got, want)

    running = start_server(LanguageModel.load(golden_model(tmp_path / "mle.nlm", objective="mle")))
    try:
        with grpc.insecure_channel(running.target) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                list(lm_pb2_grpc.LanguageModelStub(channel).GetScoringTables(lm_pb2.GetScoringTablesRequest()))
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not self-normalised" in failed.value.details()
    finally:
        running.stop(1.0)
