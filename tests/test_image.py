"""The images built and serving, with no Docker daemon and no image registry:
docker/debian-base.sh makes a base from Debian's packages, ``buildah bud --isolation chroot``
builds docker/Dockerfile.cpu and docker/Dockerfile.cuda on it, and each image's entry point,
started by ``buildah run``, serves the health service and scores that the test asks for from
outside the container, equal to the model's own.

Slow (minutes), so opt-in: NLMSERVE_IMAGE_TEST=1, which .ci/run sets after ``make test`` when
buildah is installed. Needs root (buildah, debootstrap), a reachable Debian mirror and package
index. The build's pip gets the host's pip settings (index, certificate bundle, find-links
folders, bound read-only). The CPU image takes torch from a find-links folder that holds its
wheel (``--build-arg TORCH_INDEX=``), else from PyTorch's CPU index; the CUDA image takes
PyPI's CUDA build (its default; about 2.5 GB of downloads) and, on this base and without a GPU,
serves on the CPU. NLMSERVE_IMAGE_BASE names another base image to build on.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BASE = os.environ.get("NLMSERVE_IMAGE_BASE", "localhost/nlmserve-base:bookworm")
TORCH_WHEEL = "torch-2.13.0*.whl"
PIP_SETTINGS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "default-timeout")
NGRAMS = [["the", "european"], ["of", "the", "house"], ["the", "house", "is", "open", "."]]
TOL = 1e-5


def _unavailable() -> str | None:
    if os.environ.get("NLMSERVE_IMAGE_TEST") != "1":
        return ("builds and runs the CPU and CUDA images (minutes): set NLMSERVE_IMAGE_TEST=1 "
                "(.ci/run does, after make test, when buildah is installed)")
    if shutil.which("buildah") is None:
        return "needs buildah (Debian package buildah; .ci/run installs it as root)"
    probe = subprocess.run(["buildah", "from", "scratch"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"buildah cannot make a container here: {probe.stderr.strip()[-400:]}"
    subprocess.run(["buildah", "rm", probe.stdout.strip()], capture_output=True)
    return None


UNAVAILABLE = _unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")]


# buildah re-executes itself from a sealed in-memory copy of its binary before it runs a step
# (containers/storage's unshare); the kernel may refuse the seal with EBUSY while the copy's pages
# are still pinned, and the step fails before anything of the image's own has run.
REEXEC_TRANSIENT = "sealing memfd copy: Device or resource busy"


def buildah(*args: str, timeout: float = 300) -> str:
    """``buildah ARGS`` → its stdout; a failure is an AssertionError with its stderr (one on
    buildah's own re-execution, REEXEC_TRANSIENT, is retried once)."""
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and REEXEC_TRANSIENT in done.stderr:
        done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"buildah {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout.strip()


def logged(command: list[str], log: Path, timeout: float, report: list[str] | None = None) -> None:
    """Run ``command`` with its output in ``log``; a failure shows the end of that log. A failure
    of buildah's own re-execution (REEXEC_TRANSIENT) is retried once, and said in ``report``."""
    for attempt in (1, 2):
        with open(log, "w", encoding="utf-8") as out:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        if code == 0 or attempt == 2 or REEXEC_TRANSIENT not in tail:
            break
        if report is not None:
            report.append(f"{command[0]} {command[1]}: exit {code} on buildah's re-execution "
                          f"({REEXEC_TRANSIENT!r}), retried once")
    assert code == 0, f"{' '.join(command)}: exit {code}\n{tail}"


def host_pip_settings() -> dict[str, str]:
    """The pip settings of this host that say where packages come from: its configuration
    files, then PIP_* variables (which win, as for pip)."""
    found: dict[str, str] = {}
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.partition(".")
        if section in ("global", "install") and name in PIP_SETTINGS:
            found[name] = str(ast.literal_eval(value))
    for name in PIP_SETTINGS:
        value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            found[name] = value
    return found


def build_pip_flags(tmp: Path, find_links: bool) -> tuple[list[str], list[str], str]:
    """What gives the build's pip the host's settings: a pip.conf bound at /etc/pip.conf, the
    certificate bundle and find-links folders it names bound read-only at their own paths
    (indexes in local folders are left out: the build reaches the index over the network;
    find-links too unless ``find_links``) → (``-v`` flags, ``--build-arg`` flags, where torch
    comes from)."""
    settings = host_pip_settings()
    for key in ("index-url", "extra-index-url"):
        remote = [url for url in settings.pop(key, "").split() if not url.startswith("file:")]
        if remote:
            settings[key] = " ".join(remote)
    links = [link.removeprefix("file://") for link in settings.pop("find-links", "").split()] if find_links else []
    links = [link for link in links if not link.startswith("/") or Path(link).is_dir()]
    if links:
        settings["find-links"] = " ".join(links)
    binds: list[str] = []
    for path in [*links, settings.get("cert", "")]:
        if path.startswith("/") and Path(path).exists():
            binds += ["-v", f"{path}:{path}:ro"]
    wheels = [link for link in links if link.startswith("/") and any(Path(link).glob(TORCH_WHEEL))]
    args, torch_from = [], f"the Dockerfile's TORCH_INDEX, else {settings.get('index-url', 'PyPI')}"
    if wheels:
        args, torch_from = ["--build-arg", "TORCH_INDEX="], f"the wheel in {wheels[0]}"
    conf = tmp / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    return [*binds, "-v", f"{conf}:/etc/pip.conf:ro"], args, torch_from


def remove_leftovers(container: str, image: str) -> None:
    """The container and image of this or an earlier run that did not finish."""
    subprocess.run(["buildah", "rm", container], capture_output=True)
    subprocess.run(["buildah", "rmi", "-f", image], capture_output=True)


class Output:
    """The stdout lines of a process, read by a thread: ``wait_for(prefix)``."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, prefix: str, timeout: float, process: subprocess.Popen[str]) -> str | None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while time.monotonic() < deadline:
                found = next((line for line in self.lines if line.startswith(prefix)), None)
                if found is not None or process.poll() is not None:
                    return found
                self.changed.wait(0.5)
        return None


def stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM to the process group of ``buildah run``, then SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_serving(target: str, timeout: float, process: subprocess.Popen[str]) -> str:
    """Ask grpc.health.v1 at ``target`` until it says SERVING → the last status seen."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = "no answer"
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and process.poll() is None:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="nlmserve.v1.LanguageModel"), timeout=2)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if status == "SERVING":
                    break
            except grpc.RpcError as e:
                status = e.code().name
            time.sleep(0.5)
    return status


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Iterator[list[str]]:
    """Lines printed on the terminal at the end of the test, captured or not."""
    lines: list[str] = []
    yield lines
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The base image, made by docker/debian-base.sh unless present → (its name, what was done
    and how long it took)."""
    log = tmp_path_factory.mktemp("base") / "base.log"
    start = time.monotonic()
    logged(["sh", str(REPO / "docker" / "debian-base.sh"), BASE], log, timeout=3600)
    done = f"{log.read_text().strip().splitlines()[-1]} in {time.monotonic() - start:.0f} s"
    probe = subprocess.run(["buildah", "from", BASE], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    ran = subprocess.run(["buildah", "run", "--isolation", "chroot", probe.stdout.strip(), "--", "true"],
                         capture_output=True, text=True)
    subprocess.run(["buildah", "rm", probe.stdout.strip()], capture_output=True)
    if ran.returncode != 0:
        pytest.skip(f"buildah run --isolation chroot does not run here: {ran.stderr.strip()[-400:]}")
    return BASE, done


@pytest.mark.timeout(5400)
@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_the_image_builds_on_a_debian_base_and_serves(flavour: str, base: tuple[str, str], tiny_model_path: Path,
                                                      tiny_lm: Any, tmp_path: Path, report: list[str]) -> None:
    from nlmserve.client import LMClient
    from nlmserve.common.serve_process import parse_listening, parse_metrics

    image, container = f"localhost/nlmserve:{flavour}-image-test", f"nlmserve-image-test-{flavour}"
    remove_leftovers(container, image)
    report.append(f"Dockerfile.{flavour} on {base[1]}")
    binds, args, torch_from = build_pip_flags(tmp_path, find_links=flavour == "cpu")
    report.append(f"torch from {torch_from}")
    start = time.monotonic()
    try:
        logged(["buildah", "bud", "--isolation", "chroot", "--format", "docker", "--build-arg", f"BASE={base[0]}",
                *args, *binds, "-f", str(REPO / "docker" / f"Dockerfile.{flavour}"), "-t", image, str(REPO)],
               tmp_path / "build.log", timeout=3600, report=report)
        report.append(f"build (buildah bud): {time.monotonic() - start:.0f} s, "
                      f"image size {buildah('images', '--format', '{{.Size}}', image)}")

        model = tmp_path / "model.nlm"
        shutil.copyfile(tiny_model_path, model)
        model.chmod(0o644)  # the image's user reads it
        start = time.monotonic()
        buildah("from", "--name", container, image)
        # the container shares the host's network (chroot isolation): the server binds 127.0.0.1
        # and ports it picks, and prints them
        env = ["NLMSERVE_HOST=127.0.0.1", "NLMSERVE_PORT=0", "NLMSERVE_METRICS_PORT=0",
               "NLMSERVE_EXTRA_ARGS=--torch-threads 1"]
        with open(tmp_path / "serve.log", "w", encoding="utf-8") as log:
            process = subprocess.Popen(
                ["buildah", "run", "--isolation", "chroot", *[f"--env={e}" for e in env],
                 "-v", f"{model}:/models/model.nlm:ro", container, "--", "/usr/local/bin/entrypoint.sh"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        port = None
        try:
            output = Output(process.stdout)
            listening = output.wait_for("listening on ", 300, process)
            served = f"exit {process.poll()}" if process.poll() is not None else "still starting"
            assert listening, (f"no 'listening on' line from the container ({served}):\n"
                               + (tmp_path / "serve.log").read_text(errors="replace")[-3000:])
            target = parse_listening(listening)
            assert target, listening
            port = int(target.rsplit(":", 1)[1])
            status = wait_serving(f"127.0.0.1:{port}", 120, process)
            assert status == "SERVING", f"health: {status}\n" + (tmp_path / "serve.log").read_text()[-3000:]
            report.append(f"run to SERVING (buildah from + run): {time.monotonic() - start:.0f} s")
            # the server's malloc: jemalloc, which the image installs (docs/operating.md, Memory)
            assert "malloc: jemalloc (" in (tmp_path / "serve.log").read_text(errors="replace")

            with LMClient(f"127.0.0.1:{port}") as client:
                got = client.score_ngrams(NGRAMS).log_probs
            want = np.array([tiny_lm.score_ngrams(np.array([tiny_lm.vocab.encode(ng)]), log10=True)[0]
                             for ng in NGRAMS])
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
            report.append(f"log10 P(european | the) served by the image {got[0]:.6f}, in-process {want[0]:.6f}")

            metrics = output.wait_for("metrics on ", 10, process)
            url = parse_metrics(metrics or "")
            assert url, output.lines
            assert "nlmserve_" in urllib.request.urlopen(url, timeout=10).read().decode()

            # the image's own HEALTHCHECK command, and its torch, run in the container
            check = subprocess.run(["buildah", "run", "--isolation", "chroot", f"--env=NLMSERVE_PORT={port}", container,
                                    "--", "/opt/venv/bin/python3.11", "/usr/local/bin/healthcheck.py"],
                                   capture_output=True, text=True, timeout=60)
            assert (check.returncode, check.stdout.strip()) == (0, "SERVING"), check.stderr
            torch = buildah("run", "--isolation", "chroot", container, "--", "/opt/venv/bin/python3.11", "-c",
                            "import torch; print(torch.__version__, torch.version.cuda)", timeout=120)
            report.append(f"torch in the image: {torch} (version, CUDA)")
            version, cuda = torch.split()
            assert version.startswith("2.13.0") and (cuda != "None") == (flavour == "cuda"), torch
        finally:
            stop(process)
        if port is not None:
            deadline = time.monotonic() + 10
            while port_open(port) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not port_open(port), f"the server in the container still listens on {port} after its stop"
    finally:
        remove_leftovers(container, image)
