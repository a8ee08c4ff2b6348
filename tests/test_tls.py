"""TLS and mutual TLS against a real server on 127.0.0.1 (port 0), the tiny real model.

A throwaway PKI is made at test time with the ``openssl`` command line: a CA, a server
certificate for localhost/127.0.0.1, a client certificate signed by the CA, and a client
certificate signed by another ("rogue") CA.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from nlmserve.client import AsyncLMClient, LMClient, RpcError
from nlmserve.common.errors import InputError, ServerUnavailableError
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine

from support import dev_sentences, start_server

TOL = 1e-5


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_ca: str
    rogue_cert: str
    rogue_key: str
    rogue_server_cert: str
    rogue_server_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: Path, name: str, ca: str, usage: str, san: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(
        f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
        f"subjectAltName={san}\n", encoding="ascii")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "serverAuth", "DNS:localhost,IP:127.0.0.1")
    _leaf(d, "client", "ca", "clientAuth", "DNS:decoder-1")
    _leaf(d, "rogue-client", "rogue-ca", "clientAuth", "DNS:decoder-2")
    _leaf(d, "rogue-server", "rogue-ca", "serverAuth", "DNS:localhost,IP:127.0.0.1")
    p = {n: str(d / n) for n in ("ca", "server", "client", "rogue-ca", "rogue-client", "rogue-server")}
    return Pki(p["ca"] + ".pem", p["server"] + ".pem", p["server"] + ".key", p["client"] + ".pem",
               p["client"] + ".key", p["rogue-ca"] + ".pem", p["rogue-client"] + ".pem", p["rogue-client"] + ".key",
               p["rogue-server"] + ".pem", p["rogue-server"] + ".key")


def expected_totals(lm: Any, sentences: list[str]) -> np.ndarray:
    return np.asarray([lm.score_sentences([s.split()], log10=True)[0].total for s in sentences])


def _totals(client: LMClient, sentences: list[str]) -> np.ndarray:
    return np.asarray([s.total for s in client.score_sentences(sentences)])


@pytest.fixture(scope="module")
def tls_server(tiny_lm: Any, pki: Pki) -> Iterator[RunningServer]:
    running = start_server(tiny_lm, tls_cert=pki.server_cert, tls_key=pki.server_key)
    yield running
    running.stop(1.0)


@pytest.fixture(scope="module")
def mtls_server(tiny_lm: Any, pki: Pki) -> Iterator[RunningServer]:
    running = start_server(tiny_lm, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    yield running
    running.stop(1.0)


def test_tls_client_scores_and_a_plaintext_client_is_refused(tls_server: RunningServer, tiny_lm: Any,
                                                             pki: Pki) -> None:
    sentences = dev_sentences(0, 20)
    with LMClient(tls_server.target, tls_ca=pki.ca, timeout=10) as client:
        np.testing.assert_allclose(_totals(client, sentences), expected_totals(tiny_lm, sentences), atol=1e-3)
        assert client.score_ngrams([["the", "european"]]).model_hash == tiny_lm.model_hash
    with LMClient(f"localhost:{tls_server.port}", tls_ca=pki.ca, timeout=10) as client:  # name in the SAN too
        assert client.info.model_hash == tiny_lm.model_hash
    with LMClient(tls_server.target, retries=0, timeout=5) as plain, \
            pytest.raises(ServerUnavailableError, match="Socket closed.*if it serves TLS, connect with --tls"):
        plain.info
    plaintext = start_server(tiny_lm)  # and the other way round
    try:
        with LMClient(plaintext.target, tls_ca=pki.ca, retries=0, timeout=5) as tls_client, \
                pytest.raises(ServerUnavailableError, match="the server may serve plaintext"):
            tls_client.info
    finally:
        plaintext.stop(0.5)
    # A server certificate from a CA the client does not trust fails the handshake.
    with LMClient(tls_server.target, tls_ca=pki.rogue_ca, retries=0, timeout=5) as wrong_ca, \
            pytest.raises(ServerUnavailableError):
        wrong_ca.info


def test_mutual_tls_needs_a_client_certificate_signed_by_the_ca(mtls_server: RunningServer, tiny_lm: Any,
                                                                pki: Pki) -> None:
    sentences = dev_sentences(0, 10)
    with LMClient(mtls_server.target, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key,
                  timeout=10) as client:
        np.testing.assert_allclose(_totals(client, sentences), expected_totals(tiny_lm, sentences), atol=1e-3)
    with LMClient(mtls_server.target, tls_ca=pki.ca, retries=0, timeout=5) as no_cert, \
            pytest.raises(ServerUnavailableError):
        no_cert.info
    with LMClient(mtls_server.target, tls_ca=pki.ca, tls_cert=pki.rogue_cert, tls_key=pki.rogue_key,
                  retries=0, timeout=5) as rogue, pytest.raises(ServerUnavailableError):
        rogue.info
    with LMClient(mtls_server.target, retries=0, timeout=5) as plain, pytest.raises(ServerUnavailableError):
        plain.info


def test_async_client_over_mutual_tls_with_a_token(tiny_lm: Any, pki: Pki, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-token\n", encoding="utf-8")
    running = start_server(tiny_lm, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca,
                    token_file=str(tokens))
    sentences = dev_sentences(0, 5)

    async def run() -> tuple[list[float], str]:
        async with AsyncLMClient(running.target, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key,
                                 token_file=str(tokens), timeout=10) as lm:
            totals = [s.total for s in await lm.score_sentences(sentences)]
            try:  # this server was given no model file to reload
                await lm.reload_model()
            except RpcError as e:
                assert e.code.name == "FAILED_PRECONDITION" and "(in-process)" in str(e)
            else:
                raise AssertionError("reloading '(in-process)' succeeded")
        async with AsyncLMClient(running.target, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key,
                                 retries=0, timeout=5) as anonymous:
            try:
                await anonymous.get_info()
            except RpcError as e:
                return totals, e.code.name
        return totals, "OK"

    try:
        totals, anonymous_code = asyncio.run(run())
    finally:
        running.stop(1.0)
    np.testing.assert_allclose(totals, expected_totals(tiny_lm, sentences), atol=1e-3)
    assert anonymous_code == "UNAUTHENTICATED"


def test_score_cli_over_tls_with_a_token(tiny_lm: Any, pki: Pki, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# decoder farm\ncli-token\n", encoding="utf-8")
    running = start_server(tiny_lm, tls_cert=pki.server_cert, tls_key=pki.server_key, token_file=str(tokens))
    sentences = dev_sentences(0, 3)
    cmd = [sys.executable, "-m", "nlmserve", "score", "--server", running.target, "--json", "--tls-ca", pki.ca]
    try:
        ok = subprocess.run(cmd + ["--token-file", str(tokens)], input="\n".join(sentences) + "\n", text=True,
                            capture_output=True, timeout=60)
        denied = subprocess.run(cmd + ["--timeout", "5"], input=sentences[0] + "\n", text=True,
                                capture_output=True, timeout=60)
    finally:
        running.stop(1.0)
    assert ok.returncode == 0, ok.stderr
    rows = [json.loads(line) for line in ok.stdout.splitlines()]
    np.testing.assert_allclose([r["total"] for r in rows[:-1]], expected_totals(tiny_lm, sentences), atol=1e-3)
    assert denied.returncode == 1
    assert "UNAUTHENTICATED" in denied.stderr


def test_all_interfaces_with_tls_and_a_token_log_no_warning(tiny_lm: Any, pki: Pki, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("t0ken\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="nlmserve.server.app"):
        running = start_server(tiny_lm, host="0.0.0.0", tls_cert=pki.server_cert, tls_key=pki.server_key,
                        token_file=str(tokens))
        running.stop(0.5)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        caplog.clear()
        # TLS alone is not enough: anyone holding a connection could still score.
        running = start_server(tiny_lm, host="0.0.0.0", tls_cert=pki.server_cert, tls_key=pki.server_key)
        running.stop(0.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without a token" in warnings[0] and warnings[0].startswith("SECURITY")


def test_certificate_rotation_on_reload(tiny_lm: Any, tiny_model_path: Path, pki: Pki, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copyfile(pki.server_cert, cert)
    shutil.copyfile(pki.server_key, key)
    config = ServerConfig(model=str(tiny_model_path), port=0, tls_cert=str(cert), tls_key=str(key))
    running = create_server(config, engine=Engine(tiny_lm, config))
    try:
        with LMClient(running.target, tls_ca=pki.ca, timeout=10) as old_client:
            assert old_client.info.model_hash == tiny_lm.model_hash
            # The certificate is renewed (here: by another CA) and the server told to reload.
            shutil.copyfile(pki.rogue_server_cert, cert)
            shutil.copyfile(pki.rogue_server_key, key)
            running.reload()
            with LMClient(running.target, tls_ca=pki.rogue_ca, timeout=10) as new_client:
                assert np.isfinite(new_client.score("the european parliament"))
            with LMClient(running.target, tls_ca=pki.ca, retries=0, timeout=5) as stale, \
                    pytest.raises(ServerUnavailableError):
                stale.info
            assert np.isfinite(old_client.score("the european parliament"))  # its connection stays
            # A damaged certificate at reload time is logged and the one in use stays.
            cert.write_text("not a certificate\n", encoding="ascii")
            with caplog.at_level(logging.ERROR, logger="nlmserve.server.admin"):
                running.reload()
            assert any("TLS files not reloaded" in r.getMessage() for r in caplog.records)
            with LMClient(running.target, tls_ca=pki.rogue_ca, timeout=10) as new_client:
                assert new_client.info.model_hash == tiny_lm.model_hash
    finally:
        running.stop(0.5)


def test_unusable_tls_files_are_refused_naming_the_file(pki: Pki, tmp_path: Path) -> None:
    def start_with(**tls: str) -> None:  # the files are checked before the model is looked at
        create_server(ServerConfig(model=str(tmp_path / "no-model"), port=0, **tls))

    with pytest.raises(InputError, match="do not load together") as err:
        start_with(tls_cert=pki.server_cert, tls_key=pki.client_key)  # the key of another certificate
    assert pki.server_cert in str(err.value)
    with pytest.raises(InputError, match="absent.pem: cannot read TLS certificate"):
        start_with(tls_cert=str(tmp_path / "absent.pem"), tls_key=pki.server_key)
    fifo = tmp_path / "fifo.pem"  # read at start and on every reload: it must not block
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="fifo.pem: TLS key is a FIFO, not a regular file"):
        start_with(tls_cert=pki.server_cert, tls_key=str(fifo))
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("garbage\n", encoding="ascii")
    with pytest.raises(InputError, match="client CA") as err:
        start_with(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=str(bad_ca))
    assert str(bad_ca) in str(err.value)
