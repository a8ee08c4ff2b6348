"""Shared fixtures: real data paths and a tiny real model file.

``tiny_model_path`` is a normal model file written by the normal save path: vocabulary
from the first 3,000 lines of the shipped Europarl slice (words seen at least twice),
frequency-binned classes, order 5, width 16, NCE-trained for a few hundred steps with a
fixed seed (deterministic on one thread). ``tiny_lm`` is that file loaded on the CPU.
"""

from __future__ import annotations

import lzma
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from nlmserve.lm.corpus import CorpusIds
    from nlmserve.lm.vocab import Vocabulary

REPO = Path(__file__).resolve().parent.parent
DATA_LM = REPO / "data" / "lm"
TRAIN_XZ = DATA_LM / "europarl.train.50k.lc-moses.en.xz"
DEV_TXT = DATA_LM / "europarl.dev.1k.lc-moses.en"

TINY_LINES = 3000
TINY_DIM = 16
TINY_ORDER = 5
TINY_CLASSES = 24
TINY_SEED = 7
TINY_STEPS = 300


@pytest.fixture(scope="session")
def train_small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 3,000 lines of the shipped training slice as a plain text file."""
    out = tmp_path_factory.mktemp("data") / "train.3k.en"
    with lzma.open(TRAIN_XZ, "rt", encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= TINY_LINES:
                break
            dst.write(line)
    return out


@pytest.fixture(scope="session")
def dev_small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 200 lines of the shipped dev slice."""
    out = tmp_path_factory.mktemp("data") / "dev.200.en"
    with open(DEV_TXT, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= 200:
                break
            dst.write(line)
    return out


@pytest.fixture(scope="module")
def vocab(train_small_path: Path) -> "Vocabulary":
    """The vocabulary of ``train_small_path`` (words seen at least twice)."""
    from nlmserve.lm.corpus import count_words
    from nlmserve.lm.vocab import Vocabulary

    counts, _ = count_words(train_small_path)
    return Vocabulary.build(counts, min_count=2)


@pytest.fixture(scope="module")
def corpus(train_small_path: Path, vocab: "Vocabulary", tmp_path_factory: pytest.TempPathFactory) -> "CorpusIds":
    """``train_small_path`` as a memory-mapped id file over ``vocab``."""
    from nlmserve.lm.corpus import CorpusIds

    return CorpusIds.encode(train_small_path, vocab, tmp_path_factory.mktemp("ids") / "train.ids")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path, dev_small_path: Path) -> Path:
    """A real, small, trained model file (class output, NCE, order 5)."""
    from nlmserve.lm.train import TrainConfig, train

    out = tmp_path_factory.mktemp("model") / "tiny.nlm"
    config = TrainConfig(
        train=str(train_small_path),
        valid=str(dev_small_path),
        out=str(out),
        order=TINY_ORDER,
        dim=TINY_DIM,
        classes=TINY_CLASSES,
        class_method="frequency",
        objective="nce",
        min_count=2,
        max_steps=TINY_STEPS,
        batch_size=256,
        lr=0.1,
        threads=1,
        seed=TINY_SEED,
        progress=False,
        learning_curve=False,
    )
    train(config)
    return out


@pytest.fixture(scope="session")
def feature_model_path(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path,
                       dev_small_path: Path) -> Path:
    """A small model trained with direct n-gram features (AdaGrad: sparse feature updates;
    order 4, tables of 1,024 class and 4,096 word slots)."""
    from nlmserve.lm.train import TrainConfig, train

    out = tmp_path_factory.mktemp("ngram") / "feat.nlm"
    train(TrainConfig(train=str(train_small_path), valid=str(dev_small_path), out=str(out), order=4, dim=8,
                      classes=16, objective="nce", min_count=2, max_steps=120, batch_size=128,
                      valid_every=60, threads=1, seed=3, progress=False, learning_curve=False,
                      checkpoint_every=0, ngram_class_table=1 << 10, ngram_word_table=1 << 12))
    return out


@pytest.fixture(scope="session")
def tree_model_path(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path, dev_small_path: Path) -> Path:
    """A small trained tree-output model (Huffman codes, exact likelihood; order 4)."""
    from nlmserve.lm.train import TrainConfig, train

    out = tmp_path_factory.mktemp("tree") / "tree.nlm"
    train(TrainConfig(train=str(train_small_path), valid=str(dev_small_path), out=str(out), order=4, dim=8,
                      output="huffman", objective="mle", min_count=2, max_steps=120, batch_size=128,
                      valid_every=60, threads=1, seed=3, progress=False, learning_curve=False,
                      checkpoint_every=0))
    return out


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_path: Path):  # type: ignore[no-untyped-def]
    """``tiny_model_path`` loaded on the CPU."""
    import torch

    from nlmserve.lm.scoring import LanguageModel

    torch.set_num_threads(1)
    return LanguageModel.load(tiny_model_path, device="cpu")
