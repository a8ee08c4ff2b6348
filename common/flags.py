"""``nlmserve.common.flags``: what the rooms' command lines share about their flags.

One spelling per idea; an older spelling stays accepted, hidden from ``--help``, and says
once on stderr what to write instead::

    action = parser.add_argument("--kenlm", help="...")
    deprecated_spelling(parser, "--kn", action)   # --kn FILE still works, with a warning

A value out of range is a usage error when it is parsed, before anything is read::

    parser.add_argument("--order", type=int_at_least(2))    # --order 0: exit 2, one line
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Sequence


class _OldSpelling(argparse.Action):
    """Stores as the new spelling's action would (a value, or ``const`` for a switch) and
    writes one deprecation line to stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def deprecated_spelling(container: Any, old: str, new: argparse.Action) -> None:
    """Accept ``old`` as a hidden spelling of the option ``new`` (an action returned by
    ``add_argument``, a store or store_true/store_const one) in ``container``, the parser or
    group that holds ``new`` (so a mutually exclusive group still excludes it)."""
    container.add_argument(old, dest=new.dest, action=_OldSpelling, new=new.option_strings[0], nargs=new.nargs,
                           const=new.const, type=new.type, choices=new.choices, metavar=new.metavar,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)


# ---------------------------------------------------------------------- values
# argparse ``type=`` functions: a value out of range is a usage error (exit 2) at parsing,
# before any file is read, with one line naming the flag.


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, not {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        value = int_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must lie between {low} and {high}, not {value}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
             ) -> Callable[[str], float]:
    """A finite number in the interval from ``low`` to ``high`` (each end closed unless said open)."""
    span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or math.isinf(high) else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high \
                or (high_open and value == high):
            if math.isinf(high):
                bound = f"more than {low:g}" if low_open else f"at least {low:g}"
                raise argparse.ArgumentTypeError(f"must be {bound}, not {text}")
            raise argparse.ArgumentTypeError(f"must lie in {span}, not {text}")
        return value

    parse.__name__ = f"number in {span}"
    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return float_in(0.0, low_open=True)(text)
