"""experiments/moses_mert.py's parts that need no Moses: the tuned moses.ini a reader gets (paths
as placeholders, weights as tuned) and the results section it renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import golden_model

from experiments import moses_mert
from nlmserve.pipeline.moses_experiment import same_seeds

TUNED = """[feature]
PhraseDictionaryMemory name=TranslationModel0 num-features=4 path={system}/phrase-table.gz input-factor=0 output-factor=0
KENLM name=LM0 factor=0 path={kenlm} order=5
NeuralLMServer name=NLM0 factor=0 order=5 path=127.0.0.1:41234 normalized=false scoring=local

[weight]
LM0= 0.0512
NLM0= 0.0443
"""


def test_exported_ini_has_placeholders_and_the_tuned_weights(tmp_path: Path) -> None:
    system, kenlm = tmp_path / "moses-fr-en", tmp_path / "kenlm" / "ep.trie.bin"
    tuned = tmp_path / "moses.ini"
    tuned.write_text(TUNED.format(system=system, kenlm=kenlm))
    out = tmp_path / "docs" / "moses-mert" / "europarl.seed1.ini"
    moses_mert.export_ini(tuned, out, system, str(kenlm))
    text = out.read_text()
    assert "path=MOSES_FR_EN/phrase-table.gz" in text and "path=LM_PATH order=5" in text
    assert "path=127.0.0.1:50051 normalized=false scoring=local" in text
    assert "NLM0= 0.0443" in text and str(tmp_path) not in text


def test_rendered_section(tmp_path: Path) -> None:
    run = {"iterations": 7, "seconds_per_iteration": 210.5, "tuning_wall_s": 1473.4, "test_decode_s": 402.1,
           "search_errors": 0.0123}
    result = {
        "machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 0.5}, "tuner": "mert", "dev_lines": 1001,
        "test_lines": 3000, "seeds": [1],
        "rows": [{"system": "kenlm", "model": None, "options": {}, "bleu": [21.04], "mean": 21.04, "sd": None,
                  "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0", "runs": [run]},
                 {"system": "europarl", "model": "/tmp/ep5.nlm", "options": {"normalized": "false"},
                  "bleu": [21.50], "mean": 21.5, "sd": None, "delta": 0.46, "p": 0.002,
                  "runs": [{**run, "exported_ini": "moses-mert/europarl.seed1.ini"}]}],
        "command": "experiments/moses_mert.py --seeds 1"}
    doc = tmp_path / "results.md"
    doc.write_text(f"# R\n\n{moses_mert.BEGIN}\nold\n{moses_mert.END}\nafter\n")
    moses_mert.write_section(doc, moses_mert.render(result))
    text = doc.read_text()
    assert "old" not in text and text.endswith(moses_mert.END + "\nafter\n")
    assert "| kenlm | — | 21.04 | 21.04 |  | 7 | 210.5 | 1473.4 | 402.1 | 1.2% |" in text
    assert "| europarl | `ep5.nlm` `normalized=false` | 21.50 | 21.50 | +0.46, p 0.002 |" in text
    assert "[europarl.seed1.ini](moses-mert/europarl.seed1.ini)" in text
    assert "`nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`" in text
    assert "2 cores, load average 0.5 at the start." in text and "upper bounds" not in text


def test_tabulated_section_gives_no_load() -> None:
    """--finished-only starts no tuning: the load when it ran is not the tunings' load."""
    result = {
        "machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 0.5}, "tuner": "mert", "dev_lines": 1001,
        "test_lines": 3000, "seeds": [1],
        "rows": [{"system": "kenlm", "model": None, "options": {}, "bleu": [21.04], "mean": 21.04, "sd": None,
                  "signature": "nrefs:1", "runs": [{"iterations": 7, "seconds_per_iteration": 210.5,
                                                    "tuning_wall_s": 1473.4, "test_decode_s": 402.1}]}],
        "command": "experiments/moses_mert.py --seeds 1 --finished-only --json r.json", "finished_only": True}
    text = moses_mert.render(result)
    assert "load average" not in text
    assert "2 cores, the tunings' times are upper bounds (other work may have run beside them). Δ:" in text
    # The run's own record decides, not the command string it stored.
    assert "load average 0.5 at the start" in moses_mert.render({**result, "finished_only": False})


def test_a_mira_section_beside_the_mert_one(tmp_path: Path) -> None:
    run = {"iterations": 6, "seconds_per_iteration": 250.0, "tuning_wall_s": 1500.0, "test_decode_s": 400.0,
           "search_errors": 0.0}
    result = {
        "machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 0.5}, "tuner": "mira", "max_iterations": 6,
        "dev_lines": 1001, "test_lines": 3000, "seeds": [1],
        "rows": [{"system": "kenlm", "model": None, "options": {}, "bleu": [20.61], "mean": 20.61, "sd": None,
                  "signature": "nrefs:1|case:mixed|eff:no|tok:none|smooth:exp|version:2.6.0", "runs": [run]}],
        "command": "experiments/moses_mert.py --tuner mira"}
    begin, end = moses_mert.markers("mira")
    assert (begin, end) != (moses_mert.BEGIN, moses_mert.END) and moses_mert.markers("mert")[0] == moses_mert.BEGIN
    doc = tmp_path / "results.md"
    doc.write_text(f"{moses_mert.BEGIN}\nmert table\n{moses_mert.END}\n\n{begin}\nold\n{end}\n")
    moses_mert.write_section(doc, moses_mert.render(result), "mira")
    text = doc.read_text()
    assert "mert table" in text and "old" not in text
    assert "Moses' `mert-moses.pl` (mira, at most 6 iterations), 1001 dev sentences" in text
    assert "| kenlm | — | 20.61 | 20.61 |  | 6 | 250.0 | 1500.0 | 400.0 | 0.0% |" in text
    with pytest.raises(SystemExit, match="no '<!-- experiments/moses_mert.py --tuner pro: begin -->'"):
        moses_mert.write_section(doc, moses_mert.render(result), "pro")
    # a MERT run of its own (--section) goes between its own markers; the others stay
    result["tuner"], result["section"] = "mert", "ep10f"
    own = moses_mert.markers("mert", "ep10f")
    assert own == ("<!-- experiments/moses_mert.py ep10f: begin -->", "<!-- experiments/moses_mert.py ep10f: end -->")
    doc.write_text(f"{text}\n{own[0]}\nstale\n{own[1]}\n")
    moses_mert.write_section(doc, moses_mert.render(result), "mert", "ep10f")
    after = doc.read_text()
    assert after.startswith(text) and "stale" not in after and after.count("| kenlm | — | 20.61 |") == 2


def test_unfinished_seeds_are_left_out_and_paired_by_seed(tmp_path: Path) -> None:
    base = tmp_path / "europarl" / "seed2"
    assert not moses_mert.finished(base, 3)
    (base / "tune").mkdir(parents=True)
    (base / "tune" / "moses.ini").write_text("[weight]\n")
    (base / "test.out").write_text("a\nb\n")
    assert not moses_mert.finished(base, 3)  # the test set is still being decoded
    (base / "test.out").write_text("a\nb\nc\n")
    assert moses_mert.finished(base, 3)
    kenlm = [{"seed": 1, "output": "k1"}, {"seed": 2, "output": "k2"}]
    europarl = [{"seed": 2, "output": "e2"}]
    assert same_seeds(kenlm, europarl) == [(kenlm[1], europarl[0])]
    assert same_seeds(europarl, kenlm) == [(europarl[0], kenlm[1])]
    run = {"iterations": 7, "seconds_per_iteration": 210.5, "tuning_wall_s": 1473.4, "test_decode_s": 402.1,
           "search_errors": 0.0123}
    result = {
        "machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 0.5}, "tuner": "mert", "dev_lines": 1001,
        "test_lines": 3000, "seeds": [1, 2],
        "rows": [{"system": "kenlm", "model": None, "options": {}, "seeds": [1, 2], "bleu": [21.04, 21.0],
                  "mean": 21.02, "sd": 0.03, "signature": "sig", "runs": [run, {**run, "iterations": 6}]},
                 {"system": "europarl", "model": "/tmp/ep5.nlm", "options": {}, "seeds": [2], "bleu": [21.5],
                  "mean": 21.5, "sd": None, "delta": 0.48, "p": 0.002, "runs": [{**run, "iterations": 9}]}],
        "command": "experiments/moses_mert.py --finished-only", "finished_only": True}
    text = moses_mert.render(result)
    assert "| kenlm | — | 21.04, 21.00 | 21.02 ± 0.03 |  | 7, 6 |" in text
    assert "| europarl | `ep5.nlm` | —, 21.50 | 21.50 | +0.48, p 0.002 | —, 9 | —, 210.5 |" in text


def test_feature_line_takes_the_systems_own_order() -> None:
    plain = moses_mert.System.parse("ep5=/m/ep5.nlm,normalized=false,scoring=local")
    assert (moses_mert.feature_line(plain.options, "127.0.0.1:7", 5) ==
            "NeuralLMServer name=NLM0 factor=0 order=5 path=127.0.0.1:7 normalized=false scoring=local")
    ten = moses_mert.System.parse("ep10=/m/ep10.nlm,normalized=false,order=10")
    assert (moses_mert.feature_line(ten.options, "127.0.0.1:7", 5) ==
            "NeuralLMServer name=NLM0 factor=0 order=10 path=127.0.0.1:7 normalized=false")
    assert plain.moses is None and ten.moses is None


def test_a_systems_own_decoder_binary_is_not_a_feature_option() -> None:
    """``moses=PATH`` among a system's options is the binary that tunes and decodes it (another
    build of the feature), not a moses.ini option; the table names it beside the options."""
    other = moses_mert.System.parse("new=/m/ep10.nlm,normalized=false,moses=/tmp/moses-new,order=10")
    assert other.moses == "/tmp/moses-new" and other.options == {"normalized": "false", "order": "10"}
    assert (moses_mert.feature_line(other.options, "127.0.0.1:7", 5) ==
            "NeuralLMServer name=NLM0 factor=0 order=10 path=127.0.0.1:7 normalized=false")
    run = {"iterations": 3, "seconds_per_iteration": 1.0, "tuning_wall_s": 3.0, "test_decode_s": 1.0}
    result = {"machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 0.5}, "tuner": "mert", "dev_lines": 10,
              "test_lines": 10, "seeds": [1], "command": "c",
              "rows": [{"system": "new", "model": "/m/ep10.nlm", "options": other.options, "moses": other.moses,
                        "bleu": [20.0], "mean": 20.0, "sd": None, "signature": "s", "runs": [run]}]}
    assert "| new | `ep10.nlm` `normalized=false` `order=10` (decoder `/tmp/moses-new`) | 20.00 |" in moses_mert.render(result)


def test_a_model_without_scoring_tables_is_refused_before_any_tuning(tmp_path: Path) -> None:
    nce, mle = golden_model(tmp_path / "nce.nlm"), golden_model(tmp_path / "mle.nlm", objective="mle")
    ok = [moses_mert.System.parse("kenlm"), moses_mert.System.parse(f"nce={nce},normalized=false,scoring=local"),
          moses_mert.System.parse(f"mle={mle},normalized=false")]  # the server scores it: no tables needed
    moses_mert.check_local_scoring(ok)
    refused = [*ok, moses_mert.System.parse(f"late={mle},normalized=false,scoring=local")]
    with pytest.raises(SystemExit, match=r"--system late: scoring=local needs .* not self-normalised"):
        moses_mert.check_local_scoring(refused)
