"""Python client for the nlmserve service (sync and asyncio). Never imports torch.

Import path: ``nlmserve.client`` (folder ``client/``).
"""

from nlmserve.client.aio import AsyncLMClient
from nlmserve.client.core import ModelInfo, NgramScores, RetryPolicy, Security, SentenceScore
from nlmserve.client.replicas import Endpoint
from nlmserve.client.sync import LMClient
from nlmserve.errors import ModelMismatchError, RequestTimeoutError, RpcError  # re-exported: raised by the client

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
