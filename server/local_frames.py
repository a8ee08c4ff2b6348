"""The frames of the native front end's private channel (server/local.py): the model server
reads NLQ2 request frames and writes NLR2 answer frames.

The rule, field by field and with its edge cases, is the golden file
proto/contract/local_frames.tsv (little-endian numbers, a head of a magic and seven of
them, then the authorization, the part table and the ids; an answer's part table, part
messages and float32 scores); tests/test_local_frames.py checks this module against it, as
``nlmserve_frontend --check-local-frames`` checks the front end's side
(server/native/local_frames.h). A frame that breaks the rule raises ProtocolError.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..common.errors import ProtocolError

REQUEST = struct.Struct("<4s7I")  # magic, request_id, flags, timeout_ms, rows, width, auth_len, parts
RESPONSE = struct.Struct("<4s7I")  # magic, request_id, status, flags, rows, hash_len, message_len, parts
PART = struct.Struct("<2I")  # request: part_rows, part_order; response: part_status, part_message_len
OK_PART = PART.pack(0, 0)  # a part answered OK: status 0, no message
REQUEST_MAGIC, RESPONSE_MAGIC = b"NLQ2", b"NLR2"
LOG10, ALLOW_UNNORMALIZED = 1, 2  # request flags
NORMALIZED = 2  # response flag (bit 0: log10, as in the request)
MAX_AUTH_BYTES = 8192


class RequestHead(NamedTuple):
    """The numbers of a request frame's head."""

    request_id: int
    flags: int
    timeout_ms: int
    rows: int
    width: int
    auth_len: int
    parts: int

    @property
    def body_size(self) -> int:
        """The bytes that follow the head: authorization, part table, ids."""
        return self.auth_len + self.parts * PART.size + self.rows * self.width * 4


def request_head(header: bytes) -> RequestHead:
    """The head of a request frame (its first ``REQUEST.size`` bytes)."""
    magic, *numbers = REQUEST.unpack(header)
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    head = RequestHead(*numbers)
    if head.auth_len > MAX_AUTH_BYTES:
        raise ProtocolError(f"authorization of {head.auth_len} bytes")
    return head


def check_part_count(head: RequestHead) -> None:
    """A request has from one part to one part per row."""
    if head.parts == 0 or head.parts > head.rows:
        raise ProtocolError(f"{head.parts} parts for {head.rows} rows")


def request_body(head: RequestHead, body: bytes) -> tuple[bytes, list[tuple[int, int]], memoryview]:
    """The authorization, the part table (rows, order) and the ids' bytes of a request's
    ``body`` (its ``head.body_size`` bytes after the head)."""
    table_end = head.auth_len + head.parts * PART.size
    view = memoryview(body)
    shape = list(PART.iter_unpack(view[head.auth_len:table_end]))
    if sum(r for r, _ in shape) != head.rows or not all(r >= 1 and 1 <= k <= head.width for r, k in shape):
        raise ProtocolError(f"a part table that does not describe {head.rows} rows of width {head.width}")
    return body[:head.auth_len], shape, view[table_end:]


def decode_request(frame: bytes) -> tuple[RequestHead, bytes, list[tuple[int, int]], np.ndarray]:
    """A whole request frame: its head, authorization, part table and ids (rows × width)."""
    if len(frame) < REQUEST.size:
        raise ProtocolError("connection closed inside a frame")
    head = request_head(frame[:REQUEST.size])
    check_part_count(head)
    if len(frame) - REQUEST.size != head.body_size:
        raise ProtocolError("connection closed inside a frame")
    auth, parts, ids = request_body(head, frame[REQUEST.size:])
    return head, auth, parts, np.frombuffer(ids, dtype="<u4").reshape(-1, head.width)


def answer_frame(request_id: int, flags: int, model_hash: str, scores: np.ndarray,
                 statuses: Sequence[tuple[int, str]] | None, parts: int) -> bytes:
    """The answer of a batch of ``parts`` scored (status 0): one score a row, each part's
    status and message (``statuses`` None: every part OK)."""
    digest = model_hash.encode()
    data = np.asarray(scores, dtype="<f4").tobytes()
    head = RESPONSE.pack(RESPONSE_MAGIC, request_id, 0, flags, len(data) // 4, len(digest), 0, parts)
    if statuses is None:
        return b"".join((head, digest, OK_PART * parts, data))
    texts = [message.encode("utf-8", "replace") for _, message in statuses]
    table = b"".join(PART.pack(code, len(text)) for (code, _), text in zip(statuses, texts))
    return b"".join((head, digest, table, *texts, data))


def failed_frame(request_id: int, code: int, flags: int, model_hash: str, message: str) -> bytes:
    """The answer of a batch every part of which fails with ``code`` (the request's flags)."""
    digest, text = model_hash.encode(), message.encode("utf-8", "replace")
    return b"".join((RESPONSE.pack(RESPONSE_MAGIC, request_id, code, flags, 0, len(digest), len(text), 0),
                     digest, text))
