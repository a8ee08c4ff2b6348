"""Output trees: Huffman codes by hand, golden tree probabilities by hand, words with two
codes, the feature-based clustering rules, and normalisation of every output type."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nlmserve.lm.config import ModelConfig
from nlmserve.lm.model import NeuralLM
from nlmserve.lm.outputs.banded import default_bands
from nlmserve.lm.outputs.tree import TreeOutput
from nlmserve.lm.tree_clustering import cluster_tree
from nlmserve.lm.trees import Tree, huffman_tree, node_log_odds, random_tree, tree_from_splits, tree_words
from nlmserve.lm.vocab import BOS_ID


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_huffman_code_lengths_match_the_hand_built_tree() -> None:
    # The textbook example (Cormen et al., 16.3): counts 45, 13, 12, 16, 9, 5 give code
    # lengths 1, 3, 3, 3, 4, 4. Ids: 0 <unk>, 1 <s> (never a leaf), 2 </s>, 3.., so 7 ids.
    counts = np.array([45, 1000, 13, 12, 16, 9, 5])
    tree = huffman_tree(counts)
    lengths = {int(w): int(n) for w, n in zip(tree.code_word, tree.code_lengths())}
    assert lengths == {0: 1, 2: 3, 3: 3, 4: 3, 5: 4, 6: 4}
    assert tree.num_nodes == 5 and tree.num_codes == 6
    # Kraft: a full binary tree's code lengths satisfy Σ 2^-l = 1 exactly.
    assert sum(2.0 ** -n for n in lengths.values()) == 1.0
    # Prefix-free and all different.
    codes = [tree.codes_of(w)[0] for w in lengths]
    assert len(set(codes)) == 6
    assert not any(a != b and b.startswith(a) for a in codes for b in codes)


def test_random_tree_is_balanced_over_all_words_but_bos() -> None:
    tree = random_tree(11, seed=3)
    assert sorted(tree.code_word.tolist()) == [w for w in range(11) if w != BOS_ID]
    lengths = tree.code_lengths()
    assert lengths.min() >= 3 and lengths.max() == math.ceil(math.log2(10))
    assert not np.array_equal(random_tree(11, seed=3).code_word, random_tree(11, seed=4).code_word)


def _tree_output(tree: Tree, V: int, q: list[list[float]], b: list[float]) -> TreeOutput:
    out = TreeOutput(tree, V, 2)
    with torch.no_grad():
        out.node_embed.copy_(torch.tensor(q))
        out.node_bias.copy_(torch.tensor(b))
    return out


def test_golden_tree_probabilities_by_hand() -> None:
    # ((0, 2), 3): root 0 (left: node 1, right: word 3), node 1 (left: word 0, right: word 2).
    tree = tree_from_splits(((0, 2), 3), "test")
    out = _tree_output(tree, 4, [[0.5, -0.25], [0.2, 0.3]], [0.1, -0.4])
    r = torch.tensor([[1.0, 2.0]])
    x0 = 0.5 * 1 - 0.25 * 2 + 0.1  # 0.1
    x1 = 0.2 * 1 + 0.3 * 2 - 0.4  # 0.4
    want = {0: sig(x0) * sig(x1), 2: sig(x0) * sig(-x1), 3: sig(-x0)}
    for w, p in want.items():
        got = out.log_prob(r, torch.tensor([w])).item()
        assert got == pytest.approx(math.log(p), abs=1e-6)
    full = out.full_log_probs(r)[0]
    assert full[BOS_ID].item() == -math.inf
    assert full.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    assert tree.codes_of(0) == ["11"] and tree.codes_of(2) == ["10"] and tree.codes_of(3) == ["0"]


def test_a_word_with_two_codes_gets_the_sum_of_both_paths() -> None:
    # ((0, 3), (3, (2, 4))): word 3 is a leaf under both children of the root.
    tree = tree_from_splits(((0, 3), (3, (2, 4))), "test")
    assert sorted(tree.codes_of(3)) == ["01", "10"]
    q = [[0.3, -0.1], [0.7, 0.2], [-0.4, 0.5], [0.1, 0.1]]
    b = [0.2, -0.3, 0.05, 0.4]
    out = _tree_output(tree, 5, q, b)
    r = torch.tensor([[0.6, -1.2]])
    x = [q[n][0] * 0.6 - q[n][1] * 1.2 + b[n] for n in range(4)]
    # Nodes in creation order: 0 root, 1 = (0, 3), 2 = (3, (2, 4)), 3 = (2, 4).
    p3 = sig(x[0]) * sig(-x[1]) + sig(-x[0]) * sig(x[2])
    assert out.log_prob(r, torch.tensor([3])).item() == pytest.approx(math.log(p3), abs=1e-6)
    full = out.full_log_probs(r)[0].exp()
    assert full[3].item() == pytest.approx(p3, abs=1e-6)
    assert full.sum().item() == pytest.approx(1.0, abs=1e-6)
    # (N, k) shapes as in batched scoring.
    two = out.log_prob(r, torch.tensor([[3, 0]]))
    assert two.shape == (1, 2) and two[0, 0].item() == pytest.approx(math.log(p3), abs=1e-6)


def test_bias_initialisation_gives_the_unigram() -> None:
    counts = np.array([9, 0, 4, 2, 1, 0])
    tree = huffman_tree(counts)
    out = TreeOutput(tree, 6, 3)
    with torch.no_grad():
        out.node_embed.zero_()
        out.node_bias.copy_(torch.from_numpy(node_log_odds(tree, counts)))
    with torch.no_grad():
        p = out.full_log_probs(torch.zeros(1, 3))[0].exp().numpy()
    add_one = counts + 1.0
    add_one[BOS_ID] = 0
    np.testing.assert_allclose(p, add_one / add_one.sum(), atol=1e-6)


def _features(V: int, seed: int) -> np.ndarray:
    """Two well separated groups of words, and a few words half way between them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.05, size=(V, 4))
    x[: V // 2, 0] += 3.0
    x[V // 2 :, 0] -= 3.0
    x[-3:, 0] = 0.0
    return x


@pytest.mark.parametrize("rule", ["balanced", "adaptive", "adaptive-eps"])
def test_clustering_rules(rule: str) -> None:
    V = 40
    words = tree_words(V)
    tree = cluster_tree(_features(V, 1), words, rule, eps=0.45, seed=2)
    tree.validate(V)
    counts = np.bincount(tree.code_word, minlength=V)
    assert counts[BOS_ID] == 0
    if rule == "adaptive-eps":
        assert counts.max() >= 2  # the words half way belong to both groups
        assert counts.max() <= 4
    else:
        assert (counts[words] == 1).all()
    if rule == "balanced":
        lengths = tree.code_lengths()
        assert lengths.max() - lengths.min() <= 1
    # The first split separates the two groups (bar the words half way).
    first_left = {int(w) for w in tree.code_word[tree.code_bits[:, 0] == 1]}
    group_a = {int(w) for w in words if w < V // 2}
    assert group_a <= first_left or not (group_a & first_left - set(range(V - 3, V)))


def _random_model(output: str, V: int = 23, seed: int = 0) -> NeuralLM:
    torch.manual_seed(seed)
    extra: dict[str, object] = {}
    tree = None
    if output in ("huffman", "random", "balanced", "adaptive", "adaptive-eps"):
        counts = np.arange(V)[::-1] * 3 + 1
        if output == "huffman":
            tree = huffman_tree(counts)
        elif output == "random":
            tree = random_tree(V, 5)
        else:
            tree = cluster_tree(np.random.default_rng(1).normal(size=(V, 3)), tree_words(V), output, eps=0.3)
        extra = {"output": "tree", "tree_nodes": tree.num_nodes, "tree_method": tree.method}
    elif output == "dsoftmax":
        extra = {"output": "dsoftmax", "band_sizes": (5, 8, V - 13), "band_dims": (4, 2, 2)}
    else:
        extra = {"output": output}
    config = ModelConfig(vocab_size=V, order=3, dim=8, **extra)  # type: ignore[arg-type]
    model = NeuralLM(config, tree=tree)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.7)
    return model


OUTPUTS = ["huffman", "random", "balanced", "adaptive", "adaptive-eps", "dsoftmax", "softmax"]


@pytest.mark.parametrize("output", OUTPUTS)
def test_every_output_sums_to_one(output: str) -> None:
    model = _random_model(output)
    ctx = torch.tensor([[1, 1], [4, 7], [12, 3], [22, 0]])
    with torch.no_grad():
        logp = model.full_log_probs(ctx)
    assert torch.isinf(logp[:, BOS_ID]).all()
    np.testing.assert_allclose(logp.exp().sum(1).numpy(), 1.0, atol=1e-4)
    # log_prob of each word agrees with the full distribution.
    for w in (0, 2, 9, 22):
        with torch.no_grad():
            lp = model.log_prob(ctx, torch.full((4,), w))
        np.testing.assert_allclose(lp.numpy(), logp[:, w].numpy(), atol=1e-5)


def test_default_bands_cover_the_vocabulary_and_the_width() -> None:
    assert default_bands(50_000, 128) == ((2500, 7500, 40_000), (64, 32, 32))
    assert default_bands(5000, 128) == ((2500, 2500), (96, 32))
    assert default_bands(100, 16) == ((100,), (16,))


def test_tree_paths_of_the_golden_tree_by_hand() -> None:
    """The scoring tables' layout of ((0, 2), 3) over 4 words (<s> = 1 has no code): word 0
    goes left, left (steps 2·0+1, 2·1+1), word 2 left, right (1, 2), word 3 right (0); the
    same arrays as the C++ unit test's tree (client/cpp/nlmserve_unit_test.cpp)."""
    paths = tree_from_splits(((0, 2), 3), "test").paths(4)
    assert paths.code_start.tolist() == [0, 1, 1, 2, 3]
    assert paths.step_start.tolist() == [0, 2, 4, 5]
    assert paths.steps.tolist() == [1, 3, 1, 2, 0]
    assert paths.sizes == (3, 5)


def _saved(model: NeuralLM, path: Path) -> Path:
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.vocab import Vocabulary

    words = [f"w{i}" for i in range(model.config.vocab_size - 3)]
    save_model(path, model, Vocabulary(words), None, objective="mle")
    return path


@pytest.mark.parametrize("output", ["huffman", "adaptive-eps"])
def test_scoring_tables_of_a_tree_give_its_exact_log_probabilities(output: str, tmp_path: Path) -> None:
    """ScoringTables of a tree-output model: node vectors and biases as output and bias,
    every word's codes as paths, and the score the model's normalised log-probability (a
    word with several codes, as ADAPTIVE(ε) makes them, the log of their sum)."""
    from nlmserve.lm.scoring import LanguageModel

    model = _random_model(output)
    lm = LanguageModel.load(_saved(model, tmp_path / "tree.nlm"), device="cpu")
    assert lm.scoring_tables_missing() is None
    tables = lm.scoring_tables()
    tree = model.output.tree
    assert tables.kind == "tree" and tables.output.shape == (tree.num_nodes, 8) and tables.bias.shape == (tree.num_nodes,)
    assert tables.tree is not None and tables.tree.sizes == (tree.num_codes, int(tree.code_lengths().sum()))
    if output == "adaptive-eps":
        assert np.diff(tables.tree.code_start).max() > 1  # some word has two codes
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 23, size=(200, 3))
    rows[:, 2] = np.where(rows[:, 2] == BOS_ID, 2, rows[:, 2])
    rows = lm.canonical_rows(rows)
    np.testing.assert_allclose(tables.score(rows), lm.score_ngrams(rows), rtol=0, atol=1e-5)
    assert tables.score(np.array([[3, 4, BOS_ID]]))[0] == -np.inf
    V, D, K = 23, 8, tree.num_nodes
    codes, steps = tables.tree.sizes
    assert tables.flat().size == 2 * V * D + K * D + K + (V + 1) + (codes + 1) + steps


def test_a_tree_model_streams_its_tables_with_the_tree_sizes(tmp_path: Path) -> None:
    """GetScoringTables of a served tree model: output "tree", the tree's nodes, codes and
    steps in the first chunk, the array ScoringTables.flat gives."""
    from nlmserve.lm.scoring import LanguageModel
    from support import streamed_tables

    lm = LanguageModel.load(_saved(_random_model("huffman"), tmp_path / "tree.nlm"), device="cpu")
    want = lm.scoring_tables()
    assert want.tree is not None
    head, got = streamed_tables(lm, 100)
    assert (head.output, head.tree_nodes, head.tree_codes, head.tree_steps) == (
        "tree", want.output.shape[0], *want.tree.sizes)
    assert head.feature_order == 0 and head.total_floats == want.flat().size
    np.testing.assert_array_equal(got, want.flat())


def test_a_tree_whose_paths_do_not_fit_float32_has_no_tables() -> None:
    """The paths travel as whole numbers in float32, exact below 2^24: a step beyond that
    (a tree of millions of nodes) is refused with the reason, which the server answers
    GetScoringTables with, instead of sending rounded node ids."""
    from nlmserve.common.errors import UnsupportedModelError
    from nlmserve.lm.scoring import ScoringTables
    from nlmserve.lm.trees import TreePaths

    paths = TreePaths(np.array([0, 1, 1, 2]), np.array([0, 1, 2]), np.array([2 * (1 << 24) + 1, 0]))
    tables = ScoringTables(np.zeros((1, 3, 1)), np.zeros((2, 1)), np.zeros(2), "none", tree=paths)
    with pytest.raises(UnsupportedModelError, match="do not fit"):
        tables.flat()
