"""The fused CPU NCE step (nlmserve.lm.fused) against the torch step it replaces: from the same
parameters, optimiser state, minibatch, noise and dropout mask, the same loss, the same
AdaGrad accumulators (after a first step, the squared gradients) and the same parameters."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nlmserve.lm.fused import FusedNCE, unavailable_reason
from nlmserve.lm.config import ModelConfig
from nlmserve.lm.model import NeuralLM
from nlmserve.lm.objectives import NoiseDistribution, nce_loss
from nlmserve.lm.optim import HashedAdagrad, HogwildAdagrad
from nlmserve.lm.train import TrainConfig, train

pytestmark = pytest.mark.skipif(unavailable_reason("nce", NeuralLM(ModelConfig(vocab_size=8, num_classes=2),
                                                                   np.arange(8) % 2),
                                                   "adagrad", torch.device("cpu")) is not None,
                                reason="the fused step is unavailable (numba missing or NLMSERVE_FUSED=0)")


def _model(V: int, K: int, order: int, dim: int, activation: str, tables: tuple[int, int], ngram_order: int,
           seed: int) -> tuple[NeuralLM, np.ndarray]:
    rng = np.random.default_rng(seed)
    # every class non-empty; <s> (id 1) alone in the last class when K > 2, as frequency
    # binning puts it (a class masked at -inf, never sampled)
    if K > 2 and K < V:
        others = np.concatenate([np.arange(K - 1), rng.integers(0, K - 1, V - K)])  # classes 0 .. K-2
        wc = np.insert(others, 1, K - 1)
    else:
        wc = np.concatenate([np.arange(K), rng.integers(0, K, V - K)])
    config = ModelConfig(vocab_size=V, order=order, dim=dim, activation=activation, num_classes=K,
                         ngram_class_table=tables[0], ngram_word_table=tables[1], ngram_order=ngram_order)
    torch.manual_seed(seed)
    model = NeuralLM(config, wc)
    counts = rng.integers(1, 200, V).astype(np.float64)
    model.init_biases(counts)
    model.set_sparse_grads(output=True, context=True, features=True)
    model.train()
    return model, counts


def _optimizer(model: NeuralLM, kind: str) -> torch.optim.Optimizer:
    """As lm.optim.make_optimizer makes them: Adagrad, HashedAdagrad with feature tables, HogwildAdagrad for --workers."""
    if kind == "hogwild":
        return HogwildAdagrad(model.parameters(), lr=0.1)
    tables = model.output.feature_tables()  # type: ignore[operator]
    if not tables:
        return torch.optim.Adagrad(model.parameters(), lr=0.1)
    ids = {id(p) for p in tables}
    return HashedAdagrad([{"params": [p for p in model.parameters() if id(p) not in ids]},
                          {"params": tables, "hashed": True}], lr=0.1)


CASES: dict[str, dict[str, Any]] = {
    "order5-features": dict(order=5, tables=(64, 128)),
    "no-features": dict(order=5, tables=(0, 0)),
    "class-features-only": dict(order=5, tables=(100, 0)),
    "tables-not-powers-of-two": dict(order=5, tables=(97, 1000)),
    "dropout": dict(order=5, tables=(64, 128), dropout=0.3),
    "order10-features-at-5": dict(order=10, tables=(256, 512), ngram_order=5),
    "order10-no-features": dict(order=10, tables=(0, 0)),
    "tanh": dict(order=5, tables=(64, 128), activation="tanh"),
    "relu-dropout": dict(order=4, tables=(0, 0), activation="relu", dropout=0.5),
    "classes-of-one-word": dict(order=5, tables=(64, 128), V=40, K=40),
    "one-class": dict(order=3, tables=(0, 64), K=1),
    "hogwild-adagrad": dict(order=5, tables=(64, 128), optimizer="hogwild"),
    "bigram": dict(order=2, tables=(32, 32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_step_equals_the_torch_step(name: str) -> None:
    case = {"V": 60, "K": 6, "dim": 16, "activation": "none", "ngram_order": 0, "dropout": 0.0,
            "optimizer": "adagrad", **CASES[name]}
    B, k, steps = 48, 5, 4
    ref, counts = _model(case["V"], case["K"], case["order"], case["dim"], case["activation"], case["tables"],
                         case["ngram_order"], seed=3)
    fused_model = copy.deepcopy(ref)
    ref.dropout = case["dropout"]
    opt_ref = _optimizer(ref, case["optimizer"])
    opt_fused = _optimizer(fused_model, case["optimizer"])
    noise = NoiseDistribution(counts, ref.output.word_class.numpy(), torch.device("cpu"))  # type: ignore[union-attr, operator]
    fused = FusedNCE(fused_model, opt_fused, noise)
    rng = np.random.default_rng(7)
    V, n1 = case["V"], case["order"] - 1
    for step in range(steps):
        ctx = rng.integers(0, V, (B, n1))
        ctx[:, 0] = 1  # <s> in the contexts, as at sentence starts
        tgt = rng.integers(2, V, B)  # never <s>
        tgt[:4] = tgt[0]  # a repeated target: rows touched several times
        gen = torch.Generator()
        gen.manual_seed(step)
        noise_classes, noise_words = noise.sample(ref, torch.from_numpy(tgt), k, gen)
        assert noise_classes is not None
        # the torch step: its dropout mask drawn from a generator in the state the fused one gets
        mask_gen = torch.Generator()
        mask_gen.manual_seed(100 + step)
        ref.dropout_gen = mask_gen
        opt_ref.zero_grad(set_to_none=True)
        loss_ref = nce_loss(ref, torch.from_numpy(ctx), torch.from_numpy(tgt), noise, noise_classes, noise_words)
        loss_ref.backward()  # type: ignore[no-untyped-call]
        opt_ref.step()
        keep = None
        if case["dropout"]:
            mask_gen.manual_seed(100 + step)
            keep = (torch.rand((B, case["dim"]), generator=mask_gen) >= case["dropout"]).numpy()
        loss = fused.step(ctx, tgt, noise_classes.numpy(), noise_words.numpy(), keep, case["dropout"])
        assert loss == pytest.approx(float(loss_ref.detach()), rel=1e-6), f"loss at step {step}"
        for (pname, a), (_, b) in zip(ref.named_parameters(), fused_model.named_parameters()):
            # AdaGrad's first steps move every touched element by about the rate: the
            # tolerance is a small fraction of it
            torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=1e-4, msg=f"{pname} at step {step}")
            s_ref, s_fused = opt_ref.state[a], opt_fused.state[b]
            torch.testing.assert_close(s_fused["sum"], s_ref["sum"], rtol=1e-4, atol=1e-9,
                                       msg=f"AdaGrad sum of {pname} at step {step}")
            assert float(s_fused["step"]) == float(s_ref["step"]) == step + 1
    # the parameters moved (a step that did nothing would pass the comparisons above)
    assert float((ref.output.word_embed.detach() - _model(case["V"], case["K"], case["order"], case["dim"],  # type: ignore[operator]
                                                   case["activation"], case["tables"], case["ngram_order"],
                                                   seed=3)[0].output.word_embed.detach()).abs().max()) > 0.05


def test_first_step_accumulators_are_the_squared_gradients() -> None:
    # after one step from a zero accumulator, sum = g²: the gradients themselves, element by element
    ref, counts = _model(30, 3, 4, 8, "relu", (32, 64), 0, seed=1)
    fused_model = copy.deepcopy(ref)
    opt = _optimizer(fused_model, "adagrad")
    noise = NoiseDistribution(counts, ref.output.word_class.numpy(), torch.device("cpu"))  # type: ignore[union-attr, operator]
    fused = FusedNCE(fused_model, opt, noise)
    rng = np.random.default_rng(0)
    ctx, tgt = rng.integers(0, 30, (16, 3)), rng.integers(2, 30, 16)
    gen = torch.Generator()
    gen.manual_seed(0)
    nc, nw = noise.sample(ref, torch.from_numpy(tgt), 4, gen)
    assert nc is not None
    nce_loss(ref, torch.from_numpy(ctx), torch.from_numpy(tgt), noise, nc, nw).backward()  # type: ignore[no-untyped-call]
    fused.step(ctx, tgt, nc.numpy(), nw.numpy(), None, 0.0)
    for (pname, p), (_, q) in zip(ref.named_parameters(), fused_model.named_parameters()):
        assert p.grad is not None
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(opt.state[q]["sum"].sqrt(), g.abs(), rtol=1e-4, atol=1e-7, msg=pname)


def test_unavailable_for_other_runs() -> None:
    model, _ = _model(20, 2, 3, 4, "none", (0, 0), 0, seed=0)
    cpu = torch.device("cpu")
    assert unavailable_reason("nce", model, "adagrad", cpu) is None
    assert "objective mle" in str(unavailable_reason("mle", model, "adagrad", cpu))
    assert "optimizer adam" in str(unavailable_reason("nce", model, "adam", cpu))
    assert "device cuda" in str(unavailable_reason("nce", model, "adagrad", torch.device("cuda")))
    full = NeuralLM(ModelConfig(vocab_size=20, order=3, dim=4, context="full", num_classes=2), np.arange(20) % 2)
    assert "full-matrix" in str(unavailable_reason("nce", full, "adagrad", cpu))


def _short_run(train_small_path: Path, dev_small_path: Path, out: Path, step: str, seed: int = 3,
               **kw: Any) -> Any:
    cfg = TrainConfig(train=str(train_small_path), valid=str(dev_small_path), out=str(out), order=4, dim=16,
                      classes=12, min_count=2, batch_size=64, lr=0.2, threads=1, seed=seed, epochs=1000,
                      max_steps=300, valid_every=300, checkpoint_every=0, progress=False, learning_curve=False,
                      step=step, workdir=str(out.parent / "ids"), **kw)
    return train(cfg)


@pytest.mark.parametrize("extra", [{}, {"ngram_class_table": 1 << 10, "ngram_word_table": 1 << 12, "dropout": 0.2,
                                         "activation": "relu"}], ids=["plain", "features-dropout-relu"])
def test_short_training_reaches_the_torch_steps_perplexity(train_small_path: Path, dev_small_path: Path,
                                                            tmp_path: Path, extra: dict[str, Any]) -> None:
    # the same minibatches, other noise draws: over three seeds each, the fused step's mean
    # perplexity lies within the torch step's own spread from seed to seed (or 3% of it:
    # with dropout the torch step's three runs happen to agree within 0.2%)
    ppl = {step: [_short_run(train_small_path, dev_small_path, tmp_path / f"{step}{seed}.nlm", step, seed,
                             **extra).best_valid_ppl for seed in (3, 4, 5)] for step in ("torch", "fused")}
    spread = max(max(ppl["torch"]) - min(ppl["torch"]), 0.03 * float(np.mean(ppl["torch"])))
    assert max(ppl["torch"]) < 1000  # it learned something (V = 3,629: a uniform model's perplexity)
    assert abs(np.mean(ppl["fused"]) - np.mean(ppl["torch"])) <= spread, ppl


def test_step_fused_where_it_does_not_apply_is_an_error(train_small_path: Path, dev_small_path: Path,
                                                        tmp_path: Path) -> None:
    from nlmserve.common.errors import InputError

    with pytest.raises(InputError, match="--step fused does not apply: objective mle"):
        _short_run(train_small_path, dev_small_path, tmp_path / "mle.nlm", "fused", objective="mle")


def test_the_steps_own_noise_and_mask_follow_the_distributions() -> None:
    from nlmserve.lm.fused import _draw

    model, counts = _model(60, 6, 3, 8, "none", (0, 0), 0, seed=2)
    noise = NoiseDistribution(counts, model.output.word_class.numpy(), torch.device("cpu"))  # type: ignore[union-attr, operator]
    fused = FusedNCE(model, torch.optim.Adagrad(model.parameters()), noise)
    wc = fused.word_class
    B, k, E, p = 4000, 10, 8, 0.3
    target = np.random.default_rng(0).integers(2, 60, B)
    target[: B // 2] = 5  # half the rows in one class: enough draws to check q(w | c)
    words = np.zeros((B, k + 1), dtype=np.int64)
    classes = np.zeros((B, k + 1), dtype=np.int64)
    words[:, 0], classes[:, 0] = target, wc[target]
    keep = np.zeros((B, E), dtype=np.bool_)
    _draw(11, classes, words, fused.class_cum, fused.word_keys, fused.word_order, keep.view(np.uint8), p)
    q_class = np.exp(noise.log_q_class.numpy())
    q_class[q_class < 1e-20] = 0.0
    seen = np.bincount(classes[:, 1:].ravel(), minlength=6) / classes[:, 1:].size
    np.testing.assert_allclose(seen, q_class, atol=0.01)  # 40,000 draws: a few thousandths of spread
    assert seen[wc[1]] == 0.0  # the class holding only <s> is never drawn
    assert (wc[words[:, 1:]] == wc[target][:, None]).all()  # each row's noise words are its class's
    assert (words[:, 1:] != 1).all()  # never <s>
    c = wc[5]
    in_class = np.flatnonzero(wc == c)
    drawn = words[: B // 2, 1:].ravel()
    q_in = np.exp(noise.log_q_word.numpy()[in_class])
    np.testing.assert_allclose(np.bincount(drawn, minlength=60)[in_class] / drawn.size, q_in, atol=0.015)
    assert keep.mean() == pytest.approx(1 - p, abs=0.01)
    for a, b in ((0, 1), (0, 4), (3, 7)):  # units drawn from the same and from other 64-bit draws
        assert abs(np.corrcoef(keep[:, a], keep[:, b])[0, 1]) < 0.05
    again = words.copy()
    _draw(11, classes, again, fused.class_cum, fused.word_keys, fused.word_order, keep.view(np.uint8), p)
    assert (again == words).all()  # one seed, one draw


def _fused_for_checks() -> tuple[FusedNCE, NeuralLM, torch.optim.Optimizer, NoiseDistribution]:
    model, counts = _model(30, 3, 4, 8, "none", (32, 64), 0, seed=1)
    opt = _optimizer(model, "adagrad")
    noise = NoiseDistribution(counts, model.output.word_class.numpy(), torch.device("cpu"))  # type: ignore[union-attr, operator]
    return FusedNCE(model, opt, noise), model, opt, noise


@pytest.mark.parametrize("array, position, bad", [
    ("target", 3, 30), ("target", 0, -1), ("ctx", (2, 1), 30), ("ctx", (0, 0), -3),
    ("noise_words", (1, 2), 30), ("noise_words", (5, 0), -1), ("noise_classes", (0, 3), 3),
    ("noise_classes", (7, 1), -2)])
def test_ids_out_of_range_are_refused_before_the_kernel_runs(array: str, position: Any, bad: int) -> None:
    # the kernel reads without bounds checks: the step refuses the minibatch, names the
    # array and the id, and changes nothing (parameters, accumulators, step counts)
    fused, model, opt, noise = _fused_for_checks()
    rng = np.random.default_rng(0)
    arrays = {"ctx": rng.integers(0, 30, (16, 3)), "target": rng.integers(2, 30, 16)}
    gen = torch.Generator()
    gen.manual_seed(0)
    nc, nw = noise.sample(model, torch.from_numpy(arrays["target"]), 4, gen)
    assert nc is not None
    arrays["noise_classes"], arrays["noise_words"] = nc.numpy().copy(), nw.numpy().copy()
    arrays[array][position] = bad
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sums_before = {name: opt.state[p]["sum"].clone() for name, p in model.named_parameters()}
    limit = 3 if array == "noise_classes" else 30
    with pytest.raises(ValueError, match=rf"fused step: {array} holds id {bad}, outside \[0, {limit}\)"):
        fused.step(arrays["ctx"], arrays["target"], arrays["noise_classes"], arrays["noise_words"], None, 0.0)
    if array in ("ctx", "target"):  # the step's own noise: the same check first
        with pytest.raises(ValueError, match=rf"fused step: {array} holds id {bad}"):
            fused.step(arrays["ctx"], arrays["target"], None, None, None, 0.2, k=4, seed=1)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert torch.equal(opt.state[p]["sum"], sums_before[name]), name
        assert float(opt.state[p]["step"]) == 0.0, name
    assert fused._views is None  # no views made, no step counted


def test_the_noise_tables_are_checked_when_the_step_is_made() -> None:
    _, model, opt, noise = _fused_for_checks()
    noise._order = noise._order.clone()
    noise._order[0] = 30  # a word the vocabulary has not: the step's own draws would read past R
    with pytest.raises(ValueError, match=r"fused step: the noise's word order holds id 30, outside \[0, 30\)"):
        FusedNCE(model, opt, noise)


def test_parameters_and_accumulators_have_the_same_names() -> None:
    # the kernel takes the parameters and their AdaGrad sums as two structures of the same
    # field names (of two types, so that mypy refuses them swapped): params.X is updated with
    # sums.X, which is the optimiser's state of that very tensor
    from nlmserve.lm.fused import Params, Sums

    assert Params._fields == Sums._fields and Params is not Sums
    fused, model, opt, _ = _fused_for_checks()
    rng = np.random.default_rng(0)
    fused.step(rng.integers(0, 30, (16, 3)), rng.integers(2, 30, 16), None, None, None, 0.0, k=4, seed=1)
    assert fused._views is not None
    _, params, sums = fused._views
    assert isinstance(params, Params) and isinstance(sums, Sums)
    for name, tensor in zip(Params._fields, fused.tensors):
        assert tensor is not None, name
        param, acc = getattr(params, name), getattr(sums, name)
        assert param.shape == acc.shape, name
        assert np.shares_memory(param, tensor.detach().numpy()), name
        assert np.shares_memory(acc, opt.state[tensor]["sum"].numpy()), name
    views = fused._views
    fused.step(rng.integers(0, 30, (16, 3)), rng.integers(2, 30, 16), None, None, None, 0.0, k=4, seed=2)
    assert fused._views is views  # made once, kept while the memory stays
    model.share_memory()  # --workers: the parameters move, the views follow
    fused.step(rng.integers(0, 30, (16, 3)), rng.integers(2, 30, 16), None, None, None, 0.0, k=4, seed=3)
    assert fused._views is not views
    assert np.shares_memory(fused._views[1].Q, model.embed.weight.detach().numpy())
