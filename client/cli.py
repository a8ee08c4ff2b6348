"""``nlmserve score --server HOST:PORT [--json] < text``: per-sentence scores, like KenLM's ``query``;
``nlmserve reload --server HOST:PORT [--path FILE]``: make the server load a model file.

``--server`` of ``score`` (and of ``rescore``/``experiment``) also takes replicas of one model:
``a:1,b:2`` or ``dns:///name:port`` (round_robin, health-checked); ``reload`` takes a
comma-separated list and reloads the replicas one after the other.

Plain output, one line per sentence, then a summary (KenLM's layout)::

    word=id ngram_length log10prob<TAB>...</s>=2 n log10prob<TAB>Total: T OOV: k
    Perplexity including OOVs:<TAB>P
    Perplexity excluding OOVs:<TAB>P
    OOVs:<TAB>k
    Tokens:<TAB>n

``--json``: one object per sentence (``tokens`` with word, id, ngram_length, log10 prob,
oov; ``total``; ``oov``), then one ``{"summary": {...}}`` object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, TextIO

from nlmserve.errors import InputError

if TYPE_CHECKING:
    from nlmserve.client.sync import LMClient

BATCH_LINES = 1000
SERVER_HELP = ("HOST:PORT of `nlmserve serve`, or replicas of one model: HOST:PORT,HOST:PORT,... "
               "or dns:///NAME:PORT (balanced round_robin, unhealthy replicas skipped)")


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("score", help="score sentences from stdin against a server (like KenLM's query)",
                              description="Score whitespace-tokenised sentences (one per line) from stdin.")
    p.add_argument("--server", required=True, help=SERVER_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object per sentence")
    p.add_argument("--lowercase", action="store_true", help="lowercase the input first")
    p.add_argument("--no-bos", action="store_true", help="do not condition the first word on <s>")
    p.add_argument("--no-eos", action="store_true", help="do not score </s>")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    add_security_flags(p)
    p.set_defaults(func=run_score)

    r = subparsers.add_parser("reload", help="make a running server load a model file (Admin/ReloadModel)",
                              description="Ask `nlmserve serve` to load and serve a model file without "
                                          "failing a request; prints the new model hash.")
    r.add_argument("--server", required=True,
                   help="HOST:PORT of `nlmserve serve`; HOST:PORT,HOST:PORT reloads replicas one by one")
    r.add_argument("--path", default="", help="model file on the server (default: its --model)")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds to wait (default 300)")
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
    from nlmserve.client.sync import LMClient

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
            info = client.reload_model(args.path)
        sys.stdout.write(f"serving {info.model_hash}" + (f" on {address}\n" if len(replicas) > 1 else "\n"))
        sys.stdout.flush()
    return 0


@dataclass
class Totals:
    log10: float = 0.0
    oov_log10: float = 0.0
    tokens: int = 0
    oovs: int = 0

    def summary(self) -> dict[str, float | int]:
        ppl = math.pow(10.0, -self.log10 / self.tokens) if self.tokens else float("nan")
        known = self.tokens - self.oovs
        ppl_excl = math.pow(10.0, -(self.log10 - self.oov_log10) / known) if known else float("nan")
        return {"perplexity": ppl, "perplexity_excl_oov": ppl_excl, "oovs": self.oovs, "tokens": self.tokens}


def _batches(stream: TextIO, lowercase: bool) -> Iterator[list[str]]:
    batch: list[str] = []
    for line in stream:
        text = line.strip()
        batch.append(text.lower() if lowercase else text)
        if len(batch) >= BATCH_LINES:
            yield batch
            batch = []
    if batch:
        yield batch


def run_score(args: argparse.Namespace) -> int:
    totals = Totals()
    out = sys.stdout
    with connect(args.server, args, args.timeout) as client:
        vocab = client.vocabulary()
        lower = client.info.lowercase
        eos = not args.no_eos
        for batch in _batches(sys.stdin, args.lowercase):
            scores = client.score_sentences(batch, bos=not args.no_bos, eos=eos, log_base="log10")
            for text, s in zip(batch, scores):
                words = text.split() + (["</s>"] if eos else [])
                lp, lens, oov = s.token_log_probs.tolist(), s.ngram_lengths.tolist(), s.oov.tolist()
                ids = [vocab.get(w.lower() if lower else w, 0) for w in words]
                n_oov = sum(oov)
                totals.log10 += s.total
                totals.oov_log10 += sum(p for p, o in zip(lp, oov) if o)
                totals.tokens += len(words)
                totals.oovs += n_oov
                if args.json:
                    tokens = [{"word": w, "id": i, "ngram_length": n, "log_prob": p, "oov": o}
                              for w, i, n, p, o in zip(words, ids, lens, lp, oov)]
                    out.write(json.dumps({"tokens": tokens, "total": s.total, "oov": n_oov}) + "\n")
                else:
                    cells = [f"{w}={i} {n} {p:.6g}" for w, i, n, p in zip(words, ids, lens, lp)]
                    out.write("\t".join(cells + [f"Total: {s.total:.6g} OOV: {n_oov}"]) + "\n")
    summary = totals.summary()
    if args.json:
        out.write(json.dumps({"summary": summary}) + "\n")
    else:
        out.write(f"Perplexity including OOVs:\t{summary['perplexity']:.6g}\n")
        out.write(f"Perplexity excluding OOVs:\t{summary['perplexity_excl_oov']:.6g}\n")
        out.write(f"OOVs:\t{summary['oovs']}\n")
        out.write(f"Tokens:\t{summary['tokens']}\n")
    return 0
