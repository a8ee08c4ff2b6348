"""NLM0 by its two routes: the Moses feature's (``scoring=local``, a tables file, the scorer in
the decoder) and ``nlmserve rescore``'s (the model file in Python) give the same hypotheses
the same value, by the rule docs/interfaces.md states ("NLM0 by both routes").

The feature's arithmetic runs without Moses in ``nlmserve_contract_test --nlm0`` (the C++
driver of tests/test_cpp_client.py): phrase by phrase as the decoder adds it (each phrase's
n-grams with a full context, then those across its left boundary, then ``</s>``), each
n-gram's natural-log score floored at Moses' -100, summed in float. ``rescore`` sums the same
n-grams' natural-log scores in float64, unfloored, and writes 6 significant digits. On a
real n-best list, scored by a small trained model in which one word's output bias has been
lowered by 200 nats, so that every n-gram predicting that word falls below the floor: where
no n-gram scores below -100 the two values agree within the rounding rule, and where some do
the feature's is higher by exactly what its floor raised them.
"""

from __future__ import annotations

import gzip
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from support import REPO
from test_cpp_client import CONTRACT_TEST, driver  # noqa: F401 - the driver fixture builds build/cpp

NBEST = REPO / "data" / "nbest" / "newstest-fr-en" / "newstest2012.300.nbest.gz"
SENTENCES = 3
#: Moses' LOWEST_SCORE: FloorScore raises every language-model score below it to it.
FLOOR = -100.0
#: The word whose output bias is lowered, and by how much (nats).
LOWERED, BY = "parliament", 200.0
#: Per n-gram: the tables' float32 score against the model's (the C++ scorer's contract).
PER_NGRAM = 1e-5


def _tolerance(value: float, ngrams: int) -> float:
    """The rule's allowance for a hypothesis of ``ngrams`` n-grams (its words and ``</s>``)
    whose NLM0 is ``value``: the float32 scores, their float32 sum (half an ulp of the sum
    per addition) and half a unit in the sixth significant digit rescore writes."""
    written = 0.5 * 10.0 ** (math.floor(math.log10(abs(value))) - 5) if value else 0.0
    return ngrams * (PER_NGRAM + 2.0 ** -24 * abs(value)) + written


@pytest.fixture(scope="module")
def floored_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model with LOWERED's output bias lowered by BY, as a model file and as the
    tables file `nlmserve export-tables` writes of it."""
    from nlmserve.cli import main
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(tiny_model_path, device="cpu")
    with torch.no_grad():
        lm.net.output.word_bias[lm.vocab.id(LOWERED)] -= BY
    work = tmp_path_factory.mktemp("nlm0")
    model, tables = work / "floored.nlm", work / "floored.nlt"
    save_model(model, lm.net, lm.vocab, lm.classes, objective=lm.objective, lowercase=lm.lowercase,
               training=lm.training)
    assert main(["export-tables", "--model", str(model), "--out", str(tables)]) == 0
    return model, tables


def _segmentations(n: int) -> list[list[int]]:
    """Phrase lengths of ``n`` words: one phrase, one word a phrase, and 1, 2, 3, 1, 2, ..."""
    cycle, left = [], n
    while left:
        cycle.append(min(left, len(cycle) % 3 + 1))
        left -= cycle[-1]
    return [[n], [1] * n, cycle]


def test_the_decoders_nlm0_is_rescores_within_the_floor_and_rounding_rule(
        driver: Path, floored_model: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    from nlmserve.cli import main
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.moses_plugin.nbest import iter_entries
    from nlmserve.moses_plugin.rescore import SentenceLM

    model, tables = floored_model
    nbest = tmp_path / "slice.nbest"
    with gzip.open(NBEST, "rt", encoding="utf-8") as f:
        nbest.write_text("".join(line for line in f if int(line.split(" ||| ")[0]) < SENTENCES), encoding="utf-8")
    rescored = tmp_path / "rescored.nbest"
    assert main(["rescore", "--model", str(model), "--nbest", str(nbest), "--out", str(rescored),
                 "--unnormalized", "--no-progress"]) == 0
    entries = list(iter_entries(rescored))
    hyps = [e.hyp for e in entries]
    written = np.array([dict(e.dense)["NLM0"][0] for e in entries])
    assert len(hyps) > 100 and all(h.split() for h in hyps)

    # The decoder's route: every hypothesis in three segmentations into phrases.
    lines = [f"{' '.join(map(str, lengths))}\t{hyp}" for hyp in hyps for lengths in _segmentations(len(hyp.split()))]
    done = subprocess.run([str(CONTRACT_TEST), "--nlm0", str(tables)], input="".join(l + "\n" for l in lines),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    head, *values = done.stdout.splitlines()
    assert head == f"ok {len(lines)}"
    decoder = np.array([float(v) for v in values]).reshape(len(hyps), 3)

    # The floor's part, from the model's own scores of rescore's n-grams.
    lm = LanguageModel.load(model, device="cpu")
    rows, owners = SentenceLM(lm.vocab.index, lm.order, lm.lowercase).ngrams(hyps)
    scores = lm.score_ngrams(rows, normalized=False).astype(np.float64)
    raised = np.bincount(owners, weights=np.maximum(0.0, FLOOR - scores), minlength=len(hyps))
    ngrams = np.bincount(owners, minlength=len(hyps))
    floored = raised > 0
    assert floored.sum() >= 30 and (~floored).sum() >= 30  # both cases on the real list
    assert raised[floored].min() > 50  # the lowered word is far below the floor

    for i in range(len(hyps)):
        allowed = _tolerance(written[i], int(ngrams[i]))
        # every segmentation: rescore's value, raised by what the floor raised
        assert np.abs(decoder[i] - (written[i] + raised[i])).max() <= allowed, (hyps[i], decoder[i], written[i],
                                                                                raised[i], allowed)
    # and unraised, where no n-gram is below the floor: the same value
    assert np.abs(decoder[~floored] - written[~floored, None]).max() <= max(
        _tolerance(written[i], int(ngrams[i])) for i in np.flatnonzero(~floored))
