"""bench/targets.py: the ``nlmserve train`` command each target runs (the text, the budget, the
selection text and the step, plus only the model flags given to the bench: the trainer's
recipe chooses the rest); the dev text cut into the half that selects and the half that
reports; Kneser-Ney's perplexities with and without OOVs read from KenLM's ``query``; the
verdict, met only with and without OOVs; and a short run end to end on the shipped slices,
with stand-ins for lmplz and query, that selects on one half and reports on the other."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from bench import targets

FULL, OXLM, OXLM_MLE = targets.TARGETS[1], targets.TARGETS[2], targets.TARGETS[3]
SELECT = Path("w/dev.select.txt")


def _command(target: targets.Target, *flags: str, scale: float = 1.0) -> list[str]:
    args = targets.parser().parse_args(list(flags))
    row = targets.Row(target, target.minutes * scale)
    return targets.train_command(row, args, Path("w/train.full.txt"), SELECT, Path("w/full.nlm"))


def test_no_model_flag_leaves_every_choice_to_the_recipe() -> None:
    cmd = _command(FULL)
    assert cmd[:3] == [sys.executable, "-m", "nlmserve"]
    assert cmd[3:] == ["train", "--train", "w/train.full.txt", "--valid", str(SELECT), "--out", "w/full.nlm",
                       "--max-minutes", "60.000", "--step", "fused", "--no-progress"]


def test_given_flags_pass_through_and_the_scale_shortens_the_budget() -> None:
    cmd = _command(FULL, "--noise-samples", "5", "--dim", "768", "--no-ngram-features", "--lr", "0.05",
                   "--workers", "2", "--order", "10", "--ngram-order", "5", scale=0.05)
    text = " ".join(cmd)
    assert "--max-minutes 3.000" in text
    assert "--order 10 --ngram-order 5" in text
    assert "--noise-samples 5" in text and "--dim 768" in text and "--lr 0.05" in text and "--workers 2" in text
    assert cmd[-1] == "--no-ngram-features"
    assert "--threads" not in cmd and "--class-method" not in cmd  # not given: the recipe's


def test_the_oxlm_targets_set_their_objective_min_count_width_and_step() -> None:
    text = " ".join(_command(OXLM))
    assert "--objective nce --min-count 2" in text and "--dim 256" in text and "--step fused" in text
    assert "--dim 512" in " ".join(_command(OXLM, "--oxlm-dim", "512"))
    assert "--dim" not in _command(FULL, "--oxlm-dim", "512")  # the width of the OxLM rows only
    # MLE has the torch step only; the NCE rows take --nce-step; auto is never a choice
    assert "--objective mle --min-count 2" in " ".join(_command(OXLM_MLE, "--nce-step", "fused"))
    assert "--step torch" in " ".join(_command(OXLM_MLE)) and "--step torch" in " ".join(_command(FULL, "--nce-step",
                                                                                                  "torch"))
    with pytest.raises(SystemExit):
        targets.parser().parse_args(["--nce-step", "auto"])


def test_no_baseline_is_typed_in() -> None:
    """A target holds its set-up and goal, no perplexity of another model."""
    fields = {f.name for f in dataclasses.fields(targets.Target)}
    assert fields == {"name", "lines", "minutes", "objective", "min_count", "dim", "goal"}
    with pytest.raises(SystemExit):
        targets.parser().parse_args(["--kn", "full=52.4"])


def test_the_dev_text_is_cut_into_a_selection_half_and_a_report_half(tmp_path: Path) -> None:
    dev = tmp_path / "dev.txt"
    dev.write_text("a\nb c\nd\ne f g\nh\n", encoding="utf-8")
    select, report, half = targets.split_dev(dev, tmp_path)
    assert half == 2
    assert select.read_text() == "a\nb c\n" and report.read_text() == "d\ne f g\nh\n"
    dev.write_text("only one\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="selection and report need 2 at least"):
        targets.split_dev(dev, tmp_path)


QUERY_OUT = (
    "the=5 2 -1.0\tcat=0 1 -3.0\t</s>=2 2 -0.5\tTotal: -4.5 OOV: 1\n"
    "UNKWORD=7 2 -2.0\ta=b=3 3 -0.5\t</s>=2 3 -1.0\tTotal: -3.5 OOV: 0\n"
    "Perplexity including OOVs:\t21.5443\n"
    "Perplexity excluding OOVs:\t5.62341\n"
    "OOVs:\t1\n"
    "Tokens:\t6\n"
)


def test_query_output_gives_the_perplexity_with_and_without_oovs() -> None:
    """Six tokens summing to -8.0 (log10); without the word KenLM does not know (id 0) and the
    placeholder of the mapped rare words: four tokens summing to -3.0."""
    kn = targets.parse_query(QUERY_OUT)
    assert (kn.tokens, kn.oov) == (6, 2)
    assert kn.ppl == pytest.approx(10 ** (8.0 / 6)) and kn.ppl_excl_oov == pytest.approx(10 ** (3.0 / 4))
    # without a placeholder in the text only id 0 is an OOV (KenLM's own summary above)
    plain = targets.parse_query(QUERY_OUT, placeholder="zzz")
    assert plain.oov == 1 and plain.ppl_excl_oov == pytest.approx(10 ** (5.0 / 5))
    with pytest.raises(RuntimeError, match="no scored words"):
        targets.parse_query("Perplexity including OOVs:\t1\n")


def _ppl(ppl: float, excl: float, oov: int = 30, tokens: int = 1000) -> targets.Perplexity:
    return targets.Perplexity(ppl, excl, oov, tokens)


def test_a_target_is_met_only_with_and_without_oovs() -> None:
    kn = _ppl(60.0, 50.0)
    assert targets.verdict(-0.08, _ppl(54.0, 45.0), kn) == "met"  # -10%, -10%
    # <unk>'s mass flatters the first: -10% with OOVs, -6% without
    assert targets.verdict(-0.08, _ppl(54.0, 47.0), kn) == "not met (without OOVs)"
    assert targets.verdict(-0.08, _ppl(57.0, 47.0), kn) == "not met (with OOVs and without OOVs)"
    assert targets.verdict(-0.08, _ppl(54.0, 45.0), None) == "no verdict: no Kneser-Ney run (--lmplz)"
    assert targets.verdict(None, _ppl(54.0, 45.0), kn) == "no goal"


def test_the_table_without_kneser_ney_says_so() -> None:
    row = targets.Row(FULL, 60.0, ours=_ppl(52.0, 50.5), steps=10, tokens_seen=5120, train_seconds=3600, dim=768,
                      recipe="large", step="fused", step_reason="--step fused")
    line = targets.format_table([row], 1.0).splitlines()[-1]
    assert line == ("| full | 60.00 | 768 | fused | 52.00 (KN not measured) | 50.50 (KN not measured) | 30 of 1,000 "
                    "| no verdict: no Kneser-Ney run (--lmplz) | 10 | 5,120 | 3600 | large |")


def _run(ours: tuple[float, float], kn: tuple[float, float], kn_oov: int = 527) -> dict[str, object]:
    return {"machine": {"cpu": "CPU X", "load_average_1m": 0.5}, "date": "2026-12-02",
            "command": "bench/targets.py --only 200k --lmplz /scratch/k/bin/lmplz --json /scratch/t/200k.json",
            "split": {"dev": "/x/europarl.dev.lc-moses.en", "lines": 6640, "select_lines": 3320},
            "rows": [{"target": dataclasses.asdict(targets.TARGETS[0]), "minutes": 20.0,
                      "kn": {"ppl": kn[0], "ppl_excl_oov": kn[1], "oov": kn_oov, "tokens": 90_000},
                      "ours": {"ppl": ours[0], "ppl_excl_oov": ours[1], "oov": 527, "tokens": 90_000},
                      "steps": 1000, "tokens_seen": 6_000_000, "train_seconds": 1200.0, "dim": 768,
                      "recipe": "small (for 5,452,225 training tokens, 20 minutes, 2 cores): dropout=0.3",
                      "step": "fused", "step_reason": "--step fused"}]}


def test_the_no_flag_rows_render_with_both_comparisons_and_their_verdict(tmp_path: Path) -> None:
    met = _run((56.0, 54.0), (61.06, 59.0))
    unk = _run((56.0, 55.0), (61.06, 59.0), kn_oov=530)
    table = targets.render([met, unk]).splitlines()
    assert len(table) == 4
    # 56.0 / 61.06 - 1 = -8.29% and 54.0 / 59.0 - 1 = -8.47%: met; 55.0 / 59.0 - 1 = -6.78%: not met
    assert "| 56.00 against 61.06 (−8.29%) | 54.00 against 59.00 (−8.47%); OOV tokens 527 of 90,000 (both) |" \
        in table[2]
    assert table[2].split(" | ")[-2] == "met" and table[3].split(" | ")[-2] == "not met (without OOVs)"
    assert "**differ**: ours 527 of 90,000, KN 530 of 90,000" in table[3]
    assert ("chose the `small` recipe): at most −8% against `lmplz -o 5` on the same lines; selected on lines "
            "1–3,320 of the dev text, reported on lines 3,321–6,640") in table[2]
    assert "the fused step (--step fused); 1,000 steps, 6.0M tokens, 5,000 tokens/s, 1,200 s" in table[2]
    assert "`python -m bench.targets --only 200k --lmplz lmplz --json 200k.json` (2026-12-02, CPU X, load average 0.5" \
        in table[2]
    doc = tmp_path / "page.md"
    begin, end = targets.markers("targets.py")
    doc.write_text(f"before\n{begin}\nold\n{end}\nafter\n", encoding="utf-8")
    (tmp_path / "run.json").write_text(json.dumps(met), encoding="utf-8")
    assert targets.main(["--render", str(doc), str(tmp_path / "run.json")]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text and "| met |" in text


def test_the_oxlm_setups_render_with_their_flags_and_no_goal() -> None:
    run = _run((60.0, 59.0), (62.84, 61.0))
    row = run["rows"][0]  # type: ignore[index]
    row.update(target=dataclasses.asdict(targets.TARGETS[3]), minutes=20.0, dim=256, step="torch",
               step_reason="--step torch")
    (line,) = targets.render([run]).splitlines()[2:]
    assert line.startswith("| OxLM's set-up (the first 120,000 lines, words seen once as `<unk>`): exact class MLE "
                           "within 20 minutes (`--objective mle --min-count 2 --dim 256`, the `small` recipe's other "
                           "choices), "
                           "no goal; `lmplz -o 5` on the same mapped lines; selected on lines 1–3,320 ")
    # 60.0 / 62.84 - 1 = -4.52%
    assert "| 60.00 against 62.84 (−4.52%) |" in line and line.split(" | ")[-2] == "no goal"


# Stand-ins for KenLM's tools: lmplz writes its training text as the "model"; query scores
# every word log10 -1 (id 0 for a word the model's text lacks) and keeps what it was given.
_LMPLZ = "import sys\nsys.stdout.write(sys.stdin.read())\n"
_QUERY = """\
import sys
from pathlib import Path
model = Path(sys.argv[1])
known = set(model.read_text().split())
given = sys.stdin.read()
Path(str(model) + ".queried").write_text(given)
oov_total = 0
for line in given.splitlines():
    words = line.split() + ["</s>"]
    oov = sum(w not in known and w != "</s>" for w in words)
    cells = [f"{w}={0 if w not in known and w != '</s>' else 1} 1 -1" for w in words]
    print("\\t".join(cells + [f"Total: {-len(words)} OOV: {oov}"]))
"""


def _tool(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def test_a_short_run_selects_on_one_half_and_reports_on_the_other(train_small_path: Path, dev_small_path: Path,
                                                                   tmp_path: Path) -> None:
    """The 200k target on the shipped slices, its budget scaled to 5 s (the set-up's second or two
    included, so the loop runs even on a busy machine): training's --valid is the dev text's
    first half, both models are scored on the second half alone (the same tokens, the same OOV
    positions: the words outside the training lines), Kneser-Ney is built on the training lines
    alone, and the row records the step that ran."""
    from nlmserve.lm.model_file import read_model_header

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lmplz = _tool(bin_dir / "lmplz", _LMPLZ)
    _tool(bin_dir / "query", _QUERY)
    work = tmp_path / "work"
    assert targets.main(["--train", str(train_small_path), "--dev", str(dev_small_path), "--only", "200k",
                         "--scale", "0.004", "--lmplz", str(lmplz), "--work", str(work), "--json",
                         str(tmp_path / "run.json"),
                         # a small model, quick to set up (the recipe's Brown classes and feature tables are not)
                         "--dim", "16", "--order", "3", "--no-ngram-features", "--class-method", "frequency",
                         "--workers", "1", "--threads", "1"]) == 0
    run = json.loads((tmp_path / "run.json").read_text())
    dev = dev_small_path.read_text(encoding="utf-8").splitlines(keepends=True)
    assert run["split"] == {"dev": str(dev_small_path), "lines": 200, "select_lines": 100,
                            "select": "the first half: training's --valid",
                            "report": "the second half: every number of the rows"}
    report = "".join(dev[100:])
    assert read_model_header(work / "200k.nlm").training["valid"] == str(work / "dev.select.txt")
    assert (work / "dev.select.txt").read_text() == "".join(dev[:100])
    arpa = work / "train.200000.kn5.arpa"
    assert arpa.read_text() == train_small_path.read_text() and Path(f"{arpa}.queried").read_text() == report
    (row,) = run["rows"]
    tokens = sum(len(line.split()) + 1 for line in dev[100:])
    known = set(train_small_path.read_text().split())
    oov = sum(w not in known for line in dev[100:] for w in line.split())
    assert row["ours"]["tokens"] == row["kn"]["tokens"] == tokens
    assert row["ours"]["oov"] == row["kn"]["oov"] == oov > 0
    assert row["kn"]["ppl"] == pytest.approx(10.0) and row["kn"]["ppl_excl_oov"] == pytest.approx(10.0)
    assert math.isfinite(row["ours"]["ppl"]) and row["ours"]["ppl_excl_oov"] < row["ours"]["ppl"]
    assert (row["step"], row["step_reason"]) == ("fused", "--step fused")
    # what the trainer cost: its set-up and loop from its log, its largest resident set, its file
    log = [json.loads(line) for line in (work / "200k.nlm.log.jsonl").read_text().splitlines()]
    assert row["prepare_seconds"] == log[0]["prepare_s"] >= 0 and row["loop_seconds"] == log[-1]["elapsed"] > 0
    assert row["prepare_seconds"] + row["loop_seconds"] < row["train_seconds"]
    assert row["model_bytes"] == (work / "200k.nlm").stat().st_size
    assert 50e6 < row["peak_rss_bytes"] < 4e9  # a Python process with torch, not kB and not the machine
    assert row["train_tokens"] == log[0]["train_tokens"] == sum(len(line.split()) + 1 for line in
                                                                 train_small_path.read_text().splitlines())
    # the table names the text given by --train, with its tokens, and the recorded costs
    table = targets.render([run])
    assert f"| first 200,000 lines of `{train_small_path.name}` ({row['train_tokens'] / 1e6:.2f}M tokens), " in table
    assert f"model file {row['model_bytes'] / 1e6:,.0f} MB" in table and "largest resident set" in table


def test_the_page_shows_the_saved_run() -> None:
    """docs/performance.md's targets table is what --render writes from bench/results/targets-200k.json,
    targets-full.json and targets-oxlm.json: each row at its full budget."""
    repo = Path(__file__).resolve().parent.parent
    saved = [json.loads((repo / "bench" / "results" / name).read_text(encoding="utf-8"))
             for name in ("targets-200k.json", "targets-full.json", "targets-oxlm.json")]
    for run in saved:
        assert run["split"]["select_lines"] < run["split"]["lines"]  # selected on one half, reported on the other
        assert all(row["minutes"] == row["target"]["minutes"] for row in run["rows"])
    assert [r["target"]["name"] for run in saved for r in run["rows"]] == ["200k", "full", "oxlm-nce", "oxlm-mle"]
    assert targets.render(saved) in (repo / "docs" / "performance.md").read_text(encoding="utf-8")


def test_the_large_vocabulary_page_shows_its_saved_run() -> None:
    """docs/training-scale.md's 113,737-word row is what --render writes from
    bench/results/targets-100k.json: a run given its own --train text, at its full budget."""
    repo = Path(__file__).resolve().parent.parent
    saved = json.loads((repo / "bench" / "results" / "targets-100k.json").read_text(encoding="utf-8"))
    (row,) = saved["rows"]
    assert row["target"]["name"] == "full" and row["minutes"] == row["target"]["minutes"] == 60.0
    table = targets.render([saved])
    assert "| all of `train.lc.tok.en` (20.82M tokens), 60 minutes, " in table
    assert table in (repo / "docs" / "training-scale.md").read_text(encoding="utf-8")
