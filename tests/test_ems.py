"""moses_plugin/ems: the section an EMS user pastes (nlmserve-lm.ems), its ``custom-training``
wrapper (train-nlm.py) and the example experiment on the shipped system (config.shipped-fr-en).

The wrapper runs as EMS runs it, ``train-nlm.py ... -text IN -lm OUT``: with a stand-in
nlmserve program that records its calls, and once with the real one on a tiny model. The
configs are planned by Moses' own experiment.perl: its dry run (no ``-exec``) prints the steps
it would run and writes their scripts, running none. That needs perl and a Moses checkout with
scripts/ems, ``$NLMSERVE_MOSES_ROOT`` (mosesdecoder @ 34452895: docs/ems.md); skipped when it
is unset (CI has none). The shipped-system test also needs ../shared/data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nlmserve.moses_plugin.moses_ini import ModelFacts, feature_line, start_weight, tuneable_l1_norm

REPO = Path(__file__).resolve().parent.parent
EMS = REPO / "moses_plugin" / "ems"
WRAPPER = EMS / "train-nlm.py"
FRAGMENT = EMS / "nlmserve-lm.ems"
EXAMPLE = EMS / "config.shipped-fr-en"
DATA = REPO.parent / "shared" / "data"
TINY_TEXT = REPO / "data" / "lm" / "europarl.dev.1k.lc-moses.en"

#: What experiment.perl's check_if_crashed looks for in a step's stderr (case-insensitive):
#: any of them marks the step crashed, so a finished training must print none.
EMS_ERROR_WORDS = ("error", "killed", "core dumped", "can't read", "no such file or directory",
                   "unknown option", "died at", "exit code", "permission denied", "segmentation fault",
                   "abort", "no space left on device", ": not found", "can't locate", "unrecognized option",
                   "exception")

#: A stand-in nlmserve: appends its arguments to $FAKE_CALLS, writes a log line with words EMS
#: would take for a crash, fails with status 3 as the command $FAKE_FAIL, else writes the file
#: it is asked for.
FAKE = """\
import json, os, sys
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.stderr.write("INFO a log line EMS must not see: Exception, error, killed\\n")
command, args = sys.argv[1], sys.argv[2:]
if command == os.environ.get("FAKE_FAIL"):
    sys.stderr.write("Traceback (most recent call last):\\nRuntimeError: the model diverged\\n")
    sys.exit(3)
if command in ("train", "export-tables"):
    open(args[args.index("--out") + 1], "w").write(command)
if command == "train":
    print("model\\t" + args[args.index("--out") + 1])
if command == "moses-ini":
    print("[feature]\\nNeuralLMServer name=NLM0 factor=0 order=5 normalized=false tables=" + args[-1])
"""


def read_ems(text: str) -> dict[str, dict[str, str]]:
    """An EMS config as experiment.perl's read_config reads it: ``#`` to the end of a line
    dropped, ``[SECTION]`` lines, ``name = value`` lines, one pair of quotes around a value
    taken off."""
    sections: dict[str, dict[str, str]] = {"GENERAL": {}}
    section = "GENERAL"
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        m = re.match(r"^\[(.+)\]", line)
        if m:
            section = m.group(1)
            sections.setdefault(section, {})
            continue
        m = re.match(r"^(\S+) = (.+)$", line)
        assert m, f"a line experiment.perl would call buggy: {raw!r}"
        sections[section][m.group(1)] = re.sub(r'^"(.*)"$', r"\1", m.group(2).strip())
    return sections


def with_values(text: str, values: dict[str, str | Path]) -> str:
    """The config with the placeholder (``/path/to...``) of each named value set."""
    for name, value in values.items():
        text, n = re.subn(rf"^{re.escape(name)} = /path/to\S*$", f"{name} = {value}", text, flags=re.M)
        assert n == 1, f"one placeholder line for {name} expected, found {n}"
    return text


def wrapper(args: list[str], tmp_path: Path, program: Path,
            fail: str | None = None) -> subprocess.CompletedProcess[str]:
    """train-nlm.py as EMS's train-custom step runs it, with ``program`` as nlmserve."""
    env = {**os.environ, "FAKE_CALLS": str(tmp_path / "calls"), "FAKE_FAIL": fail or ""}
    return subprocess.run([sys.executable, str(WRAPPER), "--nlmserve", str(program), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def fake_nlmserve(tmp_path: Path) -> Path:
    program = tmp_path / "nlmserve"
    program.write_text(f"#!{sys.executable}\n{FAKE}")
    program.chmod(0o755)
    return program


def real_nlmserve(tmp_path: Path) -> Path:
    """A program that runs this interpreter's nlmserve, as an installed ``nlmserve`` does."""
    program = tmp_path / "nlmserve-real"
    program.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m nlmserve "$@"\n')
    program.chmod(0o755)
    return program


def calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ems_words(text: str) -> list[str]:
    return [w for w in EMS_ERROR_WORDS if w in text.lower()]


def test_the_wrapper_trains_exports_and_links_the_steps_output_to_the_tables_file(tmp_path: Path) -> None:
    program = fake_nlmserve(tmp_path)
    folder, out = tmp_path / "lm" / "nlm.1", tmp_path / "lm" / "nlm.custom-lm.1"
    done = wrapper(["--dir", str(folder), "--order", "5", "--valid", "dev.en", "--quantize", "int8",
                    "-text", "corpus.en", "-lm", str(out)], tmp_path, program)
    assert done.returncode == 0, done.stderr
    assert calls(tmp_path) == [
        ["train", "--train", "corpus.en", "--out", str(folder / "model.nlm"), "--order", "5", "--valid", "dev.en"],
        ["export-tables", "--model", str(folder / "model.nlm"), "--out", str(folder / "model.nlt"),
         "--quantize", "int8"],
        ["moses-ini", "--tables", str(folder / "model.nlt")]]
    assert out.is_symlink() and out.resolve() == folder / "model.nlt"
    assert f"model\t{folder / 'model.nlm'}" in done.stdout  # nlmserve's results, kept in the step's .STDOUT
    assert "RuntimeError" not in done.stderr and not ems_words(done.stderr), done.stderr
    assert "Exception" in (folder / "train.log").read_text()  # nlmserve's log lines went to the log
    assert f"tables={folder / 'model.nlt'}" in (folder / "moses-ini.txt").read_text()


def test_a_failed_command_is_a_line_ems_takes_for_a_crash_and_its_exit_status(tmp_path: Path) -> None:
    program = fake_nlmserve(tmp_path)
    out = tmp_path / "nlm.custom-lm.1"
    done = wrapper(["--dir", str(tmp_path / "nlm.1"), "-text", "corpus.en", "-lm", str(out)], tmp_path, program,
                   fail="export-tables")
    assert done.returncode == 3
    errors = [x for x in done.stderr.splitlines() if x.startswith("ERROR:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("ERROR: train-nlm.py: nlmserve export-tables failed with exit status 3; its log, ")
    assert "RuntimeError: the model diverged" in done.stderr
    assert [c[0] for c in calls(tmp_path)] == ["train", "export-tables"]
    assert not out.exists()


def test_flags_the_wrapper_sets_and_a_missing_program_are_refused(tmp_path: Path) -> None:
    program = fake_nlmserve(tmp_path)
    done = wrapper(["--dir", "d", "--out", "elsewhere.nlm", "-text", "corpus.en", "-lm", "out"], tmp_path, program)
    assert done.returncode == 2 and "--out: set by this script" in done.stderr and ems_words(done.stderr)
    assert calls(tmp_path) == []
    done = wrapper(["--dir", str(tmp_path / "d"), "-text", "corpus.en", "-lm", "out"], tmp_path,
                   tmp_path / "no-such-program")
    assert done.returncode == 127
    assert done.stderr.startswith("ERROR: train-nlm.py: cannot run ") and "--nlmserve" in done.stderr


def test_the_sections_feature_line_is_the_one_moses_ini_derives_for_a_class_model() -> None:
    section = read_ems(FRAGMENT.read_text())["LM:nlm"]
    facts = ModelFacts(order=5, output="class", objective="nce", self_normalized=True, tables_missing=None,
                       model_hash="0" * 64)
    line = section["config-feature-line"].replace("$order", "5").replace(
        "$working-dir/lm/nlm.$nlm-run/model.nlt", "/w/lm/nlm.1/model.nlt")
    assert line == feature_line(facts, None, extra={"tables": "/w/lm/nlm.1/model.nlt"})


def test_the_example_configs_section_is_the_one_to_paste() -> None:
    pasted = read_ems(FRAGMENT.read_text())["LM:nlm"]
    example = read_ems(EXAMPLE.read_text())["LM:nlm"]
    placeholders = {k for k, v in pasted.items() if v.startswith("/path/to")}
    assert placeholders == {"nlmserve-program", "nlmserve-ems", "raw-corpus"}
    assert set(example) == set(pasted)
    assert {k: v for k, v in example.items() if k not in placeholders | {"custom-training"}} == \
           {k: v for k, v in pasted.items() if k not in placeholders | {"custom-training"}}
    assert example["custom-training"].startswith(pasted["custom-training"] + " ")  # the system's flags added


def test_the_real_nlmserve_trains_a_model_whose_line_is_the_sections(tmp_path: Path) -> None:
    program = real_nlmserve(tmp_path)
    text = tmp_path / "text.en"
    text.write_text("".join(TINY_TEXT.read_text(encoding="utf-8").splitlines(keepends=True)[:300]), encoding="utf-8")
    work = tmp_path / "work"
    folder, out = work / "lm" / "nlm.1", work / "lm" / "nlm.custom-lm.1"
    folder.parent.mkdir(parents=True)
    done = wrapper(["--dir", str(folder), "--order", "5", "--recipe", "none", "--dim", "8", "--max-steps", "5",
                    "--threads", "1", "--no-progress", "-text", str(text), "-lm", str(out)], tmp_path, program)
    assert done.returncode == 0, done.stderr
    assert not ems_words(done.stderr), done.stderr
    assert out.resolve() == folder / "model.nlt"
    printed = [x for x in (folder / "moses-ini.txt").read_text().splitlines() if x.startswith("NeuralLMServer ")]
    section = read_ems(FRAGMENT.read_text())["LM:nlm"]
    expected = section["config-feature-line"].replace("$order", "5").replace("$working-dir", str(work)).replace(
        "$nlm-run", section["nlm-run"])
    assert printed == [expected]


# experiment.perl's dry run


def moses_root() -> Path:
    given = os.environ.get("NLMSERVE_MOSES_ROOT")
    if not given:
        pytest.skip("no Moses checkout: set NLMSERVE_MOSES_ROOT to one with scripts/ems "
                    "(mosesdecoder @ 34452895, docs/ems.md)")
    root = Path(given)
    if not (root / "scripts" / "ems" / "experiment.perl").is_file():
        pytest.fail(f"NLMSERVE_MOSES_ROOT={given} has no scripts/ems/experiment.perl")
    if shutil.which("perl") is None:
        pytest.skip("no perl")
    return root


def bin_dir(root: Path, tmp_path: Path) -> Path:
    """The tree's bin/ when it holds moses, else a folder of empty stand-ins: the dry run checks
    that the programs a config names exist, and runs none."""
    if (root / "bin" / "moses").exists():
        return root / "bin"
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    for name in ("moses", "build_binary", "lmplz"):
        (stand_in / name).touch()
    return stand_in


def dry_run(root: Path, config: str, work: Path) -> tuple[list[str], Path]:
    """experiment.perl without -exec on ``config`` (its working-dir ``work``) → the steps it
    would run and the folder of their scripts."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "config").write_text(config)
    done = subprocess.run(["perl", str(root / "scripts" / "ems" / "experiment.perl"), "-config", str(work / "config"),
                           "-no-graph"], cwd=work, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(r"^\d+ (\S+) ->\s*run$", done.stdout, re.M)
    assert steps, done.stdout
    return steps, work / "steps" / "0"


def step(folder: Path, name: str) -> str:
    """The command lines of a planned step's script."""
    text = (folder / (name.replace(":", "_") + ".0")).read_text()
    return "\n".join(x for x in text.splitlines() if not x.startswith(("PATH=", "#!", "echo ", "touch ")))


def feature_lines(ini: str) -> list[str]:
    section = ini.split("[feature]", 1)[1].split("\n\n", 1)[0]
    return sorted(" ".join(x.split()) for x in section.splitlines() if x.strip() and not x.startswith("#"))


def test_ems_plans_the_shipped_system_with_its_tables_its_kenlm_and_the_nlm(tmp_path: Path) -> None:
    root = moses_root()
    system, newstest = DATA / "moses-fr-en", DATA / "nbest" / "newstest-fr-en"
    if not (system / "moses.ini").is_file() or not (newstest / "newstest2013.src").is_file():
        pytest.skip(f"no shipped system: {system} or {newstest} is missing")
    sets, work, kenlm = tmp_path / "sets", tmp_path / "ems", tmp_path / "lm.bin"
    sets.mkdir()
    kenlm.touch()  # planned, not read
    for name, src, every in (("dev", "newstest2012", 3), ("test", "newstest2013", 1)):  # as docs/ems.md makes them
        for ext, side in (("fr", "src"), ("en", "ref")):
            lines = (newstest / f"{src}.{side}").read_text(encoding="utf-8").splitlines(keepends=True)
            (sets / f"{name}.{ext}").write_text("".join(lines[::every][:300]), encoding="utf-8")
    program = real_nlmserve(tmp_path)
    config = with_values(EXAMPLE.read_text(), {
        "moses-src-dir": root, "nlmserve-program": program, "nlmserve-ems": EMS, "data": DATA, "kenlm": kenlm,
        "sets": sets, "working-dir": work})
    config = re.sub(r"^moses-bin-dir = .*$", f"moses-bin-dir = {bin_dir(root, tmp_path)}", config, flags=re.M)
    planned, folder = dry_run(root, config, work)

    assert {"LM:nlm:train-custom", "TRAINING:create-config", "TUNING:tune", "EVALUATION:newstest2013:decode",
            "EVALUATION:newstest2013:multi-bleu", "REPORTING:report"} <= set(planned)
    trained = [s for s in planned if s.startswith(("CORPUS:", "TRAINING:", "LM:europarl:"))]
    assert trained == ["TRAINING:create-config"], "the tables and the KenLM are reused, not built"
    assert "LM:nlm:binarize" not in planned
    assert (f"{EMS}/train-nlm.py --nlmserve {program} --dir {work}/lm/nlm.1 --order 10 --max-minutes 60 --lowercase "
            f"--valid {DATA}/lm/europarl.dev.lc-moses.en -text {DATA}/lm/europarl.train.lc-moses.en.xz "
            f"-lm {work}/lm/nlm.custom-lm.0") in step(folder, "LM:nlm:train-custom")
    create = step(folder, "TRAINING:create-config")
    for part in (f"-phrase-translation-table {system}/phrase-table.gz ",
                 f"-reordering-table {system}/reordering-table ", f"-lm 0:5:{kenlm}:8 ",
                 f'-config-add-feature-lines "NeuralLMServer name=NLM0 factor=0 order=10 normalized=false '
                 f'tables={work}/lm/nlm.1/model.nlt;" ', '-config-add-weight-lines "NLM0= 0.46;"'):
        assert part in create, f"{part!r} not in {create}"
    assert f"mert-moses.pl {sets}/dev.fr {sets}/dev.en " in step(folder, "TUNING:tune")
    assert f"< {sets}/test.fr > " in step(folder, "EVALUATION:newstest2013:decode")

    # the step that writes model/moses.ini (train-model.perl's step 9: it reads no table) run as planned
    done = subprocess.run(["bash", str(folder / "TRAINING_create-config.0")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    ini = (work / "model" / "moses.ini.0").read_text()
    shipped = (system / "moses.ini").read_text().replace("path=phrase-table.gz", f"path={system}/phrase-table.gz") \
        .replace("path=reordering-table", f"path={system}/reordering-table").replace("LM_PATH", str(kenlm))
    nlm = f"NeuralLMServer name=NLM0 factor=0 order=10 normalized=false tables={work}/lm/nlm.1/model.nlt"
    assert feature_lines(ini) == sorted(feature_lines(shipped) + [nlm]), "the shipped system's features, and NLM0"
    assert "[distortion-limit]\n6\n" in ini and "[distortion-limit]\n6\n" in shipped
    others = "\n".join(x for x in ini.splitlines() if not x.startswith(("NLM0=", "NeuralLMServer ")))
    weight = float(read_ems(FRAGMENT.read_text())["LM:nlm"]["config-weight-line"].split("=")[1])
    assert weight == round(start_weight(tuneable_l1_norm(others)), 6)


def test_the_section_pasted_into_moses_own_toy_config_trains_the_nlm_and_is_not_binarized(tmp_path: Path) -> None:
    root = moses_root()
    toy = (root / "scripts" / "ems" / "example" / "config.toy").read_text()
    work = tmp_path / "ems"
    binaries = bin_dir(root, tmp_path)
    # the tree's paths; the tools of config.toy that a Moses build does not make, which it names
    # but no active setting uses, left out
    toy = re.sub(r"^(srilm-dir|irstlm-dir|randlm-dir|ttable-binarizer) = .*\n", "", toy, flags=re.M)
    for name, value in (("moses-src-dir", root), ("working-dir", work), ("external-bin-dir", binaries),
                        ("moses-bin-dir", binaries)):
        toy, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", toy, count=1, flags=re.M)
        assert n == 1, name
    section = with_values(FRAGMENT.read_text(), {
        "nlmserve-program": real_nlmserve(tmp_path), "nlmserve-ems": EMS, "raw-corpus": "x"})
    section = section.replace("raw-corpus = x", "raw-corpus = $toy-data/nc-5k.$output-extension")
    planned, folder = dry_run(root, toy + "\n" + section, work)

    assert {"LM:nlm:train-custom", "LM:toy:train", "LM:toy:binarize", "TRAINING:create-config"} <= set(planned)
    assert "LM:nlm:binarize" not in planned, "build_binary would run on the tables file"
    train = step(folder, "LM:nlm:train-custom")
    assert re.search(rf"-text {work}/lm/nlm\.\S+ -lm {work}/lm/nlm\.custom-lm\.0$", train, re.M), train
    assert (f'-config-add-feature-lines "NeuralLMServer name=NLM0 factor=0 order=10 normalized=false '
            f'tables={work}/lm/nlm.1/model.nlt;"') in step(folder, "TRAINING:create-config")
