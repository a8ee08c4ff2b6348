"""What a file must be before the server reads it: a regular file of a bounded size.

The server reads files that an operator or a token holder names (the model at start and on
reload, the token file, the TLS files). Reading a FIFO would block for ever, a device such
as /dev/zero would grow the process until it is killed, so every such file is opened
without blocking and checked (``fstat`` of the opened file, so that what is read is what
was checked) before a byte is read. A model file must further have the size its own
header gives (``lm.model_file``'s layout: prefix, header, padding, data of ``data_size``
bytes) and at most ``max_model_bytes``.
"""

from __future__ import annotations

import os
import stat

from ..common.errors import InputError, ModelFileError
from ..lm.model_file import declared_size

#: Largest token or TLS file read, in bytes.
MAX_SMALL_FILE_BYTES = 1024 * 1024


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, what: str, max_bytes: int, limit_name: str) -> tuple[int, int]:
    """Open ``path`` for reading → (file descriptor, size); InputError naming the file when
    it cannot be opened, is not a regular file or is larger than ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}", path) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{what} is {_kind(info.st_mode)}, not a regular file", path)
        if info.st_size > max_bytes:
            raise InputError(f"{what} has {info.st_size} bytes, more than {limit_name} = {max_bytes}", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_small_file(path: str, what: str) -> bytes:
    """The bytes of a token or TLS file (at most :data:`MAX_SMALL_FILE_BYTES`)."""
    fd, size = open_regular(path, what, MAX_SMALL_FILE_BYTES, "the limit for such files")
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_SMALL_FILE_BYTES + 1)[:MAX_SMALL_FILE_BYTES]
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}", path) from e
    finally:
        os.close(fd)


def check_model_file(path: str, max_bytes: int) -> None:
    """ModelFileError naming ``path`` unless it is a regular file of at most ``max_bytes``
    whose size is the one its header gives. A file whose header cannot be read is left to
    ``read_model_file``, which says what is wrong with it (reading at most ``max_bytes``)."""
    try:
        fd, size = open_regular(path, "model file", max_bytes, "max_model_bytes")
    except InputError as e:
        raise ModelFileError(str(e)) from e
    try:
        expected = declared_size(lambda n, offset: os.pread(fd, n, offset), size)
        if expected is None:
            return
        if size != expected:
            raise ModelFileError(f"{path}: model file has {size} bytes, its header says {expected} "
                                 f"({'truncated' if size < expected else 'bytes after the data'})")
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read model file: {e.strerror}") from e
    finally:
        os.close(fd)
