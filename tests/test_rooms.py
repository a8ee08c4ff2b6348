"""docs/architecture.md's rooms table against the import lines of the package.

The product is what the wheel installs: the ``.py`` files of the packages pyproject.toml
lists (``nlmserve`` is the checkout's root, ``nlmserve.X`` its folder ``X/``). Every
import line of every such file counts, wherever it stands: at the top, inside a function
(imported when it runs) and under ``if TYPE_CHECKING`` alike. Checked here:

* the table's "imports" column names exactly the rooms each room imports (its convention:
  a room as its folder's name in a code span, `lm`; third-party libraries and notes in
  plain words beside them, not checked);
* the client never reaches ``lm/``: no file of ``client/`` imports one of ``lm/``, directly
  or through the files it imports (tests/test_client.py checks the same of a running
  interpreter);
* no circle of files: no file imports, through any chain of imports, itself.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
TOP = "nlmserve"  # the room of the package's own files (__init__.py, __main__.py, cli.py)


@cache
def packages() -> dict[str, Path]:
    """Each installed package → its folder."""
    names = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return {name: REPO.joinpath(*name.split(".")[1:]) for name in names}


@cache
def modules() -> dict[str, Path]:
    """Each installed module (a package is its ``__init__``) → its file."""
    found = {}
    for package, folder in packages().items():
        for path in sorted(folder.glob("*.py")):
            if package == TOP and path.name == "setup.py":
                continue  # the build script beside the root's __init__.py is not installed
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def room_of(module: str) -> str:
    """``nlmserve.X.…`` → ``X`` when ``nlmserve.X`` is a package; the package's own files → TOP."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and f"{TOP}.{parts[1]}" in packages() else TOP


def _resolved(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    here = module if modules()[module].stem == "__init__" else module.rpartition(".")[0]
    base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
    return f"{base}.{node.module}" if node.module else base


@cache
def imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(the installed modules ``module`` names in its import lines, the third-party
    libraries it imports: top-level names outside the standard library)."""
    tree = ast.parse(modules()[module].read_text(), str(modules()[module]))
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolved(module, node)
            for alias in node.names:  # `from . import core` names the module core
                named.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules() else source)
    ours, libraries = set(), set()
    for name in named:
        top = name.split(".")[0]
        if top == TOP:
            while name not in modules():  # `import nlmserve.x.y` of a name inside a module
                name = name.rpartition(".")[0]
            if name != module:
                ours.add(name)
        elif top not in sys.stdlib_module_names and top != "__future__":
            libraries.add(top)
    return frozenset(ours), frozenset(libraries)


def room_imports() -> dict[str, set[str]]:
    """Each room → the other rooms its files import."""
    out: dict[str, set[str]] = {room_of(m): set() for m in modules()}
    for module in modules():
        out[room_of(module)] |= {room_of(m) for m in imports(module)[0]} - {room_of(module)}
    return out


def table() -> dict[str, set[str]]:
    """The rooms table of docs/architecture.md: each room (by its import path) → the rooms
    its "imports" column names (code spans that are a room's name)."""
    rooms = {room_of(m) for m in modules()}
    lines = ARCHITECTURE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| folder | import path |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    column = header.index("imports")
    out: dict[str, set[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        path = re.match(r"`(nlmserve(?:\.\w+)?)`", cells[1])
        if path is None:
            continue  # not installed: bench/, experiments/, tests/, docker/, ...
        room = room_of(path.group(1)) if path.group(1) != TOP else TOP
        out[room] = {name for name in re.findall(r"`([\w.]+)`", cells[column]) if name in rooms}
    return out


def test_the_package_is_read() -> None:
    rooms = {room_of(m) for m in modules()}
    assert {TOP, "common", "wire", "lm", "server", "client", "moses_plugin", "pipeline"} <= rooms
    assert "nlmserve.cli" in modules() and "nlmserve.wire.ngrams" in modules()
    # a lazy import and a type-only one count as well as a top-level one
    assert "nlmserve.lm.scoring" in imports("nlmserve.moses_plugin.model_source")[0]
    assert "torch" in imports("nlmserve.lm.scoring")[1]


def test_the_table_names_every_room_and_the_rooms_each_imports() -> None:
    documented, actual = table(), room_imports()
    assert set(documented) == set(actual), "a room without a row, or a row of no room"
    wrong = {room: (sorted(documented[room]), sorted(actual[room])) for room in actual
             if documented[room] != actual[room]}
    assert not wrong, f"docs/architecture.md's imports column (room: (said, imported)): {wrong}"


def _reached(start: set[str]) -> set[str]:
    """The modules importing ``start`` loads: every module named, and the packages above each."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(imports(module)[0])
        parent = module.rpartition(".")[0]
        if parent in modules():
            todo.append(parent)
    return seen


def test_the_client_never_reaches_lm() -> None:
    client = {m for m in modules() if room_of(m) == "client"}
    direct = {(m, n) for m in client for n in imports(m)[0] if room_of(n) == "lm"}
    assert not direct
    assert not sorted(m for m in _reached(client) if room_of(m) == "lm")


def circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node of ``graph`` (node → the nodes
    it imports): Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def file_graph() -> dict[str, frozenset[str]]:
    return {m: imports(m)[0] for m in modules()}


def test_no_circle_of_files() -> None:
    assert circles(file_graph()) == []


def test_a_circle_is_found() -> None:
    """The check itself, on a graph of three files: a → b → c → a, and d beside them."""
    graph = {"a": frozenset({"b"}), "b": frozenset({"c", "d"}), "c": frozenset({"a"}), "d": frozenset()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({**graph, "c": frozenset()}) == []


if __name__ == "__main__":  # the rooms and what each imports, for the table
    libraries: dict[str, set[str]] = {}
    for m in modules():
        libraries.setdefault(room_of(m), set()).update(imports(m)[1])
    for room, rooms in sorted(room_imports().items()):
        print(f"{room}: rooms {sorted(rooms)}; libraries {sorted(libraries[room])}")
    for group in circles(file_graph()):
        print("circle:", " ".join(group))
