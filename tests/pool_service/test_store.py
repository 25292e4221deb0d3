"""The pool stores: round trips, de-duplication, bad entries, memory bounds (real Redis)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from pool_service.codec import (
    ForeignEntryError,
    MalformedEntryError,
    decode_entry,
    encode_entry,
    pack_tokens,
)
from pool_service.config import PoolConfig
from pool_service.redis_pool import RedisPool, pool_keys
from pool_service.store import START_CURSOR, InMemoryPool, PoolUnavailableError

VOCAB = 1000


def test_codec_round_trip_and_rejections():
    packed = [pack_tokens([5, 0, 999]), pack_tokens([7]), pack_tokens([1, 2])]
    fields = encode_entry("ns", "replica-a", packed, [1234, 1240, 1250])
    entries = decode_entry("1-0", fields, "ns", VOCAB)
    assert [(e.origin, e.token_ids, e.published_ms) for e in entries] == [
        ("replica-a", [5, 0, 999], 1234),
        ("replica-a", [7], 1240),
        ("replica-a", [1, 2], 1250),
    ]
    # The layout before batching (no lengths field: one sequence) still reads.
    single = {k: v for k, v in encode_entry("ns", "b", packed[:1], [9]).items() if k != b"l"}
    assert [e.token_ids for e in decode_entry("2-0", single, "ns", VOCAB)] == [[5, 0, 999]]
    with pytest.raises(ForeignEntryError):
        decode_entry("1-0", fields, "other-ns", VOCAB)
    with pytest.raises(MalformedEntryError, match="outside the vocabulary"):
        decode_entry("1-0", fields, "ns", 999)
    for broken in (
        {k: v for k, v in fields.items() if k != b"t"},
        {**fields, b"t": b"\x01\x02\x03"},
        {**fields, b"t": b""},
        {**fields, b"ts": b"soon"},
        {**fields, b"ts": b"1,2"},  # three sequences, two times
        {**fields, b"l": b"3,1,3"},  # lengths past the payload
        {**fields, b"l": b"3,0,3"},
        {**fields, b"l": b""},
        {**fields, b"o": b"\xff\xfe"},
    ):
        with pytest.raises(MalformedEntryError):
            decode_entry("1-0", broken, "ns", VOCAB)


def _stores(redis_url: str | None, namespace: str, config: PoolConfig):
    if redis_url is None:
        return InMemoryPool(namespace, config, VOCAB)
    return RedisPool(redis_url, namespace, config, VOCAB)


@pytest.fixture(params=["memory", "redis"])
def make_store(request, namespace):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def make(**config):
        return _stores(url, namespace, PoolConfig(redis_url=url, **config))

    return make


def test_publish_read_dedup_and_cursor(make_store):
    async def run():
        store = make_store()
        await store.connect()
        assert await store.publish("a", [[1, 2, 3], [4, 5, 6], [1, 2, 3]]) == 2
        assert await store.publish("b", [[4, 5, 6], [7, 8]]) == 1  # another replica, same text
        first = await store.read(START_CURSOR, 1, 0)  # one entry: the first call's new sequences
        assert [e.token_ids for e in first.entries] == [[1, 2, 3], [4, 5, 6]] and first.num_read == 1
        rest = await store.read(first.cursor, 10, 0)
        assert [(e.origin, e.token_ids) for e in rest.entries] == [("b", [7, 8])]
        empty = await store.read(rest.cursor, 10, 50)  # blocks 50 ms, then nothing
        assert empty.entries == [] and empty.cursor == rest.cursor
        await store.close()

    asyncio.run(run())


def test_a_publish_fills_entries_up_to_the_token_cap(make_store):
    """Both stores lay a call's new sequences out alike: consecutive runs of at most
    max_sequence_tokens tokens per stream entry, each sequence with its own finish time."""

    async def run():
        store = make_store(max_sequence_tokens=5)
        await store.connect()
        sequences = [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10], [11], [12, 13]]
        assert await store.publish("a", sequences, [10, 11, 12, 13, 14]) == 5
        batch = await store.read(START_CURSOR, 10, 0)
        assert batch.num_read == 3  # [1 2 | 3 4 5], [6 .. 10], [11 | 12 13]
        assert [e.token_ids for e in batch.entries] == sequences
        assert [e.published_ms for e in batch.entries] == [10, 11, 12, 13, 14]
        assert len({e.entry_id for e in batch.entries}) == 3
        await store.close()

    asyncio.run(run())


def test_blocking_read_wakes_on_publish(make_store):
    async def run():
        reader, writer = make_store(), make_store()
        await reader.connect()
        await writer.connect()
        pending = asyncio.create_task(reader.read(START_CURSOR, 10, 5000))
        await asyncio.sleep(0.1)
        await writer.publish("w", [[9, 9, 9]])
        batch = await asyncio.wait_for(pending, 2)  # long before the 5 s block ends
        assert [e.token_ids for e in batch.entries] == [[9, 9, 9]]
        await reader.close()
        await writer.close()

    asyncio.run(run())


def test_malformed_and_foreign_entries_are_counted_and_skipped(redis_url, namespace):
    async def run():
        store = RedisPool(redis_url, namespace, PoolConfig(redis_url=redis_url), VOCAB)
        await store.connect()
        client = redis.Redis.from_url(redis_url)
        stream = pool_keys(namespace)["seqs"]
        await store.publish("a", [[1, 2]])
        client.xadd(stream, {"garbage": "yes"})
        client.xadd(stream, encode_entry(namespace, "x", [b"\x00\x01\x02"], [1]))
        client.xadd(stream, encode_entry(namespace, "x", [pack_tokens([VOCAB + 5])], [1]))
        client.xadd(stream, encode_entry("another-model", "x", [pack_tokens([3, 4])], [1]))
        await store.publish("a", [[5, 6]])
        batch = await store.read(START_CURSOR, 100, 0)
        assert [e.token_ids for e in batch.entries] == [[1, 2], [5, 6]]
        assert (batch.num_malformed, batch.num_foreign, batch.num_read) == (3, 1, 6)
        await store.close()

    asyncio.run(run())


def test_incompatible_schema_is_refused(redis_url, namespace):
    redis.Redis.from_url(redis_url).hset(pool_keys(namespace)["meta"], "schema_version", "999")

    async def run():
        store = RedisPool(redis_url, namespace)
        with pytest.raises(PoolUnavailableError, match="schema"):
            await store.connect()
        await store.close()

    asyncio.run(run())


def test_unreachable_redis_raises_typed_error(namespace):
    from tests.redis_server import free_port

    async def run():
        store = RedisPool(f"redis://127.0.0.1:{free_port()}", namespace)
        with pytest.raises(PoolUnavailableError):
            await store.connect()
        with pytest.raises(PoolUnavailableError):
            await store.publish("a", [[1, 2]])
        await store.close()

    asyncio.run(run())


def test_redis_memory_bounded_under_a_flood_of_100k_sequences(own_redis, namespace):
    """100k distinct sequences published: the stream and digest set stay at their caps (entries
    of at most two 4-token sequences here, so the stream must trim)."""
    max_len = 2000
    config = PoolConfig(redis_url=own_redis.url, max_stream_len=max_len, max_sequence_tokens=8)

    async def run():
        store = RedisPool(own_redis.url, namespace, config, VOCAB)
        await store.connect()
        for start in range(0, 100_000, 1000):
            batch = [
                [(i * 7) % VOCAB, (i * 13) % VOCAB, i % VOCAB, i // VOCAB] for i in range(start, start + 1000)
            ]
            assert await store.publish("flood", batch) == 1000
        await store.close()

    asyncio.run(run())
    client = redis.Redis.from_url(own_redis.url)
    keys = pool_keys(namespace)
    # Approximate trimming drops whole stream nodes (100 entries each by default).
    assert max_len <= client.xlen(keys["seqs"]) <= max_len + 100
    assert client.zcard(keys["seen"]) == 2 * max_len
    used = sum(client.memory_usage(key) for key in keys.values())
    assert used < 2_000_000, used  # ~ a few hundred bytes per retained entry


def test_a_namespace_expires_after_its_last_publish(redis_url, namespace):
    """Namespaces of departed tenants and retired models must not hold Redis memory for ever:
    a publish sets the expiry of all three keys (at most every tenth of the TTL)."""
    client = redis.Redis.from_url(redis_url)
    keys = list(pool_keys(namespace).values())

    async def run():
        store = RedisPool(redis_url, namespace, PoolConfig(redis_url=redis_url, key_ttl_s=100), VOCAB)
        await store.connect()
        assert 0 < client.ttl(keys[2]) <= 100  # meta, before any publish
        await store.publish("a", [[1, 2, 3]])
        assert all(0 < client.ttl(key) <= 100 for key in keys)
        client.persist(keys[0])
        await store.publish("a", [[4, 5, 6]])
        assert client.ttl(keys[0]) == -1  # refreshed 0 s ago: this publish leaves it alone
        await store.connect()  # a reconnect (Redis may have restarted empty) sets it again
        await store.publish("a", [[7, 8, 9]])
        assert 0 < client.ttl(keys[0]) <= 100
        await store.close()

        short = RedisPool(redis_url, namespace + "-short", PoolConfig(redis_url=redis_url, key_ttl_s=1))
        await short.connect()
        await short.publish("a", [[1, 2]])
        assert client.exists(*pool_keys(namespace + "-short").values()) == 3
        await asyncio.sleep(1.5)
        assert client.exists(*pool_keys(namespace + "-short").values()) == 0
        await short.close()

        never = RedisPool(redis_url, namespace + "-kept", PoolConfig(redis_url=redis_url, key_ttl_s=0))
        await never.connect()
        await never.publish("a", [[1, 2]])
        assert [client.ttl(key) for key in pool_keys(namespace + "-kept").values()] == [-1, -1, -1]
        await never.close()
        client.delete(*pool_keys(namespace + "-kept").values())

    asyncio.run(run())


def test_in_memory_pool_bounded(namespace):
    config = PoolConfig(max_stream_len=100)

    async def run():
        store = InMemoryPool(namespace, config, VOCAB)
        for i in range(5000):
            await store.publish("a", [[i % VOCAB, i // VOCAB]])
        batch = await store.read(START_CURSOR, 10_000, 0)
        assert len(batch.entries) == 100
        assert batch.entries[-1].token_ids == [4999 % VOCAB, 4]

    asyncio.run(run())


def test_password_from_the_environment(monkeypatch, namespace):
    """A Redis with requirepass is reached with the password from NASD_REDIS_PASSWORD only."""
    from tests.redis_server import own_redis_server

    server = own_redis_server("--requirepass", "s3cret-test")

    async def connect() -> None:
        store = RedisPool(server.url, namespace, PoolConfig(redis_url=server.url), VOCAB)
        try:
            await store.connect()
            assert await store.publish("a", [[1, 2]]) == 1
        finally:
            await store.close()

    try:
        monkeypatch.delenv("NASD_REDIS_PASSWORD", raising=False)
        with pytest.raises(PoolUnavailableError):
            asyncio.run(connect())
        monkeypatch.setenv("NASD_REDIS_PASSWORD", "s3cret-test")
        asyncio.run(connect())
    finally:
        server.stop()
