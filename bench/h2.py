"""HTTP/2 written by hand, for clients no gRPC library makes: frames as given (a header block
before the SETTINGS acknowledgement, HEADERS + RST_STREAM bursts, a zero receive window, a
connection that stops inside its preface or a header block), and just enough HPACK to send
literal fields and read a gRPC server's trailers (RFC 7540, RFC 7541; no Huffman coding).

    from bench.h2 import H2, frame, header_block, grpc_fields, headers_frames
"""

from __future__ import annotations

import asyncio

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_HEADER_LIST_SIZE = 0x1, 0x3, 0x4, 0x6
FRAME_BYTES = 16_384  # the smallest SETTINGS_MAX_FRAME_SIZE a peer may set
ERRORS = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
          "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR", "CONNECT_ERROR",
          "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED")


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + (stream & 0x7FFFFFFF).to_bytes(4, "big") + payload


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items()))


def error_name(code: int) -> str:
    return ERRORS[code] if code < len(ERRORS) else f"error {code}"


def _hpack_int(value: int, prefix: int, flags: int = 0) -> bytes:
    """RFC 7541 5.1: ``value`` with an N-bit prefix, the first byte's other bits ``flags``."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((flags | value,))
    out = bytearray((flags | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(fields: list[tuple[str, str]]) -> bytes:
    """Each field as a literal without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    out = bytearray()
    for name, value in fields:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return bytes(out)


def grpc_fields(port: int, path: str, token: str | None = None) -> list[tuple[str, str]]:
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"127.0.0.1:{port}"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    if token is not None:
        fields.append(("authorization", f"Bearer {token}"))
    return fields


def headers_frames(stream: int, block: bytes, end_stream: bool = False, end_headers: bool = True) -> bytes:
    """A header block as HEADERS and CONTINUATION frames of at most :data:`FRAME_BYTES`."""
    pieces = [block[i : i + FRAME_BYTES] for i in range(0, len(block), FRAME_BYTES)] or [b""]
    out = bytearray()
    for i, piece in enumerate(pieces):
        last = END_HEADERS if end_headers and i == len(pieces) - 1 else 0
        if i == 0:
            out += frame(HEADERS, last | (END_STREAM if end_stream else 0), stream, piece)
        else:
            out += frame(CONTINUATION, last, stream, piece)
    return bytes(out)


# RFC 7541 Appendix A: the names of the static table (values only where a decoder needs them).
_STATIC: tuple[tuple[str, str], ...] = (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"), (":path", "/index.html"),
    (":scheme", "http"), (":scheme", "https"), (":status", "200"), (":status", "204"), (":status", "206"),
    (":status", "304"), (":status", "400"), (":status", "404"), (":status", "500")) + tuple(
    (name, "") for name in (
        "accept-charset accept-encoding accept-language accept-ranges accept access-control-allow-origin age "
        "allow authorization cache-control content-disposition content-encoding content-language "
        "content-length content-location content-range content-type cookie date etag expect expires from "
        "host if-match if-modified-since if-none-match if-range if-unmodified-since last-modified link "
        "location max-forwards proxy-authenticate proxy-authorization range referer refresh retry-after "
        "server set-cookie strict-transport-security transfer-encoding user-agent vary via "
        "www-authenticate").split())


def _status_names() -> dict[str, str]:
    import grpc

    return {str(code.value[0]): code.name for code in grpc.StatusCode}


_STATUS = _status_names()


class HpackDecoder:
    """Just enough of RFC 7541 to read a gRPC server's response headers and trailers: the
    static and dynamic tables and literal strings; a Huffman-coded string reads as ``?``."""

    def __init__(self) -> None:
        self.table: list[tuple[str, str]] = []
        self.size = 0
        self.limit = 4096

    def _int(self, data: bytes, i: int, prefix: int) -> tuple[int, int]:
        limit = (1 << prefix) - 1
        value = data[i] & limit
        i += 1
        if value < limit:
            return value, i
        shift = 0
        while True:
            b = data[i]
            i += 1
            value += (b & 127) << shift
            shift += 7
            if not b & 128:
                return value, i

    def _str(self, data: bytes, i: int) -> tuple[str, int]:
        huffman = bool(data[i] & 0x80)
        n, i = self._int(data, i, 7)
        raw = data[i : i + n]
        return ("?" if huffman else raw.decode("latin-1")), i + n

    def _entry(self, index: int) -> tuple[str, str]:
        if index <= len(_STATIC):
            return _STATIC[index - 1]
        return self.table[index - len(_STATIC) - 1]

    def _add(self, name: str, value: str) -> None:
        self.table.insert(0, (name, value))
        self.size += len(name) + len(value) + 32
        self._evict()

    def _evict(self) -> None:
        while self.size > self.limit and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + 32

    def decode(self, data: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        i = 0
        while i < len(data):
            b = data[i]
            if b & 0x80:  # indexed
                index, i = self._int(data, i, 7)
                name, value = self._entry(index)
            elif b & 0xE0 == 0x20:  # dynamic table size update
                self.limit, i = self._int(data, i, 5)
                self._evict()
                continue
            else:  # literal: with incremental indexing (6-bit index), without or never indexed (4-bit)
                indexing = bool(b & 0x40)
                index, i = self._int(data, i, 6 if indexing else 4)
                if index:
                    name = self._entry(index)[0]
                else:
                    name, i = self._str(data, i)
                value, i = self._str(data, i)
                if indexing:
                    self._add(name, value)
            out[name] = value
        return out


class H2:
    """One raw HTTP/2 connection to 127.0.0.1: frames written as given, read one at a time;
    a header block split over CONTINUATION frames is read as one HEADERS frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.hpack = HpackDecoder()
        self.peer: dict[int, int] = {}  # the server's SETTINGS

    @classmethod
    async def open(cls, port: int, values: dict[int, int] | None = None) -> "H2":
        """Connected, with the preface and our SETTINGS (``values``) sent."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        conn = cls(reader, writer)
        writer.write(PREFACE + settings(values or {}))
        await conn.drain()
        return conn

    async def drain(self) -> None:
        await asyncio.wait_for(self.writer.drain(), 30)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read(self, timeout: float | None = None) -> tuple[int, int, int, bytes]:
        """The next frame as (type, flags, stream, payload); EOFError when the server has
        closed the connection, TimeoutError after ``timeout`` s."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), timeout)
            kind, flags, stream = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = await asyncio.wait_for(self.reader.readexactly(int.from_bytes(head[:3], "big")), 30)
            if kind == HEADERS and not flags & END_HEADERS:
                while True:
                    more = await asyncio.wait_for(self.reader.readexactly(9), 30)
                    payload += await asyncio.wait_for(self.reader.readexactly(int.from_bytes(more[:3], "big")), 30)
                    if more[4] & END_HEADERS:
                        break
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise EOFError("closed by the server") from e
        if kind == SETTINGS and not flags & ACK:
            self.peer.update((int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(payload[i + 2 : i + 6], "big"))
                             for i in range(0, len(payload) - 5, 6))
        return kind, flags, stream, payload

    def ended(self, kind: int, flags: int, payload: bytes) -> str | None:
        """What a frame says about the end of its stream or connection, else None: the gRPC
        status of trailers (by name), ``RST_STREAM CODE``, ``GOAWAY CODE``."""
        if kind == HEADERS:
            if flags & 0x8:  # PADDED
                payload = payload[1 : len(payload) - payload[0]]
            if flags & 0x20:  # PRIORITY
                payload = payload[5:]
            fields = self.hpack.decode(payload)
            if flags & END_STREAM or "grpc-status" in fields:
                return _STATUS.get(fields.get("grpc-status", ""), f"grpc-status {fields.get('grpc-status', '?')}")
            return None
        if kind == RST_STREAM:
            return f"RST_STREAM {error_name(int.from_bytes(payload[:4], 'big'))}"
        if kind == GOAWAY:
            return f"GOAWAY {error_name(int.from_bytes(payload[4:8], 'big'))}"
        return None

    def answer(self, kind: int, flags: int, payload: bytes, ack_settings: bool = True) -> None:
        """What a well-behaved peer answers: PING and (unless told not to) SETTINGS acknowledged."""
        if kind == PING and not flags & ACK:
            self.send(frame(PING, ACK, 0, payload))
        elif kind == SETTINGS and not flags & ACK and ack_settings:
            self.send(frame(SETTINGS, ACK, 0))

    async def exchange(self, timeout: float | None = None,
                       ack_settings: bool = True) -> tuple[int, int, int, bytes, str | None]:
        """The next frame (:meth:`read`), answered as a well-behaved peer would
        (:meth:`answer`), and what it says of its stream's or connection's end
        (:meth:`ended`): (type, flags, stream, payload, end or None)."""
        kind, flags, stream, payload = await self.read(timeout)
        self.answer(kind, flags, payload, ack_settings)
        return kind, flags, stream, payload, self.ended(kind, flags, payload)

    def close(self) -> None:
        self.writer.transport.abort()


async def unread_calls(port: int, path: str, token: str | None, message: bytes, calls: int,
                       timeout: float = 10.0) -> tuple[list[str], H2]:
    """A client that never reads its answers: ``calls`` calls of ``path`` with ``message``
    (a serialised request), one after the other on one connection whose receive window is 0,
    each sent once the server has sent the previous one's first HEADERS (the server can
    send headers, never a message). Returns, for each call, "held" (its answer waits in the
    server) or "CODE: message" (how the server refused it), and the connection, left open
    (``close`` it on the loop that made it). What it sends keeps to the server's connection
    window."""
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    conn = await H2.open(port, {HEADER_TABLE_SIZE: 0, INITIAL_WINDOW_SIZE: 0})
    window = 65_535  # what the connection may still send: the server's WINDOW_UPDATEs widen it
    outcomes: list[str] = []
    answered: dict[int, str] = {}

    async def read() -> None:
        nonlocal window
        kind, flags, stream, payload = await conn.read(timeout)
        conn.answer(kind, flags, payload)
        if kind == WINDOW_UPDATE and stream == 0:
            window += int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        elif kind == HEADERS and stream not in answered:
            fields = conn.hpack.decode(payload)  # no dynamic table (HEADER_TABLE_SIZE 0): safe to decode here
            status = fields.get("grpc-status")
            answered[stream] = "held" if status is None else f"{_STATUS.get(status, status)}: " \
                                                              f"{fields.get('grpc-message', '')}"

    for i in range(calls):
        stream = 2 * i + 1
        while window < len(body):
            await read()
        conn.send(headers_frames(stream, header_block(grpc_fields(port, path, token))))
        for at in range(0, len(body), FRAME_BYTES):
            conn.send(frame(DATA, END_STREAM if at + FRAME_BYTES >= len(body) else 0, stream,
                            body[at : at + FRAME_BYTES]))
        window -= len(body)
        await conn.drain()
        while stream not in answered:
            await read()
        outcomes.append(answered[stream])
    return outcomes, conn
