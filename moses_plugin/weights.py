"""Feature weights: moses.ini ``[weight]`` sections and Moses' ``weights.txt``.

A :class:`Weights` maps each dense feature group of an n-best list (``LM0``,
``TranslationModel0`` …, in list order) to its values. In moses.ini a group is one line,
``Name0= v v v``; mert's ``weights.txt`` is one line of the flattened values, in the
order of the n-best list's features (``FEATURES_TXT`` names).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..common.errors import InputError

Layout = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Weights:
    """Dense weights grouped by feature, in feature order.

    Fields:
        groups: ``(name, values)`` per feature group, names without ``=``.
    """

    groups: tuple[tuple[str, tuple[float, ...]], ...]

    @classmethod
    def from_flat(cls, layout: Layout, flat: Sequence[float]) -> "Weights":
        total = sum(n for _, n in layout)
        if len(flat) != total:
            raise InputError(f"{len(flat)} weights for {total} features")
        groups, pos = [], 0
        for name, n in layout:
            groups.append((name, tuple(float(v) for v in flat[pos : pos + n])))
            pos += n
        return cls(tuple(groups))

    @property
    def layout(self) -> Layout:
        return tuple((name, len(values)) for name, values in self.groups)

    def flat(self) -> list[float]:
        return [v for _, values in self.groups for v in values]

    def as_dict(self) -> dict[str, list[float]]:
        return {name: list(values) for name, values in self.groups}

    def get(self, name: str) -> tuple[float, ...] | None:
        for group, values in self.groups:
            if group == name:
                return values
        return None

    def for_layout(self, layout: Layout, default: float | None = None) -> "Weights":
        """These weights arranged for ``layout``; missing groups get ``default`` (or an error)."""
        groups = []
        for name, n in layout:
            values = self.get(name)
            if values is None:
                if default is None:
                    raise InputError(f"no weight for feature {name!r}")
                values = (default,) * n
            elif len(values) != n:
                raise InputError(f"feature {name!r} has {n} values but {len(values)} weights")
            groups.append((name, values))
        return Weights(tuple(groups))

    def normalized_l1(self) -> "Weights":
        """Scaled to L1 norm 1, as Moses' mert reports its best point."""
        norm = sum(abs(v) for v in self.flat())
        if norm == 0:
            return self
        return Weights(tuple((name, tuple(v / norm for v in values)) for name, values in self.groups))


def format_weight(value: float) -> str:
    """A weight with enough digits to round-trip through text."""
    return repr(float(value))


def to_moses_ini(weights: Weights) -> str:
    """A moses.ini ``[weight]`` section, one ``Name= v v`` line per feature."""
    lines = ["[weight]"]
    lines += [f"{name}= " + " ".join(format_weight(v) for v in values) for name, values in weights.groups]
    return "\n".join(lines) + "\n"


def to_weights_txt(weights: Weights) -> str:
    """Moses' mert ``weights.txt``: the flattened weights on one line, blank-separated."""
    return "".join(format_weight(v) + " " for v in weights.flat()) + "\n"


def parse_moses_ini(text: str, path: str = "<string>") -> Weights:
    """The ``[weight]`` section of a moses.ini (other sections are ignored)."""
    groups: list[tuple[str, tuple[float, ...]]] = []
    in_section = False
    seen = False
    for line_no, line in enumerate(text.splitlines(), start=1):
        stripped = line.split("#", 1)[0].strip()
        if not stripped:
            continue
        if stripped.startswith("["):
            in_section = stripped == "[weight]"
            seen = seen or in_section
            continue
        if not in_section:
            continue
        name, sep, rest = stripped.partition("=")
        if not sep or not name.strip() or " " in name.strip():
            raise InputError(f"expected 'Name= value …' in the [weight] section, got {stripped!r}", path, line_no)
        try:
            values = tuple(float(v) for v in rest.split())
        except ValueError as exc:
            raise InputError(f"weight of {name.strip()!r} is not a number: {rest.strip()!r}", path, line_no) from exc
        if not all(math.isfinite(v) for v in values):
            raise InputError(f"weight of {name.strip()!r} is not finite", path, line_no)
        groups.append((name.strip(), values))
    if not seen:
        raise InputError("no [weight] section", path)
    return Weights(tuple(groups))


def parse_weights_txt(text: str, layout: Layout, path: str = "<string>") -> Weights:
    """A mert ``weights.txt`` (flattened dense weights; later lines, sparse, are ignored)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    try:
        flat = [float(v) for v in first.split()]
    except ValueError as exc:
        raise InputError(f"not a line of numbers: {first[:60]!r}", path, 1) from exc
    total = sum(n for _, n in layout)
    if len(flat) != total:
        raise InputError(f"has {len(flat)} weights but the n-best list has {total} features", path, 1)
    return Weights.from_flat(layout, flat)


def load_weights(path: str | os.PathLike[str], layout: Layout | None = None) -> Weights:
    """Read a moses.ini (``[weight]`` section) or a ``weights.txt`` (needs ``layout``)."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise InputError(f"cannot read weights: {exc.strerror}", name) from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"not a weights file: not UTF-8 text ({exc.reason} at byte {exc.start})", name) from exc
    if "[weight]" in text or "=" in text:
        return parse_moses_ini(text, name)
    if layout is None:
        raise InputError("a weights.txt needs the n-best list's feature layout", name)
    return parse_weights_txt(text, layout, name)


def layout_names(layout: Layout) -> list[str]:
    """Moses' extractor names of the flattened features: ``Name_0 Name_1 …`` per group."""
    return [f"{name}_{i}" for name, n in layout for i in range(n)]


def layout_from_names(names: Iterable[str]) -> Layout:
    """Inverse of :func:`layout_names` (``LM0_0 TM0_0 TM0_1`` → ``(LM0, 1), (TM0, 2)``)."""
    layout: list[tuple[str, int]] = []
    for name in names:
        base, sep, index = name.rpartition("_")
        if not sep or not index.isdigit():
            base, index = name, "0"
        if layout and layout[-1][0] == base and int(index) == layout[-1][1]:
            layout[-1] = (base, layout[-1][1] + 1)
        else:
            layout.append((base, 1))
    return tuple(layout)
