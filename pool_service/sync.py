"""The per-replica sync worker: write-behind publishing and tailing of the shared pool.

Never on the token path: the engine only reads its local indexes. This worker publishes
finished sequences in batches and tails everyone else's into the pool-fed index. At start
its cursor is the beginning of the retained pool, so a new replica replays it and starts
warm. When the pool is down, slow or broken the worker logs once per state change, keeps
the unpublished sequences (bounded), retries with exponential backoff and resumes by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from nasd_core.speculation.drafter import SharedIndex
from pool_service.codec import bounded_runs, pack_tokens, sequence_digest
from pool_service.config import PoolConfig
from pool_service.store import START_CURSOR, PoolStore, PoolUnavailableError, now_ms

logger = logging.getLogger(__name__)

# Runs a function where the index may be mutated (the engine thread); may return a Future.
Apply = Callable[[Callable[[], None]], object]
_LAG_SAMPLES = 2048
_RECENT_DIGESTS = 4096
_CANCEL_TIMEOUT_S = 5.0
_RECANCEL_S = 0.2
# Tokens learned per apply call: an apply runs between engine steps, so a large read (a
# replay, a burst) is learned in slices of ~12 ms (NGramIndex.update: ~3 us per token at 3
# levels on this 2-core VM) instead of holding up one step, or the event loop where updates
# run inline, for a second.
APPLY_SLICE_TOKENS = 4096


def apply_now(function: Callable[[], None]) -> None:
    function()


class PoolSync:
    """Syncs one namespace of the pool with a local index. Construct, then ``await start()``.

    Args:
        store: the namespace's pool.
        pool_index: the local index fed with other replicas' sequences.
        config: batching, retention and retry settings.
        origin: this replica's name; entries it published itself are not learned twice.
        apply: how to run an index update (default: at once, on the calling thread).
    """

    def __init__(
        self,
        store: PoolStore,
        pool_index: SharedIndex,
        config: PoolConfig,
        origin: str,
        apply: Apply = apply_now,
    ) -> None:
        self.store = store
        self.pool_index = pool_index
        self.config = config
        self.origin = origin
        self.apply = apply
        self.state = "stopped"
        self.last_error: str | None = None
        self.is_replayed = asyncio.Event()
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "published",
                "duplicates_skipped",
                "dropped",
                "received",
                "own_skipped",
                "malformed",
                "foreign",
                "learned_tokens",
                "state_changes",
            ),
            0,
        )
        self._pending: deque[tuple[list[int], int]] = deque()  # (tokens, finished at, ms)
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._lags_ms: deque[float] = deque(maxlen=_LAG_SAMPLES)
        self._cursor = START_CURSOR
        self._epoch: str | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._loops: list[asyncio.Task] = []  # the read and write loops of the current connection

    # ------------------------------------------------------------------ control
    async def start(self, wait_for_replay: bool = True) -> None:
        """Start syncing in the background and wait (bounded) for the pool's replay."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if self._pending:  # published before start
            self._wake.set()
        self._task = asyncio.create_task(self._run(), name=f"pool-sync-{self.store.namespace}")
        if wait_for_replay and self.config.warm_start_timeout_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.is_replayed.wait(), self.config.warm_start_timeout_s)

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Publish what is pending (bounded by ``flush_timeout_s``), then stop and close."""
        if self._task is None:
            return
        deadline = time.monotonic() + flush_timeout_s
        await asyncio.sleep(0)  # let publishes handed over from other threads land first
        self._wake_up()
        while self._pending and self.state == "connected" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # The loops are waited for directly: a re-cancel of the worker task interrupts its own
        # clean-up, which would otherwise leave a loop running on a store about to close.
        tasks, self._task = [self._task, *self._loops], None
        if not await cancel_and_wait(tasks, flush_timeout_s):
            logger.warning("pool %s: sync worker ignored cancellation; left behind", self.store.namespace)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.store.close(), flush_timeout_s)
        self._set_state("stopped")

    def publish(self, token_ids: Sequence[int]) -> None:
        """Queue a finished sequence for the pool; thread-safe and never blocks.

        Only the last ``max_sequence_tokens`` are kept; a sequence published recently by this
        replica is skipped (the pool de-duplicates across replicas too).
        """
        tokens = list(token_ids[-self.config.max_sequence_tokens :])
        if len(tokens) < 2:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed() and _running_loop() is not loop:
            loop.call_soon_threadsafe(self._enqueue, tokens, now_ms())  # the queue is the loop's
        else:
            self._enqueue(tokens, now_ms())

    def _enqueue(self, tokens: list[int], finished_ms: int) -> None:
        digest = sequence_digest(pack_tokens(tokens))
        if digest in self._recent:
            self.counts["duplicates_skipped"] += 1
            return
        self._recent[digest] = None
        if len(self._recent) > _RECENT_DIGESTS:
            self._recent.popitem(last=False)
        self._pending.append((tokens, finished_ms))
        while len(self._pending) > self.config.max_pending:
            self._pending.popleft()
            self.counts["dropped"] += 1
        self._wake_up()

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------- worker
    async def _run(self) -> None:
        backoff_s = self.config.backoff_initial_s
        while True:
            try:
                epoch = await self.store.connect()
                if epoch != self._epoch:
                    # A new or recreated pool: replay it from the start (local data is kept).
                    self._epoch, self._cursor = epoch, START_CURSOR
                self._set_state("connected")
                backoff_s = self.config.backoff_initial_s
                self._loops = [
                    asyncio.ensure_future(self._read_loop()),
                    asyncio.ensure_future(self._write_loop()),
                ]
                await _first_failure(self._loops)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any pool failure: serve on, retry later
                self._set_state("down", exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, self.config.backoff_max_s)

    async def _write_loop(self) -> None:
        while True:
            # What a failed publish left pending goes out on reconnect, not at the next publish.
            if not self._pending:
                await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.config.flush_interval_ms / 1000)  # let a burst batch up
            while self._pending:
                batch = [self._pending[i] for i in range(min(self.config.publish_batch, len(self._pending)))]
                num_added = await self.store.publish(
                    self.origin, [tokens for tokens, _ in batch], [finished_ms for _, finished_ms in batch]
                )
                # Taken off the queue only once Redis has them: a failure keeps them pending.
                for _ in batch:
                    self._pending.popleft()
                self.counts["published"] += num_added
                self.counts["duplicates_skipped"] += len(batch) - num_added

    async def _read_loop(self) -> None:
        while True:
            # Replaying the retained pool must not wait on an empty stream; tailing may.
            block_ms = self.config.read_block_ms if self.is_replayed.is_set() else 0
            batch = await self.store.read(self._cursor, self.config.read_batch, block_ms)
            self.counts["malformed"] += batch.num_malformed
            self.counts["foreign"] += batch.num_foreign
            learned = [entry for entry in batch.entries if entry.origin != self.origin]
            self.counts["own_skipped"] += len(batch.entries) - len(learned)
            if learned:
                sizes = [len(entry.token_ids) for entry in learned]
                for piece in bounded_runs(learned, sizes, APPLY_SLICE_TOKENS):
                    sequences = [entry.token_ids for entry in piece]
                    await _wait_applied(self.apply(functools.partial(self.pool_index.update_many, sequences)))
                    now = time.time() * 1000
                    self._lags_ms.extend(max(0.0, now - entry.published_ms) for entry in piece)
                    self.counts["received"] += len(piece)
                    self.counts["learned_tokens"] += sum(len(tokens) for tokens in sequences)
            self._cursor = batch.cursor
            if batch.num_read < self.config.read_batch:
                self.is_replayed.set()
            if learned and self.is_replayed.is_set():
                # Entries arrive in bursts (a batch finishing): one read per interval takes a
                # whole burst, which keeps Redis commands per generated token low.
                await asyncio.sleep(self.config.read_interval_ms / 1000)

    def _set_state(self, state: str, error: BaseException | None = None) -> None:
        if error is not None:
            self.last_error = f"{type(error).__name__}: {error}"
        if state == self.state:
            return
        self.counts["state_changes"] += 1
        if state == "down":
            logger.warning("pool %s unavailable, serving from local indexes: %s", self.store.namespace, error)
        else:
            logger.info("pool %s: %s", self.store.namespace, state)
        self.state = state

    # -------------------------------------------------------------------- stats
    def stats(self) -> dict[str, object]:
        """JSON-able sync state: connection, counts, queue, lag percentiles."""
        lags = np.asarray(self._lags_ms) if self._lags_ms else None
        return {
            "namespace": self.store.namespace,
            "state": self.state,
            "last_error": self.last_error,
            "replayed": self.is_replayed.is_set(),
            "pending": len(self._pending),
            "store_calls": self.store.num_calls,
            "index_entries": self.pool_index.num_entries,
            **self.counts,
            "lag_ms_p50": None if lags is None else round(float(np.percentile(lags, 50)), 3),
            "lag_ms_p99": None if lags is None else round(float(np.percentile(lags, 99)), 3),
        }


async def _first_failure(tasks: Sequence[asyncio.Task]) -> None:
    """Wait for the loops; the first one to fail cancels the others and raises."""
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        await cancel_and_wait(tasks, _CANCEL_TIMEOUT_S)


async def cancel_and_wait(tasks: Sequence[asyncio.Task], timeout_s: float) -> bool:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end; whether they all did.

    One ``cancel()`` is not always enough: a cancellation that lands while a redis-py call's
    own timeout fires can be swallowed (``asyncio.timeout`` in Python 3.11), and the loop then
    carries on with its next blocking read. So the cancel is repeated until the task ends, and
    the wait is bounded: a replica's shutdown must never hang on the pool (a CI run once did).
    """
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(
            pending, timeout=min(_RECANCEL_S, max(0.0, deadline - time.monotonic()))
        )
    for task in tasks:  # mark failures as retrieved: they were reported where they happened
        if task.done() and not task.cancelled():
            task.exception()
    return not pending


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _wait_applied(result: object) -> None:
    if isinstance(result, Future):
        await asyncio.wrap_future(result)
    else:
        await asyncio.sleep(0)  # applied inline: let the loop's other work in between slices


__all__ = ["Apply", "PoolSync", "PoolUnavailableError", "apply_now"]
