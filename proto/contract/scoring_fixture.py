"""Writes scoring_tables.txt: a tiny model's scoring tables (the floats GetScoringTables
streams) and the scores nlmserve.lm gives a handful of its n-grams, so that the C++ local
scorer (nlmserve_tables.h) is checked against lm/'s arithmetic with no server; and
scoring_tables.nlt, the same tables as the tables file `nlmserve export-tables` writes
(nlmserve.lm.tables_file), which the C++ test maps (MapTablesFile) and scores, with
scoring_tables.fp16.nlt and scoring_tables.int8.nlt, the same quantised (each scored within
the error bound it records). The same for a tree-output model: scoring_tables_tree.txt and
its three .nlt files. And scoring_words.tsv: words as a client gives them and the ids the
two files' vocabularies give them (the class model lowercases words first, the tree model
does not), for the Python reader and the C++ one (nlmserve_tables_file.h).

    python proto/contract/scoring_fixture.py           # rewrite them all
    python proto/contract/scoring_fixture.py --check   # exit 1 when lm/ gives other tables, scores or file bytes now

(tests/test_contract.py runs the check.)

The class model: V = 8 (<unk> <s> </s> the été straße οδος i̇stanbul), order 3, D = 3, tanh,
three classes, direct n-gram features of order 3 in tables of 7 (class) and 16 (word)
slots, NCE (so self-normalised), trained on lowercased text (so it lowercases words). The
tree model: the same words, order 3, D = 3, relu, a Huffman tree of fixed counts (codes of
two to four steps), whose scores are exact log-probabilities, cased. Every weight drawn
once from numpy's PCG64 with seed 2015 (stable across numpy versions) and rounded to 1/64,
so that the floats print exactly.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from nlmserve.lm.tables_file import FlatTables

FIXTURE = Path(__file__).resolve().parent / "scoring_tables.txt"
TREE_FIXTURE = FIXTURE.with_name("scoring_tables_tree.txt")
FIXTURES = (FIXTURE, TREE_FIXTURE)
WORDS_FILE = FIXTURE.with_name("scoring_words.tsv")
QUANTIZATIONS = ("none", "fp16", "int8")
MODEL_HASH = "scoring_fixture"  # the tables file's model hash: a name, the model is not kept
WORDS = ("the", "été", "straße", "οδος", "i\u0307stanbul")  # lowercase: the class model's text was
LOWERCASE = {FIXTURE: True, TREE_FIXTURE: False}
# Words as a client gives them: known as they are, only once lowercased (str.lower: non-ASCII,
# U+0130, the final sigma), or not at all.
QUERIES = ("the", "The", "THE", "été", "ÉTÉ", "Été", "straße", "Straße", "STRASSE", "οδος", "ΟΔΟΣ", "Οδος",
           "\u0130stanbul", "i\u0307stanbul", "istanbul", "<s>", "</s>", "<unk>", "<UNK>", "zebra", "a")
WORD_CLASS = (0, 0, 0, 1, 1, 2, 2, 2)
TREE_COUNTS = (3, 0, 40, 25, 12, 9, 5, 1)  # <s> is never predicted: no code
V, ORDER, DIM, CLASS_TABLE, WORD_TABLE = 8, 3, 3, 7, 16
NO_WORD = V
# Canonical rows (oldest first): <s>-padded, </s> and <unk> predicted and in contexts, the
# no-word (id V) in contexts, a word repeated.
ROWS = ((1, 1, 3), (1, 3, 4), (3, 4, 5), (4, 5, 2), (5, 6, 7), (7, 7, 7), (0, 3, 4), (6, 0, 2), (2, 6, 3),
        (NO_WORD, 3, 4), (NO_WORD, NO_WORD, 5), (NO_WORD, 7, 0), (1, 1, 0), (3, 3, 3))


def tables_file(fixture: Path, quantization: str = "none") -> Path:
    """The tables file of a text fixture in a quantisation (beside it)."""
    return fixture.with_suffix(".nlt" if quantization == "none" else f".{quantization}.nlt")


def model_scores(fixture: Path) -> tuple[dict[str, str], list[float], list[float]]:
    """(the fixture's NAME VALUE pairs, the tables' floats, the natural-log scores of ROWS)
    from nlmserve.lm: the class model's unnormalised (self-normalised) scores, the tree's
    exact log-probabilities."""
    import torch

    from nlmserve.lm.classes import WordClasses
    from nlmserve.lm.config import ModelConfig
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.trees import huffman_tree
    from nlmserve.lm.vocab import Vocabulary

    treed = fixture == TREE_FIXTURE
    if treed:
        tree = huffman_tree(np.array(TREE_COUNTS))
        config = ModelConfig(vocab_size=V, order=ORDER, dim=DIM, context="diagonal", activation="relu", output="tree",
                             tree_nodes=tree.num_nodes, tree_method="huffman")
        net = NeuralLM(config, tree=tree)
    else:
        config = ModelConfig(vocab_size=V, order=ORDER, dim=DIM, context="diagonal", activation="tanh", output="class",
                             num_classes=3, ngram_class_table=CLASS_TABLE, ngram_word_table=WORD_TABLE)
        net = NeuralLM(config, np.array(WORD_CLASS))
    rng = np.random.default_rng(2015)
    state = net.state_dict()
    weights = {name: torch.tensor(np.round(rng.normal(0.0, 0.5, tuple(state[name].shape)) * 64) / 64,
                                  dtype=torch.float32)
               for name in sorted(state)}
    net.load_state_dict(weights)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fixture.nlm"
        save_model(path, net, Vocabulary(WORDS), None if treed else WordClasses(np.array(WORD_CLASS), "file"),
                   objective="mle" if treed else "nce", lowercase=LOWERCASE[fixture],
                   training={"note": "proto/contract/scoring_fixture.py"})
        lm = LanguageModel.load(path, device="cpu")
        tables = lm.scoring_tables()
        flat = FlatTables.of(tables)
        scores = lm.score_ngrams(np.array(ROWS), normalized=treed)
    head = {"order": str(ORDER), "vocab_size": str(V), "dim": str(flat.dim), "activation": flat.activation,
            "feature_order": str(flat.feature_order), "class_table": str(flat.ngram_class_table),
            "word_table": str(flat.ngram_word_table), "output": flat.output, "tree_nodes": str(flat.tree_nodes),
            "tree_codes": str(flat.tree_codes), "tree_steps": str(flat.tree_steps)}
    if not treed:
        assert flat.feature_order == ORDER and (flat.ngram_class_table, flat.ngram_word_table) == (CLASS_TABLE,
                                                                                                   WORD_TABLE)
    return head, [float(x) for x in flat.data], [float(s) for s in scores]


def render(fixture: Path) -> str:
    head, floats, scores = model_scores(fixture)
    lines = [
        "# Scoring tables of a tiny model and the scores nlmserve.lm gives some of its n-grams",
        "# (written by scoring_fixture.py in this folder; do not edit). Owners: Python",
        "# nlmserve.lm.scoring.ScoringTables (and the model it describes), C++ nlmserve_tables.h.",
        "# The tables are the float32 array GetScoringTables streams (position, output, bias; with",
        "# features the word classes and the class and word feature tables; with a tree its",
        "# code_start, step_start and steps), 8 floats a line; each row below them holds a",
        "# canonical n-gram (the no-word is id vocab_size), its score in natural log (a class",
        "# output's unnormalised, self-normalised log-probability; a tree's exact one) and the",
        "# same in log10. Lines starting with # are comments; the rest is white-space-separated",
        "# NAME VALUE pairs, then the data.",
    ]
    lines += [f"{name} {value}" for name, value in head.items()]
    lines.append(f"floats {len(floats)}")
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


def write_tables_file(fixture: Path, path: Path, quantization: str = "none") -> None:
    """A text fixture's tables (as it holds them) as a tables file of the fixture's words."""
    from nlmserve.lm.tables_file import write_tables_file as write
    from nlmserve.lm.vocab import Vocabulary

    head, floats, _ = read_fixture(fixture)
    tables = FlatTables(np.array(floats, dtype="<f4"), int(head["dim"]), head["activation"],
                        int(head["feature_order"]), int(head["class_table"]), int(head["word_table"]),
                        output=head["output"], tree_nodes=int(head["tree_nodes"]),
                        tree_codes=int(head["tree_codes"]), tree_steps=int(head["tree_steps"]))
    write(path, tables, order=int(head["order"]), words=Vocabulary(WORDS).words, lowercase=LOWERCASE[fixture],
          model_hash=MODEL_HASH, quantization=quantization)


def render_words() -> str:
    """scoring_words.tsv: each query word, its id in the class model's file (lowercased first)
    and in the tree model's (as given), by the Python owner (the vocabulary and str.lower)."""
    from nlmserve.lm.vocab import Vocabulary

    index = Vocabulary(WORDS).index
    lines = [
        "# Words as a client gives them and the ids the fixture's tables files give them (written by",
        "# scoring_fixture.py in this folder; do not edit). Owners: Python nlmserve.lm.tables_file",
        "# (TablesFile.lookup, its probing table; TablesFile.index), C++ nlmserve_tables_file.h",
        "# (TablesVocabulary). The vocabulary: <unk> <s> </s> the été straße οδος i̇stanbul (ids 0-7);",
        "# scoring_tables*.nlt lowercase a word first (str.lower, proto/contract/lowercase.tsv),",
        "# scoring_tables_tree*.nlt do not. Columns: the word, its id in scoring_tables*.nlt, its id",
        "# in scoring_tables_tree*.nlt ('unknown': not a word of the file, which a client scores as",
        "# <unk>, id 0).",
    ]
    for word in QUERIES:
        ids = [index.get(word.lower() if lower else word) for lower in (True, False)]
        lines.append("\t".join([word] + ["unknown" if i is None else str(i) for i in ids]))
    return "\n".join(lines) + "\n"


def differences(fixture: Path) -> list[str]:
    """How a fixture differs from what nlmserve.lm gives now (tables exactly, scores
    within 1e-6: float sums may round differently elsewhere)."""
    want_head, floats, scores = model_scores(fixture)
    head, written, rows = read_fixture(fixture)
    out = []
    if head != want_head:
        out.append(f"the header differs: {head} in the fixture, {want_head} from nlmserve.lm")
    if len(written) != len(floats) or any(np.float32(a) != np.float32(b) for a, b in zip(written, floats)):
        out.append("the tables differ")
    for (row, ln, log10), want in zip(rows, scores):
        if abs(ln - want) > 1e-6 or abs(log10 - want / math.log(10.0)) > 1e-6:
            out.append(f"row {row}: {ln} in the fixture, {want} from nlmserve.lm")
    if [tuple(r) for r, _, _ in rows] != list(ROWS):
        out.append("the rows differ")
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in QUANTIZATIONS:
            mapped = tables_file(fixture, quantization)
            fresh = Path(tmp) / mapped.name
            write_tables_file(fixture, fresh, quantization)
            if not mapped.is_file() or fresh.read_bytes() != mapped.read_bytes():
                out.append(f"{mapped.name} is not the tables file of these tables")
    return [f"{fixture.name}: {line}" for line in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the text fixtures and their tables files instead of writing them")
    args = parser.parse_args()
    if args.check:
        wrong = [line for fixture in FIXTURES for line in differences(fixture)]
        if not WORDS_FILE.is_file() or WORDS_FILE.read_text(encoding="utf-8") != render_words():
            wrong.append(f"{WORDS_FILE.name} is not what the vocabulary and str.lower give")
        for line in wrong:
            print(line, file=sys.stderr)
        return 1 if wrong else 0
    for fixture in FIXTURES:
        fixture.write_text(render(fixture), encoding="utf-8")
        for quantization in QUANTIZATIONS:
            write_tables_file(fixture, tables_file(fixture, quantization), quantization)
    WORDS_FILE.write_text(render_words(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
