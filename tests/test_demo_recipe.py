"""The demo's training recipe (``make demo``): bounded by steps, not by time; the same seed and
steps train the same model; the validation curve it prints falls to the model it writes."""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nlmserve.cli import main
from nlmserve.lm.cli import apply_recipe, register
from nlmserve.lm.model_file import read_model_file
from nlmserve.pipeline.experiment import training_command, training_text
from nlmserve.pipeline.config import ExperimentConfig


def _train_args(cmd: list[str]) -> argparse.Namespace:
    """``cmd`` (``python -m nlmserve train …``) as ``nlmserve train`` parses it."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(cmd[3:])


def test_the_demo_trains_a_fixed_number_of_steps_with_time_only_as_a_safety_limit() -> None:
    config = ExperimentConfig()
    args = _train_args(training_command(config, "train.txt", Path("nlm.model")))
    assert args.recipe == "none" and apply_recipe(args).startswith("none (the plain values): ")
    assert args.max_steps == config.steps > 0
    assert args.max_minutes == config.minutes >= 10  # far beyond the steps' time: a safety limit
    # One process, a fixed seed, and a rate that never looks at the clock (the linear schedule
    # counts wall time when --max-minutes is given): the same weights on any machine.
    assert args.workers == 1 and not args.distributed and args.seed == 1 and args.lr_schedule == "plateau"
    # A validation falls on the last step, so the printed curve ends at the model written.
    assert 0 < args.valid_every <= config.steps and config.steps % args.valid_every == 0
    # --steps 0: the experiment's older behaviour, a wall-time budget alone.
    assert _train_args(training_command(replace(config, steps=0), "t", Path("m"))).max_steps is None


def _head(src: str, n: int, dst: Path) -> str:
    with lzma.open(src, "rt", encoding="utf-8") as handle:
        dst.write_text("".join(line for _, line in zip(range(n), handle)), encoding="utf-8")
    return str(dst)


def _train(config: ExperimentConfig, work: Path) -> tuple[object, list[float]]:
    out = work / "nlm.model"
    for stale in (out, Path(f"{out}.ckpt"), Path(f"{out}.log.jsonl"), Path(f"{out}.curve.png")):
        stale.unlink(missing_ok=True)
    shutil.rmtree(f"{out}.work", ignore_errors=True)
    cmd = training_command(config, training_text(config.train_text, work), out)
    assert main([*cmd[3:], "--no-progress"]) == 0
    records = [json.loads(line) for line in Path(f"{out}.log.jsonl").read_text().splitlines()]
    return read_model_file(out), [r["valid_ppl"] for r in records if "valid_ppl" in r]


@pytest.mark.slow
def test_the_demo_recipe_on_a_slice_is_deterministic_and_its_curve_falls(tmp_path: Path) -> None:
    """Two trainings: the same curve, falling, and the same model file byte for byte (so the
    same model hash: the file records nothing of the clock or the machine)."""
    demo = ExperimentConfig()
    europarl, news = demo.train_text[0], demo.train_text[1]
    valid = tmp_path / "valid.txt"
    valid.write_text("".join(Path(demo.valid_text).read_text(encoding="utf-8").splitlines(True)[:200]))
    flags = list(demo.train_args)
    flags[flags.index("--valid-every") + 1] = "10"
    config = replace(demo, train_text=(_head(europarl, 1500, tmp_path / "ep.txt"), _head(news, 1000, tmp_path / "news.txt"),
                                       str(tmp_path / "news.txt")),
                     valid_text=str(valid), steps=40, train_args=tuple(flags))
    first, curve = _train(config, tmp_path)
    second, again = _train(config, tmp_path)
    assert len(curve) == 4 and curve == again
    assert all(b <= a for a, b in zip(curve, curve[1:])), curve
    assert first.training["valid_perplexity"] == curve[-1] and first.training["stopped"] == "max steps"
    assert first.tensors.keys() == second.tensors.keys()
    assert all(np.array_equal(first.tensors[k], second.tensors[k]) for k in first.tensors)
    assert "seconds" not in first.training
    assert first.sha256 == second.sha256
