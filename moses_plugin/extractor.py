"""Moses' extractor text formats, so our tuning mixes with Moses' own ``extractor``/``mert``.

Feature file (``FEATSTAT``), one block per sentence::

    FEATURES_TXT_BEGIN_0 <sentence> <hypotheses> <dense count> <Name_0 Name_1 … >
    v v v …            (one line per hypothesis, each value followed by a blank)
    FEATURES_TXT_END_0

Score file (``SCORESTAT``) for BLEU, the same blocks with 9 statistics per hypothesis
(``c1 t1 c2 t2 c3 t3 c4 t4 ref_len``)::

    SCORES_TXT_BEGIN_0 <sentence> <hypotheses> 9 BLEU
    …
    SCORES_TXT_END_0

Values are printed as Moses' C++ streams print them (6 significant digits).
"""

from __future__ import annotations

import os
from typing import Iterator, TextIO

import numpy as np

from ..common.errors import InputError
from .bleu import MOSES_N_STATS, from_moses, to_moses
from .mert import MertData
from .nbest import format_value, write_text_atomic
from .weights import layout_from_names, layout_names

FEATURES_BEGIN = "FEATURES_TXT_BEGIN_0"
FEATURES_END = "FEATURES_TXT_END_0"
SCORES_BEGIN = "SCORES_TXT_BEGIN_0"
SCORES_END = "SCORES_TXT_END_0"


def features_text(data: MertData) -> str:
    """The FEATSTAT text of ``data`` (sentences in id order)."""
    names = "".join(name + " " for name in layout_names(data.layout))
    out = []
    for sent in sorted(data.feats):
        feats = data.feats[sent]
        out.append(f"{FEATURES_BEGIN} {sent} {len(feats)} {data.dim} {names}\n")
        out.extend("".join(format_value(v) + " " for v in row) + "\n" for row in feats.tolist())
        out.append(FEATURES_END + "\n")
    return "".join(out)


def scores_text(data: MertData) -> str:
    """The SCORESTAT text of ``data``: Moses' 9 BLEU statistics per hypothesis."""
    out = []
    for sent in sorted(data.stats):
        stats = to_moses(data.stats[sent])
        out.append(f"{SCORES_BEGIN} {sent} {len(stats)} {MOSES_N_STATS} BLEU\n")
        out.extend("".join(f"{int(v)} " for v in row) + "\n" for row in stats.tolist())
        out.append(SCORES_END + "\n")
    return "".join(out)


def save(data: MertData, feature_file: str, score_file: str) -> None:
    """Write FEATSTAT and SCORESTAT files (atomically)."""
    write_text_atomic(feature_file, features_text(data))
    write_text_atomic(score_file, scores_text(data))


def _blocks(handle: TextIO, path: str, begin: str, end: str) -> Iterator[tuple[list[str], list[list[str]], int]]:
    """(header fields, rows of tokens, header line number) per block."""
    lines = enumerate(handle, start=1)
    for line_no, line in lines:
        if not line.strip():
            continue
        header = line.split()
        if header[0] != begin or len(header) < 4:
            raise InputError(f"expected a '{begin} <sentence> <n> <k> …' header", path, line_no)
        try:
            count = int(header[2])
        except ValueError as exc:
            raise InputError(f"bad hypothesis count {header[2]!r}", path, line_no) from exc
        rows = []
        for _ in range(count):
            try:
                row_no, row = next(lines)
            except StopIteration as exc:
                raise InputError(f"block of sentence {header[1]} ends early", path, line_no) from exc
            rows.append(row.split())
        try:
            end_no, footer = next(lines)
        except StopIteration as exc:
            raise InputError(f"missing {end}", path, line_no) from exc
        if footer.strip() != end:
            raise InputError(f"expected {end}", path, end_no)
        yield header, rows, line_no


def load(feature_file: str, score_file: str) -> MertData:
    """Read FEATSTAT + SCORESTAT files (Moses' text format) into MertData.

    Hypothesis texts are not in these files; ``hyps`` holds empty strings. Sparse
    features after the dense values are ignored.
    """
    data: MertData | None = None
    with open(feature_file, encoding="utf-8") as fh, open(score_file, encoding="utf-8") as sh:
        feature_blocks = _blocks(fh, feature_file, FEATURES_BEGIN, FEATURES_END)
        score_blocks = _blocks(sh, score_file, SCORES_BEGIN, SCORES_END)
        for (fhead, frows, fline), (shead, srows, sline) in zip(feature_blocks, score_blocks):
            dim = _int(fhead[3], feature_file, fline)
            layout = layout_from_names(fhead[4:])
            if sum(n for _, n in layout) != dim:
                raise InputError(f"{dim} features but {len(fhead) - 4} names", feature_file, fline)
            if data is None:
                data = MertData(layout)
            elif layout != data.layout:
                raise InputError("feature names differ from the first block", feature_file, fline)
            if shead[1] != fhead[1] or len(srows) != len(frows):
                raise InputError(f"block of sentence {shead[1]} does not match {feature_file}", score_file, sline)
            if _int(shead[3], score_file, sline) != MOSES_N_STATS or shead[4:5] != ["BLEU"]:
                raise InputError("only BLEU statistics (9 columns) are supported", score_file, sline)
            sent = _int(fhead[1], feature_file, fline)
            feats = _matrix([r[:dim] for r in frows], dim, feature_file, fline)
            stats = _matrix(srows, MOSES_N_STATS, score_file, sline).astype(np.int64)
            data.add(sent, feats, from_moses(stats), [""] * len(frows))
    if data is None:
        raise InputError("no feature blocks", feature_file)
    return data


def _int(text: str, path: str, line: int) -> int:
    try:
        return int(text)
    except ValueError as exc:
        raise InputError(f"{text!r} is not an integer", path, line) from exc


def _matrix(rows: list[list[str]], width: int, path: str, line: int) -> np.ndarray:
    try:
        matrix = np.asarray([[float(v) for v in row] for row in rows], dtype=np.float64)
    except ValueError as exc:
        raise InputError(f"non-numeric value in the block starting here ({exc})", path, line) from exc
    if matrix.size and matrix.shape[1] != width:
        raise InputError(f"rows have {matrix.shape[1]} values, expected {width}", path, line)
    return matrix.reshape(len(rows), width)


def exists(feature_file: str, score_file: str) -> bool:
    return os.path.exists(feature_file) and os.path.exists(score_file)
