"""Python client for the nlmserve service (sync and asyncio). Never imports torch."""
