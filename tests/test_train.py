"""Training: exact resume after an interruption, bad inputs through the CLI, the three
objectives end to end, logs, learning curve and the time budget."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from nlmserve.cli import main
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.train import TrainConfig, load_checkpoint, train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def small_train(tmp_path_factory: pytest.TempPathFactory, train_small_path: Path) -> Path:
    out = tmp_path_factory.mktemp("train") / "train.600.en"
    lines = train_small_path.read_text(encoding="utf-8").splitlines(keepends=True)[:600]
    out.write_text("".join(lines), encoding="utf-8")
    return out


def _config(train_path: Path, valid: Path, out: Path, **kw: object) -> TrainConfig:
    base = dict(train=str(train_path), valid=str(valid), out=str(out), order=4, dim=8, classes=12,
                min_count=2, batch_size=64, lr=0.2, threads=1, seed=3, progress=False,
                learning_curve=False, valid_every=15, checkpoint_every=10, checkpoint_share=0.0, max_steps=40)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("objective,tables,dropout",
                         [("nce", 0, 0.0), ("mle", 0, 0.0), ("nce", 512, 0.0), ("mle", 512, 0.0), ("nce", 512, 0.3)])
def test_interrupt_then_resume_ends_at_the_same_parameters(small_train: Path, dev_small_path: Path, tmp_path: Path,
                                                          objective: str, tables: int, dropout: float) -> None:
    # tables > 0: direct n-gram features (their HashedAdagrad state is checkpointed too);
    # dropout > 0: the masks come from the checkpointed generator, so they repeat after a resume
    feats = dict(ngram_class_table=tables // 2, ngram_word_table=tables, dropout=dropout)
    straight = train(_config(small_train, dev_small_path, tmp_path / "a.nlm", objective=objective, **feats))
    cfg_b = _config(small_train, dev_small_path, tmp_path / "b.nlm", objective=objective, **feats)
    # stop dead 5 steps after the checkpoint of step 20 (as a kill would): steps 21-25 are lost
    cut = train(cfg_b, _interrupt_after_step=25)
    assert cut.stopped == "interrupted" and not (tmp_path / "b.nlm").exists()
    assert load_checkpoint(cfg_b.checkpoint_path)["state"]["step"] == 20
    resumed = train(replace(cfg_b, resume=True))
    assert resumed.steps == straight.steps == 40
    a = straight.model.state_dict()
    b = resumed.model.state_dict()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), name
    assert resumed.best_valid_ppl == pytest.approx(straight.best_valid_ppl, abs=1e-6)
    la = LanguageModel.load(tmp_path / "a.nlm", device="cpu")
    lb = LanguageModel.load(tmp_path / "b.nlm", device="cpu")
    rows = np.array([[1, 1, 5], [3, 4, 9], [7, 8, 2]])
    assert np.allclose(la.score_ngrams(rows), lb.score_ngrams(rows), atol=1e-6)


@pytest.mark.parametrize("share,expected", [(0.0, [5, 10, 15, 20, 25, 30, 35, 40]), (0.01, [5, 40])])
# (the point at step 40 is where training stops: the end's own checkpoint is written there)
def test_slow_checkpoints_are_written_less_often_but_always_at_the_end(
        small_train: Path, dev_small_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, share: float,
        expected: list[int]) -> None:
    # a checkpoint that takes 0.2 s with share 0.01 passes over the points of the next 20 s:
    # the 40 steps of this model take far less, so only the first point and the last write
    import nlmserve.lm.train as train_module

    written: list[int] = []
    real = train_module.save_checkpoint

    def slow_save(path: str, model: object, opt: object, gen: object, state: dict[str, int], *rest: object,
                  **kw: object) -> None:
        time.sleep(0.2)
        written.append(state["step"])
        real(path, model, opt, gen, state, *rest, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "save_checkpoint", slow_save)
    cfg = _config(small_train, dev_small_path, tmp_path / "m.nlm", checkpoint_every=5, checkpoint_share=share)
    assert train(cfg).steps == 40
    assert written == expected
    assert load_checkpoint(cfg.checkpoint_path)["state"]["step"] == 40


@pytest.mark.parametrize("tables", [0, 512])
def test_a_version_1_checkpoint_resumes_to_the_same_parameters(small_train: Path, dev_small_path: Path,
                                                               tmp_path: Path, tables: int) -> None:
    # Version 1 checkpoints listed each optimiser group's parameters in the model file's
    # order (the class layer's parameters before the context embeddings); the optimiser now
    # lists them in module order. Rewritten to that form, a checkpoint still resumes exactly.
    feats = dict(ngram_class_table=tables // 2, ngram_word_table=tables)
    straight = train(_config(small_train, dev_small_path, tmp_path / "a.nlm", **feats))
    cfg_b = _config(small_train, dev_small_path, tmp_path / "b.nlm", **feats)
    train(cfg_b, _interrupt_after_step=25)
    ck = load_checkpoint(cfg_b.checkpoint_path)
    names, opt = ck.pop("optimizer_params"), ck["optimizer"]
    rank = {name: i for i, name in enumerate(ck["model"])}
    old_index, start = {}, 0
    for group in opt["param_groups"]:
        members = [names[i] for i in group["params"]]
        for j, name in enumerate(sorted(members, key=rank.__getitem__)):
            old_index[name] = start + j
        start += len(members)
    assert [old_index[n] for n in names] != list(range(len(names)))  # the orders do differ
    opt["state"] = {old_index[names[i]]: st for i, st in opt["state"].items()}
    ck["version"] = 1
    torch.save(ck, cfg_b.checkpoint_path)
    resumed = train(replace(cfg_b, resume=True))
    assert resumed.steps == straight.steps == 40
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), name


def test_dropout_regularises_training_only(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    plain = train(_config(small_train, dev_small_path, tmp_path / "a.nlm", max_steps=10, valid_every=0))
    dropped = train(_config(small_train, dev_small_path, tmp_path / "b.nlm", max_steps=10, valid_every=0,
                            dropout=0.5))
    assert not torch.equal(plain.model.ctx_weight, dropped.model.ctx_weight)  # the masks changed the updates
    m = dropped.model.eval()
    ctx = torch.tensor([[4, 5, 6], [7, 8, 9]])
    tgt = torch.tensor([10, 11])
    with torch.inference_mode():  # no masks at scoring time: the same values every call
        assert torch.equal(m.log_prob(ctx, tgt), m.log_prob(ctx, tgt))
    m.train()
    r1, r2 = m.encode(ctx), m.encode(ctx)  # masks while training: units zeroed, the rest scaled by 2
    assert not torch.equal(r1, r2)
    with torch.no_grad():
        full = m.eval().encode(ctx)
    kept = r1 != 0
    assert torch.allclose(r1[kept], 2 * full[kept], atol=1e-6)
    with pytest.raises(ValueError, match="dropout"):
        _config(small_train, dev_small_path, tmp_path / "c.nlm", dropout=1.0)


def test_min_improvement_slows_the_rate_on_small_gains(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    def schedule(**kw: object) -> list[tuple[float, float]]:
        cfg = _config(small_train, dev_small_path, tmp_path / "m.nlm", valid_every=10, checkpoint_every=0, **kw)
        train(cfg)
        records = [json.loads(x) for x in Path(cfg.log_path).read_text().splitlines()]
        return [(r["valid_ppl"], r["lr"]) for r in records if "valid_ppl" in r]

    plain = schedule()
    assert all(b[0] < a[0] for a, b in zip(plain, plain[1:]))  # every validation improves here ...
    assert {lr for _, lr in plain} == {0.2}  # ... so the rate stays
    # a 50% bar: every gain after the first validation is "small", so each later validation
    # halves the rate, and the model still improves and is kept (no early stop: 40 steps done)
    slow = schedule(min_improvement=0.5)
    assert [lr for _, lr in slow] == pytest.approx([0.2 * 0.5 ** i for i in range(len(slow))])
    assert slow[-1][0] < slow[0][0]


def test_linear_schedule_lets_the_rate_fall_to_zero_over_the_budget(small_train: Path, dev_small_path: Path,
                                                                     tmp_path: Path) -> None:
    cfg = _config(small_train, dev_small_path, tmp_path / "lin.nlm", lr_schedule="linear", log_every=10,
                  checkpoint_every=0)
    result = train(cfg)
    records = [json.loads(x) for x in Path(cfg.log_path).read_text().splitlines()]
    rates = {r["step"]: r["lr"] for r in records if "loss" in r}
    # 40 steps (max_steps): after step k the next step's rate is 0.2 * (1 - k / 40)
    assert rates == pytest.approx({k: 0.2 * (1 - k / 40) for k in (10, 20, 30, 40)})
    plain = train(_config(small_train, dev_small_path, tmp_path / "plain.nlm", checkpoint_every=0))
    assert result.best_valid_ppl is not None and plain.best_valid_ppl is not None
    assert result.best_valid_ppl != plain.best_valid_ppl  # the rates did reach the updates
    # an interrupted linear run resumes exactly: the schedule follows the checkpointed step
    cfg2 = _config(small_train, dev_small_path, tmp_path / "lin2.nlm", lr_schedule="linear", checkpoint_every=20)
    assert train(cfg2, _interrupt_after_step=25).stopped == "interrupted"
    resumed = train(replace(cfg2, resume=True))
    assert resumed.best_valid_ppl == pytest.approx(result.best_valid_ppl, rel=1e-6)
    with pytest.raises(ValueError, match="lr_schedule"):
        _config(small_train, dev_small_path, tmp_path / "x.nlm", lr_schedule="cosine")


def test_a_diverged_model_validates_as_infinite_perplexity_not_a_crash() -> None:
    from nlmserve.lm.train import perplexity_of

    assert perplexity_of(-2.0 * 10, 10) == pytest.approx(math.exp(2.0))
    assert perplexity_of(-800.0 * 10, 10) == math.inf  # math.exp(800) raises OverflowError


def test_hogwild_workers_share_one_model(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    one = train(_config(small_train, dev_small_path, tmp_path / "a.nlm", dropout=0.1))
    two = train(_config(small_train, dev_small_path, tmp_path / "b.nlm", dropout=0.1, workers=2))
    # 40 minibatches of 64 either way; with two processes they come in 20 rounds of two
    assert one.steps == two.steps == 40 and one.tokens == two.tokens == 40 * 64
    assert one.best_valid_ppl is not None and two.best_valid_ppl is not None
    assert abs(two.best_valid_ppl / one.best_valid_ppl - 1) < 0.05
    # the helper's updates reached the shared parameters: the model is not the one that the
    # trainer's 20 minibatches alone make
    alone = train(_config(small_train, dev_small_path, tmp_path / "c.nlm", dropout=0.1, max_steps=20))
    assert alone.best_valid_ppl is not None and two.best_valid_ppl < alone.best_valid_ppl
    # a killed Hogwild run resumes from its checkpoint (statistically, not bit for bit): it
    # ends where the uninterrupted run of the same configuration (`two`) ended
    cfg = _config(small_train, dev_small_path, tmp_path / "d.nlm", dropout=0.1, workers=2)
    assert train(cfg, _interrupt_after_step=25).stopped == "interrupted"
    assert load_checkpoint(cfg.checkpoint_path)["state"]["step"] == 20
    resumed = train(replace(cfg, resume=True))
    assert resumed.steps == 40 and resumed.best_valid_ppl is not None
    assert abs(resumed.best_valid_ppl / two.best_valid_ppl - 1) < 0.05
    # under --distributed, Hogwild workers need the fused step (tests/test_distributed.py runs them)
    with pytest.raises(ValueError, match="workers > 1 with distributed needs the fused step"):
        _config(small_train, dev_small_path, tmp_path / "e.nlm", workers=2, distributed=True, step="torch")


def test_hogwild_adagrad_is_adagrad_alone_and_bounded_when_an_update_is_lost() -> None:
    from nlmserve.lm.optim import HogwildAdagrad

    torch.manual_seed(0)
    emb = [torch.nn.Embedding(50, 8, sparse=True) for _ in range(2)]
    dense = [torch.nn.Parameter(torch.randn(8)) for _ in range(2)]
    dense[1].data.copy_(dense[0].data)
    emb[1].weight.data.copy_(emb[0].weight.data)
    ref = torch.optim.Adagrad([emb[0].weight, dense[0]], lr=0.1)
    ours = HogwildAdagrad([emb[1].weight, dense[1]], lr=0.1)
    for step in range(5):  # one process: the same steps as torch's AdaGrad (rows repeat in a batch)
        idx = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(step))
        for e, d, opt in ((emb[0], dense[0], ref), (emb[1], dense[1], ours)):
            opt.zero_grad()
            ((e(idx) * d).sum(-1) ** 2).mean().backward()
            opt.step()
    torch.testing.assert_close(emb[1].weight, emb[0].weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(dense[1], dense[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.state[dense[1]]["sum"], ref.state[dense[0]]["sum"], rtol=1e-6, atol=0)
    # Another process's write lost this one's g² (its accumulator holds less than g² after the
    # add): AdaGrad's plain update g / sqrt(sum) would be unbounded; this one moves by the rate.
    p = torch.nn.Parameter(torch.zeros(3))
    opt = HogwildAdagrad([p], lr=0.1)
    g = torch.tensor([5.0, -3.0, 1e-3])
    opt.state[p]["sum"].copy_(-g * g + torch.tensor([0.0, 1e-12, 0.0]))
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.1, 0.1, -0.1]), rtol=1e-4, atol=1e-6)


# `nlmserve train` with only this room's subcommands registered.
_LM_TRAIN = (
    "import argparse, sys\n"
    "from nlmserve.lm import cli\n"
    "p = argparse.ArgumentParser(prog='nlmserve')\n"
    "cli.register(p.add_subparsers())\n"
    "a = p.parse_args()\n"
    "sys.exit(a.func(a))\n"
)


@pytest.mark.slow
def test_killed_subprocess_resumes_exactly(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    args = ["--train", str(small_train), "--valid", str(dev_small_path), "--order", "4", "--dim", "8",
            "--classes", "12", "--min-count", "2", "--batch-size", "32", "--lr", "0.2", "--threads", "1",
            "--seed", "5", "--valid-every", "400", "--checkpoint-every", "20", "--max-steps", "2000",
            "--no-progress"]
    cmd = [sys.executable, "-c", _LM_TRAIN, "train", "--recipe", "none"]
    ref = subprocess.run(cmd + args + ["--out", str(tmp_path / "ref.nlm")], capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed.nlm"
    proc = subprocess.Popen(cmd + args + ["--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = Path(str(out) + ".ckpt")
    deadline = time.monotonic() + 120
    while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run must be killed part-way"
    step_at_kill = load_checkpoint(str(ckpt))["state"]["step"]
    assert 0 < step_at_kill < 2000, "the run must be killed part-way"
    res = subprocess.run(cmd + args + ["--out", str(out), "--resume"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    a = load_checkpoint(str(tmp_path / "ref.nlm") + ".ckpt")
    b = load_checkpoint(str(ckpt))
    assert a["state"]["step"] == b["state"]["step"] == 2000
    for name, t in a["model"].items():
        assert torch.allclose(t, b["model"][name], atol=1e-6, rtol=0), name


def test_sigterm_to_the_process_group_writes_the_best_model(small_train: Path, dev_small_path: Path,
                                                             tmp_path: Path) -> None:
    # as `kill -- -PGID`, systemd or a batch scheduler would stop a Hogwild run: the trainer
    # stops as on Ctrl-C, its helper leaves when told, and --resume goes on from the checkpoint
    out = tmp_path / "termed.nlm"
    cmd = [sys.executable, "-c", _LM_TRAIN, "train", "--recipe", "none", "--train", str(small_train),
           "--valid", str(dev_small_path), "--out", str(out), "--order", "4", "--dim", "8", "--classes", "12",
           "--min-count", "2", "--batch-size", "32", "--threads", "1", "--workers", "2", "--valid-every", "20",
           "--checkpoint-every", "20", "--max-steps", "1000000", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ckpt = Path(str(out) + ".ckpt")
    deadline = time.monotonic() + 120
    while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted at step" in stderr and "Traceback" not in stderr
    assert "stopped\tinterrupted" in stdout
    lm = LanguageModel.load(out, device="cpu")
    assert lm.training["stopped"] == "interrupted" and lm.training["valid_perplexity"] > 1
    assert 0 < load_checkpoint(str(ckpt))["state"]["step"] < 1_000_000


@pytest.mark.parametrize("objective", ["nce", "mle", "softmax"])
def test_each_objective_trains_and_writes_a_loadable_model(small_train: Path, dev_small_path: Path,
                                                          tmp_path: Path, objective: str) -> None:
    out = tmp_path / f"{objective}.nlm"
    cfg = _config(small_train, dev_small_path, out, objective=objective, max_steps=None, epochs=2,
                  valid_every=0, checkpoint_every=0, learning_curve=True, batch_size=128)
    result = train(cfg)
    assert result.stopped == "epochs"
    lm = LanguageModel.load(out, device="cpu")
    assert lm.objective == objective
    assert lm.output_type == ("softmax" if objective == "softmax" else "class")
    records = [json.loads(line) for line in Path(cfg.log_path).read_text().splitlines()]
    ppls = [r["valid_ppl"] for r in records if "valid_ppl" in r]
    assert len(ppls) == 2
    assert ppls[-1] < len(lm.vocab) / 3  # well below a uniform guess
    assert result.best_valid_ppl == pytest.approx(min(ppls))
    assert lm.training["valid_perplexity"] == pytest.approx(min(ppls))
    assert Path(cfg.curve_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _step_records(cfg: TrainConfig) -> list[tuple[str, str, str]]:
    """(event, step_ran, step_reason) of the start and resume records of ``cfg``'s log."""
    records = [json.loads(line) for line in Path(cfg.log_path).read_text().splitlines()]
    return [(r["event"], r["step_ran"], r["step_reason"]) for r in records if r.get("event") in ("start", "resume")]


def test_the_log_and_the_model_file_say_which_step_ran_and_why(small_train: Path, dev_small_path: Path,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's start record (and a resume record per resumed invocation) and the model file's
    training record name the step that ran, ``fused`` or ``torch``, and why: what ``--step``
    asked for and, under ``auto``, whether the fused step applied (else the reason it did not).
    The reason stays out of the model's hash, the step does not."""
    from nlmserve.lm.fused import unavailable_reason
    from nlmserve.lm.config import ModelConfig
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.model_file import read_model_header

    probe = NeuralLM(ModelConfig(vocab_size=8, num_classes=2), np.arange(8) % 2)
    missing = unavailable_reason("nce", probe, "adagrad", torch.device("cpu"))
    auto = ("torch", f"--step auto and the fused step does not apply: {missing}") if missing else \
        ("fused", "--step auto and it applies")
    cases = [({}, auto), ({"step": "torch"}, ("torch", "--step torch")),
             ({"objective": "mle"}, ("torch", "--step auto and the fused step does not apply: "
                                              "objective mle (the fused step is NCE's)"))]
    for i, (kw, (ran, why)) in enumerate(cases):
        cfg = _config(small_train, dev_small_path, tmp_path / f"m{i}.nlm", max_steps=10, **kw)
        train(cfg)
        assert _step_records(cfg) == [("start", ran, why)]
        header = read_model_header(cfg.out)
        assert (header.training["step_ran"], header.training["step_reason"]) == (ran, why)
    # A resumed invocation that cannot run the fused step records its own step and reason.
    monkeypatch.setenv("NLMSERVE_FUSED", "0")
    cfg = _config(small_train, dev_small_path, tmp_path / "m0.nlm", max_steps=20, resume=True)
    train(cfg)
    off = ("torch", "--step auto and the fused step does not apply: NLMSERVE_FUSED=0")
    assert _step_records(cfg) == [("start", *auto), ("resume", *off)]
    assert (read_model_header(cfg.out).training["step_ran"], read_model_header(cfg.out).training["step_reason"]) == off
    assert "step_reason" not in json.dumps(_hashed_training(cfg.out))


def _hashed_training(path: str) -> dict[str, object]:
    """The training record as the header stores it under the hash (provenance left out)."""
    import struct

    blob = Path(path).read_bytes()
    _, _, length = struct.unpack_from("<8sIQ", blob)
    header: dict[str, object] = json.loads(blob[20:20 + length])
    assert isinstance(header["training"], dict) and "step_ran" in header["training"]
    return header["training"]


def test_max_minutes_stops_cleanly_with_the_best_model(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "timed.nlm"
    t0 = time.monotonic()
    result = train(_config(small_train, dev_small_path, out, max_steps=None, epochs=1000, max_minutes=0.05,
                           valid_every=50, patience=10**6))
    assert time.monotonic() - t0 < 30
    assert result.stopped == "max minutes"
    assert LanguageModel.load(out, device="cpu").training["stopped"] == "max minutes"


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        rc = main(["train", "--recipe", "none", *args, "--no-progress", "--max-steps", "2"])
    except SystemExit as stop:  # argparse's usage errors
        rc = int(stop.code or 0)
    return rc, capsys.readouterr().err


def test_bad_bytes_in_training_text_name_file_and_line(tmp_path: Path, dev_small_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a good line\nanother one\nbroken \xff\xfe here\n")
    rc, err = _cli(capsys, "--train", str(bad), "--valid", str(dev_small_path), "--out", str(tmp_path / "m.nlm"))
    assert rc == 1
    assert f"{bad}:3" in err


def test_bad_bytes_in_validation_text(tmp_path: Path, small_train: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "valid.txt"
    bad.write_bytes(b"fine\n\xc3\x28\n")
    rc, err = _cli(capsys, "--train", str(small_train), "--valid", str(bad), "--out", str(tmp_path / "m.nlm"),
                   "--classes", "10")
    assert rc == 1 and f"{bad}:2" in err


def test_empty_and_missing_training_text(tmp_path: Path, dev_small_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    rc, err = _cli(capsys, "--train", str(empty), "--valid", str(dev_small_path), "--out", str(tmp_path / "m.nlm"))
    assert rc == 1 and str(empty) in err and "empty" in err
    missing = tmp_path / "missing.txt"
    rc, err = _cli(capsys, "--train", str(missing), "--valid", str(dev_small_path), "--out", str(tmp_path / "m.nlm"))
    assert rc == 1 and str(missing) in err


def test_bad_flag_values_are_rejected(tmp_path: Path, small_train: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "--train", str(small_train), "--out", str(tmp_path / "m.nlm"), "--lr", "-1")
    assert rc == 2 and "lr" in err
    rc, err = _cli(capsys, "--train", str(small_train), "--out", str(tmp_path / "m.nlm"), "--classes", "999999")
    assert rc == 1 and "--classes" in err


def test_resume_after_a_time_budget_counts_the_time_spent(small_train: Path, dev_small_path: Path,
                                                          tmp_path: Path) -> None:
    cfg = _config(small_train, dev_small_path, tmp_path / "timed.nlm", max_steps=None, epochs=1000, max_minutes=0.05,
                  valid_every=50, patience=10**6, lr_schedule="linear", log_every=1)
    first = train(cfg)
    assert first.stopped == "max minutes"
    again = train(replace(cfg, resume=True))  # the same budget: spent, nothing more to do
    assert (again.steps, again.stopped) == (first.steps, "max minutes")
    spent = load_checkpoint(cfg.checkpoint_path)["state"]["elapsed"]
    assert spent > 0
    lines = len(Path(cfg.log_path).read_text().splitlines())
    more = train(replace(cfg, resume=True, max_minutes=0.1))
    assert more.steps > first.steps and more.stopped == "max minutes"
    # the linear rate goes on from the time spent (0.2 at the start, 0 at 6 s), not from 0.2
    resumed = [json.loads(x) for x in Path(cfg.log_path).read_text().splitlines()[lines:]]
    first_rate = next(r["lr"] for r in resumed if "loss" in r)
    assert first_rate <= 0.2 * (1 - spent / 6.0) + 1e-9


def test_resume_after_a_step_budget_continues(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    cfg = _config(small_train, dev_small_path, tmp_path / "budget.nlm", max_steps=20)
    assert train(cfg).steps == 20
    assert train(replace(cfg, resume=True)).steps == 20  # same budget: nothing more to do
    more = train(replace(cfg, resume=True, max_steps=30))
    assert more.steps == 30 and more.stopped == "max steps"
    assert LanguageModel.load(tmp_path / "budget.nlm", device="cpu").training["steps"] == 30


@pytest.mark.parametrize("how", ["brown", "file"])
def test_brown_classes_and_class_files(small_train: Path, dev_small_path: Path, tmp_path: Path, how: str) -> None:
    kw: dict[str, object] = {"class_method": "brown"}
    if how == "file":
        paths = tmp_path / "paths"
        paths.write_text("0\tthe\t10\n0\tof\t5\n10\tto\t4\n11\tand\t3\n", encoding="utf-8")
        kw = {"class_file": str(paths), "classes": None}
    out = tmp_path / f"{how}.nlm"
    train(_config(small_train, dev_small_path, out, max_steps=5, **kw))
    lm = LanguageModel.load(out, device="cpu")
    assert lm.classes is not None and lm.classes.method == how
    if how == "file":
        # three classes from the file, plus one for every other word of the vocabulary
        assert lm.num_classes == 4
        wc = lm.classes.word_class
        assert wc[lm.vocab.id("the")] == wc[lm.vocab.id("of")] != wc[lm.vocab.id("to")]
    else:
        assert lm.num_classes == 12


@pytest.mark.slow
def test_ctrl_c_writes_the_best_model_and_exits_130(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "sigint.nlm"
    args = ["--train", str(small_train), "--valid", str(dev_small_path), "--order", "4", "--dim", "8",
            "--classes", "12", "--min-count", "2", "--batch-size", "32", "--threads", "1",
            "--valid-every", "20", "--checkpoint-every", "20", "--max-steps", "100000", "--no-progress",
            # only the interrupt may end this run: no epoch limit or early stop before the signal
            # arrives on a loaded machine
            "--epochs", "100000", "--patience", "100000", "--out", str(out)]
    # Ctrl-C as a terminal delivers it: with Python's own SIGINT handler, which a test run
    # started in the background (`make test &`) would otherwise pass down as "ignored". Set
    # by the child itself, not by a preexec_fn: that would make Popen fork this test process,
    # whose gRPC threads (earlier tests' servers) then restart in the child before its exec
    # and abort there (SIGABRT, "epoll_wait error: Bad file descriptor").
    reset = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    proc = subprocess.Popen([sys.executable, "-c", reset + _LM_TRAIN, "train", "--recipe", "none", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = Path(str(out) + ".ckpt")
    deadline = time.monotonic() + 120
    while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, stderr[-2000:])
    assert "stopped\tinterrupted" in stdout
    lm = LanguageModel.load(out, device="cpu")
    assert lm.training["stopped"] == "interrupted" and lm.training["valid_perplexity"] is not None


def test_lowercase_models_lowercase_what_they_score(small_train: Path, dev_small_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "lower.nlm"
    train(_config(small_train, dev_small_path, out, max_steps=5, lowercase=True, max_vocab=300))
    lm = LanguageModel.load(out, device="cpu")
    assert lm.lowercase and len(lm.vocab) == 300
    upper, lower = lm.score_sentences([["The", "Commission"], ["the", "commission"]])
    assert np.array_equal(upper.token_log_probs, lower.token_log_probs)
    assert not upper.oov.any()
