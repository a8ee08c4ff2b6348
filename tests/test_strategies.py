"""The output strategies on real data: each new objective lowers the cross-entropy, every
type round-trips through the model file, and a tree model serves over gRPC."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import torch

from nlmserve.lm.model import NeuralLM
from nlmserve.lm.model_file import read_model_file
from nlmserve.lm.objectives import NoiseDistribution, batch_loss
from nlmserve.lm.outputs.tree import TreeOutput
from nlmserve.lm.scoring import LanguageModel
from nlmserve.lm.strategies import build_tree
from nlmserve.lm.data import prepare_data
from nlmserve.lm.train import TrainConfig, TrainResult, model_config, train
from nlmserve.lm.vocab import BOS_ID
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine


def _config(train_path: Path, out: Path, output: str | None, objective: str, **kw: Any) -> TrainConfig:
    settings: dict[str, Any] = dict(
        train=str(train_path), out=str(out), order=3, dim=16, min_count=2, objective=objective, output=output,
        threads=1, seed=3, batch_size=128, progress=False, learning_curve=False, checkpoint_every=0,
        tree_pretrain_steps=40, noise_samples=64, workdir=str(out.parent / "work"),
    )
    settings.update(kw)
    return TrainConfig(**settings)


@pytest.fixture(scope="module")
def data(train_small_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("strategies") / "x.nlm"
    return prepare_data(_config(train_small_path, out, "softmax", "mle"))


CASES = [
    ("softmax", "sampling"),
    ("dsoftmax", "sampling"),
    ("softmax", "weaknorm"),
    ("softmax", "weaknormsq"),
    ("dsoftmax", "weaknorm"),
    ("dsoftmax", "mle"),
    ("huffman", "mle"),
    ("adaptive-eps", "mle"),
]


@pytest.mark.parametrize(("output", "objective"), CASES)
def test_training_each_objective_lowers_the_cross_entropy(train_small_path: Path, tmp_path: Path, data: Any,
                                                          output: str, objective: str) -> None:
    cfg = _config(train_small_path, tmp_path / "m.nlm", output, objective)
    tree = build_tree(cfg, output, data.train, data.unigram, torch.device("cpu"), None)
    torch.manual_seed(0)
    model = NeuralLM(model_config(cfg, data, tree), None, tree)
    model.init_biases(data.unigram)
    noise = NoiseDistribution(data.unigram, None, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    held = np.arange(0, data.train.num_tokens, 97)[:600]  # fixed real positions
    ctx, tgt = (torch.from_numpy(a) for a in data.train.examples(held, 3))

    def cross_entropy() -> float:
        with torch.no_grad():
            return float(-model.log_prob(ctx, tgt).mean())

    before = cross_entropy()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    rng = np.random.default_rng(2)
    for _ in range(40):
        pos = np.sort(rng.integers(0, data.train.num_tokens, 128))
        c, t = (torch.from_numpy(a) for a in data.train.examples(pos, 3))
        opt.zero_grad()
        batch_loss(objective, model, c, t, noise, 64, gen).backward()
        opt.step()
    after = cross_entropy()
    assert after < before - 0.05, (before, after)


# Every file is written as format 3 (lm/model_file.py); formats 1 and 2 are read only.
ROUND_TRIP = [("huffman", "mle", 3), ("adaptive-eps", "mle", 3), ("dsoftmax", "weaknorm", 3),
              ("softmax", "weaknormsq", 3), ("random", "mle", 3)]


@pytest.fixture(scope="module")
def trained(train_small_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainResult]:
    out: dict[str, TrainResult] = {}
    d = tmp_path_factory.mktemp("trained")
    for output, objective, _ in ROUND_TRIP:
        out[output] = train(_config(train_small_path, d / f"{output}.nlm", output, objective, max_steps=12))
    return out


@pytest.mark.parametrize(("output", "objective", "version"), ROUND_TRIP)
def test_model_file_round_trip(trained: dict[str, TrainResult], dev_small_path: Path, output: str, objective: str,
                               version: int) -> None:
    res = trained[output]
    blob = Path(res.model_path).read_bytes()
    assert struct.unpack_from("<I", blob, 8)[0] == version
    mf = read_model_file(res.model_path)
    assert mf.objective == objective
    lm = LanguageModel(mf, device="cpu")
    sentences = [line.split() for line in dev_small_path.read_text().splitlines()[:30]]
    ids, _, _, _ = lm.sentence_ngrams(sentences)
    ctx, tgt = lm.prepare_contexts(ids)
    with torch.no_grad():
        want = res.model.eval().log_prob(ctx, tgt).numpy()  # the trained network, no validation: the last one
    np.testing.assert_allclose(lm.score_ngrams(ids), want, atol=1e-5)
    if output in ("huffman", "adaptive-eps", "random"):
        tree = lm.net.output.tree  # type: ignore[union-attr]
        assert tree.method == output and isinstance(res.model.output, TreeOutput)
        np.testing.assert_array_equal(tree.code_word, res.model.output.tree.code_word)
        assert lm.self_normalized  # the fast path is exact for a tree
        np.testing.assert_array_equal(lm.score_ngrams(ids, normalized=False), lm.score_ngrams(ids))
    else:
        assert lm.self_normalized is (objective in ("weaknorm", "weaknormsq"))
        with torch.no_grad():
            np.testing.assert_allclose(lm.net.full_log_probs(ctx[:50]).exp().sum(1).numpy(), 1.0, atol=1e-4)


def test_tree_file_with_a_broken_tree_is_refused(trained: dict[str, TrainResult], tmp_path: Path) -> None:
    from nlmserve.common.errors import ModelFileError
    from nlmserve.lm.model_file import save_model

    mf = read_model_file(trained["huffman"].model_path)
    model = mf.build_model()
    model.output.tree.left[0] = model.output.tree.right[0]  # type: ignore[union-attr]  # node reached twice
    bad = tmp_path / "bad.nlm"
    save_model(bad, model, mf.vocab, None, objective="mle")
    with pytest.raises(ModelFileError, match="invalid output tree"):
        read_model_file(bad).build_model()


def test_invalid_strategy_pairs_are_refused(train_small_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot train the huffman output"):
        _config(train_small_path, tmp_path / "m.nlm", "huffman", "nce")
    with pytest.raises(ValueError, match="cannot train the class output"):
        _config(train_small_path, tmp_path / "m.nlm", "class", "weaknorm")
    assert _config(train_small_path, tmp_path / "m.nlm", None, "sampling").resolved_output == "softmax"


@pytest.fixture(scope="module")
def tree_server(trained: dict[str, TrainResult]) -> Iterator[tuple[RunningServer, LanguageModel]]:
    lm = LanguageModel.load(trained["adaptive-eps"].model_path, device="cpu")
    config = ServerConfig(model=trained["adaptive-eps"].model_path, port=0, metrics_port=0)
    running = create_server(config, engine=Engine(lm, config))
    yield running, lm
    running.stop(1.0)


@pytest.mark.parametrize("unnormalized", [False, True])
def test_tree_model_served_over_grpc(tree_server: tuple[RunningServer, LanguageModel], dev_small_path: Path,
                                     unnormalized: bool) -> None:
    running, lm = tree_server
    sentences = [line.split() for line in dev_small_path.read_text().splitlines()[40:70]]
    ids, _, _, _ = lm.sentence_ngrams(sentences)
    req = lm_pb2.ScoreNgramsRequest(packed_ids=ids.astype("<u4").tobytes(), packed_order=ids.shape[1],
                                    log_base=lm_pb2.LogBase.Value("LN"), allow_unnormalized=unnormalized)
    with grpc.insecure_channel(running.target) as channel:
        stub = lm_pb2_grpc.LanguageModelStub(channel)
        resp = stub.ScoreNgrams(req)
        info = stub.GetModelInfo(lm_pb2.GetModelInfoRequest())
    got = np.asarray(resp.log_probs, dtype=np.float32)
    np.testing.assert_allclose(got, lm.score_ngrams(ids), atol=1e-5)
    assert info.output_type == "tree"
    # An exact distribution: the probabilities of every word after one real context sum to one.
    ctx = np.repeat(ids[5:6, :-1], len(lm.vocab) - 1, axis=0)
    words = np.array([w for w in range(len(lm.vocab)) if w != BOS_ID])
    total = np.exp(lm.score_ngrams(np.column_stack([ctx, words])).astype(np.float64)).sum()
    assert total == pytest.approx(1.0, abs=1e-4)


def test_train_help_names_every_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("huffman", "random", "balanced", "adaptive-eps", "dsoftmax", "sampling", "weaknorm", "weaknormsq"):
        assert name in text


def test_cli_choices_match_the_library() -> None:
    from nlmserve.lm import cli
    from nlmserve.lm.objectives import OBJECTIVES
    from nlmserve.lm.strategies import OUTPUT_CHOICES

    assert set(cli.OUTPUT_CHOICES) == set(OUTPUT_CHOICES)
    assert set(cli.OBJECTIVE_CHOICES) == set(OBJECTIVES)
