"""Hot reload: the ``Reloader`` (shared by SIGHUP and the RPC) and the ``nlmserve.v1.Admin`` servicer.

A reload loads the model file in a worker thread of its own (never the event loop or the
engine worker; only a regular file of at most ``max_model_bytes`` and of the size its
header gives, server/files.py) within ``reload_timeout_seconds``, checks it
(``Engine.prepare``: same vocabulary and order, finite scores on a probe), then swaps it in between batches (``Engine.swap``: fresh caches, a new model-info
gauge). A file that fails any step is an error and the served model stays. The token file
and the TLS certificate files, when there are, are re-read by the same reload (each kept
as it was when its files are unusable). Reloads run one at a time: another one asked for
meanwhile, by SIGHUP or the RPC, is refused ("a reload is in progress"), not queued.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, NoReturn

import grpc

from ..common.errors import InputError, ModelFileError, ReloadError
from ..proto import lm_pb2
from .auth import TlsFiles, TokenStore
from .config import ServerConfig
from .engine import Engine, ModelState, load_model
from .metrics import ServerMetrics
from .requests import CallStatus, status_of
from .servicer import _parser, model_info

if TYPE_CHECKING:
    from .servicer import Context

log = logging.getLogger(__name__)

ADMIN_SERVICE = lm_pb2.DESCRIPTOR.services_by_name["Admin"].full_name  # nlmserve.v1.Admin


class _Load(threading.Thread):
    """Loads and checks one model file; may be abandoned by the reload that started it
    (then it gives the reload lock back itself when it ends)."""

    def __init__(self, reloader: "Reloader", path: str) -> None:
        super().__init__(name="nlmserve-reload", daemon=True)
        self.reloader, self.path = reloader, path
        self.state: ModelState | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._started_at = time.monotonic()

    def run(self) -> None:
        try:
            lm = load_model(self.reloader.config, self.path)  # its errors name the file
            try:
                self.state = self.reloader.engine.prepare(lm)
            except ModelFileError as e:
                raise ModelFileError(f"{self.path}: {e}") from e
        except BaseException as e:  # handed to the reload that waits for it
            self.error = e
        with self._lock:
            self.done.set()
            abandoned = self._abandoned
        if abandoned:
            log.warning("the abandoned reload of %s ended after %.0f s; its result is discarded, reloads are "
                        "accepted again", self.path, time.monotonic() - self._started_at)
            self.state = None
            self.reloader._busy.release()

    def abandon(self) -> bool:
        """Leave the load running, its result unused; False when it has just ended."""
        with self._lock:
            if self.done.is_set():
                return False
            self._abandoned = True
            return True


class Reloader:
    """Reloads the model (and the token and TLS files) of one running server, one reload at
    a time: a reload asked for while one runs is refused (ReloadError "a reload is in
    progress"), never queued. The file is read in a worker thread; a read that takes longer
    than ``reload_timeout_seconds`` is abandoned and refused, and reloads stay refused until
    that read ends (so that stuck reads never pile up)."""

    def __init__(self, engine: Engine, config: ServerConfig, tokens: TokenStore | None = None,
                 metrics: ServerMetrics | None = None, tls: TlsFiles | None = None) -> None:
        self.engine = engine
        self.config = config
        self.tokens = tokens
        self.tls = tls
        self.metrics = metrics
        self._busy = threading.Lock()

    def reload(self, path: str | None = None) -> ModelState:
        """Load ``path`` (default: the configured ``model``) and serve it; ReloadError if refused."""
        path = path or self.config.model
        if not self._busy.acquire(blocking=False):
            self._count("error")
            log.warning("reload of %s refused: a reload is in progress", path)
            raise ReloadError(f"{path}: a reload is in progress; try again when it has ended")
        released = False
        try:
            self._reload_secrets()
            load = _Load(self, path)
            load.start()
            timeout = self.config.reload_timeout_seconds
            if not load.done.wait(timeout) and load.abandon():
                released = True  # the worker releases the lock when its read ends
                self._refuse(ModelFileError(
                    f"{path}: reading and checking the file took more than {timeout:g} s "
                    "(reload_timeout_seconds); abandoned, and reloads are refused until that read ends"))
            if load.error is not None or load.state is None:
                self._refuse(load.error, path)
            state = load.state
            self.engine.swap(state)
            self._count("ok")
            log.info("reloaded %s: now serving %s", path, state.model_hash)
            return state
        finally:
            if not released:
                self._busy.release()

    def _reload_secrets(self) -> None:
        """Re-read the token and TLS files; each kept as it was when its files are unusable."""
        if self.tokens is not None:
            try:
                self.tokens.reload()
            except InputError as e:
                log.error("token file not reloaded, the previous tokens stay: %s", e)
        if self.tls is not None:
            try:
                self.tls.reload()
            except InputError as e:
                log.error("TLS files not reloaded, the certificate in use stays: %s", e)

    def _refuse(self, error: BaseException | None, path: str = "") -> NoReturn:
        """Count, log and raise the ReloadError for ``error`` (whose message names the file
        when it is one of ours)."""
        self._count("error")
        if isinstance(error, (ModelFileError, InputError)):
            message = str(error)
        else:  # unexpected (MemoryError, a torch error): logged with its traceback
            log.error("reload of %s failed", path, exc_info=error)
            message = f"{path}: {type(error).__name__}: {error}"
        log.error("reload refused, still serving %s: %s", self.engine.state.model_hash, message)
        raise ReloadError(message) from error

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.reloads.labels(result=result).inc()


class AdminServicer:
    """``nlmserve.v1.Admin``. Without tokens it answers PERMISSION_DENIED unless
    ``allow_unauthenticated_admin``; with tokens the interceptor has checked the caller."""

    def __init__(self, reloader: Reloader, metrics: ServerMetrics | None = None) -> None:
        self.reloader = reloader
        self.metrics = metrics
        config = reloader.config
        self.enabled = config.token_file is not None or config.allow_unauthenticated_admin

    async def ReloadModel(self, request: lm_pb2.ReloadModelRequest,
                          context: Context) -> lm_pb2.ModelInfo:
        code, message = grpc.StatusCode.OK, ""
        info = None
        if not self.enabled:
            code = CallStatus.admin_disabled
            message = "the Admin service needs --token-file (or --allow-unauthenticated-admin)"
        elif not isinstance(request, lm_pb2.ReloadModelRequest):  # did not parse
            code, message = CallStatus.malformed, str(getattr(request, "error", "bad request"))
        else:
            try:
                state = await asyncio.to_thread(self.reloader.reload, request.path or None)
                info = model_info(state, self.reloader.config.max_ngrams_per_request)
            except ReloadError as e:
                code, message = status_of(e), str(e)
        if self.metrics is not None:
            self.metrics.requests.labels(rpc="ReloadModel", code=code.name).inc()
        if info is None:
            await context.abort(code, message)
        assert info is not None  # abort raises
        return info


def add_admin_to_server(servicer: AdminServicer, server: grpc.aio.Server) -> None:
    handlers = {
        "ReloadModel": grpc.unary_unary_rpc_method_handler(
            servicer.ReloadModel, request_deserializer=_parser(lm_pb2.ReloadModelRequest),
            response_serializer=lm_pb2.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ADMIN_SERVICE, handlers),))
    server.add_registered_method_handlers(ADMIN_SERVICE, handlers)  # type: ignore[attr-defined]
