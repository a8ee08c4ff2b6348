"""Large vocabularies: square-root frequency classes (``--class-method frequency-sqrt``)
that keep exact scoring cheap, and validation chunks sized by the scored rows' class widths
(docs/scaling.md, "Large vocabulary")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nlmserve.lm.classes import frequency_binning
from nlmserve.lm.corpus import CorpusIds
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.data import prepare_data
from nlmserve.lm.train import TrainConfig, corpus_log_likelihood, scoring_spans


def _output_cost(word_class: np.ndarray, counts: np.ndarray) -> float:
    """K + E|c|: class softmax plus the softmax inside the token's class, per token."""
    sizes = np.bincount(word_class)
    return float(sizes.size + (counts / counts.sum() * sizes[word_class]).sum())


def test_sqrt_binning_narrows_the_rare_word_classes(train_small_path: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(train=str(train_small_path), out=str(tmp_path / "m.nlm"), min_count=1,
                      class_method="frequency-sqrt", progress=False)
    data = prepare_data(cfg)
    assert data.classes is not None
    counts = data.unigram.astype(np.float64)
    K = data.classes.num_classes
    assert K == round(np.sqrt(len(data.vocab)))
    plain = frequency_binning(counts, K).word_class
    sqrt = data.classes.word_class
    assert np.array_equal(sqrt, frequency_binning(counts, K, sqrt=True).word_class)
    # with min-count 1 the singletons fill the last count bins; square-root bins split them
    assert np.bincount(sqrt).max() * 3 < np.bincount(plain).max()
    assert _output_cost(sqrt, counts) < 0.8 * _output_cost(plain, counts)


@pytest.mark.parametrize("budget", [1 << 24, 5_000, 1])
def test_validation_chunks_by_class_width_score_every_position_once(tiny_model_path: Path, dev_small_path: Path,
                                                                    tmp_path: Path, budget: int) -> None:
    lm = LanguageModel.load(tiny_model_path, device="cpu")
    dev = CorpusIds.encode(dev_small_path, lm.vocab, tmp_path / "dev.ids")
    span = range(37, dev.num_tokens - 11)
    parts = list(scoring_spans(lm.net, dev, span, budget))
    assert [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]]  # contiguous, in order
    assert parts[0].start == span.start and parts[-1].stop == span.stop
    sizes = np.bincount(lm.net.output.word_class.numpy())
    widths = sizes[lm.net.output.word_class.numpy()[np.asarray(dev.ids)]]
    assert all(len(p) == 1 or widths[p.start : p.stop].sum() <= budget for p in parts)
    if budget == 1:
        assert len(parts) == len(span)
    ll, n = corpus_log_likelihood(lm.net, dev, lm.order, torch.device("cpu"), span, budget)
    # the same n-grams through the serving path (LanguageModel.score_ngrams)
    ctx, tgt = dev.examples(np.arange(span.start, span.stop), lm.order)
    ref = lm.score_ngrams(np.concatenate([ctx, tgt[:, None]], axis=1)).astype(np.float64).sum()
    assert n == len(span) and ll == pytest.approx(ref, rel=1e-5)


def test_epoch_permutation_is_numpys_in_half_the_memory() -> None:
    # the same order as Generator.permutation (checkpoints of earlier runs resume alike), as uint32
    from nlmserve.lm.data import permutation

    for n in (1, 17, 100_003):
        perm = permutation(5, 2, n)
        assert perm.dtype == np.uint32
        assert np.array_equal(perm, np.random.default_rng([5, 2]).permutation(n))
