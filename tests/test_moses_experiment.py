"""``nlmserve moses-experiment`` without a Moses build: the systems it makes of ``--model``,
mert-moses.pl's working folder (which tuner, continue or start again) driven through a
stand-in script that records how it was called, the moses.ini each system starts from, and
the table of a hand-made result. The whole path with a real Moses is in docs/performance-decoder.md."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nlmserve.common.errors import InputError
from nlmserve.moses_plugin import moses_experiment
from support import golden_model

INI = "[feature]\nKENLM name=LM0 factor=0 path=LM_PATH order=5\n\n[weight]\nLM0= 0.5\n"


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    moses_experiment.add_arguments(p)
    ini = tmp_path / "moses.ini"
    ini.write_text(INI)
    return p.parse_args(["--moses-root", str(tmp_path / "moses"), "--ini", str(ini), "--kenlm", "lm.bin",
                         "--model", str(golden_model(tmp_path / "nce.nlm")), "--dev-src", "s", "--dev-ref", "r",
                         "--test-src", "t", "--test-ref", "u", "--workdir", str(tmp_path / "work"), *extra])


def test_the_systems_are_kenlm_alone_then_one_per_model(tmp_path: Path) -> None:
    a, b = golden_model(tmp_path / "a.nlm"), golden_model(tmp_path / "b.nlm")
    systems = moses_experiment.parse_models([str(a), f"news={b}"])
    assert [(s.name, s.model) for s in systems] == [("moses", None), ("a", str(a)), ("news", str(b))]
    with pytest.raises(InputError, match="a name of its own"):
        moses_experiment.parse_models([str(a), f"a={b}"])
    with pytest.raises(InputError, match="a name of its own"):
        moses_experiment.parse_models([f"moses={a}"])
    with pytest.raises(InputError, match="no such file"):
        moses_experiment.parse_models([str(tmp_path / "missing.nlm")])


def test_a_workdir_tuned_with_one_tuner_is_refused_for_the_other(tmp_path: Path) -> None:
    # mert-moses.pl's file names after a first iteration: MERT's, then batch MIRA's
    work = tmp_path / "seed1" / "tune"
    assert moses_experiment.tuned_with(work) is None
    work.mkdir(parents=True)
    (work / "run1.mert.out").write_text("0.1 0.2\n")
    assert moses_experiment.tuned_with(work) == "mert"
    (work / "run1.mira.out").write_text("")
    assert moses_experiment.tuned_with(work) == "mira"
    args = _args(tmp_path, "--tuner", "mert")
    with pytest.raises(InputError, match="tuned with mira, not mert: give --tuner mira, or another --workdir"):
        moses_experiment.tune(args, None, "moses", 1, tmp_path, tmp_path / "s", tmp_path / "r", tmp_path / "seed1",
                              "moses")


def test_a_tuning_stopped_inside_its_first_iteration_starts_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # mert-moses.pl --continue dies without finished_step.txt (written after each finished
    # iteration): a working folder without it is started afresh, one with it is continued.
    script = tmp_path / "moses" / "scripts" / "training" / "mert-moses.pl"
    script.parent.mkdir(parents=True)
    script.write_text('open(my $f, ">>", "$ENV{CALLS}"); print $f join(" ", @ARGV), "\\n"; exit 3;\n')
    args = _args(tmp_path, "--nlm-weight", "0.2")
    base = tmp_path / "kenlm" / "seed1"
    work = base / "tune"
    work.mkdir(parents=True)
    (work / "run1.out").write_text("half an iteration\n")
    (base / "tune.started").write_text("12.000\n")
    calls = tmp_path / "calls"
    monkeypatch.setenv("CALLS", str(calls))
    feature = "NeuralLMServer name=NLM0 factor=0 order=3 path=127.0.0.1:9 normalized=false scoring=local"

    def tune() -> None:
        with pytest.raises(InputError, match=r"mert-moses.pl failed \(3\) for kenlm seed 1"):
            moses_experiment.tune(args, feature, "moses", 1, tmp_path, tmp_path / "s", tmp_path / "r", base, "kenlm")

    tune()
    assert "--continue" not in calls.read_text().split() and not work.exists()
    assert float((base / "tune.started").read_text()) != 12.0  # the clock starts again
    first = calls.read_text().split()
    assert first[first.index("--mertargs") + 1:first.index("--mertargs") + 3] == ["-r", "1"]
    # the ini it started from: LM_PATH replaced, the feature after KENLM, its weight last
    assert (base / "start.ini").read_text() == (
        f"[feature]\nKENLM name=LM0 factor=0 path={Path('lm.bin').resolve()} order=5\n{feature}\n\n"
        "[weight]\nLM0= 0.5\nNLM0= 0.2\n")
    work.mkdir()
    (work / "finished_step.txt").write_text("1\n")
    tune()
    assert calls.read_text().splitlines()[1].split()[-1] == "--continue"
    assert (work / "finished_step.txt").exists()


def test_the_table() -> None:
    run = {"iterations": 7, "tuning_wall_s": 300.5, "test_decode_s": 20.1}
    result = {"tuner": "mert", "max_iterations": 10, "dev_lines": 300, "test_lines": 300, "seeds": [1],
              "rows": [{"system": "moses", "line": None, "bleu": [20.0], "mean": 20.0, "sd": None,
                        "signature": "nrefs:1|case:mixed", "runs": [run]},
                       {"system": "demo", "line": "NeuralLMServer name=NLM0 order=5", "bleu": [20.5], "mean": 20.5,
                        "sd": None, "delta": 0.5, "p": 0.012, "signature": "nrefs:1|case:mixed", "runs": [run]}]}
    text = moses_experiment.render(result)
    assert "| moses | 20.00 | 20.00 |  | 7 | 300.5 | 20.1 |" in text
    assert "| demo | 20.50 | 20.50 | +0.50, p 0.012 | 7 | 300.5 | 20.1 |" in text
    assert text.startswith("MERT inside Moses (mert-moses.pl, at most 10 iterations) on 300 dev sentences, 300 test")
    assert text.splitlines()[-1] == "`demo`: `NeuralLMServer name=NLM0 order=5`"


def test_the_command_is_installed_and_refuses_a_missing_moses(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.common.cli import main

    ini = tmp_path / "moses.ini"
    ini.write_text(INI)
    model = golden_model(tmp_path / "nce.nlm")
    (tmp_path / "no-moses").mkdir()  # a folder without a Moses build: refused before any input is read
    code = main(["moses-experiment", "--moses-root", str(tmp_path / "no-moses"), "--ini", str(ini),
                 "--model", str(model), "--dev-src", "s", "--dev-ref", "r", "--test-src", "t", "--test-ref", "u",
                 "--workdir", str(tmp_path / "work")])
    assert code != 0 and "no moses binary under" in capsys.readouterr().err


def test_the_page_holds_the_recorded_run() -> None:
    """docs/performance-decoder.md's table of the run on the shipped system is what render gives of
    bench/results/moses-experiment.json."""
    import json

    from support import REPO

    result = json.loads((REPO / "bench" / "results" / "moses-experiment.json").read_text(encoding="utf-8"))
    assert moses_experiment.render(result) in (REPO / "docs" / "performance-decoder.md").read_text(encoding="utf-8")
