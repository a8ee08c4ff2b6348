"""bench/scaling.py without a clock: the command line of each configuration, the medians and
ratios of hand-made runs, and the table it renders."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import scaling


def _args() -> argparse.Namespace:
    return argparse.Namespace(train=Path("t.xz"), valid=Path("v.txt"), order=5, dim=128, batch_size=512, steps=2000,
                              seed=1)


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_every_configuration_trains_the_same_tokens_with_the_step_it_names() -> None:
    args = _args()
    one = scaling.command("one", args, Path("o.nlm"))
    assert _flag(one, "--workers") == "1" and _flag(one, "--step") == "fused" and "--distributed" not in one
    assert _flag(scaling.command("workers2", args, Path("o.nlm")), "--workers") == "2"
    assert _flag(scaling.command("workers16", args, Path("o.nlm")), "--workers") == "16"
    assert scaling._label("workers16") == "16 Hogwild workers (`--workers 16`)"
    ranks = scaling.command("dist2:128", args, Path("o.nlm"))
    assert "torch.distributed.run" in ranks and _flag(ranks, "--nproc-per-node") == "2"
    assert _flag(ranks, "--average-every") == "128" and _flag(ranks, "--step") == "fused"
    assert (_flag(ranks, "--batch-size"), _flag(ranks, "--max-steps")) == ("512", "2000")
    assert _flag(ranks, "--workers") == "1"
    groups = scaling.command("dist2x8:128", args, Path("o.nlm"))  # two ranks of 8 Hogwild workers each
    assert (_flag(groups, "--nproc-per-node"), _flag(groups, "--workers"), _flag(groups, "--average-every")) == (
        "2", "8", "128")
    assert scaling._label("dist2x8:128") == "2 ranks of 8 Hogwild workers, averaged every 128 steps " \
        "(`--distributed --workers 8`)"
    # the torch step's step is the global batch: twice the batch, half the steps
    sync = scaling.command("dist2:torch", args, Path("o.nlm"))
    assert (_flag(sync, "--batch-size"), _flag(sync, "--max-steps"), _flag(sync, "--step")) == ("1024", "1000", "torch")
    with pytest.raises(SystemExit, match="unknown configuration"):
        scaling.command("dist3", args, Path("o.nlm"))
    with pytest.raises(SystemExit, match="unknown configuration"):
        scaling.command("dist2:often", args, Path("o.nlm"))
    with pytest.raises(SystemExit, match="unknown configuration"):
        scaling.command("dist2x0:128", args, Path("o.nlm"))


def _run(name: str, rnd: int, train_s: float, ppl: float, average_s: float | None = None) -> dict:  # type: ignore[type-arg]
    return {"name": name, "round": rnd, "train_s": train_s, "wall_s": train_s + 5, "tokens": 1_024_000,
            "steps": 2000, "valid_ppl": ppl, "average_s": average_s,
            "ranks_identical": None if average_s is None else True}


def test_medians_and_the_ratio_to_one_process() -> None:
    runs = [_run("one", 0, 10.0, 114.0), _run("dist2:128", 0, 6.0, 121.0, 1.5),
            _run("one", 1, 12.0, 114.2), _run("dist2:128", 1, 4.0, 120.0, 0.5)]
    rows = scaling.summarise(runs, ["one", "dist2:128"])
    assert rows[0]["train_s"] == 11.0 and rows[0]["tokens_per_s"] == pytest.approx(1_024_000 / 11.0)
    assert rows[1]["train_s"] == 5.0 and rows[1]["vs_one"] == pytest.approx(11.0 / 5.0)
    assert rows[1]["valid_ppl"] == 120.5 and rows[1]["average_s"] == 1.0 and rows[1]["ranks_identical"] is True
    result = {"machine": {"cpu": "CPU X", "cores": 2, "load_average_1m": 0.25},
              "command": "/venv/bin/python /repo/bench/scaling.py --steps 2000 --work /scratch/w",
              "args": {"order": 5, "dim": 128, "steps": 2000, "batch_size": 512, "train": "/d/t.xz",
                       "valid": "/d/v.txt", "rounds": 2},
              "rows": rows}
    lines = scaling.render(result).splitlines()
    assert lines[0] == "<!-- bench/scaling.py: begin -->" and lines[-1] == "<!-- bench/scaling.py: end -->"
    assert "| 1 process | 11.0 (10.0, 12.0) | 93,091 | 1.00 | 114.10 |  |  |" in lines
    assert ("| 2 ranks, averaged every 128 steps (`--distributed`) | 5.0 (6.0, 4.0) | 204,800 | 2.20 | 120.50 | 1.00 "
            "| yes |") in lines


def test_the_page_shows_the_saved_run() -> None:
    """docs/training-scale.md's table is what --render writes from bench/results/scaling.json."""
    import json

    repo = Path(__file__).resolve().parent.parent
    saved = json.loads((repo / "bench" / "results" / "scaling.json").read_text(encoding="utf-8"))
    assert scaling.render(saved) in (repo / "docs" / "training-scale.md").read_text(encoding="utf-8")
