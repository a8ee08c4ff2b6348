"""The frames of the native front end's private channel against their golden file,
proto/contract/local_frames.tsv, in both languages: the model server's side
(server/local_frames.py) reads every request row to its fields and writes every answer
row's bytes, and refuses every bad request; the front end's side
(server/native/local_frames.h, ``nlmserve_frontend --check-local-frames``) writes every
request row's bytes and reads every answer row to its fields, and refuses every bad
answer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from contract import CONTRACT, cases, unescape
from nlmserve.common.errors import ProtocolError
from nlmserve.server.local_frames import answer_frame, decode_request, failed_frame
from test_cpp_client import NATIVE, driver  # noqa: F401 - the driver fixture builds build/native

FRONTEND = NATIVE / "nlmserve_frontend"
FRAMES = cases("local_frames.tsv", 4)
# What the model server says of each refusal the file names.
REFUSALS = {"magic": "bad magic", "auth": "authorization of", "parts": "parts for",
            "part_table": "a part table that does not describe", "short": "closed inside a frame"}


def rows(kind: str) -> list[tuple[str, bytes, str]]:
    return [(name, bytes.fromhex(hexes.replace(" ", "")), fields) for frame, name, hexes, fields in FRAMES
            if frame == kind]


def names(kind: str) -> list[str]:
    return [name for name, _, _ in rows(kind)]


def parse(fields: str) -> tuple[dict[str, bytes], list[bytes]]:
    """A row's key=value fields (escapes made bytes), and its ``part`` values in order."""
    one: dict[str, bytes] = {}
    parts: list[bytes] = []
    for word in fields.split(" "):
        key, _, value = word.partition("=")
        if key == "part":
            parts.append(unescape(value))
        else:
            one[key] = unescape(value)
    return one, parts


def numbers(text: bytes) -> list[int]:
    return [int(x) for x in text.split(b",")] if text else []


def test_the_file_has_every_kind_of_frame_and_refusal() -> None:
    kinds = {frame for frame, *_ in FRAMES}
    assert kinds == {"request", "answer", "bad-request", "bad-answer"}
    assert {parse(f)[0]["error"].decode() for frame, _, _, f in FRAMES if frame == "bad-request"} == set(REFUSALS)
    assert {parse(f)[0]["error"].decode() for frame, _, _, f in FRAMES if frame == "bad-answer"} == {
        "malformed", "inconsistent", "short"}


@pytest.mark.parametrize("name,frame,fields", rows("request"), ids=names("request"))
def test_the_model_server_reads_each_request(name: str, frame: bytes, fields: str) -> None:
    want, parts = parse(fields)
    head, auth, shape, ids = decode_request(frame)
    assert (head.request_id, head.flags, head.timeout_ms, head.rows, head.width) == tuple(
        int(want[k]) for k in ("id", "flags", "timeout_ms", "rows", "width"))
    assert auth == want["auth"]
    assert shape == [tuple(int(n) for n in p.split(b":")) for p in parts]
    assert ids.dtype == np.dtype("<u4") and ids.shape == (head.rows, head.width)
    assert ids.ravel().tolist() == numbers(want["ids"])


@pytest.mark.parametrize("name,frame,fields", rows("bad-request"), ids=names("bad-request"))
def test_the_model_server_refuses_each_bad_request(name: str, frame: bytes, fields: str) -> None:
    with pytest.raises(ProtocolError, match=REFUSALS[parse(fields)[0]["error"].decode()]):
        decode_request(frame)


@pytest.mark.parametrize("name,frame,fields", rows("answer"), ids=names("answer"))
def test_the_model_server_writes_each_answer(name: str, frame: bytes, fields: str) -> None:
    want, parts = parse(fields)
    request_id, status, flags = (int(want[k]) for k in ("id", "status", "flags"))
    model_hash = want["hash"].decode()
    if status:
        assert not parts and not want["scores"] and want["rows"] == b"0"
        assert failed_frame(request_id, status, flags, model_hash, want["message"].decode()) == frame
        return
    assert want["message"] == b""
    scores = np.array([float(s) for s in want["scores"].split(b",")], dtype="<f4")
    statuses = [(int(code), message.decode()) for code, _, message in (p.partition(b":") for p in parts)]
    assert answer_frame(request_id, flags, model_hash, scores, statuses, len(parts)) == frame
    if all(code == 0 for code, _ in statuses):  # the model server's way when every part is OK
        assert answer_frame(request_id, flags, model_hash, scores, None, len(parts)) == frame


def test_the_front_end_writes_each_request_and_reads_each_answer(driver: Path) -> None:  # noqa: F811
    """The C++ side of the same file: every row but the bad requests (the model server's to
    refuse) checked; one byte changed in a request row and in an answer row fails the check."""
    golden = CONTRACT / "local_frames.tsv"
    done = subprocess.run([str(FRONTEND), "--check-local-frames", str(golden)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    checked = sum(1 for frame, *_ in FRAMES if frame != "bad-request")
    assert done.stdout == f"local frames: {checked} checked, 0 differ\n"


def test_the_front_ends_check_fails_on_a_changed_row(driver: Path, tmp_path: Path) -> None:  # noqa: F811
    golden = (CONTRACT / "local_frames.tsv").read_text(encoding="utf-8")
    changed = tmp_path / "local_frames.tsv"
    # The request's timeout (30000 = 0x7530) in the other byte order, and an answer's score.
    one_request = "4e4c5132 01000000 00000000 30750000"
    one_answer = "0000000000000000 000020c0\trequest=1:1:1 id=1"
    assert golden.count(one_request) == 1 and golden.count(one_answer) == 1
    changed.write_text(golden.replace(one_request, "4e4c5132 01000000 00000000 00007530")
                       .replace(one_answer, "0000000000000000 000020c1\trequest=1:1:1 id=1"), encoding="utf-8")
    done = subprocess.run([str(FRONTEND), "--check-local-frames", str(changed)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1
    assert done.stdout.endswith(" checked, 2 differ\n")
    assert "request 'one trigram, natural log, normalised' encodes to" in done.stderr
    assert "answer 'one part, natural log, normalised' reads other scores" in done.stderr
