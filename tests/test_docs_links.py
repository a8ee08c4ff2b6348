"""Every relative link in the README, docs/, experiments/, moses_plugin/README.md and data/SOURCES.md points
at a file or folder of the checkout, and every page of docs/ their text names exists, and every #anchor into a Markdown file at one of its headings (as
GitHub makes them). Likewise every page of docs/ that a Python file names (in a docstring or
a comment), with its #anchor or the quoted section after it (a comma or an opening bracket,
then "Heading": matched against the start of a heading)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", REPO / "moses_plugin" / "README.md", REPO / "data" / "SOURCES.md",
                *(REPO / "docs").rglob("*.md"), *(REPO / "experiments").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
ROOMS = ("common", "wire", "lm", "server", "client", "moses_plugin", "pipeline", "bench", "experiments", "tests")
SOURCES = sorted([REPO / "cli.py", *(p for room in ROOMS for p in (REPO / room).rglob("*.py"))])
# a page of docs/, an optional #anchor, an optional "Section" after a comma or an opening bracket
DOC_MENTION = re.compile(r"\bdocs/([\w./-]+?\.md)(?:#([\w-]+))?(?:(?:,|\s*\()\s*\"([^\"\n]+)\")?")


def prose(text: str) -> str:
    """The text outside fenced and indented code blocks and inline code spans."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") or line.startswith("\t"):
            continue
        kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces to hyphens, -1, -2 on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def headings(page: Path) -> list[str]:
    return [m.group(1).lower() for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", prose(page.read_text()), re.M)]


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def unresolved(dest: Path, anchor: str) -> str | None:
    """Why a link to ``dest#anchor`` does not resolve, or None when it does."""
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor} in {dest.relative_to(REPO)}"
    return None


def test_the_pages_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "moses_plugin/README.md", "docs/performance.md", "experiments/results.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        why = unresolved((page.parent / path).resolve() if path else page, anchor)
        if why:
            broken.append(f"{target}: {why}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_anchor_rules() -> None:
    page = REPO / "docs" / "scaling.md"
    assert "large-vocabulary-v--129531" in anchors(page) and "kubernetes" in anchors(page)


def test_the_sources_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in SOURCES}
    assert {"common/memory.py", "lm/hogwild.py", "tests/test_docs_links.py"} <= names


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_docs_mentioned_in_python_exist(source: Path) -> None:
    broken = []
    for m in DOC_MENTION.finditer(source.read_text()):
        name, anchor, section = m.groups()
        dest = REPO / "docs" / name
        why = unresolved(dest, anchor or "")
        if why:
            broken.append(f"docs/{name}{'#' + anchor if anchor else ''}: {why}")
        elif section and not any(h.startswith(section.lower()) for h in headings(dest)):
            broken.append(f'docs/{name}, "{section}": no heading starts so')
    assert not broken, f"{source.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_docs_named_in_pages_exist(page: Path) -> None:
    named = {m.group(1) for m in DOC_MENTION.finditer(page.read_text()) if m.start() == 0
             or page.read_text()[m.start() - 1] not in "./"}
    missing = sorted(name for name in named if not (REPO / "docs" / name).exists())
    assert not missing, f"{page.relative_to(REPO)} names docs/{missing[0]}, which does not exist"
