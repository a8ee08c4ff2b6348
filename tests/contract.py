"""The contract folder (proto/contract): one golden file per rule that Python and C++ both
implement. Each file is tab-separated, one case a line; blank lines and lines starting
with ``#`` are comments (proto/contract/README.md)."""

from __future__ import annotations


from support import REPO

CONTRACT = REPO / "proto" / "contract"


def cases(name: str, columns: int) -> list[list[str]]:
    """The cases of ``proto/contract/NAME``, each a list of ``columns`` fields."""
    out = []
    for number, line in enumerate((CONTRACT / name).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        assert len(fields) == columns, f"{name}:{number}: {len(fields)} fields, not {columns}"
        out.append(fields)
    return out


def unescape(text: str) -> bytes:
    r"""A field written with the escapes ``\n \r \t \v \f \\ \xHH`` → its bytes (UTF-8)."""
    out = bytearray()
    i = 0
    raw = text.encode("utf-8")
    simple = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("v"): b"\v", ord("f"): b"\f", ord("\\"): b"\\"}
    while i < len(raw):
        if raw[i] == ord("\\") and i + 1 < len(raw):
            if raw[i + 1] in simple:
                out += simple[raw[i + 1]]
                i += 2
                continue
            if raw[i + 1] == ord("x") and i + 3 < len(raw):
                out.append(int(raw[i + 2:i + 4], 16))
                i += 4
                continue
        out.append(raw[i])
        i += 1
    return bytes(out)
