"""Who may reload what: an admin token file of its own for the Admin service (a scoring
token gets PERMISSION_DENIED there), and a reload folder that a ReloadModel path must lie
in, with no symlink followed below it; SIGHUP's path (the operator's ``--model``, a
symlink included) reloads as before. Real servers on 127.0.0.1 (port 0) over the tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from nlmserve.client import LMClient, RpcError
from nlmserve.server.app import RunningServer

from support import dev_ngrams, metric, start_server

SCORING, ADMIN = "scoring-token-0123", "admin-token-4567"


@pytest.fixture()
def folder(tiny_model_path: Path, tmp_path: Path) -> Path:
    """The reload folder: a copy of the tiny model (``served.nlm``) and a second copy."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(tiny_model_path, models / "served.nlm")
    shutil.copyfile(tiny_model_path, models / "next.nlm")
    return models


def token_file(path: Path, token: str) -> str:
    path.write_text(f"{token}\n", encoding="utf-8")
    return str(path)


def reload_code(target: str, token: str | None, path: str = "") -> str:
    """The status code name of ReloadModel ``path`` with ``token``."""
    with LMClient(target, token=token, retries=0, timeout=30) as client:
        try:
            client.reload_model(path)
        except RpcError as e:
            return e.code.name
    return "OK"


def scores(target: str, token: str | None, lm: Any) -> bool:
    rows = dev_ngrams(lm, 0, 2)
    with LMClient(target, token=token, retries=0, timeout=10) as client:
        return bool(np.allclose(client.score_ids(rows, log_base="ln").log_probs,
                                lm.score_ngrams(rows.astype(np.int64)), atol=1e-5, rtol=0))


@pytest.fixture()
def both(tiny_lm: Any, folder: Path, tmp_path: Path) -> Iterator[RunningServer]:
    """A server with a scoring token file and an admin token file."""
    running = start_server(tiny_lm, model=str(folder / "served.nlm"), metrics_port=0,
                           token_file=token_file(tmp_path / "tokens", SCORING),
                           admin_token_file=token_file(tmp_path / "admin-tokens", ADMIN))
    yield running
    running.stop(0.5)


def test_only_an_admin_token_may_reload(both: RunningServer, tiny_lm: Any, folder: Path) -> None:
    """With --admin-token-file a scoring token may score but not reload
    (PERMISSION_DENIED), no token may do neither (UNAUTHENTICATED), an admin token may do
    both; each refusal is counted under its code."""
    target, path = both.target, str(folder / "next.nlm")
    assert reload_code(target, SCORING, path) == "PERMISSION_DENIED"
    assert reload_code(target, None, path) == "UNAUTHENTICATED"
    assert reload_code(target, "guessed-token", path) == "UNAUTHENTICATED"
    assert scores(target, SCORING, tiny_lm)
    assert reload_code(target, ADMIN, path) == "OK"
    assert scores(target, ADMIN, tiny_lm)
    assert metric(both, 'nlmserve_requests_total{code="PERMISSION_DENIED",rpc="ReloadModel"}') == 1
    assert metric(both, 'nlmserve_requests_total{code="OK",rpc="ReloadModel"}') == 1


def test_an_admin_token_file_alone_guards_admin_only(tiny_lm: Any, folder: Path, tmp_path: Path) -> None:
    """An admin token file without a scoring one: scoring stays open, Admin needs the admin
    token even with --allow-unauthenticated-admin."""
    running = start_server(tiny_lm, model=str(folder / "served.nlm"), allow_unauthenticated_admin=True,
                           admin_token_file=token_file(tmp_path / "admin-tokens", ADMIN))
    try:
        assert scores(running.target, None, tiny_lm)
        assert reload_code(running.target, None) == "UNAUTHENTICATED"
        assert reload_code(running.target, ADMIN) == "OK"
    finally:
        running.stop(0.5)


def test_both_token_files_are_re_read_on_reload(both: RunningServer, tiny_lm: Any, tmp_path: Path) -> None:
    """New tokens in either file take effect with the next reload (SIGHUP's), for the call
    gate and for Admin alike; the old ones stop."""
    token_file(tmp_path / "admin-tokens", "rotated-admin-token-89")
    token_file(tmp_path / "tokens", "rotated-scoring-token-67")
    both.reload()  # as SIGHUP does
    assert reload_code(both.target, ADMIN) == "UNAUTHENTICATED"
    assert reload_code(both.target, "rotated-admin-token-89") == "OK"
    assert reload_code(both.target, "rotated-scoring-token-67") == "PERMISSION_DENIED"
    assert scores(both.target, "rotated-scoring-token-67", tiny_lm)
    with pytest.raises(RpcError) as err:
        scores(both.target, SCORING, tiny_lm)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_reload_path_outside_the_reload_folder_is_refused(tiny_lm: Any, folder: Path, tmp_path: Path,
                                                            tiny_model_path: Path) -> None:
    """A valid model outside the reload folder (by its own name, by ``..``, or through a
    symlink in the folder, to a file or to a folder) is refused FAILED_PRECONDITION before
    it is opened; inside, it loads. Before, any file the server could read was loaded."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(tiny_model_path, outside / "model.nlm")
    (folder / "link.nlm").symlink_to(outside / "model.nlm")
    (folder / "linked").symlink_to(outside)
    running = start_server(tiny_lm, model=str(folder / "served.nlm"), allow_unauthenticated_admin=True)
    try:
        for path, words in ((outside / "model.nlm", "not inside the reload folder"),
                            (f"{folder}/../elsewhere/model.nlm", "not inside the reload folder"),
                            (folder / "link.nlm", "a symbolic link below the reload folder"),
                            (folder / "linked" / "model.nlm", "a symbolic link below the reload folder")):
            with LMClient(running.target, retries=0, timeout=30) as client:
                with pytest.raises(RpcError) as err:
                    client.reload_model(str(path))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
            assert words in str(err.value), err.value
        assert reload_code(running.target, None, str(folder / "next.nlm")) == "OK"
    finally:
        running.stop(0.5)


def test_the_operators_model_may_be_a_symlink(tiny_lm: Any, folder: Path, tmp_path: Path) -> None:
    """``--model current.nlm → v1.nlm``: SIGHUP's reload, a call without a path and a call
    naming --model itself follow it (the operator's choice), with --reload-dir elsewhere."""
    link = tmp_path / "current.nlm"
    link.symlink_to(folder / "served.nlm")
    running = start_server(tiny_lm, model=str(link), allow_unauthenticated_admin=True, reload_dir=str(folder))
    try:
        link.unlink()
        link.symlink_to(folder / "next.nlm")
        assert running.reload().model_hash == tiny_lm.model_hash
        assert reload_code(running.target, None) == "OK"
        assert reload_code(running.target, None, str(link)) == "OK"
    finally:
        running.stop(0.5)
