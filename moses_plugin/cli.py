"""``nlmserve rescore | tune | rerank | search-errors | bleu | moses-ini``: parse and dispatch.

Heavy work lives in the modules; each handler imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from ..client.cli import SERVER_HELP, add_security_flags
from ..common.errors import InputError, UsageError
from ..common.flags import deprecated_spelling, float_in, int_at_least, positive_float
from ..common.paths import LIST, MODEL, PLAIN, TABLES, check_input, check_output
from .nbest import feature_name

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    _register_rescore(subparsers)
    _register_tune(subparsers)
    _register_rerank(subparsers)
    _register_search_errors(subparsers)
    _register_bleu(subparsers)
    _register_moses_ini(subparsers)


def _register_rescore(subparsers: Any) -> None:
    p = subparsers.add_parser("rescore", help="add the neural LM's sentence log-probability to an n-best list")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--server", help=SERVER_HELP)
    source.add_argument("--model", metavar="FILE",
                        help="instead of a server: a model file of nlmserve train, scored in this process "
                             "(cuda when available, else cpu); the same output as through a server of it")
    source.add_argument("--kenlm", metavar="FILE",
                        help="instead of a server: a Kneser-Ney model (ARPA or KenLM binary) read in-process "
                             "by the kenlm module, e.g. an in-domain LM as --feature-name KN1")
    p.add_argument("--nbest", required=True, help="Moses n-best list (plain or gzip)")
    p.add_argument("--out", required=True, help="output n-best list (gzip when it ends in .gz)")
    p.add_argument("--feature-name", type=feature_name, default="NLM0",
                   help="name of the new dense feature (no '_'; default NLM0)")
    p.add_argument("--lowercase", action="store_true", help="lowercase hypotheses before scoring")
    p.add_argument("--unnormalized", action="store_true",
                   help="the self-normalised score of an NCE model, as the decoder's normalized=false "
                        "(a model that is not self-normalised gives its normalised scores)")
    p.add_argument("--skip-bad", action="store_true", help="count and drop malformed lines instead of failing")
    p.add_argument("--batch-ngrams", type=int_at_least(1), default=50_000, help="n-grams per batch and checkpoint (default 50000)")
    p.add_argument("--wait-server", type=float_in(0.0), default=60.0, help="seconds to wait for a lost server (default 60)")
    p.add_argument("--timeout", type=positive_float, default=60.0, help="per-request timeout in seconds (default 60)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, a log line every 30 s otherwise)")
    add_security_flags(p)
    p.set_defaults(func=_rescore)


def _register_tune(subparsers: Any) -> None:
    p = subparsers.add_parser("tune", help="MERT or batch MIRA on n-best lists (union over lists), BLEU by sacrebleu")
    p.add_argument("--nbest", nargs="+", required=True, help="n-best lists, e.g. of successive decoder runs")
    p.add_argument("--ref", nargs="+", required=True, help="reference files (one per reference set)")
    p.add_argument("--out", required=True, help="weights path: writes OUT.ini ([weight] section) and OUT.txt (weights.txt)")
    p.add_argument("--init", help="initial weights: moses.ini or weights.txt (default: the decoder's, fitted to the totals)")
    tuner = p.add_argument("--tuner", choices=("mert", "mira"), default="mert",
                           help="mert: Och's exact line search; mira: batch k-best MIRA as Moses' kbmira "
                                "(mert-moses.pl --batch-mira) (default mert)")
    deprecated_spelling(p, "--algorithm", tuner)
    p.add_argument("--restarts", type=int_at_least(0), default=5, help="MERT: random restarts (default 5)")
    p.add_argument("--random-directions", type=int_at_least(0), default=3, help="MERT: random directions per sweep (default 3)")
    p.add_argument("--iterations", type=int_at_least(1), default=60, help="MIRA: epochs over the sentences (kbmira --iters, default 60)")
    p.add_argument("--mira-c", type=positive_float, default=0.01, help="MIRA: step cap C, lower regularises more (default 0.01)")
    p.add_argument("--decay", type=float_in(0.0, 1.0, low_open=True), default=0.999, help="MIRA: background BLEU decay (default 0.999)")
    p.add_argument("--model-bg", action="store_true", help="MIRA: background BLEU from the model's 1-best, not the hope")
    p.add_argument("--seed", type=int, default=0, help="random seed: MERT's restarts and directions, MIRA's order (default 0)")
    p.add_argument("--lowercase", action="store_true", help="lowercased BLEU")
    p.add_argument("--tokenize", default="none", help="sacrebleu tokenizer (default none: lists are tokenised)")
    p.add_argument("--features", nargs="+", help="tune only these feature groups (default: all in the list)")
    p.add_argument("--fix", nargs="+", default=[], help="feature groups held at their initial weights")
    p.add_argument("--range", nargs="+", default=[], dest="ranges", metavar="NAME[:i]=LO..HI",
                   help="bounds of weights (empty side: unbounded), e.g. WordPenalty0=-1..0")
    p.add_argument("--no-normalize", action="store_true", help="do not L1-normalise the result")
    p.add_argument("--ffile", help="also write the features in Moses' extractor text format")
    p.add_argument("--scfile", help="also write the BLEU statistics in Moses' extractor text format")
    p.add_argument("--prev-ffile", help="previous extractor feature file to merge (with --prev-scfile)")
    p.add_argument("--prev-scfile", help="previous extractor score file to merge")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed n-best lines")
    p.set_defaults(func=_tune)


def _register_rerank(subparsers: Any) -> None:
    p = subparsers.add_parser("rerank", help="1-best per sentence under a set of weights")
    p.add_argument("--nbest", required=True, help="n-best list")
    p.add_argument("--weights", required=True, help="moses.ini ([weight] section) or weights.txt")
    p.add_argument("--out", required=True, help="output: one hypothesis per line")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed n-best lines")
    p.set_defaults(func=_rerank)


def _register_search_errors(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "search-errors",
        help="how often the decoder's 1-best lost, under its own weights, to a hypothesis of other n-best lists")
    p.add_argument("--nbest", required=True, help="n-best list the decoder wrote with --weights (first entry = 1-best)")
    p.add_argument("--weights", required=True, help="the moses.ini it decoded with ([weight] section) or weights.txt")
    p.add_argument("--earlier", nargs="*", default=[],
                   help="n-best lists of the same sentences from the same system, e.g. a tuning's earlier "
                        "runN.best100.out.gz")
    p.add_argument("--margin", type=float_in(0.0), default=1e-3, help="model-score difference that counts (default 0.001)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_search_errors)


def _register_bleu(subparsers: Any) -> None:
    p = subparsers.add_parser("bleu", help="sacrebleu BLEU with signature; paired bootstrap against --baseline")
    p.add_argument("--hyp", required=True, help="system output, one sentence per line")
    p.add_argument("--ref", nargs="+", required=True, help="reference files")
    p.add_argument("--baseline", help="baseline output: adds sacrebleu's paired bootstrap p-value")
    p.add_argument("--samples", type=int_at_least(1), default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--lowercase", action="store_true", help="lowercased BLEU")
    p.add_argument("--tokenize", default="none", help="sacrebleu tokenizer (default none: tokenised text)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_bleu)


def _register_moses_ini(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "moses-ini", help="the NeuralLMServer feature line and starting weight that fit a model, for moses.ini")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="FILE", help="a model file of nlmserve train (read here, no server)")
    source.add_argument("--server", help="a running server: " + SERVER_HELP)
    p.add_argument("--path", default=None,
                   help="with --model or --tables: the path= the decoder will use, where the model is served "
                        "(default with --model alone 127.0.0.1:50051, nlmserve serve's default port; with --tables "
                        "none: the server-free line)")
    p.add_argument("--name", type=feature_name, default="NLM0", help="the feature's name (no '_'; default NLM0)")
    p.add_argument("--ini", metavar="FILE",
                   help="the system's moses.ini: the starting weight is a share of the L1 norm of its tuneable "
                        "weights (default: of weights of L1 norm 1, as mert-moses.pl writes them)")
    p.add_argument("--tables", metavar="FILE",
                   help="a tables file of the model (`nlmserve export-tables`): the server-free line, which maps "
                        "it (tables=FILE: its vocabulary, the model's facts, one copy of the tables for every decoder "
                        "of the host) and needs no server; alone, or with --model or --server to check it is theirs")
    p.add_argument("--timeout", type=positive_float, default=30.0, help="per-request timeout in seconds (default 30)")
    add_security_flags(p)
    p.set_defaults(func=_moses_ini)


def _moses_ini(args: argparse.Namespace) -> int:
    from . import moses_ini

    extra = _feature_security(args)
    if not (args.model or args.server or args.tables):
        raise UsageError("give --tables FILE (the server-free line), --model FILE or --server HOST:PORT")
    if not args.server and extra:
        raise UsageError("--tls* and --token-file go with --server (the feature's own options are set for it)")
    if args.server and args.path:
        raise UsageError("--path goes with --model or --tables: with --server the path is the server's address")
    if args.model:
        check_input(args.model, MODEL)
    if args.ini:
        check_input(args.ini, PLAIN)
    if args.tables:
        check_input(args.tables, TABLES)
    path: str | None
    if args.server:
        from ..client.cli import security_kwargs

        facts = moses_ini.facts_of_server(args.server, args.timeout, security_kwargs(args))
        path = args.server
    elif args.model:
        facts = moses_ini.facts_of_file(args.model)
        path = args.path or (None if args.tables else moses_ini.DEFAULT_PATH)
    else:
        facts = moses_ini.facts_of_tables(args.tables)
        path = args.path
    if args.tables:
        own = moses_ini.facts_of_tables(args.tables)  # ModelFileError names a file that is not one
        if own.model_hash != facts.model_hash:
            raise InputError(f"holds the tables of model {own.model_hash[:12]}, not of {facts.model_hash[:12]}: "
                             "write it with `nlmserve export-tables --model` of this model", args.tables)
        extra["tables"] = os.path.abspath(args.tables)
    share = f"{moses_ini.START_SHARE:g} of the L1 norm of"
    if args.ini:
        try:
            with open(args.ini, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror}", args.ini) from e
        except UnicodeDecodeError as e:
            raise InputError(f"not a UTF-8 text file ({e.reason})", args.ini) from e
        norm = moses_ini.tuneable_l1_norm(text, args.ini)
        reason = f"starting weight: {share} the tuneable weights of {args.ini} ({norm:.6g})"
    else:
        norm = 1.0
        reason = f"starting weight: {share} the other weights (1 as mert-moses.pl writes them)"
    print(moses_ini.render(facts, path, moses_ini.start_weight(norm), reason, args.name, extra), end="")
    return 0


def _feature_security(args: argparse.Namespace) -> dict[str, str]:
    """The feature's TLS and token options for the client flags given (the feature speaks TLS
    only with a CA file)."""
    if args.tls and not args.tls_ca:
        raise UsageError("the NeuralLMServer feature's TLS needs the CA file: give --tls-ca")
    names = {"tls_ca": "tls-ca", "tls_cert": "tls-cert", "tls_key": "tls-key",
             "tls_server_name": "tls-server-name", "token_file": "token-file"}
    return {option: os.path.abspath(getattr(args, field)) if field != "tls_server_name" else getattr(args, field)
            for field, option in names.items() if getattr(args, field)}


def _rescore(args: argparse.Namespace) -> int:
    from .rescore import RescoreConfig, rescore

    check_output(args.out)
    check_input(args.nbest, LIST)
    if args.model:
        check_input(args.model, MODEL)
    if args.kenlm:
        check_input(args.kenlm)
    config = RescoreConfig(
        feature_name=args.feature_name,
        lowercase=args.lowercase,
        normalized=not args.unnormalized,
        skip_bad=args.skip_bad,
        batch_ngrams=args.batch_ngrams,
        wait_server=args.wait_server,
        progress=not args.no_progress,
    )

    def connect() -> Any:
        if args.kenlm:
            from .kenlm_source import KenlmScorer

            return KenlmScorer(args.kenlm)
        if args.model:
            from .model_source import ModelScorer

            return ModelScorer(args.model)
        from ..client.cli import connect

        return connect(args.server, args, args.timeout)

    stats = rescore(args.nbest, args.out, connect, config)
    rate = stats.seconds or float("nan")
    print(f"rescored {stats.sentences} sentences, {stats.hypotheses} hypotheses into {args.out}"
          f" ({stats.resumed_sentences} sentences resumed from a checkpoint)")
    print(f"n-grams {stats.ngrams}, distinct {stats.distinct_ngrams} (distinct share {stats.distinct_share:.3f}),"
          f" {stats.hypotheses / rate:.1f} hyp/s, {stats.ngrams / rate:.1f} n-grams/s, model {stats.model_hash}")
    if stats.bad_lines:
        print(f"skipped {stats.bad_lines} malformed lines, e.g. {stats.bad_examples[0]}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from . import extractor, mert, mira
    from .bleu import BleuConfig, SentenceStats, full_signature, read_references
    from .nbest import write_text_atomic
    from .weights import load_weights, to_moses_ini, to_weights_txt

    if bool(args.prev_ffile) != bool(args.prev_scfile):
        raise UsageError("--prev-ffile and --prev-scfile go together")
    stem = _strip_suffix(args.out)
    outputs = [stem + ".ini", stem + ".txt"]
    if args.ffile or args.scfile:
        outputs += [args.ffile or stem + ".features.dat", args.scfile or stem + ".scores.dat"]
    for path in outputs:
        check_output(path)
    for path in [*args.nbest, *args.ref]:
        check_input(path, LIST)
    for path in (args.init, args.prev_ffile, args.prev_scfile):
        if path:
            check_input(path, PLAIN)
    mira_config = mira.MiraConfig(iterations=args.iterations, c=args.mira_c, decay=args.decay, model_bg=args.model_bg,
                                  seed=args.seed, normalize=not args.no_normalize)  # checked before any work
    bleu_config = BleuConfig(lowercase=args.lowercase, tokenize=args.tokenize)
    scorer = SentenceStats(bleu_config, read_references(args.ref))
    data = mert.load_nbest_data(args.nbest, scorer, features=args.features, skip_bad=args.skip_bad)
    if args.prev_ffile:
        added = mert.merge(data, extractor.load(args.prev_ffile, args.prev_scfile))
        log.info("merged %d hypotheses from %s", added, args.prev_ffile)
    if args.init:
        init = load_weights(args.init, data.layout).for_layout(data.layout, default=0.0)
    else:
        init, residual = mert.weights_from_totals(args.nbest, data.layout, skip_bad=args.skip_bad)
        log.info("initial weights fitted to the totals (largest residual %.3g)", residual)
    ranges = mert.fix_features(mert.parse_ranges(args.ranges, data.layout), args.fix, data.layout)
    if args.tuner == "mira":
        found = mira.tune(data, scorer, init, ranges, mira_config)
        weights, tuned_bleu, start_bleu = found.weights, found.bleu, found.start_bleu
        work = f"{len(found.epochs)} MIRA epochs, {found.updates} updates"
    else:
        result = mert.tune(data, scorer, init, ranges, mert.MertConfig(
            restarts=args.restarts, random_directions=args.random_directions, seed=args.seed,
            normalize=not args.no_normalize))
        weights, tuned_bleu, start_bleu = result.weights, result.bleu, result.start_bleu
        work = f"{result.line_searches} line searches"
    write_text_atomic(stem + ".ini", to_moses_ini(weights))
    write_text_atomic(stem + ".txt", to_weights_txt(weights))
    if args.ffile or args.scfile:
        extractor.save(data, args.ffile or stem + ".features.dat", args.scfile or stem + ".scores.dat")
    signature = full_signature(scorer.metric.get_signature().format(), weights.as_dict())
    print(f"BLEU {tuned_bleu:.2f} on the tuning lists (start {start_bleu:.2f}),"
          f" {data.n_hypotheses} hypotheses of {len(data.feats)} sentences, {work}")
    print(f"signature {signature}")
    print(to_moses_ini(weights), end="")
    print(f"wrote {stem}.ini and {stem}.txt")
    return 0


def _strip_suffix(path: str) -> str:
    root, ext = os.path.splitext(path)
    return root if ext in (".ini", ".txt") else path


def _rerank(args: argparse.Namespace) -> int:
    from .nbest import write_text_atomic
    from .rerank import rerank
    from .weights import load_weights

    check_output(args.out)
    check_input(args.nbest, LIST)
    check_input(args.weights, PLAIN)
    weights = load_weights(args.weights, _layout_of(args.nbest))
    result = rerank(args.nbest, weights, skip_bad=args.skip_bad)
    write_text_atomic(args.out, "".join(h + "\n" for h in result.hyps))
    print(f"wrote {len(result.hyps)} lines to {args.out} ({len(result.missing)} sentences without hypotheses)")
    return 0


def _search_errors(args: argparse.Namespace) -> int:
    from .rerank import search_check
    from .weights import load_weights

    check_input(args.nbest, LIST)
    check_input(args.weights, PLAIN)
    for path in args.earlier:
        check_input(path, LIST)
    weights = load_weights(args.weights, _layout_of(args.nbest))
    check = search_check(args.nbest, list(args.earlier), weights, margin=args.margin)
    share = check.share
    if args.json:
        print(json.dumps({"sentences": check.sentences, "beaten": check.beaten, "share": share,
                          "mean_gap": check.mean_gap}))
    else:
        print(f"{check.beaten} of {check.sentences} sentences ({100 * share:.1f}%): the 1-best scores lower than "
              f"a hypothesis of the lists (mean difference {check.mean_gap:.3f})")
    return 0


def _layout_of(path: str) -> tuple[tuple[str, int], ...] | None:
    from .nbest import iter_entries

    for entry in iter_entries(path, skip_bad=True):
        return entry.layout()
    return None


def _bleu(args: argparse.Namespace) -> int:
    from .bleu import BleuConfig, corpus_bleu, paired_bootstrap, read_references
    from .nbest import read_lines

    check_input(args.hyp, LIST)
    for path in args.ref:
        check_input(path, LIST)
    if args.baseline:
        check_input(args.baseline, LIST)
    config = BleuConfig(lowercase=args.lowercase, tokenize=args.tokenize)
    hyps = read_lines(args.hyp)
    refs = read_references(args.ref)
    score, signature = corpus_bleu(hyps, refs, config)
    out: dict[str, Any] = {"bleu": score.score, "score": str(score), "signature": signature}
    if args.baseline:
        paired = paired_bootstrap(read_lines(args.baseline), hyps, refs, config, args.samples)
        out.update(baseline_bleu=paired.baseline_bleu, p_value=paired.p_value, paired_signature=paired.signature,
                   mean=paired.system_mean, ci95=paired.system_ci)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{score} {signature}")
    if args.baseline:
        print(f"baseline BLEU {out['baseline_bleu']:.2f}, system {score.score:.2f}"
              f" ({out['mean']:.2f} ± {out['ci95']:.2f}), paired bootstrap p = {out['p_value']:.4f}"
              f" [{out['paired_signature']}]")
    return 0
