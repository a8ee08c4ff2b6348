"""The training data: what ``nlmserve train`` reads before its first step (vocabulary, the
memory-mapped id files, unigram counts, word classes), and the order it visits the tokens
in (a fresh permutation of all positions per epoch, derived from the seed and the epoch
number, cut into minibatches)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from ..common.errors import CorpusError, InputError
from .classes import WordClasses, brown_clusters, default_num_classes, frequency_binning, load_wcluster
from .corpus import CorpusIds, count_words
from .vocab import Vocabulary

log = logging.getLogger(__name__)


class DataSettings(Protocol):
    """The settings :func:`prepare_data` reads (``lm.train.TrainConfig`` has them; the
    fields' meanings are documented there)."""

    @property
    def train(self) -> str: ...
    @property
    def valid(self) -> str | None: ...
    @property
    def out(self) -> str: ...
    @property
    def workdir(self) -> str | None: ...
    @property
    def max_train_lines(self) -> int | None: ...
    @property
    def lowercase(self) -> bool: ...
    @property
    def min_count(self) -> int: ...
    @property
    def max_vocab(self) -> int | None: ...
    @property
    def resolved_output(self) -> str: ...
    @property
    def class_file(self) -> str | None: ...
    @property
    def classes(self) -> int | None: ...
    @property
    def class_method(self) -> str: ...
    @property
    def seed(self) -> int: ...


@dataclass
class TrainingData:
    """What :func:`prepare_data` made: the vocabulary, the id files, the training text's unigram
    counts and the word classes (None but for the class output)."""

    vocab: Vocabulary
    train: CorpusIds
    valid: CorpusIds | None
    unigram: np.ndarray
    classes: WordClasses | None


def head_lines(src: str, n: int, dst: Path) -> Path:
    """The first n lines of ``src`` as a plain text file (kept when up to date)."""
    stamp = dst.with_name(dst.name + ".src")
    try:
        st = os.stat(src)
    except FileNotFoundError as exc:
        raise CorpusError("no such file", src) from exc
    key = f"{os.path.abspath(src)} {st.st_size} {st.st_mtime_ns} {n}"
    if dst.exists() and stamp.exists() and stamp.read_text() == key:
        return dst
    import gzip
    import lzma

    opener: Any = lzma.open if src.endswith(".xz") else gzip.open if src.endswith(".gz") else open
    tmp = dst.with_name(dst.name + ".tmp")
    with opener(src, "rb") as fin, open(tmp, "wb") as fout:
        for i, line in enumerate(fin):
            if i >= n:
                break
            fout.write(line)
    os.replace(tmp, dst)
    stamp.write_text(key)
    return dst


def prepare_data(cfg: DataSettings) -> TrainingData:
    """Vocabulary, id files, unigram counts and word classes for ``cfg``."""
    work = Path(cfg.workdir or cfg.out + ".work")
    work.mkdir(parents=True, exist_ok=True)
    train_text: str | Path = cfg.train
    if cfg.max_train_lines is not None:
        train_text = head_lines(cfg.train, cfg.max_train_lines, work / "train.head.txt")
    counts, num_sentences = count_words(train_text, lowercase=cfg.lowercase)
    vocab = Vocabulary.build(counts, min_count=cfg.min_count, max_vocab=cfg.max_vocab)
    log.info("vocabulary: %d words from %d sentences of %s", len(vocab), num_sentences, cfg.train)
    train_ids = CorpusIds.encode(train_text, vocab, work / "train.ids", lowercase=cfg.lowercase)
    valid_ids = None
    if cfg.valid is not None:
        valid_ids = CorpusIds.encode(cfg.valid, vocab, work / "valid.ids", lowercase=cfg.lowercase)
    unigram = train_ids.unigram_counts(len(vocab))
    classes: WordClasses | None = None
    if cfg.resolved_output == "class":
        if cfg.class_file is not None:
            classes = load_wcluster(cfg.class_file, vocab)
        else:
            K = cfg.classes if cfg.classes is not None else default_num_classes(len(vocab))
            if not 1 <= K <= len(vocab):
                raise InputError(f"--classes {K} must lie in [1, {len(vocab)}] for this vocabulary")
            if cfg.class_method == "brown":
                classes = brown_clusters(train_ids, len(vocab), K, seed=cfg.seed)
            else:
                classes = frequency_binning(unigram, K, sqrt=cfg.class_method == "frequency-sqrt")
        log.info("%d %s word classes", classes.num_classes, classes.method)
    return TrainingData(vocab, train_ids, valid_ids, unigram, classes)


def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The epoch's order of positions: ``Generator.permutation(n)``'s, held as uint32 below
    2^32 positions (half the memory: 4 GB instead of 8 GB per process for 1B tokens)."""
    perm = np.arange(n, dtype=np.uint32 if n < 1 << 32 else np.int64)
    np.random.default_rng([seed, epoch]).shuffle(perm)  # the same draws as permutation(n)
    return perm


def batches(perm: np.ndarray, start: int, size: int) -> Iterator[tuple[int, np.ndarray]]:
    """The minibatches of ``size`` positions of ``perm`` from ``start`` on, each with the
    position in ``perm`` after it (where a checkpoint resumes)."""
    for pos in range(start, perm.size, size):
        yield pos + min(size, perm.size - pos), perm[pos : pos + size]
