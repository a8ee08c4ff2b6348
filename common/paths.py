"""``nlmserve.common.paths``: what a command checks of its files before it works, and how it
writes them.

The rule of every command (docs/DESIGN: what a user's mistake gets): the outputs are checked
first, then the inputs, and only then is anything read, trained or written, so that a
mistake costs a second, not a run, and nothing is left beside a refused output.

* :func:`check_output`: a file the command will write: not a directory nor a device, in a
  folder that exists and can be written, with room for it where its size is known.
* :func:`check_output_dir`: a work directory the command fills (made, parents included,
  when missing).
* :func:`check_input`: a file the command will read: it exists, is not a directory, can be
  opened, and its first bytes are of the expected :data:`kind <KINDS>`. Pipes and devices
  (``<(zcat …)``, ``/dev/stdin``) pass on their kind alone: their first bytes cannot be read
  without being taken from the reader.
* :func:`atomic_output`: a file written under a temporary name beside it and renamed over
  it when complete; removed when writing fails, so a refused or failed output leaves nothing.

Each check raises :class:`InputError` naming the file, which the command line prints as one
line with exit status 1.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import shutil
import stat
from typing import IO, Any, Iterator

from .errors import InputError

#: A text whose reader decompresses by the name's suffix (``.gz``, ``.xz``): training texts.
TEXT = "text"
#: A text whose reader detects gzip by its magic bytes: n-best lists, references, outputs.
LIST = "list"
#: An uncompressed UTF-8 text: weights, moses.ini, token files.
PLAIN = "plain"
#: A model file of ``nlmserve train`` (magic ``NLMSERVE``).
MODEL = "model"
#: A tables file of ``nlmserve export-tables`` (magic ``NLMTABLE``).
TABLES = "tables"
#: Either of the two (``nlmserve info``).
MODEL_OR_TABLES = "model-or-tables"
#: Any readable file (a Kneser-Ney model: ARPA text or KenLM's binary).
ANY = "any"
KINDS = (TEXT, LIST, PLAIN, MODEL, TABLES, MODEL_OR_TABLES, ANY)

_GZIP = b"\x1f\x8b"
_XZ = b"\xfd7zXZ\x00"
_MODEL = b"NLMSERVE"
_TABLES = b"NLMTABLE"
#: Bytes read to judge a text: enough for a line or two of any n-best list.
_HEAD = 4096


def check_output(path: str | os.PathLike[str], *, size: int | None = None) -> None:
    """Refuse an output ``path`` that cannot be written whole: a directory, a device or pipe
    (it is written under a temporary name and renamed over: a device would be replaced), a
    missing folder or one without write permission, and, when ``size`` (bytes) is given, a
    file system with less room than that."""
    name = os.fspath(path)
    try:
        st: os.stat_result | None = os.stat(name)
    except (FileNotFoundError, NotADirectoryError):
        st = None  # the folder's check below says what is wrong
    except OSError as exc:
        raise InputError(f"cannot write the output: {exc.strerror or exc}", name) from exc
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InputError("the output is a directory", name)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError("the output is not a regular file (it is written under a temporary name and renamed "
                         "over, which would replace it)", name)
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        what = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise InputError(f"cannot write the output: its folder {folder} {what}", name)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"cannot write the output: no permission to write into {folder}", name)
    if size is not None:
        free = shutil.disk_usage(folder).free
        if free < size:
            raise InputError(f"cannot write the output: it needs {size:,} bytes, {folder} has {free:,} free", name)


def check_output_dir(path: str | os.PathLike[str]) -> None:
    """Refuse a work directory that is a file, or that cannot be made (its nearest existing
    ancestor is not a writable directory) or written into."""
    name = os.fspath(path)
    if os.path.exists(name):
        if not os.path.isdir(name):
            raise InputError("not a directory", name)
        if not os.access(name, os.W_OK | os.X_OK):
            raise InputError("no permission to write into it", name)
        return
    parent = os.path.dirname(os.path.abspath(name))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InputError(f"cannot make the directory: {parent} is not a directory", name)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot make the directory: no permission to write into {parent}", name)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages ("a directory", "a FIFO", ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """``path`` opened read-only without waiting (a FIFO with no writer would block ``open``) and
    its ``fstat``: the descriptor, to read from, and what it is (the caller refuses what is not
    a regular file, ``stat.S_ISREG``). OSError as ``os.open`` raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        return fd, os.fstat(fd)
    except OSError:
        os.close(fd)
        raise


def check_input(path: str | os.PathLike[str], kind: str = ANY, *, empty_ok: bool = True) -> None:
    """Refuse an input that is missing, a directory, unreadable, of another kind than
    ``kind`` (one of :data:`KINDS`) by its first bytes, or (``empty_ok`` False) empty."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    name = os.fspath(path)
    try:
        st = os.stat(name)
        if stat.S_ISDIR(st.st_mode):
            raise InputError("a directory, not a file", name)
        if not stat.S_ISREG(st.st_mode):
            if kind in (MODEL, TABLES, MODEL_OR_TABLES):  # read in place: a FIFO would block
                raise InputError(f"{file_kind(st.st_mode)}, not a regular file (a model or tables file is read "
                                 "in place)", name)
            return  # a pipe or a device: reading it is the only check
        with open(name, "rb") as f:
            head = f.read(_HEAD)
    except FileNotFoundError as exc:
        raise InputError("no such file", name) from exc
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", name) from exc
    if not head:
        if not empty_ok:
            raise InputError("empty", name)
        if kind not in (MODEL, TABLES, MODEL_OR_TABLES):
            return
    problem = _kind_problem(name, head, kind)
    if problem:
        raise InputError(problem, name, _bad_byte_line(head) if problem.startswith("not UTF-8") else None)


def _kind_problem(name: str, head: bytes, kind: str) -> str:
    """Why ``head``, the first bytes of the file ``name``, are not of ``kind`` ("" if they are)."""
    if kind == ANY:
        return ""
    if kind in (MODEL, TABLES, MODEL_OR_TABLES):
        wanted = {MODEL: (_MODEL,), TABLES: (_TABLES,), MODEL_OR_TABLES: (_MODEL, _TABLES)}[kind]
        if head[:8] in wanted:
            return ""
        what = {MODEL: "an nlmserve model file", TABLES: "an nlmserve export-tables file",
                MODEL_OR_TABLES: "an nlmserve model file nor a tables file"}[kind]
        how = {MODEL: " (`nlmserve train` writes one)", TABLES: " (`nlmserve export-tables` writes one)",
               MODEL_OR_TABLES: ""}[kind]
        return f"not {what}: {_looks_like(head)}{how}"
    suffix = os.path.splitext(name)[1]
    if head.startswith(_GZIP):
        if kind == LIST or (kind == TEXT and suffix == ".gz"):
            return ""
        return ("gzip-compressed, but its name does not end in .gz (this reader decompresses by the name)"
                if kind == TEXT else "gzip-compressed: give the plain text")
    if head.startswith(_XZ):
        if kind == TEXT and suffix == ".xz":
            return ""
        return ("xz-compressed, but its name does not end in .xz (this reader decompresses by the name)"
                if kind == TEXT else "xz-compressed: give the plain text")
    if kind == TEXT and suffix in (".gz", ".xz"):
        return f"named {suffix} but not {'gzip' if suffix == '.gz' else 'xz'}-compressed"
    return _text_problem(head)


def _text_problem(head: bytes) -> str:
    """Why ``head`` is not the start of a UTF-8 text ("" if it is)."""
    if head[:8] in (_MODEL, _TABLES):
        return f"not a text file: {_looks_like(head)}"
    nul = head.find(b"\0")
    if nul >= 0:
        return f"not a text file: a NUL byte at offset {nul} (a binary file?)"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {head[exc.start:exc.start + 1]!r}{'; a binary file?' if exc.start == 0 else ''})"
    return ""


def _bad_byte_line(head: bytes) -> int | None:
    """The 1-based line of the first byte of ``head`` that is not UTF-8."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as exc:
        return head.count(b"\n", 0, exc.start) + 1
    return None


def _looks_like(head: bytes) -> str:
    """What the first bytes of a file say it is, for a refusal."""
    if head[:8] == _MODEL:
        return "it is a model file"
    if head[:8] == _TABLES:
        return "it is a tables file"
    if head.startswith(_GZIP):
        return "it is gzip-compressed"
    if not head:
        return "it is empty"
    if not _text_problem(head):
        return "it is a text file"
    return f"its first bytes are {head[:8]!r}"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync the directory holding ``path`` so a rename survives a crash (where the file
    system allows it)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], mode: str = "wb", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open ``path + ".tmp"`` for writing (``mode``, ``kwargs`` as ``open`` takes them) and,
    when the block ends, fsync it and rename it over ``path``; when the block or the writing
    fails, the temporary file is removed and the error goes on, so nothing half-written is
    left."""
    name = os.fspath(path)
    tmp = name + ".tmp"
    try:
        with open(tmp, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(name)
