"""``ExperimentConfig``: what ``nlmserve experiment`` runs on and with (its defaults: the
shipped data and the demo's recipe), apart from the modules that read it (``experiment``,
``steps``, ``workdir``), so that each imports it and none of them another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def _data_dir() -> Path:
    """``data/`` of the current directory, else of the checkout this module is in."""
    here = Path("data")
    if (here / "nbest").is_dir():
        return here
    return Path(__file__).resolve().parent.parent / "data"


DATA = _data_dir()
NEWS = DATA / "nbest" / "newstest-fr-en"


@dataclass(frozen=True)
class ExperimentConfig:
    """Inputs and settings of one experiment (paths relative to the current directory).

    Fields:
        workdir: where every output goes (and where a rerun resumes from).
        train_text: the NLM's training text: one file, or several read one after the other
            (plain, .gz or .xz; a file named twice counts twice, e.g. in-domain text beside
            general text), joined into ``WORKDIR/train.txt``.
        valid_text: the NLM's validation text (early stopping and the best model).
        dev_nbest / dev_ref / test_nbest / test_ref: n-best lists and references.
        steps: the training budget in optimiser steps (``--max-steps``; 0: none, then
            ``minutes`` bounds it). A step budget, unlike a time budget, trains the same model
            on a fast and on a busy machine: same seed, same steps, one process → the same
            weights (``nlmserve train`` is deterministic on the CPU then).
        minutes: a wall-time safety limit on training (``--max-minutes``); a run stopped by
            it is not reproducible, and the experiment says so.
        train_args: extra ``nlmserve train`` flags (after the ones above, so they win).
        model: use this model file instead of training one.
        server: rescore through this running server (HOST:PORT) instead of with a model file.
        via_server: serve the model file (a subprocess) and rescore through it, instead of
            scoring it in this process.
        tuner: ``mert`` (Och's MERT) or ``mira`` (batch k-best MIRA, Moses' ``kbmira``).
        kenlm / kenlm_name: a Kneser-Ney model (ARPA or KenLM binary) added to both lists as
            the feature ``kenlm_name`` before NLM0, e.g. an in-domain LM beside the decoder's:
            the table then has ``TUNER+KN1`` and ``TUNER+KN1+NLM0``.
        restarts / seed: MERT random restarts (MIRA has none); the tuner's seed.
        mert_runs: tune every system this many times (seeds ``seed`` … ``seed+mert_runs-1``)
            and report the mean, the standard deviation and a p-value over all runs.
        samples: paired bootstrap resamples.
        lowercase: lowercase hypotheses for the LM and BLEU (the shipped data already is).
    """

    workdir: str = "runs/demo"
    # The shipped data (data/SOURCES.md): Europarl, the text of the system's own KenLM, with
    # in-domain news text counted twice beside it, validated on held-out news text, since the
    # lists are news; and every third sentence of newstest2012 / 2013, 50-best.
    train_text: tuple[str, ...] = (str(DATA / "lm" / "europarl.train.50k.lc-moses.en.xz"),
                                   str(DATA / "lm" / "wmtnews.30k.lc-moses.en.xz"),
                                   str(DATA / "lm" / "wmtnews.30k.lc-moses.en.xz"))
    valid_text: str = str(DATA / "lm" / "wmtnews.dev.1k.lc-moses.en")
    dev_nbest: str = str(NEWS / "newstest2012.every3.nbest.gz")
    dev_ref: tuple[str, ...] = (str(NEWS / "newstest2012.every3.ref"),)
    test_nbest: str = str(NEWS / "newstest2013.every3.nbest.gz")
    test_ref: tuple[str, ...] = (str(NEWS / "newstest2013.every3.ref"),)
    # The demo's recipe (docs/rescoring.md): 4,000 steps of 512 tokens, about 70% of one pass
    # over the joined text, validated every 500 steps. On the shipped data the validation
    # perplexity falls at every check up to the last step, so the model written is the last
    # one; passes after the first overfit the twice-counted news (the perplexity rises).
    # Width 256: with the fused training step the 4,000 steps take seconds (validation
    # perplexity 233.5 against width 128's 240.5, docs/rescoring.md).
    steps: int = 4000
    minutes: float = 60.0
    # --recipe none: no flag is chosen from the corpus or the machine (Hogwild workers would
    # make the weights, hence the table, differ from run to run).
    train_args: tuple[str, ...] = ("--recipe", "none", "--order", "5", "--dim", "256", "--min-count", "2",
                                   "--threads", "2", "--valid-every", "500")
    model: str | None = None
    server: str | None = None
    via_server: bool = False
    tuner: str = "mert"
    kenlm: str | None = None
    kenlm_name: str = "KN1"
    restarts: int = 5
    seed: int = 0
    mert_runs: int = 1
    samples: int = 1000
    lowercase: bool = False
