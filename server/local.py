"""The native front end's private channel to the engine: packed n-gram batches over a Unix socket.

``nlmserve serve --frontend native`` puts the C++ front end (server/native) before this
process. The front end merges the small ScoreNgrams requests of many clients; each merged
batch then costs one round trip to the engine. Over gRPC that round trip costs the Python
gRPC stack's few hundred microseconds per call; over this socket it is two system calls and
a header to parse, which is the Triton design (a C++ server talking to its Python backend
through a private IPC channel). Everything else the front end forwards (strings,
ScoreSentences, model info, vocabulary, reload) stays on gRPC.

A merged batch carries its client requests (its parts), and the answer gives each part its
own status: one client's invalid n-gram fails that client only, with the status and message
the gRPC servicer gives that request alone; the others get their scores.

The frames (NLQ2 requests, NLR2 answers, one at a time per connection) are
server/local_frames.py's, whose rule is the golden file proto/contract/local_frames.tsv. An
answer's status, and each part's, is the gRPC code the same request gets from the gRPC
servicer (a batch's when every part fails alike: a refused token, an oversized batch, an
overloaded or stopped engine, a deadline); the OOV flags are the front end's to compute (the
predicted word is ``<unk>``). A frame that breaks the rule closes its connection.

The socket lives in a directory only this user may enter (mode 0700). Tokens, the size
limit, error mapping and metrics are the gRPC servicer's own (server/requests.py): a merged
batch counts as the client requests it holds in ``nlmserve_requests``, each with its status.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

import grpc
import numpy as np

from ..common.errors import InvalidRequestError, ProtocolError
from ..wire.status import CallStatus, status_of
from .engine import Engine, ModelState
from .local_frames import (ALLOW_UNNORMALIZED, LOG10, NORMALIZED, REQUEST, answer_frame, check_part_count,
                           failed_frame, request_body, request_head)
from .requests import RequestHandler

log = logging.getLogger(__name__)

RPC = "ScoreNgrams"


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

    def __init__(self, path: str | Path, engine: Engine, requests: RequestHandler) -> None:
        self.path = str(path)
        self.engine = engine
        self.requests = requests
        self.max_items = requests.max_items
        #: Batches answered (each holds one or more client requests).
        self.batches = 0
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
                head = request_head(header)
                request_id, flags, rows, width, parts = head.request_id, head.flags, head.rows, head.width, head.parts
                size = rows * width * 4
                try:
                    self.requests.check_size(rows, "n-grams")
                    if size > (1 << 31):
                        raise InvalidRequestError(f"a batch of {size} bytes")
                except InvalidRequestError as e:
                    # answer first (the exact status), then drop the connection: the ids are not read
                    n = max(1, min(parts, rows))
                    self.requests.count(RPC, status_of(e), n)
                    conn.sendall(self._failed(request_id, status_of(e), flags,
                                              self.engine.state.model_hash, str(e)))
                    raise ProtocolError("oversized batch") from None
                check_part_count(head)
                body = _read_exact(conn, head.body_size)  # the rest of the frame, in one read
                if body is None:
                    raise ProtocolError("connection closed inside a frame")
                auth, shape, ids = request_body(head, body)
                conn.sendall(self._answer(request_id, flags, head.timeout_ms, width, auth, shape, ids))
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
    def _answer(self, request_id: int, flags: int, timeout_ms: int, width: int, auth: bytes,
                parts: list[tuple[int, int]], data: bytes | memoryview) -> bytes:
        handler = self.requests
        n = len(parts)
        start = handler.started(n)
        with self._lock:
            self.batches += 1
        state = self.engine.state
        log10 = bool(flags & LOG10)
        normalized = not flags & ALLOW_UNNORMALIZED
        timeout = timeout_ms / 1000.0 if timeout_ms else None
        try:
            refusal = handler.refusal(auth or None)
            if refusal is not None:
                handler.count(RPC, CallStatus.unauthenticated, n)
                return self._failed(request_id, CallStatus.unauthenticated, flags, state.model_hash, refusal)
            ids = np.frombuffer(data, dtype="<u4").reshape(-1, width)
            try:
                try:
                    scores = np.asarray(self._score(ids, normalized, log10, timeout, state), dtype="<f4")
                    statuses = None  # every part OK
                except InvalidRequestError:
                    # Some part is invalid: each part alone gets the servicer's answer to it.
                    scores, statuses = self._score_parts(ids, parts, normalized, log10, timeout, state)
            except Exception as e:
                code, message = handler.error(RPC, e)
                handler.count(RPC, code, n)
                return self._failed(request_id, code, flags, state.model_hash, message)
        finally:
            handler.finished(RPC, start, n)
        out_flags = (LOG10 if log10 else 0) | (NORMALIZED if normalized or not state.self_normalized else 0)
        if statuses is None:
            handler.count(RPC, grpc.StatusCode.OK, n)
            return answer_frame(request_id, out_flags, state.model_hash, scores, None, n)
        for code, _ in statuses:
            handler.count(RPC, code)
        return answer_frame(request_id, out_flags, state.model_hash, scores,
                            [(code.value[0], message) for code, message in statuses], n)

    def _score(self, ids: np.ndarray, normalized: bool, log10: bool, timeout: float | None,
               state: ModelState) -> np.ndarray:
        scores = self.engine.try_score_now(ids, normalized=normalized, log10=log10, state=state)
        if scores is None:  # the engine is busy (gRPC clients too): queue for its batching thread
            future = self.engine.submit_ngrams(ids, normalized=normalized, log10=log10, timeout=timeout,
                                               state=state)
            scores = future.result()
        return scores

    def _score_parts(self, ids: np.ndarray, parts: list[tuple[int, int]], normalized: bool, log10: bool,
                     timeout: float | None,
                     state: ModelState) -> tuple[np.ndarray, list[tuple[grpc.StatusCode, str]]]:
        """Each part scored alone on its own rows (the <s> padding taken off): an invalid one
        gets its own status and message; any other error is the batch's."""
        out = np.zeros(ids.shape[0], dtype="<f4")
        statuses: list[tuple[grpc.StatusCode, str]] = []
        at = 0
        for rows, order in parts:
            part = np.ascontiguousarray(ids[at : at + rows, ids.shape[1] - order :])
            try:
                out[at : at + rows] = self._score(part, normalized, log10, timeout, state)
                statuses.append((grpc.StatusCode.OK, ""))
            except InvalidRequestError as e:
                statuses.append(self.requests.error(RPC, e))
            at += rows
        return out, statuses

    @staticmethod
    def _failed(request_id: int, code: grpc.StatusCode, flags: int, model_hash: str, message: str) -> bytes:
        """The answer of a batch every part of which fails with ``code``."""
        return failed_frame(request_id, code.value[0], flags, model_hash, message)
