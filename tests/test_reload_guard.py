"""Reloads that cannot wedge the server: files that are no model file are refused at once
(a device, a FIFO, a directory, a 10 GB sparse file, a file of another size than its
header says), a reload asked for during another is refused rather than queued, and a read
that takes too long is abandoned; the served model serves on throughout. Real servers on
127.0.0.1 (port 0) over the tiny real model."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

import nlmserve.server.admin as admin
from nlmserve.client import LMClient, RpcError
from nlmserve.common.errors import ModelFileError, ReloadError
from nlmserve.common import memory
from nlmserve.lm.model_file import MAGIC
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig

MAX_MODEL_BYTES = ServerConfig(model="-").max_model_bytes
from nlmserve.server.engine import Engine

from support import dev_ngrams, serve_subprocess


@pytest.fixture()
def running(tiny_lm: Any, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningServer]:
    """A server of a copy of the tiny model in ``tmp_path``: its reload folder."""
    model = tmp_path / "served.nlm"
    shutil.copyfile(tiny_model_path, model)
    config = ServerConfig(model=str(model), port=0, allow_unauthenticated_admin=True, reload_timeout_seconds=2.0)
    server = create_server(config, engine=Engine(tiny_lm, config))
    yield server
    server.stop(0.5)


def serves(running: RunningServer, lm: Any) -> None:
    rows = dev_ngrams(lm, 0, 3)
    with LMClient(running.target, retries=0, timeout=10) as client:
        np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs,
                                   lm.score_ngrams(rows.astype(np.int64)), atol=1e-5, rtol=0)


def refused(running: RunningServer, path: str) -> str:
    """The FAILED_PRECONDITION message of Admin/ReloadModel ``path`` (within 10 s)."""
    with LMClient(running.target, retries=0, timeout=10) as client:
        with pytest.raises(RpcError) as err:
            client.reload_model(path)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    return str(err.value)


@pytest.fixture()
def odd_files(tmp_path: Path, tiny_model_path: Path) -> dict[str, tuple[str, str]]:
    """Paths that are no model file → the words their refusal must hold."""
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    sparse = tmp_path / "sparse.nlm"
    with open(sparse, "wb") as f:
        f.truncate(10 * 10**9)  # 10 GB of holes: no disk used
    blob = tiny_model_path.read_bytes()
    longer = tmp_path / "longer.nlm"
    longer.write_bytes(blob + b"\0" * 64)
    shorter = tmp_path / "shorter.nlm"
    shorter.write_bytes(blob[:-64])
    return {
        "device": ("/dev/zero", "model file is a character device, not a regular file"),  # the operator's path
        "fifo": (str(fifo), "model file is a FIFO, not a regular file"),
        "directory": (str(folder), "model file is a directory, not a regular file"),
        "sparse": (str(sparse), f"model file has {10 * 10**9} bytes, more than max_model_bytes = {MAX_MODEL_BYTES}"),
        "longer": (str(longer), f"model file has {len(blob) + 64} bytes, its header says {len(blob)} "
                                "(bytes after the data)"),
        "shorter": (str(shorter), f"model file has {len(blob) - 64} bytes, its header says {len(blob)} "
                                  "(truncated)"),
    }


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "sparse", "longer", "shorter"])
def test_a_file_that_is_no_model_file_is_refused_at_once(running: RunningServer, tiny_lm: Any,
                                                         odd_files: dict[str, tuple[str, str]], kind: str) -> None:
    path, words = odd_files[kind]
    if kind == "device":  # outside the reload folder: a ReloadModel call may not name it, SIGHUP's path may
        with pytest.raises(ReloadError) as err:
            running.reload(path)
        message = str(err.value)
    else:
        message = refused(running, path)
    assert f"{path}: {words}" in message
    assert message.count(path) == 1  # named once
    serves(running, tiny_lm)
    # the next reload is not held up by the refused one
    with LMClient(running.target, retries=0, timeout=30) as client:
        assert client.reload_model(running.config.model).model_hash == tiny_lm.model_hash


def test_a_start_with_a_device_as_model_fails_at_once() -> None:
    with pytest.raises(ModelFileError, match="/dev/zero: model file is a character device"):
        create_server(ServerConfig(model="/dev/zero", port=0))


def test_a_refused_file_is_named_once(running: RunningServer, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.nlm"
    garbage.write_bytes(b"NLMSERVE" + b"\x80\x04\x95" + b"\0" * 200)  # our magic, then a pickle's opcodes
    message = refused(running, str(garbage))
    assert message.count(str(garbage)) == 1
    assert "corrupt or not an nlmserve model file" in message and "upgrade" not in message


class SlowLoad:
    """``load_model`` held at a gate, to keep a reload in progress."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real: Callable[..., Any] = admin.load_model
        self.entered = threading.Event()
        self.gate = threading.Event()
        monkeypatch.setattr(admin, "load_model", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(20)
        return self.real(*args, **kwargs)


def test_a_reload_during_another_is_refused_not_queued(running: RunningServer, tiny_lm: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowLoad(monkeypatch)
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(running.reload()))
    thread.start()
    try:
        assert slow.entered.wait(10)
        with pytest.raises(ReloadError, match="a reload is in progress"):
            running.reload()  # as SIGHUP does
        message = refused(running, running.config.model)  # and the RPC
        assert "a reload is in progress" in message
        serves(running, tiny_lm)
    finally:
        slow.gate.set()
        thread.join(20)
    assert first and first[0].model_hash == tiny_lm.model_hash
    assert running.reload().model_hash == tiny_lm.model_hash  # accepted again


def test_a_read_that_takes_too_long_is_abandoned(running: RunningServer, tiny_lm: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowLoad(monkeypatch)
    try:
        with pytest.raises(ReloadError, match=r"took more than 2 s \(reload_timeout_seconds\); abandoned"):
            running.reload()
        with pytest.raises(ReloadError, match="a reload is in progress"):
            running.reload()  # the abandoned read has not ended: refused, not piled up
        serves(running, tiny_lm)
    finally:
        slow.gate.set()
    deadline = time.monotonic() + 20
    while True:  # the abandoned read ends; reloads are accepted again
        try:
            assert running.reload().model_hash == tiny_lm.model_hash
            break
        except ReloadError as e:
            assert "in progress" in str(e) and time.monotonic() < deadline
            time.sleep(0.05)


def test_sighup_with_a_fifo_as_model_file_does_not_wedge(tiny_model_path: Path, tiny_lm: Any,
                                                        tmp_path: Path) -> None:
    """SIGHUP re-reads --model; replaced by a FIFO it is refused at once, every time (the
    reloads are not queued behind a blocked read), and the server serves on."""
    model = tmp_path / "served.nlm"
    shutil.copyfile(tiny_model_path, model)
    log_path = tmp_path / "serve.log"
    server = serve_subprocess(model, log=log_path)
    proc = server.process
    try:
        model.unlink()
        os.mkfifo(model)
        for n in range(1, 4):
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while log_path.read_text(encoding="utf-8").count("model file is a FIFO") < n:
                assert time.monotonic() < deadline, log_path.read_text(encoding="utf-8")[-2000:]
                time.sleep(0.05)
        rows = dev_ngrams(tiny_lm, 0, 2)
        with LMClient(server.target, retries=0, timeout=10) as client:
            np.testing.assert_allclose(client.score_ids(rows, log_base="ln").log_probs,
                                       tiny_lm.score_ngrams(rows.astype(np.int64)), atol=1e-5, rtol=0)
        logged = log_path.read_text(encoding="utf-8")
        assert logged.count(f"{model}: model file is a FIFO, not a regular file") == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0


# ---------------------------------------------------------------------- one open, bounded reads
def test_a_symlink_flipped_to_a_fifo_after_the_check_is_never_read(tiny_lm: Any, tiny_model_path: Path,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's model path is a symlink, flipped to a FIFO right after the server
    looked at the file it named (its fstat). What is read is what was looked at (one open of
    the path): the reload serves the model; the next one, of the FIFO, is refused at once. A
    second open of the path read the FIFO: the reload was abandoned after
    reload_timeout_seconds and every later one refused as "in progress"."""
    target = tmp_path / "v1.nlm"
    shutil.copyfile(tiny_model_path, target)
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "current.nlm"
    link.symlink_to(target)
    config = ServerConfig(model=str(link), port=0, reload_timeout_seconds=2.0)
    running = create_server(config, engine=Engine(tiny_lm, config))
    real_fstat = os.fstat
    model_inode = os.stat(target).st_ino
    flipped: list[bool] = []

    def fstat_then_flip(fd: int) -> os.stat_result:
        info = real_fstat(fd)
        if not flipped and info.st_ino == model_inode:
            (tmp_path / "flip").symlink_to(fifo)
            os.replace(tmp_path / "flip", link)
            flipped.append(True)
        return info

    monkeypatch.setattr(os, "fstat", fstat_then_flip)
    try:
        assert running.reload().model_hash == tiny_lm.model_hash  # as SIGHUP does
        assert flipped and os.path.realpath(link) == str(fifo)
        with pytest.raises(ReloadError, match="model file is a FIFO, not a regular file"):
            running.reload()
        serves(running, tiny_lm)
    finally:
        with contextlib.suppress(OSError):  # a read blocked on the FIFO (a second open) gets its end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        running.stop(0.5)


def sparse_model(path: Path, size: int) -> Path:
    """A file of ``size`` bytes, holes after a valid prefix and header that declare that size
    (and a digest its zeros do not have)."""
    data_start = 0
    header = {"format": "nlmserve-model", "data_size": 0, "sha256": "0" * 64}
    for _ in range(2):  # the data size depends on the header's length, which depends on it
        header["data_size"] = size - data_start
        body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        data_start = (20 + len(body) + 63) // 64 * 64
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIQ", MAGIC, 1, len(body)) + body)
        f.truncate(size)
    return path


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), bytes."""
    value = memory.resident_bytes()
    assert value is not None, "no VmRSS in /proc/self/status"
    return value


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_a_refused_read_gives_its_memory_back(tiny_lm: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    """A 256 MiB sparse file whose header declares its size, with max_model_bytes above it:
    read in chunks, refused on its digest, and the server's resident memory is back within
    16 MiB of where it was once the refusal is answered (the old read kept the whole file
    alive in the refused reload's error)."""
    size = 256 * 1024 * 1024
    sparse = sparse_model(tmp_path / "sparse.nlm", size)
    model = tmp_path / "served.nlm"
    shutil.copyfile(tiny_model_path, model)
    config = ServerConfig(model=str(model), port=0, allow_unauthenticated_admin=True, max_model_bytes=size + 4096,
                          reload_timeout_seconds=60.0)
    running = create_server(config, engine=Engine(tiny_lm, config))
    try:
        serves(running, tiny_lm)
        with LMClient(running.target, retries=0, timeout=30) as client:  # what a first reload sets up is there
            assert client.reload_model(str(model)).model_hash == tiny_lm.model_hash
        before = resident_bytes()
        message = refused(running, str(sparse))
        after = resident_bytes()
        assert f"{sparse}: content hash mismatch" in message  # read to its end
        assert after - before < 16 * 1024 * 1024, (before, after)
        serves(running, tiny_lm)
    finally:
        running.stop(0.5)


def test_a_sparse_file_larger_than_the_default_limit_is_refused_before_a_read(running: RunningServer,
                                                                             tmp_path: Path) -> None:
    """3 GiB of holes whose header declares that size: refused by its size at once, by the
    default max_model_bytes (2 GiB, the product's largest models with headroom); before, the
    8 GiB default let it be read whole (0.3 → 3.5 GB) and refused only on the digest."""
    sparse = sparse_model(tmp_path / "three.nlm", 3 * 1024**3)
    message = refused(running, str(sparse))
    assert f"{sparse}: model file has {3 * 1024**3} bytes, more than max_model_bytes = {MAX_MODEL_BYTES}" in message


# ---------------------------------------------------------------------- what a refusal shows
def test_a_refusal_never_shows_the_bytes_of_the_file(running: RunningServer, tmp_path: Path) -> None:
    """A file that is no model file is refused without a byte of it in the message or the
    log: one of secrets in the reload folder (by the RPC), and /proc/self/environ (the
    operator's path; fstat gives it 0 bytes, reading it gives the environment)."""
    secret = tmp_path / "secret.nlm"
    secret.write_bytes(b"PASSWORD=hunter2-and-more-secret-bytes\n" * 4)
    message = refused(running, str(secret))
    assert f"{secret}: not an nlmserve model file" in message
    assert "PASSWORD" not in message and "hunter" not in message
    with pytest.raises(ReloadError) as err:
        running.reload("/proc/self/environ")
    environ = open("/proc/self/environ", "rb").read()[:8].decode("ascii", "replace")
    assert "/proc/self/environ: not an nlmserve model file" in str(err.value)
    assert environ not in str(err.value)


def test_a_path_with_a_newline_cannot_forge_a_log_line(running: RunningServer, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A ReloadModel path holding a newline (and other control characters) is shown with
    them escaped, in the refusal and in every log line: no line of its own for the
    characters after the newline."""
    forged = "x.nlm\n2030-01-01 00:00:00 INFO nlmserve.server.admin: reloaded\r\x1b[2K"
    evil = tmp_path / forged
    evil.write_bytes(b"not a model")
    with caplog.at_level(logging.INFO, logger="nlmserve"):
        message = refused(running, str(evil))
    shown = f"{tmp_path}/x.nlm\\n2030-01-01 00:00:00 INFO nlmserve.server.admin: reloaded\\r\\x1b[2K"
    assert f"{shown}: not an nlmserve model file" in message
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("nlmserve.server")]
    assert any(shown in line for line in lines), lines
    assert not any(c in line for line in lines for c in "\n\r\x1b"), lines
