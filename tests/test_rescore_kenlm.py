"""``nlmserve rescore --kenlm``: a Kneser-Ney model as the added feature (e.g. KN1 for an
in-domain LM), through the same streaming, checkpointed rescoring as the neural feature.

Values are checked against sums worked out by hand on the tiny bigram ARPA file, and
against KenLM's own whole-sentence scoring (``full_scores``) on a trigram file and on real
n-best lines: the per-n-gram decomposition of the rescoring loop must add up to it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nlmserve.cli import main
from nlmserve.common.errors import InputError
from nlmserve.moses_plugin.kenlm_source import KenlmScorer
from nlmserve.moses_plugin.nbest import file_sha256, iter_entries
from nlmserve.moses_plugin.rescore import RescoreConfig, rescore

from support import TINY_ARPA, TINY_ARPA_GOLDEN, nbest_head

kenlm = pytest.importorskip("kenlm", reason="the kenlm module is in the dev extras (make install)")

LN10 = math.log(10.0)

# A trigram file with back-off at every order; its numbers need not be normalised, since
# the reference is KenLM's own sentence scoring of the same file.
TRIGRAM_ARPA = """\\data\\
ngram 1=8
ngram 2=8
ngram 3=6

\\1-grams:
-1.5\t<unk>\t0
-99\t<s>\t-0.5
-1.0\t</s>\t0
-0.8\tthe\t-0.3
-1.2\teuropean\t-0.2
-1.3\tunion\t-0.25
-1.1\tis\t-0.15
-0.9\tof\t-0.1

\\2-grams:
-0.3\t<s> the\t-0.2
-1.0\t<s> european\t-0.1
-0.5\tthe european\t-0.1
-0.2\teuropean union\t-0.05
-0.4\tunion is\t0
-0.7\tunion </s>
-0.5\tis the\t-0.02
-0.3\tof the\t-0.1

\\3-grams:
-0.2\t<s> the european
-0.3\t<s> european union
-0.1\tthe european union
-0.3\teuropean union is
-0.35\tunion is the
-0.25\tof the european

\\end\\
"""

HYPS = ["the european union is the european union", "of the european union", "european union is of",
        "zebra the european", "the the the the", "union", "european union </s> the"]


def _config(**overrides: Any) -> RescoreConfig:
    values: dict[str, Any] = {"feature_name": "KN1", "batch_ngrams": 40, "progress": False}
    values.update(overrides)
    return RescoreConfig(**values)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _nbest(path: Path, hyps: list[str]) -> Path:
    lines = [f"{i // 3} ||| {h} ||| LM0= -{i + 1}.5 WordPenalty0= -{len(h.split())} ||| -{i}\n" for i, h in enumerate(hyps)]
    return _write(path, "".join(lines))


def _kn1(path: Path) -> list[float]:
    values = []
    for entry in iter_entries(path):
        name, (value,) = entry.dense[-1]
        assert name == "KN1"
        values.append(value)
    return values


def test_feature_is_the_hand_computed_sentence_log_probability(tmp_path: Path) -> None:
    arpa = _write(tmp_path / "tiny.arpa", TINY_ARPA)
    nbest = _nbest(tmp_path / "in.nbest", ["the of the", "of zebra"])
    stats = rescore(str(nbest), str(tmp_path / "out.nbest"), lambda: KenlmScorer(arpa), _config())
    # "the of the </s>" and "of zebra </s>": the per-token log10 values worked out by hand.
    want = [LN10 * sum(TINY_ARPA_GOLDEN[:4]), LN10 * sum(TINY_ARPA_GOLDEN[4:])]
    assert _kn1(tmp_path / "out.nbest") == pytest.approx(want, abs=5e-5)
    assert stats.hypotheses == 2 and stats.ngrams == 7
    assert stats.model_hash == file_sha256(arpa) and len(stats.model_hash) == 64


def test_the_ngram_decomposition_adds_up_to_kenlms_sentence_score(tmp_path: Path) -> None:
    arpa = _write(tmp_path / "tri.arpa", TRIGRAM_ARPA)
    model = kenlm.Model(str(arpa))
    nbest = _nbest(tmp_path / "in.nbest", HYPS)
    rescore(str(nbest), str(tmp_path / "out.nbest"), lambda: KenlmScorer(arpa), _config())
    want = [LN10 * model.score(h, bos=True, eos=True) for h in HYPS]
    assert _kn1(tmp_path / "out.nbest") == pytest.approx(want, rel=1e-5)
    # Row by row: the padded rows of the loop against KenLM's per-token full_scores.
    scorer = KenlmScorer(arpa)
    vocab = scorer.vocabulary()
    ids = [vocab.get(w, 0) for w in ["<s>", "<s>", "the", "european", "union", "is", "zebra", "</s>"]]
    rows = np.lib.stride_tricks.sliding_window_view(np.asarray(ids, dtype=np.uint32), 3)
    got = scorer.score_ids(rows, log_base="log10").log_probs
    tokens = [p for p, _, _ in model.full_scores("the european union is zebra", bos=True, eos=True)]
    np.testing.assert_allclose(got, tokens, rtol=1e-6)
    np.testing.assert_allclose(scorer.score_ids(rows).log_probs, LN10 * np.asarray(tokens), rtol=1e-6)


def test_real_list_lines_keep_every_byte_and_match_kenlm(tmp_path: Path) -> None:
    arpa = _write(tmp_path / "tri.arpa", TRIGRAM_ARPA)
    model = kenlm.Model(str(arpa))
    small = nbest_head(tmp_path / "small.nbest.gz", 5)
    out = tmp_path / "out.nbest.gz"
    stats = rescore(str(small), str(out), lambda: KenlmScorer(arpa), _config(batch_ngrams=2000))
    entries, originals = list(iter_entries(out)), list(iter_entries(small))
    assert stats.sentences == 5 and len(entries) == len(originals) == stats.hypotheses > 100
    for new, old in zip(entries, originals):
        value = new.dense[-1][1][0]
        assert value == pytest.approx(LN10 * model.score(old.hyp, bos=True, eos=True), rel=1e-5)
        assert new.raw.replace(f" KN1= {new.raw.split('KN1= ')[1].split()[0]}", "", 1) == old.raw


def test_lowercase_and_resume_after_a_crash(tmp_path: Path) -> None:
    arpa = _write(tmp_path / "tri.arpa", TRIGRAM_ARPA)
    hyps = HYPS * 4
    lower = _nbest(tmp_path / "lower.nbest", hyps)
    upper = _nbest(tmp_path / "upper.nbest", [h.upper().replace("</S>", "</s>") for h in hyps])
    reference = tmp_path / "reference.nbest"
    rescore(str(lower), str(reference), lambda: KenlmScorer(arpa), _config())
    cased = tmp_path / "cased.nbest"
    rescore(str(upper), str(cased), lambda: KenlmScorer(arpa), _config(lowercase=True))
    assert _kn1(cased) == _kn1(reference)

    class Crashing(KenlmScorer):
        calls = 0

        def score_ids(self, ids: np.ndarray, log_base: str = "ln", normalized: bool = True) -> Any:
            Crashing.calls += 1
            if Crashing.calls > 2:
                raise RuntimeError("injected failure")
            return super().score_ids(ids, log_base, normalized)

    out = tmp_path / "out.nbest"
    with pytest.raises(RuntimeError, match="injected failure"):
        rescore(str(lower), str(out), lambda: Crashing(arpa), _config())
    done = json.loads((tmp_path / "out.nbest.progress.json").read_text())["sentences_done"]
    assert 0 < done < 10 and not out.exists()
    stats = rescore(str(lower), str(out), lambda: KenlmScorer(arpa), _config())
    assert stats.resumed_sentences == done
    assert out.read_bytes() == reference.read_bytes()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arpa = _write(tmp_path / "tri.arpa", TRIGRAM_ARPA)
    nbest = _nbest(tmp_path / "in.nbest", HYPS)
    out = tmp_path / "out.nbest"
    assert main(["rescore", "--kenlm", str(arpa), "--nbest", str(nbest), "--out", str(out),
                 "--feature-name", "KN1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"model {file_sha256(arpa)}" in printed and "7 hypotheses" in printed
    model = kenlm.Model(str(arpa))
    assert _kn1(out) == pytest.approx([LN10 * model.score(h, bos=True, eos=True) for h in HYPS], rel=1e-5)
    # Adding a feature the list already has is refused with the file and line, not written twice.
    assert main(["rescore", "--kenlm", str(arpa), "--nbest", str(out), "--out", str(tmp_path / "again"),
                 "--feature-name", "KN1", "--no-progress"]) == 1
    assert f"{out}:1: already has a feature KN1: choose another --feature-name" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    # A server and a KenLM file at once, or neither, is a usage error.
    for extra in (["--server", "127.0.0.1:1", "--kenlm", str(arpa)], []):
        with pytest.raises(SystemExit) as stop:
            main(["rescore", *extra, "--nbest", str(nbest), "--out", str(tmp_path / "x")])
        assert stop.value.code == 2
    capsys.readouterr()


def test_bad_model_files_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nbest = _nbest(tmp_path / "in.nbest", HYPS)
    bad = _write(tmp_path / "bad.arpa", "not an arpa file\n")
    with pytest.raises(InputError, match="bad.arpa: cannot read the Kneser-Ney model"):
        rescore(str(nbest), str(tmp_path / "o"), lambda: KenlmScorer(bad), _config())
    with pytest.raises(InputError, match="no such Kneser-Ney model file"):
        KenlmScorer(tmp_path / "missing.bin")
    with pytest.raises(InputError, match="a directory"):
        KenlmScorer(tmp_path)
    assert main(["rescore", "--kenlm", str(bad), "--nbest", str(nbest), "--out", str(tmp_path / "o")]) == 1
    assert "nlmserve rescore: error: " + str(bad) + ": cannot read the Kneser-Ney model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
