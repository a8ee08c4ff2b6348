"""What a file must be before the server reads it: a regular file of a bounded size, opened
once and read from that one descriptor.

The server reads files that an operator or an Admin caller names (the model at start and on
reload, the token files, the TLS files). Reading a FIFO would block for ever, a device such
as /dev/zero would grow the process until it is killed, so every such file is opened
without blocking and checked (``fstat`` of the opened file) before a byte is read, and
what is read is read from that same descriptor: no second open of the path, so nothing
swapped in at the path after the check (a symlink flipped to a FIFO) is ever read. A model
file must further have the size its own header gives and at most ``max_model_bytes``; it
is read in chunks with its digest computed on the way (``lm.model_file``).

Which paths are followed: the operator's own model path (``--model``: at start, on SIGHUP
and on a ReloadModel call without a path) may be a symlink, followed when it is opened
(``current.nlm → v42.nlm``, switched and then SIGHUP, is a usual deployment). A path a
ReloadModel caller names must lie inside the reload folder (``--reload-dir``) and is opened
one component at a time below it with ``O_NOFOLLOW``, so that no symlink (or ``..``) leads
out of it.

Every path in a message or a log line goes through :func:`shown_path`, which escapes control
characters: a path holding a newline cannot start a log line of its own.
"""

from __future__ import annotations

import errno
import os
import stat

from ..common.errors import InputError, ModelFileError
from ..common.paths import file_kind
from ..lm.model_file import ModelFile, read_model_descriptor

#: Largest token or TLS file read, in bytes.
MAX_SMALL_FILE_BYTES = 1024 * 1024

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def shown_path(path: str) -> str:
    """``path`` as it may appear in a message or a log line: control characters (C0, DEL,
    C1, the Unicode line and paragraph separators) and the undecodable bytes of a file
    name escaped as ``\\n``, ``\\xNN``, ``\\uNNNN``, and a backslash doubled, so that the
    shown path is one line and says unambiguously which file was meant."""
    out = []
    for ch in path:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif code in (0x2028, 0x2029) or 0xD800 <= code < 0xE000:  # line breaks; surrogate-escaped bytes
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def _check_regular(fd: int, path: str, what: str, max_bytes: int, limit_name: str) -> int:
    """The size of the file open as ``fd``; InputError naming ``path`` when it is not a
    regular file or is larger than ``max_bytes``."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{what} is {file_kind(info.st_mode)}, not a regular file", shown_path(path))
    if info.st_size > max_bytes:
        raise InputError(f"{what} has {info.st_size} bytes, more than {limit_name} = {max_bytes}", shown_path(path))
    return info.st_size


def open_regular(path: str, what: str, max_bytes: int, limit_name: str) -> tuple[int, int]:
    """Open ``path`` for reading → (file descriptor, size); InputError naming the file when
    it cannot be opened, is not a regular file or is larger than ``max_bytes``."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}", shown_path(path)) from e
    try:
        return fd, _check_regular(fd, path, what, max_bytes, limit_name)
    except BaseException:
        os.close(fd)
        raise


def read_small_file(path: str, what: str) -> bytes:
    """The bytes of a token or TLS file (at most :data:`MAX_SMALL_FILE_BYTES`)."""
    fd, size = open_regular(path, what, MAX_SMALL_FILE_BYTES, "the limit for such files")
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_SMALL_FILE_BYTES + 1)[:MAX_SMALL_FILE_BYTES]
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}", shown_path(path)) from e
    finally:
        os.close(fd)


def inside(folder: str, path: str) -> str | None:
    """``path`` relative to ``folder`` when it lies inside it, by the names alone (``..``
    resolved as text, no file looked at; a relative ``path`` is taken from the working
    directory); None otherwise. ``folder`` is taken as given and as its real path, so a
    caller may name a file by either."""
    full = os.path.abspath(path)
    for root in dict.fromkeys((os.path.abspath(folder), os.path.realpath(folder))):
        rel = os.path.relpath(full, root)
        if rel != os.curdir and rel != os.pardir and not rel.startswith(os.pardir + os.sep):
            return rel
    return None


def _open_beneath(folder: str, rel: str) -> int:
    """Open ``rel`` (relative, no ``..``) below ``folder``, one component at a time relative
    to its parent's descriptor with ``O_NOFOLLOW``: a symlink anywhere below ``folder``
    fails (ELOOP or ENOTDIR) instead of being followed. ``folder`` itself is the operator's
    and may be reached through symlinks."""
    parent = os.open(folder, _DIR_FLAGS)
    try:
        *dirs, name = rel.split(os.sep)
        for part in dirs:
            child = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=parent)
            os.close(parent)
            parent = child
        return os.open(name, _OPEN_FLAGS | _NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)


def read_model(path: str, max_bytes: int, reload_dir: str | None = None) -> ModelFile:
    """Open the model file ``path`` once and read it from that descriptor: a regular file of
    at most ``max_bytes`` and of the size its header gives, its digest checked (read in
    chunks, nothing past the declared data). ``reload_dir``: the path must lie inside that
    folder and is opened with no symlink followed below it (a caller's path); None: the
    operator's path, symlinks followed. ModelFileError naming the file (by
    :func:`shown_path`) on any problem; no byte of a file that is no model file is shown."""
    shown = shown_path(path)
    try:
        if reload_dir is None:
            fd = os.open(path, _OPEN_FLAGS)
        else:
            rel = inside(reload_dir, path)
            if rel is None:
                raise ModelFileError(f"{shown}: not inside the reload folder {shown_path(reload_dir)} (--reload-dir); "
                                     "a ReloadModel path must name a file there")
            fd = _open_beneath(reload_dir, rel)
    except OSError as e:
        if reload_dir is not None and e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ModelFileError(f"{shown}: cannot read model file: a symbolic link below the reload folder "
                                 "(not followed for a ReloadModel path), or not a directory") from e
        raise ModelFileError(f"{shown}: cannot read model file: {e.strerror}") from e
    try:
        try:
            _check_regular(fd, path, "model file", max_bytes, "max_model_bytes")
        except InputError as e:
            raise ModelFileError(str(e)) from e
        except OSError as e:
            raise ModelFileError(f"{shown}: cannot read model file: {e.strerror}") from e
        return read_model_descriptor(fd, shown, max_bytes=max_bytes, exact_size=True)
    finally:
        os.close(fd)
