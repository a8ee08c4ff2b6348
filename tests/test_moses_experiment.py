"""``nlmserve moses-experiment`` without a Moses build: the systems it makes of ``--model``,
mert-moses.pl's working folder (which tuner, continue or start again) driven through a
stand-in script that records how it was called, the moses.ini each system starts from, and
the table of a hand-made result. The whole path with a real Moses is in docs/performance-decoder.md."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nlmserve.common.errors import InputError
from nlmserve.pipeline import moses_experiment
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
    from nlmserve.cli import main

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


def _fake_moses(path: Path, pause: float) -> Path:
    """A stand-in decoder: copies its input to its output, one line every ``pause`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nwhile IFS= read -r line; do printf '%s\\n' \"$line\"; sleep {pause}; done\n")
    path.chmod(0o755)
    return path


def test_decoding_says_how_far_it_got_and_when_it_reuses_a_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(moses_experiment, "PROGRESS_EVERY_S", 0.05)
    moses = _fake_moses(tmp_path / "moses", 0.1)
    src = tmp_path / "test.src"
    src.write_text("".join(f"sentence {i}\n" for i in range(6)))
    out = tmp_path / "test.out"
    caplog.set_level("INFO", logger=moses_experiment.__name__)
    moses_experiment.decode_test(str(moses), 1, tmp_path / "ini", src, out, 6, "nlm seed 1: ")
    assert out.read_text() == src.read_text()
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("nlm seed 1: decoding 6 test sentences (log: ")
    progress = [m for m in said if " of 6 test sentences decoded in " in m]
    assert progress and all(m.startswith("nlm seed 1: ") for m in progress), said
    caplog.clear()
    moses_experiment.decode_test(str(moses), 1, tmp_path / "ini", src, out, 6, "nlm seed 1: ")
    assert [r.getMessage() for r in caplog.records] == [f"nlm seed 1: test set decoded before, reusing {out}"]


def test_a_watched_command_gives_its_status_wall_and_cpu_time(tmp_path: Path) -> None:
    """run_watched, which bench/decoder.py times Moses by: the exit status, the wall time of
    the command, its CPU time (a command that sleeps uses little, one that spins uses about its
    wall time) and its largest resident set (bench/targets.py's trainer memory)."""
    import sys

    out = tmp_path / "out"
    with open(out, "wb") as f:
        slept = moses_experiment.run_watched(["sh", "-c", "sleep 0.3; exit 3"], lambda: None, stdout=f)
        spun = moses_experiment.run_watched(
            [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
            lambda: None, stdout=f)
    assert slept.code == 3 and slept.wall >= 0.3 and slept.cpu < 0.2
    assert spun.code == 0 and spun.cpu >= 0.3 and spun.wall >= spun.cpu * 0.9
    # Linux counts the caller's resident set at the fork, until the exec: a floor for every
    # command. That set can shrink between two forks (a long test run gives pages back), so
    # the command holds 256 MiB more than the larger of this process now and the first fork
    resident = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
    size = max(resident, slept.maxrss) + (256 << 20)
    with open(out, "wb") as f:
        held = moses_experiment.run_watched([sys.executable, "-c", f"b = bytearray({size})"], lambda: None, stdout=f)
    assert slept.maxrss > 0
    assert held.code == 0 and held.maxrss >= size


def _finished_tuning(base: Path, dev_ref: Path, outputs: list[str]) -> None:
    """mert-moses.pl's working folder after len(outputs) iterations whose 1-best were ``outputs``."""
    work = base / "tune"
    work.mkdir(parents=True)
    for i, text in enumerate(outputs, 1):
        (work / f"run{i}.out").write_text(text)
        (work / f"run{i}.best100.out.gz").write_bytes(b"")
    (work / "moses.ini").write_text("[weight]\nLM0= 0.5\n")
    (base / "tune.started").write_text("12.000\n")


def test_a_finished_tuning_is_reused_with_its_dev_bleu_per_iteration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    dev_ref = tmp_path / "dev.ref"
    dev_ref.write_text("the cat sat on the mat\na dog ran in the park\n")
    worse = "the cat sat on a hat\na dog ran in a field\n"
    base = tmp_path / "nlm" / "seed1"
    _finished_tuning(base, dev_ref, [worse, dev_ref.read_text()])
    monkeypatch.setattr(moses_experiment.subprocess, "Popen", None)  # nothing is run
    caplog.set_level("INFO", logger=moses_experiment.__name__)
    args = _args(tmp_path, "--max-iterations", "2")
    record = moses_experiment.tune(args, None, "moses", 1, tmp_path, tmp_path / "s", dev_ref, base, "nlm")
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"nlm seed 1: tuned before, reusing {base / 'tune' / 'moses.ini'}"
    assert record["iterations"] == 2 and record["dev_bleu"][1] == 100.0 and record["dev_bleu"][0] < 100.0
    assert said[1].startswith("nlm seed 1: stopped at --max-iterations 2 while its dev BLEU still rose (")
    assert moses_experiment.still_rising(record, 2) and not moses_experiment.still_rising(record, 3)


def test_the_table_says_when_a_tuning_stopped_at_the_cap_while_dev_bleu_rose() -> None:
    capped = {"seed": 1, "iterations": 10, "tuning_wall_s": 1.0, "test_decode_s": 2.0, "dev_bleu": [19.5, 19.8]}
    flat = {"seed": 2, "iterations": 10, "tuning_wall_s": 1.0, "test_decode_s": 2.0, "dev_bleu": [19.8, 19.8]}
    short = {"seed": 1, "iterations": 6, "tuning_wall_s": 1.0, "test_decode_s": 2.0, "dev_bleu": [19.0, 19.2]}
    line = "NeuralLMServer name=NLM0 factor=0 order=5 normalized=false tables=/abs/model.nlt"
    result = {"tuner": "mert", "max_iterations": 10, "dev_lines": 3, "test_lines": 3, "seeds": [1, 2],
              "rows": [{"system": "moses", "line": None, "bleu": [20.0], "mean": 20.0, "sd": None,
                        "signature": "s", "runs": [short]},
                       {"system": "nlm", "line": line, "bleu": [20.5, 20.4], "mean": 20.45, "sd": 0.07, "delta": 0.45,
                        "p": 0.1, "signature": "s", "runs": [capped, flat]}]}
    text = moses_experiment.render(result)
    assert "| moses | 20.00 | 20.00 |  | 6 | 1.0 | 2.0 |" in text
    assert "| nlm | 20.50, 20.40 | 20.45 ± 0.07 | +0.45, p 0.100 | 10 (cap; dev BLEU rising), 10 (cap) |" in text
    assert ("`nlm` seed 1: stopped at the cap of 10 iterations while the dev BLEU still rose (results.json has it "
            "per iteration): more iterations may move the test BLEU.") in text
    assert text.splitlines()[-1] == f"`nlm`: `{line}`"


def _fake_mert(root: Path) -> None:
    """A stand-in mert-moses.pl: one iteration whose 1-best is the dev source, and the start ini as the tuned one."""
    script = root / "scripts" / "training" / "mert-moses.pl"
    script.parent.mkdir(parents=True)
    script.write_text(
        'my %o; my @pos; while (@ARGV) { my $a = shift @ARGV; if ($a =~ /^--(working-dir|mertdir|nbest|'
        'decoder-flags|maximum-iterations|mertargs)$/) { $o{$1} = shift @ARGV } '
        'elsif ($a !~ /^--/) { push @pos, $a } }\n'
        'my $w = $o{"working-dir"}; mkdir $w;\n'
        'system("cp", $pos[0], "$w/run1.out") == 0 or die; system("touch", "$w/run1.best100.out.gz");\n'
        'system("cp", $pos[3], "$w/moses.ini") == 0 or die;\n')


@pytest.mark.parametrize("serve", [False, True])
def test_a_model_is_decoded_from_its_tables_file_unless_served(serve: bool, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The whole run with stand-ins for mert-moses.pl and moses: by default the model's tables file
    is written once and the feature line maps it (no path=, no server started); --serve serves it."""
    from nlmserve.common import serve_process

    root = tmp_path / "moses"
    _fake_moses(root / "bin" / "moses", 0)
    _fake_mert(root)
    text = tmp_path / "text"
    text.write_text("a b c\nb a c\n")
    (tmp_path / "lm.bin").write_text("kenlm\n")
    started: list[str] = []

    class Served:
        target = "127.0.0.1:7"

        def stop(self) -> None:
            started.append("stopped")

    def start_server(model: Path, extra: list[str]) -> Served:
        started.append(str(model))
        return Served()

    monkeypatch.setattr(serve_process, "start_server", start_server)
    monkeypatch.chdir(tmp_path)
    args = _args(tmp_path, "--mertdir", str(tmp_path), *(["--serve"] if serve else []))
    args.dev_src = args.dev_ref = args.test_src = args.test_ref = text
    caplog.set_level("INFO", logger=moses_experiment.__name__)
    result = moses_experiment.run(args)
    line = result["rows"][1]["line"]
    start = (tmp_path / "work" / "nce" / "seed1" / "start.ini").read_text()
    assert line in start.splitlines()
    if serve:
        assert started == [str(args.model[0]), "stopped"]
        assert line == "NeuralLMServer name=NLM0 factor=0 order=3 path=127.0.0.1:7 normalized=false scoring=local"
        return
    tables = tmp_path / "work" / "nce" / "model.nlt"
    assert not started
    assert line == f"NeuralLMServer name=NLM0 factor=0 order=3 normalized=false tables={tables}"
    assert f"`nce`: `{line}`" in (tmp_path / "work" / "results.md").read_text()
    caplog.clear()
    moses_experiment.run(args)  # a rerun keeps the file, the tuning and the decoding
    said = [r.getMessage() for r in caplog.records]
    assert f"tables of {args.model[0]} written before, reusing {tables}" in said
    assert any(m.startswith("nce seed 1: tuned before, reusing ") for m in said)


def test_tuning_says_which_iteration_it_is_in_and_the_dev_bleu_of_those_done(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(moses_experiment, "PROGRESS_EVERY_S", 0.05)
    dev_ref = tmp_path / "dev.ref"
    dev_ref.write_text("the cat sat on the mat\na dog ran in the park\n")
    script = tmp_path / "moses" / "scripts" / "training" / "mert-moses.pl"
    script.parent.mkdir(parents=True)
    # A stand-in that finishes iteration 1 (its 1-best: the reference), then takes its time.
    script.write_text(
        'my ($w) = map { $ARGV[$_ + 1] } grep { $ARGV[$_] eq "--working-dir" } 0..$#ARGV; mkdir $w;\n'
        f'system("cp", "{dev_ref}", "$w/run1.out"); system("touch", "$w/run1.best100.out.gz");\n'
        'select(undef, undef, undef, 0.6); system("cp", $ARGV[3], "$w/moses.ini");\n')
    caplog.set_level("INFO", logger=moses_experiment.__name__)
    base = tmp_path / "nlm" / "seed1"
    base.mkdir(parents=True)
    record = moses_experiment.tune(_args(tmp_path), None, "moses", 1, tmp_path, tmp_path / "s", dev_ref, base, "nlm")
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("nlm seed 1: tuning with mert, at most 25 iterations (log: ")
    assert ("nlm seed 1: tuning iteration 2 of at most 25, 0 of 2 dev sentences decoded; dev BLEU of iteration 1: "
            "100.00") in said, said
    assert record["iterations"] == 1 and record["dev_bleu"] == [100.0]
    # at the cap, mert-moses.pl optimises the last iteration: not "iteration 2 of at most 1"
    caplog.clear()
    (base / "tune").rename(base / "tune.first")
    moses_experiment.tune(_args(tmp_path, "--max-iterations", "1"), None, "moses", 1, tmp_path, tmp_path / "s",
                          dev_ref, base, "nlm")
    said = [r.getMessage() for r in caplog.records]
    assert ("nlm seed 1: tuning: all 1 iterations decoded, optimising the last one's weights and writing the "
            "tuned moses.ini; dev BLEU of iteration 1: 100.00") in said, said
    assert not any("of at most 1," in s for s in said), said
