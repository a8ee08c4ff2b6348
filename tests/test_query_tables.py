"""``nlmserve query --tables FILE``: KenLM's ``query`` from a tables file, with numpy alone (torch is
never imported): the lines ``query --model`` prints (``--unnormalized`` for a class output's
self-normalised scores; a tree's exact ones either way), within float32 rounding for a
float32 file and within the bound a quantised file records (nlmserve.lm.tables_scorer)."""

from __future__ import annotations

import io
import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from nlmserve.cli import main

from contract import CONTRACT
from support import dev_sentences

TOL = 1e-5  # float32 rounding and the 6 significant digits printed (log10)
LINES = dev_sentences(0, 40) + ["qqqunknownqqq europe", "", "The European Parliament"]


def run(argv: list[str], stdin: bytes, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``nlmserve ARGV < stdin`` in this process → (exit code, stdout, stderr)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], Path]:
    """The tables file of a model in a quantisation, written once (``export-tables`` in this process)."""
    folder = tmp_path_factory.mktemp("tables")
    done: dict[tuple[Path, str], Path] = {}

    def export(model: Path, quantization: str) -> Path:
        if (model, quantization) not in done:
            out = folder / f"{model.stem}.{quantization}.nlt"
            assert main(["export-tables", "--model", str(model), "--out", str(out), "--quantize", quantization]) == 0
            done[model, quantization] = out
        return done[model, quantization]

    return export


def _tokens(out: str) -> list[list[tuple[str, float]]]:
    """Plain output's sentence lines → per line ("word=id n", log10) cells and ("Total OOV: k", T)."""
    lines = []
    for line in out.splitlines():
        if line.startswith(("Perplexity", "OOVs:", "Tokens:")):
            continue
        row = []
        for cell in line.split("\t"):
            if cell.startswith("Total: "):
                _, total, oov, k = cell.split(" ")
                row.append((f"Total {oov} {k}", float(total)))
            else:
                head, value = cell.rsplit(" ", 1)
                row.append((head, float(value)))
        lines.append(row)
    return lines


@pytest.mark.parametrize("fixture", ["tiny_model_path", "feature_model_path", "tree_model_path"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_query_tables_prints_what_query_model_prints(fixture: str, quantization: str, request: pytest.FixtureRequest,
                                                     exported: Callable[[Path, str], Path],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The same lines, words, ids, n-gram lengths and OOVs; each log10 score within float32
    rounding of query --model's (float32 file) or within the file's bound (int8), the totals
    within the bound times the tokens."""
    from nlmserve.lm.tables_file import read_tables_file

    model: Path = request.getfixturevalue(fixture)
    tables = exported(model, quantization)
    bound = read_tables_file(tables).header.error_bound / math.log(10) + TOL
    text = ("\n".join(LINES) + "\n").encode()
    code_t, out_t, err_t = run(["query", "--tables", str(tables), "--unnormalized"], text, monkeypatch, capsys)
    code_m, out_m, err_m = run(["query", "--model", str(model), "--device", "cpu", "--unnormalized"], text,
                               monkeypatch, capsys)
    assert (code_t, code_m) == (0, 0), (err_t, err_m)
    assert err_t == "" and len(out_t.splitlines()) == len(LINES) + 4
    got, want = _tokens(out_t), _tokens(out_m)
    assert [[head for head, _ in row] for row in got] == [[head for head, _ in row] for row in want]
    for row_got, row_want in zip(got, want):
        for (head, g), (_, w) in zip(row_got, row_want):
            allowed = bound * (len(row_got) - 1) if head.startswith("Total") else bound
            assert abs(g - w) <= allowed + 2e-6 * abs(w), (head, g, w, allowed)
    assert out_t.splitlines()[len(LINES) - 3].startswith("qqqunknownqqq=0 ")
    if quantization == "none":
        assert out_t.splitlines()[-4:][2:] == out_m.splitlines()[-4:][2:]  # OOVs and tokens


def test_a_tree_needs_no_flag_and_json_has_the_same_keys(tree_model_path: Path, exported: Callable[[Path, str], Path],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A tree's tables give its exact log-probabilities: query --tables without --unnormalized
    answers what query --model answers, says nothing on stderr, and --json gives the keys
    of query --model --json."""
    tables = exported(tree_model_path, "none")
    text = ("\n".join(LINES[:10]) + "\n").encode()
    caplog.set_level(logging.WARNING)
    code_t, out_t, err_t = run(["query", "--tables", str(tables), "--json"], text, monkeypatch, capsys)
    code_m, out_m, _ = run(["query", "--model", str(tree_model_path), "--device", "cpu", "--json"], text,
                           monkeypatch, capsys)
    assert (code_t, code_m, err_t) == (0, 0, "")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    got, want = [json.loads(line) for line in out_t.splitlines()], [json.loads(line) for line in out_m.splitlines()]
    assert len(got) == len(want) == 11
    for g, w in zip(got[:-1], want[:-1]):
        assert [(t["word"], t["id"], t["ngram_length"], t["oov"]) for t in g["tokens"]] == \
            [(t["word"], t["id"], t["ngram_length"], t["oov"]) for t in w["tokens"]]
        assert [t["log_prob"] for t in g["tokens"]] == pytest.approx([t["log_prob"] for t in w["tokens"]], abs=TOL)
    assert got[-1]["summary"] == pytest.approx(want[-1]["summary"], rel=TOL)


def test_query_tables_imports_no_torch(tiny_model_path: Path, exported: Callable[[Path, str], Path]) -> None:
    """As KenLM's query reads a binary file: query --tables, of a float32 and of a quantised
    file, runs with numpy alone; torch is never imported."""
    code = ("import io, sys\nfrom nlmserve.cli import main\n"
            "sys.stdin = io.TextIOWrapper(io.BytesIO(b'the european parliament\\n'))\n"
            "rc = main(['query', '--tables', sys.argv[1], '--unnormalized'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    for quantization in ("none", "fp16"):
        done = subprocess.run([sys.executable, "-c", code, str(exported(tiny_model_path, quantization))],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("the=") and "Tokens:\t4" in done.stdout


def test_words_are_lowercased_as_the_client_lowercases(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The fixture's class model was trained lowercased: its file maps The, ÉTÉ, ΟΔΟΣ and
    İstanbul to the ids of the, été, οδος and i̇stanbul (str.lower, proto/contract/lowercase.tsv),
    as proto/contract/scoring_words.tsv says; STRASSE is not straße. A class output's file
    says once on stderr that its scores are self-normalised."""
    text = "The ÉTÉ ΟΔΟΣ İstanbul STRASSE\n".encode()
    code, out, err = run(["query", "--tables", str(CONTRACT / "scoring_tables.nlt")], text, monkeypatch, capsys)
    assert code == 0, err
    cells = out.splitlines()[0].split("\t")
    assert [c.split(" ")[0] for c in cells[:6]] == ["The=3", "ÉTÉ=4", "ΟΔΟΣ=6", "İstanbul=7", "STRASSE=0", "</s>=2"]
    assert cells[-1].endswith("OOV: 1")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "self-normalised" in warned[0] and "--unnormalized" in warned[0]


@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--threads", "2"]])
def test_the_model_flags_are_a_usage_error_with_tables(flags: list[str], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["query", "--tables", str(CONTRACT / "scoring_tables.nlt"), *flags], b"a\n", monkeypatch,
                         capsys)
    assert code == 2 and out == "" and f"{flags[0]} is for --model" in err and len(err.splitlines()) == 1


def test_model_and_tables_are_one_or_the_other(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["query"], ["query", "--model", "m.nlm", "--tables", "t.nlt"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2
        assert "--model" in capsys.readouterr().err
