"""Python client for the nlmserve service (sync and asyncio). Never imports torch.

Import path: ``nlmserve.client`` (folder ``client/``).
"""

from .aio import AsyncLMClient
from .core import ModelInfo, NgramScores, RetryPolicy, Security, SentenceScore
from .replicas import Endpoint
from .sync import LMClient
from ..common.errors import ModelMismatchError, RequestTimeoutError, RpcError  # re-exported: raised by the client

__all__ = [
    "AsyncLMClient",
    "Endpoint",
    "LMClient",
    "ModelInfo",
    "ModelMismatchError",
    "NgramScores",
    "RequestTimeoutError",
    "RetryPolicy",
    "RpcError",
    "Security",
    "SentenceScore",
]
