"""What can be checked of docker/ without a Docker engine: the files parse, the compose file
wires what the README says, and every metric the Grafana dashboard queries is one a real
server exports."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from nlmserve.cli import build_parser
from nlmserve.client import LMClient
from nlmserve.server.app import create_server
from nlmserve.server.config import ServerConfig

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
DASHBOARD = DOCKER / "grafana" / "dashboards" / "nlmserve.json"
METRIC = re.compile(r"\bnlmserve_[a-z_]+")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dash["panels"] for t in panel["targets"]]


def test_compose_has_two_replicas_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"nlmserve-1", "nlmserve-2", "prometheus", "grafana"} <= set(services)
    for name in ("nlmserve-1", "nlmserve-2"):
        assert services[name]["environment"]["NLMSERVE_METRICS_PORT"] == "9090"
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["nlmserve-1:9090", "nlmserve-2:9090"]
    for path in (DOCKER / "grafana" / "provisioning").rglob("*.yaml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1


def test_dockerfiles_run_as_non_root_with_a_grpc_health_check() -> None:
    for name in DOCKERFILES:
        text = (DOCKER / name).read_text()
        assert re.search(r"^USER nlmserve$", text, re.M), name
        assert "HEALTHCHECK" in text and "healthcheck.py" in text, name
        assert "torch==2.13.0" in text, name
    assert "grpc_health" in (DOCKER / "healthcheck.py").read_text()


def test_every_dashboard_metric_is_exported(tiny_model_path: Path) -> None:
    running = create_server(ServerConfig(model=str(tiny_model_path), port=0, metrics_port=0,
                                         ngram_cache_size=100, context_cache_size=100))
    try:
        with LMClient(f"127.0.0.1:{running.port}") as client:
            client.score_ngrams([["the", "european"], ["of", "the", "house"]])
            client.score_sentences(["the house is open ."])
        text = urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics").read().decode()
    finally:
        running.stop(grace=0)
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("nlmserve_")}
    queried = {m for expr in dashboard_exprs() for m in METRIC.findall(expr)}
    assert len(queried) >= 8
    missing = sorted(m for m in queried if m not in exported)
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"
    # and the base names exist without the exposition suffix (a typo check on the suffixes)
    for m in queried:
        base = next((m[: -len(s)] for s in SUFFIXES if m.endswith(s)), m)
        assert any(e.startswith(base) for e in exported), m


@pytest.mark.parametrize("expr", dashboard_exprs())
def test_dashboard_expressions_are_balanced(expr: str) -> None:
    assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in (DOCKER / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def copies(name: str) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY and ADD."""
    out = []
    for op, args in instructions(name):
        if op in ("COPY", "ADD"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            out.append((words[:-1], words[-1]))
    return out


def python_minimum() -> str:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    found = re.fullmatch(r">=\s*(\d+\.\d+)", pyproject["project"]["requires-python"])
    assert found, pyproject["project"]["requires-python"]
    assert pyproject["tool"]["mypy"]["python_version"] == found.group(1)  # the type checker's Python too
    return found.group(1)


def build_args(name: str) -> tuple[dict[str, str], dict[str, str]]:
    """The ARGs of a Dockerfile with their defaults: (before its FROM, after it)."""
    ops = instructions(name)
    first = next(i for i, (op, _) in enumerate(ops) if op == "FROM")
    found: tuple[dict[str, str], dict[str, str]] = ({}, {})
    for i, (op, args) in enumerate(ops):
        if op == "ARG":
            key, _, value = args.partition("=")
            found[i > first][key] = value
    return found


def base_image(name: str) -> str:
    """The image a Dockerfile builds on by default: its FROM with the ARGs before it filled in."""
    (image,) = [args for op, args in instructions(name) if op == "FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda m: build_args(name)[0][m.group(1)], image)


BUILD_DEFAULTS = {
    "Dockerfile.cpu": {"BASE": "python:3.11-slim", "TORCH_INDEX": "https://download.pytorch.org/whl/cpu"},
    "Dockerfile.cuda": {"BASE": "nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04", "TORCH_INDEX": ""},
}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_base_image_and_torch_index_are_build_arguments(name: str, tmp_path: Path) -> None:
    """``FROM ${BASE}`` and TORCH_INDEX, whose defaults build what the images always built; the
    torch install line, run by sh with TORCH_INDEX set (an index) or empty (pip's own
    settings: its index, find-links), hands pip the arguments it should."""
    before, after = build_args(name)
    assert [args for op, args in instructions(name) if op == "FROM"] == ["${BASE}"]
    assert before == {"BASE": BUILD_DEFAULTS[name]["BASE"]} and base_image(name) == before["BASE"]
    assert after == {"TORCH_INDEX": BUILD_DEFAULTS[name]["TORCH_INDEX"]}
    (install,) = [part.strip() for op, args in instructions(name) if op == "RUN" for part in args.split("&&")
                  if "torch==" in part]
    (tmp_path / "pip").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@"\n')
    (tmp_path / "pip").chmod(0o755)
    shown = install.replace("/opt/venv/bin/python3.11 -m pip", str(tmp_path / "pip"), 1)
    assert shown != install, install
    for index in (after["TORCH_INDEX"], "", "https://mirror.example/torch cpu/"):
        done = subprocess.run(["sh", "-c", shown], env={"PATH": "/usr/bin:/bin", "TORCH_INDEX": index},
                              capture_output=True, text=True, check=True)
        assert done.stdout.splitlines() == ["install", "torch==2.13.0", *(["--index-url", index] if index else [])]


def test_the_debian_base_script_makes_what_the_images_need() -> None:
    """docker/debian-base.sh (run by tests/test_image.py): Debian's minbase with python3 (3.11
    on bookworm) and its venv module, ca-certificates for pip, libjemalloc2 for the server's
    malloc, and a PATH for ENV PATH to extend."""
    script = (DOCKER / "debian-base.sh").read_text()
    assert re.search(r"^debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libjemalloc2 ",
                     script, re.M)
    assert "${SUITE:-bookworm}" in script and "--env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin" in script
    assert subprocess.run(["sh", "-n", str(DOCKER / "debian-base.sh")]).returncode == 0


@pytest.mark.parametrize("name", DOCKERFILES)
def test_everything_the_images_copy_is_in_the_repository(name: str) -> None:
    assert copies(name)
    for sources, _ in copies(name):
        for source in sources:
            assert (REPO / source).exists(), f"{name}: COPY {source}: not in the repository (the build context)"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_run_pyprojects_python(name: str) -> None:
    """Every python the image installs, makes a venv with, runs pip or the health check with
    is python3.X of requires-python; pip only as ``python3.X -m pip``."""
    version = python_minimum()
    commands = [args for op, args in instructions(name) if op in ("RUN", "CMD", "HEALTHCHECK", "ENTRYPOINT")]
    image = re.match(r"python:([\d.]+)", base_image(name))
    if image:
        assert image.group(1) == version, f"{name}: FROM {base_image(name)}"
    pythons = [m.group(0) for text in commands for m in re.finditer(r"[\w./-]*python[\w.-]*", text)]
    assert pythons, name
    for word in pythons:
        assert word.rsplit("/", 1)[-1].startswith(f"python{version}"), f"{name}: {word} is not python{version}"
    for text in commands:
        assert not re.search(r"(?:^|&&|;|\|\|)\s*(?:[\w./-]*/)?pip[\d.]*\s", text), f"{name}: a bare pip in {text!r}"
    venv = next(args for op, args in instructions(name) if op == "RUN" and "-m venv" in args)
    assert f"python{version} -m venv /opt/venv" in venv
    env = " ".join(args for op, args in instructions(name) if op == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env  # nlmserve itself (entrypoint.sh) runs from the venv


def image_context(name: str, dest: Path) -> Path:
    """The files the image's install step sees: its COPYs into the work directory."""
    for sources, target in copies(name):
        if target.startswith("/"):
            continue  # entrypoint and health check, outside the package
        for source in sources:
            into = dest / target / Path(source).name if target.endswith("/") or len(sources) > 1 else dest / target
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / source, into)
    return dest


def test_the_images_install_by_the_package_build(tmp_path: Path) -> None:
    """No protoc or sed of their own: `pip install .` on what they copy, which this test
    builds into a wheel holding the generated stubs (the images' pip runs the same build,
    in an isolated environment)."""
    contexts = set()
    for name in DOCKERFILES:
        runs = " && ".join(args for op, args in instructions(name) if op == "RUN")
        installs = re.findall(r"-m pip install ([^&]*)", runs)
        assert installs and installs[-1].strip() == ".", f"{name}: {installs}"
        assert all(i.startswith(("torch==2.13.0", "--upgrade pip")) for i in installs[:-1]), installs
        for word in ("protoc", "grpc_tools", "grpcio-tools", "sed ", "gen/proto"):
            assert word not in runs, f"{name}: {word}"
        contexts.add(tuple(map(str, copies(name))))
    assert len(contexts) == 1  # both images install the same files
    context = image_context(DOCKERFILES[0], tmp_path / "opt-nlmserve")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(context)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("nlmserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"nlmserve/proto/lm_pb2.py", "nlmserve/proto/lm_pb2_grpc.py", "nlmserve/cli.py",
            "nlmserve/server/cli.py"} <= set(names)


def image_env(name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in instructions(name):
        if op == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args) if word.startswith("NLMSERVE_"))
    return env


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_entrypoint_starts_nlmserve_serve_with_flags_it_accepts(name: str, tmp_path: Path) -> None:
    """entrypoint.sh run by sh with the image's environment; a stand-in `nlmserve` on PATH
    records the command line, which the real `nlmserve serve` parser must accept."""
    (tmp_path / "nlmserve").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@"\n')
    (tmp_path / "nlmserve").chmod(0o755)
    base = {"PATH": f"{tmp_path}:/usr/bin:/bin", **image_env(name)}
    cases = [
        ({}, [], {"model": "/models/model.nlm", "host": "0.0.0.0", "port": 50051, "metrics_port": 9090, "device": None}),
        ({"NLMSERVE_DEVICE": "cuda:1", "NLMSERVE_EXTRA_ARGS": "--ngram-cache-size 100000 --max-delay-us 500"},
         ["--torch-threads", "2"], {"device": "cuda:1", "ngram_cache_size": 100000, "max_delay_us": 500, "torch_threads": 2}),
    ]
    for env, container_args, expected in cases:
        done = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), *container_args], env={**base, **env},
                              capture_output=True, text=True, check=True)
        argv = done.stdout.splitlines()
        assert argv[0] == "serve", argv
        args = build_parser().parse_args(argv)  # an unknown flag would exit here
        assert {k: getattr(args, k) for k in expected} == expected, argv
