"""nlmserve.common.paths: the checks every command makes of its files before it works, and
the atomic write that leaves nothing behind when it fails."""

from __future__ import annotations

import gzip
import lzma
import os
from pathlib import Path

import pytest

from nlmserve.common.errors import InputError
from nlmserve.common.paths import (LIST, MODEL, MODEL_OR_TABLES, PLAIN, TABLES, TEXT, atomic_output, check_input,
                                   check_output, check_output_dir)


def test_an_output_is_refused_when_it_cannot_be_written_whole(tmp_path: Path) -> None:
    check_output(tmp_path / "new.txt")  # a new file in a folder that exists
    (tmp_path / "old.txt").write_text("x")
    check_output(tmp_path / "old.txt")  # replaced when the work is done
    (tmp_path / "dir").mkdir()
    with pytest.raises(InputError, match=f"{tmp_path / 'dir'}: the output is a directory"):
        check_output(tmp_path / "dir")
    with pytest.raises(InputError, match="its folder .*missing does not exist"):
        check_output(tmp_path / "missing" / "out.txt")
    with pytest.raises(InputError, match="its folder .*old.txt is not a directory"):
        check_output(tmp_path / "old.txt" / "out.txt")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InputError, match="not a regular file"):
        check_output(tmp_path / "fifo")  # the rename would replace it
    with pytest.raises(InputError, match=r"it needs [\d,]+ bytes, .* free"):
        check_output(tmp_path / "huge.bin", size=1 << 62)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "old.txt"]


def test_a_work_directory_is_made_with_its_parents_unless_a_file_is_in_the_way(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "runs" / "demo")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        check_output_dir(tmp_path / "file")
    with pytest.raises(InputError, match="is not a directory"):
        check_output_dir(tmp_path / "file" / "demo")
    assert not (tmp_path / "runs").exists()  # a check makes nothing


@pytest.mark.parametrize(("name", "data", "kind", "problem"), [
    ("plain.txt", b"a b c\n", TEXT, None),
    ("bom.txt", "\ufeffa b\n".encode(), TEXT, None),
    ("cut.txt", "a é".encode()[:-1], TEXT, None),  # a character cut by the first bytes' end is no fault
    ("t.gz", gzip.compress(b"a\n"), TEXT, None),
    ("t.xz", lzma.compress(b"a\n"), TEXT, None),
    ("t.txt", gzip.compress(b"a\n"), TEXT, "gzip-compressed, but its name does not end in .gz"),
    ("t.gz", b"a b c\n", TEXT, "named .gz but not gzip-compressed"),
    ("list.nbest", gzip.compress(b"0 ||| a ||| F= 1 ||| 1\n"), LIST, None),  # the reader goes by the magic bytes
    ("w.ini", gzip.compress(b"[weight]\n"), PLAIN, "gzip-compressed: give the plain text"),
    ("bin.dat", b"\xb7\xfd" + bytes(range(1, 200)), TEXT, r"not UTF-8 text \(byte b'\\xb7'; a binary file\?\)"),
    ("nul.dat", b"abc\0def", PLAIN, "a NUL byte at offset 3"),
    ("later.txt", b"fine\nfine\n\xff\n", TEXT, r"later.txt:3: not UTF-8 text"),
    ("m.nlm", b"NLMSERVE" + bytes(12), MODEL, None),
    ("m.nlm", b"NLMSERVE" + bytes(12), TEXT, "not a text file: it is a model file"),
    ("t.nlt", b"NLMTABLE" + bytes(12), MODEL, "not an nlmserve model file: it is a tables file"),
    ("t.nlt", b"NLMTABLE" + bytes(12), TABLES, None),
    ("t.nlt", b"NLMTABLE" + bytes(12), MODEL_OR_TABLES, None),
    ("x.txt", b"a b\n", MODEL_OR_TABLES, "not an nlmserve model file nor a tables file: it is a text file"),
    ("e.nlm", b"", MODEL, "not an nlmserve model file: it is empty"),
])
def test_an_input_is_judged_by_its_first_bytes(tmp_path: Path, name: str, data: bytes, kind: str,
                                               problem: str | None) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    if problem is None:
        check_input(path, kind)
    else:
        with pytest.raises(InputError, match=problem):
            check_input(path, kind)


def test_an_input_that_is_not_there_empty_or_a_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="nope.txt: no such file"):
        check_input(tmp_path / "nope.txt", TEXT)
    with pytest.raises(InputError, match="a directory, not a file"):
        check_input(tmp_path, TEXT)
    (tmp_path / "empty.txt").write_bytes(b"")
    check_input(tmp_path / "empty.txt", TEXT)  # where an empty text is fine, the reader says so
    with pytest.raises(InputError, match="empty.txt: empty"):
        check_input(tmp_path / "empty.txt", TEXT, empty_ok=False)
    os.mkfifo(tmp_path / "fifo")
    check_input(tmp_path / "fifo", TEXT, empty_ok=False)  # a pipe passes on its kind: nothing is read from it


def test_an_atomic_output_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("before")
    with pytest.raises(RuntimeError):
        with atomic_output(out, "w", encoding="utf-8") as handle:
            handle.write("half of it")
            raise RuntimeError("the disk is full")
    assert out.read_text() == "before" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
    with atomic_output(out, "w", encoding="utf-8") as handle:
        handle.write("after")
    assert out.read_text() == "after" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
