"""pool_service: the shared n-gram pool (in-process or Redis) and each replica's sync worker.

pools = SharedPools(PoolConfig(redis_url="redis://..."), namespace_for(model_name, tokenizer))
await pools.start()
engine.add_request(prompt, shared=pools.sources_for(tenant))
pools.publish(tenant, prompt_ids + output_ids)
"""

from pool_service.codec import PoolEntry
from pool_service.config import PoolConfig
from pool_service.shared import POOL_SOURCE, REPLICA_SOURCE, SharedPools, namespace_for, tenant_namespace
from pool_service.store import InMemoryPool, PoolStore, PoolUnavailableError, open_store
from pool_service.sync import PoolSync

__all__ = [
    "POOL_SOURCE",
    "REPLICA_SOURCE",
    "InMemoryPool",
    "PoolConfig",
    "PoolEntry",
    "PoolStore",
    "PoolSync",
    "PoolUnavailableError",
    "SharedPools",
    "namespace_for",
    "open_store",
    "tenant_namespace",
]
