"""bench/targets.py: the ``nlmserve train`` command each target runs (the text and the budget,
plus only the model flags given to the bench: the trainer's recipe chooses the rest), and the
label of a Kneser-Ney perplexity that no lmplz run of this invocation produced."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


from bench import targets

FULL, OXLM = targets.TARGETS[1], targets.TARGETS[2]


def _command(target: targets.Target, *flags: str, scale: float = 1.0) -> list[str]:
    args = targets.parser().parse_args(list(flags))
    row = targets.Row(target, target.minutes * scale, target.kn, "typed in")
    return targets.train_command(row, args, Path("w/train.full.txt"), Path("w/full.nlm"))


def test_no_model_flag_leaves_every_choice_to_the_recipe() -> None:
    cmd = _command(FULL)
    assert cmd[:3] == [sys.executable, "-m", "nlmserve"]
    assert cmd[3:] == ["train", "--train", "w/train.full.txt", "--valid", str(targets.DEV), "--out", "w/full.nlm",
                       "--max-minutes", "60.000", "--no-progress"]


def test_given_flags_pass_through_and_the_scale_shortens_the_budget() -> None:
    cmd = _command(FULL, "--noise-samples", "5", "--dim", "768", "--no-ngram-features", "--lr", "0.05",
                   "--workers", "2", "--order", "10", "--ngram-order", "5", scale=0.05)
    text = " ".join(cmd)
    assert "--max-minutes 3.000" in text
    assert "--order 10 --ngram-order 5" in text
    assert "--noise-samples 5" in text and "--dim 768" in text and "--lr 0.05" in text and "--workers 2" in text
    assert cmd[-1] == "--no-ngram-features"
    assert "--threads" not in cmd and "--class-method" not in cmd  # not given: the recipe's


def test_the_oxlm_targets_set_their_objective_min_count_and_width() -> None:
    text = " ".join(_command(OXLM))
    assert "--objective nce --min-count 2" in text and "--dim 256" in text
    assert "--dim 512" in " ".join(_command(OXLM, "--oxlm-dim", "512"))
    assert "--dim" not in _command(FULL, "--oxlm-dim", "512")  # the width of the OxLM rows only


def test_a_typed_in_kneser_ney_value_says_so_in_the_table() -> None:
    row = targets.Row(FULL, 60.0, FULL.kn, "typed in", ppl=52.0, steps=10, tokens_seen=5120, train_seconds=3600,
                      dim=768, recipe="large")
    line = targets.format_table([row], 1.0).splitlines()[-1]
    assert line.startswith("| full | 60.00 | 768 | 52.4 | typed in | 52.0 | n/a | -0.8% | 10 | 5,120 | 3600 | large |")


def test_the_no_flag_rows_render_with_their_verdict_against_the_goal(tmp_path: Path) -> None:
    run = {"machine": {"cpu": "CPU X", "load_average_1m": 0.5}, "date": "2026-12-02",
           "command": "bench/targets.py --only 200k --lmplz /scratch/k/bin/lmplz --json /scratch/t/200k.json",
           "rows": [{"target": dataclasses.asdict(targets.TARGETS[0]), "minutes": 20.0, "kn_ppl": 61.06,
                     "kn_source": "lmplz", "ppl": 56.0, "ppl_excl_oov": 54.0, "oov": 527, "steps": 1000,
                     "tokens_seen": 6_000_000, "train_seconds": 1200.0, "dim": 768,
                     "recipe": "small (for 5,452,225 training tokens, 20 minutes, 2 cores): dropout=0.3"}]}
    worse = json.loads(json.dumps(run))
    worse["rows"][0]["ppl"] = 56.5
    table = targets.render([run, worse]).splitlines()
    assert len(table) == 4
    # 56.0 / 61.06 - 1 = -8.29% (at most -8%: met); 56.5 / 61.06 - 1 = -7.47% (not met)
    assert "| met, −8.29% |" in table[2] and "| not met, −7.47% |" in table[3]
    assert "chose the `small` recipe): at most −8% against `lmplz -o 5` on the same lines (61.06)" in table[2]
    assert "56.00 (excl. OOVs 54.00); 1,000 steps, 6.0M tokens, 5,000 tokens/s, 1,200 s" in table[2]
    assert "`python -m bench.targets --only 200k --lmplz lmplz --json 200k.json` (2026-12-02, CPU X, load average 0.5" \
        in table[2]
    doc = tmp_path / "page.md"
    begin, end = targets.markers("targets.py")
    doc.write_text(f"before\n{begin}\nold\n{end}\nafter\n", encoding="utf-8")
    (tmp_path / "run.json").write_text(json.dumps(run), encoding="utf-8")
    assert targets.main(["--render", str(doc), str(tmp_path / "run.json")]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text and "| met, −8.29% |" in text
