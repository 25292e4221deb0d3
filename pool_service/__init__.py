"""pool_service: the shared n-gram pool (in-process or Redis) and each replica's sync worker.

pools = SharedPools(PoolConfig(redis_url="redis://..."), namespace_for(model_name, tokenizer))
await pools.start()
engine.add_request(prompt, shared=pools.sources_for(tenant))
pools.publish(tenant, prompt_ids + output_ids)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nasd_core.lazy import lazy_attributes

# Each public name and the module that defines it, imported on first use (as in nasd_core):
# ``python -m pool_service`` reads Redis without loading torch.
_EXPORTS = {
    "POOL_SOURCE": "pool_service.shared",
    "REPLICA_SOURCE": "pool_service.shared",
    "InMemoryPool": "pool_service.store",
    "PoolConfig": "pool_service.config",
    "PoolEntry": "pool_service.codec",
    "PoolStore": "pool_service.store",
    "PoolSync": "pool_service.sync",
    "PoolUnavailableError": "pool_service.store",
    "SharedPools": "pool_service.shared",
    "namespace_for": "pool_service.shared",
    "open_store": "pool_service.backends",
    "tenant_namespace": "pool_service.shared",
}
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

if TYPE_CHECKING:
    from pool_service.backends import open_store
    from pool_service.codec import PoolEntry
    from pool_service.config import PoolConfig
    from pool_service.shared import POOL_SOURCE, REPLICA_SOURCE, SharedPools, namespace_for, tenant_namespace
    from pool_service.store import InMemoryPool, PoolStore, PoolUnavailableError
    from pool_service.sync import PoolSync


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
