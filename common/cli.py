"""``nlmserve.common.cli``, the ``nlmserve`` command line: parses and dispatches, nothing more.

Each room registers its own subcommands from a light ``cli`` module that imports heavy
dependencies (torch) only inside the handler, so ``nlmserve score`` on a decoder host
never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, Sequence

from .. import __version__
from .errors import NlmserveError

# Modules that define ``register(subparsers) -> None``; each parser sets ``func``.
_ROOM_CLIS = (
    "nlmserve.lm.cli",
    "nlmserve.server.cli",
    "nlmserve.client.cli",
    "nlmserve.moses_plugin.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nlmserve",
        description="Neural language-model feature server for phrase-based SMT.",
    )
    parser.add_argument("--version", action="version", version=f"nlmserve {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _ROOM_CLIS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.verbose == 0:  # sacrebleu narrates each corpus score and bootstrap at INFO
        logging.getLogger("sacrebleu").setLevel(logging.WARNING)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except NlmserveError as exc:
        print(f"nlmserve {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
