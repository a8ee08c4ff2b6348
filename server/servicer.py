"""The gRPC servicer (grpc.aio): protos in, arrays to the engine, arrays back into protos.

It only converts: strings to ids with the model's vocabulary (unknown words → ``<unk>``,
flagged; lowercased first when the model was trained lowercased), packed bytes to an id
array, and errors to status codes. Size limits, the mapping of errors to status codes and
the request metrics are server/requests.py's, shared with the native front end's socket
(server/local.py).

The OOV flag of an n-gram is that of its predicted word (KenLM's ``full_scores``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from ..common.errors import InvalidRequestError, UnsupportedModelError
from ..wire.ngrams import BOS_ID, EOS_ID, UNK_ID, pack_ngrams, word_ids
from ..proto import lm_pb2, lm_pb2_grpc
from ..wire.status import CallStatus, status_of
from .engine import Engine, ModelState
from .metrics import ServerMetrics
from .requests import LargeRequest, RequestHandler

log = logging.getLogger(__name__)

T = TypeVar("T")

if TYPE_CHECKING:
    #: The context of any RPC (the stubs make it generic in the request and response types).
    Context = grpc.aio.ServicerContext[Any, Any]

#: HTTP/2's initial flow-control window: a client reads a larger answer in parts and sends
#: window updates meanwhile, so the shutdown drain lets such an answer settle (server.app).
INITIAL_WINDOW_BYTES = 65_535

#: What a request gets while the server drains for shutdown (with UNAVAILABLE).
DRAINING_MESSAGE = "the server is shutting down; retry on another replica"

#: Requests with more n-grams than this are converted off the event loop thread.
OFFLOAD_ITEMS = 20_000
#: ScoreSentences requests of more characters than this are split and mapped off the event
#: loop thread.
OFFLOAD_CHARACTERS = 100_000
#: A token as ``str.split()`` finds them (``\s`` is the same white space).
_TOKEN = re.compile(r"\S+")
# A request of at most this many n-grams from a lone client is scored in the event-loop
# thread when the engine is idle (Engine.try_score_now): no thread hand-over and back.
INLINE_ITEMS = 16
#: Floats per GetScoringTables chunk when the request names none: 1 MiB, well under any
#: client's receive limit.
TABLE_CHUNK_FLOATS = 262_144


def _asks_log10(request: lm_pb2.ScoreNgramsRequest | lm_pb2.ScoreSentencesRequest) -> bool:
    """The wire's LogBase as the engine's ``log10`` flag (unset is LOG10); a value the
    enum does not hold (a newer or broken client) is an InvalidRequestError."""
    if request.log_base not in _LOG_BASES:
        raise InvalidRequestError(
            f"log_base {request.log_base} is not a LogBase (LOG10 = {lm_pb2.LOG10}, LN = {lm_pb2.LN}, unset: LOG10)"
        )
    return request.log_base != lm_pb2.LN


_LOG_BASES = frozenset(lm_pb2.LogBase.values())


def _wire_log_base(log10: bool) -> Any:  # the enum type differs between stub generators
    return lm_pb2.LOG10 if log10 else lm_pb2.LN


def _remaining(context: Context) -> float | None:
    """Seconds to the client's deadline; None without one (gRPC reports a huge number)."""
    left = context.time_remaining()
    return None if left is None or left > 1e6 else max(0.0, left)


class MalformedRequest:
    """What a request that does not parse becomes; every RPC answers it INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _parser(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that turns a parse failure (corrupt wire data, invalid UTF-8 in
    a string field) into a MalformedRequest instead of an UNKNOWN status. A message larger
    than ``LargeRequest.BYTES`` is left as a LargeRequest, which the call gate parses off the
    event loop thread."""
    name = message_type.DESCRIPTOR.name

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as e:  # protobuf DecodeError and kin
            return MalformedRequest(f"{name} does not parse: {e}")

    def deserialize(data: bytes) -> Any:
        return LargeRequest(data, parse) if len(data) > LargeRequest.BYTES else parse(data)

    return deserialize


class _WordsOf:
    """The ``words`` of each NgramStrings, made one at a time as they are read. A list of
    them all would have upb wrap every message at once, and upb's map of live wrappers keeps
    the size of its largest peak for good (about 63 bytes an n-gram: 6 MB for each
    100,000-n-gram request mapped at the same moment, never given back)."""

    def __init__(self, ngrams: Sequence[lm_pb2.NgramStrings]) -> None:
        self._ngrams = ngrams

    def __len__(self) -> int:
        return len(self._ngrams)

    def __iter__(self) -> Iterator[Sequence[str]]:
        return (ng.words for ng in self._ngrams)


def _check_parsed(request: Any) -> None:
    if isinstance(request, MalformedRequest):
        raise InvalidRequestError(request.error)


def add_to_server(servicer: "LanguageModelServicer", server: grpc.aio.Server) -> None:
    """Register ``servicer`` as in the generated code, with the tolerant deserializers."""
    handlers = {
        "ScoreNgrams": grpc.unary_unary_rpc_method_handler(
            servicer.ScoreNgrams, request_deserializer=_parser(lm_pb2.ScoreNgramsRequest),
            response_serializer=lm_pb2.ScoreNgramsResponse.SerializeToString),
        "ScoreSentences": grpc.unary_unary_rpc_method_handler(
            servicer.ScoreSentences, request_deserializer=_parser(lm_pb2.ScoreSentencesRequest),
            response_serializer=lm_pb2.ScoreSentencesResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=_parser(lm_pb2.GetModelInfoRequest),
            response_serializer=lm_pb2.ModelInfo.SerializeToString),
        "GetVocabulary": grpc.unary_stream_rpc_method_handler(
            servicer.GetVocabulary, request_deserializer=_parser(lm_pb2.GetVocabularyRequest),
            response_serializer=lm_pb2.VocabularyChunk.SerializeToString),
        "GetScoringTables": grpc.unary_stream_rpc_method_handler(
            servicer.GetScoringTables, request_deserializer=_parser(lm_pb2.GetScoringTablesRequest),
            response_serializer=lm_pb2.ScoringTablesChunk.SerializeToString),
    }
    service = lm_pb2.DESCRIPTOR.services_by_name["LanguageModel"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)  # type: ignore[attr-defined]


def model_info(state: ModelState, max_items: int) -> lm_pb2.ModelInfo:
    """The ModelInfo message of a served model."""
    lm = state.lm
    return lm_pb2.ModelInfo(
        order=state.order,
        vocab_size=state.vocab_size,
        num_classes=lm.num_classes,
        native_log_base=lm_pb2.LN,
        objective=lm.objective,
        output_type=lm.output_type,
        model_hash=state.model_hash,
        format_version=lm.format_version,
        device=str(lm.device),
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        self_normalized=state.self_normalized,
        max_ngrams_per_request=max_items,
        lowercase=state.lowercase,
    )


class LanguageModelServicer(lm_pb2_grpc.LanguageModelServicer):
    """``nlmserve.v1.LanguageModel`` over one :class:`Engine`."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None,
                 requests: RequestHandler | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_items = engine.config.max_ngrams_per_request
        #: Size limit, error mapping and metrics (shared with server/local.py).
        self.requests = requests if requests is not None else RequestHandler(self.max_items, metrics)
        self._info: tuple[weakref.ref[ModelState], lm_pb2.ModelInfo] | None = None
        self._active = 0  # RPCs being served (the event loop's own count)
        #: Set when the server drains for shutdown: new RPCs get UNAVAILABLE (server.app).
        self.draining = False
        #: When the last answer larger than the client's initial flow-control window was sent
        #: (time.monotonic); the drain lets it reach the client before connections close.
        self.large_answer_at = 0.0
        self._last_end = 0.0  # when the last ScoreNgrams was scored (perf_counter) ...
        self._last_took = 0.0  # ... and how long it took

    @property
    def active(self) -> int:
        """RPCs being served now."""
        return self._active

    @property
    def info(self) -> lm_pb2.ModelInfo:
        """ModelInfo of the served model (rebuilt after a reload; a replaced model is not kept alive)."""
        state = self.engine.state
        if self._info is None or self._info[0]() is not state:
            self._info = (weakref.ref(state), model_info(state, self.max_items))
        return self._info[1]

    # -------------------------------------------------------------- RPCs
    async def ScoreNgrams(self, request: lm_pb2.ScoreNgramsRequest,
                          context: Context) -> lm_pb2.ScoreNgramsResponse:
        return await self._guard("ScoreNgrams", context, self._score_ngrams(request, context))

    async def ScoreSentences(self, request: lm_pb2.ScoreSentencesRequest,
                             context: Context) -> lm_pb2.ScoreSentencesResponse:
        return await self._guard("ScoreSentences", context, self._score_sentences(request, context))

    async def GetModelInfo(self, request: lm_pb2.GetModelInfoRequest,
                           context: Context) -> lm_pb2.ModelInfo:
        return await self._guard("GetModelInfo", context, self._model_info(request))

    async def _model_info(self, request: lm_pb2.GetModelInfoRequest) -> lm_pb2.ModelInfo:
        _check_parsed(request)
        return self.info

    async def GetVocabulary(self, request: lm_pb2.GetVocabularyRequest,
                            context: Context) -> AsyncIterator[lm_pb2.VocabularyChunk]:
        if isinstance(request, MalformedRequest):
            self._count("GetVocabulary", CallStatus.malformed)
            await context.abort(CallStatus.malformed, request.error)
        if self.draining:
            self._count("GetVocabulary", CallStatus.draining)
            await context.abort(CallStatus.draining, DRAINING_MESSAGE)
        size = request.chunk_size or self.engine.config.vocab_chunk_size
        words = self.engine.state.words
        self._count("GetVocabulary", grpc.StatusCode.OK)
        self._active += 1
        try:
            for i in range(0, len(words), size):
                yield lm_pb2.VocabularyChunk(offset=i, words=words[i : i + size])
        finally:
            self._active -= 1
            self.large_answer_at = time.monotonic()

    async def GetScoringTables(self, request: lm_pb2.GetScoringTablesRequest,
                               context: Context) -> AsyncIterator[lm_pb2.ScoringTablesChunk]:
        rpc = "GetScoringTables"
        if isinstance(request, MalformedRequest):
            self._count(rpc, CallStatus.malformed)
            await context.abort(CallStatus.malformed, request.error)
        if self.draining:
            self._count(rpc, CallStatus.draining)
            await context.abort(CallStatus.draining, DRAINING_MESSAGE)
        state = self.engine.state
        try:
            tables = await asyncio.to_thread(state.scoring_tables)
        except UnsupportedModelError as e:
            self._count(rpc, status_of(e))
            await context.abort(status_of(e), str(e))
        flat = tables.data
        size = request.chunk_floats or TABLE_CHUNK_FLOATS
        self._count(rpc, grpc.StatusCode.OK)
        self._active += 1
        try:
            yield lm_pb2.ScoringTablesChunk(
                model_hash=state.model_hash, order=state.order, vocab_size=state.vocab_size,
                dim=tables.dim, activation=tables.activation, total_floats=flat.size,
                feature_order=tables.feature_order, ngram_class_table=tables.ngram_class_table,
                ngram_word_table=tables.ngram_word_table, output=tables.output, tree_nodes=tables.tree_nodes,
                tree_codes=tables.tree_codes, tree_steps=tables.tree_steps, offset=0, data=flat[:size].tobytes())
            for i in range(size, flat.size, size):
                yield lm_pb2.ScoringTablesChunk(offset=i, data=flat[i : i + size].tobytes())
        finally:
            self._active -= 1
            self.large_answer_at = time.monotonic()

    # -------------------------------------------------------------- conversion
    async def _score_ngrams(self, request: lm_pb2.ScoreNgramsRequest,
                            context: Context) -> lm_pb2.ScoreNgramsResponse:
        _check_parsed(request)
        state = self.engine.state  # the model that maps, scores and is named in the answer
        if request.ngrams and (request.packed_ids or request.packed_order):
            raise InvalidRequestError("send either n-gram strings or packed ids (with packed_order), not both")
        if request.packed_ids or request.packed_order:
            ids = self._unpack(request.packed_ids, request.packed_order)
            oov = ids[:, -1] == UNK_ID if ids.shape[1] else np.zeros(ids.shape[0], dtype=bool)
        elif len(request.ngrams) > OFFLOAD_ITEMS:  # keep the event loop free for other requests
            ids, oov = await asyncio.to_thread(self._map_ngrams, request.ngrams, state)
        else:
            ids, oov = self._map_ngrams(request.ngrams, state)
        normalized = not request.allow_unnormalized
        log10 = _asks_log10(request)
        scores = None
        started = time.perf_counter()
        # A lone client: alone in the server, and arriving after a pause longer than the last
        # request took (a crowd's requests follow each other without one, and go to the
        # batching thread so that they are merged).
        if (self._active == 1 and ids.shape[0] <= INLINE_ITEMS
                and started - self._last_end > self._last_took):
            scores = self.engine.try_score_now(ids, normalized=normalized, log10=log10, state=state)
        if scores is None:
            future = self.engine.submit_ngrams(ids, normalized=normalized, log10=log10,
                                               timeout=_remaining(context), state=state)
            scores = await asyncio.wrap_future(future)
        self._last_end = time.perf_counter()
        self._last_took = self._last_end - started
        return lm_pb2.ScoreNgramsResponse(
            log_probs=scores.tolist(),
            oov=oov.tolist(),
            log_base=_wire_log_base(log10),
            normalized=normalized or not state.self_normalized,
            model_hash=state.model_hash,
        )

    def _unpack(self, data: bytes, packed_order: int) -> np.ndarray:
        if packed_order == 0:
            raise InvalidRequestError("packed_ids need packed_order >= 1")
        row_bytes = 4 * packed_order
        if len(data) % row_bytes:
            raise InvalidRequestError(
                f"packed_ids has {len(data)} bytes, not a multiple of 4 x packed_order = {row_bytes}"
            )
        n = len(data) // row_bytes
        self._check_size(n, "n-grams")
        return np.frombuffer(data, dtype="<u4").reshape(n, packed_order)

    def _map_ngrams(self, ngrams: Sequence[lm_pb2.NgramStrings], state: ModelState) -> tuple[np.ndarray, np.ndarray]:
        self._check_size(len(ngrams), "n-grams")
        return pack_ngrams(_WordsOf(ngrams), state.index, state.order, lowercase=state.lowercase)

    async def _score_sentences(self, request: lm_pb2.ScoreSentencesRequest,
                               context: Context) -> lm_pb2.ScoreSentencesResponse:
        _check_parsed(request)
        state = self.engine.state
        bos = request.bos if request.HasField("bos") else True
        eos = request.eos if request.HasField("eos") else True
        if sum(map(len, request.sentences)) > OFFLOAD_CHARACTERS:  # keep the event loop free
            sentences, oovs = await asyncio.to_thread(self._map_sentences, request.sentences, eos, state)
        else:
            sentences, oovs = self._map_sentences(request.sentences, eos, state)
        normalized = not request.allow_unnormalized
        log10 = _asks_log10(request)
        future = self.engine.submit_sentences(
            sentences, bos=bos, eos=eos, normalized=normalized, log10=log10, timeout=_remaining(context),
            state=state,
        )
        results = await asyncio.wrap_future(future)
        out = []
        for res, oov in zip(results, oovs):
            flags = oov.tolist() + ([False] if eos else [])
            out.append(lm_pb2.SentenceScore(
                token_log_probs=res.log_probs.tolist(), oov=flags,
                ngram_lengths=res.ngram_lengths.tolist(), total=res.total,
            ))
        return lm_pb2.ScoreSentencesResponse(
            sentences=out,
            log_base=_wire_log_base(log10),
            normalized=normalized or not state.self_normalized,
            model_hash=state.model_hash,
        )

    def _map_sentences(self, texts: Sequence[str], eos: bool,
                       state: ModelState) -> tuple[list[np.ndarray], list[np.ndarray]]:
        sentences: list[np.ndarray] = []
        oovs: list[np.ndarray] = []
        total = 0
        for s in texts:
            # Counted before splitting: a sentence of more tokens than the request may hold
            # is refused without building a string per token.
            self._check_tokens(s, total + int(eos))
            toks = s.split()
            ids = word_ids(toks, state.index, lowercase=state.lowercase)
            sentences.append(ids)
            oovs.append(ids == UNK_ID)
            total += len(toks) + int(eos)
        self._check_size(total, "tokens")
        return sentences, oovs

    def _check_size(self, n: int, what: str) -> None:
        self.requests.check_size(n, what)

    def _check_tokens(self, sentence: str, before: int) -> None:
        """InvalidRequestError when ``sentence`` would take the request's tokens past the
        limit (``before`` tokens are counted already), found without splitting it: a
        sentence of ``c`` characters holds at most ``(c + 1) // 2`` tokens, and longer ones
        are counted token by token, stopping at the limit."""
        room = self.max_items - before
        if (len(sentence) + 1) // 2 <= room:
            return
        count = 0
        for _ in _TOKEN.finditer(sentence):
            count += 1
            if count > room:
                raise InvalidRequestError(
                    f"request has more than {self.max_items} tokens, more than max_ngrams_per_request = "
                    f"{self.max_items}; split it")

    # -------------------------------------------------------------- errors and metrics
    async def _guard(self, rpc: str, context: Context, work: Awaitable[T]) -> T:
        handler = self.requests
        if self.draining:
            if asyncio.iscoroutine(work):
                work.close()  # never started
            handler.count(rpc, CallStatus.draining)
            await context.abort(CallStatus.draining, DRAINING_MESSAGE)
        start = handler.started()
        self._active += 1
        failed: tuple[grpc.StatusCode, str] | None = None
        try:
            result = await work
        except asyncio.CancelledError:
            handler.count(rpc, CallStatus.cancelled)
            raise
        except Exception as e:
            failed = handler.error(rpc, e)
            handler.count(rpc, failed[0])
        finally:
            self._active -= 1
            handler.finished(rpc, start)
        if failed is not None:
            # Aborted outside the except block: gRPC keeps the abort's exception with the
            # call's state until its next call, and raised in there it would chain to the
            # error, whose frames hold the refused request's arrays.
            await context.abort(*failed)
        handler.count(rpc, grpc.StatusCode.OK)
        if isinstance(result, Message) and result.ByteSize() > INITIAL_WINDOW_BYTES:
            self.large_answer_at = time.monotonic()
        return result

    def _count(self, rpc: str, code: grpc.StatusCode) -> None:
        self.requests.count(rpc, code)
