"""Helpers the test modules share: the shipped dev slice, an in-process server and
``nlmserve serve`` as a subprocess.

Fixtures live in ``conftest.py``; plain functions that modules import live here.
"""

from __future__ import annotations

import gzip
import json
import math
import resource
import subprocess
import sys
import tarfile
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.common.errors import NlmserveError
from nlmserve.common.serve_process import ServerProcess, start_server as start_serve_process
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


def serve_subprocess(model: str | Path, *flags: str, log: Path | None = None, stderr: Any = None,
                     **kwargs: Any) -> ServerProcess:
    """``nlmserve serve --model MODEL --torch-threads 1 FLAGS`` as a real process on 127.0.0.1,
    ready when it returns (``nlmserve.common.serve_process.start_server``: ``port=``, ``metrics_port=0``,
    ``env=``, ``command=`` pass through). Its log goes to ``stderr``, or is appended to the file
    ``log``; a server that does not start is an AssertionError with the end of that log."""
    handle = open(log, "a", encoding="utf-8") if log is not None else None
    try:
        return start_serve_process(model, ["--torch-threads", "1", *flags], stderr=handle or stderr, **kwargs)
    except NlmserveError as e:
        raise AssertionError(f"{e}\n{_log_tail(log, stderr)}") from e
    finally:
        if handle is not None:
            handle.close()


def _log_tail(log: Path | None, stderr: Any) -> str:
    """The last 3000 characters a server logged to the file ``log`` or the readable file ``stderr``."""
    if log is not None:
        return log.read_text(encoding="utf-8", errors="replace")[-3000:]
    if hasattr(stderr, "seek") and stderr.readable():
        stderr.seek(0)
        data = stderr.read()
        return (data.decode("utf-8", "replace") if isinstance(data, bytes) else data)[-3000:]
    return ""


def streamed_tables(lm: Any, chunk_floats: int) -> tuple[Any, np.ndarray]:
    """GetScoringTables of ``lm`` served for real (:func:`start_server`) in chunks of
    ``chunk_floats`` → (the first chunk, the streamed array of little-endian float32)."""
    import grpc

    from nlmserve.proto import lm_pb2, lm_pb2_grpc

    running = start_server(lm)
    try:
        with grpc.insecure_channel(running.target) as channel:
            chunks = list(lm_pb2_grpc.LanguageModelStub(channel).GetScoringTables(
                lm_pb2.GetScoringTablesRequest(chunk_floats=chunk_floats)))
    finally:
        running.stop(1.0)
    return chunks[0], np.frombuffer(b"".join(c.data for c in chunks), dtype="<f4")


# ---------------------------------------------------------------------- the golden model
#: The golden model's words after <unk> = 0, <s> = 1, </s> = 2: a = 3, b = 4, c = 5.
GOLDEN_WORDS = ("a", "b", "c")
LN2, LN3 = math.log(2.0), math.log(3.0)


def golden_model(path: str | Path, objective: str = "nce") -> Path:
    """Write the fixed-weight golden model to ``path`` and return it: V = 6, order 3, D = 2,
    diagonal context, no activation, two classes, NCE (so self-normalised).

    Classes: 0 = {<unk>, <s>, </s>}, 1 = {a, b, c}. With q(w) the context vectors and
    c_j the context weights (oldest first), r(x, y) = c_0 ⊙ q(x) + c_1 ⊙ q(y):

        q(a) = (1, 0), q(b) = (0, 1), q(<unk>) = q(<s>) = q(</s>) = q(c) = (0, 0)
        c_0 = (1, 1), c_1 = (2, 2)                      so r(x, y) = q(x) + 2 q(y)
        class scores  s_c0 = 0,               s_c1 = r · (0, ln 2) + ln 3
                      so exp s_c0 = 1,        exp s_c1 = 3 · 2^r2
        word scores   s_a = r · (ln 2, 0),    s_b = r · (0, ln 2),    every other word 0
                      so exp s_a = 2^r1, exp s_b = 2^r2, exp s_c = exp s_<unk> = exp s_</s> = 1
                      (<s> is masked: exp s_<s> = 0)

    log p(w | h) = s_class(w) - log Σ_k exp s_k + s_w - log Σ_{v in class(w)} exp s_v.
    tests/test_golden_model.py works the probabilities out by hand. ``objective`` "mle"
    writes the same weights as a model that is not self-normalised.
    """
    import torch

    from nlmserve.lm.classes import WordClasses
    from nlmserve.lm.config import ModelConfig
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.vocab import Vocabulary

    word_class = np.array([0, 0, 0, 1, 1, 1])
    config = ModelConfig(vocab_size=6, order=3, dim=2, context="diagonal", activation="none", output="class",
                         num_classes=2)
    net = NeuralLM(config, word_class)
    weights = {
        "embed.weight": [[0, 0], [0, 0], [0, 0], [1, 0], [0, 1], [0, 0]],
        "ctx_weight": [[1, 1], [2, 2]],
        "word_embed": [[0, 0], [0, 0], [0, 0], [LN2, 0], [0, LN2], [0, 0]],
        "word_bias": [0, 0, 0, 0, 0, 0],
        "class_embed": [[0, 0], [0, LN2]],
        "class_bias": [0, LN3],
    }
    state = net.state_dict()
    assert set(state) == set(weights), sorted(state)
    net.load_state_dict({name: torch.tensor(value, dtype=torch.float32) for name, value in weights.items()})
    out = Path(path)
    save_model(out, net, Vocabulary(GOLDEN_WORDS), WordClasses(word_class, "file"), objective=objective,
               training={"note": "hand-set weights (tests/support.py golden_model)"})
    return out


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

    def stats(self) -> dict[str, tuple[int, int, int]]:
        return self.scorer.stats()  # type: ignore[no-any-return]


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


#: The Moses header tree of ../shared/moses-src (its README): enough to compile a feature.
MOSES_TARBALL = REPO.parent / "shared" / "moses-src" / "mosesdecoder-34452895.tar.xz"


def extract_moses_tree(into: Path) -> Path:
    """Extract MOSES_TARBALL into ``into``; returns its ``mosesdecoder`` folder (the caller
    checks that the tarball exists and skips otherwise)."""
    with tarfile.open(MOSES_TARBALL, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(into)  # noqa: S202 - the project's own shared tarball
    return into / "mosesdecoder"


def metric(running: RunningServer, sample: str) -> float:
    """The value of one Prometheus sample (``name{labels}`` as exposed) of a running server, 0 when absent."""
    with urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            key, _, value = line.rpartition(" ")
            if key == sample:
                return float(value)
    return 0.0


async def ended(calls: list[Any]) -> list[tuple[str, str]]:
    """How each grpc.aio call ended, in order: ("OK", "") or its status (code name, details)."""
    import grpc

    out = []
    for call in calls:
        try:
            await call
            out.append(("OK", ""))
        except grpc.aio.AioRpcError as e:
            out.append((e.code().name, e.details() or ""))
    return out


def needs_mallinfo() -> None:
    """Skip the calling test where glibc's ``mallinfo2`` (``common.memory.heap_now``) is missing."""
    from nlmserve.common.memory import heap_now

    if heap_now() is None:
        pytest.skip("needs glibc's mallinfo2")


def heap_per_call(model: Path, calls: int, patterns: str, work: Path) -> tuple[dict[str, Any], str]:
    """``python -m bench.heap_per_call --model M --calls N --patterns P`` run to the end: its
    JSON result and what it printed (the test skips without ``mallinfo2``)."""
    needs_mallinfo()
    out = work / "heap.json"
    done = subprocess.run([sys.executable, "-m", "bench.heap_per_call", "--model", str(model), "--calls", str(calls),
                           "--patterns", patterns, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout


@contextmanager
def open_files(connections: int) -> Iterator[None]:
    """This process's open-files soft limit raised to the hard one, so that it may open
    ``connections`` at once (and 200 more of its own), restored after; a skip where the
    hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < connections + 200:
        pytest.skip(f"the open-files hard limit ({hard}) is below a flood of {connections} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
