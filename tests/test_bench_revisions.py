"""bench/revisions.py: the verdict rule on hand-made runs, the table it renders into a page, its
sequential-latency probe against a real server of this tree, and its timing of a training
recipe from the trainer's log."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import REPO

from bench import revisions
from bench._common import random_class_model


def test_same_when_the_means_differ_by_less_than_the_larger_range() -> None:
    # old 100, 110 (range 10); new 104, 108 (range 4): means 105 and 106 differ by 1 <= 10
    r = revisions.compare([100.0, 110.0], [104.0, 108.0], higher_is_better=True)
    assert r["verdict"] == "same" and r["noise"] == 10.0
    assert r["ratio"] == pytest.approx(106 / 105)


def test_better_or_worse_follows_the_metric_direction() -> None:
    # means 101 and 90.5 differ by 10.5, ranges 2 and 1
    assert revisions.compare([100.0, 102.0], [90.0, 91.0], higher_is_better=True)["verdict"] == "worse"
    assert revisions.compare([100.0, 102.0], [90.0, 91.0], higher_is_better=False)["verdict"] == "better"
    # exactly the range apart is still the same
    assert revisions.compare([1.0, 3.0], [4.0, 4.0], higher_is_better=True)["verdict"] == "same"


def test_differences_under_one_percent_are_the_same_even_without_spread() -> None:
    # two runs each side that agree exactly: 0.5% apart is the same, 2% apart is not
    assert revisions.compare([100.0, 100.0], [100.5, 100.5], higher_is_better=False)["verdict"] == "same"
    assert revisions.compare([100.0, 100.0], [102.0, 102.0], higher_is_better=False)["verdict"] == "worse"


def test_lookup_and_summary_skip_what_a_revision_does_not_report() -> None:
    run = {"serve": {"engine_10000": 100, "latency_c1": {"p50_ms": 1.0}, "load_clients": "C++"},
           "train": {"tokens_per_s": 5e4, "dev_ppl": 100.0}}
    assert revisions.lookup(run, "serve.latency_c1.p50_ms") == 1.0
    assert revisions.lookup(run, "serve.load_clients") is None  # not a number
    assert revisions.lookup(run, "serve.engine_4096") is None
    old = [run, {**run, "serve": {**run["serve"], "engine_10000": 120}}]
    new = [{**run, "serve": {"engine_10000": 60}}, {**run, "serve": {"engine_10000": 62}}]
    rows = {r["key"]: r for r in revisions.summarise({"old": old, "new": new})}
    # new's runs report no single-request latency: that metric is left out
    assert set(rows) == {"serve.engine_10000", "train.tokens_per_s", "train.dev_ppl"}
    assert rows["serve.engine_10000"]["old"] == [100.0, 120.0]
    assert rows["serve.engine_10000"]["verdict"] == "worse"  # 61 vs 110, ranges 20 and 2
    assert rows["train.dev_ppl"]["verdict"] == "same" and rows["train.dev_ppl"]["ratio"] == 1.0


def test_render_writes_the_table_into_the_page(tmp_path: Path) -> None:
    result = {"machine": {"cpu": "AMD EPYC", "cores": 2, "load_average_1m": 0.1}, "rounds": 2,
              "command": "bench/revisions.py --old 19f2784",
              "old": {"rev": "19f2784", "sha": "19f2784" + "0" * 33}, "new": {"rev": "HEAD", "sha": "abcdef1" + "0" * 33},
              "rows": revisions.summarise({"old": [{"train": {"tokens_per_s": 100}}, {"train": {"tokens_per_s": 110}}],
                                           "new": [{"train": {"tokens_per_s": 104}}, {"train": {"tokens_per_s": 108}}]})}
    js = tmp_path / "r.json"
    js.write_text(json.dumps(result))
    doc = tmp_path / "results.md"
    doc.write_text(f"# Results\n\n{revisions.BEGIN}\nold table\n{revisions.END}\n\nafter\n")
    assert revisions.main(["--render", str(doc), str(js)]) == 0
    text = doc.read_text()
    assert "old table" not in text and text.endswith("\n\nafter\n")
    assert "| training, NCE, 1 thread (tokens/s) | 100, 110 | 104, 108 | 1.01 | same |" in text
    assert "`19f2784` (19f2784) against `HEAD` (abcdef1), 2 rounds" in text
    assert "Command: `python -m bench.revisions --old 19f2784`" in text
    # a named section is written between its own markers; the unnamed one stays
    begin, end = revisions.markers("training")
    doc.write_text(text + f"\n{begin}\nold\n{end}\n")
    assert revisions.main(["--render", str(doc), str(js), "--section", "training"]) == 0
    named = doc.read_text()
    assert named.startswith(text) and named.count("| training, NCE, 1 thread (tokens/s) |") == 2


def test_training_speed_reads_tokens_per_second_after_the_first_steps(tmp_path: Path) -> None:
    log = tmp_path / "m.nlm.log.jsonl"
    rows = [{"event": "start", "step": 0, "tokens": 0},
            {"step": 500, "tokens": 256_000, "elapsed": 40.0, "tokens_per_s": 6400.0, "loss": 5.0},
            {"step": 1000, "tokens": 512_000, "elapsed": 60.0, "tokens_per_s": 8533.3, "loss": 4.0},
            {"step": 1000, "valid_ppl": 90.0, "elapsed": 61.0},
            {"step": 1500, "tokens": 768_000, "elapsed": 80.0, "tokens_per_s": 9600.0, "loss": 3.9}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # (768,000 - 512,000) tokens in (80 - 60) s, from step 1,000 on
    assert revisions.training_speed(log) == {"tokens_per_s": 12_800.0, "steps": 1500.0}
    with pytest.raises(SystemExit, match="larger budget"):
        revisions.training_speed(log, skip_steps=1500)  # nothing after it


def test_a_training_recipe_of_this_tree_is_timed_from_its_log(tmp_path: Path, train_small_path: Path) -> None:
    side = revisions.Side("new", "HEAD", "0" * 40, REPO, tmp_path / "site")
    args = ["--train", str(train_small_path), "--recipe", "none", "--dim", "8", "--order", "3", "--batch-size", "8",
            "--max-steps", "1200", "--log-every", "100", "--checkpoint-every", "0", "--threads", "1"]
    out = tmp_path / "recipe.nlm"
    r = revisions.recipe_bench(side, args, out)
    assert r["steps"] == 1200.0 and r["tokens_per_s"] > 0
    assert out.exists()
    # the step is named (--train-step's default) and the log's start record says it ran
    assert (r["step"], r["step_reason"]) == ("fused", "--step fused")


def test_the_training_step_is_named_and_auto_is_refused(tmp_path: Path) -> None:
    assert revisions.given_step(["--train", "t", "--step", "torch"]) == "torch"
    assert revisions.given_step(["--step=fused", "--max-minutes", "4"]) == "fused"
    assert revisions.given_step(["--train", "t"]) is None
    for args in (["--step", "auto"], ["--step=auto"], ["--step"]):
        with pytest.raises(SystemExit, match="name the step measured"):
            revisions.given_step(args)
    with pytest.raises(SystemExit, match="name the step measured"):
        revisions.main(["--old", "HEAD", "--train-args=--step auto", "--work", str(tmp_path)])
    this = revisions.Side("new", "HEAD", "0" * 40, REPO, tmp_path / "site")
    older = revisions.Side("old", "19f2784", "0" * 40, tmp_path, tmp_path / "site")  # a tree without the flags
    assert this.knows("lm/cli.py", "--step") and this.knows("bench/train.py", "--nce-step")
    assert not older.knows("lm/cli.py", "--step") and not older.knows("bench/train.py", "--nce-step")


def test_the_table_says_which_step_each_side_trained_with() -> None:
    fused = {"step": "fused", "step_reason": "--step fused"}
    rounds = {"old": [{"train": {"tokens_per_s": 1.0, "step": None, "step_reason": None}}] * 2,
              "new": [{"train": {"tokens_per_s": 1.0, **fused}, "recipe": {"steps": 5.0, **fused}}] * 2}
    assert revisions._steps(rounds) == ["train old not recorded, new fused (--step fused)",
                                        "recipe new fused (--step fused)"]


def test_one_round_is_refused() -> None:
    with pytest.raises(SystemExit):
        revisions.main(["--old", "HEAD", "--rounds", "1"])


def test_sequential_latency_against_a_real_server(tmp_path: Path) -> None:
    model = tmp_path / "m.nlm"
    random_class_model([REPO / "data" / "lm" / "europarl.train.50k.lc-moses.en.xz"], 2000, 5, 16, 0, model)
    # this tree, as installed in this environment (an empty PYTHONPATH adds nothing)
    side = revisions.Side("new", "HEAD", "0" * 40, REPO, tmp_path / "site")
    assert side.env["PYTHONPATH"] == str(tmp_path / "site") and os.environ.get("PYTHONPATH") != side.env["PYTHONPATH"]
    r = revisions.sequential_latency(side, model, 60, native=False)
    assert 0 < r["p50_ms"] <= r["p99_ms"] < 5000
    assert r["server_cpu_us"] > 0  # the server did work for the requests


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.nlm"
    bad.write_text("not a model\n")
    side = revisions.Side("old", "19f2784", "0" * 40, REPO, tmp_path / "site")
    with pytest.raises(SystemExit, match="did not start"):
        revisions.sequential_latency(side, bad, 10, native=False)
