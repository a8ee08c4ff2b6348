#!/usr/bin/env python3
"""Add nlmserve's NeuralLMServer feature to a Moses source tree.

    python3 moses_plugin/cpp/add_to_moses.py /path/to/mosesdecoder [--check]

What it does (moses_plugin/README.md, "Add the feature to Moses"):

- copies NeuralLMServer.h, NeuralLMServer.cpp and NeuralLMServerPrefetch.cpp, and any header
  of this folder they include that the client library does not install (CMakeLists.txt's
  ``install(FILES ...)``), into moses/LM/; a copy that differs from this folder's file is
  replaced;
- moses/LM/Jamfile: the feature block (``--with-nlmserve=PREFIX``) before the line
  ``#Top-level LM library. ...``;
- moses/Jamfile: ``nlmserve`` added to the loop that records the LM options of a build in
  bin/lm.log, on which FF_Factory.o alone depends, so that bjam recompiles
  moses/FF/Factory.cpp (and nothing else) whenever ``--with-nlmserve`` changes (the block's
  comment explains why);
- moses/FF/Factory.cpp: the feature's include after ``#include "moses/LM/ExampleLM.h"`` and
  ``MOSES_FNAME(NeuralLMServer);`` after ``MOSES_FNAME(ExampleLM);``, both inside
  ``#ifdef LM_NLMSERVE``.

Every addition sits between ``>>> nlmserve NAME`` and ``<<< nlmserve NAME`` comment lines;
a later run compares what is between them with what it would write, leaves it alone when
equal and replaces it otherwise. Everything is checked before anything is written: an anchor
line not found exactly once (compared without leading and trailing blanks), nlmserve lines
outside the markers (edits made by hand), or an unreadable file stop the run with the file
and line named and nothing changed. Each file is written to a temporary file next to it and
renamed over it.

Exit status: 0 done (or nothing to do), 1 with --check when something would change,
2 on an error. Python 3 standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The client library the feature links (its headers are installed under PREFIX/include).
CLIENT_CMAKE = HERE.parents[1] / "client" / "cpp" / "CMakeLists.txt"
FEATURE_FILES = ("NeuralLMServer.h", "NeuralLMServer.cpp", "NeuralLMServerPrefetch.cpp")
JAMFILE = "moses/LM/Jamfile"
MOSES_JAMFILE = "moses/Jamfile"
FACTORY = "moses/FF/Factory.cpp"
LM_DIR = "moses/LM"
# A line outside the managed blocks that mentions one of these is an earlier hand edit.
FOREIGN = re.compile(r"nlmserve|neurallmserver", re.IGNORECASE)


class Refusal(Exception):
    """A reason to change nothing, worded for the user."""


@dataclass(frozen=True)
class Edit:
    """A block of lines put before, after or in place of one anchor line of a file."""

    file: str  # relative to the Moses tree
    name: str  # in the marker lines
    comment: str  # the file's line-comment leader
    anchor: str
    how: str  # "before", "after" or "replace"
    body: tuple[str, ...]

    @property
    def begin(self) -> str:
        return f"{self.comment} >>> nlmserve {self.name}"

    @property
    def end(self) -> str:
        return f"{self.comment} <<< nlmserve {self.name}"

    def lines(self) -> list[str]:
        return [self.begin, *self.body, self.end]


LM_LOG_LINE = "for local i in srilm irstlm randlm {"

EDITS = (
    Edit(
        file=JAMFILE,
        name="feature",
        comment="#",
        anchor="#Top-level LM library.  If you've added a file that doesn't depend on external",
        how="before",
        body=(
            "# NeuralLMServer, the client of nlmserve's neural LM server, built with",
            "# --with-nlmserve=PREFIX: the prefix nlmserve's client library is installed in",
            "# (PREFIX/include/nlmserve_client.h, PREFIX/lib/libnlmserve_client.so).",
            "# Written by nlmserve's moses_plugin/cpp/add_to_moses.py, which replaces the lines",
            "# between the >>> and <<< markers when run again.",
            'local with-nlmserve = [ option.get "with-nlmserve" ] ;',
            "if $(with-nlmserve) {",
            "  lib nlmserve_client : : <search>$(with-nlmserve)/lib <link>shared ;",
            "  obj NeuralLMServer.o : NeuralLMServer.cpp ..//headers : <include>$(with-nlmserve)/include ;",
            "  obj NeuralLMServerPrefetch.o : NeuralLMServerPrefetch.cpp ..//headers : "
            "<include>$(with-nlmserve)/include ;",
            "  alias nlmserve : NeuralLMServer.o NeuralLMServerPrefetch.o nlmserve_client : : : "
            "<linkflags>-Wl,-rpath,$(with-nlmserve)/lib <define>LM_NLMSERVE ;",
            "  dependencies += nlmserve ;",
            "  lmmacros += LM_NLMSERVE ;",
            "}",
        ),
    ),
    Edit(
        file=MOSES_JAMFILE,
        name="Factory.o dependency",
        comment="#",
        anchor=LM_LOG_LINE,
        how="replace",
        body=(
            "# The line was: " + LM_LOG_LINE,
            "# Factory.cpp registers NeuralLMServer only #ifdef LM_NLMSERVE, a define. bjam does not",
            "# rebuild an object when only its defines change, so after a build without",
            "# --with-nlmserve a build with it would keep the old FF_Factory.o and bin/moses would",
            "# not know the feature. The loop below records the LM options of the last build in",
            "# bin/lm.log, on which FF_Factory.o (and only it) depends: with nlmserve in the loop,",
            "# switching --with-nlmserve on, off or to another PREFIX recompiles Factory.cpp.",
            "for local i in srilm irstlm randlm nlmserve {",
        ),
    ),
    Edit(
        file=FACTORY,
        name="include",
        comment="//",
        anchor='#include "moses/LM/ExampleLM.h"',
        how="after",
        body=(
            "// NeuralLMServer, built with bjam --with-nlmserve=PREFIX (moses/LM/Jamfile); written by",
            "// nlmserve's moses_plugin/cpp/add_to_moses.py.",
            "#ifdef LM_NLMSERVE",
            '#include "moses/LM/NeuralLMServer.h"',
            "#endif",
        ),
    ),
    Edit(
        file=FACTORY,
        name="registration",
        comment="//",
        anchor="MOSES_FNAME(ExampleLM);",
        how="after",
        body=(
            "#ifdef LM_NLMSERVE",
            "  MOSES_FNAME(NeuralLMServer);",
            "#endif",
        ),
    ),
)


@dataclass
class Change:
    """The new content of one file of the Moses tree and why."""

    rel: str
    data: bytes
    mode: int
    reasons: list[tuple[str, str]] = field(default_factory=list)  # (what, "added ...")


def installed_headers(cmake: Path = CLIENT_CMAKE) -> set[str]:
    """Headers the client library installs into PREFIX/include (its CMakeLists.txt)."""
    try:
        text = cmake.read_text(encoding="utf-8")
    except OSError as err:
        raise Refusal(f"cannot read {cmake}: {err.strerror}") from None
    found: set[str] = set()
    for m in re.finditer(r"install\s*\(\s*FILES\s+([^)]*?)\s+DESTINATION\s+include\b", text):
        found.update(m.group(1).split())
    if not found:
        raise Refusal(f"{cmake}: no 'install(FILES ... DESTINATION include)' line: which headers "
                      "does the client library install?")
    return found


def feature_sources(src: Path = HERE, client_cmake: Path = CLIENT_CMAKE) -> list[str]:
    """The feature's files, then every header of ``src`` they include (quoted, transitively)
    that the client library (``client_cmake``) does not install."""
    installed = installed_headers(client_cmake)
    files = list(FEATURE_FILES)
    i = 0
    while i < len(files):
        path = src / files[i]
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise Refusal(f"cannot read {path}: {err.strerror}") from None
        for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, re.MULTILINE):
            if name not in files and name not in installed and "/" not in name and (src / name).is_file():
                files.append(name)
        i += 1
    return files


def _split(data: bytes, rel: str) -> tuple[list[str], str]:
    """Lines without their ends (a last empty one when the text ends with a line end), and
    the line end the file uses."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Refusal(f"{rel}: not UTF-8 text ({err})") from None
    newline = "\r\n" if "\r\n" in text else "\n"
    return text.split(newline) if text else [], newline


def _join(lines: list[str], newline: str) -> bytes:
    return newline.join(lines).encode("utf-8")


def _managed(lines: list[str], edits: list[Edit], rel: str) -> dict[str, tuple[int, int]]:
    """Where each edit's marked block is: name -> (begin index, end index), checked."""
    spans: dict[str, tuple[int, int]] = {}
    for e in edits:
        begins = [i for i, s in enumerate(lines) if s.strip() == e.begin]
        ends = [i for i, s in enumerate(lines) if s.strip() == e.end]
        if not begins and not ends:
            continue
        if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
            raise Refusal(f"{rel}: the marker lines '{e.begin}' (lines {_numbers(begins)}) and "
                          f"'{e.end}' (lines {_numbers(ends)}) do not enclose one block; "
                          "fix them by hand (moses_plugin/README.md) and run again")
        spans[e.name] = (begins[0], ends[0])
    return spans


def _numbers(indices: list[int]) -> str:
    return ", ".join(str(i + 1) for i in indices) or "none"


def _outside(lines: list[str], spans: dict[str, tuple[int, int]]) -> list[int]:
    inside = {i for b, e in spans.values() for i in range(b, e + 1)}
    return [i for i in range(len(lines)) if i not in inside]


def plan_text(moses: Path, rel: str, edits: list[Edit]) -> Change | None:
    """The new content of ``rel`` with ``edits`` applied, or None when it has them already."""
    path = moses / rel
    try:
        data = path.read_bytes()
        mode = path.stat().st_mode & 0o7777
    except OSError as err:
        raise Refusal(f"cannot read {path}: {err.strerror}") from None
    lines, newline = _split(data, rel)

    spans = _managed(lines, edits, rel)
    for i in _outside(lines, spans):
        if FOREIGN.search(lines[i]):
            raise Refusal(f"{path}, line {i + 1}: '{lines[i].strip()}' mentions the feature outside "
                          "the blocks this script writes (an edit made by hand?); remove the "
                          "nlmserve lines made by hand and run again")

    change = Change(rel, b"", mode)
    for e in edits:  # one at a time: each edit moves the lines after it
        spans = _managed(lines, edits, rel)
        if e.name in spans:
            b, end = spans[e.name]
            if [s.rstrip() for s in lines[b:end + 1]] == e.lines():
                continue
            lines[b:end + 1] = e.lines()
            change.reasons.append((f"block 'nlmserve {e.name}'",
                                   f"replaced at lines {b + 1}-{end + 1} (it differs from this version's)"))
            continue
        outside = _outside(lines, spans)
        hits = [i for i in outside if lines[i].strip() == e.anchor]
        if len(hits) != 1:
            raise Refusal(f"{path}: the anchor line '{e.anchor}' occurs {len(hits)} times "
                          f"(lines: {_numbers(hits)}), not exactly once, so the nlmserve {e.name} "
                          f"has no place to go. Nothing was changed. This Moses differs from the "
                          "one the script knows (moses-smt/mosesdecoder @ 34452895): restore the "
                          "anchor line, or add the blocks of EDITS in this script by hand "
                          "(moses_plugin/README.md says where they go)")
        at = hits[0]
        if e.how == "before":
            lines[at:at] = e.lines()
            where = f"before line {at + 1}"
        elif e.how == "after":
            lines[at + 1:at + 1] = e.lines()
            where = f"after line {at + 1}"
        else:
            lines[at:at + 1] = e.lines()
            where = f"in place of line {at + 1}"
        change.reasons.append((f"block 'nlmserve {e.name}'", f"added {where} '{e.anchor}'"))

    if not change.reasons:
        return None
    change.data = _join(lines, newline)
    return change


def plan_copies(moses: Path, src: Path = HERE) -> list[Change]:
    """The feature's files that moses/LM/ lacks or holds in another version."""
    changes = []
    for name in feature_sources(src):
        source = src / name
        rel = f"{LM_DIR}/{name}"
        target = moses / rel
        try:
            data = source.read_bytes()
            mode = source.stat().st_mode & 0o777
            if target.exists():
                if target.read_bytes() == data:
                    continue
                changes.append(Change(rel, data, target.stat().st_mode & 0o7777,
                                      [("", f"replaced by {source} (it differs)")]))
            else:
                changes.append(Change(rel, data, mode, [("", f"copied from {source}")]))
        except OSError as err:
            raise Refusal(f"cannot copy {source} to {target}: {err.strerror}") from None
    return changes


def plan(moses: Path, src: Path = HERE) -> list[Change]:
    """Every change, in the order to write them; raises Refusal before anything is written."""
    if not moses.is_dir():
        raise Refusal(f"{moses}: no such directory (give the top of a Moses checkout, the "
                      "folder that holds Jamroot and moses/)")
    for rel in (JAMFILE, MOSES_JAMFILE, FACTORY):
        if not (moses / rel).is_file():
            raise Refusal(f"{moses} is not a Moses source tree: {moses / rel} is missing")
    changes = plan_copies(moses, src)
    for rel in (JAMFILE, MOSES_JAMFILE, FACTORY):  # Factory.cpp last: its include needs the copied header
        c = plan_text(moses, rel, [e for e in EDITS if e.file == rel])
        if c is not None:
            changes.append(c)
    return changes


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a temporary file in ``path``'s folder, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="add_to_moses.py",
        description="Add nlmserve's NeuralLMServer feature to a Moses source tree: copy the "
                    "feature into moses/LM/, add its block to moses/LM/Jamfile and its guarded "
                    "lines to moses/FF/Factory.cpp. A second run changes nothing.",
        epilog="Exit status: 0 done or nothing to do; 1 with --check when something would "
               "change; 2 on an error (found before writing: nothing changed). Then build Moses with "
               "./bjam --with-nlmserve=PREFIX.")
    parser.add_argument("moses", metavar="MOSES_DIR", help="top of the Moses checkout (holds Jamroot and moses/)")
    parser.add_argument("--check", action="store_true", help="report what would change, change nothing")
    args = parser.parse_args(argv)
    moses = Path(args.moses)

    try:
        changes = plan(moses)
    except Refusal as e:
        print(f"add_to_moses.py: error: {e}", file=sys.stderr)
        return 2

    if not changes:
        print(f"{moses}: up to date, nothing to change (the NeuralLMServer feature of {HERE} "
              "is in place)")
        return 0

    for c in changes:
        for what, done in c.reasons:
            print(f"{c.rel}: {what + ' ' if what else ''}{'would be ' if args.check else ''}{done}")
    if args.check:
        print(f"{moses}: {len(changes)} file(s) would change; run without --check to apply")
        return 1

    for c in changes:
        try:
            write_atomic(moses / c.rel, c.data, c.mode)
        except OSError as err:
            print(f"add_to_moses.py: error: cannot write {moses / c.rel}: {err.strerror}; the files "
                  "listed before it are written, run again once it is writable", file=sys.stderr)
            return 2
    print(f"{moses}: {len(changes)} file(s) changed. Build with: ./bjam -j2 -q --without-tcmalloc --no-xmlrpc-c "
          "--with-nlmserve=PREFIX moses-cmd//moses (PREFIX: where 'cmake --install build/cpp --prefix PREFIX' put "
          "nlmserve's client library)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
