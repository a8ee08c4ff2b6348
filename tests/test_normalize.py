"""lm.normalize / ``nlmserve normalize``: tokenised text into the form of the n-best lists."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import pytest

from nlmserve.cli import main
from nlmserve.common.errors import CorpusError
from nlmserve.lm.normalize import TextForm, normalize_file, normalize_line

DATA = Path(__file__).resolve().parent.parent / "data" / "lm"
LC_MOSES = TextForm.lc_moses()


def test_shipped_europarl_slice_becomes_its_lc_moses_form_byte_for_byte(tmp_path: Path) -> None:
    # The shipped lc-moses slice was made by the Moses pipeline, not by this module.
    out = tmp_path / "dev.lc-moses.en"
    assert main(["normalize", "--in", str(DATA / "europarl.dev.1k.tok.en"), "--out", str(out), "--lc-moses"]) == 0
    expected = (DATA / "europarl.dev.1k.lc-moses.en").read_bytes()
    assert out.read_bytes() == expected
    source = (DATA / "europarl.dev.1k.tok.en").read_text(encoding="utf-8")
    assert source != expected.decode("utf-8")  # the slice does need the steps: 165 hyphens, capitals


@pytest.mark.parametrize(
    ("line", "form", "expected"),
    [
        ("Long-term aid", TextForm(split_hyphens=True), "Long @-@ term aid"),
        ("a 2-3 vote , e-mail-based", TextForm(split_hyphens=True), "a 2 @-@ 3 vote , e @-@ mail @-@ based"),
        ("café-bar", TextForm(split_hyphens=True), "café @-@ bar"),
        # only between letters or digits: a dash standing alone, at a word's edge or by _ stays
        ("a - b -- c d- -e x_-y", TextForm(split_hyphens=True), "a - b -- c d- -e x_-y"),
        ("the Union ’ s and Union ' s , ’ quote ’", TextForm(apostrophes=True),
         "the Union 's and Union 's , ' quote '"),
        ("don ' stop ' sure", TextForm(apostrophes=True), "don ' stop ' sure"),  # ' s only as a word
        ("Ärger  IN\tBrüssel ", TextForm(lowercase=True), "ärger in brüssel"),
        ("The EU’s Long-Term plan", LC_MOSES, "the eu's long @-@ term plan"),
        ("", LC_MOSES, ""),
        ("   ", LC_MOSES, ""),
    ],
)
def test_normalize_line(line: str, form: TextForm, expected: str) -> None:
    assert normalize_line(line, form) == expected


def test_lines_are_kept_one_for_one(tmp_path: Path) -> None:
    # references must stay aligned with their sources: empty lines stay, CRLF and a BOM go
    src = tmp_path / "refs.txt"
    src.write_bytes("\ufeffOne-Two\r\n\n  \nThree\n".encode("utf-8"))
    out = tmp_path / "refs.lc"
    assert normalize_file(str(src), str(out), LC_MOSES) == 4
    assert out.read_text(encoding="utf-8") == "one @-@ two\n\n\nthree\n"


@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_compressed_in_and_out(tmp_path: Path, suffix: str) -> None:
    opener = gzip.open if suffix == ".gz" else lzma.open
    src = tmp_path / f"in.txt{suffix}"
    with opener(src, "wt", encoding="utf-8") as f:
        f.write("Well-known\nA’s B\n")
    out = tmp_path / f"out.txt{suffix}"
    assert normalize_file(str(src), str(out), LC_MOSES) == 2
    with opener(out, "rt", encoding="utf-8") as f:
        assert f.read() == "well @-@ known\na's b\n"


def test_bad_input_names_the_line_and_leaves_the_old_output(tmp_path: Path) -> None:
    src = tmp_path / "bad.txt"
    src.write_bytes(b"fine-line\nsecond\nbad \xff byte\n")
    out = tmp_path / "out.txt"
    out.write_text("previous output\n", encoding="utf-8")
    with pytest.raises(CorpusError) as exc:
        normalize_file(str(src), str(out), LC_MOSES)
    assert exc.value.line == 3 and str(src) in str(exc.value)
    assert out.read_text(encoding="utf-8") == "previous output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "out.txt"]  # no partial file left


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a-b\n", encoding="utf-8")
    assert main(["normalize", "--in", str(src), "--out", str(tmp_path / "o")]) == 2
    assert "choose --lc-moses" in capsys.readouterr().err
    assert main(["normalize", "--in", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"), "--lc-moses"]) == 1
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["normalize", "--in", str(src), "--out", "-", "--split-hyphens", "--lowercase"]) == 0
    assert capsys.readouterr().out == "a @-@ b\n"
