"""Square-root frequency classes (``--class-method frequency-sqrt``): the classes that keep
exact scoring cheap at large V (docs/scaling.md, "Large vocabulary")."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nlmserve.lm.classes import frequency_binning
from nlmserve.lm.train import TrainConfig, prepare_data


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
