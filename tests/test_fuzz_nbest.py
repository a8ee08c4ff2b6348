"""Property-based fuzzing of the n-best reader (``moses_plugin.nbest``).

Files are built from lines whose fate is known (well-formed lines with their expected
fields, lines with one known defect) and from random text and bytes whose fate is not.
Whatever the input: every line is either parsed or refused with ``NbestFormatError`` naming
``file:line``; no other exception escapes; ``skip_bad`` counts the refused lines and keeps
the others.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nlmserve.common.errors import NbestFormatError
from nlmserve.moses_plugin.nbest import NbestEntry, ReadStats, iter_entries, iter_sentences

FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLOAT_WORDS = {"inf", "infinity", "nan"}


@dataclass(frozen=True)
class Line:
    """One generated line (no ``\\n`` inside) and what the reader must make of it."""

    data: bytes
    good: bool | None  # None: unknown (random input)
    sent_id: int = 0
    hyp: str = ""
    total: float = 0.0
    dense: tuple[tuple[str, tuple[float, ...]], ...] = ()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nlmserve-fuzz-nbest-") as d:
        yield Path(d)


def number(x: float) -> str:
    return repr(x)


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
label = st.from_regex(r"\A[A-Za-z][A-Za-z0-9]{0,8}\Z").filter(lambda s: s.lower() not in FLOAT_WORDS)
hyp_text = st.text(st.characters(blacklist_characters="\n\r", blacklist_categories=["Cs"]), max_size=30).filter(
    lambda s: "|||" not in s and "\x85" not in s)


@st.composite
def good_line(draw: st.DrawFn) -> Line:
    sent_id = draw(st.integers(0, 10**9))
    hyp = draw(hyp_text)
    dense = draw(st.lists(st.tuples(label, st.lists(finite, min_size=1, max_size=3).map(tuple)), max_size=4))
    total = draw(finite)
    blank = draw(st.sampled_from([" ", "  ", "\t"]))
    feats = blank.join(f"{name}= " + " ".join(number(v) for v in values) for name, values in dense)
    extra = draw(st.sampled_from(["", " ||| 0-0 1-1", " ||| "]))
    end = draw(st.sampled_from(["", "\r"]))
    text = f"{sent_id} ||| {hyp} ||| {feats} ||| {number(total)}{extra}{end}"
    return Line(text.encode("utf-8"), True, sent_id, hyp.strip(), total, tuple((n, tuple(v)) for n, v in dense))


DEFECTS = {
    "three fields": "0 ||| a b ||| LM0= -1",
    "id not a number": "x1 ||| a b ||| LM0= -1 ||| -1",
    "negative id": "-3 ||| a b ||| LM0= -1 ||| -1",
    "total not a number": "0 ||| a b ||| LM0= -1 ||| total",
    "value before a label": "0 ||| a b ||| -1 LM0= -1 ||| -1",
    "value not a number": "0 ||| a b ||| LM0= -1x ||| -1",
    "nan value": "0 ||| a b ||| LM0= nan ||| -1",
    "sparse feature without value": "0 ||| a b ||| LM0= -1 tm_x= ||| -1",
    "one field": "just some words",
}


@st.composite
def bad_line(draw: st.DrawFn) -> Line:
    kind = draw(st.sampled_from(sorted(DEFECTS) + ["invalid utf-8"]))
    if kind == "invalid utf-8":
        good = draw(good_line())
        cut = draw(st.integers(0, len(good.data)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf8\x88\x80\x80\x80"]))
        return Line(good.data[:cut] + junk + good.data[cut:], False)
    return Line(DEFECTS[kind].encode("utf-8"), False)


random_line = st.one_of(
    st.binary(max_size=60).map(lambda b: Line(b.replace(b"\n", b" "), None)),
    st.text(max_size=60).map(lambda t: Line(t.encode("utf-8", "surrogatepass").replace(b"\n", b" "), None)),
    st.lists(st.sampled_from(["|||", "0", "-1.5", "LM0=", "d:", "tm_a=", "inf", "nan", "a", " ", "1e999", "=", ":"]),
             max_size=14).map(lambda ts: Line(" ".join(ts).encode(), None)),
)


def write(workdir: Path, lines: list[Line], gz: bool, blank_every: int) -> Path:
    blob = b"".join(line.data + b"\n" + (b"\n" if blank_every and i % blank_every == 0 else b"")
                    for i, line in enumerate(lines))
    fd, name = tempfile.mkstemp(dir=workdir, suffix=".nbest.gz" if gz else ".nbest")
    os.close(fd)
    path = Path(name)
    path.write_bytes(gzip.compress(blob, mtime=0) if gz else blob)
    return path


def line_numbers(lines: list[Line], blank_every: int) -> list[int]:
    """1-based physical line number of each generated line (blank lines counted)."""
    out, n = [], 0
    for i in range(len(lines)):
        n += 1
        out.append(n)
        if blank_every and i % blank_every == 0:
            n += 1
    return out


def is_blank(data: bytes) -> bool:
    try:
        return not (data + b"\n").decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def read_all(path: Path, skip_bad: bool) -> tuple[list[NbestEntry], ReadStats]:
    stats = ReadStats()
    return list(iter_entries(path, skip_bad=skip_bad, stats=stats)), stats


# ------------------------------------------------------------------ lines of known fate
@FUZZ
@given(lines=st.lists(st.one_of(good_line(), good_line(), bad_line()), max_size=25), gz=st.booleans(),
       blank_every=st.sampled_from([0, 0, 3]))
def test_known_lines_are_parsed_or_refused_with_file_and_line(workdir: Path, lines: list[Line], gz: bool,
                                                              blank_every: int) -> None:
    path = write(workdir, lines, gz, blank_every)
    numbers = line_numbers(lines, blank_every)
    bad = [numbers[i] for i, line in enumerate(lines) if not line.good]
    good = [line for line in lines if line.good]
    try:
        if bad:
            with pytest.raises(NbestFormatError) as err:
                read_all(path, skip_bad=False)
            assert str(err.value).startswith(f"{path}:{bad[0]}: "), str(err.value)
            assert err.value.path == str(path) and err.value.line == bad[0]
        entries, stats = read_all(path, skip_bad=True)
        assert stats.bad_lines == len(bad)
        assert len(stats.bad_examples) == min(5, len(bad))
        assert [e.line_no for e in entries] == [numbers[i] for i, line in enumerate(lines) if line.good]
        for entry, line in zip(entries, good):
            assert entry.sent_id == line.sent_id
            assert entry.hyp == line.hyp
            assert entry.total == line.total
            assert entry.dense == line.dense
            assert entry.raw.encode("utf-8") == line.data + b"\n"
        # The sentences must come in increasing id order: the first good line whose id is
        # below its group's predecessor is refused, naming its line.
        good_numbers = [numbers[i] for i, line in enumerate(lines) if line.good]
        backwards = next((n for n, prev, line in zip(good_numbers[1:], good, good[1:])
                          if line.sent_id < prev.sent_id), None)
        if backwards is not None:
            with pytest.raises(NbestFormatError) as err:
                list(iter_sentences(path, skip_bad=True))
            assert err.value.line == backwards and "increasing id order" in str(err.value)
        else:
            groups = list(iter_sentences(path, skip_bad=True))
            assert sum(len(g) for g in groups) == len(good)
            assert all(len({e.sent_id for e in g}) == 1 for g in groups)
    finally:
        path.unlink()


# ------------------------------------------------------------------ random lines
@FUZZ
@given(lines=st.lists(st.one_of(random_line, good_line(), bad_line()), min_size=1, max_size=25),
       gz=st.booleans())
@example(lines=[Line(b"\x1f\x8b", None), Line(b"000000", None)], gz=False)  # gzip's magic, plain
def test_random_lines_never_raise_anything_but_nbest_format_error(workdir: Path, lines: list[Line],
                                                                  gz: bool) -> None:
    path = write(workdir, lines, gz, 0)
    try:
        if not gz and path.read_bytes()[:2] == b"\x1f\x8b":
            # a plain file that opens with gzip's magic is read as gzip, and is damaged gzip:
            # the whole file is refused, skip_bad or not (no line of it can be read)
            for skip_bad in (False, True):
                with pytest.raises(NbestFormatError, match="damaged or truncated gzip data") as err:
                    read_all(path, skip_bad=skip_bad)
                assert err.value.path == str(path) and err.value.line == 1
            return
        try:
            strict = len(read_all(path, skip_bad=False)[0])
        except NbestFormatError as e:
            assert e.path == str(path) and e.line is not None and 1 <= e.line <= len(lines)
            assert str(e).startswith(f"{path}:{e.line}: ")
            strict = None
        entries, stats = read_all(path, skip_bad=True)  # never raises on a readable file
        blank = sum(1 for line in lines if is_blank(line.data))
        assert len(entries) + stats.bad_lines + blank == len(lines) == stats.lines
        assert stats.entries == len(entries)
        if strict is not None:
            assert stats.bad_lines == 0 and strict == len(entries)
        else:
            assert stats.bad_lines >= 1
        raws = {e.raw.encode("utf-8") for e in entries}
        assert all(line.data + b"\n" in raws for line in lines if line.good)
    finally:
        path.unlink()


# ------------------------------------------------------------------ damaged gzip
@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_gzip_is_a_format_error_naming_the_file(workdir: Path, damage: str) -> None:
    data = gzip.compress(b"0 ||| a b ||| LM0= -1 ||| -1\n" * 2000, mtime=0)
    data = data[: len(data) // 2] if damage == "truncated" else data[:20] + b"\x00garbage" * 20
    path = workdir / f"{damage}.nbest.gz"
    path.write_bytes(data)
    with pytest.raises(NbestFormatError, match=str(path)):
        read_all(path, skip_bad=True)
