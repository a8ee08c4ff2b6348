"""deploy/kubernetes against the server it runs: without a cluster, the manifests are read
and every number in them is checked against what `nlmserve serve` does with the
container's own command line, and a real server answers the probe and the scrape."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nlmserve.cli import build_parser
from nlmserve.client.replicas import endpoint_of
from nlmserve.server.app import create_server
from nlmserve.server.config import ServerConfig

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"


def manifests() -> dict[str, dict[str, Any]]:
    """Every object of the directory by kind (one of each)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, f"two {doc['kind']} objects"
            found[doc["kind"]] = doc
    return found


def container() -> dict[str, Any]:
    (only,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def serve_args() -> Any:
    """The container's command line as `nlmserve serve` parses it (an unknown flag exits)."""
    c = container()
    assert c["command"][:2] == ["nlmserve", "serve"]
    return build_parser().parse_args([*c["command"][1:], *c["args"]])


def port(name: str) -> int:
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name)


def cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_kustomization_applies_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    kinds = manifests()
    assert {"Namespace", "Deployment", "Service", "Kustomization"} == set(kinds)
    namespace = kinds["Namespace"]["metadata"]["name"]
    assert kinds["Deployment"]["metadata"]["namespace"] == kinds["Service"]["metadata"]["namespace"] == namespace


def test_the_container_runs_serve_with_flags_the_server_accepts() -> None:
    args = serve_args()
    assert args.host == "0.0.0.0"  # reachable from other pods (the default is loopback)
    assert args.port == port("grpc") and args.metrics_port == port("metrics")
    # the model comes from a read-only volume
    (mount,) = container()["volumeMounts"]
    assert Path(args.model).parent == Path(mount["mountPath"]) and mount["readOnly"] is True
    spec = manifests()["Deployment"]["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    # draining fits in the pod's grace period; torch uses the threads it was given
    assert spec["terminationGracePeriodSeconds"] > args.grace_seconds
    requests = container()["resources"]["requests"]
    assert args.torch_threads == cpus(requests["cpu"]) and args.device == "cpu"
    assert "memory" in requests and "memory" in container()["resources"]["limits"]


def test_probes_are_grpc_health_checks_on_the_grpc_port() -> None:
    args = serve_args()
    c = container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == args.port, probe
        assert c[probe]["grpc"].get("service", "") == "", probe
    readiness = c["readinessProbe"]
    # a draining replica leaves the Service before its grace period ends
    assert readiness["periodSeconds"] * readiness["failureThreshold"] < args.grace_seconds


def test_prometheus_annotations_name_the_metrics_port() -> None:
    annotations = manifests()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(serve_args().metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_headless_service_selects_the_deployments_pods() -> None:
    kinds = manifests()
    service, deployment = kinds["Service"], kinds["Deployment"]
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    names = {p["name"]: p["containerPort"] for p in container()["ports"]}
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["port"] == serve_args().port
    for p in by_name.values():
        assert p["targetPort"] in names and names[p["targetPort"]] == p["port"]


def test_clients_are_told_the_services_dns_name() -> None:
    service = manifests()["Service"]
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    target = f"dns:///{name}.{namespace}.svc.cluster.local:{serve_args().port}"
    scaling = (REPO / "docs" / "scaling.md").read_text()
    assert f'LMClient("{target}")' in scaling and f"--server {target}" in scaling and f"path={target}" in scaling
    assert target in (K8S / "service.yaml").read_text()
    endpoint = endpoint_of(target)  # what LMClient makes of it: one gRPC target, replicated
    assert endpoint.target == target and endpoint.replicated


def test_a_real_server_answers_the_probe_and_the_scrape(tiny_model_path: Path) -> None:
    running = create_server(ServerConfig(model=str(tiny_model_path), port=0, metrics_port=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        path = manifests()["Deployment"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}{path}") as response:
            assert response.status == 200
            assert re.search(r"^nlmserve_\w+", response.read().decode(), re.M)
    finally:
        running.stop(grace=0)


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--host", "--model"])
def test_every_networking_flag_is_given_explicitly(flag: str) -> None:
    """The server's defaults (loopback, no metrics) would make a pod that no probe reaches."""
    assert any(a == flag or a.startswith(flag + "=") for a in container()["args"])
