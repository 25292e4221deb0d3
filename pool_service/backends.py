"""Which store a pool configuration opens: the in-process pool, or Redis (``redis_pool``)."""

from __future__ import annotations

from pool_service.config import PoolConfig
from pool_service.redis_pool import RedisPool
from pool_service.store import InMemoryPool, PoolStore


def open_store(
    config: PoolConfig, namespace: str, vocab_size: int | None = None, client: object | None = None
) -> PoolStore:
    """The store the config names: Redis when ``redis_url`` is set, else the in-process pool.
    ``client``: a Redis command client to share (``redis_pool.command_client``)."""
    if config.redis_url:
        return RedisPool(config.redis_url, namespace, config, vocab_size, client)
    return InMemoryPool(namespace, config, vocab_size)
