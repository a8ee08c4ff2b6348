"""How well a phrase's own words estimate its first words' scores (the decoder's future costs).

Moses scores each target phrase on its own when its table loads
(``LanguageModelImplementation::CalcScore``): the n-grams whose history lies inside the
phrase are exact, the first order-1 words have only the phrase's words before them, and
their scores go into the future costs and the ``table-limit`` pruning. KenLM scores them
with its lower orders. This script puts a phrase boundary before every word of a
translation (but its first) and scores each of the phrase's first words three ways:

* ``in context``: with the sentence's real history (what the search later adds);
* ``<s>``: the words before the phrase as sentence starts (the feature's rule before the
  no-word);
* ``no-word``: the words before the phrase as the no-word (``nlmserve.wire.ngrams``: they add
  nothing), the feature's rule.

and prints, per number of known words k and in all, the mean difference from the score in
context (bias) and its mean absolute value (log10), for each model; with ``--kenlm``, KenLM's
own estimates of the same words (its lower orders) as the yardstick. Usage:

    .venv/bin/python -m experiments.estimates --model model.nlm [--model other.nlm]
    .venv/bin/python -m experiments.estimates --model ep10f.nlm --kenlm europarl.5gram.bin --text ../shared/data/nbest/newstest-fr-en/newstest2013.moses-1best \\
        --lines 300 --json experiments/estimates.json --doc experiments/results.md

The default text is the shipped Moses 1-best of 300 newstest2013 sentences (lowercased,
Moses-tokenised, as the models' training text). Self-normalised scores (``normalized=false``,
what ``scoring=local`` computes) unless ``--normalized``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench import _common

from nlmserve.wire.ngrams import BOS_ID, no_word_id

REPO = Path(__file__).resolve().parent.parent
RULES = ("<s>", "no-word")


def phrase_rows(sentences: list[np.ndarray], order: int, vocab_size: int) -> dict[str, np.ndarray]:
    """For a phrase starting at every word but a sentence's first, the rows of its first
    order-1 words: ``context`` (the real history, <s>-padded at the sentence start), the
    same n-grams with the words before the phrase as <s> and as the no-word, and ``known``
    (how many of the context's words are the phrase's)."""
    n1 = order - 1
    context, known = [], []
    for ids in sentences:
        hist = np.concatenate([np.full(n1, BOS_ID, dtype=np.int64), ids.astype(np.int64)])
        for start in range(1, len(ids)):
            for k in range(min(n1, len(ids) - start)):
                at = n1 + start + k  # the predicted word's index in hist
                context.append(hist[at - n1:at + 1])
                known.append(k)
    rows = np.array(context, dtype=np.int64).reshape(-1, order)
    k = np.array(known, dtype=np.int64)
    before = np.arange(n1)[None, :] < (n1 - k)[:, None]  # (N, n-1): positions before the phrase
    out = {"context": rows, "known": k}
    for rule, fill in zip(RULES, (BOS_ID, no_word_id(vocab_size))):
        r = rows.copy()
        r[:, :n1][before] = fill
        out[rule] = r
    return out


def summary(d: np.ndarray, k: np.ndarray) -> dict[str, Any]:
    """Bias (mean) and MAE of the differences ``d`` from the scores in context, in all and
    per number of known words ``k``."""
    per_k = [{"k": int(j), "n": int((k == j).sum()), "bias": float(d[k == j].mean()),
              "mae": float(np.abs(d[k == j]).mean())} for j in np.unique(k).tolist()]
    return {"bias": float(d.mean()), "mae": float(np.abs(d).mean()), "per_k": per_k}


def measure(model: str, text: Path, lines: int, normalized: bool) -> dict[str, Any]:
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(model, device="cpu")
    sentences = []
    with open(text, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= lines:
                break
            words = line.lower().split() if lm.lowercase else line.split()
            if len(words) > 1:
                sentences.append(lm.vocab.encode(words))
    rows = phrase_rows(sentences, lm.order, len(lm.vocab))
    k = rows["known"]
    actual = lm.score_ngrams(rows["context"], normalized=normalized, log10=True)
    result: dict[str, Any] = {"model": str(model), "order": lm.order, "hash": lm.model_hash,
                              "sentences": len(sentences), "words": int(k.size), "rules": {}}
    for rule in RULES:
        d = lm.score_ngrams(rows[rule], normalized=normalized, log10=True).astype(np.float64) - actual
        result["rules"][rule] = summary(d, k)
    return result


def measure_kenlm(path: str, text: Path, lines: int, order: int) -> dict[str, Any]:
    """The same for a KenLM model: each phrase-initial word from the phrase's words alone
    (KenLM's null context and lower orders, what Moses' KENLM feature estimates) against
    its score after the real history."""
    import kenlm

    from nlmserve.common.kenlm_file import load_kenlm

    model = load_kenlm(path)
    n1 = min(order, model.order) - 1
    diffs: list[float] = []
    known: list[int] = []
    with open(text, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= lines:
                break
            words = line.split()
            if len(words) < 2:
                continue
            actual = []
            state, out = kenlm.State(), kenlm.State()
            model.BeginSentenceWrite(state)
            for w in words:
                actual.append(model.BaseScore(state, w, out))
                state, out = out, state
            for start in range(1, len(words)):
                state, out = kenlm.State(), kenlm.State()
                model.NullContextWrite(state)
                for k in range(min(n1, len(words) - start)):
                    diffs.append(model.BaseScore(state, words[start + k], out) - actual[start + k])
                    known.append(k)
                    state, out = out, state
    d, k = np.array(diffs), np.array(known)
    return {"model": str(path), "order": model.order, "words": int(d.size), "rules": {"KenLM lower orders": summary(d, k)}}


def render(res: dict[str, Any]) -> str:
    begin, end = _common.markers("estimates.py", room="experiments")
    scores = "exact (normalised)" if res["normalized"] else "self-normalised"
    head = (f"`experiments/estimates.py` on {res['text']} (first {res['lines']} lines), {scores} scores, log10. "
            "Bias: the estimate's mean difference from the score in context; MAE: its mean absolute "
            "difference; k: words of the phrase before the predicted one.\n\n")
    rows = ["| model | phrase-initial words | rule | bias | MAE | MAE k=0 | MAE k=1 | MAE k=2 | MAE k=3 |",
            "|---|---|---|---|---|---|---|---|---|"]
    for m in res["models"]:
        for rule, r in m["rules"].items():
            by_k = {p["k"]: p["mae"] for p in r["per_k"]}
            cells = [f"{by_k[j]:.2f}" if j in by_k else "—" for j in range(4)]
            rows.append(f"| `{Path(m['model']).name}` (order {m['order']}) | {m['words']} | `{rule}` | "
                        f"{r['bias']:+.2f} | {r['mae']:.2f} | " + " | ".join(cells) + " |")
    return begin + "\n" + head + "\n".join(rows) + "\n" + end


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", action="append", required=True, help="an nlmserve model (repeatable)")
    p.add_argument("--text", type=Path, default=REPO / "data/nbest/newstest-fr-en/newstest2013.300.moses-1best",
                   help="target-language sentences, one a line (default: the shipped Moses 1-best)")
    p.add_argument("--lines", type=int, default=300, help="the first N lines of --text")
    p.add_argument("--normalized", action="store_true", help="exact scores instead of self-normalised ones")
    p.add_argument("--kenlm", help="also a KenLM model (ARPA or binary), for its lower orders' estimates")
    p.add_argument("--kenlm-order", type=int, default=5, help="the order of the KENLM feature (default 5)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--doc", type=Path, help="write the table into this page's experiments/estimates.py section")
    args = p.parse_args(argv)
    res = {"machine": _common.machine(), "text": str(args.text), "lines": args.lines, "normalized": args.normalized,
           "models": [measure(m, args.text, args.lines, args.normalized) for m in args.model]}
    if args.kenlm:
        res["models"].append(measure_kenlm(args.kenlm, args.text, args.lines, args.kenlm_order))
    table = render(res)
    print(table)
    if args.json:
        _common.write_json(args.json, res)
    if args.doc:
        _common.write_section(args.doc, *_common.markers("estimates.py", room="experiments"), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
