"""Add the neural LM's sentence log-probability to every hypothesis of an n-best list.

For each hypothesis ``w1 … wm`` the feature is ``ln p(w1 … wm </s> | <s>)``: the sum of
the natural-log probabilities of its ``m + 1`` n-grams (contexts left-padded with
``<s>``). Hypotheses of several sentences are batched: their n-grams are packed as ids
(``source.vocabulary()``), the distinct ones are scored once (``source.score_ids``) and
summed back per hypothesis.

The scores come from a :class:`ScoreSource`: a server's ``nlmserve.client.LMClient``
(``--server``), a model file scored in this process
(``moses_plugin.model_source.ModelScorer``, ``--model``) or a Kneser-Ney model read by
KenLM (``moses_plugin.kenlm_source.KenlmScorer``, ``--kenlm``). All three go through
the one loop below.

The output is written to ``OUT.partial`` and checkpointed after every batch (the number
of finished sentences and the byte length of the partial output, in
``OUT.progress.json``, written atomically after an fsync of the partial file). A killed
run started again with the same arguments truncates the partial file to the last
checkpoint and continues from there; batches are cut at the same sentences as in an
uninterrupted run, so the finished file is the same byte for byte. It appears at
``OUT`` only when complete (fsync + rename). A dead server is waited for, with
backoff, up to ``wait_server`` seconds, then the client reconnects. A run may be resumed
from another source of the same model (its ``info.model_hash``): a server's and the
model file's are the same.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ..common.errors import InputError, NbestFormatError, NlmserveError, OverloadedError, ServerUnavailableError
from ..wire.ngrams import sentence_windows, word_ids
from ..wire.logbase import is_log10
from ..common.paths import LIST, atomic_output, check_input, check_output, fsync_dir
from .nbest import (
    NbestEntry,
    ReadStats,
    add_feature,
    check_feature_name,
    iter_sentences,
)
from ..common.progress import progress

log = logging.getLogger(__name__)

PROGRESS_VERSION = 1


class NgramScores(Protocol):
    @property
    def log_probs(self) -> np.ndarray: ...


class SourceModel(Protocol):
    @property
    def model_hash(self) -> str: ...


class ScoreSource(Protocol):
    """What rescoring needs of a scorer: the surface of ``nlmserve.client.LMClient`` that
    ``ModelScorer`` and ``KenlmScorer`` also have."""

    @property
    def order(self) -> int: ...

    @property
    def info(self) -> SourceModel: ...

    def vocabulary(self) -> dict[str, int]: ...

    def score_ids(self, ids: np.ndarray, log_base: str = ..., normalized: bool = ...) -> NgramScores: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SourceInfo:
    """``info`` of a source read in this process: the file's model hash and path."""

    model_hash: str
    path: str


@dataclass(frozen=True)
class SourceScores:
    """What ``score_ids`` of a source read in this process returns."""

    log_probs: np.ndarray


def log10_flag(log_base: str) -> bool:
    """``log_base`` ("log10" or "ln") as a flag; InputError otherwise."""
    try:
        return is_log10(log_base)
    except ValueError as e:
        raise InputError(str(e)) from e


@dataclass(frozen=True)
class RescoreConfig:
    """Settings of one rescoring run.

    Fields:
        feature_name: name of the added dense feature (no ``_``: Moses reads it as sparse).
        lowercase: lowercase hypotheses before looking words up (for lowercased models).
        normalized: False: the source's self-normalised scores (an NCE model's s_c + s_w, what
            the Moses feature's ``normalized=false`` adds), not log-probabilities.
        skip_bad: count and skip malformed n-best lines instead of failing.
        batch_ngrams: n-grams (before de-duplication) gathered per batch; a batch always
            ends at a sentence boundary and is one checkpoint.
        request_ngrams: most distinct n-grams sent in one ``score_ids`` request.
        wait_server: seconds to keep retrying (and reconnecting) when the server is gone.
        progress: show progress on stderr (``nlmserve.common.progress``: a bar on a terminal, log
            lines otherwise).
    """

    feature_name: str = "NLM0"
    lowercase: bool = False
    normalized: bool = True
    skip_bad: bool = False
    batch_ngrams: int = 50_000
    request_ngrams: int = 65_536
    wait_server: float = 60.0
    progress: bool = True


@dataclass
class RescoreStats:
    """What a run did: counts, de-duplication and speed (this invocation only for timing)."""

    sentences: int = 0
    hypotheses: int = 0
    ngrams: int = 0
    distinct_ngrams: int = 0
    bad_lines: int = 0
    resumed_sentences: int = 0
    reconnects: int = 0
    seconds: float = 0.0
    model_hash: str = ""
    bad_examples: list[str] = field(default_factory=list)

    @property
    def distinct_share(self) -> float:
        """The share of this invocation's n-grams that were distinct, hence sent to be scored:
        distinct / total (lower means more reuse; 1.0 when there were none)."""
        return self.distinct_ngrams / self.ngrams if self.ngrams else 1.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["distinct_share"] = self.distinct_share
        return out


class SentenceLM:
    """Turns hypotheses into packed n-gram ids and sums scored n-grams per hypothesis."""

    def __init__(self, vocab: dict[str, int], order: int, lowercase: bool) -> None:
        if order < 1:
            raise NlmserveError(f"model order {order} < 1")
        self.vocab = vocab
        self.order = order
        self.lowercase = lowercase

    def ngrams(self, hyps: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All n-grams of ``hyps`` (N, order) uint32, and the hypothesis index of each row."""
        sentences = [word_ids(hyp.split(), self.vocab, lowercase=self.lowercase) for hyp in hyps]
        rows, _, counts = sentence_windows(sentences, self.order, eos=True)
        return rows.astype(np.uint32), np.repeat(np.arange(len(hyps), dtype=np.int64), counts)


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a (N, n) uint32 array and the inverse index."""
    contiguous = np.ascontiguousarray(rows)
    keys = contiguous.view(np.dtype((np.void, contiguous.dtype.itemsize * contiguous.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return contiguous[first], inverse.reshape(-1)


class _Outage:
    """The waits of one call while the server is away: 0.2 s, doubling up to 5 s, until
    ``seconds`` have passed since the call began; then ServerUnavailableError."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.delay = 0.2

    def wait(self, exc: Exception, what: str, then: str) -> None:
        if time.monotonic() + self.delay > self.deadline:
            raise ServerUnavailableError(f"server unreachable for {self.seconds:g} s: {exc}") from exc
        log.warning("%s (%s); %s in %.1f s", what, exc, then, self.delay)
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)


class Connection:
    """A source plus what rescoring derived from it; reconnects with backoff when asked."""

    def __init__(self, connect: Callable[[], ScoreSource], config: RescoreConfig, stats: RescoreStats) -> None:
        self._connect = connect
        self.config = config
        self.stats = stats
        self.client: ScoreSource | None = None
        self.lm: SentenceLM | None = None
        self.model_hash = ""

    def open(self) -> SentenceLM:
        outage = _Outage(self.config.wait_server)
        while True:
            try:
                client = self._connect()
                vocab = client.vocabulary()
                order = int(client.order)
                model_hash = str(client.info.model_hash)
                break
            except (ServerUnavailableError, OverloadedError, ConnectionError, OSError) as exc:
                outage.wait(exc, "server unreachable", "retrying")
        if self.model_hash and model_hash and model_hash != self.model_hash:
            raise NlmserveError(f"the model is now {model_hash}, not {self.model_hash} as when this output was begun; "
                               "rescoring stopped")
        self.model_hash = model_hash or self.model_hash
        self.close()
        self.client = client
        self.lm = SentenceLM(vocab, order, self.config.lowercase)
        return self.lm

    def score(self, ids: np.ndarray) -> np.ndarray:
        """Natural-log probabilities of the rows of ``ids``, retrying through server outages."""
        outage = _Outage(self.config.wait_server)
        while True:
            try:
                if self.client is None:
                    self.open()
                assert self.client is not None
                out = []
                for start in range(0, len(ids), self.config.request_ngrams):
                    chunk = ids[start : start + self.config.request_ngrams]
                    result = self.client.score_ids(chunk, log_base="ln", normalized=self.config.normalized)
                    out.append(np.asarray(result.log_probs, dtype=np.float64))
                return np.concatenate(out) if out else np.zeros(0)
            except (ServerUnavailableError, OverloadedError, ConnectionError, TimeoutError) as exc:
                outage.wait(exc, "server unavailable", "reconnecting")
                self.close()
                self.stats.reconnects += 1

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken channel must not mask the real error
                log.debug("closing the old client failed", exc_info=True)


def score_batch(conn: Connection, groups: Sequence[Sequence[NbestEntry]], stats: RescoreStats) -> list[np.ndarray]:
    """Sentence log-probabilities of every hypothesis, per group."""
    lm = conn.lm if conn.lm is not None else conn.open()
    hyps = [e.hyp for g in groups for e in g]
    rows, owners = lm.ngrams(hyps)
    distinct, inverse = _unique_rows(rows)
    scores = conn.score(distinct) if len(distinct) else np.zeros(0)
    if len(scores) != len(distinct):
        raise NlmserveError(f"server returned {len(scores)} scores for {len(distinct)} n-grams")
    per_hyp = np.bincount(owners, weights=scores[inverse], minlength=len(hyps))
    stats.ngrams += len(rows)
    stats.distinct_ngrams += len(distinct)
    out, pos = [], 0
    for g in groups:
        out.append(per_hyp[pos : pos + len(g)])
        pos += len(g)
    return out


def _batches(groups: Iterator[list[NbestEntry]], batch_ngrams: int) -> Iterator[list[list[NbestEntry]]]:
    batch: list[list[NbestEntry]] = []
    size = 0
    for group in groups:
        batch.append(group)
        size += sum(len(e.hyp.split()) + 1 for e in group)
        if size >= batch_ngrams:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _prefetch(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """Yield ``items`` in order while a thread reads ahead (parsing overlaps scoring).

    Exceptions of the reader are raised here, in order; closing this generator stops it.
    """
    done = object()
    slots: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def read() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        slots.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put((True, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            slots.put((False, exc))

    reader = threading.Thread(target=read, name="nbest-reader", daemon=True)
    reader.start()
    try:
        while True:
            ok, item = slots.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()


class Checkpoint:
    """The sidecar ``OUT.progress.json``: which run it belongs to and how far it got."""

    def __init__(self, out_path: str, identity: dict[str, Any]) -> None:
        self.path = out_path + ".progress.json"
        self.partial = out_path + ".partial"
        self.identity = identity

    def load(self) -> tuple[int, int, str]:
        """(sentences done, bytes of partial output, model hash) to resume from, or zeros."""
        if not (os.path.exists(self.path) and os.path.exists(self.partial)):
            return 0, 0, ""
        try:
            with open(self.path, encoding="utf-8") as handle:
                state = json.load(handle)
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable checkpoint %s (%s)", self.path, exc)
            return 0, 0, ""
        if state.get("identity") != self.identity or state.get("version") != PROGRESS_VERSION:
            log.warning("checkpoint %s is for another run; starting over", self.path)
            return 0, 0, ""
        done, size = int(state["sentences_done"]), int(state["bytes_written"])
        if os.path.getsize(self.partial) < size:
            raise InputError(f"partial output is shorter ({os.path.getsize(self.partial)} bytes) than checkpointed ({size})", self.partial)
        return done, size, str(state.get("model_hash", ""))

    def save(self, done: int, size: int, model_hash: str) -> None:
        state = {"version": PROGRESS_VERSION, "identity": self.identity, "sentences_done": done,
                 "bytes_written": size, "model_hash": model_hash}
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)

    def remove(self) -> None:
        for path in (self.path, self.partial):
            if os.path.exists(path):
                os.remove(path)


def rescore(
    nbest_path: str,
    out_path: str,
    connect: Callable[[], ScoreSource],
    config: RescoreConfig = RescoreConfig(),
    *,
    on_checkpoint: Callable[[int], None] | None = None,
) -> RescoreStats:
    """Rescore ``nbest_path`` into ``out_path`` (resuming a checkpointed earlier run) with
    the scores of ``connect()``'s source (called again to reconnect after an outage).

    ``on_checkpoint(sentences_done)`` is called after each checkpoint is durable.
    """
    check_feature_name(config.feature_name)
    check_output(out_path)
    check_input(nbest_path, LIST)
    if next(iter_sentences(nbest_path, skip_bad=config.skip_bad), None) is None:
        raise InputError("holds no hypotheses" + (" that can be read" if config.skip_bad else "")
                         + ": nothing to rescore", nbest_path)
    stat = os.stat(nbest_path)
    identity = {"input": os.path.abspath(nbest_path), "input_size": stat.st_size, "input_mtime_ns": stat.st_mtime_ns,
                "feature_name": config.feature_name, "lowercase": config.lowercase, "skip_bad": config.skip_bad,
                "batch_ngrams": config.batch_ngrams, **({} if config.normalized else {"normalized": False})}
    checkpoint = Checkpoint(out_path, identity)
    done, size, model_hash = checkpoint.load()
    stats = RescoreStats(resumed_sentences=done)
    conn = Connection(connect, config, stats)
    conn.model_hash = model_hash
    conn.open()
    stats.model_hash = conn.model_hash
    if done:
        log.info("resuming %s after %d sentences (%d bytes)", out_path, done, size)
    read_stats = ReadStats()
    started = time.monotonic()
    mode = "r+b" if done else "wb"
    with _writing(checkpoint.partial):
        out = open(checkpoint.partial, mode)
    with out:
        with _writing(checkpoint.partial):
            out.truncate(size)
            out.seek(size)
        groups = iter_sentences(nbest_path, skip_bad=config.skip_bad, stats=read_stats)
        for _ in range(done):
            if next(groups, None) is None:
                raise InputError(f"checkpoint says {done} sentences were done but the list is shorter", nbest_path)
        bar = _progress_bar(config.progress, done)
        try:
            for batch in _prefetch(_batches(groups, config.batch_ngrams)):
                _check_new_feature(batch, config.feature_name, nbest_path)
                values = score_batch(conn, batch, stats)
                text = "".join(add_feature(e, config.feature_name, [v]) for g, vs in zip(batch, values) for e, v in zip(g, vs))
                with _writing(checkpoint.partial):
                    out.write(text.encode("utf-8"))
                    out.flush()
                    os.fsync(out.fileno())
                done += len(batch)
                stats.sentences += len(batch)
                stats.hypotheses += sum(len(g) for g in batch)
                with _writing(checkpoint.path):
                    checkpoint.save(done, out.tell(), conn.model_hash)
                _advance(bar, len(batch), stats, time.monotonic() - started)
                if on_checkpoint is not None:
                    on_checkpoint(done)
        finally:
            bar.close()
            conn.close()
    with _writing(out_path):
        _finish(checkpoint.partial, out_path)
        checkpoint.remove()
    stats.bad_lines = read_stats.bad_lines
    stats.bad_examples = read_stats.bad_examples
    stats.seconds = time.monotonic() - started
    return stats


def _check_new_feature(batch: list[list[NbestEntry]], name: str, path: str) -> None:
    """Refuse to add ``name`` to lines that have it already (a second ``NLM0=`` would be read
    as one group of two values, or as two features of one name)."""
    for group in batch:
        for entry in group:
            if any(feature == name for feature, _ in entry.dense):
                raise NbestFormatError(f"already has a feature {name}: choose another --feature-name", path, entry.line_no)


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """Turn a failed write (no permission, a directory, a full disk) into an error naming ``path``."""
    try:
        yield
    except NlmserveError:
        raise
    except OSError as exc:
        raise InputError(f"cannot write the output: {exc.strerror or exc}", path) from exc


def _finish(partial: str, out_path: str) -> None:
    """Move the complete partial output to ``out_path`` (gzip when it ends in .gz), atomically."""
    if out_path.endswith(".gz"):
        with open(partial, "rb") as src, atomic_output(out_path) as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    else:
        os.replace(partial, out_path)
        fsync_dir(out_path)


def _progress_bar(enabled: bool, initial: int) -> Any:
    return progress(desc="rescore", unit="sent", logger=log, initial=initial, enabled=enabled, leave=False)


def _advance(bar: Any, n: int, stats: RescoreStats, elapsed: float) -> None:
    """Count ``n`` more sentences, with the speed so far (set first: a log line is written
    by ``update``)."""
    if elapsed > 0:
        bar.set_postfix(ngrams_s=f"{stats.ngrams / elapsed:,.0f}", distinct=f"{stats.distinct_share:.1%}", refresh=False)
    bar.update(n)
