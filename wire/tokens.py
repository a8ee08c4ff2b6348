"""``nlmserve.wire.tokens``: what a token file holds, for the server and every client.

The rule (proto/contract/token_files.tsv has its cases; the C++ owner is
``nlmserve::ParseTokens`` in the C++ client library, which the native front end uses too):

* the file is split into lines at ``\\n``; each line is stripped of ASCII white space
  (space, ``\\t``, ``\\r``, ``\\v``, ``\\f``);
* a line left empty, or starting with ``#``, is skipped;
* any other line is one token: printable ASCII without white space (bytes 0x21–0x7E, what
  a gRPC metadata value carries), else the file is refused, naming the line;
* a file with no token is refused.

The server accepts every token of its file; a client sends the first.
"""

from __future__ import annotations

from ..common.errors import InputError

_WHITE = b" \t\r\v\f"


def parse_tokens(data: bytes, path: str) -> tuple[str, ...]:
    """The tokens of a token file's bytes; InputError naming ``path`` (and the line) when
    the file breaks the rule."""
    tokens = []
    for number, line in enumerate(data.split(b"\n"), 1):
        token = line.strip(_WHITE)
        if not token or token.startswith(b"#"):
            continue
        if any(b < 0x21 or b > 0x7E for b in token):
            raise InputError("a token is printable ASCII and holds no whitespace", path, number)
        tokens.append(token.decode("ascii"))
    if not tokens:
        raise InputError("token file holds no token", path)
    return tuple(tokens)


def read_tokens(path: str) -> tuple[str, ...]:
    """The tokens of the file ``path`` (any size; the server reads its file bounded,
    ``server.files.read_small_file``, and calls :func:`parse_tokens`)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"cannot read token file: {e.strerror}", path) from e
    return parse_tokens(data, path)
