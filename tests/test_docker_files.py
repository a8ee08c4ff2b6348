"""What can be checked of docker/ without a Docker engine: the files parse, the compose file
wires what the README says, and every metric the Grafana dashboard queries is one a real
server exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from nlmserve.client import LMClient
from nlmserve.server.app import create_server
from nlmserve.server.config import ServerConfig

DOCKER = Path(__file__).resolve().parent.parent / "docker"
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
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
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
