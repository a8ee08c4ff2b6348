"""Hot reload: the ``Reloader`` (shared by SIGHUP and the RPC) and the ``nlmserve.v1.Admin`` servicer.

A reload loads the model file in a worker thread of its own (never the event loop or the
engine worker) within ``reload_timeout_seconds``: the path is opened once and read from
that descriptor only, a regular file of at most ``max_model_bytes`` and of the size its
header gives, in chunks with its digest computed on the way (server/files.py). It then
checks it (``Engine.prepare``: same vocabulary and order, finite scores on a probe) and
swaps it in between batches (``Engine.swap``: fresh caches, a new model-info gauge). A file
that fails any step is an error, the served model stays, and the memory the refused read
took is given back before the refusal is answered. The token files and the TLS
certificate files, when there are, are re-read by the same reload (each kept as it was
when its files are unusable). Reloads run one at a time: another one asked for meanwhile,
by SIGHUP or the RPC, is refused ("a reload is in progress"), not queued.

Who may reload what: SIGHUP (the operator's) reloads ``model``. A ReloadModel call needs an
admin token when ``admin_token_file`` is set (a scoring token gets PERMISSION_DENIED), else
a scoring token (or ``allow_unauthenticated_admin``); the path it names must lie in
``reload_dir`` (default: the folder of ``model``) and is opened with no symlink followed
below it; a call without a path, or naming ``model`` itself, reloads ``model`` as SIGHUP
does. Every path in a log line or a message is shown by ``files.shown_path`` (control
characters escaped), and no refusal shows a byte of a file that is no model file.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from ..common.errors import InputError, ModelFileError, ReloadError
from ..common.memory import trim_heap
from ..proto import lm_pb2
from ..wire.status import CallStatus, status_of
from .auth import TlsFiles, TokenStore
from .config import ServerConfig
from .engine import Engine, ModelState, load_model
from .files import shown_path
from .metrics import ServerMetrics
from .servicer import _parser, model_info

if TYPE_CHECKING:
    from .servicer import Context

log = logging.getLogger(__name__)

ADMIN_SERVICE = lm_pb2.DESCRIPTOR.services_by_name["Admin"].full_name  # nlmserve.v1.Admin


class _Load(threading.Thread):
    """Loads and checks one model file; may be abandoned by the reload that started it
    (then it gives the reload lock back itself when it ends)."""

    def __init__(self, reloader: "Reloader", path: str, reload_dir: str | None) -> None:
        super().__init__(name="nlmserve-reload", daemon=True)
        self.reloader, self.path, self.reload_dir = reloader, path, reload_dir
        self.state: ModelState | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._started_at = time.monotonic()

    def run(self) -> None:
        try:
            lm = load_model(self.reloader.config, self.path, self.reload_dir)  # its errors name the file
            try:
                self.state = self.reloader.engine.prepare(lm)
            except ModelFileError as e:
                raise ModelFileError(f"{shown_path(self.path)}: {e}") from e
        except BaseException as e:  # handed to the reload that waits for it
            _drop_locals(e)
            self.error = e
        with self._lock:
            self.done.set()
            abandoned = self._abandoned
        if abandoned:
            log.warning("the abandoned reload of %s ended after %.0f s; its result is discarded, reloads are "
                        "accepted again", shown_path(self.path), time.monotonic() - self._started_at)
            self.state = None
            self.reloader._busy.release()

    def abandon(self) -> bool:
        """Leave the load running, its result unused; False when it has just ended."""
        with self._lock:
            if self.done.is_set():
                return False
            self._abandoned = True
            return True


def _drop_locals(error: BaseException) -> None:
    """Clear the locals of the frames ``error`` (and the errors it was raised from) passed
    through: a refused read's buffers are not kept alive by the error the reload keeps."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]


def _give_back_memory() -> None:
    """Collect what a refused reload left and ask glibc to return its free heap to the
    system (``malloc_trim``; nothing where there is none). The data of a read is an
    anonymous mapping, unmapped at once; this returns the rest (the header, small arrays)."""
    gc.collect()
    trim_heap()


class GateTokens(TokenStore):
    """The tokens the call gate accepts when both a token file and an admin token file are
    set: the token file's and the admin file's (an admin token may call every service; the
    Admin service itself takes only the admin ones). It holds no tokens of its own: it asks
    the two stores, which the reloads re-read, and lends the scoring store's state to any
    other ``TokenStore`` method."""

    def __init__(self, scoring: TokenStore, admin: TokenStore) -> None:  # no file of its own to read
        self.scoring, self.admin = scoring, admin

    def __getattr__(self, name: str) -> Any:  # the scoring store's attributes (path, _tokens, ...)
        return getattr(self.scoring, name)

    def __len__(self) -> int:
        return len(self.scoring) + len(self.admin)

    def reload(self) -> None:
        self.scoring.reload()
        self.admin.reload()

    def check(self, header: str | bytes | None) -> bool:
        scoring = self.scoring.check(header)
        admin = self.admin.check(header)  # both compared, so the time does not say which
        return scoring or admin


class Reloader:
    """Reloads the model (and the token and TLS files) of one running server, one reload at
    a time: a reload asked for while one runs is refused (ReloadError "a reload is in
    progress"), never queued. The file is read in a worker thread; a read that takes longer
    than ``reload_timeout_seconds`` is abandoned and refused, and reloads stay refused until
    that read ends (so that stuck reads never pile up).

    ``tokens`` is what the call gate checks: the scoring tokens, joined by the admin tokens
    when there are both (:class:`GateTokens`); ``scoring_tokens`` and ``admin_tokens`` are
    each file's own."""

    def __init__(self, engine: Engine, config: ServerConfig, tokens: TokenStore | None = None,
                 metrics: ServerMetrics | None = None, tls: TlsFiles | None = None) -> None:
        self.engine = engine
        self.config = config
        self.scoring_tokens = tokens
        self.admin_tokens = TokenStore(config.admin_token_file) if config.admin_token_file is not None else None
        self.tokens: TokenStore | None = tokens
        if tokens is not None and self.admin_tokens is not None:
            self.tokens = GateTokens(tokens, self.admin_tokens)
        self.tls = tls
        self.metrics = metrics
        #: The folder a ReloadModel path must lie in.
        self.reload_dir = config.reload_dir or os.path.dirname(os.path.abspath(config.model))
        self._busy = threading.Lock()

    def reload(self, path: str | None = None, *, caller: bool = False) -> ModelState:
        """Load ``path`` (default: the configured ``model``) and serve it; ReloadError if
        refused. ``caller``: the path comes from a ReloadModel call, so it must lie in
        ``reload_dir`` (no symlink followed below it) unless it names ``model`` itself."""
        reload_dir = None
        if path and os.path.abspath(path) != os.path.abspath(self.config.model):
            reload_dir = self.reload_dir if caller else None
        path = path or self.config.model
        shown = shown_path(path)
        if not self._busy.acquire(blocking=False):
            self._count("error")
            log.warning("reload of %s refused: a reload is in progress", shown)
            raise ReloadError(f"{shown}: a reload is in progress; try again when it has ended")
        released = False
        try:
            self._reload_secrets()
            load = _Load(self, path, reload_dir)
            load.start()
            timeout = self.config.reload_timeout_seconds
            if not load.done.wait(timeout) and load.abandon():
                released = True  # the worker releases the lock when its read ends
                self._refuse(ModelFileError(
                    f"{shown}: reading and checking the file took more than {timeout:g} s "
                    "(reload_timeout_seconds); abandoned, and reloads are refused until that read ends"))
            if load.error is not None or load.state is None:
                error, load.error = load.error, None
                del load
                _give_back_memory()
                self._refuse(error, shown)
            state = load.state
            self.engine.swap(state)
            self._count("ok")
            log.info("reloaded %s: now serving %s", shown, state.model_hash)
            return state
        finally:
            if not released:
                self._busy.release()

    def _reload_secrets(self) -> None:
        """Re-read the token files and the TLS files; each kept as it was when its files are
        unusable."""
        for store, what in ((self.scoring_tokens, "token file"), (self.admin_tokens, "admin token file")):
            if store is not None:
                try:
                    store.reload()
                except InputError as e:
                    log.error("%s not reloaded, the previous tokens stay: %s", what, e)
        if self.tls is not None:
            try:
                self.tls.reload()
            except InputError as e:
                log.error("TLS files not reloaded, the certificate in use stays: %s", e)

    def _refuse(self, error: BaseException | None, shown: str = "") -> NoReturn:
        """Count, log and raise the ReloadError for ``error`` (whose message names the file,
        as ``shown``, when it is one of ours)."""
        self._count("error")
        if isinstance(error, (ModelFileError, InputError)):
            message = str(error)
        else:  # unexpected (MemoryError, a torch error): logged with its traceback
            log.error("reload of %s failed", shown, exc_info=error)
            message = f"{shown}: {type(error).__name__}: {error}"
        log.error("reload refused, still serving %s: %s", self.engine.state.model_hash, message)
        raise ReloadError(message) from error

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.reloads.labels(result=result).inc()


class AdminServicer:
    """``nlmserve.v1.Admin``. Who may call it: with ``admin_token_file``, the holders of its
    tokens only (PERMISSION_DENIED for a scoring token, UNAUTHENTICATED for none or an
    unknown one); else, with ``token_file``, the scoring tokens (the call gate has checked
    the caller); else only with ``allow_unauthenticated_admin`` (PERMISSION_DENIED)."""

    def __init__(self, reloader: Reloader, metrics: ServerMetrics | None = None) -> None:
        self.reloader = reloader
        self.metrics = metrics
        config = reloader.config
        self.enabled = (config.token_file is not None or config.admin_token_file is not None
                        or config.allow_unauthenticated_admin)
        self._refused_at = 0.0  # when a refused caller was last logged
        self._refused_since = 0  # refused callers not logged since

    def _refusal(self, context: Context) -> tuple[grpc.StatusCode, str] | None:
        """The code and message for a caller that may not call Admin; None when it may."""
        admin = self.reloader.admin_tokens
        if admin is None:
            if self.enabled:
                return None
            return (CallStatus.admin_disabled,
                    "the Admin service needs --token-file or --admin-token-file (or --allow-unauthenticated-admin)")
        header = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                header = value
                break
        if admin.check(header):
            return None
        scoring = self.reloader.scoring_tokens
        if header is not None and scoring is not None and scoring.check(header):
            return CallStatus.admin_disabled, "this token may not call Admin: ReloadModel needs an admin token"
        return CallStatus.unauthenticated, f"{'missing' if header is None else 'invalid'} admin bearer token"

    def _log_refused(self, context: Context, message: str) -> None:
        """A refused caller, logged at WARNING at most once every 10 s (with the count since)."""
        self._refused_since += 1
        now = time.monotonic()
        if now - self._refused_at >= 10.0:
            log.warning("Admin call from %s refused: %s (%d refused since the last such line)",
                        shown_path(str(context.peer())), message, self._refused_since)
            self._refused_at, self._refused_since = now, 0

    async def ReloadModel(self, request: lm_pb2.ReloadModelRequest,
                          context: Context) -> lm_pb2.ModelInfo:
        code, message = grpc.StatusCode.OK, ""
        info = None
        refusal = self._refusal(context)
        if refusal is not None:
            code, message = refusal
            self._log_refused(context, message)
        elif not isinstance(request, lm_pb2.ReloadModelRequest):  # did not parse
            code, message = CallStatus.malformed, str(getattr(request, "error", "bad request"))
        else:
            try:
                state = await asyncio.to_thread(self.reloader.reload, request.path or None, caller=True)
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
