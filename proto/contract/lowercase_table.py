"""Writes the C++ lowercasing tables (client/cpp/nlmserve_lowercase.h) from Python's
``str.lower``, the rule's owner, so that the C++ client lowercases as Python does with no
locale: the simple mappings as runs, U+0130 (the one code point that lowercases to two),
and for the final sigma the code points that are case-ignorable and those that are cased
(and not case-ignorable), read off ``str.lower``'s own answers.

    python proto/contract/lowercase_table.py           # rewrite the header
    python proto/contract/lowercase_table.py --check   # exit 1 when it is not what this Python writes

Before writing, the tables are checked against ``str.lower`` through a Python copy of the
C++ algorithm: every code point alone and in the sigma contexts.
"""

from __future__ import annotations

import argparse
import sys
import unicodedata
from pathlib import Path

HEADER = Path(__file__).resolve().parents[2] / "client" / "cpp" / "nlmserve_lowercase.h"
SIGMA, FINAL, MEDIAL = 0x3A3, "\u03c2", "\u03c3"
Run = tuple[int, int, int, int]  # first, last, step, delta
Range = tuple[int, int]


def code_points() -> list[int]:
    return [cp for cp in range(0x110000) if not 0xD800 <= cp < 0xE000]


def runs() -> list[Run]:
    """The single-code-point mappings as runs: cp in [first, last], (cp - first) % step == 0
    → cp + delta (U+0130 and Σ apart)."""
    pairs = [(cp, ord(chr(cp).lower()) - cp) for cp in code_points()
             if cp not in (0x130, SIGMA) and chr(cp).lower() != chr(cp)]
    assert all(len(chr(cp).lower()) == 1 for cp, _ in pairs)
    out: list[Run] = []
    i = 0
    while i < len(pairs):
        cp, delta = pairs[i]
        best = (1, 1)
        for step in (1, 2):
            n = 1
            while i + n < len(pairs) and pairs[i + n] == (cp + step * n, delta):
                n += 1
            if n > best[0]:
                best = (n, step)
        n, step = best
        out.append((cp, cp + step * (n - 1), step, delta))
        i += n
    return out


def ranges(keep: list[bool]) -> list[Range]:
    out: list[Range] = []
    start = None
    for cp in range(0x110001):
        on = cp < 0x110000 and keep[cp]
        if on and start is None:
            start = cp
        elif not on and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def sigma_classes() -> tuple[list[Range], list[Range]]:
    """(case-ignorable, cased and not case-ignorable): "A" c "Σ" ends final when c is either;
    c "Σ" when c is cased and not case-ignorable (Python's Final_Sigma test skips the
    case-ignorable code points before it asks whether one is cased)."""
    ignorable = [False] * 0x110000
    cased = [False] * 0x110000
    for cp in code_points():
        c = chr(cp)
        either = ("A" + c + "\u03a3").lower()[-1] == FINAL
        cased[cp] = (c + "\u03a3").lower()[-1] == FINAL
        ignorable[cp] = either and not cased[cp]
    return ranges(ignorable), ranges(cased)


def lower(text: str, table: list[Run], ignorable: list[Range], cased: list[Range]) -> str:
    """The C++ Lowercase, in Python: what the header's tables give."""
    def within(cp: int, rs: list[Range]) -> bool:
        return any(a <= cp <= b for a, b in rs)

    def mapped(cp: int) -> int:
        for first, last, step, delta in table:
            if first <= cp <= last and (cp - first) % step == 0:
                return cp + delta
        return cp

    cps = [ord(c) for c in text]
    out = []
    for i, cp in enumerate(cps):
        if cp == 0x130:
            out.append("i\u0307")
        elif cp == SIGMA:
            j = i - 1
            while j >= 0 and within(cps[j], ignorable):
                j -= 1
            final = j >= 0 and within(cps[j], cased)
            j = i + 1
            while final and j < len(cps) and within(cps[j], ignorable):
                j += 1
            final = final and (j == len(cps) or not within(cps[j], cased))
            out.append(FINAL if final else MEDIAL)
        else:
            out.append(chr(mapped(cp)))
    return "".join(out)


def check(table: list[Run], ignorable: list[Range], cased: list[Range]) -> None:
    """The tables give ``str.lower`` for every code point alone and around a sigma."""
    fast = {cp: cp + d for first, last, step, d in table for cp in range(first, last + 1, step)}
    for cp in code_points():
        if cp not in (0x130, SIGMA):
            assert chr(fast.get(cp, cp)) == chr(cp).lower(), hex(cp)
    samples = [cp for cp in code_points() if cp < 0x3000 or cp % 97 == 0]
    for cp in samples:
        c = chr(cp)
        for text in ("A" + c + "\u03a3", c + "\u03a3", "A\u03a3" + c, "A\u03a3" + c + "B", "A" + c + "\u03a3" + c,
                     "\u03a3" + c):
            assert lower(text, table, ignorable, cased) == text.lower(), (hex(cp), text)


def rows(items: list[tuple[int, ...]], per_line: int) -> str:
    cells = ["{" + ", ".join(f"{x:#x}" if x >= 0 else f"-{-x:#x}" for x in item) + "}" for item in items]
    return "\n".join("    " + ", ".join(cells[i:i + per_line]) + "," for i in range(0, len(cells), per_line))


def header() -> str:
    table = runs()
    ignorable, cased = sigma_classes()
    check(table, ignorable, cased)
    version = unicodedata.unidata_version
    return f"""// Generated by proto/contract/lowercase_table.py from Python's str.lower (Unicode
// {version}); do not edit. nlmserve::Lowercase (nlmserve_words.h) reads it, so that
// the C++ client lowercases as the Python owner does, in any locale.
#ifndef NLMSERVE_LOWERCASE_H
#define NLMSERVE_LOWERCASE_H

#include <cstdint>

namespace nlmserve {{
namespace lowercase {{

const char kUnicodeVersion[] = "{version}";

// Code point cp in [first, last] with (cp - first) % step == 0 lowercases to cp + delta
// (sorted, disjoint; U+0130 and U+03A3 are handled apart).
struct Run {{
  uint32_t first, last, step;
  int32_t delta;
}};
const Run kRuns[] = {{
{rows(table, 4)}
}};

struct Range {{
  uint32_t first, last;
}};
// For the final sigma: the case-ignorable code points, skipped around a U+03A3 ...
const Range kCaseIgnorable[] = {{
{rows(ignorable, 6)}
}};
// ... and the cased ones (not case-ignorable) that make it final when one is before it
// and none after.
const Range kCased[] = {{
{rows(cased, 6)}
}};

}}  // namespace lowercase
}}  // namespace nlmserve

#endif  // NLMSERVE_LOWERCASE_H
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the header instead of writing it")
    args = parser.parse_args()
    text = header()
    if args.check:
        if HEADER.read_text(encoding="utf-8") != text:
            print(f"{HEADER} is not what this Python writes; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    HEADER.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
