"""bench/decoder.py's own logic, without a Moses binary: the moses.ini it writes for each
configuration, the counts it reads from the feature's ``-v 1`` lines, and the results-page
section it renders. (The decoding itself needs a Moses build: experiments/moses-decoder.md.)"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from support import REPO, golden_model

from bench import decoder

SHARED_INI = REPO.parent / "shared" / "data" / "moses-fr-en" / "moses.ini"

INI = """\
# a comment with path=relative.gz that stays as it is
[feature]
UnknownWordPenalty
PhraseDictionaryMemory name=TranslationModel0 num-features=4 path=phrase-table.gz input-factor=0 output-factor=0
KENLM name=LM0 factor=0 path=LM_PATH order=5

[weight]
LM0= 0.107688
TranslationModel0= 0.1 0.2 0.3 0.4
"""

# Lines as the feature prints them with -v 1 (sentence lines and the closing line at exit).
LOG = """\
Translating: le parlement
NeuralLMServer NLM0: sentence 0 took 9 round trips, 26851 n-grams sent; cache: 17498 hits, 26851 misses (39.5% hits); boundary scores: 40606 in order, 0 looked up, 0 scored alone
NeuralLMServer NLM0: sentence 1 took 16 round trips, 85272 n-grams sent; cache: 78114 hits, 85272 misses (47.8% hits); boundary scores: 135809 in order, 0 looked up, 0 scored alone
NeuralLMServer NLM0: 2 sentences, 25 round trips, 0 failed requests, 0 requests floored, 112123 n-grams sent, 95612 cache hits, 112123 misses; boundary scores: 176415 in order, 0 looked up, 0 scored alone
"""


def test_the_ini_of_each_configuration(tmp_path: Path) -> None:
    system = tmp_path / "system"
    system.mkdir()
    (system / "moses.ini").write_text(INI)
    plain, feature = tmp_path / "kenlm.ini", tmp_path / "nlm.ini"
    decoder.rewrite_ini(system / "moses.ini", "/models/lm.bin", plain, None, 0.25)
    line = "NeuralLMServer name=NLM0 factor=0 order=5 path=127.0.0.1:5 normalized=false"
    decoder.rewrite_ini(system / "moses.ini", "/models/lm.bin", feature, line, 0.25)
    want_plain = INI.replace("path=phrase-table.gz", f"path={system / 'phrase-table.gz'}") \
                    .replace("LM_PATH", "/models/lm.bin")
    assert plain.read_text() == want_plain
    lines = feature.read_text().splitlines()
    # The feature line right after KENLM, its weight at the end of [weight]; nothing else changed.
    assert lines[lines.index("KENLM name=LM0 factor=0 path=/models/lm.bin order=5") + 1] == line
    assert lines[-1] == "NLM0= 0.25"
    assert [x for x in lines if x not in (line, "NLM0= 0.25")] == want_plain.splitlines()


def test_oov_feature_gets_its_own_weight(tmp_path: Path) -> None:
    # With oov-feature=1 Moses gives the feature two scores and refuses an ini with one weight.
    ini = tmp_path / "moses.ini"
    ini.write_text(INI)
    line = "NeuralLMServer name=NLM0 factor=0 order=5 path=h:1 normalized=false oov-feature=1"
    decoder.rewrite_ini(ini, "/lm.bin", tmp_path / "out.ini", line, 0.1)
    assert (tmp_path / "out.ini").read_text().splitlines()[-1] == "NLM0= 0.1 0"
    assert decoder.weight_line("NeuralLMServer name=NLM0 oov-feature=true", 0.2) == "NLM0= 0.2 0"
    assert decoder.weight_line("NeuralLMServer name=NLM0 oov-feature=Y", 0.2) == "NLM0= 0.2 0"
    assert decoder.weight_line("NeuralLMServer name=NLM0 oov-feature=0", 0.2) == "NLM0= 0.2"
    assert decoder.weight_line("NeuralLMServer name=NLM0 xoov-feature=1", 0.2) == "NLM0= 0.2"


def test_a_configuration_names_its_model_binary_and_order() -> None:
    c = decoder.Config.parse("ep10:normalized=false,scoring=local,order=10,model=/m/ep10.nlm,moses=/b/moses")
    assert (c.name, c.model, c.moses) == ("ep10", "/m/ep10.nlm", "/b/moses")
    assert c.options == {"normalized": "false", "scoring": "local", "order": "10"}  # the feature's alone
    assert decoder.feature_line(c.options, "127.0.0.1:7", 5) == \
        "NeuralLMServer name=NLM0 factor=0 order=10 path=127.0.0.1:7 normalized=false scoring=local"
    assert decoder.feature_line({"normalized": "true"}, "h:1", 5) == \
        "NeuralLMServer name=NLM0 factor=0 order=5 path=h:1 normalized=true"
    old = decoder.Config.parse("kenlm:moses=/b/old")
    assert (old.options, old.moses, old.model) == (None, "/b/old", None)
    for bad in ("kenlm:normalized=false", "kenlm:model=/m/x.nlm"):
        with pytest.raises(SystemExit, match="KENLM alone takes no feature options"):
            decoder.Config.parse(bad)
    with pytest.raises(SystemExit, match="is not key=value"):
        decoder.Config.parse("x:scoring")


def test_a_tables_configuration_is_server_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tables=FILE without path=: no server is started for it, and its line has no path= but
    # the file's absolute path (the decoder runs in the work folder).
    (tmp_path / "system").mkdir()
    (tmp_path / "system" / "moses.ini").write_text(INI)
    monkeypatch.chdir(tmp_path)
    int8 = decoder.Config.parse("int8:normalized=false,tables=m.int8.nlt")
    kenlm = decoder.Config.parse("kenlm")
    assert not decoder.served(int8.options) and not decoder.served(kenlm.options)
    assert decoder.served({"normalized": "false", "scoring": "local"})
    started: list[Path] = []
    monkeypatch.setattr(decoder, "start_server", lambda model, args: started.append(model))
    args = decoder.argparse.Namespace(ini=tmp_path / "system" / "moses.ini", kenlm="/models/lm.bin", order=5,
                                      nlm_weight=0.25, model=None, server=None, serve_args="")
    bench = decoder.Bench(args, tmp_path / "work", [])
    (tmp_path / "work").mkdir()
    bench.start_servers([kenlm, int8])
    assert started == [] and bench.servers == {}
    lines = bench.ini_for("int8", int8.options).read_text().splitlines()
    assert f"NeuralLMServer name=NLM0 factor=0 order=5 normalized=false tables={tmp_path / 'm.int8.nlt'}" in lines


def test_an_ini_without_kenlm_is_refused(tmp_path: Path) -> None:
    ini = tmp_path / "moses.ini"
    ini.write_text(INI.replace("KENLM", "SRILM"))
    from nlmserve.common.errors import InputError

    with pytest.raises(InputError, match="no KENLM line"):
        decoder.rewrite_ini(ini, None, tmp_path / "out.ini", "NeuralLMServer name=NLM0", 0.1)


def test_the_shipped_system_ini(tmp_path: Path) -> None:
    if not SHARED_INI.is_file():
        pytest.skip(f"{SHARED_INI} absent (the Moses system of ../shared/data/moses-fr-en)")
    out = tmp_path / "nlm.ini"
    decoder.rewrite_ini(SHARED_INI, "/lm.bin", out, "NeuralLMServer name=NLM0 factor=0 order=5 path=h:1", 0.1)
    text = out.read_text()
    system = SHARED_INI.resolve().parent
    assert f"path={system / 'phrase-table.gz'}" in text
    assert f"path={system / 'reordering-table.wbe-msd-bidirectional-fe.gz'}" in text
    assert "path=/lm.bin order=5\nNeuralLMServer name=NLM0" in text and "\nNLM0= 0.1\n" in text


def test_feature_counts_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert decoder.feature_counts(log) == {"round_trips": 25, "ngrams_sent": 112123,
                                           "cache_hits": 95612, "cache_misses": 112123, "ngrams_local": None,
                                           "rows_summed": None, "nodes_computed": None, "rows_remembered": None}
    log.write_text("no feature here\n")
    assert decoder.feature_counts(log) == {"round_trips": None, "ngrams_sent": None,
                                           "cache_hits": None, "cache_misses": None, "ngrams_local": None,
                                           "rows_summed": None, "nodes_computed": None, "rows_remembered": None}
    # scoring=local: the closing line counts the n-grams scored in the decoder
    log.write_text("NeuralLMServer NLM0: 20 sentences, 0 round trips, 0 failed requests, 0 requests floored, "
                   "0 n-grams sent, 0 cache hits, 0 misses, 7783539 n-grams scored locally; boundary scores: "
                   "4836542 in order, 0 looked up, 0 scored alone\n")
    assert decoder.feature_counts(log) == {"round_trips": None, "ngrams_sent": 0, "cache_hits": 0,
                                           "cache_misses": 0, "ngrams_local": 7783539, "rows_summed": None,
                                           "nodes_computed": None, "rows_remembered": None}
    # and the position rows summed for their contexts (a real 30-sentence run of the 10-gram)
    log.write_text("NeuralLMServer NLM0: 30 sentences, 0 round trips, 0 failed requests, 0 requests floored, "
                   "0 n-grams sent, 0 cache hits, 0 misses, 13770312 n-grams scored locally (4976492 position "
                   "rows summed); boundary scores: 9082806 in order, 0 looked up, 0 scored alone\n")
    assert decoder.feature_counts(log)["rows_summed"] == 4976492
    # and with a tree output, the node dot products computed (the feature's closing line)
    log.write_text("NeuralLMServer NLM0: 30 sentences, 0 round trips, 0 failed requests, 0 requests floored, "
                   "0 n-grams sent, 0 cache hits, 0 misses, 13770312 n-grams scored locally (4976492 position "
                   "rows summed, 51000000 tree nodes computed); boundary scores: 9082806 in order, 0 looked up, "
                   "0 scored alone\n")
    counts = decoder.feature_counts(log)
    assert (counts["rows_summed"], counts["nodes_computed"]) == (4976492, 51000000)
    assert counts["rows_remembered"] is None
    # and the rows whose scores a tree's tables remembered (a real 500-sentence run of eph.nlm)
    log.write_text("NeuralLMServer NLM0: 500 sentences, 0 round trips, 0 failed requests, 0 requests floored, "
                   "0 n-grams sent, 0 cache hits, 0 misses, 216244451 n-grams scored locally (143702653 "
                   "remembered, 25772294 position rows summed, 403633508 tree nodes computed); boundary scores: "
                   "146329310 in order, 0 looked up, 0 scored alone\n")
    counts = decoder.feature_counts(log)
    assert (counts["ngrams_local"], counts["rows_remembered"], counts["rows_summed"], counts["nodes_computed"]) == (
        216244451, 143702653, 25772294, 403633508)


def test_targets_follow_the_scores_not_the_name() -> None:
    """≤ 2× for exact scores (the feature's default normalized=true, from the server or a
    tree model's tables with scoring=local), ≤ 1.5× for self-normalised ones, ≤ 1.2× for
    self-normalised ones mapped from a tables file with no server."""
    assert decoder.target_of({"normalized": "false", "scoring": "local"}) == 1.5
    assert decoder.target_of({"normalized": "false", "tables": "m.int8.nlt"}) == 1.2
    assert decoder.target_of({"tables": "tree.nlt"}) == 2.0  # exact scores: a tree's tables
    assert decoder.target_of({"scoring": "local", "model": "/m/tree.nlm"}) == 2.0
    assert decoder.target_of({"normalized": "true"}) == 2.0
    # (the n-best check decodes exact scores where such a configuration computes them)
    assert decoder.exact_config({"scoring": "local"}) and not decoder.exact_config({"normalized": "false"})
    assert not decoder.exact_config(None)  # KENLM alone
    runs = [decoder.Run("kenlm", 0, 10, 10.0, 20.0, 0.0, output_sha="a"),
            decoder.Run("ep5", 0, 10, 14.0, 30.0, 0.0, output_sha="b"),
            decoder.Run("tree", 0, 10, 19.0, 30.0, 0.0, output_sha="c")]
    configs = [decoder.Config.parse(c) for c in ("kenlm", "ep5:normalized=false,scoring=local",
                                                 "tree:scoring=local,model=/m/tree.nlm")]
    rows = decoder.summarise(runs, configs)
    assert "target" not in rows[0]
    assert (rows[1]["target"], rows[1]["met"]) == (1.5, True) and (rows[2]["target"], rows[2]["met"]) == (2.0, True)


def test_load_seconds_from_moses_log(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    # the lines of a moses -v 1 log around the end of loading (the real system, KENLM alone)
    log.write_text("Start loading text phrase table. Moses format : [0.984] seconds\n"
                   "Reading phrase-table.gz\n"
                   "Created input-output object : [2.021] seconds\n"
                   "Line 0: Initialize search took 0.000 seconds total\n")
    assert decoder.load_seconds(log) == 2.021
    log.write_text("Line 0: Search took 0.485 seconds\n")
    assert decoder.load_seconds(log) is None


def test_summary_ratios_and_rendered_section(tmp_path: Path) -> None:
    configs = [decoder.Config.parse(c) for c in ("kenlm", "exact:normalized=true")]
    assert configs[1].options == {"normalized": "true"}
    runs = [decoder.Run("kenlm", 0, 10, 10.0, 20.0, 0.0, output_sha="a"),
            decoder.Run("exact", 0, 10, 25.0, 30.0, 10.0, 200, 1000, 600, 400, "b"),
            decoder.Run("kenlm", 1, 10, 12.0, 22.0, 0.0, output_sha="a"),
            decoder.Run("exact", 1, 10, 23.0, 32.0, 12.0, 200, 1000, 600, 400, "c", load_s=7.5)]
    rows = decoder.summarise(runs, configs)
    # Medians: KENLM 11 s wall, 21 s CPU; the feature 24 s wall and, decoder + server, (40 + 44) / 2 = 42 s CPU.
    assert rows[0]["wall_ratio"] == 1.0
    assert rows[0]["load_s"] is None and rows[1]["load_s"] == 7.5  # the rounds that logged it
    assert rows[1]["wall_s"] == 24.0 and rows[1]["wall_ratio"] == round(24 / 11, 2)
    assert rows[1]["cpu_ratio"] == 2.0
    assert rows[1]["round_trips_per_sentence"] == 20.0 and rows[1]["ngrams_sent_per_sentence"] == 100
    assert rows[1]["cache_hit_rate"] == 0.6
    assert rows[1]["target"] == 2.0 and rows[1]["met"] is False
    assert rows[0]["same_output_every_round"] and not rows[1]["same_output_every_round"]
    # scoring=local: n-grams scored in the decoder, and which configurations translated alike
    local = decoder.Config.parse("local:normalized=false,scoring=local")
    assert local.options == {"normalized": "false", "scoring": "local"}
    both = runs + [decoder.Run("local", r, 10, 12.0, 24.0, 0.0, None, 0, 0, 0, sha, ngrams_local=5000,
                               rows_summed=summed, rows_remembered=kept)
                   for r, sha, summed, kept in ((0, "b", 1000, 2000), (1, "b", 2000, 3000))]
    extra = decoder.summarise(both, configs + [local])
    assert extra[2]["ngrams_local_per_sentence"] == 500 and "cache_hit_rate" not in extra[2]
    assert extra[2]["rows_summed_per_ngram"] == 0.3  # the median of 0.2 and 0.4
    assert extra[2]["remembered_share"] == 0.5  # the median of 0.4 and 0.6
    assert decoder.local_cell(extra[2]) == "500 (50.0% remembered, 0.3 position rows summed each)"
    plain = {k: v for k, v in extra[2].items() if k != "remembered_share"}
    assert decoder.local_cell(plain) == "500 (0.3 position rows summed each)"
    assert decoder.local_cell({**plain, "nodes_per_ngram": 4.5}) == (
        "500 (0.3 position rows summed, 4.5 tree nodes each)")
    assert extra[2]["same_output_as"] == ["exact"] and extra[1]["same_output_as"] == ["local"]
    assert extra[2]["target"] == 1.5 and extra[2]["met"] is True  # 12 s against 11 s
    result = {"machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 1.0}, "lines": 10, "input": "/x/test.src",
              "threads": 2, "rounds": 2, "serve_args": "", "nlm_weight": 0.1, "rows": rows,
              "prefetch_check": {"exact/identical": True}, "prefetch_lines": 2,
              "nbest_check": {"lines": 3, "hypotheses": 30, "max_abs_diff": 0.0005, "mean_abs_diff": 0.0002},
              "command": "bench/decoder.py --lines 10"}
    doc = tmp_path / "results.md"
    doc.write_text(f"# Results\n\n{decoder.BEGIN}\nold\n{decoder.END}\n\nafter\n")
    decoder.write_section(doc, decoder.render(result))
    text = doc.read_text()
    assert text.startswith("# Results\n\n" + decoder.BEGIN) and text.endswith(decoder.END + "\n\nafter\n")
    assert "old" not in text
    assert "| + NLM0 `normalized=true` | 25.0, 23.0 | 24.0 | 2.18 | 7.5 | 31.0 |" in text
    # a configuration with its own model and binary says so in its row
    own = decoder.Config.parse("exact:normalized=true,model=/m/ep5x.nlm,moses=/b/moses-old")
    result["rows"] = decoder.summarise(runs, [configs[0], own])
    assert result["rows"][1]["model"] == "/m/ep5x.nlm" and "moses" not in result["rows"][0]
    assert "| + NLM0 `normalized=true` (model `ep5x.nlm`) (moses `moses-old`) | 25.0, 23.0 |" in decoder.render(result)
    # a binary inside a Moses tree is named by the tree's folder, which tells two builds apart
    assert decoder.shown("/tmp/moses-main/moses-cmd/bin/gcc-12/release/link-static/threading-multi/moses") == (
        "moses-main")
    assert decoder.shown("/tmp/moses-est") == "moses-est" and decoder.shown("/m/ep5x.nlm") == "ep5x.nlm"
    # a run of its own goes between its section's markers, and the main table stays
    result["section"] = "features"
    begin, end = decoder.markers("features")
    assert begin == "<!-- bench/decoder.py features: begin -->"
    doc.write_text(f"{text}\n{begin}\nstale section\n{end}\n")
    decoder.write_section(doc, decoder.render(result), "features")
    two = doc.read_text()
    assert two.startswith(text) and "stale section" not in two and two.count("(model `ep5x.nlm`)") == 1
    assert two.rstrip().endswith(end)
    # --render puts an earlier run's JSON into the section --section names
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({**result, "section": None, "command": "bench/decoder.py --lines 20"}))
    assert decoder.main(["--render", str(saved), "--doc", str(doc), "--section", "features"]) == 0
    three = doc.read_text()
    assert three.startswith(text) and "    python -m bench.decoder --lines 20\n\n" + end in three
    assert "≤ 2.0×: **not met**" in text and "no for exact." in text
    assert "exact: identical output" in text and "largest difference 0.0005" in text
    assert "NLM0 in Moses' 10-best lists of the first 3 sentences" in text
    result["nbest_check"]["model"] = "/m/ep10f.nlm"  # the model the check scored with is named
    assert "NLM0 (`ep10f.nlm`) in Moses' 10-best lists" in decoder.render(result)
    assert "    python -m bench.decoder --lines 10" in text


def test_local_scoring_of_a_model_without_tables_is_refused_before_any_round(tmp_path: Path) -> None:
    mle = golden_model(tmp_path / "mle.nlm", objective="mle")  # not self-normalised: no scoring tables
    work = tmp_path / "work"
    argv = ["--moses", sys.executable, "--ini", str(tmp_path / "moses.ini"), "--model", str(mle),
            "--input", str(tmp_path / "in.txt"), "--workdir", str(work)]
    with pytest.raises(SystemExit, match=r"--configs local: scoring=local needs .* not self-normalised"):
        decoder.main([*argv, "--configs", "kenlm", "selfnorm:normalized=false", "local:normalized=false,scoring=local"])
    # ... and so is a configuration's own model=, named with the configurations that ask
    own = [a for a in argv if a not in ("--model", str(mle))]
    with pytest.raises(SystemExit, match=r"--configs a b: scoring=local needs .* not self-normalised"):
        decoder.main([*own, "--configs", "kenlm", f"a:scoring=local,model={mle}", f"b:scoring=local,model={mle}"])
    assert not work.exists()  # nothing started


def test_the_nbest_check_needs_a_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --server alone gives no file to score the n-best lists with: refused before anything runs
    work = tmp_path / "work"
    with pytest.raises(SystemExit):
        decoder.main(["--moses", sys.executable, "--ini", str(tmp_path / "moses.ini"), "--server", "127.0.0.1:1",
                      "--input", str(tmp_path / "in.txt"), "--workdir", str(work), "--nbest-check", "2",
                      "--configs", "kenlm", "selfnorm:normalized=false"])
    assert "--nbest-check compares with the model file's own scores" in capsys.readouterr().err
    assert not work.exists()


def test_the_journal_of_finished_runs(tmp_path: Path) -> None:
    # each finished run is a line {"key", "run"}; --resume keeps the last of each key, and a
    # line cut short by a crash is skipped
    journal = tmp_path / "runs.jsonl"
    first = decoder.Run("kenlm", 0, 500, 93.9, 182.1, 0.0, output_sha="a")
    again = decoder.Run("kenlm", 0, 500, 78.0, 150.2, 0.0, output_sha="a")
    local = decoder.Run("ep10f", 0, 500, 175.4, 331.2, 7.7, output_sha="b", ngrams_local=1, rows_summed=2)
    journal.write_text("".join(json.dumps({"key": k, "run": asdict(r)}) + "\n"
                               for k, r in (("k", first), ("l", local), ("k", again)))
                       + '{"key": "m", "run": {"config": "ep5')
    kept = decoder.read_journal(journal)
    assert kept == {"k": again, "l": local}
    assert decoder.read_journal(tmp_path / "none.jsonl") == {}
    with pytest.raises(SystemExit):
        decoder.main(["--moses", sys.executable, "--ini", str(tmp_path / "moses.ini"), "--server", "127.0.0.1:1",
                      "--input", str(tmp_path / "in.txt"), "--resume", "--configs", "kenlm"])


def test_a_failed_check_keeps_the_rounds(tmp_path: Path) -> None:
    # a check that could not run is reported as such; the measured table stays
    runs = [decoder.Run("kenlm", r, 10, 11.0, 20.0, 0.0, output_sha="a") for r in (0, 1)]
    result = {"machine": {"cpu": "CPU", "cores": 2, "load_average_1m": 1.0}, "lines": 10, "input": "/x/test.src",
              "threads": 2, "rounds": 2, "serve_args": "", "nlm_weight": 0.1,
              "rows": decoder.summarise(runs, [decoder.Config.parse("kenlm")]),
              "prefetch_check": {"local/error": "moses exited with 1"}, "prefetch_lines": 3,
              "nbest_check": {"error": "n-best check: moses exited with 1", "lines": 5, "model": "/m/x.nlm"},
              "command": "bench/decoder.py"}
    text = decoder.render(result)
    assert "| KENLM alone | 11.0, 11.0 |" in text
    assert "the first 3 sentences: local: no answer (moses exited with 1)." in text
    assert "NLM0 in Moses' n-best lists: no answer (n-best check: moses exited with 1)." in text
    # the load after each run, where the runs recorded it
    assert "load average after each run" not in text
    result["runs"] = [{"config": "kenlm", "round": r, "extra": {"load_average_1m_after": 1.5 + r}} for r in (0, 1)]
    assert "; the 1-minute load average after each run: kenlm r0 1.5, kenlm r1 2.5." in decoder.render(result)


def test_a_recorded_command_names_no_scratch_folder() -> None:
    from bench import _common

    ran = (f"bench/decoder.py --moses /scratch/moses/moses-cmd/bin/gcc-12/moses --ini {REPO.parent}/shared/data/moses-fr-en/moses.ini "
           f"--configs local:scoring=local,model=/scratch/ep5x/ep5x.nlm --doc {REPO}/docs/performance.md --json /scratch/b/d.json")
    shown = _common.shown_command(ran)
    assert "/scratch" not in shown and shown == (
        "python -m bench.decoder --moses moses --ini ../shared/data/moses-fr-en/moses.ini "
        "--configs local:scoring=local,model=ep5x.nlm --doc docs/performance.md --json d.json")


def test_a_command_recorded_in_another_checkout_shows_as_here() -> None:
    from bench import _common

    ran = "/elsewhere/checkout/bench/query.py --model /scratch/demo.nlm --rounds 3"
    assert _common.shown_command(ran) == "python -m bench.query --model demo.nlm --rounds 3"
