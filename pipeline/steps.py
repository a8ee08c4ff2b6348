"""The experiment's steps once NLM0's source is known: rescore, tune, rerank, evaluate.

NLM0's scores come from an :class:`NlmSource`: the model file scored in this process
(the default: no server), or a server (one given with ``--server``, or started by the
experiment with ``--via-server``); the report records which (``source``).

Systems compared on the test set (all reranking the same test n-best list), named after
the tuner (``mert``, Och's MERT, or ``mira``, batch k-best MIRA; ``tuner`` in the config):

* ``moses``: the list's own 1-best (the decoder's MERT-tuned weights);
* ``mert``: the tuner on dev over the decoder's features, without NLM0;
* ``mert+NLM0``: the tuner on dev over the decoder's features and NLM0, started from the
  ``mert`` optimum (NLM0 at 0) and from the decoder's weights (the better on dev wins);
* ``moses+NLM0``: the decoder's weights kept, only NLM0's weight tuned on dev, by an
  exact line search (MERT's, on one dimension) whichever the tuner: the BLEU-best value on
  dev, the same for every seed, so it is tuned once. (MIRA with that one weight free did
  not beat its start on the shipped lists: the row showed NLM0 at 0 in every run.)

p-values: ``mert+NLM0`` against ``mert``, ``moses+NLM0`` against ``moses``
(sacrebleu's paired bootstrap). With a Kneser-Ney model (``kenlm``) added to the lists
first as ``KN1``, ``mert+KN1`` (against ``mert``) and ``mert+KN1+NLM0`` (against
``mert+KN1``) take the place of ``mert+NLM0``. Each tuner's systems have their own weight and output
files (``weights.mira+NLM0.ini``, ``test.mira.1best``), so one workdir, rescored once,
holds both tuners' results.

The tuner's result depends on its seed (MERT's random directions and restarts, MIRA's
sentence order): on the full newstest lists,
tuning the same system with another seed (or on feature values that differ in the sixth
digit) moves test BLEU by tenths of a point. With ``mert_runs`` = N > 1 every tuned system
is tuned N times, with seeds ``seed … seed+N-1`` (``mert+NLM0`` run r starts from ``mert``
run r), as Clark et al. (2011) recommend for comparing systems under optimizer
instability. The table then gives the mean and the standard deviation of the runs' BLEU,
and the p-value is the paired bootstrap over the N runs' outputs joined end to end (run r
of the system paired with run r of its baseline, sentence by sentence), so a difference
must hold across the runs, not in one lucky draw. Run 0 writes the files of a single run
(``weights.NAME.ini``, ``test.NAME.1best``); run r > 0 adds ``.runR`` to the name.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..common.errors import InputError
from ..moses_plugin import bleu, mert, mira
from ..moses_plugin.nbest import file_sha256, read_lines, write_text_atomic
from ..moses_plugin.rerank import rerank
from ..moses_plugin.rescore import RescoreConfig, ScoreSource, rescore
from .config import ExperimentConfig
from ..moses_plugin.weights import Weights, load_weights, to_moses_ini, to_weights_txt

log = logging.getLogger(__name__)

FEATURE = "NLM0"
TUNERS = ("mert", "mira")


def system_names(tuner: str, kenlm_name: str = "") -> list[str]:
    """The systems of the table, in order (``kenlm_name``: the added Kneser-Ney feature, if any)."""
    if kenlm_name:
        return ["moses", tuner, f"{tuner}+{kenlm_name}", f"{tuner}+{kenlm_name}+NLM0", "moses+NLM0"]
    return ["moses", tuner, f"{tuner}+NLM0", "moses+NLM0"]


def baselines(tuner: str, kenlm_name: str = "") -> dict[str, str]:
    """Each system compared by a p-value, and its baseline."""
    if kenlm_name:
        base = f"{tuner}+{kenlm_name}"
        return {base: tuner, f"{base}+NLM0": base, "moses+NLM0": "moses"}
    return {f"{tuner}+NLM0": tuner, "moses+NLM0": "moses"}


@dataclass(frozen=True)
class NlmSource:
    """Where NLM0's scores come from.

    Fields:
        kind: ``model`` (a model file scored in this process) or ``server``.
        where: the model file's path, or the server's target.
        connect: opens the source for ``rescore`` (a model file is loaded once).
        started: the server was started by this experiment (``--via-server``).
    """

    kind: str
    where: str
    connect: Callable[[], ScoreSource] = field(repr=False, compare=False)
    started: bool = False

    @classmethod
    def model_file(cls, path: str | os.PathLike[str]) -> "NlmSource":
        loaded: list[ScoreSource] = []

        def connect() -> ScoreSource:
            if not loaded:
                from ..moses_plugin.model_source import ModelScorer

                loaded.append(ModelScorer(path))
            return loaded[0]

        return cls("model", str(path), connect)

    @classmethod
    def server(cls, target: str, client_kwargs: dict[str, Any] | None = None, started: bool = False) -> "NlmSource":
        """``target`` (HOST:PORT, replicas, dns:///…); ``client_kwargs``: ``LMClient``'s TLS and token arguments."""
        kwargs = dict(client_kwargs or {})

        def connect() -> ScoreSource:
            from ..client import LMClient

            return LMClient(target, timeout=120.0, **kwargs)

        return cls("server", target, connect, started)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "where": self.where, "started_server": self.started}


class Pipeline:
    def __init__(self, config: ExperimentConfig, work: Path, source: NlmSource) -> None:
        self.config = config
        self.work = work
        self.source = source
        self.bleu_config = bleu.BleuConfig(lowercase=config.lowercase)
        self.model_hash = ""
        self.kenlm_hash = ""
        self._kenlm: Any = None
        self.rescore_stats: dict[str, Any] = {}

    def run(self) -> dict[str, Any]:
        dev_source, test_source = self.config.dev_nbest, self.config.test_nbest
        if self.config.kenlm:
            dev_source, test_source = str(self.with_kenlm("dev", dev_source)), str(self.with_kenlm("test", test_source))
        dev = self.rescored("dev", dev_source)
        test = self.rescored("test", test_source)
        weights = self.tuned(dev)
        test_refs = bleu.read_references(list(self.config.test_ref))
        outputs: dict[str, list[list[str]]] = {}
        for name, runs in weights.items():
            outputs[name] = []
            for r, w in enumerate(runs):
                path = self.work / f"test.{self._file_name(name)}{_run_suffix(r)}.1best"
                used = w.as_dict()
                source = str(test) if FEATURE in used else test_source if self.kenlm_name in used else self.config.test_nbest
                if not path.exists():
                    hyps = rerank(source, w, n_sentences=len(test_refs[0])).hyps
                    write_text_atomic(path, "".join(h + "\n" for h in hyps))
                outputs[name].append(read_lines(path))
        return self.evaluate(outputs, weights, test_refs)

    @property
    def kenlm_name(self) -> str:
        """The Kneser-Ney feature's name, or "" without ``--kenlm``."""
        return self.config.kenlm_name if self.config.kenlm else ""

    def with_kenlm(self, name: str, nbest: str) -> Path:
        """``nbest`` with the Kneser-Ney feature added (``NAME.kn.nbest.gz``), made once per model."""
        from ..moses_plugin.kenlm_source import KenlmScorer

        assert self.config.kenlm
        out = self.work / f"{name}.kn.nbest.gz"
        stats_path = self.work / f"{name}.kn.json"
        if not self.kenlm_hash:
            if not os.path.isfile(self.config.kenlm):
                raise InputError("no such Kneser-Ney model file", self.config.kenlm)
            self.kenlm_hash = file_sha256(self.config.kenlm)
        if out.exists() and stats_path.exists():
            stats = json.loads(stats_path.read_text())
            if stats.get("model_hash") != self.kenlm_hash or stats.get("feature") != self.config.kenlm_name:
                raise InputError(f"has {stats.get('feature')} of Kneser-Ney model {stats.get('model_hash')}, not "
                                 f"{self.config.kenlm_name} of {self.config.kenlm} ({self.kenlm_hash}): use another workdir",
                                 str(out))
        else:
            log.info("adding %s of %s: %s → %s", self.config.kenlm_name, self.config.kenlm, nbest, out)
            config = RescoreConfig(feature_name=self.config.kenlm_name, lowercase=self.config.lowercase, progress=False)
            if self._kenlm is None:  # loaded once, and only when a list needs it
                self._kenlm = KenlmScorer(self.config.kenlm)
            scorer = self._kenlm
            stats = rescore(nbest, str(out), lambda: scorer, config).as_dict() | {"feature": self.config.kenlm_name}
            write_text_atomic(stats_path, json.dumps(stats, indent=2))
        self.rescore_stats[f"{name} {self.config.kenlm_name}"] = stats
        return out

    def _file_name(self, name: str) -> str:
        """A system's name in its files. ``moses+NLM0`` is tuned by the line search whichever
        the tuner, with or without the Kneser-Ney feature (held at 0), so its files say so:
        ``*.moses+NLM0[.KN1].line.*`` (the other systems' names already differ)."""
        if name != "moses+NLM0":
            return name
        return name + (f".{self.kenlm_name}" if self.kenlm_name else "") + ".line"

    def rescored(self, name: str, nbest: str) -> Path:
        out = self.work / f"{name}{'.kn' if self.config.kenlm else ''}.nlm.nbest.gz"
        config = RescoreConfig(feature_name=FEATURE, lowercase=self.config.lowercase, progress=False)
        source = self.source.connect()
        try:
            self.model_hash = source.info.model_hash
        finally:
            source.close()
        stats_path = out.with_name(out.name.replace(".nlm.nbest.gz", ".rescore.json"))
        if out.exists() and stats_path.exists():
            stats = json.loads(stats_path.read_text())
            if stats.get("model_hash") and stats["model_hash"] != self.model_hash:
                raise InputError(f"was rescored with model {stats['model_hash']}, the {self.source.kind} has "
                                 f"{self.model_hash}", str(out))
        else:
            log.info("rescoring %s → %s (%s %s)", nbest, out, self.source.kind, self.source.where)
            result = rescore(nbest, str(out), self.source.connect, config)
            stats = result.as_dict()
            write_text_atomic(stats_path, json.dumps(stats, indent=2))
        self.rescore_stats[name] = stats
        return out

    def tuned(self, dev: Path) -> dict[str, list[Weights]]:
        """Each system's weights, one per tuning run (``moses``: the decoder's, once).

        With ``--kenlm`` the Kneser-Ney feature joins the decoder's in ``TUNER+KN1``, and
        ``TUNER+KN1+NLM0`` adds NLM0 to that; ``TUNER`` keeps the decoder's features only.
        """
        refs = bleu.read_references(list(self.config.dev_ref))
        scorer = bleu.SentenceStats(self.bleu_config, refs)
        data = mert.load_nbest_data([str(dev)], scorer)
        kn = self.kenlm_name
        decoder_layout = tuple(g for g in data.layout if g[0] not in (FEATURE, kn))
        base_layout = tuple(g for g in data.layout if g[0] != FEATURE)
        decoder, residual = mert.weights_from_totals([self.config.dev_nbest], decoder_layout)
        log.info("decoder weights fitted to the dev totals (largest residual %.3g)", residual)
        decoder_data = mert.select_features(data, [name for name, _ in decoder_layout])
        base_data = mert.select_features(data, [name for name, _ in base_layout]) if kn else decoder_data
        tuner = self.config.tuner
        names = system_names(tuner, kn)
        out: dict[str, list[Weights]] = {name: [] for name in names}
        out["moses"] = [decoder.normalized_l1()]
        self.dev_bleu: dict[str, list[float]] = {name: [] for name in out}
        zero = Weights(((FEATURE, (0.0,)),) + (((kn, (0.0,)),) if kn else ()))  # every added feature at 0
        zero_nlm = Weights(((FEATURE, (0.0,)),))
        only = mert.fix_features([mert.FeatureRange()] * data.dim, [g[0] for g in base_layout], data.layout)
        out["moses+NLM0"] = [self._tune("moses+NLM0", 0, data, scorer, [_with(decoder, zero, data)], only,
                                        self.config.seed)]
        for r in range(self.config.mert_runs):
            seed = self.config.seed + r
            plain = self._tune(tuner, r, decoder_data, scorer, [decoder], None, seed)
            out[tuner].append(plain)
            base = plain
            if kn:
                starts = [_with(plain, zero, base_data), _with(decoder, zero, base_data)]
                base = self._tune(f"{tuner}+{kn}", r, base_data, scorer, starts, None, seed)
                out[f"{tuner}+{kn}"].append(base)
            starts = [_with(base, zero_nlm, data), _with(decoder, zero, data)]
            out[names[-2]].append(self._tune(names[-2], r, data, scorer, starts, None, seed))
        packed = mert.PackedData(decoder_data)
        flat = packed.corpus_stats(_flat(decoder, decoder_data))
        self.dev_bleu["moses"] = [bleu.score_from_stats(scorer.metric, flat).score]
        return out

    def _tune(self, name: str, run: int, data: mert.MertData, scorer: bleu.SentenceStats, starts: list[Weights],
              ranges: list[mert.FeatureRange] | None, seed: int) -> Weights:
        """The weights of system ``name``, run ``run``: tuned from each start (the best on dev
        wins) unless a previous run left them in the workdir."""
        stem = f"weights.{self._file_name(name)}{_run_suffix(run)}"
        path = self.work / f"{stem}.ini"
        packed = mert.PackedData(data)
        if not path.exists():
            best: tuple[float, Weights] | None = None
            for i, start in enumerate(starts):
                result = self._optimise(data, scorer, start, ranges, seed, restarts=self.config.restarts if i == 0 else 0)
                if best is None or result[0] > best[0]:
                    best = result
            assert best is not None
            write_text_atomic(self.work / f"{stem}.txt", to_weights_txt(best[1]))
            write_text_atomic(path, to_moses_ini(best[1]))
        weights = load_weights(path).for_layout(data.layout)
        stats = packed.corpus_stats(_flat(weights, data))
        self.dev_bleu[name].append(bleu.score_from_stats(scorer.metric, stats).score)
        log.info("%s run %d (seed %d): dev BLEU %.2f", name, run, seed, self.dev_bleu[name][-1])
        return weights

    def _optimise(self, data: mert.MertData, scorer: bleu.SentenceStats, start: Weights,
                  ranges: list[mert.FeatureRange] | None, seed: int, restarts: int) -> tuple[float, Weights]:
        """(dev BLEU, weights) of one tuning from ``start`` with the configured tuner, or,
        when ``ranges`` leave one weight free, MERT's exact line search along it."""
        if ranges is not None and sum(r.active for r in ranges) == 1:
            exact = mert.tune(data, scorer, start, ranges, mert.MertConfig(restarts=0))
            return exact.bleu, exact.weights
        if self.config.tuner == "mira":
            found = mira.tune(data, scorer, start, ranges, mira.MiraConfig(seed=seed))
            return found.bleu, found.weights
        result = mert.tune(data, scorer, start, ranges, mert.MertConfig(restarts=restarts, seed=seed))
        return result.bleu, result.weights

    def evaluate(self, outputs: dict[str, list[list[str]]], weights: dict[str, list[Weights]],
                 refs: list[list[str]]) -> dict[str, Any]:
        rows = []
        tuner = self.config.tuner
        pairs = baselines(tuner, self.kenlm_name)
        n_runs = max(len(v) for v in outputs.values())
        for name, runs in outputs.items():
            scores = [bleu.corpus_bleu(hyps, refs, self.bleu_config) for hyps in runs]
            test = [score.score for score, _ in scores]
            dev = self.dev_bleu.get(name, [])
            first = weights[name][0].as_dict()
            uses_nlm = FEATURE in first
            line_search = name == "moses+NLM0"
            tuned_by_mira = tuner == "mira" and name != "moses" and not line_search
            signature = bleu.full_signature(scores[0][1], first, self.model_hash if uses_nlm else None)
            if self.kenlm_name in first:
                signature += f"|{self.kenlm_name}:{self.kenlm_hash[:12]}"
            row: dict[str, Any] = {
                "system": name,
                "test_bleu": _mean(test),
                "test_bleu_sd": _sd(test),
                "test_score": str(scores[0][0]),
                "dev_bleu": _mean(dev) if dev else None,
                "weights": first,
                "signature": signature + ("|tune:line-search" if line_search
                                          else f"|{tuner}-runs:{len(runs)}" if len(runs) > 1 or tuned_by_mira else ""),
                "p_value": None,
                "baseline": pairs.get(name),
                "runs": [{"seed": self.config.seed + r, "test_bleu": test[r], "dev_bleu": dev[r] if r < len(dev) else None,
                          "weights": weights[name][r].as_dict()} for r in range(len(runs))],
            }
            if name in pairs:
                base_runs = outputs[pairs[name]]
                paired_base = [base_runs[r % len(base_runs)] for r in range(len(runs))]
                joined_refs = [[line for _ in runs for line in ref] for ref in refs]
                paired = bleu.paired_bootstrap([h for hyps in paired_base for h in hyps], [h for hyps in runs for h in hyps],
                                               joined_refs, self.bleu_config, self.config.samples)
                base_test = [bleu.corpus_bleu(hyps, refs, self.bleu_config)[0].score for hyps in base_runs]
                row.update(p_value=paired.p_value, paired_signature=paired.signature,
                           delta=_mean(test) - _mean(base_test), ci95=paired.system_ci)
            rows.append(row)
        return {"rows": rows, "model_hash": self.model_hash, "rescore": self.rescore_stats, "source": self.source.as_dict(),
                "mert_runs": n_runs, "tuner": self.config.tuner, "kenlm": self.config.kenlm,
                "kenlm_name": self.kenlm_name or None, "kenlm_hash": self.kenlm_hash or None}


def _run_suffix(run: int) -> str:
    return f".run{run}" if run else ""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sd(values: list[float]) -> float:
    """Sample standard deviation (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _with(weights: Weights, extra: Weights, data: mert.MertData) -> Weights:
    merged = dict(weights.groups) | dict(extra.groups)
    return Weights(tuple(merged.items())).for_layout(data.layout)


def _flat(weights: Weights, data: mert.MertData) -> Any:
    import numpy as np

    return np.asarray(weights.for_layout(data.layout).flat(), dtype=np.float64)
