"""Helpers the test modules share: the shipped dev slice and an in-process server.

Fixtures live in ``conftest.py``; plain functions that modules import live here.
"""

from __future__ import annotations

import gzip
import threading
from pathlib import Path
from typing import Any

import numpy as np

from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine

REPO = Path(__file__).resolve().parent.parent
DEV = REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en"


def dev_sentences(start: int, count: int) -> list[str]:
    """The non-empty lines among lines ``start .. start+count-1`` of the shipped dev slice."""
    with open(DEV, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    return [s for s in lines[start : start + count] if s]


def dev_ngrams(lm: Any, start: int, count: int) -> np.ndarray:
    """Every n-gram (T, order) uint32 of those dev sentences, with ``<s>``/``</s>``, as ``lm`` sees them."""
    ids, _, _, _ = lm.sentence_ngrams([s.split() for s in dev_sentences(start, count)])
    return np.asarray(ids, dtype=np.uint32)


def start_server(lm: Any, **overrides: Any) -> RunningServer:
    """A real gRPC server on 127.0.0.1 (port 0 unless ``port`` is given) over an engine of ``lm``."""
    fields: dict[str, Any] = {"model": "(in-process)", "port": 0, **overrides}
    config = ServerConfig(**fields)
    return create_server(config, engine=Engine(lm, config))


NEWS_NBEST = REPO / "data" / "nbest" / "newstest-fr-en" / "newstest2013.300.nbest.gz"


def nbest_head(out: Path, sentences: int, source: Path = NEWS_NBEST) -> Path:
    """The first ``sentences`` sentences of a real Moses n-best list, written to ``out`` (gzip)."""
    from nlmserve.moses_plugin.nbest import iter_sentences

    lines: list[str] = []
    for group in iter_sentences(source):
        if group[0].sent_id >= sentences:
            break
        lines += [e.raw for e in group]
    with gzip.open(out, "wt", encoding="utf-8") as handle:
        handle.write("".join(lines))
    return out


class GatedScorer:
    """The real scorer behind a gate the test opens, to hold the batching thread busy."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.rows_scored = 0

    def score(self, ids: np.ndarray, normalized: np.ndarray) -> np.ndarray:
        self.entered.set()
        self.gate.wait(10)
        self.rows_scored += len(ids)
        return self.scorer.score(ids, normalized)  # type: ignore[no-any-return]


# A bigram ARPA file small enough to work out by hand (tests of the KenLM paths).
TINY_ARPA = """\\data\\
ngram 1=5
ngram 2=4

\\1-grams:
-1.0\t<unk>\t0
-99\t<s>\t-0.30103
-0.5\t</s>\t0
-0.69897\tthe\t-0.2
-0.60206\tof\t-0.1

\\2-grams:
-0.22185\t<s> the
-0.39794\tthe of
-0.30103\tof </s>
-0.52288\tthe </s>

\\end\\
"""

TINY_ARPA_TEXT = "the of the\nof zebra\n"
# By hand, log10 P per token (</s> included), OOV flag:
#   "the of the </s>": the|<s> bigram -0.22185; of|the bigram -0.39794;
#       the|of no bigram: backoff(of) + P(the) = -0.1 - 0.69897; </s>|the bigram -0.52288.
#   "of zebra </s>": of|<s> no bigram: backoff(<s>) + P(of) = -0.30103 - 0.60206;
#       zebra is OOV: backoff(of) + P(<unk>) = -0.1 - 1.0; </s>|<unk>: backoff(<unk>) 0 + P(</s>) -0.5.
TINY_ARPA_GOLDEN = [-0.22185, -0.39794, -0.79897, -0.52288, -0.90309, -1.1, -0.5]
TINY_ARPA_GOLDEN_OOV = [False, False, False, False, False, True, False]
