"""The experiment's steps once a server is up: rescore, tune, rerank, evaluate.

Systems compared on the test set (all reranking the same test n-best list):

* ``moses``: the list's own 1-best (the decoder's MERT-tuned weights);
* ``mert``: MERT on dev over the decoder's features, without NLM0;
* ``mert+NLM0``: MERT on dev over the decoder's features and NLM0, started from the
  ``mert`` optimum (NLM0 at 0) and from the decoder's weights;
* ``moses+NLM0``: the decoder's weights kept, only NLM0's weight tuned on dev.

p-values: ``mert+NLM0`` against ``mert``, ``moses+NLM0`` against ``moses``
(sacrebleu's paired bootstrap).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nlmserve.errors import InputError
from nlmserve.moses_plugin import bleu, mert
from nlmserve.moses_plugin.nbest import read_lines, write_text_atomic
from nlmserve.moses_plugin.rerank import first_best, rerank
from nlmserve.moses_plugin.rescore import RescoreConfig, rescore
from nlmserve.moses_plugin.weights import Weights, load_weights, to_moses_ini, to_weights_txt

if TYPE_CHECKING:
    from nlmserve.moses_plugin.experiment import ExperimentConfig

log = logging.getLogger(__name__)

FEATURE = "NLM0"
BASELINES = {"mert+NLM0": "mert", "moses+NLM0": "moses"}


class Pipeline:
    def __init__(self, config: "ExperimentConfig", work: Path, target: str,
                 client_kwargs: dict[str, Any] | None = None) -> None:
        self.config = config
        self.client_kwargs = dict(client_kwargs or {})
        self.work = work
        self.target = target
        self.bleu_config = bleu.BleuConfig(lowercase=config.lowercase)
        self.model_hash = ""
        self.rescore_stats: dict[str, Any] = {}

    def run(self) -> dict[str, Any]:
        dev = self.rescored("dev", self.config.dev_nbest)
        test = self.rescored("test", self.config.test_nbest)
        weights = self.tuned(dev)
        test_refs = bleu.read_references(list(self.config.test_ref))
        outputs = {"moses": first_best(self.config.test_nbest)}
        for name, w in weights.items():
            path = self.work / f"test.{name}.1best"
            source = str(test) if FEATURE in w.as_dict() else self.config.test_nbest
            if not path.exists():
                write_text_atomic(path, "".join(h + "\n" for h in rerank(source, w, n_sentences=len(test_refs[0])).hyps))
            outputs[name] = read_lines(path)
        return self.evaluate(outputs, weights, test_refs)

    def connect(self) -> Any:
        from nlmserve.client import LMClient

        return LMClient(self.target, timeout=120.0, **self.client_kwargs)

    def rescored(self, name: str, nbest: str) -> Path:
        out = self.work / f"{name}.nlm.nbest.gz"
        config = RescoreConfig(feature_name=FEATURE, lowercase=self.config.lowercase, progress=False)
        with self.connect() as client:
            self.model_hash = client.info.model_hash
        stats_path = self.work / f"{name}.rescore.json"
        if out.exists() and stats_path.exists():
            stats = json.loads(stats_path.read_text())
            if stats.get("model_hash") and stats["model_hash"] != self.model_hash:
                raise InputError(f"was rescored with model {stats['model_hash']}, the server has {self.model_hash}", str(out))
        else:
            log.info("rescoring %s → %s", nbest, out)
            result = rescore(nbest, str(out), self.connect, config)
            stats = result.as_dict()
            write_text_atomic(stats_path, json.dumps(stats, indent=2))
        self.rescore_stats[name] = stats
        return out

    def tuned(self, dev: Path) -> dict[str, Weights]:
        refs = bleu.read_references(list(self.config.dev_ref))
        scorer = bleu.SentenceStats(self.bleu_config, refs)
        data = mert.load_nbest_data([str(dev)], scorer)
        base_layout = tuple(g for g in data.layout if g[0] != FEATURE)
        decoder, residual = mert.weights_from_totals([self.config.dev_nbest], base_layout)
        log.info("decoder weights fitted to the dev totals (largest residual %.3g)", residual)
        cfg = mert.MertConfig(restarts=self.config.restarts, seed=self.config.seed)
        base_data = mert.select_features(data, [name for name, _ in base_layout])
        out: dict[str, Weights] = {"moses": decoder.normalized_l1()}
        self.dev_bleu: dict[str, float] = {}
        out["mert"] = self._tune("mert", base_data, scorer, [decoder], None, cfg)
        zero = Weights(((FEATURE, (0.0,)),))
        starts = [_with(out["mert"], zero, data), _with(decoder, zero, data)]
        out["mert+NLM0"] = self._tune("mert+NLM0", data, scorer, starts, None, cfg)
        only = mert.fix_features([mert.FeatureRange()] * data.dim, [g[0] for g in base_layout], data.layout)
        out["moses+NLM0"] = self._tune("moses+NLM0", data, scorer, [_with(decoder, zero, data)], only, cfg)
        packed = mert.PackedData(base_data)
        flat = packed.corpus_stats(_flat(decoder, base_data))
        self.dev_bleu["moses"] = bleu.score_from_stats(scorer.metric, flat).score
        return out

    def _tune(self, name: str, data: mert.MertData, scorer: bleu.SentenceStats, starts: list[Weights],
              ranges: list[mert.FeatureRange] | None, cfg: mert.MertConfig) -> Weights:
        path = self.work / f"weights.{name}.ini"
        packed = mert.PackedData(data)
        if not path.exists():
            best: mert.MertResult | None = None
            for i, start in enumerate(starts):
                run_cfg = cfg if i == 0 else mert.MertConfig(restarts=0, seed=cfg.seed)
                result = mert.tune(data, scorer, start, ranges, run_cfg)
                if best is None or result.bleu > best.bleu:
                    best = result
            assert best is not None
            write_text_atomic(self.work / f"weights.{name}.txt", to_weights_txt(best.weights))
            write_text_atomic(path, to_moses_ini(best.weights))
        weights = load_weights(path).for_layout(data.layout)
        stats = packed.corpus_stats(_flat(weights, data))
        self.dev_bleu[name] = bleu.score_from_stats(scorer.metric, stats).score
        log.info("%s: dev BLEU %.2f", name, self.dev_bleu[name])
        return weights

    def evaluate(self, outputs: dict[str, list[str]], weights: dict[str, Weights], refs: list[list[str]]) -> dict[str, Any]:
        rows = []
        for name, hyps in outputs.items():
            score, signature = bleu.corpus_bleu(hyps, refs, self.bleu_config)
            uses_nlm = FEATURE in weights[name].as_dict()
            row: dict[str, Any] = {
                "system": name,
                "test_bleu": score.score,
                "test_score": str(score),
                "dev_bleu": self.dev_bleu.get(name),
                "weights": weights[name].as_dict(),
                "signature": bleu.full_signature(signature, weights[name].as_dict(), self.model_hash if uses_nlm else None),
                "p_value": None,
                "baseline": BASELINES.get(name),
            }
            if name in BASELINES:
                paired = bleu.paired_bootstrap(outputs[BASELINES[name]], hyps, refs, self.bleu_config, self.config.samples)
                row.update(p_value=paired.p_value, paired_signature=paired.signature,
                           delta=paired.system_bleu - paired.baseline_bleu, ci95=paired.system_ci)
            rows.append(row)
        return {"rows": rows, "model_hash": self.model_hash, "rescore": self.rescore_stats, "server": self.target}


def _with(weights: Weights, extra: Weights, data: mert.MertData) -> Weights:
    merged = dict(weights.groups) | dict(extra.groups)
    return Weights(tuple(merged.items())).for_layout(data.layout)


def _flat(weights: Weights, data: mert.MertData) -> Any:
    import numpy as np

    return np.asarray(weights.for_layout(data.layout).flat(), dtype=np.float64)
