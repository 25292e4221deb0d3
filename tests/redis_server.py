"""Test support: real Redis servers (the machine's at 127.0.0.1:6379, or one a test owns),
and waiting for a condition.

Outside CI a missing server skips the test with a loud reason; in CI (CI=true) it fails,
because CI is where these tests must run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from pool_service.local_redis import LocalRedis, free_port, is_up

MACHINE_REDIS_URL = os.environ.get("NASD_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def require(condition: bool, reason: str) -> None:
    """Skip (outside CI) or fail (in CI) when a real server the test needs is missing."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test, but: {reason}")
    pytest.skip(f"!!! SKIPPED: {reason} !!!")


def own_redis_server(*extra_args: str) -> LocalRedis:
    """A started redis-server of the test's own (fails or skips loudly without the binary)."""
    require(LocalRedis.available(), "redis-server is not installed")
    return LocalRedis().start("--enable-debug-command", "yes", *extra_args)


async def until(condition, timeout_s: float) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.01)
    return False


__all__ = ["MACHINE_REDIS_URL", "free_port", "is_up", "own_redis_server", "require", "until"]


CLEANUP_TIMEOUT_S = 10.0


def run_async(coroutine):
    """``asyncio.run`` whose clean-up cannot hang the suite.

    Once in CI a test's body had finished and ``asyncio.run`` then waited forever for a
    cancelled task: the pool sync worker's read loop, whose cancellation (most likely) redis-py's timeout
    had swallowed (``PoolSync.stop`` now re-cancels, bounded: see
    ``pool_service.sync.cancel_and_wait``). As a second line, the clean-up here waits at most
    ``CLEANUP_TIMEOUT_S`` and names any task that still ignores cancellation.
    """
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            _, stuck = loop.run_until_complete(asyncio.wait(pending, timeout=CLEANUP_TIMEOUT_S))
            if stuck:
                print(f"run_async: {len(stuck)} task(s) ignored cancellation: {stuck}", file=sys.stderr)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
