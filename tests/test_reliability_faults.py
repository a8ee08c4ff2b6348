"""Faults on the real processes: ``kill -9`` of the server during ``nlmserve rescore``,
SIGTERM under concurrent load, and an output that cannot be written (unwritable folder,
full disk via RLIMIT_FSIZE). Everything runs on 127.0.0.1 with real subprocesses."""

from __future__ import annotations

import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

from nlmserve.common.serve_process import free_port
from nlmserve.proto import lm_pb2, lm_pb2_grpc

from support import nbest_head, serve_subprocess

NLMSERVE = [sys.executable, "-m", "nlmserve"]
N_SENTENCES = 40
BATCH_NGRAMS = "2000"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------ helpers
class Server:
    """``nlmserve serve`` as a subprocess; ``port`` 0 picks one (read from its first line)."""

    def __init__(self, model: Path, port: int = 0, *flags: str) -> None:
        self.stderr = tempfile.TemporaryFile()
        server = serve_subprocess(model, *flags, port=port, stderr=self.stderr, env=ENV)
        self.proc = server.process
        self.port = server.port
        self.target = server.target

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def news_list(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 40 sentences (about 3,900 hypotheses) of the shipped newstest2013 list, gzip."""
    return nbest_head(tmp_path_factory.mktemp("nbest") / "news40.nbest.gz", N_SENTENCES)


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    running = Server(tiny_model_path)
    yield running
    running.kill()


def rescore_cmd(target: str, nbest: Path, out: Path, *extra: str) -> list[str]:
    return NLMSERVE + ["rescore", "--server", target, "--nbest", str(nbest), "--out", str(out),
                       "--batch-ngrams", BATCH_NGRAMS, "--no-progress", "--timeout", "10", *extra]


@pytest.fixture(scope="module")
def reference(server: Server, news_list: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The output of an undisturbed ``nlmserve rescore`` run."""
    out = tmp_path_factory.mktemp("ref") / "ref.nbest"
    done = subprocess.run(rescore_cmd(server.target, news_list, out), capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data.count(b"\n") > 3000 and b"NLM0= " in data
    return data


def sentences_done(progress: Path) -> int:
    try:
        return int(json.loads(progress.read_text())["sentences_done"])
    except (OSError, ValueError, KeyError):
        return 0


# ------------------------------------------------------------------ (a) kill -9 of the server
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_server_killed_or_stopped_during_rescore_then_restarted_gives_identical_output(
        tiny_model_path: Path, news_list: Path, reference: bytes, tmp_path: Path, sig: signal.Signals) -> None:
    """kill -9 (a crash) or SIGTERM (a restart by the operator) of the server in the middle of the job."""
    port = free_port()
    first = Server(tiny_model_path, port)
    second: Server | None = None
    out = tmp_path / "out.nbest"
    progress = tmp_path / "out.nbest.progress.json"
    job = subprocess.Popen(rescore_cmd(first.target, news_list, out, "--wait-server", "90"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while sentences_done(progress) < 3 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        first.proc.send_signal(sig)
        first.proc.wait(30)
        killed_at = sentences_done(progress)
        assert job.poll() is None and 3 <= killed_at < N_SENTENCES, "the server must die in the middle of the job"
        time.sleep(2.0)  # the job finds no server for a while
        assert job.poll() is None, "the job must wait for the server, not give up"
        assert not out.exists()
        second = Server(tiny_model_path, port)  # the same port
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr
        assert "rescored" in stdout
        assert "unavailable" in stderr or "unreachable" in stderr  # it noticed the outage
        assert out.read_bytes() == reference
        assert not progress.exists() and not (tmp_path / "out.nbest.partial").exists()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        first.kill()
        if second is not None:
            second.kill()


# ------------------------------------------------------------------ (b) SIGTERM under load
@pytest.mark.slow
def test_sigterm_under_load_fails_no_request_sent_before_the_signal(tiny_model_path: Path, tiny_lm: Any) -> None:
    srv = Server(tiny_model_path, 0, "--grace-seconds", "30")
    rng = np.random.default_rng(3)
    vocab = len(tiny_lm.vocab)
    requests: list[tuple[lm_pb2.ScoreNgramsRequest, np.ndarray]] = []
    for size in (1, 2, 3, 20_000, 1, 2, 3, 8_000):
        ids = rng.integers(3, vocab, size=(size, tiny_lm.order)).astype(np.uint32)
        requests.append((lm_pb2.ScoreNgramsRequest(packed_ids=ids.tobytes(), packed_order=tiny_lm.order),
                         tiny_lm.score_ngrams(ids, log10=True)))
    records: list[tuple[float, float, str, bool]] = []  # start, end, status, values right
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        local: list[tuple[float, float, str, bool]] = []
        with grpc.insecure_channel(srv.target) as channel:
            stub = lm_pb2_grpc.LanguageModelStub(channel)
            i = k
            while not stop.is_set():
                request, expected = requests[i % len(requests)]
                i += 1
                t0 = time.monotonic()
                try:
                    got = np.asarray(stub.ScoreNgrams(request, timeout=60).log_probs)
                    right = got.shape == expected.shape and bool(np.allclose(got, expected, atol=1e-4, rtol=0))
                    local.append((t0, time.monotonic(), "OK", right))
                except grpc.RpcError as e:
                    local.append((t0, time.monotonic(), e.code().name, False))
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        time.sleep(0.05)
        with lock:
            records.extend(local)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(16)]
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        srv.kill()
    # A request's start is taken on the client before the call: one started in the last
    # moment before the signal may reach the server only after it stopped accepting (a
    # correct UNAVAILABLE). Requests started at least MARGIN earlier were surely sent.
    margin = 0.25
    before = [r for r in records if r[0] < signalled - margin]
    after = [r for r in records if r[0] >= signalled]
    assert len(before) > 20
    failed = [r for r in before if r[2] != "OK" or not r[3]]
    assert not failed, f"{len(failed)} of {len(before)} requests sent before SIGTERM failed: {failed[:5]}"
    sent_before = [r for r in records if r[0] < signalled]
    assert any(r[1] > signalled for r in sent_before), "some requests must have been in flight at the signal"
    # Calls that reach the server as it stops accepting end UNAVAILABLE or CANCELLED
    # (never processed); LMClient retries both, so a rescoring job loses nothing.
    assert {r[2] for r in sent_before} <= {"OK", "UNAVAILABLE", "CANCELLED"}
    assert all(r[3] for r in sent_before if r[2] == "OK")
    assert {r[2] for r in after} <= {"OK", "UNAVAILABLE", "CANCELLED"}
    assert all(r[3] for r in after if r[2] == "OK")
    assert "SIGTERM" in srv.stderr_text()
    print(f"{len(before)} requests sent before SIGTERM ({sum(r[1] > signalled for r in before)} in flight at the "
          f"signal), all OK; {len(after)} after it: {sorted((c, sum(r[2] == c for r in after)) for c in {r[2] for r in after})}")


# ------------------------------------------------------------------ (c) output that cannot be written
PREVIOUS = b"0 ||| an earlier output that must survive ||| a= 1 ||| 1\n"


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def assert_clear_error(done: subprocess.CompletedProcess[str], path: Path) -> None:
    """Exit 1 with one ``nlmserve rescore: error: ...`` line naming ``path``, no traceback."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("nlmserve rescore: error:")]
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0], lines[0]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


class ReadOnlyFolder:
    """A folder nobody can create files in: mode 0555, or ``chattr +i`` for root (who ignores modes)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.root = os.geteuid() == 0

    def __enter__(self) -> "ReadOnlyFolder":
        if not self.root:
            os.chmod(self.folder, 0o555)
        elif subprocess.run(["chattr", "+i", str(self.folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root and chattr +i is not allowed here: cannot make a folder unwritable")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.root:
            subprocess.run(["chattr", "-i", str(self.folder)], capture_output=True)
        else:
            os.chmod(self.folder, 0o755)


@dataclass(frozen=True)
class WriteFault:
    """What one output fault left behind: the rescore process, the output path and the folder."""

    done: subprocess.CompletedProcess[str]
    out: Path
    named: Path  # the path the error message must name
    left: dict[str, bytes | None]  # the folder's files afterwards


_FAULTS: dict[str, WriteFault] = {}


def write_fault(kind: str, server: Server, news_list: Path, base: Path) -> WriteFault:
    """Run ``nlmserve rescore`` into an output that cannot be written (once per kind and module).

    read_only_plain / read_only_gzip: the output folder does not allow new files;
    out_is_a_folder: the output path is an existing folder; full_disk: RLIMIT_FSIZE at a third
    of the output's size, so a write fails with EFBIG as on a full disk.
    """
    if kind in _FAULTS:
        return _FAULTS[kind]
    folder = base / kind
    folder.mkdir()
    out = folder / ("out.nbest.gz" if kind == "read_only_gzip" else "out.nbest")
    cmd = rescore_cmd(server.target, news_list, out)
    run: dict[str, Any] = {"capture_output": True, "text": True, "env": ENV, "timeout": 120}
    if kind.startswith("read_only"):
        out.write_bytes(PREVIOUS)
        with ReadOnlyFolder(folder):
            done = subprocess.run(cmd, **run)
        named = folder
    elif kind == "out_is_a_folder":
        out.mkdir()
        (out / "kept.txt").write_bytes(PREVIOUS)
        done = subprocess.run(cmd, **run)
        named = out
    elif kind == "full_disk":
        out.write_bytes(PREVIOUS)
        done = subprocess.run(cmd, preexec_fn=_limit_file_size(FULL_DISK_BYTES), **run)
        named = Path(str(out) + ".partial")
    else:
        raise ValueError(kind)
    _FAULTS[kind] = WriteFault(done, out, named, snapshot(folder))
    return _FAULTS[kind]


FAULT_KINDS = ["read_only_plain", "read_only_gzip", "out_is_a_folder", "full_disk"]
FULL_DISK_BYTES = 200_000  # the whole output is about 1.1 MB


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_unwritable_output_fails_and_keeps_the_previous_output(kind: str, server: Server, news_list: Path,
                                                               fault_dir: Path) -> None:
    fault = write_fault(kind, server, news_list, fault_dir)
    assert fault.done.returncode != 0, fault.done.stdout
    if kind == "out_is_a_folder":
        assert fault.left["out.nbest"] is None and fault.left["out.nbest/kept.txt"] == PREVIOUS
    else:
        assert fault.left[fault.out.name] == PREVIOUS
    if kind.startswith("read_only"):
        assert list(fault.left) == [fault.out.name]


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_unwritable_output_error_is_one_clear_line(kind: str, server: Server, news_list: Path,
                                                   fault_dir: Path) -> None:
    fault = write_fault(kind, server, news_list, fault_dir)
    assert_clear_error(fault.done, fault.named)


def test_after_a_full_disk_the_same_command_resumes_to_the_reference(server: Server, news_list: Path,
                                                                     reference: bytes, fault_dir: Path) -> None:
    fault = write_fault("full_disk", server, news_list, fault_dir)
    progress = Path(str(fault.out) + ".progress.json")
    assert 0 < sentences_done(progress) < N_SENTENCES  # the checkpoints before the failed write survive
    again = subprocess.run(rescore_cmd(server.target, news_list, fault.out), capture_output=True, text=True,
                           env=ENV, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "sentences resumed from a checkpoint" in again.stdout
    assert fault.out.read_bytes() == reference


# ------------------------------------------------------------------ bad lines in the rescored list
BAD_LINES = [b"0 ||| broken \xff\xfe bytes ||| LM0= -1 ||| -1\n", b"just words, no fields\n",
             b"12 ||| a b ||| LM0= one ||| -1\n", b"-1 ||| a ||| LM0= -1 ||| -1\n", b"3 ||| a ||| LM0= -1\n"]


def test_bad_lines_are_refused_with_file_and_line_or_skipped_to_the_clean_output(
        server: Server, news_list: Path, reference: bytes, tmp_path: Path) -> None:
    with gzip.open(news_list, "rb") as handle:
        lines = handle.read().splitlines(keepends=True)
    dirty: list[bytes] = []
    first_bad = 0
    for i, line in enumerate(lines):
        if i % 700 == 350:  # inside sentences as well as between them
            dirty.append(BAD_LINES[(i // 700) % len(BAD_LINES)])
            first_bad = first_bad or len(dirty)
        dirty.append(line)
    injected = len(dirty) - len(lines)
    dirty_list = tmp_path / "dirty.nbest.gz"
    dirty_list.write_bytes(gzip.compress(b"".join(dirty), mtime=0))
    out = tmp_path / "out.nbest"
    strict = subprocess.run(rescore_cmd(server.target, dirty_list, out), capture_output=True, text=True, env=ENV,
                            timeout=120)
    assert strict.returncode == 1 and "Traceback" not in strict.stderr, strict.stderr
    assert f"{dirty_list}:{first_bad}:" in strict.stderr
    assert not out.exists()
    skipped = subprocess.run(rescore_cmd(server.target, dirty_list, out, "--skip-bad"), capture_output=True,
                             text=True, env=ENV, timeout=120)
    assert skipped.returncode == 0, skipped.stderr
    assert f"skipped {injected} malformed lines" in skipped.stdout
    assert out.read_bytes() == reference
