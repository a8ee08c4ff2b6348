"""The moses.ini line of the NeuralLMServer feature against proto/contract/moses_ini_lines.tsv:
every line the one writer (nlmserve.moses_plugin.moses_ini) writes is a line the file accepts,
read back with the values written; what the writer refuses to write, the file refuses too. The
C++ reader (nlmserve::ParseFeatureLine, which the feature reads its options with inside Moses)
passes the same file in nlmserve_contract_test (tests/test_cpp_client.py)."""

from __future__ import annotations

import pytest

from contract import cases
from nlmserve.moses_plugin.moses_ini import ModelFacts, feature_line, line_of

CASES = cases("moses_ini_lines.tsv", 3)
ACCEPTED = {line: read for line, outcome, read in CASES if outcome == "ok"}
REFUSED = {line: message for line, outcome, message in CASES if outcome == "error"}


def _facts(output: str, objective: str = "nce", tables: bool = True, self_normalized: bool = True) -> ModelFacts:
    return ModelFacts(order=5, output=output, objective=objective, self_normalized=self_normalized,
                      tables_missing=None if tables else "a hidden layer", model_hash="0" * 64)


SERVER = "127.0.0.1:50051"
TABLES = {"tables": "/abs/model.nlt"}
WRITTEN = {
    "a tree with tables: scoring=local, exact": feature_line(_facts("tree"), SERVER),
    "a class output with tables: scoring=local, self-normalised": feature_line(_facts("class"), SERVER),
    "self-normalised without tables: the server's": feature_line(_facts("softmax", tables=False), SERVER),
    "exact without tables: the server's": feature_line(_facts("class", "mle", tables=False, self_normalized=False),
                                                       SERVER),
    "the server-free line": feature_line(_facts("class"), None, extra=TABLES),
    "the server-free line of a tree": feature_line(_facts("tree"), None, extra=TABLES),
    "a tables file checked against a server": feature_line(_facts("class"), SERVER, extra=TABLES),
    "bench/decoder.py's prefetch runs": line_of({"name": "NLM0", "factor": "0", "order": "5", "path": SERVER,
                                                 "normalized": "false", "scoring": "local", "prefetch": "stack"}),
}


def test_the_file_has_both_outcomes() -> None:
    assert {outcome for _, outcome, _ in CASES} == {"ok", "error"}
    assert len(ACCEPTED) >= 10 and len(REFUSED) >= 10


@pytest.mark.parametrize("what", sorted(WRITTEN))
def test_every_written_line_is_accepted_and_read_back_as_written(what: str) -> None:
    line = WRITTEN[what]
    assert line in ACCEPTED, f"{what}: the golden file does not accept {line!r}"
    written = dict(word.split("=", 1) for word in line.split()[1:])
    read = dict(word.split("=", 1) for word in ACCEPTED[line].split())
    assert read == written


def test_bench_decoder_writes_through_the_one_writer() -> None:
    from bench.decoder import feature_line as bench_line

    line = bench_line({"normalized": "false", "scoring": "local", "prefetch": "stack"}, SERVER, 5)
    assert line == WRITTEN["bench/decoder.py's prefetch runs"]
    assert bench_line({"order": "3", "normalized": "true", "prefetch": "hypothesis"}, SERVER, 5) in ACCEPTED


def test_what_the_writer_refuses_the_file_refuses() -> None:
    """No source (neither path= nor tables=) and a word that is not KEY=VALUE: the writer raises
    where the feature would stop Moses."""
    with pytest.raises(ValueError, match="path= .* or tables="):
        feature_line(_facts("class"), None)
    assert any(m.startswith("needs tables=FILE") for m in REFUSED.values())
    with pytest.raises(ValueError, match="not a moses.ini option"):
        line_of({"name": "NLM0", "order": "5", "path": "h:1", "token-file": "a file"})
    with pytest.raises(ValueError, match="not a moses.ini option"):
        line_of({"name": "NLM0", "order": "5", "path": ""})
    assert "not KEY=VALUE: order" in REFUSED.values()
