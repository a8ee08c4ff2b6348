"""Python client for the nlmserve service (sync and asyncio). Never imports torch."""

from nlmserve.client.aio import AsyncLMClient
from nlmserve.client.core import (
    ModelInfo, ModelMismatchError, NgramScores, RequestTimeoutError, RetryPolicy, RpcError, Security, SentenceScore,
)
from nlmserve.client.replicas import Endpoint
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
