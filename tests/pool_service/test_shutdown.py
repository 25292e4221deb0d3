"""Stopping a sync worker is bounded even when a cancellation is swallowed.

A cancellation that lands while redis-py's own timeout fires can be lost inside
``asyncio.timeout`` (Python 3.11); the worker's read loop then simply goes on. A real Redis
cannot be made to lose a cancellation on demand, so the store here swallows the first one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from nasd_core.speculation.ngram import NGramIndex
from pool_service import PoolConfig
from pool_service.store import InMemoryPool, ReadBatch
from pool_service.sync import PoolSync, cancel_and_wait

# Generous bounds, not timings: without the repeated cancel, each wait would outlast them.
GIVE_UP_BOUND_S = 30
READ_BLOCK_S = 60


class CancelSwallowingPool(InMemoryPool):
    """The in-process pool, except that a blocking read swallows the first cancellation."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.num_swallowed = 0

    async def read(self, cursor: str, count: int, block_ms: int) -> ReadBatch:
        if block_ms == 0:
            return await super().read(cursor, count, block_ms)
        try:
            await asyncio.sleep(block_ms / 1000)
        except asyncio.CancelledError:
            if self.num_swallowed == 0:
                self.num_swallowed += 1
                return ReadBatch(cursor=cursor)
            raise
        return ReadBatch(cursor=cursor)


async def _ignores(num_cancels: int) -> None:
    """Sleeps, shrugging off the first ``num_cancels`` cancellations."""
    for _ in range(num_cancels):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
    await asyncio.sleep(60)


def test_cancel_and_wait_repeats_the_cancel_and_gives_up_in_bounded_time():
    async def scenario() -> tuple[bool, bool, float]:
        once, stubborn = asyncio.ensure_future(_ignores(1)), asyncio.ensure_future(_ignores(100))
        await asyncio.sleep(0)  # both inside their sleep: a task cancelled before it starts just ends
        ended = await cancel_and_wait([once], timeout_s=5)
        started = time.monotonic()
        # Bounded: a wait that never gave up would hang here (the task shrugs off 100 cancels).
        gave_up = not await asyncio.wait_for(cancel_and_wait([stubborn], timeout_s=0.5), GIVE_UP_BOUND_S)
        waited = time.monotonic() - started
        while not stubborn.done():  # leave nothing behind for asyncio.run to wait on
            stubborn.cancel()
            await asyncio.sleep(0)
        return ended, gave_up, waited

    ended, gave_up, waited = asyncio.run(scenario())
    assert ended, "a task that ignores one cancel must end on the next"
    assert gave_up and waited >= 0.5, "it gave up before its timeout"


def test_worker_stops_although_its_read_swallowed_a_cancellation():
    async def scenario() -> tuple[float, int, str]:
        store = CancelSwallowingPool(f"shutdown-{time.time_ns()}")
        config = PoolConfig(read_block_ms=int(READ_BLOCK_S * 1000), warm_start_timeout_s=1)
        sync = PoolSync(store, NGramIndex(), config, origin="A")
        await sync.start()
        sync.publish([1, 2, 3, 4])
        await asyncio.sleep(0.05)
        tasks = [sync._task, *sync._loops]
        started = time.monotonic()
        await asyncio.wait_for(sync.stop(flush_timeout_s=5), READ_BLOCK_S / 2)
        # Ended, not left behind: stop() gives up after its timeout and says "stopped" anyway.
        assert all(task.done() for task in tasks), "a task was left running"
        return time.monotonic() - started, store.num_swallowed, sync.state

    elapsed, num_swallowed, state = asyncio.run(scenario())
    assert num_swallowed == 1, "the fault was not injected"
    # Stopped, and well before the swallowed read's block would have ended (wait_for above).
    assert state == "stopped", f"{state} after {elapsed:.1f} s"
