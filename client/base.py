"""What the sync and asyncio clients share: settings, security, the balanced channel."""

from __future__ import annotations

from typing import Any, Sequence

from nlmserve.client import core, replicas
from nlmserve.client.core import IdMap, ModelInfo, RetryPolicy
from nlmserve.proto import lm_pb2_grpc


class ClientBase:
    """Builds the one channel a client keeps (arguments documented on ``LMClient``).

    Subclasses say how a channel is opened (``grpc`` or ``grpc.aio``) and which lock guards
    the lazily fetched model info and id map.
    """

    def __init__(self, target: str | Sequence[str], *, timeout: float | None = 30.0, retries: int = 5,
                 retry_policy: RetryPolicy | None = None, pack_ids: bool = True,
                 max_message_bytes: int = 64 * 1024 * 1024, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_server_name: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 allow_mixed_models: bool = False) -> None:
        self.endpoint = replicas.endpoint_of(target)
        self.target = self.endpoint.target
        self.timeout = timeout
        self.retry = retry_policy or RetryPolicy(retries=retries)
        self.pack_ids = pack_ids
        self.max_message_bytes = max_message_bytes
        self.security = core.security_of(tls, tls_ca, tls_cert, tls_key, tls_server_name, token, token_file)
        self._metadata = self.security.metadata()
        options = (core.channel_options(max_message_bytes) + self.security.options()
                   + replicas.balancing_options(self.endpoint) + replicas.tls_name_options(self.endpoint, self.security))
        self._channel = self._open_channel(self.target, self.security.credentials(), options)
        self._guard = replicas.ModelGuard(self.target, self.endpoint.replicated, allow_mixed_models)
        self._stub: Any = lm_pb2_grpc.LanguageModelStub(self._channel)
        self._admin: Any = lm_pb2_grpc.AdminStub(self._channel)
        self._info: ModelInfo | None = None
        self._idmap: IdMap | None = None
        self._lock = self._make_lock()

    def _make_lock(self) -> Any:
        raise NotImplementedError

    def _open_channel(self, target: str, credentials: Any, options: list[tuple[str, Any]]) -> Any:
        raise NotImplementedError
