"""``nlmserve score --server HOST:PORT [--json] < text``: per-sentence scores, like KenLM's ``query``;
``nlmserve reload --server HOST:PORT [--model FILE]``: make the server load a model file.

``--server`` of ``score`` (and of ``rescore``/``experiment``) also takes replicas of one model:
``a:1,b:2`` or ``dns:///name:port`` (round_robin, health-checked); ``reload`` takes a
comma-separated list and reloads the replicas one after the other.

``score`` writes KenLM query's layout (``nlmserve.common.kenlm_query``, which ``nlmserve query``
writes too from a model file in its own process)::

    word=id ngram_length log10prob<TAB>...</s>=2 n log10prob<TAB>Total: T OOV: k
    Perplexity including OOVs:<TAB>P
    Perplexity excluding OOVs:<TAB>P
    OOVs:<TAB>k
    Tokens:<TAB>n
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ..common.errors import InputError
from ..common.flags import deprecated_spelling, positive_float
from ..common.kenlm_query import add_input_flags, write_scores

if TYPE_CHECKING:
    from .core import SentenceScore
    from .sync import LMClient

SERVER_HELP = ("HOST:PORT of `nlmserve serve`, or replicas of one model: HOST:PORT,HOST:PORT,... "
               "or dns:///NAME:PORT (balanced round_robin, unhealthy replicas skipped)")


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("score", help="score sentences from stdin against a server (like KenLM's query)",
                              description="Score whitespace-tokenised sentences (one per line) from stdin.")
    p.add_argument("--server", required=True, help=SERVER_HELP)
    add_input_flags(p)
    p.add_argument("--timeout", type=positive_float, default=60.0, help="seconds per request (default 60)")
    add_security_flags(p)
    p.set_defaults(func=run_score)

    r = subparsers.add_parser("reload", help="make a running server load a model file (Admin/ReloadModel)",
                              description="Ask `nlmserve serve` to load and serve a model file without "
                                          "failing a request; prints the new model hash.")
    r.add_argument("--server", required=True,
                   help="HOST:PORT of `nlmserve serve`; HOST:PORT,HOST:PORT reloads replicas one by one")
    deprecated_spelling(r, "--path", r.add_argument(
        "--model", metavar="FILE", default="", help="model file on the server (default: its serve --model)"))
    r.add_argument("--timeout", type=positive_float, default=300.0, help="seconds to wait (default 300)")
    add_security_flags(r)
    r.set_defaults(func=run_reload)


def add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--tls-ca", help="PEM CA that signed the server certificate (implies TLS)")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    p.add_argument("--tls-server-name", help="name to check the server certificate against")
    p.add_argument("--token-file", help="file whose first line is the bearer token")


def security_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"tls": args.tls, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
            "tls_server_name": args.tls_server_name, "token_file": args.token_file}


def connect(server: str, args: argparse.Namespace, timeout: float) -> "LMClient":
    """An ``LMClient`` for ``--server`` with the security flags of ``add_security_flags``."""
    from .sync import LMClient

    try:
        return LMClient(server, timeout=timeout, **security_kwargs(args))
    except ValueError as e:
        raise InputError(f"--server {server}: {e}") from e


def run_reload(args: argparse.Namespace) -> int:
    replicas = [a.strip() for a in args.server.split(",") if a.strip()]
    if any(a.startswith("dns:") for a in replicas):
        raise InputError("reload replicas through their own HOST:PORT addresses, not a DNS name")
    for address in replicas:
        with connect(address, args, args.timeout) as client:
            info = client.reload_model(args.model)
        sys.stdout.write(f"serving {info.model_hash}" + (f" on {address}\n" if len(replicas) > 1 else "\n"))
        sys.stdout.flush()
    return 0


def run_score(args: argparse.Namespace) -> int:
    with connect(args.server, args, args.timeout) as client:
        def score(batch: list[str]) -> "list[SentenceScore]":
            return client.score_sentences(batch, bos=not args.no_bos, eos=not args.no_eos, log_base="log10",
                                          normalized=not args.unnormalized)

        write_scores(sys.stdin.buffer, sys.stdout, score, client.vocabulary(), model_lowercase=client.info.lowercase,
                     lowercase=args.lowercase, eos=not args.no_eos, as_json=args.json)
    return 0
