"""``nlmserve query`` (a model file scored in this process) against ``nlmserve score`` through a
real server on 127.0.0.1 (port 0), the golden model's values worked out by hand, bad input;
``nlmserve info`` against the model file's own bytes and the server's ModelInfo."""

from __future__ import annotations

import io
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from nlmserve.cli import main
from nlmserve.client import LMClient
from nlmserve.server.app import RunningServer

from conftest import TINY_CLASSES, TINY_DIM, TINY_ORDER, TINY_STEPS
from support import dev_sentences, golden_model, start_server

TOL = 1e-5  # docs/serving.md: in process and through a server, float32 rounding apart
LOG10_2, LOG10_3, LOG10_E = math.log10(2), math.log10(3), math.log10(math.e)


@pytest.fixture(scope="module")
def server(tiny_lm: Any) -> Iterator[RunningServer]:
    running = start_server(tiny_lm, torch_threads=1)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return golden_model(tmp_path_factory.mktemp("golden") / "golden.nlm")


def run(argv: list[str], stdin: bytes, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``nlmserve ARGV < stdin`` in this process → (exit code, stdout, stderr)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def cells(plain: str) -> list[list[tuple[str, float]]]:
    """Plain output → per line its cells as ("word=id n", log10), the total as ("Total OOV: k", T);
    the summary lines as (name, value)."""
    parsed = []
    for line in plain.splitlines():
        if line.startswith(("Perplexity", "OOVs:", "Tokens:")):
            name, value = line.split("\t")
            parsed.append([(name, float(value))])
            continue
        row = []
        for cell in line.split("\t"):
            if cell.startswith("Total: "):
                _, total, oov, k = cell.split(" ")
                row.append((f"Total {oov} {k}", float(total)))
            else:
                head, value = cell.rsplit(" ", 1)
                row.append((head, float(value)))
        parsed.append(row)
    return parsed


def assert_same_output(query: str, score: str) -> None:
    """The same lines, words, ids, n-gram lengths and OOV counts; numbers within float32
    rounding and the 6 significant digits printed."""
    got, want = cells(query), cells(score)
    assert [[head for head, _ in row] for row in got] == [[head for head, _ in row] for row in want]
    for row_got, row_want in zip(got, want):
        assert [v for _, v in row_got] == pytest.approx([v for _, v in row_want], rel=TOL, abs=2 * TOL)


@pytest.mark.parametrize("flags", [[], ["--unnormalized"], ["--no-bos", "--no-eos", "--lowercase"]],
                         ids=["default", "unnormalized", "no-bos-no-eos-lowercase"])
def test_query_prints_what_score_prints_through_a_server(server: RunningServer, tiny_model_path: Path,
                                                         flags: list[str], monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    lines = dev_sentences(800, 40) + ["qqqunknownqqq europe", "", "The European Parliament"]
    text = ("\n".join(lines) + "\n").encode()
    query = ["query", "--model", str(tiny_model_path), "--device", "cpu", *flags]
    score = ["score", "--server", server.target, *flags]
    for as_json in (False, True):
        extra = ["--json"] if as_json else []
        code_q, out_q, err_q = run(query + extra, text, monkeypatch, capsys)
        code_s, out_s, err_s = run(score + extra, text, monkeypatch, capsys)
        assert (code_q, code_s) == (0, 0), (err_q, err_s)
        if not as_json:
            assert len(out_q.splitlines()) == len(lines) + 4
            assert_same_output(out_q, out_s)
            unknown = out_q.splitlines()[len(lines) - 3]
            assert unknown.startswith("qqqunknownqqq=0 ") and unknown.endswith("OOV: 1")
            continue
        got = [json.loads(line) for line in out_q.splitlines()]
        want = [json.loads(line) for line in out_s.splitlines()]
        assert len(got) == len(want) == len(lines) + 1
        for g, w in zip(got[:-1], want[:-1]):
            key = [(t["word"], t["id"], t["ngram_length"], t["oov"]) for t in g["tokens"]]
            assert key == [(t["word"], t["id"], t["ngram_length"], t["oov"]) for t in w["tokens"]]
            assert [t["log_prob"] for t in g["tokens"]] == pytest.approx([t["log_prob"] for t in w["tokens"]],
                                                                           abs=TOL)
            assert g["total"] == pytest.approx(w["total"], abs=1e-4) and g["oov"] == w["oov"]
        assert got[-1]["summary"] == pytest.approx(want[-1]["summary"], rel=TOL)
    # The empty line is </s> alone (none without eos), after <s>.
    empty = got[len(lines) - 2]["tokens"]
    assert [(t["word"], t["id"]) for t in empty] == ([] if "--no-eos" in flags else [("</s>", 2)])


def test_query_of_the_golden_model_by_hand(golden: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """tests/test_golden_model.py works p out: "a b" → 1/4, 1/8, 1/26 (</s>); "b zebra" → b 1/4
    (<s> <s> b), zebra as <unk> 1/26 (<s> b <unk>: r = (0, 2), class 0 1/13, in class 1/2),
    </s> 1/14 (b <unk> </s>: r = (0, 1), class 0 1/7, in class 1/2)."""
    code, out, err = run(["query", "--model", str(golden), "--device", "cpu"], b"a b\nb zebra\n", monkeypatch, capsys)
    assert code == 0, err
    p1 = [math.log10(p) for p in (1 / 4, 1 / 8, 1 / 26)]
    p2 = [math.log10(p) for p in (1 / 4, 1 / 26, 1 / 14)]
    rows = cells(out)
    assert [head for head, _ in rows[0]] == ["a=3 2", "b=4 3", "</s>=2 3", "Total OOV: 0"]
    assert [head for head, _ in rows[1]] == ["b=4 2", "zebra=0 3", "</s>=2 3", "Total OOV: 1"]
    assert [v for _, v in rows[0]] == pytest.approx(p1 + [sum(p1)], abs=1e-5)
    assert [v for _, v in rows[1]] == pytest.approx(p2 + [sum(p2)], abs=1e-5)
    total, known = sum(p1) + sum(p2), sum(p1) + sum(p2) - math.log10(1 / 26)
    assert out.splitlines()[2:] == [f"Perplexity including OOVs:\t{10 ** (-total / 6):.6g}",
                                    f"Perplexity excluding OOVs:\t{10 ** (-known / 5):.6g}",
                                    "OOVs:\t1", "Tokens:\t6"]
    # Unnormalised (NCE): s_class + s_w in log10: a ln 3, b ln 3 (r = (2, 0)), </s> 0.
    code, out, err = run(["query", "--model", str(golden), "--device", "cpu", "--unnormalized", "--json"],
                         b"a b\n", monkeypatch, capsys)
    assert code == 0, err
    tokens = json.loads(out.splitlines()[0])["tokens"]
    assert [t["log_prob"] for t in tokens] == pytest.approx([LOG10_3, LOG10_3, 0.0], abs=1e-6)


@pytest.mark.parametrize("stdin, message", [
    (b"", "<stdin>: no input: give one sentence per line"),
    (b"a b\nc\na <s> b\n", "<stdin>:3: <s> inside a sentence cannot be predicted"),
    (b"a b\n\xff\xfe c\n", "<stdin>:2: not UTF-8"),
], ids=["empty", "bos-inside", "not-utf8"])
def test_bad_input_is_a_clear_error_from_both(stdin: bytes, message: str, server: RunningServer,
                                              tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["query", "--model", str(tiny_model_path), "--device", "cpu"], ["score", "--server", server.target]):
        code, _, err = run(argv, stdin, monkeypatch, capsys)
        assert code == 1 and err.startswith(f"nlmserve {argv[0]}: error: {message}"), err


def test_a_wrong_model_file_is_a_clear_error(tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.en"
    text.write_text("the house\n")
    truncated = tmp_path / "truncated.nlm"
    truncated.write_bytes(tiny_model_path.read_bytes()[:100_000])
    cases = [(text, f"{text}: not an nlmserve model file"), (truncated, f"{truncated}: truncated model file"),
             (tmp_path / "missing.nlm", f"{tmp_path / 'missing.nlm'}: no such file")]
    for path, message in cases:
        for argv in (["query", "--model", str(path)], ["info", str(path)]):
            code, out, err = run(argv, b"the house\n", monkeypatch, capsys)
            assert code == 1 and out == "" and err.startswith(f"nlmserve {argv[0]}: error: {message}"), err


def file_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(format version, JSON header) read straight from a model file's bytes (lm/model_file.py's layout)."""
    blob = path.read_bytes()
    magic, version, length = struct.unpack_from("<8sIQ", blob)
    assert magic == b"NLMSERVE"
    return version, json.loads(blob[20 : 20 + length])


def test_info_json_round_trips_the_model_files_metadata(tiny_model_path: Path, dev_small_path: Path, tiny_lm: Any,
                                                        server: RunningServer, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.lm.evaluate import evaluate

    code, out, err = run(["info", str(tiny_model_path), "--json"], b"", monkeypatch, capsys)
    assert code == 0, err
    info = json.loads(out)
    version, header = file_header(tiny_model_path)
    assert info["config"] == header["config"]
    # the training record with its provenance (the paths, outside the hash) joined back
    assert info["training"] == {**header["training"], **header["provenance"],
                                "train_config": {**header["training"]["train_config"],
                                                 **header["provenance"]["train_config"]}}
    assert info["training"]["train"] == header["provenance"]["train"] and "train" not in header["training"]
    assert info["model_hash"] == header["sha256"] and info["format_version"] == version == 3
    assert info["vocab_size"] == len(header["vocabulary"]) and info["file_bytes"] == tiny_model_path.stat().st_size
    assert (info["num_classes"], info["class_method"]) == (header["classes"]["num_classes"],
                                                           header["classes"]["method"])
    # The values the test's training was given (conftest.py).
    assert (info["order"], info["config"]["dim"], info["num_classes"]) == (TINY_ORDER, TINY_DIM, TINY_CLASSES)
    assert (info["objective"], info["output_type"], info["self_normalized"]) == ("nce", "class", True)
    assert info["class_method"] == "frequency" and info["lowercase"] is False
    assert info["training"]["steps"] == TINY_STEPS and info["tokens_seen"] == TINY_STEPS * 256  # batch 256
    assert info["recipe"] == "" and info["training"]["valid"] == str(dev_small_path)
    # The validation perplexity the trainer recorded is the written model's on its validation text.
    assert info["valid_perplexity"] == pytest.approx(evaluate(tiny_lm, dev_small_path).perplexity, rel=1e-5)
    # What a server of the same file answers.
    with LMClient(server.target) as client:
        served = client.info
    assert served.model_hash == info["model_hash"]
    assert (served.order, served.vocab_size, served.num_classes) == (info["order"], info["vocab_size"],
                                                                     info["num_classes"])
    assert (served.objective, served.output_type, served.self_normalized) == (
        info["objective"], info["output_type"], info["self_normalized"])
    # The text form: the same facts, KEY<TAB>VALUE.
    code, out, err = run(["info", str(tiny_model_path)], b"", monkeypatch, capsys)
    assert code == 0, err
    rows = dict(line.split("\t", 1) for line in out.splitlines())
    assert rows["model_hash"] == info["model_hash"] and rows["order"] == str(TINY_ORDER)
    assert rows["num_classes"] == f"{TINY_CLASSES} (frequency)" and rows["self_normalized"] == "yes"
    assert rows["recipe"] == "flags as given" and rows["steps"] == str(TINY_STEPS)
    assert rows["tokens_seen"] == str(TINY_STEPS * 256) and rows["ngram_features"] == "none"
    assert float(rows["valid_perplexity"]) == pytest.approx(info["valid_perplexity"], rel=1e-5)


def test_info_of_a_tree_and_of_a_model_that_does_not_self_normalise(tree_model_path: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    mle = golden_model(tmp_path / "mle.nlm", objective="mle")
    for path, want in [(tree_model_path, ("tree", "mle", True, 0, None, 4)),
                       (mle, ("class", "mle", False, 2, "file", 3))]:
        code, out, err = run(["info", str(path), "--json"], b"", monkeypatch, capsys)
        assert code == 0, err
        info = json.loads(out)
        got = (info["output_type"], info["objective"], info["self_normalized"], info["num_classes"],
               info["class_method"], info["order"])
        assert got == want
    assert info["training"] == {"note": "hand-set weights (tests/support.py golden_model)"}
    assert info["recipe"] is None and info["tokens_seen"] is None


def test_info_reads_the_header_only_and_verify_reads_the_rest(tiny_model_path: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A changed weight byte: ``info`` still describes the file from its header (it builds no
    network and reads no weight), ``info --verify`` finds the content no longer matches the hash."""
    from nlmserve.lm.model_file import ModelFile

    blob = bytearray(tiny_model_path.read_bytes())
    blob[-10] ^= 0xFF
    changed = tmp_path / "changed.nlm"
    changed.write_bytes(bytes(blob))

    def no_network(self: ModelFile) -> None:
        raise AssertionError("info built the network")

    monkeypatch.setattr(ModelFile, "build_model", no_network)
    code, out, err = run(["info", str(changed), "--json"], b"", monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["model_hash"] == file_header(tiny_model_path)[1]["sha256"]
    code, out, err = run(["info", str(changed), "--verify"], b"", monkeypatch, capsys)
    assert code == 1 and out == "" and f"{changed}: content hash mismatch" in err
    code, out, err = run(["info", str(tiny_model_path), "--verify"], b"", monkeypatch, capsys)
    assert code == 0 and "model_hash\t" in out, err


def test_info_imports_no_torch(tiny_model_path: Path) -> None:
    """A header is read as KenLM's tools read theirs, without loading the training stack:
    info of a model file (not --verify) imports no torch, so it answers at once."""
    import subprocess

    code = ("import sys\nfrom nlmserve.cli import main\nrc = main(['info', '--json', sys.argv[1]])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_model_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["order"] == TINY_ORDER


def test_old_spellings_are_accepted_with_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["eval", "--model", "m", "--text", "t", "--kn", "kn.arpa", "--tune-kn-weight", "dev"])
    assert (args.kenlm, args.tune_mix_weight, args.mix_weight) == ("kn.arpa", "dev", None)
    assert capsys.readouterr().err.splitlines() == [
        "nlmserve eval: warning: --kn is deprecated; use --kenlm",
        "nlmserve eval: warning: --tune-kn-weight is deprecated; use --tune-mix-weight"]
    args = parser.parse_args(["eval", "--model", "m", "--text", "t", "--kenlm", "kn.arpa", "--mix-weight", "0.3"])
    assert (args.kenlm, args.mix_weight, args.tune_mix_weight) == ("kn.arpa", 0.3, None)
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):  # an old and a new spelling of exclusive flags are still exclusive
        parser.parse_args(["eval", "--model", "m", "--text", "t", "--mix-weight", "0.3", "--tune-kn-weight", "d"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--help"])
    help_text = capsys.readouterr().out
    assert "--kenlm" in help_text and "--kn" not in help_text.replace("--kenlm", "")
