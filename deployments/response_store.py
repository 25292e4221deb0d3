"""Where the Responses API keeps its responses (``store``, ``previous_response_id``): in the
ingress's memory for one server, in Redis when the application has a ``redis_url``, so that an id
one ingress made is read by every other.

Each stored response keeps the whole conversation through its output as chat messages, so a
continuation reads one record, however long the chain of ids before it. Records expire after a
TTL, and the store holds at most ``max_items`` of them (the oldest go first). Ids are scoped to
the API key's tenant: another tenant's id is not found, exactly as an unknown one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as redis

from pool_service import PoolConfig
from pool_service.redis_pool import open_client

# OpenAI keeps a stored response for 30 days; a server's memory is smaller, so a day by default.
DEFAULT_RESPONSE_TTL_S = 86_400
DEFAULT_RESPONSE_STORE_MAX_ITEMS = 4096
# What a request that needs the store is told while Redis cannot be reached.
STORE_RETRY_AFTER_S = 5


class StoreUnavailable(Exception):
    """The response store cannot be reached (a store request answers 503 with Retry-After)."""

    retry_after_s = STORE_RETRY_AFTER_S


@dataclass
class StoredResponse:
    """One stored response.

    Attributes:
        response: the Response object as the API returned it.
        input_items: the request's own input items, each with an id (``input_items`` route).
        messages: the conversation's chat messages through this response's output, without
            the instructions (a continuation's instructions are its own, as in OpenAI's API).
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str | bytes) -> StoredResponse | None:
        """The record of ``text``; None for one this version cannot read (a shared Redis may
        hold another version's records)."""
        try:
            fields = json.loads(text)
            return cls(fields["response"], fields.get("input_items", []), fields.get("messages", []))
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class ResponseStoreSettings:
    """The application's store: in the Redis of ``pool`` (its URL, password variable and socket
    timeout, as the replicas' pool reaches it), or the ingress's memory where it has no URL."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    namespace: str = "default"
    ttl_s: float = DEFAULT_RESPONSE_TTL_S
    max_items: int = DEFAULT_RESPONSE_STORE_MAX_ITEMS


def _tenant_key(tenant: str | None) -> str:
    """A tenant as a key part (any text, hashed: a tenant name may hold the key separator)."""
    return hashlib.sha256((tenant or "").encode("utf-8", "surrogatepass")).hexdigest()[:16]


class MemoryResponseStore:
    """Responses in this process, as JSON text (what a caller changes later is not stored)."""

    def __init__(self, settings: ResponseStoreSettings) -> None:
        self.settings = settings
        self._items: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()

    async def check(self) -> None:
        """Raises ``StoreUnavailable`` when the store cannot be reached (never, in memory)."""

    async def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        key = (_tenant_key(tenant), response_id)
        found = self._items.get(key)
        if found is None:
            return None
        expires_at, text = found
        if expires_at <= time.monotonic():
            del self._items[key]
            return None
        return StoredResponse.loads(text)

    async def put(self, tenant: str | None, response_id: str, stored: StoredResponse) -> None:
        key = (_tenant_key(tenant), response_id)
        self._items[key] = (time.monotonic() + self.settings.ttl_s, stored.dumps())
        self._items.move_to_end(key)
        while len(self._items) > self.settings.max_items:
            self._items.popitem(last=False)

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        found = self._items.pop((_tenant_key(tenant), response_id), None)
        return found is not None and found[0] > time.monotonic()  # an expired one is gone already

    async def close(self) -> None:
        self._items.clear()


class RedisResponseStore:
    """Responses in Redis: one key per response with the TTL, and a sorted set of the keys by
    time written, trimmed to ``max_items`` (the trimmed responses are deleted with it)."""

    def __init__(self, settings: ResponseStoreSettings) -> None:
        self.settings = settings
        self.client = open_client(settings.pool.redis_url, settings.pool)
        # One hash slot for the namespace's keys (a Redis Cluster runs the trim's MULTI on one node).
        self.prefix = f"nasd:{{{settings.namespace}}}:responses"
        self.index = f"{self.prefix}:index"  # the keys by time written

    def _key(self, tenant: str | None, response_id: str) -> str:
        return f"{self.prefix}:{_tenant_key(tenant)}:{response_id}"

    async def _call(self, operation):
        try:
            return await operation
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"the response store (Redis) cannot be reached: {exc}") from exc

    async def check(self) -> None:
        await self._call(self.client.ping())

    async def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        text = await self._call(self.client.get(self._key(tenant, response_id)))
        return None if text is None else StoredResponse.loads(text)

    async def put(self, tenant: str | None, response_id: str, stored: StoredResponse) -> None:
        key, index, now = self._key(tenant, response_id), self.index, time.time()
        ttl_ms = max(1, int(self.settings.ttl_s * 1000))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(key, stored.dumps(), px=ttl_ms)
            pipe.zadd(index, {key: now})
            pipe.zremrangebyscore(index, "-inf", now - self.settings.ttl_s)  # expired keys' entries
            pipe.zcard(index)
            *_, count = await self._call(pipe.execute())
        if count > self.settings.max_items:
            oldest = await self._call(self.client.zpopmin(index, count - self.settings.max_items))
            if oldest:
                await self._call(self.client.delete(*(member for member, _ in oldest)))

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.zrem(self.index, key)
            deleted, _ = await self._call(pipe.execute())
        return bool(deleted)

    async def close(self) -> None:
        await self.client.aclose()


ResponseStore = MemoryResponseStore | RedisResponseStore


def open_response_store(settings: ResponseStoreSettings) -> ResponseStore:
    """The store of ``settings``: Redis where it has a URL, else memory."""
    return RedisResponseStore(settings) if settings.pool.redis_url else MemoryResponseStore(settings)
