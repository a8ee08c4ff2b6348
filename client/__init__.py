"""Python client for the nlmserve service (sync and asyncio). Never imports torch."""

from nlmserve.client.aio import AsyncLMClient
from nlmserve.client.core import (
    Endpoint, ModelInfo, ModelMismatchError, NgramScores, RequestTimeoutError, RetryPolicy, RpcError, Security, SentenceScore,
)
from nlmserve.client.sync import LMClient

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
