"""Hot reload: the ``Reloader`` (shared by SIGHUP and the RPC) and the ``nlmserve.v1.Admin`` servicer.

A reload loads the model file in the calling thread (never the event loop or the engine
worker), checks it (``Engine.prepare``: same vocabulary and order, finite scores on a
probe), then swaps it in between batches (``Engine.swap``: fresh caches, a new model-info
gauge). A file that fails any step is an error and the served model stays. The token file
and the TLS certificate files, when there are, are re-read by the same reload (each kept
as it was when its files are unusable). Reloads run one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

import grpc

from nlmserve.errors import InputError, ModelFileError, ReloadError
from nlmserve.proto import lm_pb2
from nlmserve.server.auth import TlsFiles, TokenStore
from nlmserve.server.config import ServerConfig
from nlmserve.server.engine import Engine, ModelState, load_model
from nlmserve.server.metrics import ServerMetrics
from nlmserve.server.servicer import _parser, model_info

if TYPE_CHECKING:
    from nlmserve.server.servicer import Context

log = logging.getLogger(__name__)

ADMIN_SERVICE = lm_pb2.DESCRIPTOR.services_by_name["Admin"].full_name  # nlmserve.v1.Admin


class Reloader:
    """Reloads the model (and the token file) of one running server."""

    def __init__(self, engine: Engine, config: ServerConfig, tokens: TokenStore | None = None,
                 metrics: ServerMetrics | None = None, tls: TlsFiles | None = None) -> None:
        self.engine = engine
        self.config = config
        self.tokens = tokens
        self.tls = tls
        self.metrics = metrics
        self._lock = threading.Lock()

    def reload(self, path: str | None = None) -> ModelState:
        """Load ``path`` (default: the configured ``model``) and serve it; ReloadError if refused."""
        path = path or self.config.model
        with self._lock:
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
            try:
                state = self.engine.prepare(load_model(self.config, path))
            except (ModelFileError, InputError, OSError) as e:
                self._count("error")
                log.error("reload of %s refused, still serving %s: %s", path, self.engine.state.model_hash, e)
                raise ReloadError(f"{path}: {e}") from e
            self.engine.swap(state)
            self._count("ok")
            log.info("reloaded %s: now serving %s", path, state.model_hash)
            return state

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
            code = grpc.StatusCode.PERMISSION_DENIED
            message = "the Admin service needs --token-file (or --allow-unauthenticated-admin)"
        elif not isinstance(request, lm_pb2.ReloadModelRequest):  # did not parse
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(getattr(request, "error", "bad request"))
        else:
            try:
                state = await asyncio.to_thread(self.reloader.reload, request.path or None)
                info = model_info(state, self.reloader.config.max_ngrams_per_request)
            except ReloadError as e:
                code, message = grpc.StatusCode.FAILED_PRECONDITION, str(e)
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
