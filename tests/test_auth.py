"""Bearer tokens, the open health service, the Admin guard and the exposed-bind warning,
against real servers on 127.0.0.1 (port 0) with the tiny real model."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nlmserve.client import LMClient, RpcError
from nlmserve.common.errors import InputError
from nlmserve.proto import lm_pb2, lm_pb2_grpc
from nlmserve.server.app import RunningServer, create_server
from nlmserve.server.auth import TokenStore
from nlmserve.server.config import ServerConfig

from support import metric, start_server

TOKENS = "# one per line\nfirst-token-0123\n\nsecond-token-4567\n"
NGRAMS = [["the", "european", "parliament"], ["of", "the"], ["zzzunknownzzz"]]


def start(lm: Any, **overrides: Any) -> RunningServer:
    return start_server(lm, metrics_port=0, **overrides)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture()
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(TOKENS, encoding="utf-8")
    return path


@pytest.fixture()
def secured(tiny_lm: Any, tiny_model_path: Path, token_file: Path) -> Iterator[RunningServer]:
    running = start(tiny_lm, model=str(tiny_model_path), token_file=str(token_file))
    yield running
    running.stop(0.5)


def code_of(call: Any, *args: Any, **kw: Any) -> str:
    try:
        call(*args, **kw)
    except grpc.RpcError as e:
        return str(e.code().name)
    return "OK"


def test_calls_need_a_valid_token_and_are_counted(secured: RunningServer, tiny_lm: Any) -> None:
    request = lm_pb2.ScoreNgramsRequest(ngrams=[lm_pb2.NgramStrings(words=ng) for ng in NGRAMS],
                                        log_base=lm_pb2.LN)
    with grpc.insecure_channel(secured.target) as channel:
        stub = lm_pb2_grpc.LanguageModelStub(channel)
        assert code_of(stub.ScoreNgrams, request) == "UNAUTHENTICATED"
        assert code_of(stub.ScoreNgrams, request, metadata=bearer("first-token-012")) == "UNAUTHENTICATED"
        assert code_of(stub.ScoreNgrams, request, metadata=bearer("first-token-01234")) == "UNAUTHENTICATED"
        assert code_of(stub.ScoreNgrams, request, metadata=(("authorization", "first-token-0123"),)) == \
            "UNAUTHENTICATED"  # no scheme
        assert code_of(stub.GetModelInfo, lm_pb2.GetModelInfoRequest()) == "UNAUTHENTICATED"
        assert code_of(lambda: list(stub.GetVocabulary(lm_pb2.GetVocabularyRequest()))) == "UNAUTHENTICATED"
        for token in ("first-token-0123", "second-token-4567"):
            got = stub.ScoreNgrams(request, metadata=bearer(token))
            ids, _, _, _ = tiny_lm.sentence_ngrams([["the", "european", "parliament"]])
            np.testing.assert_allclose(got.log_probs[0], tiny_lm.score_ngrams(ids[2:3])[0], atol=1e-5)
            assert list(got.oov) == [False, False, True]
        # The health service answers without a token (load balancers, container checks) ...
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "nlmserve.v1.LanguageModel"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        # ... reflection does not (it describes the API to whoever asks).
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        assert code_of(lambda: list(refl.ServerReflectionInfo(iter([ask])))) == "UNAUTHENTICATED"
        listed = list(refl.ServerReflectionInfo(iter([ask]), metadata=bearer("second-token-4567")))
        names = {s.name for s in listed[0].list_services_response.service}
        assert {"nlmserve.v1.LanguageModel", "nlmserve.v1.Admin", "grpc.health.v1.Health"} <= names
    assert metric(secured, 'nlmserve_requests_total{code="UNAUTHENTICATED",rpc="ScoreNgrams"}') == 4
    assert metric(secured, 'nlmserve_requests_total{code="UNAUTHENTICATED",rpc="GetModelInfo"}') == 1
    assert metric(secured, 'nlmserve_requests_total{code="UNAUTHENTICATED",rpc="GetVocabulary"}') == 1
    assert metric(secured, 'nlmserve_requests_total{code="OK",rpc="ScoreNgrams"}') == 2


def test_client_token_arguments(secured: RunningServer, token_file: Path, tiny_lm: Any) -> None:
    with LMClient(secured.target, token_file=str(token_file)) as lm:  # the file's first token
        assert lm.score_ngrams(NGRAMS).model_hash == tiny_lm.model_hash
        assert "parliament" in lm
    with LMClient(secured.target, token="second-token-4567") as lm:
        assert lm.info.model_hash == tiny_lm.model_hash
    for kw in ({}, {"token": "nope"}):
        with LMClient(secured.target, retries=0, **kw) as lm, pytest.raises(RpcError) as err:
            lm.score("the european parliament")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_token_file_is_reread_on_reload(secured: RunningServer, token_file: Path, tiny_lm: Any) -> None:
    with LMClient(secured.target, token="first-token-0123", retries=0) as old:
        old.info
        token_file.write_text("rotated-token-89\n", encoding="utf-8")
        secured.reload()  # as SIGHUP does
        with pytest.raises(RpcError) as err:
            old.score("the european parliament")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with LMClient(secured.target, token="rotated-token-89") as new:
        assert new.info.model_hash == tiny_lm.model_hash
    # A token file that became unusable keeps the tokens in force (and the reload still happens).
    token_file.write_text("\n# nothing\n", encoding="utf-8")
    secured.reload()
    with LMClient(secured.target, token="rotated-token-89") as new:
        assert np.isfinite(new.score("the european parliament"))


@pytest.mark.parametrize("damage", ["emptied", "removed", "fifo"])
def test_an_unusable_token_file_keeps_the_tokens_in_force(secured: RunningServer, token_file: Path, damage: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The rule: a reload whose token file is emptied, removed or not a regular file keeps
    the tokens in force (fail safe: dropping every token would lock out every client), logs
    the reason at ERROR, and still reloads the model."""
    token_file.unlink()
    if damage == "emptied":
        token_file.write_text("", encoding="utf-8")
    elif damage == "fifo":
        os.mkfifo(token_file)
    with caplog.at_level(logging.ERROR, logger="nlmserve.server.admin"):
        state = secured.reload()  # as SIGHUP does
    assert state.model_hash == secured.engine.state.model_hash
    words = {"emptied": "token file holds no token", "removed": "cannot read token file",
             "fifo": "token file is a FIFO, not a regular file"}[damage]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"token file not reloaded, the previous tokens stay: {token_file}: {words}"
                      + ("" if damage != "removed" else ": No such file or directory")]
    with LMClient(secured.target, token="second-token-4567", retries=0) as client:
        assert np.isfinite(client.score("the european parliament"))
    with LMClient(secured.target, retries=0) as anonymous, pytest.raises(RpcError) as err:
        anonymous.score("the european parliament")
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_admin_is_guarded(tiny_lm: Any, tiny_model_path: Path, secured: RunningServer) -> None:
    model = str(tiny_model_path)
    # Tokens on: the token decides.
    with LMClient(secured.target, retries=0) as anonymous, pytest.raises(RpcError) as err:
        anonymous.reload_model()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with LMClient(secured.target, token="first-token-0123") as admin:
        assert admin.reload_model().model_hash == tiny_lm.model_hash
        with pytest.raises(RpcError) as err:
            admin.reload_model(model + ".missing")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and ".missing" in str(err.value)
        assert admin.score_ngrams(NGRAMS).model_hash == tiny_lm.model_hash  # still serving
    assert metric(secured, 'nlmserve_model_reloads_total{result="ok"}') == 1
    assert metric(secured, 'nlmserve_model_reloads_total{result="error"}') == 1
    # No tokens: refused unless explicitly allowed.
    for allow, code in ((False, "PERMISSION_DENIED"), (True, "OK")):
        running = start(tiny_lm, model=model, allow_unauthenticated_admin=allow)
        try:
            with grpc.insecure_channel(running.target) as channel:
                admin_stub = lm_pb2_grpc.AdminStub(channel)
                assert code_of(admin_stub.ReloadModel, lm_pb2.ReloadModelRequest()) == code
                assert metric(running, f'nlmserve_requests_total{{code="{code}",rpc="ReloadModel"}}') == 1
        finally:
            running.stop(0.5)


def test_bad_token_files_name_the_file_and_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# only a comment\n\n", encoding="utf-8")
    with pytest.raises(InputError, match="holds no token") as err:
        TokenStore(empty)
    assert str(empty) in str(err.value)
    spaced = tmp_path / "spaced"
    spaced.write_text("good-token\nbad token\n", encoding="utf-8")
    with pytest.raises(InputError, match="whitespace") as err:
        TokenStore(spaced)
    assert f"{spaced}:2" in str(err.value)
    with pytest.raises(InputError, match="cannot read token file"):
        TokenStore(tmp_path / "absent")
    with pytest.raises(InputError, match="cannot read token file"):  # before the model is even looked at
        create_server(ServerConfig(model=str(tmp_path / "no-model"), port=0, token_file=str(tmp_path / "absent")))


def test_exposed_bind_without_tls_or_token_warns(tiny_lm: Any, token_file: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nlmserve.server.app"):
        start(tiny_lm).stop(0.5)  # loopback: nothing to say
        assert not caplog.records
        start(tiny_lm, host="0.0.0.0").stop(0.5)
        start(tiny_lm, host="0.0.0.0", token_file=str(token_file)).stop(0.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "without TLS or a token" in warnings[0] and "bind 127.0.0.1" in warnings[0]
    assert "without TLS" in warnings[1] and "token" not in warnings[1].split(":")[1]
