"""``nlmserve.cli``, the ``nlmserve`` command line: parses and dispatches, nothing more.

Each room registers its own subcommands from a light ``cli`` module that imports heavy
dependencies (torch) only inside the handler, so ``nlmserve score`` on a decoder host
never loads torch.

What a user's mistake gets (docs/DESIGN): one line on stderr, ``nlmserve COMMAND: error:
…``, naming the file or the flag; exit status 2 for usage (argparse's errors, a flag's value
out of range, :class:`UsageError`) and 1 at run time (the project's errors, the OS's file
errors, a ``ValueError`` of a check); the traceback too only with ``-v``. Output into a
closed pipe (``nlmserve query … | head -1``) ends the process as coreutils' do: killed by
SIGPIPE (the shell shows 141), without a word.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import sys
import traceback
from typing import Callable, NoReturn, Sequence

from . import __version__
from .common.errors import NlmserveError, UsageError

# Modules that define ``register(subparsers) -> None``; each parser sets ``func``.
_ROOM_CLIS = (
    "nlmserve.lm.cli",
    "nlmserve.server.cli",
    "nlmserve.client.cli",
    "nlmserve.moses_plugin.cli",
    "nlmserve.pipeline.cli",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (the usage itself is ``--help``'s); the
    subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, which names the subcommand and its --help
        commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        command = commands[0].choices.get(args.command) if commands and args.command else None
        (command or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.verbose == 0:  # sacrebleu narrates each corpus score and bootstrap at INFO
        logging.getLogger("sacrebleu").setLevel(logging.WARNING)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError as exc:
        if _stdout_closed():
            _die_of_sigpipe()
        return _error(args, exc, 1)
    except UsageError as exc:
        return _error(args, exc, 2)
    except (NlmserveError, OSError, ValueError) as exc:
        return _error(args, exc, 1)
    except KeyboardInterrupt:
        return 130


def _error(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    """Print ``exc`` as one line (after its traceback with ``-v``) → ``code``."""
    if args.verbose:
        traceback.print_exc()
    print(f"nlmserve {args.command}: error: {error_line(exc)}", file=sys.stderr)
    return code


def error_line(exc: BaseException) -> str:
    """The one line a caught error is shown as: an OS error names its file and says what
    happened (``FILE: No such file or directory``), without errno or Python's repr."""
    if isinstance(exc, OSError) and not isinstance(exc, NlmserveError) and exc.strerror:
        names = " -> ".join(str(n) for n in (exc.filename, exc.filename2) if n is not None)
        return f"{names}: {exc.strerror}" if names else exc.strerror
    text = " ".join(str(exc).split())  # one line, whatever the message held
    return text or type(exc).__name__


def _stdout_closed() -> bool:
    """Whether standard output is a pipe (or socket) whose reader has gone."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _die_of_sigpipe() -> NoReturn:
    """End as a process that wrote to a closed pipe ends by default: killed by SIGPIPE,
    with nothing more written (Python ignores SIGPIPE and raises BrokenPipeError instead)."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(128 + signal.SIGPIPE)  # not reached: the signal ends the process


if __name__ == "__main__":
    sys.exit(main())
