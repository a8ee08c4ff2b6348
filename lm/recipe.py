"""The training recipe ``nlmserve train`` chooses for the flags it is not given: from the
corpus size, the time budget and the cores, as ``lmplz -o 5`` needs no flags.

Two recipes, each the settings of a run that beat Kneser-Ney on the lowercased Europarl
text on two cores (docs/performance.md, "Perplexity against Kneser-Ney", and bench/targets.py):

* ``small``: order 10 (nine context words) with direct n-gram features on n-grams of up to
  5 words (2^22 class and 2^24 word slots), width 768, Brown classes, dropout 0.3, AdaGrad
  at 0.05 falling linearly to 0 over the budget (halved besides when a validation does not
  improve), validation every 16,000 steps or once per pass over a smaller corpus. The first
  200,000 lines (5.45M tokens) in 20 minutes are about 13 passes over the text; the higher
  dropout kept the model gaining past the sixth pass, where dropout 0.2 stopped, and the
  10-gram gained past where the 5-gram at width 512 this recipe was before stopped.
* ``large``: the same network with dropout 0.2, validation every 16,000 steps, for the whole
  corpus (18.25M tokens) in 60 minutes.

What each recipe measures, chosen with no flag, is bench/targets.py's table in
docs/performance.md (selected on one half of the dev text, reported on the other).

``large`` is chosen for at least 10M training tokens and a budget of at least 45 minutes;
``small`` otherwise. Every process trains lock-free on its own core (``--workers`` = cores,
one torch thread each). With no time budget, training runs at most 10 epochs with the
``small`` schedule; with one, up to 100 epochs, the budget ending it. Flags given on the
command line always win; the recipe fills the rest and says what it chose (the log, and
``training.train_config.recipe`` in the model file). ``--recipe none`` fills them with the
plain values instead (:data:`PLAIN`): nothing depends on the corpus or the machine.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

#: Training tokens from which, with LARGE_MINUTES or more, the large recipe is chosen.
LARGE_TOKENS = 10_000_000
LARGE_MINUTES = 45.0

#: Under ``--distributed`` with the fused step, steps between two averages of the processes'
#: parameters (``train --average-every``; docs/training-scale.md has the measurement behind it).
AVERAGE_EVERY = 128


@dataclass(frozen=True)
class Recipe:
    """Values of the ``nlmserve train`` flags a recipe sets (names as the argparse dests)."""

    name: str
    order: int
    ngram_order: int
    dim: int
    workers: int
    threads: int
    ngram_features: bool
    ngram_class_bits: int
    ngram_word_bits: int
    class_method: str
    dropout: float
    lr: float
    lr_schedule: str
    min_improvement: float
    valid_every: int
    patience: int
    epochs: int

    def values(self) -> dict[str, Any]:
        """The flag values (every field but ``name``)."""
        out = dataclasses.asdict(self)
        del out["name"]
        return out


#: ``--recipe none``: the plain values (``nlmserve.lm.train.TrainConfig``'s defaults, which a
#: test keeps equal): a small, single-process model, for tests and reproducible demos.
PLAIN = Recipe("none", order=5, ngram_order=0, dim=128, workers=1, threads=2, ngram_features=False,
               ngram_class_bits=20, ngram_word_bits=22, class_method="frequency", dropout=0.0, lr=0.1,
               lr_schedule="plateau", min_improvement=0.0, valid_every=0, patience=3, epochs=10)

#: The argparse dests a recipe fills when the command line leaves them unset (None).
RECIPE_FLAGS = tuple(f.name for f in dataclasses.fields(Recipe) if f.name != "name")


def choose(tokens: int, minutes: float | None, cores: int) -> Recipe:
    """The recipe for ``tokens`` training tokens, a budget of ``minutes`` (None: none) and
    ``cores`` CPU cores."""
    workers = max(1, min(cores, 8))
    threads = 1 if workers > 1 else max(1, cores)
    budget = minutes is not None
    epochs = 100 if budget else 10
    if budget and tokens >= LARGE_TOKENS and minutes is not None and minutes >= LARGE_MINUTES:
        return Recipe("large", order=10, ngram_order=5, dim=768, workers=workers, threads=threads,
                      ngram_features=True, ngram_class_bits=22, ngram_word_bits=24, class_method="brown",
                      dropout=0.2, lr=0.05, lr_schedule="linear", min_improvement=0.0, valid_every=16_000,
                      patience=100, epochs=epochs)
    # Validate every 16,000 steps, or once per pass over a smaller corpus (512-token minibatches).
    valid_every = int(min(16_000, max(250, tokens // 512)))
    return Recipe("small", order=10, ngram_order=5, dim=768, workers=workers, threads=threads,
                  ngram_features=True, ngram_class_bits=22, ngram_word_bits=24, class_method="brown",
                  dropout=0.3, lr=0.05, lr_schedule="linear", min_improvement=0.0, valid_every=valid_every,
                  patience=100 if budget else 3, epochs=epochs)


def cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def fill(args: Any, recipe: Recipe) -> dict[str, Any]:
    """Set every recipe flag that is None on ``args`` (an argparse namespace) from ``recipe``
    → the flags it set and their values.

    The recipe's bound on the direct features (``ngram_order``) yields to the other flags:
    with no features, or an order the bound reaches, it is 0 (the order). With no features
    the feature tables' sizes are set but not listed: they size nothing."""
    chosen = {}
    for name, value in recipe.values().items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            chosen[name] = value
    if "ngram_order" in chosen and (not args.ngram_features or args.ngram_order >= args.order):
        args.ngram_order = chosen["ngram_order"] = 0
    if not args.ngram_features:
        chosen.pop("ngram_class_bits", None)
        chosen.pop("ngram_word_bits", None)
    return chosen


def describe(recipe: Recipe, chosen: dict[str, Any], tokens: int, minutes: float | None, ncores: int) -> str:
    """One line for the log and the model file: which recipe, why, and what it set (``chosen``:
    flag → the value it got)."""
    if not chosen:
        return "every recipe flag given on the command line"
    set_ = ", ".join(f"{name}={value}" for name, value in chosen.items())
    if recipe.name == PLAIN.name:
        return f"none (the plain values): {set_}"
    budget = f"{minutes:g} minutes" if minutes is not None else "no time budget"
    return f"{recipe.name} (for {tokens:,} training tokens, {budget}, {ncores} cores): {set_}"
