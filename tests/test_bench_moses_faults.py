"""bench/moses_faults.py's own logic, without a Moses binary: what it reads from the decoder's
stderr, which outcome of each case counts as the one the feature promises, and the section it
renders. (Killing a server under a real decoder needs a Moses build: experiments/moses-decoder.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


from bench import moses_faults

# Lines of a real decoder's stderr (the shipped French-English system, the server killed under
# it), long addresses kept as they were.
REFUSED = ("status 14 (failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:33485: "
           "Failed to connect to remote host: Connection refused)")
FLOOR_LOG = f"""\
NeuralLMServer NLM0: 127.0.0.1:33485 model 8633f350 order 5 vocabulary 36660 unnormalized
NeuralLMServer NLM0: nlmserve ScoreNgrams at 127.0.0.1:33485 failed: {REFUSED}; scoring 17264 n-grams -100.000, and every request of the next 1000 ms
NeuralLMServer NLM0: nlmserve ScoreNgrams at 127.0.0.1:33485 failed: {REFUSED}; scoring 50133 n-grams -100.000, and every request of the next 2000 ms
NeuralLMServer NLM0: 40 sentences, 58 round trips, 6 failed requests, 856 requests floored, 474941 n-grams sent, 1327436 cache hits, 511749 misses; boundary scores: 9867510 in order, 0 looked up, 0 scored alone
"""
FAIL_LOG = f"""\
NeuralLMServer NLM0: 127.0.0.1:33485 model 8633f350 order 5 vocabulary 36660 unnormalized
terminate called after throwing an instance of 'util::Exception'
  what():  moses/LM/NeuralLMServer.cpp:426 in void Moses::NeuralLMServer::Failed(const std::string&, size_t, float*) const threw util::Exception.
NeuralLMServer NLM0: nlmserve ScoreNgrams at 127.0.0.1:33485 failed: {REFUSED}
"""
LOCAL_LOG = """\
NeuralLMServer NLM0: scoring locally with 199 MB of tables (width 256, self-normalised)
NeuralLMServer NLM0: 40 sentences, 0 round trips, 0 failed requests, 0 requests floored, 0 n-grams sent, 0 cache hits, 0 misses, 18059727 n-grams scored locally (12090179 remembered, 2333493 position rows summed); boundary scores: 11650387 in order, 0 looked up, 0 scored alone
"""
MESSAGE = f"NeuralLMServer NLM0: nlmserve ScoreNgrams at 127.0.0.1:33485 failed: {REFUSED}"


def test_the_facts_read_from_the_decoders_stderr() -> None:
    # on-error=floor: the closing counts, and the first failure without the floor's own words.
    assert moses_faults.log_facts(FLOOR_LOG) == {"failed_requests": 6, "floored_requests": 856, "message": MESSAGE}
    # on-error=fail: the process stopped, so no closing line; the message is the exception's.
    assert moses_faults.log_facts(FAIL_LOG) == {"failed_requests": None, "floored_requests": None, "message": MESSAGE}
    assert moses_faults.log_facts(LOCAL_LOG) == {"failed_requests": 0, "floored_requests": 0, "message": None}


def run(**changes: object) -> dict[str, object]:
    """A case's record as main() writes it: by default every sentence, identical, no error."""
    record: dict[str, object] = {"exit_status": 0, "sentences_written": 40, "identical": True,
                                 "prefix_identical": True, "failed_requests": 0, "floored_requests": 0,
                                 "message": None}
    record.update(changes)
    return record


FAILED = dict(exit_status=-6, sentences_written=2, identical=False, failed_requests=None,
              floored_requests=None, message=MESSAGE)


@pytest.mark.parametrize("case,record,expected", [
    # fail: stopped, with the message, the sentences before the failure and nothing else.
    ("fail", run(**FAILED), (True, "")),
    ("fail", run(), (False, "the decoder did not stop")),
    ("fail", run(**{**FAILED, "message": None}), (False, "no message from the feature naming the failure")),
    ("fail", run(**{**FAILED, "sentences_written": 40}),
     (False, "the server died after the last sentence (raise --lines or lower --kill-after)")),
    ("fail", run(**{**FAILED, "prefix_identical": False}), (False, "the sentences written differ from the undisturbed run's")),
    # floor: every sentence, exit 0, requests floored; the output may differ.
    ("floor", run(identical=False, prefix_identical=False, failed_requests=6, floored_requests=856), (True, "")),
    ("floor", run(floored_requests=0), (False, "no request floored: the server died after the last request")),
    ("floor", run(exit_status=1, floored_requests=3), (False, "exit status 1")),
    ("floor", run(sentences_written=39, floored_requests=3), (False, "39 of 40 sentences written")),
    # restart and local: as if nothing had happened.
    ("restart", run(), (True, "")),
    ("restart", run(failed_requests=1), (False, "1 failed requests")),
    ("local", run(), (True, "")),
    ("local", run(identical=False), (False, "the output differs from the undisturbed run's")),
])
def test_what_each_case_must_show(case: str, record: dict[str, object], expected: tuple[bool, str]) -> None:
    assert moses_faults.verdict(case, record, 40) == expected


def test_exit_status_as_a_shell_reports_it() -> None:
    assert moses_faults.exit_text(0) == "0"
    assert moses_faults.exit_text(1) == "1"
    assert moses_faults.exit_text(-6) == "134 (SIGABRT)"
    assert moses_faults.exit_text(-9) == "137 (SIGKILL)"


def test_the_rendered_section_and_render_only(tmp_path: Path) -> None:
    result = {
        "machine": {"cpu": "AMD EPYC", "cores": 2}, "commit": "056f74a", "argv": ["--lines", "40"],
        "lines": 40, "threads": 2, "kill_after_s": 2.0, "restart_after_s": 1.0,
        "cases": {
            "fail": {**run(**FAILED), "seconds_from_kill_to_exit": 10.0, "ok": True, "why": ""},
            "local": {**run(), "seconds_from_kill_to_exit": 10.6, "ok": False, "why": "the output differs"},
        },
    }
    text = moses_faults.render(result)
    lines = text.splitlines()
    assert lines[0] == "<!-- bench/moses_faults.py: begin -->" and lines[-1] == "<!-- bench/moses_faults.py: end -->"
    assert "| `scoring=server`, `on-error=fail` (the default) | 134 (SIGABRT) | 2 of 40 | — | 10.0 | " \
           "the undisturbed run's first lines | yes |" in lines
    assert "| `scoring=local` | 0 | 40 of 40 | 0 / 0 | 10.6 | identical to the undisturbed run | " \
           "**no**: the output differs |" in lines
    assert f"The feature's message: `{MESSAGE}`" in lines
    assert "    python -m bench.moses_faults --lines 40" in lines

    doc = tmp_path / "page.md"
    doc.write_text("before\n<!-- bench/moses_faults.py: begin -->\nold\n<!-- bench/moses_faults.py: end -->\nafter\n")
    saved = tmp_path / "faults.json"
    saved.write_text(json.dumps(result))
    assert moses_faults.main(["--moses", "m", "--ini", "i", "--model", "x", "--input", "s",
                              "--render", str(saved), "--doc", str(doc)]) == 0
    assert doc.read_text() == f"before\n{text}\nafter\n"
