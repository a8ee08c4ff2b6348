"""``nlmserve.common.flags``: what the rooms' command lines share about their flags.

One spelling per idea; an older spelling stays accepted, hidden from ``--help``, and says
once on stderr what to write instead::

    action = parser.add_argument("--kenlm", help="...")
    deprecated_spelling(parser, "--kn", action)   # --kn FILE still works, with a warning
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence


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
