"""The experiment end to end on slices of the shipped lists: the model scored in process (no
server), and through a real `nlmserve serve` subprocess with --via-server."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import statistics
from collections import Counter
from pathlib import Path

import kenlm
import pytest

from nlmserve.cli import main
from nlmserve.moses_plugin import bleu
from nlmserve.moses_plugin.nbest import iter_entries, iter_sentences, read_lines
from nlmserve.moses_plugin.weights import load_weights
from nlmserve.pipeline import experiment
from nlmserve.pipeline.config import ExperimentConfig
from nlmserve.pipeline.experiment import run

NEWS = Path(__file__).resolve().parent.parent / "data" / "nbest" / "newstest-fr-en"
N = 25


def _slice(name: str, out: Path) -> tuple[str, str]:
    lines = []
    for group in iter_sentences(NEWS / f"{name}.300.nbest.gz"):
        if group[0].sent_id >= N:
            break
        lines += [e.raw for e in group]
    nbest, ref = out / f"{name}.nbest.gz", out / f"{name}.ref"
    with gzip.open(nbest, "wt", encoding="utf-8") as handle:
        handle.write("".join(lines))
    ref.write_text("".join(line + "\n" for line in read_lines(NEWS / f"{name}.300.ref")[:N]))
    return str(nbest), str(ref)


def _unigram_arpa(lines: list[str], path: Path) -> Path:
    """A unigram model of ``lines`` (add-one estimates, ``</s>`` counted once per line) as a
    bigram ARPA (KenLM reads bigrams and up): back-offs 0, and ``<s> w`` at P(w) for each
    first word, so every probability is the unigram one."""
    counts = Counter(word for line in lines for word in line.split() + ["</s>"])
    counts["<unk>"] += 0
    total = sum(counts.values()) + len(counts)
    logp = {w: math.log10((c + 1) / total) for w, c in counts.items()}
    unigrams = [f"{logp[w]:.6f}\t{w}\t0" for w in sorted(logp)] + ["-99\t<s>\t0"]
    bigrams = [f"{logp[w]:.6f}\t<s> {w}" for w in sorted({line.split()[0] for line in lines if line.split()})]
    path.write_text(f"\\data\\\nngram 1={len(unigrams)}\nngram 2={len(bigrams)}\n\n\\1-grams:\n"
                    + "\n".join(unigrams) + "\n\n\\2-grams:\n" + "\n".join(bigrams) + "\n\n\\end\\\n")
    return path


def _no_server(*args: object, **kwargs: object) -> None:
    raise AssertionError("a server was started")


@pytest.mark.slow
def test_experiment_runs_and_resumes(tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    dev, dev_ref = _slice("newstest2012", tmp_path)
    test, test_ref = _slice("newstest2013", tmp_path)
    work = tmp_path / "work"
    config = ExperimentConfig(workdir=str(work), dev_nbest=dev, dev_ref=(dev_ref,), test_nbest=test,
                              test_ref=(test_ref,), model=str(tiny_model_path), restarts=0, samples=100)
    start_server = experiment.start_server
    monkeypatch.setattr(experiment, "start_server", _no_server)  # the default path scores in this process
    report = run(config)
    assert report["source"] == {"kind": "model", "where": str(tiny_model_path), "started_server": False}
    rows = {r["system"]: r for r in report["rows"]}
    assert list(rows) == ["moses", "mert", "mert+NLM0", "moses+NLM0"]
    model_hash = report["model_hash"]
    assert len(model_hash) >= 16
    for name, row in rows.items():
        assert 0 < row["test_bleu"] < 100
        assert row["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:none|smooth:exp")
        assert ("NLM0" in name) == (f"|model:{model_hash}" in row["signature"])
        assert ("NLM0" in row["weights"]) == ("NLM0" in name)
    assert 0 < rows["mert+NLM0"]["p_value"] <= 1 and rows["mert+NLM0"]["baseline"] == "mert"
    assert rows["mert+NLM0"]["dev_bleu"] >= rows["mert"]["dev_bleu"]  # started from mert's optimum
    assert rows["moses+NLM0"]["dev_bleu"] >= rows["moses"]["dev_bleu"] - 1e-9
    assert rows["moses+NLM0"]["signature"].endswith("|tune:line-search")
    # The moses row is the list's own 1-best.
    assert read_lines(work / "test.moses.1best")[0] == next(iter_sentences(test))[0].hyp
    for name in ("results.md", "results.json", "bleu.png", "weights.mert+NLM0.ini", "weights.mert+NLM0.txt"):
        assert (work / name).stat().st_size > 0
    assert (work / "bleu.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (work / "results.md").read_text()
    assert "| mert+NLM0 |" in markdown and model_hash in markdown
    saved = json.loads((work / "results.json").read_text())
    assert saved["rows"] == report["rows"]
    assert report["rescore"]["test"]["hypotheses"] > 20 * N
    # A rerun reuses every step's output and reports the same table (CLI path, the model served by
    # a subprocess with --via-server: the lists rescored in process name the model hash it serves).
    mtime = (work / "test.nlm.nbest.gz").stat().st_mtime_ns
    monkeypatch.setattr(experiment, "start_server", start_server)
    assert main(["experiment", "--workdir", str(work), "--dev-nbest", dev, "--dev-ref", dev_ref, "--test-nbest", test,
                 "--test-ref", test_ref, "--model", str(tiny_model_path), "--restarts", "0", "--samples", "100",
                 "--via-server"]) == 0
    monkeypatch.setattr(experiment, "start_server", _no_server)
    out = capsys.readouterr().out
    assert "mert+NLM0" in out and f"model {model_hash}" in out
    assert (work / "test.nlm.nbest.gz").stat().st_mtime_ns == mtime
    served = json.loads((work / "results.json").read_text())
    assert served["rows"] == saved["rows"] and served["model_hash"] == model_hash
    assert served["source"]["kind"] == "server" and served["source"]["started_server"]
    assert served["source"]["where"].startswith("127.0.0.1:")
    # Replicated tuning on the same workdir: run 0 is the single run above (its files are
    # reused), runs 1 and 2 are new MERT runs with seeds 1 and 2 (one random restart each).
    assert main(["experiment", "--workdir", str(work), "--dev-nbest", dev, "--dev-ref", dev_ref, "--test-nbest", test,
                 "--test-ref", test_ref, "--model", str(tiny_model_path), "--restarts", "1", "--samples", "100",
                 "--runs", "3"]) == 0
    assert "±" in capsys.readouterr().out
    replicated = json.loads((work / "results.json").read_text())
    assert replicated["mert_runs"] == 3 and (work / "test.nlm.nbest.gz").stat().st_mtime_ns == mtime
    refs = [read_lines(test_ref)]
    bleu_config = bleu.BleuConfig()
    for row, single in zip(replicated["rows"], saved["rows"]):
        name, runs = row["system"], row["runs"]
        assert len(runs) == (1 if name in ("moses", "moses+NLM0") else 3)  # the line search has no seed
        assert runs[0]["test_bleu"] == pytest.approx(single["test_bleu"], abs=1e-9)
        assert runs[0]["weights"] == single["weights"]
        assert [r["seed"] for r in runs] == list(range(len(runs)))
        assert row["test_bleu"] == pytest.approx(statistics.mean(r["test_bleu"] for r in runs), abs=1e-9)
        if len(runs) > 1:
            assert row["test_bleu_sd"] == pytest.approx(statistics.stdev(r["test_bleu"] for r in runs), abs=1e-9)
            assert row["signature"].endswith("|mert-runs:3")
            for r, run_ in enumerate(runs):
                hyps = read_lines(work / f"test.{name}{'.run%d' % r if r else ''}.1best")
                assert bleu.corpus_bleu(hyps, refs, bleu_config)[0].score == pytest.approx(run_["test_bleu"], abs=1e-9)
    rows = {r["system"]: r for r in replicated["rows"]}
    assert rows["mert"]["runs"][1]["weights"] != rows["mert"]["runs"][0]["weights"]  # another seed, another path
    # The p-value: the paired bootstrap over the three runs joined, run r against run r of the baseline.
    joined = {name: [h for r in range(3) for h in read_lines(work / f"test.{name}{'.run%d' % r if r else ''}.1best")]
              for name in ("mert", "mert+NLM0")}
    paired = bleu.paired_bootstrap(joined["mert"], joined["mert+NLM0"], [refs[0] * 3], bleu_config, 100)
    assert rows["mert+NLM0"]["p_value"] == pytest.approx(paired.p_value)
    assert rows["mert+NLM0"]["delta"] == pytest.approx(rows["mert+NLM0"]["test_bleu"] - rows["mert"]["test_bleu"])
    paired = bleu.paired_bootstrap(read_lines(work / "test.moses.1best"), read_lines(work / "test.moses+NLM0.line.1best"),
                                   refs, bleu_config, 100)
    assert rows["moses+NLM0"]["p_value"] == pytest.approx(paired.p_value)
    markdown = (work / "results.md").read_text()
    assert "tuned 3 times" in markdown and "- mert+NLM0 runs: seed 0: test" in markdown
    # MIRA on the same workdir: the rescored lists are reused, its systems have files of their own
    # (MERT's results stay), and its p-value pairs mira+NLM0 with mira.
    assert main(["experiment", "--workdir", str(work), "--dev-nbest", dev, "--dev-ref", dev_ref, "--test-nbest", test,
                 "--test-ref", test_ref, "--model", str(tiny_model_path), "--samples", "100", "--tuner", "mira"]) == 0
    assert "mira+NLM0" in capsys.readouterr().out
    assert (work / "test.nlm.nbest.gz").stat().st_mtime_ns == mtime
    assert json.loads((work / "results.json").read_text())["rows"] == replicated["rows"]
    by_mira = json.loads((work / "results.mira.json").read_text())
    assert by_mira["tuner"] == "mira" and (work / "results.mira.md").stat().st_size > 0
    rows = {r["system"]: r for r in by_mira["rows"]}
    assert list(rows) == ["moses", "mira", "mira+NLM0", "moses+NLM0"]
    assert rows["mira+NLM0"]["baseline"] == "mira" and "NLM0" in rows["mira+NLM0"]["weights"]
    assert rows["mira"]["signature"].endswith("|mira-runs:1") and "runs:" not in rows["moses"]["signature"]
    assert rows["moses"]["test_bleu"] == pytest.approx(saved["rows"][0]["test_bleu"])
    outputs = {name: read_lines(work / f"test.{name}.1best") for name in ("mira", "mira+NLM0", "moses+NLM0.line")}
    paired = bleu.paired_bootstrap(outputs["mira"], outputs["mira+NLM0"], refs, bleu_config, 100)
    assert rows["mira+NLM0"]["p_value"] == pytest.approx(paired.p_value)
    assert bleu.corpus_bleu(outputs["moses+NLM0.line"], refs, bleu_config)[0].score == pytest.approx(
        rows["moses+NLM0"]["test_bleu"])
    assert load_weights(str(work / "weights.moses+NLM0.line.ini")).as_dict() == rows["moses+NLM0"]["weights"]
    assert rows["moses+NLM0"]["weights"] == saved["rows"][3]["weights"]  # one line search for both tuners
    # A Kneser-Ney feature beside NLM0 (--kenlm): a unigram ARPA of the dev references, computed here.
    arpa = _unigram_arpa(read_lines(dev_ref), tmp_path / "dev.unigram.arpa")
    args = ["experiment", "--workdir", str(work), "--dev-nbest", dev, "--dev-ref", dev_ref, "--test-nbest", test,
            "--test-ref", test_ref, "--model", str(tiny_model_path), "--restarts", "0", "--samples", "100"]
    assert main([*args, "--kenlm", str(arpa)]) == 0
    assert "mert+KN1+NLM0" in capsys.readouterr().out
    with_kn = json.loads((work / "results.KN1.json").read_text())
    assert json.loads((work / "results.json").read_text())["rows"] == replicated["rows"]
    rows = {r["system"]: r for r in with_kn["rows"]}
    assert list(rows) == ["moses", "mert", "mert+KN1", "mert+KN1+NLM0", "moses+NLM0"]
    assert rows["mert"]["weights"] == saved["rows"][1]["weights"]  # the same tuning, reused
    assert rows["mert+KN1"]["baseline"] == "mert" and rows["mert+KN1+NLM0"]["baseline"] == "mert+KN1"
    assert set(rows["mert+KN1+NLM0"]["weights"]) >= {"KN1", "NLM0"} and "NLM0" not in rows["mert+KN1"]["weights"]
    assert rows["moses+NLM0"]["weights"]["KN1"] == [0.0]
    kn_hash = with_kn["kenlm_hash"][:12]
    assert rows["mert+KN1"]["signature"].endswith(f"|KN1:{kn_hash}") and "KN1:" not in rows["mert"]["signature"]
    model = kenlm.Model(str(arpa))
    for entry, _ in zip(iter_entries(work / "test.kn.nlm.nbest.gz"), range(50)):
        (kn1,) = dict(entry.dense)["KN1"]
        assert kn1 == pytest.approx(math.log(10) * model.score(entry.hyp, bos=True, eos=True), rel=1e-5, abs=1e-4)
        assert [name for name, _ in entry.dense][-2:] == ["KN1", "NLM0"]
    outputs = {name: read_lines(work / f"test.{name}.1best") for name in ("mert+KN1", "mert+KN1+NLM0")}
    paired = bleu.paired_bootstrap(outputs["mert+KN1"], outputs["mert+KN1+NLM0"], refs, bleu_config, 100)
    assert rows["mert+KN1+NLM0"]["p_value"] == pytest.approx(paired.p_value)
    # Another Kneser-Ney model in the same workdir would mix two models' lists: refused.
    other = _unigram_arpa(read_lines(test_ref), tmp_path / "other.arpa")
    assert main([*args, "--kenlm", str(other)]) == 1
    assert "use another workdir" in capsys.readouterr().err
    assert main([*args, "--kenlm", str(arpa), "--kenlm-name", "NLM0"]) == 1
    assert "is the neural model's feature" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a usage error, found by argparse
        main(["experiment", "--workdir", str(tmp_path / "none"), "--model", str(tiny_model_path), "--runs", "0"])
    assert stop.value.code == 2
    assert "argument --runs: must be 1 or more, not 0" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_moses_nlm0_is_the_exact_line_search_along_nlm0_for_both_tuners(tmp_path: Path) -> None:
    """``moses+NLM0`` (decoder weights kept, NLM0 free) on real lists: the BLEU-best NLM0
    weight on dev, found by the line search whichever the tuner, where MIRA stayed at 0.

    NLM0 here is a unigram model of the dev references (KenLM, read in-process): a real LM
    feature that helps on dev, so the best weight is not 0.
    """
    import numpy as np

    from nlmserve.moses_plugin import mert
    from nlmserve.moses_plugin.kenlm_source import KenlmScorer
    from nlmserve.pipeline.steps import NlmSource, Pipeline
    from nlmserve.moses_plugin.rescore import RescoreConfig, rescore

    dev, dev_ref = _slice("newstest2012", tmp_path)
    arpa = _unigram_arpa(read_lines(dev_ref), tmp_path / "dev.unigram.arpa")
    scorer = KenlmScorer(str(arpa))
    dev_nlm = tmp_path / "dev.nlm.nbest.gz"
    rescore(dev, str(dev_nlm), lambda: scorer, RescoreConfig(feature_name="NLM0", progress=False))
    found = {}
    for tuner in ("mert", "mira"):
        work = tmp_path / tuner
        work.mkdir()
        config = ExperimentConfig(workdir=str(work), dev_nbest=dev, dev_ref=(dev_ref,), tuner=tuner, restarts=0,
                                  mert_runs=2)
        pipeline = Pipeline(config, work, NlmSource.server("(not used by tuning)"))
        weights = pipeline.tuned(dev_nlm)
        assert len(weights["moses+NLM0"]) == 1 and len(weights[tuner]) == 2  # one line search, two seeded runs
        found[tuner] = (weights["moses+NLM0"][0], pipeline.dev_bleu["moses+NLM0"][0], weights["moses"][0])
        assert (work / "weights.moses+NLM0.line.ini").is_file()
    assert found["mert"][:2] == found["mira"][:2]
    tuned, tuned_bleu, decoder = found["mert"]
    # The decoder's weights kept (up to the L1 scale), NLM0 moved off 0.
    nlm = tuned.as_dict().pop("NLM0")[0]
    assert nlm != 0.0
    rest = {k: np.asarray(v) for k, v in tuned.as_dict().items() if k != "NLM0"}
    scale = sum(np.abs(v).sum() for v in rest.values()) / sum(np.abs(v).sum() for v in decoder.as_dict().values())
    for name, values in decoder.as_dict().items():
        assert rest[name] == pytest.approx(scale * np.asarray(values), rel=1e-9, abs=1e-12)
    # Exact: no NLM0 weight on a dense grid (either sign, six decades) does better on dev.
    bleu_scorer = bleu.SentenceStats(bleu.BleuConfig(), bleu.read_references([dev_ref]))
    data = mert.load_nbest_data([str(dev_nlm)], bleu_scorer)
    packed = mert.PackedData(data)
    assert data.layout[-1] == ("NLM0", 1)
    base = np.asarray(decoder.for_layout(data.layout[:-1]).flat())
    at = {}
    for gamma in np.concatenate([[0.0], np.logspace(-5, 1, 600), -np.logspace(-5, 1, 600)]):
        stats = packed.corpus_stats(np.append(base, gamma))  # NLM0 is the lists' last feature
        at[float(gamma)] = bleu.score_from_stats(bleu_scorer.metric, stats).score
    assert max(at.values()) > at[0.0]  # the data can show the effect: NLM0 at 0 is not the best
    assert tuned_bleu >= max(at.values()) - 1e-9
    assert at[0.0] == pytest.approx(pipeline.dev_bleu["moses"][0]) and tuned_bleu > at[0.0]


def test_training_text_joins_files_in_order(tmp_path: Path) -> None:
    import lzma

    from nlmserve.common.errors import NlmserveError
    from nlmserve.pipeline.experiment import training_text

    plain = tmp_path / "general.txt"
    plain.write_bytes(b"a b\nc d")  # no newline at the end: the next file must not run into it
    packed = tmp_path / "news.xz"
    packed.write_bytes(lzma.compress("é f\n\ng h\n".encode("utf-8")))
    work = tmp_path / "work"
    work.mkdir()
    assert training_text((str(plain),), work) == str(plain)  # one file is read in place
    joined = training_text((str(plain), str(packed), str(packed)), work)
    assert joined == str(work / "train.txt")
    assert Path(joined).read_bytes() == "a b\nc d\né f\n\ng h\né f\n\ng h\n".encode("utf-8")
    assert sorted(p.name for p in work.iterdir()) == ["train.txt"]
    plain.write_bytes(b"changed\n")
    assert Path(training_text((str(plain), str(packed)), work)).read_bytes().startswith(b"a b\n")  # reused on a rerun
    with pytest.raises(NlmserveError, match="training text .*missing.txt"):
        training_text((str(plain), str(tmp_path / "missing.txt")), tmp_path)
    assert not (tmp_path / "train.txt").exists()
    assert main(["experiment", "--workdir", str(tmp_path / "w2"), "--train-text", str(plain),
                 str(tmp_path / "missing.txt"), "--runs", "1"]) == 1


def test_the_demo_data_is_shipped_and_consistent() -> None:
    """The experiment's defaults (``make demo``) name shipped files, and the every-third-sentence
    lists are the full lists' lines renumbered, 50-best, aligned with their references."""
    config = ExperimentConfig()
    for name in (*config.train_text, config.valid_text, config.dev_nbest, *config.dev_ref, config.test_nbest,
                 *config.test_ref):
        assert Path(name).is_file(), name
    full_dir = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "nbest" / "newstest-fr-en"
    for nbest, (ref,) in ((config.dev_nbest, config.dev_ref), (config.test_nbest, config.test_ref)):
        groups = list(iter_sentences(nbest))
        assert [g[0].sent_id for g in groups] == list(range(len(groups))) == list(range(len(read_lines(ref))))
        assert all(1 <= len(g) <= 50 for g in groups) and sum(len(g) == 50 for g in groups) > 0.9 * len(groups)
        full = full_dir / Path(nbest).name.replace(".every3", "")
        if not full.exists():
            continue  # a clone without ../shared: the slice's own consistency is checked above
        wanted = {3 * i for i in range(len(groups))}
        kept = [g[:50] for g in iter_sentences(full) if g[0].sent_id in wanted]
        assert [[e.raw.split(" ||| ", 1)[1] for e in g] for g in kept] == \
            [[e.raw.split(" ||| ", 1)[1] for e in g] for g in groups]
        assert read_lines(ref) == read_lines(full.with_name(full.name.replace(".nbest.gz", ".ref")))[::3]


def test_workdir_records_its_inputs_and_refuses_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.common.errors import NlmserveError
    from nlmserve.pipeline.workdir import RECORD, check_workdir

    dev, dev_ref = _slice("newstest2012", tmp_path)
    test, test_ref = _slice("newstest2013", tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    config = ExperimentConfig(workdir=str(work), dev_nbest=dev, dev_ref=(dev_ref,), test_nbest=test, test_ref=(test_ref,))
    check_workdir(config, work, trains=True)
    record = json.loads((work / RECORD).read_text())
    assert record["lists"]["dev_nbest"] == hashlib.sha256(Path(dev).read_bytes()).hexdigest()
    assert len(record["training"]["train_text"]) == 3 and record["training"]["train_args"] == list(config.train_args)
    check_workdir(config, work, trains=True)  # the same inputs: a rerun goes on
    # Other lists, another training text, other training flags: refused before any work, naming them.
    other_dev = tmp_path / "other.nbest.gz"
    other_dev.write_bytes(gzip.compress(gzip.decompress(Path(dev).read_bytes())[:-200] + b"\n"))
    from dataclasses import replace

    for changed, names in ((replace(config, dev_nbest=str(other_dev)), ["lists.dev_nbest"]),
                           (replace(config, train_text=config.train_text[:1]), ["training.train_text"]),
                           (replace(config, train_args=("--order", "3"), lowercase=True),
                            ["lists.lowercase", "training.train_args"])):
        with pytest.raises(NlmserveError) as exc:
            check_workdir(changed, work, trains=True)
        assert all(name in str(exc.value) for name in names) and "choose another --workdir" in str(exc.value)
    # A workdir of an earlier demo recipe (a time budget, no step budget): refused, saying what
    # changed and what to do.
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    check_workdir(config, earlier, trains=True)
    old_record = json.loads((earlier / RECORD).read_text())
    del old_record["training"]["steps"]
    old_record["training"].update(minutes=4.0, train_args=["--order", "5"])
    (earlier / RECORD).write_text(json.dumps(old_record))
    with pytest.raises(NlmserveError) as exc:
        check_workdir(config, earlier, trains=True)
    assert f"training.steps: none recorded, {config.steps} now" in str(exc.value)
    assert "training.minutes: 4.0 recorded" in str(exc.value) and "[--order 5] recorded" in str(exc.value)
    assert f"rm -r {earlier}" in str(exc.value) and f"{earlier}-2" in str(exc.value)
    # A given model (no training here) is checked on its lists only; its hash ties the rescored lists.
    check_workdir(replace(config, train_args=("--order", "3")), work, trains=False)
    assert json.loads((work / RECORD).read_text()) == record
    # An earlier version's workdir: outputs, no record: refused (it would mix old and new results).
    old = tmp_path / "old"
    old.mkdir()
    (old / "dev.nlm.nbest.gz").write_bytes(b"")
    with pytest.raises(NlmserveError, match="no record of what they were made from"):
        check_workdir(config, old, trains=True)
    assert not (old / RECORD).exists()
    # Through the CLI: the refusal comes before a server is started or a model trained.
    assert main(["experiment", "--workdir", str(work), "--dev-nbest", str(other_dev), "--dev-ref", dev_ref,
                 "--test-nbest", test, "--test-ref", test_ref]) == 1
    assert "lists.dev_nbest differ" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == [RECORD]


def test_a_served_model_and_a_running_server_are_one_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["experiment", "--workdir", str(tmp_path / "w"), "--server", "127.0.0.1:1", "--via-server"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    from nlmserve.common.errors import NlmserveError

    with pytest.raises(NlmserveError, match="give one"):
        run(ExperimentConfig(workdir=str(tmp_path / "w"), server="127.0.0.1:1", via_server=True))
    assert not (tmp_path / "w").exists()


def test_the_old_spelling_of_runs_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    from nlmserve.cli import build_parser

    assert build_parser().parse_args(["experiment", "--mert-runs", "3"]).mert_runs == 3  # the new spelling's field
    assert capsys.readouterr().err.splitlines() == ["nlmserve experiment: warning: --mert-runs is deprecated; use --runs"]
    with pytest.raises(SystemExit) as stop:  # and its check of the value
        build_parser().parse_args(["experiment", "--mert-runs", "0"])
    assert stop.value.code == 2 and "argument --mert-runs: must be 1 or more, not 0" in capsys.readouterr().err