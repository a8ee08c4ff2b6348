"""Moses n-best lists: streamed reading and byte-exact writing of both formats.

Moses has written two n-best formats over the years; one parser reads both:

* labelled: ``ID ||| hyp ||| Name0= v v  Other0= v ||| total [||| extra ...]``
* old: ``ID ||| hyp ||| d: v v lm: v tm: v v w: v ||| total`` (some lists use ``d=``)

A feature label is a token ending in ``=`` or ``:``; the numbers after it are its values.
A label containing ``_`` is a sparse feature (Moses' extractor reads ``_`` that way): it
is kept in the line but not among the dense features.

Every entry keeps its raw line (terminator included), so writing the entries of a list
back gives the input byte for byte; :func:`add_feature` splices one new dense feature
in right after the last feature value, before the ``|||`` of the total, and leaves every
other byte as it was. Lists are read as a generator of per-sentence groups, so lists of
millions of lines are never held in memory.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import logging
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import IO, Iterator, Sequence, cast

from ..common.errors import InputError, NbestFormatError
from ..common.paths import atomic_output, fsync_dir

log = logging.getLogger(__name__)

SEPARATOR = "|||"
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class NbestEntry:
    """One hypothesis of an n-best list.

    Fields:
        sent_id: the sentence number (first field).
        hyp: the hypothesis text, stripped of surrounding blanks.
        dense: dense feature groups in file order, ``(name, values)``; names without
            the trailing ``=``/``:``.
        sparse: sparse features ``(name, value)`` (labels containing ``_``).
        total: the decoder's model score (fourth field).
        raw: the line exactly as read, with its line terminator (if it had one).
        label_sep: ``"="`` or ``":"``, the label suffix this line uses.
        line_no: 1-based line number in the file.
    """

    sent_id: int
    hyp: str
    dense: tuple[tuple[str, tuple[float, ...]], ...]
    sparse: tuple[tuple[str, float], ...]
    total: float
    raw: str
    label_sep: str
    line_no: int

    def dense_values(self) -> list[float]:
        """All dense values flattened in file order."""
        return [v for _, values in self.dense for v in values]

    def layout(self) -> tuple[tuple[str, int], ...]:
        """The dense layout of this line: ``(name, number of values)`` per group."""
        return tuple((name, len(values)) for name, values in self.dense)


@dataclass
class ReadStats:
    """Counters of one read: lines read, entries yielded, bad lines skipped."""

    lines: int = 0
    entries: int = 0
    sentences: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)


def is_gzip(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with the gzip magic bytes (or is named ``.gz`` and empty)."""
    with open(path, "rb") as handle:
        head = handle.read(2)
    return head == _GZIP_MAGIC or (not head and str(path).endswith(".gz"))


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a plain or gzip file for binary reading (gzip detected by its magic bytes);
    InputError naming the file when it cannot be opened."""
    try:
        if is_gzip(path):
            return cast(IO[bytes], gzip.open(path, "rb"))
        return open(path, "rb")
    except FileNotFoundError as exc:
        raise InputError("no such file", os.fspath(path)) from exc
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", os.fspath(path)) from exc


_FLOAT_WORDS = frozenset({"inf", "infinity", "nan"})


def _is_label(token: str) -> bool:
    if len(token) < 2 or token[-1] not in "=:":
        return False
    if token[0].isalpha() and token[:-1].lower().lstrip("+-") not in _FLOAT_WORDS:
        return True
    try:
        float(token[:-1])
    except ValueError:
        return True
    return False


def parse_line(raw: str, path: str, line_no: int) -> NbestEntry:
    """Parse one n-best line (``raw`` may end in ``\\n``); NbestFormatError if malformed."""
    fields = raw.rstrip("\r\n").split(SEPARATOR)
    if len(fields) < 4:
        raise NbestFormatError(f"expected at least 4 '|||'-separated fields, found {len(fields)}", path, line_no)
    try:
        sent_id = int(fields[0])
    except ValueError as exc:
        raise NbestFormatError(f"sentence id {fields[0].strip()!r} is not an integer", path, line_no) from exc
    if sent_id < 0:
        raise NbestFormatError(f"negative sentence id {sent_id}", path, line_no)
    try:
        total = float(fields[3])
    except ValueError as exc:
        raise NbestFormatError(f"total score {fields[3].strip()!r} is not a number", path, line_no) from exc
    dense: list[tuple[str, tuple[float, ...]]] = []
    sparse: list[tuple[str, float]] = []
    label_sep = "="
    name: str | None = None
    values: list[float] = []
    sparse_name: str | None = None
    for token in fields[2].split():
        last = token[-1]
        if (last == "=" or last == ":") and _is_label(token):
            if sparse_name is not None:
                raise NbestFormatError(f"sparse feature {sparse_name!r} has no value", path, line_no)
            if name is not None:
                dense.append((name, tuple(values)))
                name = None
            label_sep = token[-1]
            if "_" in token:
                sparse_name = token[:-1]
            else:
                name, values = token[:-1], []
            continue
        try:
            value = float(token)
        except ValueError as exc:
            raise NbestFormatError(f"feature value {token!r} is not a number", path, line_no) from exc
        if math.isnan(value):
            raise NbestFormatError(f"feature value {token!r} is not a number", path, line_no)
        if sparse_name is not None:
            sparse.append((sparse_name, value))
            sparse_name = None
        elif name is None:
            raise NbestFormatError(f"feature value {token!r} before any feature label", path, line_no)
        else:
            values.append(value)
    if sparse_name is not None:
        raise NbestFormatError(f"sparse feature {sparse_name!r} has no value", path, line_no)
    if name is not None:
        dense.append((name, tuple(values)))
    return NbestEntry(sent_id, fields[1].strip(), tuple(dense), tuple(sparse), total, raw, label_sep, line_no)


def iter_entries(
    path: str | os.PathLike[str], *, skip_bad: bool = False, stats: ReadStats | None = None
) -> Iterator[NbestEntry]:
    """Yield the entries of an n-best list one by one (blank lines are ignored).

    Malformed lines raise NbestFormatError naming file and line, or with ``skip_bad``
    are counted in ``stats.bad_lines`` and logged.
    """
    stats = stats if stats is not None else ReadStats()
    name = os.fspath(path)
    with open_binary(path) as handle:
        for line_no, data in enumerate(_lines(handle, name), start=1):
            stats.lines += 1
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                error = NbestFormatError(f"not UTF-8 ({exc.reason} at byte {exc.start})", name, line_no)
                if not skip_bad:
                    raise error from exc
                _count_bad(stats, error)
                continue
            if not raw.strip():
                continue
            try:
                entry = parse_line(raw, name, line_no)
            except NbestFormatError as error:
                if not skip_bad:
                    raise
                _count_bad(stats, error)
                continue
            stats.entries += 1
            yield entry


def _lines(handle: IO[bytes], name: str) -> Iterator[bytes]:
    """The lines of ``handle``; a damaged gzip stream is an NbestFormatError naming the line.

    A damaged stream cannot be resynchronised, so this is an error even with ``skip_bad``.
    """
    line_no = 0
    while True:
        try:
            data = handle.readline()
        except (EOFError, zlib.error, OSError) as exc:
            raise NbestFormatError(f"damaged or truncated gzip data ({exc})", name, line_no + 1) from exc
        if not data:
            return
        line_no += 1
        yield data


def _count_bad(stats: ReadStats, error: NbestFormatError) -> None:
    stats.bad_lines += 1
    if len(stats.bad_examples) < 5:
        stats.bad_examples.append(str(error))
    log.warning("skipping bad n-best line: %s", error)


def iter_sentences(
    path: str | os.PathLike[str], *, skip_bad: bool = False, stats: ReadStats | None = None
) -> Iterator[list[NbestEntry]]:
    """Yield the hypotheses of an n-best list grouped by consecutive sentence id.

    Only one group is held in memory at a time; order within and across groups is kept.
    Moses writes a sentence's hypotheses together and the sentences in increasing id
    order; a sentence id lower than the one before it (a shuffled or concatenated list,
    which would split a sentence or mix two lists) is an NbestFormatError naming
    ``file:line``, with ``skip_bad`` too (the line is well-formed; the list is not).
    """
    stats = stats if stats is not None else ReadStats()
    group: list[NbestEntry] = []
    for entry in iter_entries(path, skip_bad=skip_bad, stats=stats):
        if group and entry.sent_id != group[0].sent_id:
            if entry.sent_id < group[0].sent_id:
                raise NbestFormatError(
                    f"sentence id {entry.sent_id} after sentence {group[0].sent_id}: an n-best list holds "
                    "its sentences in increasing id order, each sentence's hypotheses together",
                    os.fspath(path), entry.line_no)
            stats.sentences += 1
            yield group
            group = []
        group.append(entry)
    if group:
        stats.sentences += 1
        yield group


def check_feature_name(name: str) -> None:
    """Reject names Moses would misread: empty, with ``_`` (sparse), blanks, ``=``/``:``/``|``."""
    if not name or "_" in name or any(c.isspace() or c in "=:|" for c in name):
        raise ValueError(
            f"feature name {name!r} is not a valid dense feature name "
            "(no '_', which Moses' extractor reads as sparse, no blanks, '=', ':' or '|')"
        )


def feature_name(text: str) -> str:
    """argparse type of a dense feature's name (the rule: :func:`check_feature_name`)."""
    try:
        check_feature_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def format_value(value: float) -> str:
    """A feature value as Moses prints it (C++ stream default: 6 significant digits)."""
    if value == 0:
        return "0"
    return format(value, ".6g")


def add_feature(entry: NbestEntry, name: str, values: Sequence[float]) -> str:
    """The raw line of ``entry`` with ``name= v …`` added as the last dense feature.

    The new label uses the line's own label suffix (``=`` or ``:``); it is inserted right
    after the last non-blank character of the feature field, so the spacing before
    the total's ``|||`` (and every other byte of the line) stays as it was.
    """
    check_feature_name(name)
    raw = entry.raw
    start = _field_start(raw, 2)
    end = raw.index(SEPARATOR, start)
    addition = " ".join([name + entry.label_sep, *(format_value(v) for v in values)])
    content = raw[start:end]
    stripped = content.rstrip()
    if stripped.strip():
        insert_at = start + len(stripped)
        return raw[:insert_at] + " " + addition + raw[insert_at:]
    # An empty feature field: keep one blank on each side of the new feature.
    return raw[:start] + " " + addition + " " + raw[end:]


def _field_start(raw: str, index: int) -> int:
    """Offset of the first character of field ``index`` (0-based) in ``raw``."""
    position = 0
    for _ in range(index):
        position = raw.index(SEPARATOR, position) + len(SEPARATOR)
    return position


class NbestWriter:
    """Writes raw n-best lines to a plain or gzip file (gzip when the name ends in .gz).

    The output appears atomically: it is written to ``path + '.tmp'``, fsynced and
    renamed over ``path`` on :meth:`close`; :meth:`abort` removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.tmp_path = self.path + ".tmp"
        raw_handle = open(self.tmp_path, "wb")
        self._raw = raw_handle
        self._handle: IO[bytes] = raw_handle
        if self.path.endswith(".gz"):
            self._handle = cast(IO[bytes], gzip.GzipFile(fileobj=raw_handle, mode="wb", mtime=0))
        self.lines = 0

    def write(self, line: str) -> None:
        self._handle.write(line.encode("utf-8"))
        self.lines += 1

    def write_entries(self, entries: Sequence[NbestEntry]) -> None:
        for entry in entries:
            self.write(entry.raw)

    def close(self) -> None:
        if self._handle is not self._raw:
            self._handle.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path)

    def abort(self) -> None:
        try:
            self._raw.close()
        finally:
            if os.path.exists(self.tmp_path):
                os.remove(self.tmp_path)

    def __enter__(self) -> "NbestWriter":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename; nothing is left
    when writing fails)."""
    with atomic_output(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """The lines of a plain or gzip UTF-8 text file, without terminators."""
    name = os.fspath(path)
    try:
        with open_binary(path) as handle:
            text = io.TextIOWrapper(handle, encoding="utf-8", newline=None).read()
    except UnicodeDecodeError as exc:
        raise NbestFormatError(f"not UTF-8 ({exc.reason})", name) from exc
    except (EOFError, zlib.error, OSError) as exc:
        raise NbestFormatError(f"cannot read: {exc}", name) from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
