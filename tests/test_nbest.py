"""Moses n-best lists: byte-exact round trips, feature splicing, errors with file:line."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from nlmserve.common.errors import NbestFormatError
from nlmserve.moses_plugin.nbest import (
    NbestWriter,
    ReadStats,
    add_feature,
    check_feature_name,
    iter_entries,
    iter_sentences,
    parse_line,
)

NBEST = Path(__file__).resolve().parent.parent / "data" / "nbest"
LISTS = [
    NBEST / "europarl-100x100" / "nbest.out.gz",  # old format, "d:" labels
    NBEST / "europarl-10x100-5iter" / "nbest.3.gz",  # old names with "d=" labels
    NBEST / "newstest-fr-en" / "newstest2013.300.nbest.gz",  # labelled format
]


def _bytes(path: Path) -> bytes:
    with open(path, "rb") as handle:
        data = handle.read()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


@pytest.mark.parametrize("path", LISTS, ids=lambda p: p.parent.name)
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_round_trip_is_byte_exact(path: Path, suffix: str, tmp_path: Path) -> None:
    out = tmp_path / ("copy" + suffix)
    stats = ReadStats()
    with NbestWriter(out) as writer:
        for group in iter_sentences(path, stats=stats):
            assert len({e.sent_id for e in group}) == 1
            writer.write_entries(group)
    assert _bytes(out) == _bytes(path)
    assert stats.bad_lines == 0 and stats.entries == stats.lines
    assert (out.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")


def test_plain_input_and_sentence_grouping(tmp_path: Path) -> None:
    plain = tmp_path / "list.txt"
    plain.write_bytes(_bytes(NBEST / "newstest-fr-en" / "newstest2012.300.nbest.gz"))
    groups = list(iter_sentences(plain))
    assert [g[0].sent_id for g in groups] == list(range(300))
    assert sum(len(g) for g in groups) == 28946
    first = groups[0][0]
    assert first.hyp == "parliament has not ratified the amendment for the release of tymosenko"
    assert first.layout() == (("LexicalReordering0", 6), ("Distortion0", 1), ("LM0", 1), ("WordPenalty0", 1),
                              ("PhrasePenalty0", 1), ("TranslationModel0", 4))
    assert first.total == -108.067
    assert first.dense[2] == ("LM0", (-63.0248,))


@pytest.mark.parametrize("path", LISTS, ids=lambda p: p.parent.name)
def test_added_feature_lands_before_the_total(path: Path) -> None:
    for n, entry in enumerate(iter_entries(path)):
        if n > 300:
            break
        line = add_feature(entry, "NLM0", [-12.3456789])
        added = f" NLM0{entry.label_sep} -12.3457"
        assert line.replace(added, "", 1) == entry.raw
        parsed = parse_line(line, "x", 1)
        assert parsed.dense == entry.dense + (("NLM0", (-12.3457,)),)
        assert (parsed.sent_id, parsed.hyp, parsed.total) == (entry.sent_id, entry.hyp, entry.total)
        # The new feature is the last thing before the total's separator.
        features_end = line.index("|||", line.index("|||", line.index("|||") + 3) + 3)
        assert line[:features_end].rstrip().endswith(added)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("0 ||| a b  ||| F0= 1 2 ||| -3.5 ||| 0-0 1-1\n", "0 ||| a b  ||| F0= 1 2 NLM0= -1.5 ||| -3.5 ||| 0-0 1-1\n"),
        ("3||| x .  ||| d: 0 -1 lm: -2 w: -2 ||| -1\r\n", "3||| x .  ||| d: 0 -1 lm: -2 w: -2 NLM0: -1.5 ||| -1\r\n"),
        ("1 ||| y ||| F0= 1  sp_a= 2   ||| 4", "1 ||| y ||| F0= 1  sp_a= 2 NLM0= -1.5   ||| 4"),
        ("2 |||  ||| ||| 0\n", "2 |||  ||| NLM0= -1.5 ||| 0\n"),
    ],
)
def test_add_feature_keeps_spacing(raw: str, expected: str) -> None:
    assert add_feature(parse_line(raw, "x", 1), "NLM0", [-1.5]) == expected


def test_sparse_features_are_kept_apart() -> None:
    entry = parse_line("1 ||| y ||| F0= 1  sp_a= 2 G0= 3 4 ||| 4\n", "x", 1)
    assert entry.dense == (("F0", (1.0,)), ("G0", (3.0, 4.0)))
    assert entry.sparse == (("sp_a", 2.0),)


@pytest.mark.parametrize("name", ["NLM_0", "", "N LM", "NLM=", "a|b"])
def test_bad_feature_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError):
        check_feature_name(name)
    entry = parse_line("0 ||| a ||| F0= 1 ||| 1\n", "x", 1)
    with pytest.raises(ValueError):
        add_feature(entry, name, [0.0])


BAD_LINES = [
    ("0 ||| a b ||| F0= 1\n", "at least 4"),
    ("x ||| a b ||| F0= 1 ||| 2\n", "sentence id"),
    ("0 ||| a b ||| F0= one ||| 2\n", "feature value"),
    ("0 ||| a b ||| 1 F0= 1 ||| 2\n", "before any feature label"),
    ("0 ||| a b ||| F0= 1 ||| total\n", "total score"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
def test_malformed_line_names_file_and_line(bad: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.nbest"
    good = "0 ||| a ||| F0= 1 ||| 1\n"
    path.write_text(good + good + bad + good)
    with pytest.raises(NbestFormatError) as info:
        list(iter_entries(path))
    assert f"{path}:3:" in str(info.value) and message in str(info.value)
    assert info.value.line == 3


def test_skip_bad_counts_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "bad.nbest.gz"
    good = ["0 ||| a ||| F0= 1 ||| 1\n", "0 ||| b ||| F0= 2 ||| 2\n", "1 ||| c ||| F0= 3 ||| 3\n"]
    lines = [good[0], BAD_LINES[0][0], good[1], BAD_LINES[2][0], "\n", good[2]]
    with gzip.open(path, "wt") as handle:
        handle.write("".join(lines))
    stats = ReadStats()
    groups = list(iter_sentences(path, skip_bad=True, stats=stats))
    assert [[e.raw for e in g] for g in groups] == [good[:2], good[2:]]
    assert stats.bad_lines == 2 and stats.entries == 3 and stats.sentences == 2
    assert f"{path}:2:" in stats.bad_examples[0]


@pytest.mark.parametrize("ids", [[0, 1, 0], [0, 2, 1], [3, 3, 2], [0, 1, 1, 0]], ids=str)
@pytest.mark.parametrize("skip_bad", [False, True])
def test_a_sentence_id_out_of_order_names_file_and_line(ids: list[int], skip_bad: bool, tmp_path: Path) -> None:
    """Moses writes sentences in increasing id order, each one's hypotheses together: an id
    lower than its predecessor's is refused where it stands, not read as a new sentence."""
    path = tmp_path / "shuffled.nbest"
    path.write_text("".join(f"{i} ||| w{n} ||| F0= 1 ||| 1\n" for n, i in enumerate(ids)))
    groups = []
    with pytest.raises(NbestFormatError) as info:
        for group in iter_sentences(path, skip_bad=skip_bad):
            groups.append(group)
    line = len(ids)
    assert str(info.value).startswith(f"{path}:{line}: sentence id {ids[-1]} after sentence {ids[-2]}")
    assert info.value.line == line
    assert sum(len(g) for g in groups) == len([i for i in ids[:-1] if i != ids[-2]])  # the sentences before
    # gaps in the ids are fine (a sentence without hypotheses)
    path.write_text("0 ||| a ||| F0= 1 ||| 1\n2 ||| b ||| F0= 1 ||| 1\n2 ||| c ||| F0= 1 ||| 1\n")
    assert [[e.hyp for e in g] for g in iter_sentences(path)] == [["a"], ["b", "c"]]


def test_invalid_utf8_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.nbest"
    path.write_bytes(b"0 ||| caf\xe9 ||| F0= 1 ||| 1\n")
    with pytest.raises(NbestFormatError, match=":1: not UTF-8"):
        list(iter_entries(path))


def test_writer_is_atomic(tmp_path: Path) -> None:
    out = tmp_path / "out.nbest"
    shutil.copy(NBEST / "europarl-10x100-5iter" / "reference", out)
    before = out.read_bytes()
    with pytest.raises(RuntimeError):
        with NbestWriter(out) as writer:
            writer.write("0 ||| a ||| F0= 1 ||| 1\n")
            raise RuntimeError("interrupted")
    assert out.read_bytes() == before
    assert not (tmp_path / "out.nbest.tmp").exists()


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_gzip_names_the_file(damage: str, tmp_path: Path) -> None:
    data = gzip.compress(b"0 ||| a b ||| LM0= -1 ||| -1\n" * 2000, mtime=0)
    data = data[: len(data) // 2] if damage == "truncated" else data[:20] + b"\x00garbage" * 20
    path = tmp_path / f"{damage}.nbest.gz"
    path.write_bytes(data)
    stats = ReadStats()
    with pytest.raises(NbestFormatError, match=f"{path}:[0-9]+: damaged or truncated gzip data"):
        list(iter_entries(path, skip_bad=True, stats=stats))
