"""The scoring service against a real gRPC server on 127.0.0.1 (port 0), the tiny real model.

Reference values come from the in-process ``tiny_lm`` (nlmserve.lm.scoring); n-grams come
from real held-out Europarl sentences.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nlmserve.common.errors import InputError, InvalidRequestError, UsageError
from nlmserve.common.memory import heap_now
from nlmserve.cli import main
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig, build_config
from nlmserve.server.engine import Engine

from support import GatedScorer, dev_ngrams, dev_sentences, start_server

TOL = 1e-5


def start(lm: Any, **overrides: Any) -> RunningServer:
    return start_server(lm, metrics_port=0, **overrides)


@pytest.fixture(scope="module")
def server(tiny_lm: Any) -> Iterator[RunningServer]:
    running = start(tiny_lm)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[lm_pb2_grpc.LanguageModelStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield lm_pb2_grpc.LanguageModelStub(channel)


@pytest.fixture(scope="module")
def dev_ids(tiny_lm: Any) -> np.ndarray:
    """All n-grams (T, order) of 40 real dev sentences, as the model sees them."""
    return dev_ngrams(tiny_lm, 100, 40)


def packed(ids: np.ndarray, **kw: Any) -> lm_pb2.ScoreNgramsRequest:
    return lm_pb2.ScoreNgramsRequest(packed_ids=ids.astype("<u4").tobytes(), packed_order=ids.shape[1], **kw)


def strings(ngrams: list[list[str]], **kw: Any) -> lm_pb2.ScoreNgramsRequest:
    return lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=ng) for ng in ngrams], **kw)


def metric(running: RunningServer, line_prefix: str) -> float:
    """A sample's value from the live /metrics endpoint (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == line_prefix:
            return float(value)
    return 0.0


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("log_base", ["LN", "LOG10", "LOG_BASE_UNSPECIFIED"])
@pytest.mark.parametrize("normalized", [True, False])
def test_packed_ids_equal_in_process(stub: Any, tiny_lm: Any, dev_ids: np.ndarray, log_base: str, normalized: bool) -> None:
    resp = stub.ScoreNgrams(packed(dev_ids, log_base=lm_pb2.LogBase.Value(log_base), allow_unnormalized=not normalized))
    want = tiny_lm.score_ngrams(dev_ids, normalized=normalized, log10=log_base != "LN")
    got = np.asarray(resp.log_probs, dtype=np.float32)
    assert got.shape == want.shape == (len(dev_ids),)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert resp.normalized is normalized  # the tiny model is NCE: self-normalised
    assert resp.log_base == (lm_pb2.LN if log_base == "LN" else lm_pb2.LOG10)
    assert resp.model_hash == tiny_lm.model_hash
    assert list(resp.oov) == (dev_ids[:, -1] == 0).tolist()
    if not normalized:  # really unnormalised: differs from the normalised values
        assert np.abs(got - tiny_lm.score_ngrams(dev_ids, log10=log_base != "LN")).max() > 1e-3


def test_strings_with_oov_and_short_contexts_equal_in_process(stub: Any, tiny_lm: Any) -> None:
    words = " ".join(dev_sentences(200, 20)).split()
    rng = np.random.default_rng(3)
    ngrams = []
    for i in range(300):
        n = int(rng.integers(1, tiny_lm.order + 1))
        pos = int(rng.integers(0, len(words) - n))
        ngrams.append(words[pos : pos + n])
    ngrams += [["zyzzyvaqq"], ["the", "qqqunknownqqq"], ["qqqunknownqqq", "the"], ["<s>", "the"], ["</s>"]]
    resp = stub.ScoreNgrams(strings(ngrams))
    oov = np.array([ng[-1] not in tiny_lm.vocab for ng in ngrams])
    assert oov[-5:].tolist() == [True, True, False, False, False]
    assert oov[:300].sum() > 0  # real held-out text has unknown words
    want = np.array([tiny_lm.score_ngrams(np.array([tiny_lm.vocab.encode(ng)]), log10=True)[0] for ng in ngrams])
    np.testing.assert_allclose(np.asarray(resp.log_probs), want, atol=TOL, rtol=0)
    assert list(resp.oov) == oov.tolist()


def test_strings_are_lowercased_only_for_lowercased_models(stub: Any, tiny_lm: Any) -> None:
    resp = stub.ScoreNgrams(strings([["The", "European"], ["the", "european"]]))
    if tiny_lm.lowercase:
        assert resp.log_probs[0] == resp.log_probs[1] and list(resp.oov) == [False, False]
    else:
        assert list(resp.oov) == [True, False]


def test_bos_padding_is_equivalent(stub: Any, tiny_lm: Any) -> None:
    the = tiny_lm.vocab.id("the")
    variants = [["the"], ["<s>", "the"], ["<s>", "<s>", "the"], ["<s>", "<s>", "<s>", "<s>", "the"]]
    resp = stub.ScoreNgrams(strings(variants))
    assert np.ptp(np.asarray(resp.log_probs)) < 1e-6
    # packed with a shorter packed_order, and everything left of the newest <s> ignored
    for rows in ([[the]], [[1, the]], [[1, 1, 1, 1, the]], [[7, 9, 1, 1, the]], [[7, 1, 9, 1, the]]):
        r = stub.ScoreNgrams(packed(np.array(rows, dtype=np.uint32)))
        assert r.log_probs[0] == pytest.approx(resp.log_probs[0], abs=1e-6)
    r = stub.ScoreNgrams(packed(np.array([[7, 1, 9, the]], dtype=np.uint32)))
    r2 = stub.ScoreNgrams(packed(np.array([[1, 9, the]], dtype=np.uint32)))
    assert r.log_probs[0] == pytest.approx(r2.log_probs[0], abs=1e-6)
    assert abs(r.log_probs[0] - resp.log_probs[0]) > 1e-4


@pytest.mark.parametrize("bos", [True, False])
@pytest.mark.parametrize("eos", [True, False])
def test_sentences_equal_in_process(stub: Any, tiny_lm: Any, bos: bool, eos: bool) -> None:
    sentences = dev_sentences(300, 15) + ["", "qqqunknownqqq europe"]
    resp = stub.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=sentences, bos=bos, eos=eos))
    want = tiny_lm.score_sentences([s.split() for s in sentences], bos=bos, eos=eos, log10=True)
    assert len(resp.sentences) == len(sentences)
    for got, ref in zip(resp.sentences, want):
        np.testing.assert_allclose(np.asarray(got.token_log_probs), ref.token_log_probs, atol=TOL, rtol=0)
        assert list(got.oov) == ref.oov.tolist()
        assert list(got.ngram_lengths) == ref.ngram_lengths.tolist()
        assert got.total == pytest.approx(ref.total, abs=1e-4)
    assert resp.model_hash == tiny_lm.model_hash
    assert list(resp.sentences[-1].oov)[:2] == [True, False]
    assert len(resp.sentences[-2].token_log_probs) == int(eos)


def test_sentences_ln_and_defaults(stub: Any, tiny_lm: Any) -> None:
    s = dev_sentences(10, 1)[0]
    ln = stub.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=[s], log_base=lm_pb2.LN))
    log10 = stub.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=[s]))  # bos, eos, LOG10 by default
    assert log10.log_base == lm_pb2.LOG10 and ln.log_base == lm_pb2.LN
    assert ln.sentences[0].total == pytest.approx(log10.sentences[0].total * np.log(10), abs=1e-4)
    assert len(log10.sentences[0].token_log_probs) == len(s.split()) + 1


def test_model_info_and_vocabulary(stub: Any, tiny_lm: Any, server: RunningServer) -> None:
    info = stub.GetModelInfo(lm_pb2.GetModelInfoRequest())
    assert (info.order, info.vocab_size, info.model_hash) == (tiny_lm.order, len(tiny_lm.vocab), tiny_lm.model_hash)
    assert (info.bos_id, info.eos_id, info.unk_id) == (1, 2, 0)
    assert info.objective == "nce" and info.output_type == "class" and info.self_normalized
    assert info.num_classes == tiny_lm.num_classes and info.device == "cpu"
    assert info.max_ngrams_per_request == server.config.max_ngrams_per_request
    chunks = list(stub.GetVocabulary(lm_pb2.GetVocabularyRequest(chunk_size=100)))
    assert [c.offset for c in chunks] == list(range(0, len(tiny_lm.vocab), 100))
    assert [w for c in chunks for w in c.words] == tiny_lm.vocab.words


# ------------------------------------------------------------------ errors
BAD_REQUESTS = {
    "longer than order": (strings([["the"], ["a", "b", "c", "d", "e", "f"]]), "INVALID_ARGUMENT", "item 1"),
    "<s> predicted": (strings([["the"], ["the"], ["the", "<s>"]]), "INVALID_ARGUMENT", "item 2"),
    "<s> predicted packed": (packed(np.array([[4, 5], [4, 1]], dtype=np.uint32)), "INVALID_ARGUMENT", "item 1"),
    "empty n-gram": (strings([["the"], []]), "INVALID_ARGUMENT", "item 1"),
    "ragged packed bytes": (lm_pb2.ScoreNgramsRequest(packed_ids=b"\x01\x00\x00\x00\x02", packed_order=1),
                            "INVALID_ARGUMENT", "multiple of 4"),
    "packed without order": (lm_pb2.ScoreNgramsRequest(packed_ids=b"\x04\x00\x00\x00"), "INVALID_ARGUMENT",
                             "packed_order"),
    "id out of range": (packed(np.array([[4, 5], [4, 10**6]], dtype=np.uint32)), "INVALID_ARGUMENT", "item 1"),
    "both forms": (lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["a"])], packed_ids=b"\4\0\0\0",
                                             packed_order=1), "INVALID_ARGUMENT", "either"),
    "strings with packed_order": (lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["a"])], packed_order=1),
                                  "INVALID_ARGUMENT", "either"),
    "oversized": (packed(np.full((5000, 2), 4, dtype=np.uint32)), "INVALID_ARGUMENT", "max_ngrams_per_request = 4096"),
}


@pytest.fixture(scope="module")
def small_server(tiny_lm: Any) -> Iterator[RunningServer]:
    running = start(tiny_lm, max_ngrams_per_request=4096, max_queue_ngrams=8192)
    yield running
    running.stop(1.0)


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_status_and_next_is_served(small_server: RunningServer, tiny_lm: Any, case: str) -> None:
    request, code, text = BAD_REQUESTS[case]
    with grpc.insecure_channel(small_server.target) as channel:
        s = lm_pb2_grpc.LanguageModelStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            s.ScoreNgrams(request)
        assert err.value.code().name == code
        assert text in err.value.details()
        ok = s.ScoreNgrams(strings([["the", "european"]]))
        assert ok.log_probs[0] == pytest.approx(
            tiny_lm.score_ngrams(np.array([tiny_lm.vocab.encode(["the", "european"])]), log10=True)[0], abs=TOL)


@pytest.mark.parametrize("rpc", ["ScoreNgrams", "ScoreSentences", "GetModelInfo", "GetVocabulary"])
def test_requests_that_do_not_parse_are_invalid_argument(small_server: RunningServer, rpc: str) -> None:
    # field 1, length-delimited, holding a string with a stray byte (invalid UTF-8); for
    # ScoreNgrams the string sits inside an NgramStrings message.
    bad_string = b"\x0a\x04the\xff"
    data = {"ScoreNgrams": b"\x0a" + bytes([len(bad_string)]) + bad_string, "ScoreSentences": bad_string,
            "GetModelInfo": b"\xff\xff\xff", "GetVocabulary": b"\x08"}[rpc]  # last: a truncated varint
    with grpc.insecure_channel(small_server.target) as channel:
        path = f"/nlmserve.v1.LanguageModel/{rpc}"
        with pytest.raises(grpc.RpcError) as err:
            if rpc == "GetVocabulary":
                list(channel.unary_stream(path)(data, timeout=10))
            else:
                channel.unary_unary(path)(data, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not parse" in err.value.details()
        ok = lm_pb2_grpc.LanguageModelStub(channel).ScoreNgrams(strings([["the", "european"]]))
        assert len(ok.log_probs) == 1


def test_bad_sentences(small_server: RunningServer) -> None:
    with grpc.insecure_channel(small_server.target) as channel:
        s = lm_pb2_grpc.LanguageModelStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            s.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["the", "a <s> b"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "item 1" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            s.ScoreSentences(lm_pb2.ScoreSentencesRequest(sentences=["the " * 3000] * 2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4096" in err.value.details()


def test_message_size_limit_is_enforced(tiny_lm: Any) -> None:
    running = start(tiny_lm, max_message_bytes=64 * 1024)
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                s.ScoreNgrams(packed(np.full((20000, 2), 4, dtype=np.uint32)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(s.ScoreNgrams(packed(np.full((2000, 2), 4, dtype=np.uint32))).log_probs) == 2000
    finally:
        running.stop(1.0)


# ------------------------------------------------------------------ concurrency and batching
def test_concurrent_clients_get_their_own_answers(server: RunningServer, tiny_lm: Any, dev_ids: np.ndarray) -> None:
    n_threads = 12
    slices = [dev_ids[i::n_threads][: 20 + 7 * i] for i in range(n_threads)]
    wants = [tiny_lm.score_ngrams(s, log10=True) for s in slices]
    errors: list[str] = []
    barrier = threading.Barrier(n_threads)

    def client(i: int) -> None:
        with grpc.insecure_channel(server.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            barrier.wait()
            for _ in range(10):
                got = np.asarray(s.ScoreNgrams(packed(slices[i])).log_probs)
                if got.shape != wants[i].shape or np.abs(got - wants[i]).max() > TOL:
                    errors.append(f"client {i}: wrong answer")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_micro_batching_merges_concurrent_requests(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    """Requests that queue while a forward pass runs are answered by one merged pass, each
    client getting its own rows back. The pass in progress is held at a gate until all the
    clients' requests are queued, so the merge does not depend on how the threads are scheduled."""
    running = start(tiny_lm)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    n_threads = 16
    rows = [dev_ids[3 * i: 3 * i + 1 + i % 3] for i in range(n_threads)]  # 1 to 3 n-grams each
    got: dict[int, np.ndarray] = {}
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            # Larger than a lone request scored inline, so the batching thread takes it.
            holder = s.ScoreNgrams.future(packed(dev_ids[:100]))  # the pass held at the gate
            assert gated.entered.wait(5)

            def client(i: int) -> None:
                got[i] = np.asarray(s.ScoreNgrams(packed(rows[i])).log_probs)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(n_threads)]
            for t in threads:
                t.start()
            queued = sum(len(r) for r in rows)
            deadline = time.monotonic() + 10
            while running.engine.queue_depth() < queued and time.monotonic() < deadline:
                time.sleep(0.01)
            assert running.engine.queue_depth() == queued
            gated.gate.set()
            for t in threads:
                t.join(10)
            holder.result(10)
        for i in range(n_threads):
            np.testing.assert_allclose(got[i], tiny_lm.score_ngrams(rows[i], log10=True), atol=TOL, rtol=0)
        assert metric(running, "nlmserve_batch_requests_count") == 2  # the held pass, then one merged pass
        assert metric(running, "nlmserve_batch_requests_sum") == 1 + n_threads
        assert metric(running, 'nlmserve_batch_requests_bucket{le="1.0"}') == 1
        assert metric(running, "nlmserve_batch_size_ngrams_sum") == 100 + queued
    finally:
        gated.gate.set()
        running.stop(1.0)


@pytest.mark.parametrize("log10", [False, True])
@pytest.mark.parametrize("normalized", [True, False])
def test_a_lone_small_request_is_scored_in_the_callers_thread(tiny_lm: Any, dev_ids: np.ndarray, log10: bool,
                                                               normalized: bool) -> None:
    engine = Engine(tiny_lm, ServerConfig(model="(in-process)"))
    try:
        rows = dev_ids[:16]
        now = engine.try_score_now(rows, normalized=normalized, log10=log10)
        assert now is not None and now.dtype == np.float32
        np.testing.assert_array_equal(now, engine.score_ngrams(rows, normalized=normalized, log10=log10))
        np.testing.assert_allclose(now, tiny_lm.score_ngrams(rows, normalized=normalized, log10=log10),
                                   atol=TOL, rtol=0)
        with pytest.raises(InvalidRequestError, match="item 1"):
            engine.try_score_now(np.array([[4, 5], [4, 10**6]], dtype=np.uint32))
        # a forward pass running (or parts queued): the caller must queue instead
        with engine._cond:
            engine._busy = True
        assert engine.try_score_now(rows) is None
        with engine._cond:
            engine._busy = False
            engine._cond.notify()
        assert engine.try_score_now(rows) is not None
    finally:
        engine.shutdown()
    assert engine.try_score_now(dev_ids[:1]) is None  # stopped


def test_a_lone_client_over_grpc_skips_the_queue(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    running = start(tiny_lm)
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            s.GetModelInfo(lm_pb2.GetModelInfoRequest())
            passes = metric(running, "nlmserve_batch_requests_count")
            waited = metric(running, "nlmserve_queue_delay_seconds_sum")
            got = []
            for i in range(20):
                # a pause longer than a one-row pass takes, even on a loaded machine: a lone
                # client, not one of a crowd whose requests follow each other back to back
                time.sleep(0.05)
                got.append(s.ScoreNgrams(packed(dev_ids[i : i + 1], log_base=lm_pb2.LN)).log_probs[0])
            # scored in the event-loop thread: each counted as a pass that waited exactly 0 s
            assert metric(running, "nlmserve_batch_requests_count") - passes == 20
            assert metric(running, "nlmserve_queue_delay_seconds_sum") == waited
            big = s.ScoreNgrams(packed(dev_ids[:100], log_base=lm_pb2.LN)).log_probs  # over 16 rows: queued
            assert metric(running, "nlmserve_queue_delay_seconds_sum") > waited
        np.testing.assert_allclose(got, tiny_lm.score_ngrams(dev_ids[:20]), atol=TOL, rtol=0)
        np.testing.assert_allclose(big, tiny_lm.score_ngrams(dev_ids[:100]), atol=TOL, rtol=0)
    finally:
        running.stop(1.0)


def test_large_request_is_split_into_batches(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    running = start(tiny_lm, max_batch_ngrams=100)
    try:
        with grpc.insecure_channel(running.target) as channel:
            got = lm_pb2_grpc.LanguageModelStub(channel).ScoreNgrams(packed(dev_ids[:950], log_base=lm_pb2.LN))
        np.testing.assert_allclose(np.asarray(got.log_probs), tiny_lm.score_ngrams(dev_ids[:950]), atol=TOL, rtol=0)
        assert metric(running, "nlmserve_batch_size_ngrams_count") == 10
        assert metric(running, 'nlmserve_batch_size_ngrams_bucket{le="128.0"}') == 10
    finally:
        running.stop(1.0)


def test_a_refused_request_leaves_none_of_its_arrays_behind(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    """A request refused by the full queue keeps nothing of its own once its call has ended.
    gRPC keeps the abort's exception with the call's state until the server's next call; the
    servicer raised it inside its except block, chained to the refusal, whose frames held
    the request's rows: after a burst of 32 requests of 100,000 n-grams, 22 of them refused,
    the server stayed 114 MB larger, 12 MB once the abort moved out of the block."""
    import gc

    from nlmserve.server.engine import _Request

    running = start(tiny_lm, max_ngrams_per_request=700, max_queue_ngrams=1000)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            first = s.ScoreNgrams.future(packed(dev_ids[:600]))  # taken by the worker, held at the gate
            assert gated.entered.wait(5)
            second = s.ScoreNgrams.future(packed(dev_ids[:400]))  # queued: 400 of 1000
            deadline = time.monotonic() + 5
            while running.engine.queue_depth() < 400 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as err:
                s.ScoreNgrams(packed(dev_ids[:700]))  # 400 + 700 > 1000: refused at once
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.value.details()
            gated.gate.set()
            assert len(first.result(10).log_probs) == 600 and len(second.result(10).log_probs) == 400
        gc.collect()
        kept = [o for o in gc.get_objects() if type(o) is _Request and o.out.shape == (700,)]
        assert kept == []
    finally:
        running.stop(1.0)


def test_overload_gets_resource_exhausted_then_recovers(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    running = start(tiny_lm, max_ngrams_per_request=1000, max_queue_ngrams=1500)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    rows = dev_ids[:1000]
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            first = s.ScoreNgrams.future(packed(rows))  # taken by the worker, held at the gate
            assert gated.entered.wait(5)
            second = s.ScoreNgrams.future(packed(rows))  # queued: 1000 of 1500
            deadline = time.monotonic() + 5
            while running.engine.queue_depth() < 1000 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as err:
                s.ScoreNgrams(packed(rows))  # 2000 > 1500: refused at once
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue full" in err.value.details()
            gated.gate.set()
            want = tiny_lm.score_ngrams(rows, log10=True)
            for fut in (first, second):
                np.testing.assert_allclose(np.asarray(fut.result(10).log_probs), want, atol=TOL, rtol=0)
            np.testing.assert_allclose(np.asarray(s.ScoreNgrams(packed(rows)).log_probs), want, atol=TOL, rtol=0)
        assert metric(running, 'nlmserve_requests_total{code="RESOURCE_EXHAUSTED",rpc="ScoreNgrams"}') == 1
    finally:
        gated.gate.set()
        running.stop(1.0)


def test_requests_whose_deadline_passed_in_the_queue_are_dropped(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    running = start(tiny_lm)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            first = s.ScoreNgrams.future(packed(dev_ids[:10]))
            assert gated.entered.wait(5)
            with pytest.raises(grpc.RpcError) as err:
                s.ScoreNgrams(packed(dev_ids[:500]), timeout=0.2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gated.gate.set()
            assert len(first.result(10).log_probs) == 10
            assert len(s.ScoreNgrams(packed(dev_ids[:3])).log_probs) == 3
        assert gated.rows_scored == 13  # the expired 500 were never computed
    finally:
        gated.gate.set()
        running.stop(1.0)


# ------------------------------------------------------------------ caches
def test_caches_hit_and_equal_uncached_values(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    running = start(tiny_lm, ngram_cache_size=100_000, context_cache_size=10_000)
    try:
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            for normalized in (True, False):
                want = tiny_lm.score_ngrams(dev_ids, normalized=normalized)
                for _ in range(2):  # cold, then warm
                    got = s.ScoreNgrams(packed(dev_ids, log_base=lm_pb2.LN, allow_unnormalized=not normalized))
                    np.testing.assert_allclose(np.asarray(got.log_probs), want, atol=TOL, rtol=0)
            # same contexts, other predicted words: context-cache hits, n-gram cache misses
            shifted = dev_ids.copy()
            shifted[:, -1] = np.where(shifted[:, -1] + 1 == 1, 3, shifted[:, -1] + 1) % len(tiny_lm.vocab)
            shifted[shifted[:, -1] == 1, -1] = 3
            got = s.ScoreNgrams(packed(shifted, log_base=lm_pb2.LN))
            np.testing.assert_allclose(np.asarray(got.log_probs), tiny_lm.score_ngrams(shifted), atol=TOL, rtol=0)
        n = len(dev_ids)
        assert metric(running, 'nlmserve_cache_hits_total{cache="ngram"}') >= 2 * n
        assert metric(running, 'nlmserve_cache_hits_total{cache="context"}') > 0
        assert metric(running, 'nlmserve_cache_hits_total{cache="in_class"}') > 0
        assert metric(running, 'nlmserve_cache_misses_total{cache="ngram"}') >= n
        assert metric(running, 'nlmserve_cache_entries{cache="ngram"}') > 0
    finally:
        running.stop(1.0)


def test_context_cache_alone_equals_direct_path(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    from nlmserve.lm.cache import Scorer
    from nlmserve.wire.ngrams import canonical_rows

    rows = canonical_rows(dev_ids.astype(np.int64), tiny_lm.order, len(tiny_lm.vocab))
    mixed = np.arange(len(rows)) % 3 == 0  # normalised and unnormalised rows in one batch
    direct = Scorer(tiny_lm, 0, 0).score(rows, mixed)
    cached = Scorer(tiny_lm, 0, 64)  # small: evictions happen
    for _ in range(2):
        np.testing.assert_allclose(cached.score(rows, mixed), direct, atol=TOL, rtol=0)
    assert cached.context_cache.hits > 0 and len(cached.context_cache) == 64
    want = np.where(mixed, tiny_lm.score_ngrams(dev_ids), tiny_lm.score_ngrams(dev_ids, normalized=False))
    np.testing.assert_allclose(direct, want, atol=TOL, rtol=0)


# ------------------------------------------------------------------ operations
def test_metrics_change_as_requests_are_served(server: RunningServer, stub: Any, dev_ids: np.ndarray, tiny_lm: Any) -> None:
    ok = 'nlmserve_requests_total{code="OK",rpc="ScoreNgrams"}'
    bad = 'nlmserve_requests_total{code="INVALID_ARGUMENT",rpc="ScoreNgrams"}'
    before = {k: metric(server, k) for k in (ok, bad, "nlmserve_ngrams_scored_total", "nlmserve_batch_size_ngrams_count")}
    stub.ScoreNgrams(packed(dev_ids[:77]))
    stub.ScoreNgrams(packed(dev_ids[:23]))
    with pytest.raises(grpc.RpcError):
        stub.ScoreNgrams(strings([[]]))
    assert metric(server, ok) == before[ok] + 2
    assert metric(server, bad) == before[bad] + 1
    assert metric(server, "nlmserve_ngrams_scored_total") == before["nlmserve_ngrams_scored_total"] + 100
    assert metric(server, "nlmserve_batch_size_ngrams_count") == before["nlmserve_batch_size_ngrams_count"] + 2
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert f'model_hash="{tiny_lm.model_hash}"' in text and 'order="5"' in text and 'device="cpu"' in text
    for name in ("nlmserve_queue_delay_seconds_bucket", "nlmserve_inference_seconds_bucket",
                 "nlmserve_in_flight_requests", "nlmserve_queue_depth_ngrams", "nlmserve_model_info"):
        assert name in text
    assert all(line.startswith(("#", "nlmserve_")) for line in text.splitlines() if line)


def test_metrics_report_the_heap_and_the_process(server: RunningServer) -> None:
    """nlmserve_heap_bytes follows malloc: 64 MiB held by the server's process show as in
    use (and resident) at the next scrape, and are gone from it once freed."""
    if heap_now() is None:
        pytest.skip("needs glibc's mallinfo2")
    in_use = 'nlmserve_heap_bytes{state="in_use"}'
    size = 64 << 20
    before = metric(server, in_use)
    held = bytearray(size)  # the server runs in this process: its malloc is ours
    during = metric(server, in_use), metric(server, "nlmserve_process_resident_memory_bytes")
    del held
    after = metric(server, in_use)
    # Within 1/16: the server's own blocks come and go between two scrapes (464 bytes fewer once).
    assert before > 0 and abs(during[0] - before - size) < size / 16, (before, during)
    assert during[1] >= size
    assert abs(after - before) < size / 8, (before, after)
    assert metric(server, 'nlmserve_heap_bytes{state="free"}') >= 0
    assert metric(server, "nlmserve_process_open_fds") > 0


def test_health_is_serving(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        h = health_pb2_grpc.HealthStub(channel)
        for service in ("", "nlmserve.v1.LanguageModel"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        r = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"nlmserve.v1.LanguageModel", "grpc.health.v1.Health"} <= names


def test_config_from_toml_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text('[server]\nmodel = "m.nlm"\nport = 6000\nmax_batch_ngrams = 512\nngram_cache_size = 10\n')
    c = build_config({"port": 7000, "max_delay_us": None}, f)
    assert (c.model, c.port, c.max_batch_ngrams, c.ngram_cache_size, c.host) == ("m.nlm", 7000, 512, 10, "127.0.0.1")
    f.write_text("model = 'm.nlm'\nmax_batch = 5\n")
    with pytest.raises(InputError, match="serve.toml.*max_batch"):
        build_config({}, f)
    f.write_text("model = 'm.nlm'\nport = [\n")
    with pytest.raises(InputError, match="serve.toml.*invalid TOML"):
        build_config({}, f)
    # a flag's bad value is a usage error (exit 2, as argparse's); the file's names the file
    with pytest.raises(UsageError, match="max_queue_ngrams"):
        build_config({"model": "m", "max_queue_ngrams": 10, "max_ngrams_per_request": 100})
    f.write_text("model = 'm.nlm'\nport = -1\n")
    with pytest.raises(InputError, match="serve.toml.*bad server setting"):
        build_config({"host": "127.0.0.1"}, f)
    f.write_text("model = 'm.nlm'\n")
    with pytest.raises(UsageError, match="bad server setting"):
        build_config({"port": -1}, f)


def test_a_bad_flag_value_exits_2(tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tiny_model_path), "--port", "-1"]) == 2
    assert "bad server setting" in capsys.readouterr().err


def test_stop_drains_and_health_watchers_see_not_serving(tiny_lm: Any, dev_ids: np.ndarray) -> None:
    running = start(tiny_lm)
    gated = GatedScorer(running.engine.scorer)
    running.engine.scorer = gated  # type: ignore[assignment]
    with grpc.insecure_channel(running.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        in_flight = lm_pb2_grpc.LanguageModelStub(channel).ScoreNgrams.future(packed(dev_ids[:50]))
        assert gated.entered.wait(5)
        stopper = threading.Thread(target=running.stop, args=(10.0,))
        t0 = time.monotonic()
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # an open stream would hold the drain for the whole grace period
        deadline = time.monotonic() + 5
        while not running.servicer.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:  # a new request during the drain is refused
            lm_pb2_grpc.LanguageModelStub(channel).ScoreNgrams(packed(dev_ids[:5]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (err.value.details() or "")
        gated.gate.set()  # the in-flight request finishes during the drain
        np.testing.assert_allclose(np.asarray(in_flight.result(10).log_probs),
                                   tiny_lm.score_ngrams(dev_ids[:50], log10=True), atol=TOL, rtol=0)
        stopper.join(15)
        assert not stopper.is_alive() and not running.engine.check_health()
    assert time.monotonic() - t0 < 8  # drained when the work was done, not at the grace deadline


def test_stop_keeps_connections_open_while_a_large_answer_settles(tiny_lm: Any) -> None:
    """gRPC closes a connection once its last answer is written to the socket; a client still
    reading a large answer would then be reset and lose its tail. The drain waits
    SETTLE_SECONDS after an answer beyond the initial flow-control window, not after a small one."""
    from nlmserve.server.app import SETTLE_SECONDS
    from nlmserve.server.servicer import INITIAL_WINDOW_BYTES

    rng = np.random.default_rng(3)
    large = rng.integers(3, len(tiny_lm.vocab), size=(INITIAL_WINDOW_BYTES // 4 + 1000, tiny_lm.order))
    for ids, settles in ((large, True), (large[:20], False)):
        running = start(tiny_lm)
        with grpc.insecure_channel(running.target) as channel:
            resp = lm_pb2_grpc.LanguageModelStub(channel).ScoreNgrams(packed(ids))
            assert resp.ByteSize() > INITIAL_WINDOW_BYTES if settles else resp.ByteSize() < INITIAL_WINDOW_BYTES
            assert len(resp.log_probs) == len(ids)
            answered = running.servicer.large_answer_at
            running.stop(10.0)
            if settles:
                assert time.monotonic() >= answered + SETTLE_SECONDS
            else:
                assert answered == 0.0  # nothing to wait for


@pytest.fixture(scope="module")
def softmax_mle_model(tmp_path_factory: pytest.TempPathFactory, tiny_lm: Any) -> Path:
    """A full-softmax, MLE-objective (not self-normalised) model over the tiny vocabulary, random weights."""
    import torch

    from nlmserve.lm.config import ModelConfig
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.model_file import save_model

    torch.manual_seed(11)
    net = NeuralLM(ModelConfig(vocab_size=len(tiny_lm.vocab), order=3, dim=8, output="softmax"))
    path = tmp_path_factory.mktemp("softmax") / "softmax.nlm"
    save_model(path, net, tiny_lm.vocab, None, objective="mle", lowercase=False)
    return path


@pytest.mark.parametrize("caches", [0, 1000])
def test_softmax_mle_model_is_served_normalised(softmax_mle_model: Path, caches: int) -> None:
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(softmax_mle_model, device="cpu")
    config = ServerConfig(model=str(softmax_mle_model), port=0, ngram_cache_size=caches, context_cache_size=caches)
    running = create_server(config)  # loads the file itself, as `nlmserve serve` does
    try:
        ids = dev_ngrams(lm, 50, 20)
        with grpc.insecure_channel(running.target) as channel:
            s = lm_pb2_grpc.LanguageModelStub(channel)
            info = s.GetModelInfo(lm_pb2.GetModelInfoRequest())
            assert (info.output_type, info.objective, info.self_normalized, info.order) == ("softmax", "mle", False, 3)
            for _ in range(2):
                resp = s.ScoreNgrams(packed(ids, log_base=lm_pb2.LN, allow_unnormalized=True))
                assert resp.normalized  # not self-normalised: always normalised values
                np.testing.assert_allclose(np.asarray(resp.log_probs), lm.score_ngrams(ids), atol=TOL, rtol=0)
            # the distribution over all words but <s> sums to one
            ctx = np.tile(ids[5, :-1], (len(lm.vocab), 1))
            every = np.column_stack([ctx, np.arange(len(lm.vocab))])
            every = every[every[:, -1] != 1].astype(np.uint32)
            probs = np.exp(np.asarray(s.ScoreNgrams(packed(every, log_base=lm_pb2.LN)).log_probs, dtype=np.float64))
            assert probs.sum() == pytest.approx(1.0, abs=1e-4)
    finally:
        running.stop(1.0)
