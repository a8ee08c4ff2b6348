"""The README's first screen, run as written on the shipped data.

The ``sh`` blocks of "Five commands on the shipped data" run in order in one bash session in
an empty folder beside ``data/`` (a link to the checkout's), with this installation's
``nlmserve`` on the PATH; the server line (``… &``) is started in the background and waited
for, on a free port in place of 50051, and stopped at the end. Each block's stdout must show
the ``text`` block after it: every line in order, ``…`` in a line standing for any text, a
line of ``…`` alone for any number of lines. The commands are deterministic (a step budget on
one process, fixed seeds), so the values shown are the values printed on the machine that
recorded them; elsewhere decimals stay within ``DECIMAL_TOLERANCE``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nlmserve.common.serve_process import free_port

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SECTION = "## Five commands on the shipped data"
BLOCK = re.compile(r"^```(sh|text)\n(.*?)^```$", re.M | re.S)
MARK = "@@ step {} @@"


def steps(readme: str) -> list[tuple[str, str]]:
    """(commands, expected output) of each step of the section."""
    section = readme[readme.index(SECTION):]
    section = section[:section.find("\n## ", 1)]
    blocks = [(kind, body) for kind, body in BLOCK.findall(section)]
    pairs = []
    for (kind, body), (next_kind, expected) in zip(blocks, blocks[1:]):
        if kind == "sh":
            assert next_kind == "text", f"an sh block without its output: {body!r}"
            pairs.append((body, expected))
    return pairs


#: A number as the commands print them (a decimal point marks a measured value).
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
#: How far a decimal may stray from the one shown (relative, and absolute 0.02 below 2): the
#: arithmetic is deterministic on one machine, but another CPU's vector units round sums in
#: another order (numba and torch pick their kernels for the CPU they run on), so a model
#: trained elsewhere is close, not equal. Whole numbers (counts, ids, steps) must be equal.
DECIMAL_TOLERANCE = 0.01


def _line(want: str) -> tuple[re.Pattern[str], list[str]]:
    """The pattern of one expected line (``…`` any text, each number captured) and its numbers."""
    numbers: list[str] = []
    parts = []
    for part in want.split("…"):
        pieces = re.split(f"({NUMBER})", part)
        numbers.extend(pieces[1::2])
        parts.append("".join(re.escape(p) if i % 2 == 0 else f"({NUMBER})" for i, p in enumerate(pieces)))
    return re.compile(".*?".join(parts) + r"\Z"), numbers


def _close(want: str, got: str) -> bool:
    if "." not in want and "e" not in want:
        return want == got
    a, b = float(want), float(got)
    return abs(a - b) <= DECIMAL_TOLERANCE * max(abs(a), 2.0)


def shows(expected: str, printed: str) -> str | None:
    """None when ``printed`` shows ``expected`` (module docstring), else the first line missing."""
    lines = printed.splitlines()
    at, skip = 0, False
    for want in expected.splitlines():
        if want == "…":
            skip = True
            continue
        pattern, numbers = _line(want)

        def matches(line: str) -> bool:
            m = pattern.match(line)
            return m is not None and all(_close(w, g) for w, g in zip(numbers, m.groups()))

        while at < len(lines) and not matches(lines[at]):
            if not skip:
                return f"{want!r} expected, got {lines[at]!r}"
            at += 1
        if at == len(lines):
            return f"{want!r} not printed"
        at, skip = at + 1, False
    if at < len(lines) and not skip:
        return f"nothing more expected, got {lines[at]!r}"
    return None


def test_the_matching_rule() -> None:
    assert shows("a …\n…\nc", "a 1\nb\nb\nc") is None
    assert shows("a\n…", "a\nb") is None
    assert shows("a\nc", "a\nb\nc") == "'c' expected, got 'b'"
    assert shows("a", "a\nb") == "nothing more expected, got 'b'"
    assert shows("a\n…\nd", "a\nb") == "'d' not printed"
    assert shows("ppl 38.4635 in 4000 steps", "ppl 38.4599 in 4000 steps") is None  # another CPU's rounding
    assert shows("ppl 38.4635", "ppl 39.0") == "'ppl 38.4635' expected, got 'ppl 39.0'"
    assert shows("in 4000 steps", "in 4001 steps") == "'in 4000 steps' expected, got 'in 4001 steps'"


def _script(pairs: list[tuple[str, str]], port: int) -> str:
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for i, (commands, _) in enumerate(pairs):
        lines.append(f"echo '{MARK.format(i)}'")
        for line in commands.replace("50051", str(port)).splitlines():
            command = line.split("  #", 1)[0].rstrip()
            if command.endswith("&"):  # the server: in the background, then wait for its address
                lines.append(f"{command[:-1].rstrip()} > serve.out 2> serve.err &")
                lines.append("for _ in $(seq 600); do grep -q '^listening on' serve.out && break; sleep 0.1; done")
                lines.append("cat serve.out")
            else:
                lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_the_first_screen_prints_what_it_shows(tmp_path: Path) -> None:
    pairs = steps(README.read_text(encoding="utf-8"))
    assert [p[0].split()[0] for p in pairs] == ["xzcat", "echo", "nlmserve", "nlmserve", "nlmserve", "nlmserve"]
    (tmp_path / "data").symlink_to(REPO / "data")
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", _script(pairs, port)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = re.split(r"^@@ step \d+ @@\n", done.stdout, flags=re.M)[1:]
    assert len(printed) == len(pairs)
    for (commands, expected), out in zip(pairs, printed):
        if "50051" in commands:  # the port the commands were given
            expected = expected.replace("50051", str(port))
        missing = shows(expected, out)
        assert missing is None, f"{commands.splitlines()[0]} …: {missing}\n{out}"
    assert (tmp_path / "serve.out").read_text().startswith(f"listening on 127.0.0.1:{port}")
