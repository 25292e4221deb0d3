"""What a replica holds of the shared pool: per-namespace indexes and their sync workers.

For every namespace in use (one, or one per tenant with isolation on) a replica keeps two
read-only draft sources for its requests:

* ``replica`` - the sequences this replica finished itself (learned at once, no I/O);
* ``pool`` - the sequences other replicas finished, tailed from the pool by ``PoolSync`` workers.

With ``PoolConfig.partitions`` = 0 (the default) a namespace is one Redis stream and every
replica tails all of it. With N >= 1, each tenant's sequences are split over N partition
streams by a hash of the conversation's opening (``GenerateRequest.pool_partition``), requests
are routed by tenant and partition (``deployments.router``), and a replica tails only the partitions
of the requests it serves, at most ``max_followed_partitions`` at a time, into the one pool
index of the namespace: its ingest then grows with its own traffic, not with the replica
count (docs/results.md, the shared pool at cluster scale).

Requests pass ``sources_for(tenant, partition)`` to the engine as their shared draft sources.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import socket
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from nasd_core.speculation.drafter import SharedIndex, new_shared_index
from pool_service.backends import open_store
from pool_service.config import PoolConfig
from pool_service.redis_pool import command_client
from pool_service.sync import Apply, PoolSync, apply_now

logger = logging.getLogger(__name__)

REPLICA_SOURCE = "replica"
POOL_SOURCE = "pool"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def namespace_for(model_name: str, tokenizer) -> str:
    """Namespace of a model: its name plus a fingerprint of the tokenizer's vocabulary.

    Two replicas share drafts only when token ids mean the same thing to both, so the
    fingerprint covers every (token, id) pair and the special tokens.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    payload = json.dumps([model_name, vocab, sorted(map(str, tokenizer.all_special_tokens))])
    fingerprint = hashlib.sha256(payload.encode()).hexdigest()[:12]
    return f"{_SAFE_NAME.sub('_', model_name)[-48:]}-{fingerprint}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tenant_namespace(namespace: str, tenant: str | None) -> str:
    """A tenant's own namespace; the tenant name is hashed so any string is safe in a key."""
    if tenant is None:
        return namespace
    return f"{namespace}/tenant-{_digest(tenant)}"


def partition_namespace(namespace: str, tenant: str | None, partition: int) -> str:
    """The pool stream of one of ``tenant``'s partitions in ``namespace``. The tenant is part
    of the name with or without isolation: partitions are routing keys, and one tenant's hot
    partition must not share a stream (and so its replicas) with every other tenant's."""
    return f"{namespace}/part-{_digest(tenant or '')}-{partition}"


@dataclass
class _Namespace:
    name: str
    replica_index: SharedIndex
    pool_index: SharedIndex
    # The streams this replica tails into pool_index, least recently used first.
    syncs: OrderedDict[str, PoolSync] = field(default_factory=OrderedDict)

    @property
    def sources(self) -> list[tuple[str, SharedIndex]]:
        return [(REPLICA_SOURCE, self.replica_index), (POOL_SOURCE, self.pool_index)]


class SharedPools:
    """A replica's view of the shared pool. Construct (no I/O), then ``await start()``.

    Args:
        config: pool location, isolation, partitions, retention.
        namespace: the model's namespace (``namespace_for``).
        apply: runs an index update where the engine may read the index (its thread).
        origin: this replica's name in the pool (default: host and pid).
        vocab_size: token ids at or above it are rejected when read from the pool.
    """

    def __init__(
        self,
        config: PoolConfig,
        namespace: str,
        apply: Apply = apply_now,
        origin: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.apply = apply
        self.origin = origin or f"{socket.gethostname()}-{os.getpid()}"
        self.vocab_size = vocab_size
        self.num_tenants_refused = 0
        self.num_partitions_dropped = 0
        self._namespaces: dict[str, _Namespace] = {}
        self._background: set[Future] = set()  # workers starting, or flushing as they are dropped
        self._client = None  # the Redis command client of every followed stream (readers: their own)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Start syncing the default namespace (waits, bounded, for its replay). Never raises
        because the pool is down: the worker retries in the background. With partitions, the
        replica follows each partition when its first request comes."""
        self._loop = asyncio.get_running_loop()
        if not self.config.partitions:
            space = self._get(None)
            await self._follow(space, space.name, start=False).start()

    async def stop(self) -> None:
        """Flush pending publishes and stop every worker."""
        self._loop = None  # nothing starts from here on
        # Workers being started or dropped first: a start scheduled before this call must not
        # run after the stop below.
        await asyncio.gather(*map(asyncio.wrap_future, list(self._background)))
        syncs = [sync for space in self._namespaces.values() for sync in space.syncs.values()]
        await asyncio.gather(*(sync.stop() for sync in syncs))
        if self._client is not None:
            with contextlib.suppress(Exception):  # closing: a broken connection changes nothing
                await self._client.aclose()
            self._client = None

    def sources_for(self, tenant: str | None, partition: int = 0) -> list[tuple[str, SharedIndex]]:
        """Draft sources a request of ``tenant`` may read (tenant is ignored without isolation),
        and, with partitions, start tailing the request's ``partition`` if not yet followed."""
        space = self._get(tenant)
        if space is None:
            return []
        self._follow(space, self._stream(space, tenant, partition))
        return space.sources

    def publish(self, tenant: str | None, token_ids: Sequence[int], partition: int = 0) -> None:
        """A request finished: learn it on this replica now and share it through the pool."""
        space = self._get(tenant)
        if space is None or len(token_ids) < 2:
            return
        tokens = list(token_ids)
        self.apply(lambda: space.replica_index.update(tokens))
        self._follow(space, self._stream(space, tenant, partition)).publish(tokens)

    def stats(self) -> dict[str, object]:
        spaces = self._namespaces.values()
        return {
            "origin": self.origin,
            "backend": "redis" if self.config.redis_url else "memory",
            "tenant_isolation": self.config.tenant_isolation,
            "partitions": self.config.partitions,
            "num_tenants_refused": self.num_tenants_refused,
            "num_partitions_followed": sum(len(space.syncs) for space in spaces),
            "num_partitions_dropped": self.num_partitions_dropped,
            "replica_index_entries": sum(space.replica_index.num_entries for space in spaces),
            "namespaces": [sync.stats() for space in spaces for sync in space.syncs.values()],
        }

    def _stream(self, space: _Namespace, tenant: str | None, partition: int) -> str:
        if not self.config.partitions:
            return space.name
        if not 0 <= partition < self.config.partitions:
            raise ValueError(f"partition {partition} is not in [0, {self.config.partitions})")
        return partition_namespace(space.name, tenant, partition)

    def _get(self, tenant: str | None) -> _Namespace | None:
        name = tenant_namespace(self.namespace, tenant if self.config.tenant_isolation else None)
        space = self._namespaces.get(name)
        if space is not None:
            return space
        if len(self._namespaces) >= self.config.max_tenants + 1:  # the default namespace + tenants
            # Refusing a new tenant its pool keeps isolation and memory bounds: it drafts only
            # from its own request, which is always safe.
            if self.num_tenants_refused == 0:
                logger.warning(
                    "more than %d tenants: new tenants get no shared pool", self.config.max_tenants
                )
            self.num_tenants_refused += 1
            return None
        space = _Namespace(name, new_shared_index(self.config.index), new_shared_index(self.config.index))
        self._namespaces[name] = space
        return space

    def _follow(self, space: _Namespace, stream: str, start: bool = True) -> PoolSync:
        """The worker tailing ``stream`` into the namespace's pool index, created (and, with
        ``start``, started in the background: its first requests draft without it) if the
        replica did not follow it yet. Beyond ``max_followed_partitions`` the least recently
        used stream is dropped: its worker flushes and stops; what it taught the index stays
        until the index's own bound evicts it."""
        sync = space.syncs.get(stream)
        if sync is not None:
            space.syncs.move_to_end(stream)
            return sync
        sync = PoolSync(
            open_store(self.config, stream, self.vocab_size, self._command_client()),
            space.pool_index,
            self.config,
            self.origin,
            self.apply,
        )
        space.syncs[stream] = sync
        if len(space.syncs) > self.config.max_followed_partitions:
            _, dropped = space.syncs.popitem(last=False)
            self.num_partitions_dropped += 1
            self._in_background(dropped.stop())
        if start:
            self._in_background(sync.start(wait_for_replay=False))
        return sync

    def _command_client(self):
        """One Redis client for every stream's short commands: a replica following tens of
        partitions then holds one connection per blocking reader, not two per partition."""
        if self._client is None and self.config.redis_url:
            self._client = command_client(self.config.redis_url, self.config)
        return self._client

    def _in_background(self, coroutine: Coroutine) -> None:
        if self._loop is None:  # not started yet, or stopped: nothing may run
            coroutine.close()
            return
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._background.add(future)
        future.add_done_callback(self._background.discard)
