"""Bring tokenised text into the form of a Moses system's target side (``nlmserve normalize``).

A neural LM helps a Moses system only when its training text is in the form of the
hypotheses it scores. The shipped data and the newstest n-best lists are "lc-moses":
Moses-tokenised, lowercased, with the typographic apostrophe ``’`` as ``'``, the possessive
attached (``country 's``, not ``country ' s``) and hyphens between letters or digits split
as Moses' ``tokenizer.perl -a`` does (``long @-@ term``). Text that was tokenised without
``-a`` (an in-domain news corpus, say) differs from such lists in about one sentence of
three, and every such difference is an unknown word to the model.

Each step is one option of :class:`TextForm`; ``TextForm.lc_moses()`` turns them all on.
Applied to ``europarl.dev.tok.en`` it gives ``europarl.dev.lc-moses.en`` byte for byte.
Lines are kept one for one (an empty line stays empty), so references stay aligned with
their sources; runs of white space become one space.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

from ..common.errors import CorpusError
from .corpus import decode_lines, open_text_lines

# Moses' tokenizer.perl -a: s/([\p{IsAlnum}])\-(?=[\p{IsAlnum}])/$1 \@-\@ /g
_HYPHEN = re.compile(r"(?<=[^\W_])-(?=[^\W_])")
# "country ' s" (the apostrophe split off as a quote) → "country 's" (Moses' English possessive)
_POSSESSIVE = re.compile(r"(?<=\w) ' s\b")


@dataclass(frozen=True)
class TextForm:
    """What ``normalize_line`` does, step by step, in this order.

    Fields:
        lowercase: ``str.lower`` of the whole line.
        apostrophes: ``’`` (U+2019) → ``'``, then ``X ' s`` → ``X 's``.
        split_hyphens: ``a-b`` → ``a @-@ b`` between letters or digits (Moses' ``-a``).
    """

    lowercase: bool = False
    apostrophes: bool = False
    split_hyphens: bool = False

    @classmethod
    def lc_moses(cls) -> "TextForm":
        """The form of the shipped data and of the newstest n-best lists."""
        return cls(lowercase=True, apostrophes=True, split_hyphens=True)


def normalize_line(line: str, form: TextForm) -> str:
    """One line (without its terminator) in ``form``, tokens joined by single spaces."""
    if form.lowercase:
        line = line.lower()
    if form.apostrophes:
        line = _POSSESSIVE.sub(" 's", line.replace("\u2019", "'"))
    if form.split_hyphens:
        line = _HYPHEN.sub(" @-@ ", line)
    return " ".join(line.split())


def normalize_file(src: str, out: str, form: TextForm) -> int:
    """Write ``src`` (plain, .gz, .xz or ``-``) in ``form`` to ``out`` (``-``: stdout); lines written.

    A file is written next to its final name and renamed into place when complete, so an
    interrupted run leaves no partial output; ``.gz`` / ``.xz`` outputs are compressed.
    """
    lines = (normalize_line(line, form) for line in _read(src))
    if out == "-":
        return _write(lines, sys.stdout)
    target = Path(out)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        with _open_out(tmp, target.suffix) as handle:
            count = _write(lines, handle)
        os.replace(tmp, target)
    except OSError as exc:
        raise CorpusError(f"cannot write: {exc}", out) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return count


def _read(src: str) -> Iterator[str]:
    if src == "-":
        yield from decode_lines(sys.stdin.buffer, "<stdin>")
        return
    yield from open_text_lines(src)


def _open_out(path: Path, suffix: str) -> IO[str]:
    if suffix == ".gz":
        import gzip

        return gzip.open(path, "wt", encoding="utf-8", newline="\n")
    if suffix == ".xz":
        import lzma

        return lzma.open(path, "wt", encoding="utf-8", newline="\n")
    return open(path, "w", encoding="utf-8", newline="\n")


def _write(lines: Iterable[str], handle: IO[str]) -> int:
    count = 0
    for line in lines:
        handle.write(line + "\n")
        count += 1
    return count
