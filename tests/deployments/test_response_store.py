"""The Responses API's store, in memory and in a real Redis: a response is read back by its
tenant only, expires after its TTL, the oldest go beyond the size bound, and a Redis that cannot
be reached is ``StoreUnavailable`` (the route's 503), never another error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from deployments.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStoreSettings,
    StoredResponse,
    StoreUnavailable,
    open_response_store,
)
from pool_service import PoolConfig
from tests.redis_server import MACHINE_REDIS_URL, is_up, own_redis_server, require, run_async


def stored(index: int) -> StoredResponse:
    return StoredResponse(
        {"id": f"resp_{index:032x}", "output": [{"type": "message", "text": f"answer {index}"}]},
        [{"type": "message", "id": f"msg_{index}", "role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"answer {index}"}],
    )


@pytest.fixture(params=["memory", "redis"])
def settings(request) -> Iterator[ResponseStoreSettings]:
    if request.param == "memory":
        yield ResponseStoreSettings()
        return
    require(is_up(MACHINE_REDIS_URL), f"no Redis at {MACHINE_REDIS_URL}")
    namespace = f"test-responses-{time.time_ns()}"
    yield ResponseStoreSettings(PoolConfig(redis_url=MACHINE_REDIS_URL), namespace=namespace)
    client = redis.Redis.from_url(MACHINE_REDIS_URL)
    for key in client.scan_iter(match=f"nasd:{{{namespace}}}*"):
        client.delete(key)


def test_a_response_is_read_back_by_its_tenant_only_and_deleted_once(settings):
    async def run() -> None:
        store = open_response_store(settings)
        assert isinstance(store, RedisResponseStore if settings.pool.redis_url else MemoryResponseStore)
        try:
            await store.check()
            response_id = f"resp_{1:032x}"
            await store.put("tenant-a", response_id, stored(1))
            assert await store.get("tenant-a", response_id) == stored(1)
            assert await store.get("tenant-b", response_id) is None  # as an unknown id
            assert await store.get(None, response_id) is None
            assert not await store.delete("tenant-b", response_id)
            assert await store.delete("tenant-a", response_id)
            assert await store.get("tenant-a", response_id) is None
            assert not await store.delete("tenant-a", response_id)
        finally:
            await store.close()

    run_async(run())


def test_responses_expire_after_the_ttl_and_the_oldest_go_beyond_the_bound(settings):
    async def run() -> None:
        store = open_response_store(ResponseStoreSettings(settings.pool, settings.namespace, 60, 3))
        try:
            for index in range(5):
                await store.put(None, f"resp_{index:032x}", stored(index))
            kept = [await store.get(None, f"resp_{index:032x}") for index in range(5)]
            assert kept == [None, None, stored(2), stored(3), stored(4)]
        finally:
            await store.close()
        store = open_response_store(ResponseStoreSettings(settings.pool, settings.namespace, 0.2, 3))
        try:
            await store.put(None, f"resp_{9:032x}", stored(9))
            await asyncio.sleep(0.5)  # well past the TTL: expiry is not a race
            assert await store.get(None, f"resp_{9:032x}") is None
        finally:
            await store.close()

    run_async(run())


def test_a_redis_that_cannot_be_reached_is_store_unavailable():
    server = own_redis_server()
    store = RedisResponseStore(ResponseStoreSettings(PoolConfig(redis_url=server.url), namespace="outage"))

    async def run() -> None:
        await store.put(None, f"resp_{1:032x}", stored(1))
        server.stop()
        for operation in (
            store.check(),
            store.get(None, f"resp_{1:032x}"),
            store.put(None, f"resp_{2:032x}", stored(2)),
            store.delete(None, f"resp_{1:032x}"),
        ):
            with pytest.raises(StoreUnavailable):
                await operation
        await store.close()

    try:
        run_async(run())
    finally:
        server.stop()


def test_a_record_this_version_cannot_read_is_not_found_rather_than_an_error():
    assert StoredResponse.loads(stored(1).dumps()) == stored(1)
    for text in ("not json", '{"other": 1}', "[1, 2]", '{"response": {}, "unknown": 1}'):
        loaded = StoredResponse.loads(text)
        assert loaded is None or loaded == StoredResponse({}), text


def test_the_store_reaches_a_password_protected_redis_as_the_pool_does(monkeypatch):
    """The password comes from the pool's variable (a Kubernetes Secret), not the URL."""
    server = own_redis_server("--requirepass", "s3cret")
    monkeypatch.setenv("NASD_REDIS_PASSWORD", "s3cret")
    store = open_response_store(ResponseStoreSettings(PoolConfig(redis_url=server.url), namespace="auth"))

    async def run() -> None:
        await store.check()
        await store.put(None, f"resp_{1:032x}", stored(1))
        assert await store.get(None, f"resp_{1:032x}") == stored(1)
        await store.close()

    try:
        run_async(run())
    finally:
        server.stop()
