"""The training recipe `nlmserve train` chooses for the flags it is not given
(nlmserve.lm.recipe): the two measured recipes, the machine's cores, the plain values of
``--recipe none``, what the log and the model file say, and --help's defaults."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import pytest

from nlmserve.lm import cli
from nlmserve.lm.recipe import PLAIN, RECIPE_FLAGS, choose
from nlmserve.lm.train import TrainConfig


def test_the_200k_line_budget_gets_the_small_recipe_as_measured() -> None:
    # the first 200,000 Europarl lines are 5.4M tokens; 20 minutes; 2 cores
    r = choose(5_400_000, 20.0, 2)
    assert r.name == "small"
    assert (r.dim, r.workers, r.threads, r.ngram_features, r.ngram_class_bits, r.ngram_word_bits) == (
        768, 2, 1, True, 22, 24)
    assert (r.class_method, r.dropout, r.lr, r.lr_schedule, r.min_improvement, r.valid_every) == (
        "brown", 0.3, 0.05, "linear", 0.0, 10_546)  # once per pass: 5.4M tokens / 512
    assert (r.patience, r.epochs, r.order, r.ngram_order) == (100, 100, 10, 5)  # the budget ends the run


def test_the_full_corpus_in_an_hour_gets_the_large_recipe_as_measured() -> None:
    r = choose(18_250_000, 60.0, 2)
    assert r.name == "large"
    assert (r.dim, r.ngram_class_bits, r.ngram_word_bits, r.lr_schedule, r.min_improvement, r.valid_every) == (
        768, 22, 24, "linear", 0.0, 16_000)
    assert (r.order, r.ngram_order) == (10, 5)  # nine context words, direct features to 5-grams
    # a shorter budget or a smaller corpus keeps the small one
    assert choose(18_250_000, 30.0, 2).name == choose(9_000_000, 60.0, 2).name == "small"
    # which differs in its dropout (a small corpus is seen more often in a budget) and validation
    assert (r.dropout, choose(9_000_000, 60.0, 2).dropout) == (0.2, 0.3)
    assert choose(18_250_000, 30.0, 2).valid_every == 16_000


def test_cores_budget_and_corpus_size() -> None:
    assert (choose(5_000_000, 20.0, 1).workers, choose(5_000_000, 20.0, 1).threads) == (1, 1)
    assert choose(5_000_000, 20.0, 64).workers == 8
    unbounded = choose(18_250_000, None, 2)
    assert (unbounded.name, unbounded.epochs, unbounded.patience) == ("small", 10, 3)
    assert choose(300_000, 10.0, 2).valid_every == 585  # once per pass of 300,000 tokens
    assert choose(10_000, 10.0, 2).valid_every == 250


def test_plain_values_are_the_training_configs_defaults() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name, value in PLAIN.values().items():
        if name == "ngram_features":
            assert value is False and defaults["ngram_class_table"] == defaults["ngram_word_table"] == 0
        elif name not in ("ngram_class_bits", "ngram_word_bits"):
            assert defaults[name] == value, name


def test_the_large_recipes_feature_bound_yields_to_the_flags(
        train_small_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nlmserve.lm import recipe

    large = choose(18_250_000, 60.0, 2)  # as if the text were all of Europarl
    monkeypatch.setattr(recipe, "choose", lambda tokens, minutes, ncores: large)

    def filled(*flags: str) -> tuple[str, argparse.Namespace]:
        args = _parser().parse_args(["train", "--train", str(train_small_path), "--out", "m",
                                     "--max-minutes", "60", *flags])
        return cli.apply_recipe(args), args

    line, args = filled()
    assert (args.order, args.ngram_order, args.ngram_features) == (10, 5, True)
    assert line.startswith("large (") and "order=10, ngram_order=5, " in line
    # no features to bound, or an order the bound reaches: 0 (the order), and the line says so
    line, args = filled("--no-ngram-features")
    assert (args.order, args.ngram_order) == (10, 0) and "ngram_order=0" in line
    assert "ngram_word_bits" not in line and "ngram_class_bits" not in line  # no tables to size
    line, args = filled("--order", "5")
    assert (args.order, args.ngram_order) == (5, 0) and "order=10" not in line
    line, args = filled("--order", "7", "--ngram-order", "3")  # given: both win
    assert (args.order, args.ngram_order) == (7, 3) and "order=" not in line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nlmserve")
    cli.register(parser.add_subparsers())
    return parser


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dim DIM embedding width D (default: recipe)" in text
    assert "n-gram order: the predicted word and order-1 before it (default: recipe)" in text
    assert "--batch-size BATCH_SIZE n-grams per minibatch (per worker) (default: 512)" in text
    for flag in RECIPE_FLAGS:
        assert f"--{flag.replace('_', '-')}" in text


def test_the_log_and_the_model_file_say_what_the_recipe_chose(
        tmp_path: Path, train_small_path: Path, dev_small_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from nlmserve.lm.scoring import LanguageModel

    out = tmp_path / "m.nlm"
    args = _parser().parse_args(["train", "--train", str(train_small_path), "--valid", str(dev_small_path),
                                 "--out", str(out), "--max-steps", "2", "--no-progress", "--dim", "16",
                                 "--workers", "1", "--threads", "1", "--class-method", "frequency"])
    with caplog.at_level(logging.INFO, logger="nlmserve.lm.cli"):
        assert args.func(args) == 0
    tokens = sum(len(line.split()) for line in train_small_path.read_text(encoding="utf-8").splitlines())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("recipe: "))
    assert line.startswith(f"recipe: small (for {tokens:,} training tokens, no time budget, ")
    assert "dim=" not in line and "workers=" not in line and "class_method=" not in line  # given
    assert "ngram_features=True" in line and "dropout=0.3" in line and "lr=0.05" in line
    lm = LanguageModel.load(out, device="cpu")
    assert lm.training["train_config"]["recipe"] == line.removeprefix("recipe: ")
    assert lm.config.dim == 16 and lm.config.has_ngram_features
