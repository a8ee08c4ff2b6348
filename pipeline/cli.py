"""``nlmserve experiment | moses-experiment``: parse and dispatch.

Heavy work lives in the modules; each handler imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    _register_experiment(subparsers)
    _register_moses_experiment(subparsers)


def _register_experiment(subparsers: Any) -> None:
    from .experiment import add_arguments

    p = subparsers.add_parser("experiment", help="train, rescore, tune with and without NLM0, report BLEU")
    add_arguments(p)
    p.set_defaults(func=_experiment)


def _experiment(args: argparse.Namespace) -> int:
    from .experiment import run_from_args

    return run_from_args(args)


def _register_moses_experiment(subparsers: Any) -> None:
    from .moses_experiment import add_arguments

    p = subparsers.add_parser(
        "moses-experiment", help="the NLM inside Moses: tune with mert-moses.pl with and without NLM0, decode, BLEU",
        description="Serve the model(s) (or train one first), tune KENLM alone and KENLM + NLM0 with Moses' own "
                    "mert-moses.pl on the dev set, decode the test set with each tuned moses.ini, and report "
                    "BLEU with a paired bootstrap p-value; resumable (docs/moses.md).")
    add_arguments(p)
    p.set_defaults(func=_moses_experiment)


def _moses_experiment(args: argparse.Namespace) -> int:
    from .moses_experiment import run_from_args

    return run_from_args(args)
