"""Writes scoring_tables.txt: a tiny model's scoring tables (the floats GetScoringTables
streams) and the scores nlmserve.lm gives a handful of its n-grams, so that the C++ local
scorer (nlmserve_tables.h) is checked against lm/'s arithmetic with no server; and
scoring_tables.nlt, the same tables as the tables file `nlmserve export-tables` writes
(nlmserve.lm.tables_file), which the C++ test maps (MapTablesFile) and scores.

    python proto/contract/scoring_fixture.py           # rewrite both
    python proto/contract/scoring_fixture.py --check   # exit 1 when lm/ gives other tables, scores or file bytes now

(tests/test_contract.py runs the check.)

The model: V = 8 (<unk> <s> </s> a b c d e), order 3, D = 3, tanh, three classes, direct
n-gram features of order 3 in tables of 7 (class) and 16 (word) slots, NCE (so
self-normalised); every weight drawn once from numpy's PCG64 with seed 2015 (stable across
numpy versions) and rounded to 1/64, so that the floats print exactly.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parent / "scoring_tables.txt"
TABLES_FILE = FIXTURE.with_suffix(".nlt")
MODEL_HASH = "scoring_fixture"  # the tables file's model hash: a name, the model is not kept
WORDS = ("a", "b", "c", "d", "e")
WORD_CLASS = (0, 0, 0, 1, 1, 2, 2, 2)
V, ORDER, DIM, CLASS_TABLE, WORD_TABLE = 8, 3, 3, 7, 16
NO_WORD = V
# Canonical rows (oldest first): <s>-padded, </s> and <unk> predicted and in contexts, the
# no-word (id V) in contexts, a word repeated.
ROWS = ((1, 1, 3), (1, 3, 4), (3, 4, 5), (4, 5, 2), (5, 6, 7), (7, 7, 7), (0, 3, 4), (6, 0, 2), (2, 6, 3),
        (NO_WORD, 3, 4), (NO_WORD, NO_WORD, 5), (NO_WORD, 7, 0), (1, 1, 0), (3, 3, 3))


def model_scores() -> tuple[list[float], list[float]]:
    """(the tables' floats, the unnormalised natural-log scores of ROWS) from nlmserve.lm."""
    import torch

    from nlmserve.lm.classes import WordClasses
    from nlmserve.lm.model import ModelConfig, NeuralLM
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.vocab import Vocabulary

    config = ModelConfig(vocab_size=V, order=ORDER, dim=DIM, context="diagonal", activation="tanh", output="class",
                         num_classes=3, ngram_class_table=CLASS_TABLE, ngram_word_table=WORD_TABLE)
    word_class = np.array(WORD_CLASS)
    net = NeuralLM(config, word_class)
    rng = np.random.default_rng(2015)
    state = net.state_dict()
    weights = {name: torch.tensor(np.round(rng.normal(0.0, 0.5, tuple(state[name].shape)) * 64) / 64,
                                  dtype=torch.float32)
               for name in sorted(state)}
    net.load_state_dict(weights)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fixture.nlm"
        save_model(path, net, Vocabulary(WORDS), WordClasses(word_class, "file"), objective="nce",
                   training={"note": "proto/contract/scoring_fixture.py"})
        lm = LanguageModel.load(path, device="cpu")
        tables = lm.scoring_tables()
        assert tables.feature_order == ORDER and tables.feature_tables == (CLASS_TABLE, WORD_TABLE)
        scores = lm.score_ngrams(np.array(ROWS), normalized=False)
    return [float(x) for x in tables.flat()], [float(s) for s in scores]


def render() -> str:
    floats, scores = model_scores()
    lines = [
        "# Scoring tables of a tiny model and the scores nlmserve.lm gives some of its n-grams",
        "# (written by scoring_fixture.py in this folder; do not edit). Owners: Python",
        "# nlmserve.lm.scoring.ScoringTables (and the model it describes), C++ nlmserve_tables.h.",
        "# The tables are the float32 array GetScoringTables streams (position, output, bias, the",
        "# word classes, the class and word feature tables), 8 floats a line; each row below them",
        "# holds a canonical n-gram (the no-word is id vocab_size), its unnormalised score in",
        "# natural log (the self-normalised log-probability) and the same in log10. Lines starting",
        "# with # are comments; the rest is white-space-separated NAME VALUE pairs, then the data.",
        f"order {ORDER}",
        f"vocab_size {V}",
        f"dim {DIM}",
        "activation tanh",
        f"feature_order {ORDER}",
        f"class_table {CLASS_TABLE}",
        f"word_table {WORD_TABLE}",
        f"floats {len(floats)}",
    ]
    lines += [" ".join(f"{x:.9g}" for x in floats[i:i + 8]) for i in range(0, len(floats), 8)]
    lines.append(f"rows {len(ROWS)}")
    lines += [" ".join(map(str, row)) + f" {s:.9g} {s / math.log(10.0):.9g}" for row, s in zip(ROWS, scores)]
    return "\n".join(lines) + "\n"


def read_fixture(path: Path = FIXTURE) -> tuple[dict[str, str], list[float], list[tuple[list[int], float, float]]]:
    """(the NAME VALUE pairs, the floats, the rows with their ln and log10 scores) of the fixture."""
    words = " ".join(line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")).split()
    head: dict[str, str] = {}
    i = 0
    while words[i] != "floats":
        head[words[i]] = words[i + 1]
        i += 2
    n = int(words[i + 1])
    floats = [float(x) for x in words[i + 2:i + 2 + n]]
    i += 2 + n
    assert words[i] == "rows"
    width = int(head["order"]) + 2
    body = words[i + 2:]
    rows = [([int(x) for x in body[k:k + width - 2]], float(body[k + width - 2]), float(body[k + width - 1]))
            for k in range(0, len(body), width)]
    assert len(rows) == int(words[i + 1])
    return head, floats, rows


def write_tables_file(path: Path) -> None:
    """The fixture's tables (as scoring_tables.txt holds them) as a tables file."""
    from nlmserve.lm.tables_file import FlatTables, write_tables_file as write

    head, floats, _ = read_fixture()
    tables = FlatTables(np.array(floats, dtype="<f4"), int(head["dim"]), head["activation"],
                        int(head["feature_order"]), int(head["class_table"]), int(head["word_table"]))
    write(path, tables, order=int(head["order"]), vocab_size=int(head["vocab_size"]), model_hash=MODEL_HASH)


def differences() -> list[str]:
    """How the fixture differs from what nlmserve.lm gives now (tables exactly, scores
    within 1e-6: float sums may round differently elsewhere)."""
    floats, scores = model_scores()
    _, written, rows = read_fixture()
    out = []
    if len(written) != len(floats) or any(np.float32(a) != np.float32(b) for a, b in zip(written, floats)):
        out.append("the tables differ")
    for (row, ln, log10), want in zip(rows, scores):
        if abs(ln - want) > 1e-6 or abs(log10 - want / math.log(10.0)) > 1e-6:
            out.append(f"row {row}: {ln} in the fixture, {want} from nlmserve.lm")
    if [tuple(r) for r, _, _ in rows] != list(ROWS):
        out.append("the rows differ")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / TABLES_FILE.name
        write_tables_file(fresh)
        if not TABLES_FILE.is_file() or fresh.read_bytes() != TABLES_FILE.read_bytes():
            out.append(f"{TABLES_FILE.name} is not the tables file of these tables")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with scoring_tables.txt and .nlt instead of writing them")
    args = parser.parse_args()
    if args.check:
        wrong = differences()
        for line in wrong:
            print(f"{FIXTURE.name}: {line}", file=sys.stderr)
        return 1 if wrong else 0
    FIXTURE.write_text(render(), encoding="utf-8")
    write_tables_file(TABLES_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
