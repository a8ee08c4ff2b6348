"""The scoring API on the tiny real model: validation, context normalisation, sentences
with KenLM full_scores semantics, the server's normaliser pieces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nlmserve.common.errors import InvalidRequestError
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.vocab import BOS_ID, EOS_ID, UNK_ID


def ids(lm: LanguageModel, text: str) -> list[int]:
    return [lm.vocab.id(w) for w in text.split()]


def test_model_properties(tiny_lm: LanguageModel) -> None:
    assert tiny_lm.order == 5
    assert tiny_lm.output_type == "class" and tiny_lm.objective == "nce" and tiny_lm.self_normalized
    assert tiny_lm.classes is not None and tiny_lm.classes.num_classes == tiny_lm.config.num_classes
    assert len(tiny_lm.model_hash) == 64 and tiny_lm.format_version == 3
    assert tiny_lm.device == torch.device("cpu")
    assert tiny_lm.vocab.words[:3] == ["<unk>", "<s>", "</s>"]


def test_padding_and_sentence_start_reset(tiny_lm: LanguageModel) -> None:
    the, of, eu = ids(tiny_lm, "the of european")
    rows = np.array([[BOS_ID, BOS_ID, BOS_ID, BOS_ID, the]])
    short = [[the], [BOS_ID, the], [BOS_ID, BOS_ID, the]]
    full = tiny_lm.score_ngrams(rows[:1])[0]
    for ngram in short:
        assert tiny_lm.score_ngrams(np.array([ngram]))[0] == pytest.approx(full, abs=1e-6)
    # everything left of the newest <s> is ignored
    a = tiny_lm.score_ngrams(np.array([[of, eu, BOS_ID, of, the]]))[0]
    b = tiny_lm.score_ngrams(np.array([[BOS_ID, of, the]]))[0]
    assert a == pytest.approx(b, abs=1e-6)
    # but a real history changes the score
    c = tiny_lm.score_ngrams(np.array([[eu, of, the]]))[0]
    assert abs(c - b) > 1e-4


@pytest.mark.parametrize("bad,index,message", [
    ([[3, 4], [5, BOS_ID]], 1, "<s>"),
    ([[3, 4], [3, 10**7]], 1, "out of range"),
    ([[3, -1]], 0, "out of range"),
])
def test_invalid_ngrams_name_the_index(tiny_lm: LanguageModel, bad: list[list[int]], index: int, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as exc:
        tiny_lm.score_ngrams(np.array(bad))
    assert exc.value.index == index


def test_too_long_and_empty_ngrams(tiny_lm: LanguageModel) -> None:
    with pytest.raises(InvalidRequestError, match="longer than the model order") as exc:
        tiny_lm.score_ngrams(np.full((2, 6), 3))
    assert exc.value.index == 0
    with pytest.raises(InvalidRequestError, match="empty") as exc:
        tiny_lm.score_ngrams(np.zeros((3, 0), dtype=np.int64))
    assert exc.value.index == 0
    assert tiny_lm.score_ngrams(np.zeros((0, 3), dtype=np.int64)).shape == (0,)
    assert tiny_lm.score_ngrams(np.zeros((0, 9), dtype=np.int64)).shape == (0,)
    with pytest.raises(InvalidRequestError):
        tiny_lm.score_ngrams(np.array([1.5, 2.0]))


def test_log10_and_unnormalised(tiny_lm: LanguageModel) -> None:
    rows = np.array([ids(tiny_lm, "the european parliament"), ids(tiny_lm, "of the commission")])
    ln = tiny_lm.score_ngrams(rows)
    assert np.allclose(tiny_lm.score_ngrams(rows, log10=True), ln / math.log(10), atol=1e-6)
    raw = tiny_lm.score_ngrams(rows, normalized=False)
    assert not np.allclose(raw, ln, atol=1e-6)
    assert np.all(np.abs(raw - ln) < 1.0)  # NCE training keeps it roughly self-normalised
    assert ln.dtype == np.float32 and np.all(ln < 0)


def test_server_pieces_compose_to_log_probabilities(tiny_lm: LanguageModel) -> None:
    rows = np.array([ids(tiny_lm, "the european parliament"), [EOS_ID, UNK_ID, EOS_ID], [BOS_ID, 7, 9]])
    ctx, target = tiny_lm.prepare_contexts(rows)
    assert ctx.shape == (3, 4) and ctx.dtype == torch.long
    assert ctx[0].tolist()[:2] == [BOS_ID, BOS_ID]
    r = tiny_lm.encode_contexts(ctx)
    cls = tiny_lm.word_classes(target)
    raw = tiny_lm.raw_score(r, target, ctx)
    logp = raw - tiny_lm.class_log_normalizer(r, ctx) - tiny_lm.in_class_log_normalizer(r, cls, ctx)
    assert np.allclose(logp.numpy(), tiny_lm.score_ngrams(rows), atol=1e-5)
    unnorm = raw.numpy()
    assert np.allclose(unnorm, tiny_lm.score_ngrams(rows, normalized=False), atol=1e-5)


def test_score_sentences_matches_score_ngrams(tiny_lm: LanguageModel) -> None:
    sents = [
        "the european parliament has adopted the report".split(),
        "zzyzx the".split(),
        [],
        "commission".split(),
    ]
    out = tiny_lm.score_sentences(sents)
    assert len(out) == 4
    the = tiny_lm.vocab.id("the")
    # sentence 2: "zzyzx the </s>": OOV flagged, scored as <unk>
    s = out[1]
    assert s.oov.tolist() == [True, False, False]
    assert s.ngram_lengths.tolist() == [2, 3, 4]
    expect = np.array([tiny_lm.score_ngrams(np.array([row]))[0]
                       for row in ([UNK_ID], [UNK_ID, the], [UNK_ID, the, EOS_ID])])
    assert np.allclose(s.token_log_probs, expect, atol=1e-6)
    assert s.total == pytest.approx(float(expect.astype(np.float64).sum()), abs=1e-5)
    # sentence 1: seven words + </s>, n-gram lengths grow to the order
    assert out[0].ngram_lengths.tolist() == [2, 3, 4, 5, 5, 5, 5, 5]
    words = ids(tiny_lm, "the european parliament has adopted the report") + [EOS_ID]
    rows = np.array([([BOS_ID] * 4 + words)[i : i + 5] for i in range(len(words))])
    assert np.allclose(out[0].token_log_probs, tiny_lm.score_ngrams(rows), atol=1e-6)
    # empty sentence: just </s> after <s>
    assert out[2].ngram_lengths.tolist() == [2]
    assert out[2].token_log_probs[0] == pytest.approx(tiny_lm.score_ngrams(np.array([[EOS_ID]]))[0], abs=1e-6)


def test_score_sentences_bos_eos_flags_and_log10(tiny_lm: LanguageModel) -> None:
    sent = ["the", "commission"]
    a = tiny_lm.score_sentences([sent], eos=False, log10=True)[0]
    b = tiny_lm.score_sentences([sent], log10=False)[0]
    assert len(a.token_log_probs) == 2 and len(b.token_log_probs) == 3
    assert np.allclose(a.token_log_probs, b.token_log_probs[:2] / math.log(10), atol=1e-6)
    c = tiny_lm.score_sentences([sent], bos=False)[0]
    assert c.ngram_lengths.tolist() == [1, 2, 3]
    assert tiny_lm.score_sentences([[]], eos=False)[0].total == 0.0
    with pytest.raises(InvalidRequestError) as exc:
        tiny_lm.score_sentences([["a"], ["the", "<s>", "x"]])
    assert exc.value.index == 1


def test_large_batches_are_chunked_consistently(tiny_lm: LanguageModel) -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, len(tiny_lm.vocab), size=(9000, 5))
    rows[:, -1] = np.where(rows[:, -1] == BOS_ID, EOS_ID, rows[:, -1])
    whole = tiny_lm.score_ngrams(rows)
    parts = np.concatenate([tiny_lm.score_ngrams(rows[i : i + 1000]) for i in range(0, 9000, 1000)])
    assert np.allclose(whole, parts, atol=1e-6)


def test_distribution_over_vocabulary_sums_to_one(tiny_lm: LanguageModel) -> None:
    V = len(tiny_lm.vocab)
    targets = np.array([w for w in range(V) if w != BOS_ID])
    ctx = ids(tiny_lm, "the european parliament")
    rows = np.array([ctx + [w] for w in targets])
    assert abs(np.exp(tiny_lm.score_ngrams(rows).astype(np.float64)).sum() - 1.0) < 1e-4


@pytest.mark.parametrize(("shape", "sliced"), [((7942, 256), True), ((3000, 768), True), ((100, 16), False)])
def test_in_class_matrix_vector_product_in_slices_equals_the_whole(shape: tuple[int, int], sliced: bool) -> None:
    # The tiny path's in-class normaliser multiplies a class's embedding block by the context
    # vector in slices (so numpy's BLAS stays on the calling thread); a block larger than a
    # slice must give the product of the whole block.
    from nlmserve.lm.cpu import MV_ELEMENTS
    from nlmserve.lm.cpu import mv as _mv

    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal(shape[1]).astype(np.float32)
    got = _mv(a, x)
    assert got.shape == (shape[0],) and got.dtype == np.float32
    np.testing.assert_allclose(got, a.astype(np.float64) @ x.astype(np.float64), rtol=1e-4, atol=1e-4)
    assert (shape[0] > MV_ELEMENTS // shape[1]) == sliced
