"""What a replica holds of the shared pool: per-namespace indexes and their sync workers.

For every namespace in use (one, or one per tenant with isolation on) a replica keeps two
read-only draft sources for its requests:

* ``replica`` - the sequences this replica finished itself (learned at once, no I/O);
* ``pool`` - the sequences other replicas finished, tailed from the pool by a ``PoolSync``.

Requests pass ``sources_for(tenant)`` to the engine as their shared draft sources.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from nasd_core.ngram import NGramIndex
from pool_service.config import PoolConfig
from pool_service.store import open_store
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


def tenant_namespace(namespace: str, tenant: str | None) -> str:
    """A tenant's own namespace; the tenant name is hashed so any string is safe in a key."""
    if tenant is None:
        return namespace
    return f"{namespace}/tenant-{hashlib.sha256(tenant.encode()).hexdigest()[:16]}"


@dataclass
class _Namespace:
    replica_index: NGramIndex
    pool_index: NGramIndex
    sync: PoolSync

    @property
    def sources(self) -> list[tuple[str, NGramIndex]]:
        return [(REPLICA_SOURCE, self.replica_index), (POOL_SOURCE, self.pool_index)]


class SharedPools:
    """A replica's view of the shared pool. Construct (no I/O), then ``await start()``.

    Args:
        config: pool location, isolation, retention.
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
        self._namespaces: dict[str, _Namespace] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Start syncing the default namespace (waits, bounded, for its replay). Never raises
        because the pool is down: the worker retries in the background."""
        self._loop = asyncio.get_running_loop()
        await self._get(None).sync.start()

    async def stop(self) -> None:
        """Flush pending publishes and stop every worker."""
        await asyncio.gather(*(space.sync.stop() for space in self._namespaces.values()))

    def sources_for(self, tenant: str | None) -> list[tuple[str, NGramIndex]]:
        """Draft sources a request of ``tenant`` may read (tenant is ignored without isolation)."""
        space = self._get(tenant)
        return space.sources if space is not None else []

    def publish(self, tenant: str | None, token_ids: Sequence[int]) -> None:
        """A request finished: learn it on this replica now and share it through the pool."""
        space = self._get(tenant)
        if space is None or len(token_ids) < 2:
            return
        tokens = list(token_ids)
        self.apply(lambda: space.replica_index.update(tokens))
        space.sync.publish(tokens)

    def stats(self) -> dict[str, object]:
        return {
            "origin": self.origin,
            "backend": "redis" if self.config.redis_url else "memory",
            "tenant_isolation": self.config.tenant_isolation,
            "num_tenants_refused": self.num_tenants_refused,
            "replica_index_entries": sum(s.replica_index.num_entries for s in self._namespaces.values()),
            "namespaces": [space.sync.stats() for space in self._namespaces.values()],
        }

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
        store = open_store(self.config, name, self.vocab_size)
        pool_index = NGramIndex(self.config.index)
        space = _Namespace(
            NGramIndex(self.config.index),
            pool_index,
            PoolSync(store, pool_index, self.config, self.origin, self.apply),
        )
        self._namespaces[name] = space
        if self._loop is not None and tenant is not None:
            # A tenant's worker starts in the background; its first requests draft without it.
            asyncio.run_coroutine_threadsafe(space.sync.start(), self._loop)
        return space
