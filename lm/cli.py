"""``nlmserve train``, ``eval``, ``query``, ``info``, ``export-tables`` and ``normalize`` (torch is imported inside the handlers)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any

from ..common.errors import UsageError
from ..common.flags import deprecated_spelling, float_in, int_at_least, int_between, positive_float
from ..common.paths import MODEL, MODEL_OR_TABLES, TABLES, TEXT, check_input, check_output, check_output_dir
from ..common.kenlm_query import add_input_flags
from .recipe import AVERAGE_EVERY, RECIPE_FLAGS

log = logging.getLogger(__name__)

# Kept here (torch-free) so that --help needs no torch; a test checks that lm.strategies and
# lm.objectives agree.
OUTPUT_CHOICES = ("class", "softmax", "dsoftmax", "huffman", "random", "balanced", "adaptive", "adaptive-eps")
OBJECTIVE_CHOICES = ("nce", "mle", "softmax", "sampling", "weaknorm", "weaknormsq")
QUANTIZE_CHOICES = ("none", "fp16", "int8")  # lm.quantize.QUANTIZATIONS (a test checks they agree)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a class-factored neural n-gram LM",
        description="Train a neural n-gram language model (NCE, exact MLE or full softmax) and write a model file. "
                    "Flags shown with 'default: recipe' are chosen from the corpus size, --max-minutes and the "
                    "cores when not given (nlmserve.lm.recipe; the log says what was chosen): "
                    "`nlmserve train --train T --valid V --out M --max-minutes 60` needs nothing else.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--train", required=True, help="training text: one sentence per line (plain, .gz, .xz)")
    p.add_argument("--valid", help="validation text (learning-rate schedule, early stopping, best model)")
    p.add_argument("--out", required=True, help="model file to write (also OUT.ckpt, OUT.log.jsonl, OUT.curve.png)")
    p.add_argument("--recipe", choices=("auto", "none"), default="auto",
                   help="auto: the flags shown with 'default: recipe' are chosen from the corpus size, "
                        "--max-minutes and the cores (nlmserve.lm.recipe); none: their plain values, "
                        "the same on every machine")
    p.add_argument("--order", type=int_at_least(2), help="n-gram order: the predicted word and order-1 before it")
    p.add_argument("--dim", type=int_at_least(1), help="embedding width D")
    p.add_argument("--context", choices=("diagonal", "full"), default="diagonal", help="context weights")
    p.add_argument("--hidden", type=int_at_least(0), default=0, help="hidden layer width (0: none)")
    p.add_argument("--activation", choices=("none", "tanh", "relu"), default="none",
                   help="applied to the context vector")
    p.add_argument("--dropout", type=float_in(0.0, 1.0, high_open=True), help="dropout on the context vector while training (0: none)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--classes", type=int_at_least(1), help="number of word classes (default: the documented default for V)")
    g.add_argument("--class-file", help="word classes from a wcluster paths file (bits<TAB>word<TAB>count)")
    p.add_argument("--class-method", choices=("frequency", "frequency-sqrt", "brown"),
                   help="frequency-sqrt: bins on square roots of counts (narrow classes for V >= 100k)")
    p.add_argument("--output", choices=OUTPUT_CHOICES, default=None,
                   help="output layer: class-factored, full softmax, differentiated softmax, or a binary tree "
                        "(huffman, random, or Mnih & Hinton's balanced/adaptive/adaptive-eps); "
                        "default: softmax for --objective softmax/sampling/weaknorm/weaknormsq, else class")
    p.add_argument("--objective", choices=OBJECTIVE_CHOICES, default="nce",
                   help="nce, mle (exact likelihood of the output), softmax (full softmax, as --output softmax "
                        "--objective mle), sampling (target sampling), weaknorm, weaknormsq (self-normalising)")
    p.add_argument("--noise-samples", type=int_at_least(1), default=10,
                   help="k noise samples per example (nce); shared sample size per batch (sampling)")
    p.add_argument("--tree-eps", type=float_in(0.0, 0.5, high_open=True), default=0.25, help="ε of the adaptive-eps tree")
    p.add_argument("--tree-pretrain-steps", type=int_at_least(1), default=2000,
                   help="steps of the random-tree model behind the balanced/adaptive trees")
    p.add_argument("--norm-fraction", type=float_in(0.0, 1.0, low_open=True), default=0.1,
                   help="γ: fraction of examples whose normaliser weaknorm(sq) computes")
    p.add_argument("--norm-weight", type=float_in(0.0), help="α of the log Z penalty (weaknorm 0.1, weaknormsq 1.0)")
    p.add_argument("--epochs", type=int_at_least(1), help="passes over the training text at most")
    p.add_argument("--max-minutes", type=positive_float, help="wall-time budget; stops cleanly and writes the best model")
    p.add_argument("--max-steps", type=int_at_least(1), help="stop after this many optimiser steps")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--min-count", type=int_at_least(1), default=1, help="words seen fewer times become <unk>")
    p.add_argument("--max-vocab", type=int_at_least(4), help="keep at most this many words (with <unk>, <s>, </s>)")
    p.add_argument("--max-train-lines", type=int_at_least(1), help="train on the first N lines only")
    p.add_argument("--threads", type=int_at_least(1), help="torch threads per process")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel training under torchrun (gloo on CPU, NCCL on GPU); with the torch "
                        "step --batch-size is the global batch, split across the processes; with the fused "
                        "step each process takes its own --batch-size and the processes average their "
                        "parameters every --average-every steps")
    p.add_argument("--average-every", type=int_at_least(1), default=AVERAGE_EVERY,
                   help="with --distributed and the fused step: steps between two averages of the "
                        "processes' parameters (a step is one process's minibatch)")
    p.add_argument("--workers", type=int_at_least(1),
                   help="processes training one model together on the CPU, lock-free (Hogwild); "
                        "each takes its own minibatch of --batch-size; with --distributed (the fused "
                        "step), the workers of each process (default there: 1)")
    p.add_argument("--dense-grads", action="store_true", help="dense embedding gradients even with AdaGrad")
    p.add_argument("--step", choices=("auto", "torch", "fused"), default="auto",
                   help="auto: the fused CPU step for NCE with the class output and AdaGrad, the torch "
                        "step otherwise; torch: always the torch step (the reference)")
    p.add_argument("--seed", type=int, default=1, help="every random choice derives from it")
    p.add_argument("--resume", action="store_true", help="continue from OUT.ckpt when it exists")
    p.add_argument("--batch-size", type=int_at_least(1), default=512, help="n-grams per minibatch (per worker)")
    p.add_argument("--lr", type=positive_float, help="learning rate")
    p.add_argument("--optimizer", choices=("adagrad", "adam"), default="adagrad", help="the optimiser")
    p.add_argument("--min-improvement", type=float_in(0.0, 1.0, high_open=True),
                   help="halve the learning rate when validation improves by less than this fraction "
                        "(e.g. 0.005); 0: only when it does not improve")
    p.add_argument("--lr-schedule", choices=("plateau", "linear"),
                   help="plateau: change the rate on validation plateaus only; linear: also let it fall "
                        "linearly to 0 over the budget (--max-minutes, --max-steps or --epochs)")
    p.add_argument("--patience", type=int_at_least(1), help="validations without improvement before stopping")
    p.add_argument("--valid-every", type=int_at_least(0), help="validate every N steps (0: each epoch)")
    p.add_argument("--checkpoint-every", type=int_at_least(0), default=1000,
                   help="write OUT.ckpt every N steps, fewer when writing would take over 2%% of the time, "
                   "always where training stops (0: never)")
    p.add_argument("--log-every", type=int_at_least(1), default=100, help="append a record to OUT.log.jsonl every N steps")
    p.add_argument("--ngram-features", action=argparse.BooleanOptionalAction,
                   help="direct hashed n-gram features on the class and word scores (OxLM)")
    p.add_argument("--ngram-class-bits", type=int_between(0, 30),
                   help="log2 of the class feature table size (with --ngram-features)")
    p.add_argument("--ngram-word-bits", type=int_between(0, 30),
                   help="log2 of the word feature table size (with --ngram-features)")
    p.add_argument("--ngram-order", type=int_at_least(0),
                   help="longest n-gram with a direct feature (with --ngram-features; 0: the order)")
    p.add_argument("--workdir", help="where the id files go (default OUT.work)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    e = subparsers.add_parser(
        "eval", formatter_class=DefaultsFormatter,
        help="perplexity of a text (as KenLM's query reports it)",
        description="Perplexity including and excluding OOVs, tokens, OOVs, entropy per training-frequency band.",
    )
    e.add_argument("--model", required=True)
    e.add_argument("--text", required=True, help="one sentence per line (plain, .gz, .xz)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--lowercase", action="store_true", help="lowercase the text (also done when the model was trained so)")
    e.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    e.add_argument("--threads", type=int_at_least(0), default=0, help="torch threads (0: torch's default)")
    deprecated_spelling(e, "--kn", e.add_argument(
        "--kenlm", metavar="FILE", help="a Kneser-Ney model (ARPA or KenLM binary) to interpolate with"))
    w = e.add_mutually_exclusive_group()
    deprecated_spelling(w, "--kn-weight", w.add_argument(
        "--mix-weight", type=float_in(0.0, 1.0), metavar="λ", help="weight λ of the neural model in the mix with --kenlm"))
    deprecated_spelling(w, "--tune-kn-weight", w.add_argument(
        "--tune-mix-weight", metavar="DEV", help="tune λ on this text (maximum likelihood)"))
    e.set_defaults(func=_eval)

    q = subparsers.add_parser(
        "query", formatter_class=DefaultsFormatter,
        help="score sentences from stdin with a model file or a tables file, no server (KenLM's query)",
        description="Score whitespace-tokenised sentences (one per line) from stdin in this process and print "
                    "what `nlmserve score` prints through a server: word=id n log10 per token (n: the n-gram "
                    "length used; id 0: an unknown word, scored as <unk>), each sentence's total and OOVs, then "
                    "perplexity with and without OOVs, OOVs and tokens. With --tables, from a tables file with "
                    "numpy alone (no torch): a class output's self-normalised scores (those of --model "
                    "--unnormalized) or a tree's exact ones, within the error bound a quantised file records.",
    )
    source = q.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="FILE", help="model file written by `nlmserve train`")
    source.add_argument("--tables", metavar="FILE", help="tables file written by `nlmserve export-tables`")
    add_input_flags(q)
    q.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available; --model only)")
    q.add_argument("--threads", type=int_at_least(0), default=0,
                   help="torch threads (0: torch's default; --model only)")
    q.set_defaults(func=_query)

    i = subparsers.add_parser(
        "info", help="what a model file is: order, vocabulary, classes, output, objective, recipe, hash",
        description="Describe a model file from its header (no weights are loaded): order, vocabulary size, "
                    "classes, output layer, objective, whether it self-normalises, the recipe and flags it "
                    "was trained with, tokens seen, validation perplexity, its hash (the one a server of "
                    "it reports).",
    )
    i.add_argument("model", metavar="MODEL", help="model file written by `nlmserve train`, or a tables file written "
                                                  "by `nlmserve export-tables`")
    i.add_argument("--json", action="store_true", help="one JSON object (with the header's config and training record)")
    i.add_argument("--verify", action="store_true",
                   help="also read the whole file and check its content against the hash (a tables file: "
                        "against its checksum)")
    i.set_defaults(func=_info)

    t = subparsers.add_parser(
        "export-tables", help="write a model's scoring tables to a file every decoder on a host maps once",
        description="Write the tables the Moses feature's scoring=local scores with (what GetScoringTables "
                    "streams) to a file that each decoder maps read-only (the feature's tables=FILE), so that "
                    "the host holds one copy, as with a KenLM binary file. Models with scoring tables: "
                    "self-normalised class outputs and tree outputs with the diagonal context.",
    )
    t.add_argument("--model", required=True, help="model file written by `nlmserve train`")
    t.add_argument("--out", required=True, help="tables file to write (atomically), e.g. model.nlt")
    t.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="how the position and output rows are stored: none (float32, the model's scores), "
                        "fp16 (half the bytes), int8 (a byte per value and a scale per row: a quarter); the "
                        "file records the most a score may move (default: none)")
    t.set_defaults(func=_tables)

    n = subparsers.add_parser(
        "normalize", formatter_class=DefaultsFormatter,
        help="bring tokenised text into the form of the n-best lists (lowercase, 's, @-@)",
        description="Rewrite a tokenised text line for line: lowercase, typographic apostrophes and split "
                    "possessives joined ('s), hyphens split as Moses' tokenizer -a does (@-@). "
                    "Use it on in-domain LM training text before `nlmserve train`.",
    )
    n.add_argument("--in", dest="src", required=True, help="tokenised text (plain, .gz, .xz, or - for stdin)")
    n.add_argument("--out", required=True, help="output (.gz/.xz compressed by suffix; - for stdout); "
                                               "written atomically")
    n.add_argument("--lc-moses", action="store_true",
                   help="all three steps: the form of the shipped data and the newstest n-best lists")
    n.add_argument("--lowercase", action="store_true", help="lowercase")
    n.add_argument("--apostrophes", action="store_true", help="’ → ' and X ' s → X 's")
    n.add_argument("--split-hyphens", action="store_true", help="a-b → a @-@ b between letters or digits")
    n.set_defaults(func=_normalize)


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's default in its help: ``(default: X)``, ``(default: recipe)`` for the flags
    the training recipe chooses (nlmserve.lm.recipe), nothing for flags without one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or action.option_strings == []:
            return text
        if action.default is None:
            return text + " (default: recipe)" if action.dest in RECIPE_FLAGS else text
        if action.default is False and action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


def apply_recipe(args: argparse.Namespace) -> str:
    """Fill the recipe flags ``args`` leaves unset (None), as ``--recipe`` says → the line
    the log and the model file get ("" when every flag was given)."""
    from .recipe import PLAIN, choose, cores, describe, fill
    from .strategies import resolve_output

    if args.distributed and args.workers is None:
        args.workers = 1  # data-parallel processes, not Hogwild workers
    if args.ngram_features is None:
        try:
            if resolve_output(args.objective, args.output) != "class":
                args.ngram_features = False  # direct features need the class output
        except ValueError:
            pass  # TrainConfig reports it
    if all(getattr(args, name) is not None for name in RECIPE_FLAGS):
        return ""
    tokens, ncores = 0, cores()
    if args.recipe == "auto":
        tokens = _count_tokens(args.train, args.max_train_lines)  # a bad line fails as training would
    recipe = choose(tokens, args.max_minutes, ncores) if args.recipe == "auto" else PLAIN
    return describe(recipe, fill(args, recipe), tokens, args.max_minutes, ncores)


def check_train_files(args: argparse.Namespace) -> None:
    """What ``nlmserve train`` writes, then what it reads, checked before the work (a
    60-minute run must not learn at its end that ``--out`` is a directory)."""
    for path in (args.out, args.out + ".ckpt", args.out + ".log.jsonl", args.out + ".curve.png"):
        check_output(path)
    check_output_dir(args.workdir or args.out + ".work")
    check_input(args.train, TEXT, empty_ok=False)
    if args.valid is not None:
        check_input(args.valid, TEXT, empty_ok=False)
    if args.class_file is not None:
        check_input(args.class_file, TEXT, empty_ok=False)


def _train(args: argparse.Namespace) -> int:
    check_train_files(args)  # first: before torch is imported, before the text is read

    from .train import TrainConfig, train
    from ..common.memory import keep_freed_memory

    recipe = apply_recipe(args)
    if recipe:
        log.info("recipe: %s", recipe)
    try:
        cfg = TrainConfig(
            train=args.train, valid=args.valid, out=args.out, order=args.order, dim=args.dim,
            context=args.context, hidden=args.hidden, activation=args.activation, classes=args.classes,
            class_file=args.class_file, class_method=args.class_method, objective=args.objective,
            noise_samples=args.noise_samples, epochs=args.epochs, max_minutes=args.max_minutes,
            max_steps=args.max_steps, lowercase=args.lowercase, min_count=args.min_count,
            max_vocab=args.max_vocab, max_train_lines=args.max_train_lines, threads=args.threads,
            distributed=args.distributed, average_every=args.average_every, dense_grads=args.dense_grads, step=args.step,
            seed=args.seed, resume=args.resume, batch_size=args.batch_size, lr=args.lr,
            optimizer=args.optimizer, patience=args.patience, valid_every=args.valid_every,
            checkpoint_every=args.checkpoint_every, log_every=args.log_every, workdir=args.workdir, progress=not args.no_progress,
            ngram_class_table=_table_size(args.ngram_features, args.ngram_class_bits, "--ngram-class-bits"),
            ngram_word_table=_table_size(args.ngram_features, args.ngram_word_bits, "--ngram-word-bits"),
            ngram_order=args.ngram_order,
            output=args.output, tree_eps=args.tree_eps, tree_pretrain_steps=args.tree_pretrain_steps,
            norm_fraction=args.norm_fraction, norm_weight=args.norm_weight, dropout=args.dropout,
            workers=args.workers, min_improvement=args.min_improvement, lr_schedule=args.lr_schedule,
            recipe=recipe,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    keep_freed_memory()  # the steps' large tensors reuse the heap instead of fresh pages
    # SIGTERM (kill, systemd, a batch scheduler) stops the run as Ctrl-C does: the best model
    # so far is written, the last checkpoint stays for --resume
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = train(cfg)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.rank != 0:  # data-parallel: rank 0 reports
        return 130 if result.stopped == "interrupted" else 0
    ppl = f"{result.best_valid_ppl:.3f}" if result.best_valid_ppl is not None else "n/a"
    print(f"model\t{result.model_path}\nsteps\t{result.steps}\ntokens\t{result.tokens}\n"
          f"valid_perplexity\t{ppl}\nstopped\t{result.stopped}")
    return 130 if result.stopped == "interrupted" else 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _count_tokens(path: str, max_lines: int | None) -> int:
    """Words of the training text (its first ``max_lines`` lines), for the recipe."""
    from .corpus import open_text_lines

    tokens = 0
    for i, line in enumerate(open_text_lines(path)):
        if max_lines is not None and i >= max_lines:
            break
        tokens += len(line.split())
    return tokens


def _table_size(enabled: bool, bits: int, flag: str) -> int:
    """2^bits when the n-gram features are on (bits 0: no table), else 0."""
    if not enabled:
        return 0
    if not 0 <= bits <= 30:
        raise UsageError(f"{flag} must be between 0 and 30, got {bits}")
    return 1 << bits if bits else 0


def _normalize(args: argparse.Namespace) -> int:
    from .normalize import TextForm, normalize_file

    if args.lc_moses:
        form = TextForm.lc_moses()
    else:
        form = TextForm(lowercase=args.lowercase, apostrophes=args.apostrophes, split_hyphens=args.split_hyphens)
    if form == TextForm():
        raise UsageError("choose --lc-moses or at least one of --lowercase, --apostrophes, --split-hyphens")
    if args.out != "-":
        check_output(args.out)
    if args.src != "-":
        check_input(args.src, TEXT)
    lines = normalize_file(args.src, args.out, form)
    if args.out != "-":
        print(f"wrote {lines} lines to {args.out}", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    if args.kenlm and args.mix_weight is None and args.tune_mix_weight is None:
        raise UsageError("--kenlm needs --mix-weight or --tune-mix-weight")
    check_input(args.model, MODEL)
    check_input(args.text, TEXT, empty_ok=False)
    if args.kenlm:
        check_input(args.kenlm)
    if args.tune_mix_weight:
        check_input(args.tune_mix_weight, TEXT, empty_ok=False)

    import torch

    from .evaluate import evaluate, format_report
    from .scoring import LanguageModel

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = LanguageModel.load(args.model, device=args.device)
    result = evaluate(lm, args.text, lowercase=args.lowercase)
    out = result.to_json()
    mix = None
    if args.kenlm:
        from .interpolate import format_interpolation, interpolate

        mix = interpolate(lm, args.kenlm, args.text, weight=args.mix_weight, tune_text=args.tune_mix_weight,
                          lowercase=args.lowercase)
        out["interpolation"] = mix.to_json()
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(format_report(result))
        if mix is not None:
            print("\n" + format_interpolation(mix))
    return 0


def _query(args: argparse.Namespace) -> int:
    if args.tables is not None:
        return _query_tables(args)
    check_input(args.model, MODEL)

    import torch

    from ..common.kenlm_query import write_scores
    from .scoring import LanguageModel, SentenceScores

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = LanguageModel.load(args.model, device=args.device)
    eos = not args.no_eos

    def score(batch: list[str]) -> list[SentenceScores]:
        return lm.score_sentences([line.split() for line in batch], bos=not args.no_bos, eos=eos,
                                  normalized=not args.unnormalized, log10=True)

    write_scores(sys.stdin.buffer, sys.stdout, score, lm.vocab.index, model_lowercase=lm.lowercase,
                 lowercase=args.lowercase, eos=eos, as_json=args.json)
    return 0


def _query_tables(args: argparse.Namespace) -> int:
    """``query --tables``: numpy alone, torch never imported (tests/test_query_tables.py)."""
    for flag, given in (("--device", args.device is not None), ("--threads", bool(args.threads))):
        if given:
            raise UsageError(f"{flag} is for --model: a tables file is scored with numpy on the CPU")
    check_input(args.tables, TABLES)

    from ..common.kenlm_query import write_scores
    from .tables_scorer import SentenceScores, TablesScorer

    scorer = TablesScorer.open(args.tables)
    if not scorer.normalized and not args.unnormalized:
        log.warning("%s holds a class output's tables: its scores are the self-normalised ones (those of "
                    "query --model --unnormalized), not normalised log-probabilities", args.tables)
    eos = not args.no_eos

    def score(batch: list[str]) -> list[SentenceScores]:
        return scorer.score_sentences([line.split() for line in batch], bos=not args.no_bos, eos=eos, log10=True)

    write_scores(sys.stdin.buffer, sys.stdout, score, scorer.index, model_lowercase=scorer.lowercase,
                 lowercase=args.lowercase, eos=eos, as_json=args.json)
    return 0


def _tables(args: argparse.Namespace) -> int:
    check_output(args.out)
    check_input(args.model, MODEL)

    from .scoring import LanguageModel
    from .tables_file import FlatTables, tables_file_size, write_tables_file

    lm = LanguageModel.load(args.model, device="cpu")
    tables = FlatTables.of(lm.scoring_tables())  # UnsupportedModelError says why there are none
    words = lm.vocab.words
    check_output(args.out, size=tables_file_size(tables, words, order=lm.order, quantization=args.quantize))
    written = write_tables_file(args.out, tables, order=lm.order, words=words, lowercase=lm.lowercase,
                                model_hash=lm.model_hash, quantization=args.quantize)
    print(f"{args.out}: {written.size:,} bytes, {tables.output} output, order {lm.order}, {len(words):,} words, "
          f"width {tables.dim}, {args.quantize} (scores within {written.error_bound:.3g} nats of float32's), "
          f"model {lm.model_hash}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .info import describe, format_info
    from .model_file import read_model_file, read_model_header
    from .tables_file import MAGIC, describe_tables_file

    check_input(args.model, MODEL_OR_TABLES)
    with open(args.model, "rb") as f:
        is_tables = f.read(len(MAGIC)) == MAGIC
    if is_tables:
        tables = describe_tables_file(args.model, verify=args.verify)
        print(json.dumps(tables, sort_keys=True) if args.json else "\n".join(f"{k}\t{v}" for k, v in tables.items()))
        return 0

    info = describe(read_model_file(args.model) if args.verify else read_model_header(args.model))
    print(json.dumps(info, sort_keys=True) if args.json else format_info(info))
    return 0
