"""The Python owners of the cross-language rules against proto/contract, one golden file
per rule (the C++ owners read the same files: tests/test_cpp_client.py,
``nlmserve_contract_test``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from contract import CONTRACT, cases, unescape
from nlmserve.common.errors import InputError
from nlmserve.wire.tokens import parse_tokens

TOKEN_CASES = cases("token_files.tsv", 2)


def test_token_cases_cover_every_outcome() -> None:
    kinds = {want.rsplit(":", 1)[0] if want.startswith("error:line:") else want.split(":")[0] if
             want.startswith("tokens:") else want for _, want in TOKEN_CASES}
    assert kinds == {"tokens", "error:no-token", "error:line"}


@pytest.mark.parametrize("text,want", TOKEN_CASES)
def test_token_files(text: str, want: str) -> None:
    data = unescape(text)
    try:
        got = "tokens:" + " ".join(parse_tokens(data, "f"))
    except InputError as e:
        got = "error:no-token" if e.line is None else f"error:line:{e.line}"
    assert got.encode("utf-8") == unescape(want), (data, got)


@pytest.mark.parametrize("text,want", TOKEN_CASES[:3] + TOKEN_CASES[-3:])
def test_token_files_read_by_server_and_client(tmp_path: Path, text: str, want: str) -> None:
    """The server's reader (every token) and the client's (the first) follow the same rule."""
    from nlmserve.client.core import read_token_file
    from nlmserve.server.auth import read_tokens

    path = tmp_path / "tokens"
    path.write_bytes(unescape(text))
    if want.startswith("tokens:"):
        tokens = unescape(want)[len("tokens:"):].split(b" ")
        assert read_tokens(path) == tuple(tokens)
        assert read_token_file(str(path)) == tokens[0].decode("ascii")
    else:
        for read in (read_tokens, read_token_file):
            with pytest.raises(InputError):
                read(str(path))


# ---------------------------------------------------------------------- retry codes
class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


RETRY_CASES = cases("retry_codes.tsv", 4)


def test_retry_cases_name_every_code_by_its_wire_number() -> None:
    named = {name: int(number) for name, number, _, _ in RETRY_CASES}
    assert named == {code.name: code.value[0] for code in grpc.StatusCode}
    assert {want for *_, want in RETRY_CASES} == {"retry", "final"}


@pytest.mark.parametrize("name,number,details,want", RETRY_CASES)
def test_retry_codes(name: str, number: str, details: str, want: str) -> None:
    from nlmserve.client.core import RetryPolicy
    from nlmserve.wire.status import retryable

    error = _Failed(grpc.StatusCode[name], "" if details == "-" else details)
    assert retryable(error.code(), error.details()) == (want == "retry")
    assert RetryPolicy(retries=1).should_retry(error, 0) == (want == "retry")
    assert not RetryPolicy(retries=1).should_retry(error, 1)  # the budget is spent


# ---------------------------------------------------------------------- status codes
STATUS_CASES = cases("status_codes.tsv", 3)


def test_status_cases_cover_every_exception_and_call_status() -> None:
    from nlmserve.wire.status import ERROR_CODES, CallStatus

    conditions = {c for c, _, _ in STATUS_CASES}
    assert {f"error:{cls.__name__}" for cls, _ in ERROR_CODES} <= conditions
    assert {f"call:{name}" for name in vars(CallStatus) if not name.startswith("_")} == \
        {c for c in conditions if c.startswith("call:")}
    assert "call:unauthenticated" in conditions


@pytest.mark.parametrize("condition,name,number", STATUS_CASES)
def test_status_codes(condition: str, name: str, number: str) -> None:
    from nlmserve.common import errors
    from nlmserve.wire.status import CallStatus, status_of

    code = grpc.StatusCode[name]
    assert code.value[0] == int(number)
    kind, _, what = condition.partition(":")
    if kind == "error":
        error = RuntimeError("x") if what == "other" else getattr(errors, what)("x")
        assert status_of(error) == code
    elif kind == "call":
        assert getattr(CallStatus, what) == code
    else:
        assert kind == "frontend"  # the C++ front end's own: test_native_frontend.py checks them


# ---------------------------------------------------------------------- server targets
@pytest.mark.parametrize("given,target,replicas,replicated,host", cases("server_targets.tsv", 5))
def test_server_targets(given: str, target: str, replicas: str, replicated: str, host: str) -> None:
    from nlmserve.client.replicas import endpoint_of

    text = unescape(given).decode("utf-8")
    if target == "error":
        with pytest.raises(ValueError):
            endpoint_of(text)
        return
    e = endpoint_of(text)
    assert (e.target, ",".join(e.replicas) or "-", "yes" if e.replicated else "no", e.host_name or "-") == \
        (target, replicas, replicated, host)


# ---------------------------------------------------------------------- feature hashes
HASH_CASES = cases("feature_hashes.tsv", 7)


def test_feature_hash_constants_in_python_and_the_proto() -> None:
    from nlmserve.lm.outputs import class_factored as outputs

    constants = {name: int(value) for kind, name, value, *_ in HASH_CASES if kind == "constant"}
    assert constants == {"seed": outputs.HASH_SEED, "ctx": outputs.HASH_CTX, "key": outputs.HASH_KEY,
                         "out": outputs.HASH_OUT, "mod": outputs.HASH_MOD}
    proto = (CONTRACT.parent / "nlmserve" / "v1" / "lm.proto").read_text(encoding="utf-8")
    c = constants
    assert f"h_0 = {c['seed']}, h_l = (h_{{l-1}} * {c['ctx']} + w_{{n-l}} + 1) mod (2^31 - 1)" in proto
    assert f"slot(h, y, size) = ((h * {c['key']} + y * {c['out']}) mod (2^31 - 1)) mod size" in proto
    assert c["mod"] == 2**31 - 1


@pytest.mark.parametrize("kind,V,context,y,size,hashes,slots", [c for c in HASH_CASES if c[0] == "hash"])
def test_feature_hashes(kind: str, V: str, context: str, y: str, size: str, hashes: str, slots: str) -> None:
    import numpy as np
    import torch

    from nlmserve.lm import fused
    from nlmserve.lm.outputs.class_factored import context_hashes, ngram_feature_index

    ctx = [] if context == "-" else [int(w) for w in context.split()]
    want_h = [int(h) for h in hashes.split()]
    want_s = [None if s == "-" else int(s) for s in slots.split()]
    got_h = context_hashes(torch.tensor([ctx], dtype=torch.int64).view(1, len(ctx)), no_word=int(V))[0]
    assert got_h.tolist() == want_h
    got_s = ngram_feature_index(got_h.view(1, -1), torch.tensor([int(y)]), int(size))[0].tolist()
    assert [s if w is not None else None for s, w in zip(got_s, want_s)] == want_s
    # The numpy twins (nlmserve.wire.ngrams), which the torch-free tables scorer uses.
    from nlmserve.wire.ngrams import feature_slots, suffix_hashes

    np_h = suffix_hashes(np.array([ctx], dtype=np.int64).reshape(1, len(ctx)), no_word=int(V))
    assert np_h[0].tolist() == want_h
    np_s = feature_slots(np_h, np.array([int(y)]), int(size))[0].tolist()
    assert [s if w is not None else None for s, w in zip(np_s, want_s)] == want_s
    # The fused CPU step's own loops (their hashes come times HASH_KEY; contexts with the
    # no-word never reach them: training data holds none).
    if all(s is not None for s in want_s):
        keyed = np.zeros(len(ctx) + 1, dtype=np.int64)
        fused._suffix_hashes(np.array([ctx], dtype=np.int64).reshape(1, len(ctx)), 0, len(ctx) + 1, keyed)
        assert [fused._slot(int(k), int(y), int(size)) for k in keyed] == want_s


# ---------------------------------------------------------------------- lowercasing
LOWER_CASES = cases("lowercase.tsv", 2)


def test_lowercase_cases_hold_non_ascii_and_the_special_cases() -> None:
    words = "".join(word for word, _ in LOWER_CASES)
    assert any(ord(c) > 0xFFFF for c in words) and "\u0130" in words and "\u03a3" in words
    assert any(len(word) != len(lower) for word, lower in LOWER_CASES)  # U+0130


@pytest.mark.parametrize("word,lower", LOWER_CASES)
def test_lowercase(word: str, lower: str) -> None:
    assert word.lower() == lower


def test_the_cpp_lowercase_tables_are_what_str_lower_gives() -> None:
    """nlmserve_lowercase.h is what proto/contract/lowercase_table.py writes from this
    Python's str.lower (it checks its tables against str.lower first)."""
    import subprocess
    import sys
    import unicodedata

    header = (CONTRACT.parents[1] / "client" / "cpp" / "nlmserve_lowercase.h").read_text(encoding="utf-8")
    if f'kUnicodeVersion[] = "{unicodedata.unidata_version}"' not in header:
        pytest.skip(f"the tables were written from another Unicode version than this Python's "
                    f"{unicodedata.unidata_version}")
    done = subprocess.run([sys.executable, str(CONTRACT / "lowercase_table.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------- scoring tables
WORD_CASES = cases("scoring_words.tsv", 3)


def test_word_cases_cover_lowercasing_and_unknown_words() -> None:
    lowered = {w: i for w, i, _ in WORD_CASES}
    cased = {w: i for w, _, i in WORD_CASES}
    assert lowered["ΟΔΟΣ"] == lowered["οδος"] != "unknown" and cased["ΟΔΟΣ"] == "unknown"
    assert lowered["\u0130stanbul"] != "unknown" and lowered["STRASSE"] == "unknown" == cased["zebra"]


@pytest.mark.parametrize("word,lowered,cased", WORD_CASES)
def test_fixture_words(word: str, lowered: str, cased: str) -> None:
    """Each word through the fixture files' vocabularies, by the Python reader's probing
    table (as the C++ reader probes it) and by its dict (what query --tables uses)."""
    from nlmserve.lm.tables_file import read_tables_file

    for name, want in (("scoring_tables.int8.nlt", lowered), ("scoring_tables_tree.nlt", cased)):
        t = read_tables_file(CONTRACT / name)
        expected = None if want == "unknown" else int(want)
        assert t.lookup(word) == expected, name
        assert t.index.get(word.lower() if t.lowercase else word) == expected, name


def test_the_scoring_fixture_is_what_lm_gives() -> None:
    """scoring_tables.txt and scoring_tables_tree.txt (read by the C++ nlmserve_contract_test)
    hold the tables and the scores nlmserve.lm gives their tiny class and tree models now,
    and their .nlt files those tables."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(CONTRACT / "scoring_fixture.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
