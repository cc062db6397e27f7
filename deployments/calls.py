"""Bounded awaits of Serve handle calls: a replica that is dead, restarting or slow costs the caller
at most ``timeout_s`` (``asyncio.wait_for`` needs a coroutine, which a DeploymentResponse is not)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable


async def _await(aw: Awaitable[Any]) -> Any:
    return await aw


async def within(aw: Awaitable[Any], timeout_s: float) -> Any:
    """``await aw``, or ``asyncio.TimeoutError`` after ``timeout_s``."""
    return await asyncio.wait_for(_await(aw), timeout_s)
