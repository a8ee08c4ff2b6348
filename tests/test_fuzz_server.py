"""Property-based fuzzing of every RPC against one real server on 127.0.0.1.

For each generated request the expected outcome is computed independently (from the wire
contract in docs/reference.md and the in-process model): OK with the in-process values, or
INVALID_ARGUMENT naming the first offending item, or RESOURCE_EXHAUSTED for a message over
the size limit. After every example the server must still answer a known request correctly.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nlmserve.wire.ngrams import BOS_ID as BOS
from nlmserve.wire.ngrams import UNK_ID as UNK
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine

MAX_ITEMS = 512
MAX_BYTES = 256 * 1024
TOL = 1e-4

FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def server(tiny_lm: Any) -> Iterator[RunningServer]:
    config = ServerConfig(model="(in-process)", port=0, torch_threads=1, max_ngrams_per_request=MAX_ITEMS,
                          max_queue_ngrams=4 * MAX_ITEMS, max_message_bytes=MAX_BYTES)
    running = create_server(config, engine=Engine(tiny_lm, config))
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[lm_pb2_grpc.LanguageModelStub]:
    options = [("grpc.max_send_message_length", 16 * MAX_BYTES), ("grpc.max_receive_message_length", 16 * MAX_BYTES)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        yield lm_pb2_grpc.LanguageModelStub(channel)


@pytest.fixture(scope="module")
def known(tiny_lm: Any) -> tuple[lm_pb2.ScoreNgramsRequest, float]:
    ids = np.array([tiny_lm.vocab.encode(["the", "european"])])
    return lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["the", "european"])]), float(
        tiny_lm.score_ngrams(ids, log10=True)[0])


def still_serves(server: RunningServer, stub: Any, known: tuple[lm_pb2.ScoreNgramsRequest, float]) -> None:
    assert server.engine.check_health() and server.thread.is_alive()
    got = stub.ScoreNgrams(known[0], timeout=30).log_probs[0]
    assert abs(got - known[1]) <= TOL


def call(method: Any, request: Any) -> tuple[grpc.StatusCode, Any]:
    try:
        return grpc.StatusCode.OK, method(request, timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details()


def expect_invalid(code: grpc.StatusCode, details: Any, index: int | None, what: str) -> None:
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, what)
    if index is not None:
        assert str(details).startswith(f"item {index}: "), (details, what)


# ------------------------------------------------------------------ strategies
def words(tiny_lm: Any) -> st.SearchStrategy[str]:
    vocab = tiny_lm.vocab.words
    return st.one_of(
        st.sampled_from(vocab[3:200]),  # frequent real words
        st.sampled_from(["<s>", "</s>", "<unk>", "", " ", "The", "EUROPEAN", "a b", "\x00", "\t"]),
        st.text(max_size=12),  # any Unicode that UTF-8 can carry (protobuf refuses lone surrogates)
    )


# ------------------------------------------------------------------ ScoreNgrams with strings
@FUZZ
@given(data=st.data())
def test_score_ngrams_strings(server: RunningServer, stub: Any, known: Any, tiny_lm: Any, data: st.DataObject) -> None:
    order = tiny_lm.order
    ngrams = data.draw(st.lists(st.lists(words(tiny_lm), min_size=0, max_size=order + 2), max_size=40), "ngrams")
    log_base = data.draw(st.sampled_from([lm_pb2.LOG_BASE_UNSPECIFIED, lm_pb2.LOG10, lm_pb2.LN]), "log_base")
    request = lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=ng) for ng in ngrams], log_base=log_base)
    code, result = call(stub.ScoreNgrams, request)
    shape_bad = [i for i, ng in enumerate(ngrams) if not 0 < len(ng) <= order]
    rows = [tiny_lm.vocab.encode(ng).tolist() if 0 < len(ng) <= order else [] for ng in ngrams]
    bos_bad = [i for i, r in enumerate(rows) if r and r[-1] == BOS]
    if shape_bad:
        expect_invalid(code, result, shape_bad[0], "empty or too long n-gram")
    elif bos_bad:
        expect_invalid(code, result, bos_bad[0], "<s> predicted")
    else:
        assert code == grpc.StatusCode.OK, result
        got = np.asarray(result.log_probs)
        assert got.shape == (len(ngrams),)
        if ngrams:
            ids = np.full((len(rows), order), BOS, dtype=np.int64)
            for i, r in enumerate(rows):
                ids[i, order - len(r):] = r
            want = tiny_lm.score_ngrams(ids, log10=log_base != lm_pb2.LN)
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
            assert list(result.oov) == [r[-1] == UNK for r in rows]
    still_serves(server, stub, known)


# ------------------------------------------------------------------ ScoreNgrams with packed ids
@FUZZ
@given(data=st.data())
def test_score_ngrams_packed_ids(server: RunningServer, stub: Any, known: Any, tiny_lm: Any,
                                 data: st.DataObject) -> None:
    order, vocab = tiny_lm.order, len(tiny_lm.vocab)
    packed_order = data.draw(st.one_of(st.integers(0, order + 2), st.sampled_from([2**31, 2**32 - 1])), "order")
    width = min(packed_order, order + 2)
    n = data.draw(st.integers(0, 30), "rows")
    id_value = st.one_of(st.integers(0, vocab - 1), st.integers(3, 60), st.sampled_from([vocab, vocab + 1, 2**32 - 1]))
    ids = np.array(data.draw(st.lists(st.lists(id_value, min_size=width, max_size=width), min_size=n, max_size=n),
                             "ids"), dtype=np.uint32).reshape(n, width)
    payload = ids.astype("<u4").tobytes()
    ragged = data.draw(st.sampled_from([0, 0, 0, 1, 2, 3]), "ragged")  # trailing bytes of a cut row
    payload += b"\x07" * ragged
    with_strings = data.draw(st.integers(0, 3), "strings") == 0  # a quarter also carry a string n-gram
    request = lm_pb2.ScoreNgramsRequest(packed_ids=payload, packed_order=packed_order,
                                        allow_unnormalized=data.draw(st.booleans(), "unnormalized"))
    if with_strings:
        request.ngrams.add(words=["the"])
    code, result = call(stub.ScoreNgrams, request)
    if with_strings and (payload or packed_order):
        expect_invalid(code, result, None, "strings and ids together")
    elif not payload and not packed_order:
        assert code == grpc.StatusCode.OK and len(result.log_probs) == int(with_strings), (code, result)
    elif packed_order == 0:
        expect_invalid(code, result, None, "packed_order 0")
    elif len(payload) % (4 * packed_order):
        expect_invalid(code, result, None, "ragged bytes")
        assert "multiple of" in str(result)
    elif n == 0 or packed_order != width:
        # no rows (a huge packed_order with no payload)
        assert code == grpc.StatusCode.OK and len(result.log_probs) == 0, (code, result)
    elif packed_order > order:
        expect_invalid(code, result, 0, "longer than the order")
    else:
        # The no-word (id vocab) is allowed in a context, never predicted.
        out_of_range = np.flatnonzero((ids > vocab).any(axis=1) | (ids[:, -1] == vocab))
        bos_target = np.flatnonzero(ids[:, -1] == BOS)
        if out_of_range.size:
            expect_invalid(code, result, int(out_of_range[0]), "id out of range")
        elif bos_target.size:
            expect_invalid(code, result, int(bos_target[0]), "<s> predicted")
        else:
            assert code == grpc.StatusCode.OK, result
            want = tiny_lm.score_ngrams(ids.astype(np.int64), normalized=not request.allow_unnormalized, log10=True)
            np.testing.assert_allclose(np.asarray(result.log_probs), want, atol=TOL, rtol=0)
            assert list(result.oov) == (ids[:, -1] == UNK).tolist()
    still_serves(server, stub, known)


def test_strings_with_packed_order_and_no_bytes_are_refused(stub: Any) -> None:
    request = lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["the"])], packed_order=1)
    code, result = call(stub.ScoreNgrams, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT or len(result.log_probs) == 1, (code, result)


# ------------------------------------------------------------------ sizes: empty, at and over the limits
@settings(max_examples=30, deadline=None, database=None, derandomize=True)
@given(n=st.sampled_from([0, 1, MAX_ITEMS - 1, MAX_ITEMS, MAX_ITEMS + 1, 3 * MAX_ITEMS, 40_000]),
       packed=st.booleans(), word_bytes=st.sampled_from([1, 8, 64]))
def test_empty_and_huge_batches(server: RunningServer, stub: Any, known: Any, tiny_lm: Any, n: int, packed: bool,
                                word_bytes: int) -> None:
    if packed:
        ids = np.tile(np.array([[1, 5, 6, 7, 8]], dtype="<u4"), (n, 1))
        request = lm_pb2.ScoreNgramsRequest(packed_ids=ids.tobytes(), packed_order=5)
    else:
        word = ("the" + "x" * word_bytes)[:word_bytes]
        request = lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=["the", word])] * n)
    code, result = call(stub.ScoreNgrams, request)
    if request.ByteSize() > MAX_BYTES:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, result)
    elif n > MAX_ITEMS:
        expect_invalid(code, result, None, "over max_ngrams_per_request")
        assert f"max_ngrams_per_request = {MAX_ITEMS}" in str(result)
    else:
        assert code == grpc.StatusCode.OK and len(result.log_probs) == n, (code, result)
        if n:
            assert len(set(result.log_probs)) == 1
    still_serves(server, stub, known)


# ------------------------------------------------------------------ ScoreSentences
@FUZZ
@given(data=st.data())
def test_score_sentences(server: RunningServer, stub: Any, known: Any, tiny_lm: Any, data: st.DataObject) -> None:
    sep = st.sampled_from([" ", "  ", "\t", "\u3000", "\n", " \x1c "])
    sentence = st.builds(lambda ws, s: s.join(ws), st.lists(words(tiny_lm), max_size=12), sep)
    sentences = data.draw(st.lists(st.one_of(sentence, st.text(max_size=30)), max_size=8), "sentences")
    repeat = data.draw(st.sampled_from([1, 1, 1, 60]), "repeat")  # sometimes over the token limit
    sentences = [" ".join([s] * repeat) for s in sentences]
    bos = data.draw(st.sampled_from([None, True, False]), "bos")
    eos = data.draw(st.sampled_from([None, True, False]), "eos")
    request = lm_pb2.ScoreSentencesRequest(sentences=sentences, log_base=lm_pb2.LN)
    if bos is not None:
        request.bos = bos
    if eos is not None:
        request.eos = eos
    use_bos, use_eos = bos is not False, eos is not False
    code, result = call(stub.ScoreSentences, request)
    tokens = [s.split() for s in sentences]
    total = sum(len(t) + int(use_eos) for t in tokens)
    has_bos = [i for i, t in enumerate(tokens) if "<s>" in t]
    if request.ByteSize() > MAX_BYTES:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, result)
    elif total > MAX_ITEMS:
        expect_invalid(code, result, None, "over the token limit")
    elif has_bos:
        expect_invalid(code, result, has_bos[0], "<s> inside a sentence")
    else:
        assert code == grpc.StatusCode.OK, result
        assert len(result.sentences) == len(sentences)
        want = tiny_lm.score_sentences(tokens, bos=use_bos, eos=use_eos) if tokens else []
        for got, ref, toks in zip(result.sentences, want, tokens):
            assert len(got.token_log_probs) == len(toks) + int(use_eos)
            np.testing.assert_allclose(np.asarray(got.token_log_probs), ref.token_log_probs, atol=TOL, rtol=0)
            assert got.total == pytest.approx(float(np.sum(np.asarray(got.token_log_probs, dtype=np.float64))),
                                              abs=1e-3)
            assert list(got.oov)[: len(toks)] == (tiny_lm.vocab.encode(toks) == UNK).tolist()
    still_serves(server, stub, known)


# ------------------------------------------------------------------ GetVocabulary and GetModelInfo
@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(chunk=st.one_of(st.integers(0, 5000), st.sampled_from([1, 3628, 3629, 3630, 2**31, 2**32 - 1])))
def test_get_vocabulary_any_chunk_size(server: RunningServer, stub: Any, known: Any, tiny_lm: Any, chunk: int) -> None:
    chunks = list(stub.GetVocabulary(lm_pb2.GetVocabularyRequest(chunk_size=chunk), timeout=30))
    size = chunk or server.config.vocab_chunk_size
    assert all(len(c.words) <= size for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, len(tiny_lm.vocab), size))
    assert [w for c in chunks for w in c.words] == tiny_lm.vocab.words
    still_serves(server, stub, known)


def test_get_model_info_is_stable(server: RunningServer, stub: Any, known: Any, tiny_lm: Any) -> None:
    infos = [stub.GetModelInfo(lm_pb2.GetModelInfoRequest(), timeout=30) for _ in range(20)]
    assert all(i == infos[0] for i in infos)
    assert (infos[0].order, infos[0].vocab_size, infos[0].max_ngrams_per_request) == (
        tiny_lm.order, len(tiny_lm.vocab), MAX_ITEMS)
    still_serves(server, stub, known)


# ------------------------------------------------------------------ bytes the generated client cannot send
def varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


RPCS = ("ScoreNgrams", "ScoreSentences", "GetModelInfo", "GetVocabulary")


def raw_call(server: RunningServer, rpc: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(server.target) as channel:
        path = f"/nlmserve.v1.LanguageModel/{rpc}"
        try:
            if rpc == "GetVocabulary":
                list(channel.unary_stream(path, None, None)(data, timeout=30))
            else:
                channel.unary_unary(path, None, None)(data, timeout=30)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details() or ""


def invalid_utf8_requests() -> Sequence[tuple[str, bytes]]:
    bad = [b"the\xff", b"\xed\xa0\x80", b"\xc3", b"ok \x80 word"]  # stray byte, a surrogate, cut sequence
    return [(rpc, field(1, field(1, b)) if rpc == "ScoreNgrams" else field(1, b))
            for rpc in ("ScoreNgrams", "ScoreSentences") for b in bad]


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(rpc=st.sampled_from(RPCS), data=st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\xff", b"\x0a\x05ab"])))
def test_random_bytes_never_crash_the_server(server: RunningServer, stub: Any, known: Any, rpc: str,
                                             data: bytes) -> None:
    """Whatever the bytes: OK or INVALID_ARGUMENT (bytes that do not parse are INVALID_ARGUMENT), and the
    server serves on."""
    code, details = raw_call(server, rpc, data)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT and rpc in ("GetModelInfo", "GetVocabulary"):
        assert "does not parse" in details, details
    still_serves(server, stub, known)


def test_invalid_utf8_strings_are_refused_and_the_server_serves_on(server: RunningServer, stub: Any,
                                                                   known: Any) -> None:
    for rpc, data in invalid_utf8_requests():
        code, details = raw_call(server, rpc, data)
        assert code != grpc.StatusCode.OK, (rpc, data)
        still_serves(server, stub, known)


def test_invalid_utf8_strings_are_invalid_argument(server: RunningServer) -> None:
    codes = {(rpc, data): raw_call(server, rpc, data) for rpc, data in invalid_utf8_requests()}
    assert all(c == grpc.StatusCode.INVALID_ARGUMENT for c, _ in codes.values()), codes
