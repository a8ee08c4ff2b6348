"""A real Prometheus (Debian's package) scrapes a real nlmserve on 127.0.0.1: the counters it
stores match the traffic sent, and every PromQL expression of the Grafana dashboard returns
data."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from nlmserve.client import LMClient
from nlmserve.common.serve_process import free_port
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig

DASHBOARD = Path(__file__).resolve().parent.parent / "docker" / "grafana" / "dashboards" / "nlmserve.json"
PROMETHEUS = shutil.which("prometheus")

pytestmark = [pytest.mark.slow]
if PROMETHEUS is None:
    if os.environ.get("CI"):
        raise RuntimeError("prometheus is not installed: .ci/run installs it (make system-deps)")
    pytestmark.append(pytest.mark.skip(reason="Debian's prometheus package is not installed (make system-deps)"))


def query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def scalar(base: str, expr: str) -> float:
    result = query(base, expr)
    return float(result[0]["value"][1]) if result else math.nan


@pytest.fixture()
def server(tiny_model_path: Path) -> Iterator[RunningServer]:
    running = create_server(ServerConfig(model=str(tiny_model_path), port=0, metrics_port=0,
                                         ngram_cache_size=10_000, context_cache_size=1_000))
    yield running
    running.stop(grace=0)


@pytest.fixture()
def prometheus(server: RunningServer, tmp_path: Path) -> Iterator[str]:
    assert PROMETHEUS is not None
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: nlmserve\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.metrics_port}']\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp_path / "prometheus.log").read_text()[-2000:]) from None
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def test_prometheus_sees_the_traffic_and_the_dashboard_has_data(server: RunningServer, prometheus: str) -> None:
    ngram_requests, sentence_requests = 0, 0
    ngrams_sent = 0
    batch = [["the", "european", "parliament"], ["of", "the", "commission"], ["mr", "president", ","]]
    sentences = ["the house is open .", "i declare the session resumed ."]
    tokens_per_sentence_batch = sum(len(s.split()) + 1 for s in sentences)  # + </s>
    with LMClient(f"127.0.0.1:{server.port}") as client:
        # Traffic spread over several scrapes so that rate() has two samples to work with.
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            client.score_ngrams(batch)
            ngram_requests += 1
            ngrams_sent += len(batch)
            client.score_sentences(sentences)
            sentence_requests += 1
            ngrams_sent += tokens_per_sentence_batch
            time.sleep(0.05)
    expected_ok = 'nlmserve_requests_total{rpc="ScoreNgrams",code="OK"}'
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (scalar(prometheus, "sum(nlmserve_ngrams_scored_total)") == ngrams_sent
                and scalar(prometheus, expected_ok) == ngram_requests):
            break
        time.sleep(0.5)
    assert scalar(prometheus, expected_ok) == ngram_requests
    assert scalar(prometheus, 'nlmserve_requests_total{rpc="ScoreSentences",code="OK"}') == sentence_requests
    assert scalar(prometheus, "sum(nlmserve_ngrams_scored_total)") == ngrams_sent
    assert scalar(prometheus, 'nlmserve_cache_hits_total{cache="ngram"}') > 0
    info = query(prometheus, "nlmserve_model_info")
    assert info and info[0]["metric"]["model_hash"] == server.engine.lm.model_hash

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    empty = []
    for expr in exprs:
        values = [float(r["value"][1]) for r in query(prometheus, expr)]
        if not any(not math.isnan(v) for v in values):
            empty.append(expr)
    assert not empty, f"dashboard expressions without data: {empty}"
