"""The native front end's private channel to the engine: packed n-gram batches over a Unix socket.

``nlmserve serve --frontend native`` puts the C++ front end (server/native) before this
process. The front end merges the small ScoreNgrams requests of many clients; each merged
batch then costs one round trip to the engine. Over gRPC that round trip costs the Python
gRPC stack's few hundred microseconds per call; over this socket it is two system calls and
a header to parse, which is the Triton design (a C++ server talking to its Python backend
through a private IPC channel). Everything else the front end forwards (strings,
ScoreSentences, model info, vocabulary, reload, a merged batch's per-request re-sends after
an INVALID_ARGUMENT) stays on gRPC.

Wire format, little-endian, one request and then one response at a time per connection::

    request:  "NLQ1" u32 request_id  u32 flags  u32 timeout_ms  u32 rows  u32 width  u32 auth_len
              auth (the caller's `authorization` metadata, auth_len bytes)
              ids (rows × width uint32, oldest word first, rows of a short context left-padded with <s>)
    response: "NLR1" u32 request_id  u32 status  u32 flags  u32 rows  u32 hash_len  u32 message_len
              model hash (hash_len bytes)  message (UTF-8, message_len bytes)
              scores (rows float32; none unless status is 0)

Request flags: bit 0 log10 (else natural log), bit 1 allow unnormalised scores. Response
flags: bit 0 the scores are log10, bit 1 they are normalised. ``status`` is the gRPC status
code the same request gets from the gRPC servicer (0 OK, 3 INVALID_ARGUMENT with the
servicer's message, 4 DEADLINE_EXCEEDED, 8 RESOURCE_EXHAUSTED, 13 INTERNAL, 14 UNAVAILABLE,
16 UNAUTHENTICATED); the OOV flags are the front end's to compute (the predicted word is
``<unk>``). ``timeout_ms`` 0 means no deadline.

The socket lives in a directory only this user may enter (mode 0700), and bearer tokens,
when the server has them, are checked on every request as the gRPC interceptor does.
Metrics count a batch as one ScoreNgrams request, as they count a merged gRPC request.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from nlmserve.errors import InvalidRequestError, ProtocolError
from nlmserve.server.auth import TokenStore
from nlmserve.server.engine import Engine
from nlmserve.server.metrics import ServerMetrics
from nlmserve.server.servicer import status_of

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<4s6I")  # magic, request_id, flags, timeout_ms, rows, width, auth_len
RESPONSE = struct.Struct("<4s6I")  # magic, request_id, status, flags, rows, hash_len, message_len
REQUEST_MAGIC, RESPONSE_MAGIC = b"NLQ1", b"NLR1"
LOG10, ALLOW_UNNORMALIZED = 1, 2  # request flags
NORMALIZED = 2  # response flag (bit 0: log10, as in the request)
MAX_AUTH_BYTES = 8192


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    """n bytes, or None when the peer closed the connection before the first byte."""
    if n == 0:
        return b""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ProtocolError(f"connection closed inside a frame ({got} of {n} bytes)")
        got += k
    return bytes(buf)


class LocalBackend:
    """Serves the front end's batches on ``path`` with one thread per connection."""

    def __init__(self, path: str | Path, engine: Engine, metrics: ServerMetrics | None = None,
                 tokens: TokenStore | None = None) -> None:
        self.path = str(path)
        self.engine = engine
        self.metrics = metrics
        self.tokens = tokens
        self.max_items = engine.config.max_ngrams_per_request
        self._children: dict[Any, Any] = {}
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        if os.path.exists(self.path):
            os.unlink(self.path)  # a stale socket of a process that died
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self._sock.listen(16)
        except OSError:
            self._sock.close()
            raise
        self._accepter = threading.Thread(target=self._accept, name="nlmserve-local", daemon=True)
        self._accepter.start()
        log.info("local backend channel on %s", self.path)

    def close(self) -> None:
        """Stop accepting, close every connection (a request being scored finishes first)."""
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        self._accepter.join(5.0)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="nlmserve-local-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                header = _read_exact(conn, REQUEST.size)
                if header is None:
                    return
                magic, request_id, flags, timeout_ms, rows, width, auth_len = REQUEST.unpack(header)
                if magic != REQUEST_MAGIC:
                    raise ProtocolError(f"bad magic {magic!r}")
                if auth_len > MAX_AUTH_BYTES:
                    raise ProtocolError(f"authorization of {auth_len} bytes")
                size = rows * width * 4
                if rows > self.max_items or size > (1 << 31):
                    # answer first (the exact status), then drop the connection: the ids are not read
                    conn.sendall(self._frame(request_id, grpc.StatusCode.INVALID_ARGUMENT, flags, None, "",
                                             f"request has {rows} n-grams, more than max_ngrams_per_request = "
                                             f"{self.max_items}; split it"))
                    raise ProtocolError("oversized batch")
                auth = _read_exact(conn, auth_len)
                data = _read_exact(conn, size)
                if auth is None or data is None:
                    raise ProtocolError("connection closed inside a frame")
                conn.sendall(self._answer(request_id, flags, timeout_ms, rows, width, auth, data))
        except ProtocolError as e:
            log.warning("local backend channel: %s; closing the connection", e)
        except OSError as e:
            if not self._closing:
                log.warning("local backend channel: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    # ------------------------------------------------------------------ one batch
    def _answer(self, request_id: int, flags: int, timeout_ms: int, rows: int, width: int,
                auth: bytes, data: bytes) -> bytes:
        start = time.perf_counter()
        m = self.metrics
        if m is not None:
            m.in_flight.inc()
        state = self.engine.state
        log10 = bool(flags & LOG10)
        normalized = not flags & ALLOW_UNNORMALIZED
        try:
            if self.tokens is not None and not self.tokens.check(auth or None):
                code = grpc.StatusCode.UNAUTHENTICATED
                message = "missing bearer token" if not auth else "invalid bearer token"
                self._count(code)
                return self._frame(request_id, code, flags, None, state.model_hash, message)
            try:
                if width == 0:
                    raise InvalidRequestError("packed_ids need packed_order >= 1")
                ids = np.frombuffer(data, dtype="<u4").reshape(rows, width)
                scores = self.engine.try_score_now(ids, normalized=normalized, log10=log10, state=state)
                if scores is None:  # the engine is busy (gRPC clients too): queue for its batching thread
                    timeout = timeout_ms / 1000.0 if timeout_ms else None
                    future = self.engine.submit_ngrams(ids, normalized=normalized, log10=log10, timeout=timeout,
                                                       state=state)
                    scores = future.result()
            except Exception as e:
                code = status_of(e)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("ScoreNgrams (local channel) failed")
                    message = f"internal error: {type(e).__name__}: {e}"
                else:
                    message = str(e)
                self._count(code)
                return self._frame(request_id, code, flags, None, state.model_hash, message)
            self._count(grpc.StatusCode.OK)
            out_flags = (LOG10 if log10 else 0) | (NORMALIZED if normalized or not state.self_normalized else 0)
            return self._frame(request_id, grpc.StatusCode.OK, out_flags, np.asarray(scores, dtype="<f4"),
                               state.model_hash, "")
        finally:
            if m is not None:
                m.in_flight.dec()
                latency = self._children.get("latency")
                if latency is None:
                    latency = self._children["latency"] = m.request_latency.labels(rpc="ScoreNgrams")
                latency.observe(time.perf_counter() - start)

    @staticmethod
    def _frame(request_id: int, code: grpc.StatusCode, flags: int, scores: np.ndarray | None,
               model_hash: str, message: str) -> bytes:
        digest, text = model_hash.encode(), message.encode("utf-8", "replace")
        rows = 0 if scores is None else scores.shape[0]
        head = RESPONSE.pack(RESPONSE_MAGIC, request_id, code.value[0], flags, rows, len(digest), len(text))
        body = b"" if scores is None else scores.tobytes()
        return b"".join((head, digest, text, body))

    def _count(self, code: grpc.StatusCode) -> None:
        if self.metrics is None:
            return
        child = self._children.get(code)
        if child is None:
            child = self._children[code] = self.metrics.requests.labels(rpc="ScoreNgrams", code=code.name)
        child.inc()
