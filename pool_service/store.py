"""Where finished sequences are shared: the PoolStore protocol and the in-process pool.

A store is an append-only, bounded log of finished token sequences per namespace,
de-duplicated by content, that every replica tails from its own cursor. ``InMemoryPool``
is the embedded default (no server); ``RedisPool`` (redis_pool.py) shares it across
processes and machines. Both decode through ``codec.decode_entry`` so the same checks apply.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pool_service.codec import (
    TOKEN_BYTES,
    ForeignEntryError,
    MalformedEntryError,
    PoolEntry,
    bounded_runs,
    decode_entry,
    encode_entry,
    pack_tokens,
    sequence_digest,
)
from pool_service.config import SCHEMA_VERSION, PoolConfig

START_CURSOR = "0-0"
_POLL_S = 0.02


class PoolUnavailableError(ConnectionError):
    """The pool cannot be reached or is not usable (down, slow, wrong schema)."""


@dataclass
class ReadBatch:
    """The sequences of the entries after a cursor, with the entries that had to be skipped
    counted (``num_read``, ``num_malformed`` and ``num_foreign`` count stream entries)."""

    entries: list[PoolEntry] = field(default_factory=list)
    num_malformed: int = 0
    num_foreign: int = 0
    cursor: str = START_CURSOR
    num_read: int = 0


class PoolStore(Protocol):
    """A namespace's shared log of finished sequences."""

    namespace: str
    num_calls: int  # round trips made, for the commands-per-token figure

    async def connect(self) -> str:
        """Open (or check) the pool; returns its epoch, which changes when the pool is recreated.

        Raises:
            PoolUnavailableError: unreachable, or written by an incompatible schema.
        """

    async def publish(
        self, origin: str, sequences: Sequence[Sequence[int]], finished_ms: Sequence[int] | None = None
    ) -> int:
        """Append the sequences not already in the pool; returns how many were new.

        ``finished_ms`` (default: now) is when each sequence finished, so readers can measure
        how stale what they learn is (sync lag).
        """

    async def read(self, cursor: str, count: int, block_ms: int) -> ReadBatch:
        """Up to ``count`` entries after ``cursor``, waiting up to ``block_ms`` for the first."""

    async def close(self) -> None: ...


def decode_batch(
    raw: Sequence[tuple[str, dict[bytes, bytes]]], namespace: str, vocab_size: int | None, cursor: str
) -> ReadBatch:
    """Decode raw ``(id, fields)`` entries, skipping and counting the bad ones."""
    batch = ReadBatch(cursor=cursor, num_read=len(raw))
    for entry_id, fields in raw:
        batch.cursor = entry_id
        try:
            batch.entries.extend(decode_entry(entry_id, fields, namespace, vocab_size))
        except ForeignEntryError:
            batch.num_foreign += 1
        except MalformedEntryError:
            batch.num_malformed += 1
    return batch


def now_ms() -> int:
    return int(time.time() * 1000)


class _MemoryLog:
    """One namespace's log inside this process."""

    def __init__(self) -> None:
        self.entries: deque[tuple[int, dict[bytes, bytes]]] = deque()
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.ids = itertools.count(1)
        self.epoch = f"memory-{time.time_ns()}"


# Replicas in one process (the embedded laptop path, tests) share logs by namespace.
_LOGS: dict[str, _MemoryLog] = {}


class InMemoryPool:
    """The in-process pool: same contract as Redis, no server, shared within the process."""

    def __init__(
        self, namespace: str, config: PoolConfig | None = None, vocab_size: int | None = None
    ) -> None:
        self.namespace = namespace
        self.config = config or PoolConfig()
        self.vocab_size = vocab_size
        self.num_calls = 0

    @property
    def _log(self) -> _MemoryLog:
        return _LOGS.setdefault(self.namespace, _MemoryLog())

    async def connect(self) -> str:
        return self._log.epoch

    async def publish(
        self, origin: str, sequences: Sequence[Sequence[int]], finished_ms: Sequence[int] | None = None
    ) -> int:
        self.num_calls += 1
        log = self._log
        new: list[tuple[bytes, int]] = []
        for sequence, published_ms in zip(sequences, finished_ms or [now_ms()] * len(sequences)):
            packed = pack_tokens(sequence)
            digest = sequence_digest(packed)
            if digest not in log.seen:
                log.seen[digest] = None
                new.append((packed, published_ms))
        # As in Redis: the new sequences of one call share entries of at most max_sequence_tokens.
        sizes = [len(packed) // TOKEN_BYTES for packed, _ in new]
        for run in bounded_runs(new, sizes, self.config.max_sequence_tokens):
            fields = encode_entry(
                self.namespace, origin, [packed for packed, _ in run], [stamp for _, stamp in run]
            )
            log.entries.append((next(log.ids), fields))
        while len(log.entries) > self.config.max_stream_len:
            log.entries.popleft()
        while len(log.seen) > 2 * self.config.max_stream_len:
            log.seen.popitem(last=False)
        return len(new)

    async def read(self, cursor: str, count: int, block_ms: int) -> ReadBatch:
        self.num_calls += 1
        after = int(cursor.split("-")[0])
        deadline = time.monotonic() + block_ms / 1000
        while True:
            entries = self._log.entries
            # Ids are consecutive, so the first entry after the cursor is found by arithmetic.
            start = max(0, after + 1 - entries[0][0]) if entries else 0
            raw = [(f"{i}-0", fields) for i, fields in itertools.islice(entries, start, start + count)]
            if raw or time.monotonic() >= deadline:
                return decode_batch(raw, self.namespace, self.vocab_size, cursor)
            await asyncio.sleep(_POLL_S)

    async def close(self) -> None:
        return None

    def append_raw(self, fields: dict[bytes, bytes]) -> None:
        """Write an unchecked entry (tests use it to inject malformed data)."""
        log = self._log
        log.entries.append((next(log.ids), fields))


__all__ = [
    "SCHEMA_VERSION",
    "START_CURSOR",
    "InMemoryPool",
    "PoolStore",
    "PoolUnavailableError",
    "ReadBatch",
    "decode_batch",
]
