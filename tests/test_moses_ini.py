"""``nlmserve moses-ini``: the NeuralLMServer line derived from a model file or a server.

Real models: the shared tiny NCE 5-gram and tree 4-gram, a 10-gram trained here for a few
steps, the golden model written as MLE (no tables: not self-normalised) and a self-normalised
model with a hidden layer (no tables: its score is not of the tables' form). Each line is
checked against what the feature accepts (moses_plugin/cpp/NeuralLMServer.cpp, Load): the
model's order; scoring=local only with tables; normalized=true with scoring=local only for a
tree. ``--server`` asks a real server on 127.0.0.1 (port 0).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from nlmserve.cli import main
from nlmserve.lm.scoring import LanguageModel
from support import golden_model, start_server

BASELINE_INI = Path(__file__).resolve().parent.parent / "data" / "nbest" / "newstest-fr-en" / "baseline-weights.ini"


def _lines(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str, list[str]]:
    """The feature line, the weight line and the comment lines that ``moses-ini`` prints."""
    assert main(["moses-ini", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "[feature]" and "[weight]" in out
    weight_at = out.index("[weight]")
    assert out[weight_at + 1:] == [out[-1]]  # one weight line, last
    return out[2], out[-1], [line for line in out if line.startswith("#")]


@pytest.fixture(scope="module")
def ten_gram_path(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path, dev_small_path: Path) -> Path:
    """A 10-gram class-output NCE model (a few steps: only its kind matters here)."""
    from nlmserve.lm.train import TrainConfig, train

    out = tmp_path_factory.mktemp("ten") / "ten.nlm"
    train(TrainConfig(train=str(train_small_path), valid=str(dev_small_path), out=str(out), order=10, dim=8,
                      classes=16, objective="nce", min_count=2, max_steps=40, batch_size=128, valid_every=40,
                      threads=1, seed=3, progress=False, learning_curve=False, checkpoint_every=0))
    return out


@pytest.fixture(scope="module")
def hidden_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-normalised (NCE) class model with a hidden layer, untrained: no scoring tables."""
    import torch

    from nlmserve.lm.classes import WordClasses
    from nlmserve.lm.config import ModelConfig
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.vocab import Vocabulary

    torch.manual_seed(0)
    word_class = np.array([0, 0, 0, 1, 1, 1])
    net = NeuralLM(ModelConfig(vocab_size=6, order=3, dim=2, hidden=4, activation="tanh", output="class",
                               num_classes=2), word_class)
    out = tmp_path_factory.mktemp("hidden") / "hidden.nlm"
    save_model(out, net, Vocabulary(("a", "b", "c")), WordClasses(word_class, "file"), objective="nce")
    return out


def test_a_5_gram_a_10_gram_and_a_tree_give_three_lines(tiny_model_path: Path, ten_gram_path: Path,
                                                        tree_model_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    five, weight5, _ = _lines(capsys, "--model", str(tiny_model_path))
    ten, weight10, _ = _lines(capsys, "--model", str(ten_gram_path))
    tree, weight_tree, notes = _lines(capsys, "--model", str(tree_model_path))
    assert five == "NeuralLMServer name=NLM0 factor=0 order=5 path=127.0.0.1:50051 normalized=false scoring=local"
    assert ten == "NeuralLMServer name=NLM0 factor=0 order=10 path=127.0.0.1:50051 normalized=false scoring=local"
    assert tree == "NeuralLMServer name=NLM0 factor=0 order=4 path=127.0.0.1:50051 normalized=true scoring=local"
    assert weight5 == weight10 == weight_tree == "NLM0= 0.1"
    assert "tree output: exact log-probabilities" in notes[0]


def test_a_tables_file_gives_the_server_free_line(tiny_model_path: Path, tree_model_path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--tables FILE``: the line maps the file (its absolute path) and names no server, alone or
    with ``--model`` (the file checked against it); with ``--path`` or ``--server`` the server goes
    beside it (the feature checks at load that it serves the file's model). A file of another
    model, or one that is not a tables file, is refused, naming it."""
    tables, tree_tables = tmp_path / "tiny.nlt", tmp_path / "tree.nlt"
    assert main(["export-tables", "--model", str(tiny_model_path), "--out", str(tables)]) == 0
    assert main(["export-tables", "--model", str(tree_model_path), "--out", str(tree_tables), "--quantize",
                 "int8"]) == 0
    capsys.readouterr()
    alone, weight, notes = _lines(capsys, "--tables", str(tables))
    assert alone == f"NeuralLMServer name=NLM0 factor=0 order=5 normalized=false tables={tables}"
    assert weight == "NLM0= 0.1" and "no server: the decoder maps the tables file" in notes[0]
    assert _lines(capsys, "--model", str(tiny_model_path), "--tables", str(tables))[0] == alone
    tree, _, notes = _lines(capsys, "--tables", str(tree_tables), "--name", "NLM1")
    assert tree == f"NeuralLMServer name=NLM1 factor=0 order=4 normalized=true tables={tree_tables}"
    assert "tree output" in notes[0]
    both, _, _ = _lines(capsys, "--tables", str(tables), "--path", "10.0.0.1:7")
    assert both == ("NeuralLMServer name=NLM0 factor=0 order=5 path=10.0.0.1:7 normalized=false scoring=local "
                    f"tables={tables}")
    running = start_server(LanguageModel.load(tiny_model_path, device="cpu"))
    try:
        served, _, notes = _lines(capsys, "--server", running.target, "--tables", str(tables))
    finally:
        running.stop(1.0)
    assert served == both.replace("10.0.0.1:7", running.target)
    assert f"the server at {running.target} must serve the tables file's model" in notes[0]
    assert main(["moses-ini", "--model", str(tree_model_path), "--tables", str(tables)]) != 0
    captured = capsys.readouterr()
    assert not captured.out and re.search(rf"error: {re.escape(str(tables))}: holds the tables of model \w{{12}}, "
                                          r"not of \w{12}: write it", captured.err), captured.err
    assert main(["moses-ini", "--tables", str(tiny_model_path)]) != 0
    captured = capsys.readouterr()
    assert not captured.out and f"{tiny_model_path}: not an nlmserve export-tables file" in captured.err
    assert main(["moses-ini"]) == 2
    assert "give --tables FILE (the server-free line), --model FILE or --server HOST:PORT" in capsys.readouterr().err


def test_models_without_tables_are_scored_by_the_server(tmp_path: Path, hidden_model_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    mle = golden_model(tmp_path / "mle.nlm", objective="mle")
    line, _, notes = _lines(capsys, "--model", str(mle), "--path", "10.0.0.1:7")
    assert line == "NeuralLMServer name=NLM0 factor=0 order=3 path=10.0.0.1:7 normalized=true scoring=server"
    assert "not self-normalised" in notes[0]
    line, _, notes = _lines(capsys, "--model", str(hidden_model_path), "--name", "NLM1")
    assert line == "NeuralLMServer name=NLM1 factor=0 order=3 path=127.0.0.1:50051 normalized=false scoring=server"
    assert "hidden layer" in notes[0]


@pytest.mark.parametrize("which", ["tiny", "tree", "mle", "hidden"])
def test_a_server_gives_the_line_of_the_model_it_serves(which: str, tiny_model_path: Path, tree_model_path: Path,
                                                        hidden_model_path: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = {"tiny": tiny_model_path, "tree": tree_model_path, "hidden": hidden_model_path,
            "mle": tmp_path / "mle.nlm"}[which]
    if which == "mle":
        golden_model(path, objective="mle")
    from_file, weight, notes = _lines(capsys, "--model", str(path), "--path", "HOST:1")
    running = start_server(LanguageModel.load(path, device="cpu"))
    try:
        served, served_weight, served_notes = _lines(capsys, "--server", running.target)
    finally:
        running.stop(1.0)
    assert served == from_file.replace("path=HOST:1", f"path={running.target}")
    assert running.target.startswith("127.0.0.1:") and not running.target.endswith(":0")
    assert (served_weight, served_notes) == (weight, notes)  # the same reasons, the same hash


def test_the_weight_is_a_tenth_of_the_tuneable_weights(tiny_model_path: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the shipped baseline, tuned by mert-moses.pl: L1 norm 1 without UnknownWordPenalty0
    _, weight, _ = _lines(capsys, "--model", str(tiny_model_path), "--ini", str(BASELINE_INI))
    assert weight == "NLM0= 0.1"
    ini = tmp_path / "moses.ini"
    ini.write_text("[feature]\nUnknownWordPenalty\nWordPenalty\nKENLM name=LM0 factor=0 path=lm.bin order=5\n"
                   "Distortion tuneable=false\n\n[weight]\nUnknownWordPenalty0= 1\nWordPenalty0= -1\n"
                   "LM0= 0.5 # comment\nDistortion0= 0.3\n", encoding="utf-8")
    _, weight, notes = _lines(capsys, "--model", str(tiny_model_path), "--ini", str(ini))
    assert weight == "NLM0= 0.15"  # 0.1 × (|-1| + 0.5): the untuned UnknownWordPenalty0 and Distortion0 left out
    assert "(1.5)" in notes[-1]


def test_security_options_follow_the_server_flags(tiny_model_path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["moses-ini", "--model", str(tiny_model_path), "--token-file", "t"]) == 2  # usage
    assert "go with --server" in capsys.readouterr().err
    assert main(["moses-ini", "--server", "127.0.0.1:1", "--tls"]) == 2
    assert "--tls-ca" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse's check of the value
        main(["moses-ini", "--model", str(tiny_model_path), "--name", "NLM_0"])
    assert stop.value.code == 2 and "'_'" in capsys.readouterr().err
