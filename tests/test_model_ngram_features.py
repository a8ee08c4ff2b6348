"""Direct hashed n-gram features (OxLM): hash values by hand, normalisation, gradients,
sparse updates, the model file and the server's cached pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.func import functional_call

from nlmserve.lm.classes import frequency_binning
from nlmserve.lm.config import ModelConfig
from nlmserve.lm.model import NeuralLM
from nlmserve.lm.outputs.class_factored import (HASH_CTX, HASH_KEY, HASH_MOD, HASH_OUT, HASH_SEED, NO_HASH, context_hashes,
                                  ngram_feature_index)
from nlmserve.lm.objectives import NoiseDistribution, mle_loss, nce_loss
from nlmserve.lm.vocab import BOS_ID

torch.set_num_threads(1)


def make_model(V: int = 30, K: int = 5, order: int = 4, dim: int = 6, class_table: int = 13,
               word_table: int = 17, seed: int = 0) -> NeuralLM:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 100, size=V)
    counts[BOS_ID] = 0
    wc = frequency_binning(counts, K).word_class.copy()
    cfg = ModelConfig(vocab_size=V, order=order, dim=dim, num_classes=K,
                      ngram_class_table=class_table, ngram_word_table=word_table)
    torch.manual_seed(seed)
    model = NeuralLM(cfg, wc)
    model.init_biases(counts)
    with torch.no_grad():  # non-zero feature weights (they start at zero) and spread scores
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def test_hash_slots_and_feature_value_by_hand() -> None:
    # Context (oldest first) 5 7, order 3: suffixes "" , "7", "5 7".
    h0 = HASH_SEED
    h1 = (h0 * HASH_CTX + 7 + 1) % HASH_MOD
    h2 = (h1 * HASH_CTX + 5 + 1) % HASH_MOD
    assert context_hashes(torch.tensor([[5, 7]])).tolist() == [[h0, h1, h2]]
    size, word = 101, 9
    slots = [((h * HASH_KEY + word * HASH_OUT) % HASH_MOD) % size for h in (h0, h1, h2)]
    assert ngram_feature_index(torch.tensor([[h0, h1, h2]]), torch.tensor([word]), size).tolist() == [slots]
    # The feature adds exactly the sum of the three slots' weights to the word score.
    cfg = ModelConfig(vocab_size=12, order=3, dim=2, num_classes=3, ngram_word_table=size, ngram_class_table=7)
    model = NeuralLM(cfg, np.arange(12) % 3)
    ctx, tgt = torch.tensor([[5, 7]]), torch.tensor([word])
    with torch.no_grad():
        before = float(model.output.word_score(model.encode(ctx), tgt, ctx))
        assert model.output.ngram_word is not None
        for i, s in enumerate(slots):
            model.output.ngram_word[s, 0] += 0.25 * (i + 1)  # 0.25 + 0.5 + 0.75 (adds up on a collision)
        after = float(model.output.word_score(model.encode(ctx), tgt, ctx))
    assert after - before == pytest.approx(1.5, abs=1e-6)



def test_feature_order_caps_the_suffixes_by_hand(tmp_path: Path) -> None:
    """Order 5 with ngram_order 3: the word score gets the features of the suffixes "", "7",
    "5 7" (trigrams at most); the older context words change the LBL part only."""
    from nlmserve.lm.model_file import read_model_file, save_model
    from nlmserve.lm.vocab import Vocabulary

    size, word = 101, 9
    h0 = HASH_SEED
    h1 = (h0 * HASH_CTX + 7 + 1) % HASH_MOD
    h2 = (h1 * HASH_CTX + 5 + 1) % HASH_MOD
    slots = [((h * HASH_KEY + word * HASH_OUT) % HASH_MOD) % size for h in (h0, h1, h2)]
    cfg = ModelConfig(vocab_size=12, order=5, dim=2, num_classes=3, ngram_word_table=size, ngram_class_table=7,
                      ngram_order=3)
    assert cfg.feature_order == 3 and ModelConfig(vocab_size=12, order=5, num_classes=3).feature_order == 5
    classes = frequency_binning(np.arange(12) + 1, 3)
    model = NeuralLM(cfg, classes.word_class.copy())
    ctx, tgt = torch.tensor([[3, 4, 5, 7]]), torch.tensor([word])
    with torch.no_grad():
        assert model.encode(ctx).shape == (1, 2)  # the context vector alone; the ids go beside it
        h = model.output.hashes(ctx)
        assert h is not None and h.tolist() == [[h0, h1, h2]]
        before = float(model.output.word_score(model.encode(ctx), tgt, ctx))
        assert model.output.ngram_word is not None
        for i, s in enumerate(slots):
            model.output.ngram_word[s, 0] += 0.25 * (i + 1)
        after = float(model.output.word_score(model.encode(ctx), tgt, ctx))
        full = model.double().full_log_probs(ctx)
    assert after - before == pytest.approx(1.5, abs=1e-6)
    assert float(full.exp().sum()) == pytest.approx(1.0, abs=1e-10)
    with pytest.raises(ValueError, match="ngram_order"):
        ModelConfig(vocab_size=12, order=5, num_classes=3, ngram_word_table=size, ngram_order=6)
    from nlmserve.lm.train import TrainConfig

    with pytest.raises(ValueError, match="needs the direct n-gram features"):
        TrainConfig(train="t", valid="v", out=str(tmp_path / "m.nlm"), ngram_order=3)
    # The field round-trips through the model file (format 2 or later: older readers refuse it by version).
    words = Vocabulary([f"w{i}" for i in range(9)])
    path = tmp_path / "capped.nlm"
    save_model(path, model.float(), words, classes, objective="nce", lowercase=False)
    mf = read_model_file(path)
    assert mf.format_version >= 2 and mf.config == cfg
    # The scoring tables (GetScoringTables, scoring=local) carry the capped features: the
    # same row scores 1.5 more than the tables' LBL part alone.
    import dataclasses

    from nlmserve.lm.scoring import LanguageModel

    tables = LanguageModel.load(path, device="cpu").scoring_tables()
    assert tables.feature_order == 3 and tables.feature_tables == (7, size)
    lbl = dataclasses.replace(tables, feature_order=0, word_class=None, ngram_class=None, ngram_word=None)
    row = [[3, 4, 5, 7, word]]
    assert float(tables.score(row)[0] - lbl.score(row)[0]) == pytest.approx(1.5, abs=1e-6)


def test_the_no_word_has_no_row_and_no_feature_by_hand() -> None:
    """Context ? 7 (? the no-word, id V = 12: a word that is not known): the suffixes "" and
    "7" keep their hashes and "? 7" has NO_HASH, so the feature adds the first two slots'
    weights only (0.25 + 0.5); its context vector is 7's position row alone, as the context
    5 7 with q(5) zeroed; and every distribution with no-words still sums to one."""
    size, word, V = 101, 9, 12
    h0 = HASH_SEED
    h1 = (h0 * HASH_CTX + 7 + 1) % HASH_MOD
    assert context_hashes(torch.tensor([[V, 7], [V, V]]), no_word=V).tolist() == [[h0, h1, NO_HASH], [h0, NO_HASH, NO_HASH]]
    slots = [((h * HASH_KEY + word * HASH_OUT) % HASH_MOD) % size for h in (h0, h1)]
    cfg = ModelConfig(vocab_size=V, order=3, dim=2, num_classes=3, ngram_word_table=size, ngram_class_table=7)
    model = NeuralLM(cfg, np.arange(V) % 3)
    ctx, tgt = torch.tensor([[V, 7]]), torch.tensor([word])
    with torch.no_grad():
        before = float(model.output.word_score(model.encode(ctx), tgt, ctx))
        assert model.output.ngram_word is not None
        for i, s in enumerate(slots):
            model.output.ngram_word[s, 0] += 0.25 * (i + 1)
        after = float(model.output.word_score(model.encode(ctx), tgt, ctx))
        zeroed = model.embed.weight.clone()
        zeroed[5] = 0
        model.embed.weight.copy_(zeroed)
        assert torch.equal(model.encode(ctx), model.encode(torch.tensor([[5, 7]])))
        full = model.full_log_probs(torch.tensor([[V, 7], [V, V], [V, BOS_ID]]))
    assert after - before == pytest.approx(0.75, abs=1e-6)
    assert torch.allclose(full.exp().sum(dim=1), torch.ones(3), atol=1e-5)


def test_context_hash_depends_on_every_suffix_word_and_only_on_the_suffix() -> None:
    h = context_hashes(torch.tensor([[3, 4, 5], [9, 4, 5], [3, 8, 5], [3, 4, 6]]))
    assert h[:, 0].unique().numel() == 1  # empty suffix
    assert h[0, 2] == h[1, 2] and h[0, 3] != h[1, 3]  # "4 5" shared, "3 4 5" not
    assert h[0, 1] == h[2, 1] and h[0, 2] != h[2, 2]
    assert h[0, 1] != h[3, 1]


@pytest.mark.parametrize("class_table,word_table", [(13, 17), (0, 17), (13, 0)])
def test_distribution_sums_to_one_with_features(class_table: int, word_table: int) -> None:
    model = make_model(class_table=class_table, word_table=word_table).double()
    ctx = torch.randint(0, 30, (16, 3), generator=torch.Generator().manual_seed(1))
    ctx[3] = BOS_ID
    with torch.no_grad():
        full = model.full_log_probs(ctx)
        assert torch.all(full[:, BOS_ID] == -np.inf)
        total = full.exp().sum(dim=1)
        assert torch.allclose(total, torch.ones_like(total), atol=1e-10)
        targets = torch.arange(2, 30).repeat(16, 1)  # every word but <unk> and <s>
        rows = torch.arange(16).unsqueeze(1).expand_as(targets)
        lp = model.log_prob(ctx[rows.reshape(-1)], targets.reshape(-1)).view(16, -1)
        assert torch.allclose(lp, full[:, 2:], atol=1e-10)
        r = model.encode(ctx)
        cls = model.output.word_class[torch.full((16,), 7)]
        grouped = model.output.in_class_log_normalizer(r, cls, ctx)
        padded = model.output.in_class_log_normalizer(r, cls, ctx, method="padded")
        assert torch.allclose(grouped, padded, atol=1e-10)


def test_features_change_the_distribution() -> None:
    model = make_model()
    ctx = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        a = model.full_log_probs(ctx)
        assert model.output.ngram_word is not None and model.output.ngram_class is not None
        model.output.ngram_word.zero_()
        model.output.ngram_class.zero_()
        b = model.full_log_probs(ctx)
    assert (a - b)[:, 2:].abs().max() > 0.1


@pytest.mark.parametrize("objective", ["nce", "mle"])
def test_gradients_match_finite_differences_with_features(objective: str) -> None:
    model = make_model(V=12, K=3, order=3, dim=3, class_table=5, word_table=7).double()
    ctx = torch.randint(0, 12, (5, 2), generator=torch.Generator().manual_seed(2))
    target = torch.tensor([0, 2, 3, 5, 11])
    noise = NoiseDistribution(np.arange(12) + 1, model.output.word_class.numpy(), torch.device("cpu"))
    noise_classes, noise_words = noise.sample(model, target, 3, torch.Generator().manual_seed(5))
    names = [n for n, _ in model.named_parameters()]
    assert "output.ngram_class" in names and "output.ngram_word" in names
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in model.named_parameters())

    class LossOf(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self) -> torch.Tensor:
            if objective == "nce":
                return nce_loss(self.model, ctx, target, noise, noise_classes, noise_words)
            return mle_loss(self.model, ctx, target)

    wrapper = LossOf()

    def f(*ps: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapper, {"model." + n: p for n, p in zip(names, ps)}, ())

    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("objective", ["nce", "mle"])
def test_sparse_feature_gradients_equal_dense(objective: str) -> None:
    model = make_model(V=20, K=4, order=3, dim=4, class_table=11, word_table=9)
    ctx = torch.randint(0, 20, (8, 2), generator=torch.Generator().manual_seed(3))
    target = torch.randint(2, 20, (8,), generator=torch.Generator().manual_seed(4))
    noise = NoiseDistribution(np.arange(20) + 1, model.output.word_class.numpy(), torch.device("cpu"))
    nc, nw = noise.sample(model, target, 4, torch.Generator().manual_seed(5))
    grads = []
    for sparse in (False, True):
        model.zero_grad(set_to_none=True)
        model.output.feature_sparse = sparse
        loss = nce_loss(model, ctx, target, noise, nc, nw) if objective == "nce" else mle_loss(model, ctx, target)
        loss.backward()
        assert model.output.ngram_word is not None and model.output.ngram_class is not None
        gw, gc = model.output.ngram_word.grad, model.output.ngram_class.grad
        assert gw is not None and gc is not None and gw.is_sparse == sparse
        grads.append((gw.to_dense(), gc.to_dense()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)
    assert grads[0][0].abs().sum() > 0 and grads[0][1].abs().sum() > 0


def test_config_rejects_features_with_softmax_output() -> None:
    with pytest.raises(ValueError, match="class output"):
        ModelConfig(vocab_size=10, output="softmax", ngram_word_table=8)


# ---------------------------------------------------------------------- trained model file


def test_trained_model_file_round_trip_and_normalisation(feature_model_path: Path, tmp_path: Path) -> None:
    from nlmserve.lm.model_file import read_model_file, save_model
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(feature_model_path, device="cpu")
    assert lm.config.ngram_word_table == 4096 and lm.config.ngram_class_table == 1024
    mf = read_model_file(feature_model_path)
    assert mf.tensors["ngram_word"].shape == (4096, 1)
    assert np.abs(mf.tensors["ngram_word"]).max() > 0  # training moved the features
    # Round trip: the same scores after writing the loaded network again.
    copy = tmp_path / "copy.nlm"
    save_model(copy, lm.net, lm.vocab, lm.classes, objective=lm.objective, lowercase=lm.lowercase,
               training=lm.training)
    lm2 = LanguageModel.load(copy, device="cpu")
    rng = np.random.default_rng(0)
    V = len(lm.vocab)
    rows = rng.integers(2, V, size=(50, 4))
    assert np.array_equal(lm.score_ngrams(rows), lm2.score_ngrams(rows))
    # Normalised over the vocabulary for some contexts (and <s> never predicted).
    for ctx in ([BOS_ID, BOS_ID, BOS_ID], [5, 9, 11], [int(x) for x in rng.integers(3, V, 3)]):
        grid = np.array([ctx + [w] for w in range(V) if w != BOS_ID])
        total = np.exp(lm.score_ngrams(grid).astype(np.float64)).sum()
        assert abs(total - 1.0) < 1e-4


def test_server_pieces_and_cached_scorer_with_features(feature_model_path: Path) -> None:
    from nlmserve.lm.scoring import LanguageModel
    from nlmserve.lm.cache import Scorer

    lm = LanguageModel.load(feature_model_path, device="cpu")
    rng = np.random.default_rng(1)
    V = len(lm.vocab)
    rows = rng.integers(2, V, size=(40, 4))
    rows[::5, :2] = BOS_ID
    rows = np.concatenate([rows, rows[:10]])  # repeated contexts hit the caches
    ctx, target = lm.prepare_contexts(rows)
    expected = lm.net.log_prob(ctx, target).detach().numpy()
    r = lm.encode_contexts(ctx)
    raw = lm.raw_score(r, target, ctx)
    cls = lm.word_classes(target)
    logp = raw - lm.class_log_normalizer(r, ctx) - lm.in_class_log_normalizer(r, cls, ctx)
    assert np.allclose(logp.numpy(), expected, atol=1e-5)
    assert np.allclose(lm.score_ngrams(rows), expected, atol=1e-5)
    assert np.allclose(lm.score_ngrams(rows, normalized=False), raw.numpy(), atol=1e-5)
    canon = np.concatenate([ctx.numpy(), target.numpy()[:, None]], axis=1)
    normalized = np.ones(len(rows), dtype=bool)
    normalized[1::3] = False
    want = np.where(normalized, expected, raw.numpy())
    for ngram_cache, context_cache in ((0, 0), (0, 64), (64, 64)):
        scorer = Scorer(lm, ngram_cache, context_cache)
        for _ in range(2):  # the second pass is served from the caches
            assert np.allclose(scorer.score(canon, normalized), want, atol=1e-5)


def test_hashed_adagrad_matches_torch_adagrad() -> None:
    from nlmserve.lm.optim import HashedAdagrad

    torch.sparse.check_sparse_tensor_invariants.disable()  # as training does (quietly)
    models = [make_model(V=20, K=4, order=3, dim=4, class_table=11, word_table=9) for _ in range(2)]
    for m in models:
        m.output.feature_sparse = True
        m.set_sparse_grads(True, True)
    ref = torch.optim.Adagrad(models[0].parameters(), lr=0.3)
    tables = [models[1].output.ngram_class, models[1].output.ngram_word]
    rest = [p for n, p in models[1].named_parameters() if not n.startswith("output.ngram_")]
    groups: list[dict[str, Any]] = [{"params": rest}, {"params": tables, "hashed": True}]
    fast = HashedAdagrad(groups, lr=0.3)
    noise = NoiseDistribution(np.arange(20) + 1, models[0].output.word_class.numpy(), torch.device("cpu"))
    for step in range(4):
        ctx = torch.randint(0, 20, (8, 2), generator=torch.Generator().manual_seed(step))
        target = torch.randint(2, 20, (8,), generator=torch.Generator().manual_seed(10 + step))
        nc, nw = noise.sample(models[0], target, 4, torch.Generator().manual_seed(20 + step))
        for m, opt in zip(models, (ref, fast)):
            opt.zero_grad()
            nce_loss(m, ctx, target, noise, nc, nw).backward()
            opt.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert models[1].output.ngram_word is not None and models[1].output.ngram_word.abs().sum() > 0


def test_scoring_tables_of_a_trained_feature_model_give_its_self_normalised_scores(
        feature_model_path: Path, dev_small_path: Path) -> None:
    """The tables a client evaluates itself hold the features too: their score of every
    n-gram of the dev text is ``score_ngrams(normalized=False)``, and the wire's flat array
    ends with the word classes and the two hashed tables."""
    from nlmserve.lm.scoring import LanguageModel

    lm = LanguageModel.load(feature_model_path, device="cpu")
    tables = lm.scoring_tables()
    assert tables.feature_order == 4 and tables.feature_tables == (1024, 4096)
    sentences = [line.split() for line in dev_small_path.read_text(encoding="utf-8").splitlines()[:40]]
    rows = lm.canonical_rows(lm.sentence_ngrams(sentences)[0])
    assert len(rows) > 500
    np.testing.assert_allclose(tables.score(rows), lm.score_ngrams(rows, normalized=False), rtol=0, atol=1e-5)
    V, D = lm.config.vocab_size, lm.config.dim
    flat = tables.flat()
    assert flat.size == 3 * V * D + V * D + V + V + 1024 + 4096
    np.testing.assert_array_equal(flat[4 * V * D + V: 4 * V * D + 2 * V], lm.net.output.word_class.numpy())
    np.testing.assert_array_equal(flat[-4096:], tables.ngram_word)
    # GetScoringTables streams that array, its first chunk naming the features.
    from support import streamed_tables

    head, got = streamed_tables(lm, 1000)
    assert (head.feature_order, head.ngram_class_table, head.ngram_word_table, head.total_floats) == (
        4, 1024, 4096, flat.size)
    assert head.output == "class"
    np.testing.assert_array_equal(got, flat)
