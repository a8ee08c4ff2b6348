"""Replicas behind TLS and bearer tokens: the Python client, `nlmserve rescore` with the security
flags, and docker/healthcheck.py over TLS (health stays open without a token)."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.client import LMClient
from nlmserve.common.errors import ServerUnavailableError
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine

REPO = Path(__file__).resolve().parent.parent
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
NEWS = REPO / "data" / "nbest" / "newstest-fr-en" / "newstest2013.300.nbest.gz"
NLMSERVE = [sys.executable, "-m", "nlmserve"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
TOKEN = "replica-token-0123"


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and one server certificate (localhost, 127.0.0.1) both replicas use, and a token file."""
    d = tmp_path_factory.mktemp("replica-pki")
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "2", "-subj", "/CN=replica-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=nlmserve")
    (d / "server.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                  "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(d, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext")
    (d / "tokens").write_text(f"# decoders\n{TOKEN}\n")
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key"),
            "tokens": str(d / "tokens")}


@pytest.fixture(scope="module")
def tls_replicas(tiny_lm: Any, certs: dict[str, str]) -> Iterator[list[RunningServer]]:
    started = []
    try:
        for _ in range(2):
            config = ServerConfig(model="(in-process)", port=0, tls_cert=certs["cert"], tls_key=certs["key"],
                                  token_file=certs["tokens"])
            started.append(create_server(config, engine=Engine(tiny_lm, config)))
        yield started
    finally:
        for s in started:
            s.stop(1.0)


def _served(s: RunningServer, rpc: str) -> int:
    return int(s.metrics.requests.labels(rpc, "OK")._value.get())


def test_tls_and_token_replicas_through_one_client(tls_replicas: list[RunningServer], certs: dict[str, str],
                                                   tiny_lm: Any) -> None:
    a, b = tls_replicas
    ngrams = [["of", "the"], ["the", "european", "union"], ["union"]]
    ids = np.array([np.concatenate([np.ones(tiny_lm.order - len(ng), np.int64), tiny_lm.vocab.encode(ng)])
                    for ng in ngrams])
    expected = tiny_lm.score_ngrams(ids, log10=True)
    for hosts in ((a.target, b.target), (f"localhost:{a.port}", f"localhost:{b.port}")):
        start = (_served(a, "ScoreNgrams"), _served(b, "ScoreNgrams"))
        with LMClient(list(hosts), tls_ca=certs["ca"], token_file=certs["tokens"], timeout=10) as client:
            for _ in range(10):
                np.testing.assert_allclose(client.score_ngrams(ngrams).log_probs, expected, atol=1e-5, rtol=0)
        assert (_served(a, "ScoreNgrams") - start[0], _served(b, "ScoreNgrams") - start[1]) == (5, 5)
    with LMClient([a.target, b.target], retries=0, timeout=5) as plain, pytest.raises(ServerUnavailableError):
        plain.info


def test_rescore_takes_the_security_flags(tls_replicas: list[RunningServer], certs: dict[str, str],
                                          tmp_path: Path) -> None:
    nbest = tmp_path / "news.nbest"
    with gzip.open(NEWS, "rt", encoding="utf-8") as src:
        nbest.write_text("".join(line for _, line in zip(range(200), src)), encoding="utf-8")
    a, b = tls_replicas
    servers = f"{a.target},{b.target}"
    base = NLMSERVE + ["rescore", "--nbest", str(nbest), "--no-progress", "--timeout", "30", "--wait-server", "10",
                       "--batch-ngrams", "1000"]
    outs = []
    for i, target in enumerate((a.target, servers)):
        out = tmp_path / f"out{i}.nbest"
        done = subprocess.run(base + ["--server", target, "--out", str(out), "--tls-ca", certs["ca"],
                                      "--token-file", certs["tokens"]],
                              capture_output=True, text=True, env=ENV, timeout=120)
        assert done.returncode == 0, done.stderr
        outs.append(out.read_text(encoding="utf-8"))
    lines = outs[0].splitlines()
    assert len(lines) == 200 and all(" NLM0= " in line for line in lines), outs[0][:500]
    assert outs[0] == outs[1]
    refused = subprocess.run(base + ["--server", servers, "--out", str(tmp_path / "x.nbest"), "--tls-ca", certs["ca"]],
                             capture_output=True, text=True, env=ENV, timeout=120)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


def _healthcheck(port: int, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK)], capture_output=True, text=True, timeout=30,
                          env={**ENV, "NLMSERVE_PORT": str(port), **env})


def test_container_health_check_over_tls_without_a_token(tls_replicas: list[RunningServer],
                                                          certs: dict[str, str]) -> None:
    port = tls_replicas[0].port
    ok = _healthcheck(port, NLMSERVE_TLS_CA=certs["ca"])
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    named = _healthcheck(port, NLMSERVE_TLS_CA=certs["ca"], NLMSERVE_HEALTH_HOST="127.0.0.1",
                         NLMSERVE_TLS_SERVER_NAME="localhost")
    assert named.returncode == 0, named.stderr
    plaintext = _healthcheck(port)
    assert plaintext.returncode == 1 and "unhealthy: UNAVAILABLE" in plaintext.stderr
    wrong_name = _healthcheck(port, NLMSERVE_TLS_CA=certs["ca"], NLMSERVE_TLS_SERVER_NAME="elsewhere.example")
    assert wrong_name.returncode == 1
    missing = _healthcheck(port, NLMSERVE_TLS_CA="/nonexistent/ca.pem")
    assert missing.returncode == 1 and "cannot read /nonexistent/ca.pem" in missing.stderr
