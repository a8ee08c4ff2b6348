"""The scoring service: engine (micro-batching, caches, device), gRPC servicer, health, metrics.

Import path: ``nlmserve.server`` (folder ``server/``).
"""
