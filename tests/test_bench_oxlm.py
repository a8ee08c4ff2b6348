"""bench/oxlm.py's own logic, without an OxLM build: reading what OxLM's ``train_factored_sgd``
and ``evaluate`` print (lines captured from real runs of OxLM c3d73d5 built by
bench/oxlm_build.sh), the tokens a number of OxLM minibatches covers, the two training
commands, the table, and the skip when no OxLM is given."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest


from bench import oxlm

# train_factored_sgd's stdout, 5 minibatches at the default settings (first 200,000 Europarl
# lines, singletons as <unk>).
TRAIN_OUT = """\
################################
# Config Summary
# order = 5
# word_width = 256
# model-out = /tmp/nlmserve-oxlm/oxlm-1.bin
# input = /tmp/nlmserve-oxlm/train.200000.min2.unk.txt
# minibatch size = 10000
# minibatch threshold = 5
# lambda = 7
# step size = 0.05
# iterations = 1
# evaluate frequency = 6
# threads = 1
# randomise = 1
# diagonal contexts = 1
# activation = 2
# noise samples = 10
# hidden layers = 0
################################
Binned 24291 types in 156 classes with an average of 155.712 types per bin.
===============================
 Model parameters: 
  Context vocab size = 24291
  Output vocab size = 24291
  Total parameters = 12502399
===============================
Writing model to /tmp/nlmserve-oxlm/oxlm-1.bin...
Done...
Iteration: 0, Time: 1.075 seconds, Objective: 0.0815972

Overall minimum perplexity: inf
"""

# The passes of a run over 2,000 lines (58,215 tokens): 8 minibatches, 6 in the first pass.
TWO_PASSES = """\
Binned 4974 types in 20 classes with an average of 248.7 types per bin.
===============================
 Model parameters: 
  Context vocab size = 4974
  Output vocab size = 4974
  Total parameters = 164546
===============================
Writing model to small.bin...
Done...
Iteration: 0, Time: 0.336 seconds, Objective: 26.7554

Writing model to small.bin...
Done...
Iteration: 1, Time: 0.102 seconds, Objective: 7.43862

Overall minimum perplexity: inf
"""

EVAL_OUT = """\
################################
# Input/Output files:
# input = /tmp/nlmserve-oxlm/train.200000.min2.unk.txt
# test file = /tmp/nlmserve-oxlm/europarl.dev.lc-moses.min2.unk.train.200000.txt
# model-out = /tmp/nlmserve-oxlm/oxlm-1.bin

# General config: 
# vocab size = 24291
# order = 5
# word_width = 256
# iterations = 1
# minibatch size = 10000
# evaluate frequency = 1
# minibatch threshold = 0
# lambda = 7
# step size = 0.05
# threads = 1
# randomise = 1
# diagonal contexts = 1
# activation = 2
# noise samples = 10
################################

Calculating perplexity for 189654 tokens...
Test set perplexity: 377.27
"""


def test_the_training_output_gives_config_vocabulary_and_seconds() -> None:
    r = oxlm.parse_oxlm_train(TRAIN_OUT)
    assert (r["vocab"], r["classes"], r["parameters"]) == (24291, 156, 12502399)
    assert r["seconds"] == 1.075 and r["pass_seconds"] == [1.075] and r["objective"] == 0.0815972
    c = r["config"]
    assert c["step size"] == "0.05" and c["lambda"] == "7" and c["minibatch size"] == "10000"
    assert c["model-out"] == "/tmp/nlmserve-oxlm/oxlm-1.bin" and c["noise samples"] == "10"


def test_the_seconds_of_several_passes_add_up() -> None:
    r = oxlm.parse_oxlm_train(TWO_PASSES)
    assert r["pass_seconds"] == [0.336, 0.102]
    assert r["seconds"] == pytest.approx(0.438)
    assert r["objective"] == 7.43862  # the last pass's
    assert r["config"] == {}


def test_a_run_that_did_not_finish_a_pass_is_refused() -> None:
    cut = TRAIN_OUT.split("Writing model")[0]  # killed while training
    with pytest.raises(ValueError, match="not the output of a finished"):
        oxlm.parse_oxlm_train(cut)


def test_the_evaluation_output_gives_perplexity_and_tokens() -> None:
    assert oxlm.parse_oxlm_eval(EVAL_OUT) == {"tokens": 189654, "perplexity": 377.27}
    with pytest.raises(ValueError):
        oxlm.parse_oxlm_eval(EVAL_OUT.replace("Test set perplexity: 377.27", ""))


@pytest.mark.parametrize("minibatches, corpus, tokens", [
    (2, 25_000, 20_000),
    (3, 25_000, 25_000),  # the last minibatch of a pass is 5,000 tokens
    (4, 25_000, 35_000),  # the second pass
    (8, 58_215, 78_215),  # TWO_PASSES: 6 minibatches, then 2
    (256, 5_652_225, 2_560_000),  # the default 2.56M tokens of the 200,000 lines
])
def test_tokens_of_a_number_of_minibatches(minibatches: int, corpus: int, tokens: int) -> None:
    assert oxlm.oxlm_tokens(minibatches, corpus) == tokens


def test_text_tokens_count_one_end_of_sentence_per_line(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("a b c\nd <unk>\n")
    assert oxlm.text_tokens(text) == 7


def _args(*flags: str) -> argparse.Namespace:
    return oxlm.parser().parse_args(list(flags))  # the defaults


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_oxlm_command_trains_exactly_the_minibatches_on_one_thread() -> None:
    cmd = oxlm.oxlm_command(Path("/ox/bin"), Path("t.txt"), Path("m.bin"), _args(), 1200, 5_652_225)
    assert cmd[0] == "/ox/bin/train_factored_sgd"
    assert _flag(cmd, "--minibatch-threshold") == "1200" and _flag(cmd, "--minibatch-size") == "10000"
    assert _flag(cmd, "--iterations") == "3"  # 566 minibatches a pass
    assert int(_flag(cmd, "--evaluate-frequency")) > 1200  # no model write in the middle of the run
    assert _flag(cmd, "--threads") == "1" and _flag(cmd, "--activation") == "2"
    assert _flag(cmd, "--word-width") == "256" and _flag(cmd, "--classes") == "156"
    assert "--test-set" not in cmd  # a test set would make the threshold count minibatches without gain
    assert "--step-size" not in cmd and "--lambda-lbl" not in cmd  # OxLM's defaults
    given = oxlm.oxlm_command(Path("/ox/bin"), Path("t.txt"), Path("m.bin"), _args("--oxlm-lambda", "0"), 5, 100_000)
    assert _flag(given, "--lambda-lbl") == "0.0" and _flag(given, "--iterations") == "1"


def test_the_nlmserve_command_has_oxlms_model_and_no_recipe() -> None:
    cmd = oxlm.nlmserve_command(Path("t.txt"), Path("w/n.nlm"), _args(), 5000, 2_000_000)
    assert cmd[:3] == [sys.executable, "-m", "nlmserve"] and cmd[3] == "train"
    assert _flag(cmd, "--recipe") == "none" and _flag(cmd, "--max-steps") == "5000"
    assert _flag(cmd, "--epochs") == "2"  # 2.56M tokens of a 2M-token text
    assert _flag(cmd, "--threads") == "1" and _flag(cmd, "--workers") == "1"
    assert _flag(cmd, "--classes") == "156" and _flag(cmd, "--class-method") == "frequency"
    assert _flag(cmd, "--activation") == "relu" and _flag(cmd, "--dim") == "256" and _flag(cmd, "--order") == "5"
    assert _flag(cmd, "--objective") == "nce" and _flag(cmd, "--noise-samples") == "10"
    assert "--no-ngram-features" in cmd and _flag(cmd, "--dropout") == "0"
    assert "--valid" not in cmd and _flag(cmd, "--checkpoint-every") == "0"
    # The step measured is named, never left to --step auto's choice.
    assert _flag(cmd, "--step") == "fused"
    assert _flag(oxlm.nlmserve_command(Path("t.txt"), Path("w/n.nlm"), _args("--step", "torch"), 5, 10), "--step") \
        == "torch"
    with pytest.raises(SystemExit):
        _args("--step", "auto")


def test_a_run_of_another_step_than_the_one_asked_is_refused() -> None:
    """The log's start record names the step that ran: the one asked for gives the JSON's
    fields; another one, or a log that names none, stops the benchmark."""
    start = {"event": "start", "step_ran": "fused", "step_reason": "--step fused"}
    assert oxlm.training_step(start, "fused", "n.nlm.log.jsonl") == {"step": "fused", "step_reason": "--step fused"}
    torch_ran = {"step_ran": "torch", "step_reason": "--step auto and the fused step does not apply: NLMSERVE_FUSED=0"}
    with pytest.raises(SystemExit, match="the torch step ran .*NLMSERVE_FUSED=0.*not the fused step"):
        oxlm.training_step(torch_ran, "fused", "n.nlm.log.jsonl")
    with pytest.raises(SystemExit, match="does not say which training step ran"):
        oxlm.training_step({"event": "start"}, "fused", "n.nlm.log.jsonl")


def _run(tps: float, ppl: float, tokens: int = 2_560_000, seconds: float | None = None,
         dev_tokens: int = 189_654) -> dict[str, Any]:
    return {"tokens": tokens, "seconds": seconds or tokens / tps, "tokens_per_s": tps, "dev_ppl": ppl,
            "dev_tokens": dev_tokens, "vocab": 24291, "step": "fused", "step_reason": "--step fused"}


def _result(nlm_dev_tokens: int = 189_654) -> dict[str, Any]:
    # Two rounds (tokens/s and perplexities as an earlier measurement gave them).
    rounds = [
        {"oxlm": _run(51_639, 87.0), "nlmserve": _run(30_153, 83.5, dev_tokens=nlm_dev_tokens),
         "oxlm_same_time": _run(51_000, 78.6, tokens=4_480_000, seconds=87.7)},
        {"oxlm": _run(51_142, 87.2), "nlmserve": _run(32_057, 83.7),
         "oxlm_same_time": _run(51_000, 78.8, tokens=4_480_000, seconds=87.9)},
    ]
    return {
        "machine": {"cpu": "AMD EPYC", "cores": 2, "load_average_1m": 0.05},
        "command": "bench/oxlm.py --oxlm-bin /scratch/oxlm/bin",
        "settings": {"train": "/x/europarl.train.lc-moses.en.xz", "lines": 200_000, "min_count": 2, "order": 5,
                     "dim": 256, "activation": "relu", "classes": 156, "noise_samples": 10,
                     "oxlm": {"step_size": 0.05, "lambda": 7.0},
                     "nlmserve": {"lr": 0.1, "source": {"commit": "99a3cb8821a5", "uncommitted_changes": False}}},
        "rounds": rounds,
        "summary": oxlm.summarise(rounds),
    }


def test_the_summary_and_table() -> None:
    result = _result()
    s = result["summary"]
    assert s["oxlm_tokens_per_s"]["mean"] == pytest.approx(51_390.5)
    assert s["nlmserve_tokens_per_s"]["mean"] == pytest.approx(31_105)
    assert s["ratio"] == pytest.approx(31_105 / 51_390.5)
    text = oxlm.render(result)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1] == "| training tokens/s, one core | 51,390 (51,639, 51,142) | 31,105 (30,153, 32,057) | 0.61 |"
    assert rows[2] == ("| dev perplexity after 2,560,000 tokens (OxLM 2,560,000) | 87.1 (87.0, 87.2) "
                       "| 83.6 (83.5, 83.7) | 0.960 |")
    assert rows[3].startswith("| dev perplexity after nlmserve's 82.4 s of training (OxLM: 4,480,000 tokens in 87.8 s) "
                              "| 78.7 (78.6, 78.8) | 83.6 (83.5, 83.7) |")
    assert "nlmserve at 99a3cb8 against OxLM, 2 rounds" in text and "V = 24,291" in text
    assert "same 189,654 tokens" in text and "not comparable" not in text
    assert "no direct features; nlmserve's fused training step (--step fused)." in text
    for r in result["rounds"]:
        del r["nlmserve"]["step"]  # a JSON of a run that did not record the step
    assert "**the training step nlmserve ran is not recorded**" in oxlm.render(result)


def test_different_dev_token_counts_are_flagged() -> None:
    text = oxlm.render(_result(nlm_dev_tokens=183_014))  # e.g. one tool without </s>
    assert "**The tools counted different dev tokens** (OxLM [189654], nlmserve [183014, 189654])" in text


def test_without_oxlm_it_skips(capsys: pytest.CaptureFixture[str]) -> None:
    assert oxlm.main([]) == 0
    assert "no OxLM given" in capsys.readouterr().out


def test_a_bin_dir_without_the_binaries_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "evaluate").write_text("")
    with pytest.raises(SystemExit, match="has no train_factored_sgd"):
        oxlm.main(["--oxlm-bin", str(tmp_path)])


def test_render_replaces_only_its_section(tmp_path: Path) -> None:
    begin, end = oxlm.markers("oxlm.py")
    doc = tmp_path / "training.md"
    doc.write_text(f"# before\n\n{begin}\nold table\n{end}\n\nafter\n")
    js = tmp_path / "oxlm.json"
    js.write_text(json.dumps(_result()))
    assert oxlm.main(["--render", str(doc), str(js)]) == 0
    text = doc.read_text()
    assert text.startswith(f"# before\n\n{begin}\n\n") and text.endswith(f"\n\n{end}\n\nafter\n")
    assert "old table" not in text and "| training tokens/s, one core | 51,390" in text


def test_the_page_shows_the_saved_run() -> None:
    """docs/performance.md's OxLM table is what --render writes from bench/results/oxlm.json,
    a run that records the step nlmserve trained with."""
    repo = Path(__file__).resolve().parent.parent
    saved = json.loads((repo / "bench" / "results" / "oxlm.json").read_text(encoding="utf-8"))
    text = oxlm.render(saved)
    assert "not recorded" not in text and "nlmserve's fused training step (--step fused)" in text
    assert text in (repo / "docs" / "performance.md").read_text(encoding="utf-8")
