"""The network: normalisation for every output/context type, the NCE loss by hand,
gradients against finite differences, in-class normaliser strategies."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest
import torch
from torch.func import functional_call

from nlmserve.lm.classes import frequency_binning
from nlmserve.lm.config import ModelConfig
from nlmserve.lm.model import NeuralLM
from nlmserve.lm.objectives import NoiseDistribution, batch_loss, mle_loss, nce_loss
from nlmserve.lm.vocab import BOS_ID

torch.set_num_threads(1)


def make_model(output: str, context: str = "diagonal", hidden: int = 0, activation: str = "none",
               V: int = 40, K: int = 6, order: int = 4, dim: int = 8, seed: int = 0,
               bos_alone: bool = False) -> NeuralLM:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 100, size=V)
    counts[BOS_ID] = 0
    word_class = None
    if output == "class":
        word_class = frequency_binning(counts, K).word_class.copy()
        if bos_alone:  # <s> alone in a class of its own
            word_class[word_class == K - 1] = 0
            word_class[BOS_ID] = K - 1
    cfg = ModelConfig(vocab_size=V, order=order, dim=dim, context=context, hidden=hidden,
                      activation=activation, output=output, num_classes=K if output == "class" else 0)
    torch.manual_seed(seed)
    model = NeuralLM(cfg, word_class)
    model.init_biases(counts)
    with torch.no_grad():  # spread the scores so that errors would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


CASES = [
    ("class", "diagonal", 0, "none", False),
    ("class", "full", 0, "none", False),
    ("class", "diagonal", 6, "tanh", False),
    ("class", "full", 5, "relu", False),
    ("class", "diagonal", 0, "none", True),
    ("softmax", "diagonal", 0, "none", False),
    ("softmax", "full", 7, "tanh", False),
]


@pytest.mark.parametrize("output,context,hidden,activation,bos_alone", CASES)
def test_distribution_sums_to_one_and_never_predicts_bos(output: str, context: str, hidden: int,
                                                        activation: str, bos_alone: bool) -> None:
    model = make_model(output, context, hidden, activation, bos_alone=bos_alone)
    V = model.config.vocab_size
    ctx = torch.randint(0, V, (64, model.config.order - 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp = model.full_log_probs(ctx)  # (64, V)
        assert torch.isneginf(logp[:, BOS_ID]).all()
        total = torch.logsumexp(logp, dim=-1).exp()
        assert (total - 1).abs().max().item() < 1e-4
        # log_prob of every non-<s> word equals the full distribution
        targets = torch.tensor([w for w in range(V) if w != BOS_ID])
        c = ctx.repeat_interleave(len(targets), 0)
        t = targets.repeat(len(ctx))
        lp = model.log_prob(c, t).view(len(ctx), -1)
        assert torch.allclose(lp, logp[:, targets], atol=1e-5)


def test_grouped_and_padded_in_class_normalisers_agree() -> None:
    model = make_model("class", V=60, K=7)
    ctx = torch.randint(0, 60, (50, 3))
    cls = torch.randint(0, 7, (50,))
    with torch.no_grad():
        r = model.encode(ctx)
        a = model.output.in_class_log_normalizer(r, cls, method="grouped")
        b = model.output.in_class_log_normalizer(r, cls, method="padded")
    assert torch.allclose(a, b, atol=1e-5)


def test_class_scores_by_gemm_and_by_gather_agree_with_their_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCE scores m classes per row through one GEMM over all K classes when K is small
    # enough, otherwise by gathering the m class vectors; both must give the same scores
    # and the same gradients, and both must match the one-class-per-row path.
    import nlmserve.lm.outputs.class_factored as model_module

    model = make_model("class", V=60, K=7, bos_alone=True)
    ctx = torch.randint(0, 60, (30, 3))
    cls = torch.randint(0, 7, (30, 4))
    results = []
    for per_score in (model_module.GEMM_CLASSES_PER_SCORE, 0):
        monkeypatch.setattr(model_module, "GEMM_CLASSES_PER_SCORE", per_score)
        model.zero_grad()
        s = model.output.class_score(model.encode(ctx), cls)
        (s[torch.isfinite(s)] * torch.linspace(-1, 1, int(torch.isfinite(s).sum()))).sum().backward()
        results.append((s.detach(), [p.grad.clone() for p in (model.output.class_embed, model.ctx_weight, model.embed.weight)]))
    (s_gemm, g_gemm), (s_gather, g_gather) = results
    assert torch.equal(torch.isinf(s_gemm), torch.isinf(s_gather)) and torch.isinf(s_gemm).any()
    finite = torch.isfinite(s_gemm)
    torch.testing.assert_close(s_gemm[finite], s_gather[finite], atol=1e-5, rtol=0)
    for a, b in zip(g_gemm, g_gather):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        r = model.encode(ctx)
        one_by_one = torch.stack([model.output.class_score(r, cls[:, j]) for j in range(cls.shape[1])], dim=1)
    torch.testing.assert_close(one_by_one[finite], s_gemm[finite], atol=1e-5, rtol=0)


def test_class_layout_partitions_the_vocabulary() -> None:
    model = make_model("class", V=50, K=9)
    order = model.output.class_order.tolist()
    assert sorted(order) == list(range(50))
    offsets = model.output.class_offsets.tolist()
    assert offsets[0] == 0 and offsets[-1] == 50
    for c in range(9):
        words = order[offsets[c]: offsets[c + 1]]
        assert words and all(model.output.word_class[w].item() == c for w in words)


def test_biases_start_from_log_unigram_frequencies() -> None:
    counts = np.array([3, 0, 10, 6, 1, 2])  # add-one: 4, 0, 11, 7, 2, 3 (<s> gets none)
    wc = np.array([0, 0, 0, 1, 1, 1])
    model = NeuralLM(ModelConfig(vocab_size=6, order=2, dim=2, num_classes=2), wc)
    model.init_biases(counts)
    assert model.output.class_bias.tolist() == pytest.approx([math.log(15 / 27), math.log(12 / 27)], abs=1e-6)
    assert model.output.word_bias[3].item() == pytest.approx(math.log(7 / 12), abs=1e-6)
    assert model.output.word_bias[0].item() == pytest.approx(math.log(4 / 15), abs=1e-6)


def _toy() -> tuple[NeuralLM, NoiseDistribution]:
    """Six words {<unk>, <s>, </s>, a, b, c}; classes {<unk>, <s>, </s>} and {a, b, c};
    bigram model, D = 2, fixed weights."""
    wc = np.array([0, 0, 0, 1, 1, 1])
    model = NeuralLM(ModelConfig(vocab_size=6, order=2, dim=2, num_classes=2), wc)
    with torch.no_grad():
        model.embed.weight.copy_(torch.tensor([[0.1, 0.2], [0.3, -0.1], [0.0, 0.5], [-0.2, 0.4], [0.5, 0.5], [1.0, -1.0]]))
        model.ctx_weight.copy_(torch.tensor([[2.0, 0.5]]))
        model.output.word_embed.copy_(torch.tensor([[0.2, 0.1], [0.0, 0.0], [-0.3, 0.2], [0.4, -0.6], [0.1, 0.9], [-0.5, 0.3]]))
        model.output.word_bias.copy_(torch.tensor([-1.0, 0.0, -0.5, -0.2, -0.7, -1.2]))
        model.output.class_embed.copy_(torch.tensor([[0.3, -0.4], [0.6, 0.2]]))
        model.output.class_bias.copy_(torch.tensor([-0.3, -0.9]))
    counts = np.array([1, 0, 3, 4, 2, 2])  # q(c0)=4/12, q(c1)=8/12; q(a|c1)=4/8, q(</s>|c0)=3/4
    return model, NoiseDistribution(counts, wc, torch.device("cpu"))


def test_nce_loss_equals_hand_computation_on_six_word_toy() -> None:
    model, noise = _toy()
    ctx = torch.tensor([[1], [3]])  # contexts <s>, a
    target = torch.tensor([3, 2])  # a | <s>,  </s> | a
    noise_classes = torch.tensor([[0, 1], [1, 1]])
    noise_words = torch.tensor([[4, 5], [0, 0]])  # inside the target's class
    loss = nce_loss(model, ctx, target, noise, noise_classes, noise_words).item()

    emb = {1: (0.3, -0.1), 3: (-0.2, 0.4)}
    R = [(0.2, 0.1), (0.0, 0.0), (-0.3, 0.2), (0.4, -0.6), (0.1, 0.9), (-0.5, 0.3)]
    bw = [-1.0, 0.0, -0.5, -0.2, -0.7, -1.2]
    S, bc = [(0.3, -0.4), (0.6, 0.2)], [-0.3, -0.9]
    q_class = [4 / 12, 8 / 12]
    q_word = [1 / 4, 0.0, 3 / 4, 4 / 8, 2 / 8, 2 / 8]
    cls_of = [0, 0, 0, 1, 1, 1]
    k = 2

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    total = 0.0
    for (c_id,), t, ncs, nws in [((1,), 3, (0, 1), (4, 5)), ((3,), 2, (1, 1), (0, 0))]:
        r = (2.0 * emb[c_id][0], 0.5 * emb[c_id][1])
        s_c = lambda c: S[c][0] * r[0] + S[c][1] * r[1] + bc[c]  # noqa: E731
        s_w = lambda w: R[w][0] * r[0] + R[w][1] * r[1] + bw[w]  # noqa: E731
        ct = cls_of[t]
        class_term = -math.log(sig(s_c(ct) - math.log(k * q_class[ct])))
        class_term -= sum(math.log(1 - sig(s_c(c) - math.log(k * q_class[c]))) for c in ncs)
        word_term = -math.log(sig(s_w(t) - math.log(k * q_word[t])))
        word_term -= sum(math.log(1 - sig(s_w(w) - math.log(k * q_word[w]))) for w in nws)
        total += class_term + word_term
    assert loss == pytest.approx(total / 2, abs=1e-6)


def test_noise_samples_stay_inside_the_target_class_and_follow_unigram() -> None:
    model = make_model("class", V=60, K=5)
    counts = np.arange(60) + 1
    counts[BOS_ID] = 0
    noise = NoiseDistribution(counts, model.output.word_class.numpy(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    cls = torch.arange(5).repeat_interleave(4000)
    words = noise.sample_words_in_class(cls, 5, gen)
    assert (model.output.word_class[words] == cls[:, None]).all()
    assert not (words == BOS_ID).any()
    c = 2
    members = [w for w in range(60) if model.output.word_class[w] == c]
    drawn = words[cls == c].flatten()
    freq = torch.bincount(drawn, minlength=60)[members].double() / drawn.numel()
    expected = torch.tensor([counts[w] for w in members], dtype=torch.float64)
    assert torch.allclose(freq, expected / expected.sum(), atol=0.02)


@pytest.mark.parametrize("objective,output,context,hidden", [
    ("nce", "class", "diagonal", 0),
    ("nce", "class", "full", 3),
    ("mle", "class", "diagonal", 0),
    ("mle", "class", "full", 4),
    ("softmax", "softmax", "diagonal", 3),
    ("nce", "softmax", "diagonal", 0),
])
def test_gradients_match_finite_differences(objective: str, output: str, context: str, hidden: int) -> None:
    model = make_model(output, context, hidden, "tanh" if hidden else "none", V=12, K=3, order=3, dim=3).double()
    ctx = torch.randint(0, 12, (5, 2), generator=torch.Generator().manual_seed(2))
    target = torch.tensor([0, 2, 3, 5, 11])
    noise = NoiseDistribution(np.arange(12) + 1, model.output.word_class.numpy() if output == "class" else None,
                              torch.device("cpu"))
    noise_classes, noise_words = noise.sample(model, target, 3, torch.Generator().manual_seed(5))
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in model.named_parameters())

    def loss_of(m: NeuralLM) -> torch.Tensor:
        if objective == "nce":
            return nce_loss(m, ctx, target, noise, noise_classes, noise_words)
        return mle_loss(m, ctx, target)

    wrapper = _LossOf(model, loss_of)

    def f(*ps: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapper, {"model." + n: p for n, p in zip(names, ps)}, ())

    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-5, rtol=1e-4)


class _LossOf(torch.nn.Module):
    """A module whose forward is a loss of ``model``, for torch.func.functional_call."""

    def __init__(self, model: NeuralLM, fn: Callable[[NeuralLM], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self) -> torch.Tensor:
        return self.fn(self.model)


def test_batch_loss_rejects_unknown_objective() -> None:
    model = make_model("class")
    with pytest.raises(ValueError, match="objective"):
        batch_loss("hinge", model, torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 4]))
