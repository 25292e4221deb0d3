"""Pool faults under real generation: Redis killed (-9), restarted empty, or stalled mid-run.

The engine runs the real model; the pool runs on a redis-server this test owns. Every
generation must complete with exactly the tokens it would have had without a pool, no
finished sequence may be lost, and sync must come back by itself.
"""

from __future__ import annotations

import asyncio
import threading

import redis

from nasd_core import SamplingParams, SpecConfig, generate
from nasd_core.config import EngineConfig
from nasd_core.engine.async_engine import AsyncEngine
from nasd_core.engine.engine import Engine
from pool_service import PoolConfig, SharedPools
from pool_service.redis_pool import RedisPool
from tests.redis_server import own_redis_server, until

PROMPTS = [
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "Monday, Tuesday, Wednesday,",
    "alpha beta gamma alpha beta gamma alpha",
    "To be, or not to be,",
    "<ul>\n  <li>apple</li>\n  <li>banana</li>\n  <li>",
]
MAX_TOKENS = 20
STALLED_SEQUENCE = [31, 41, 59, 26, 53, 58, 97, 93]


def _namespace_stats(pools: SharedPools) -> dict:
    return pools.stats()["namespaces"][0]


def test_generation_survives_redis_kill_and_sync_resumes(model, tokenizer, namespace):
    expected = [
        generate(model, tokenizer, p, SamplingParams(max_tokens=MAX_TOKENS), SpecConfig(mode="off")).token_ids
        for p in PROMPTS
    ]
    server = own_redis_server()
    async_engine = AsyncEngine(Engine(model, tokenizer, EngineConfig(max_batch_rows=8)))
    async_engine.start()
    config = PoolConfig(redis_url=server.url, backoff_max_s=0.2, socket_timeout_s=0.5, flush_interval_ms=5)
    pools = SharedPools(
        config,
        namespace,
        apply=lambda fn: async_engine.call(lambda engine: fn()),
        origin="replica",
        vocab_size=model.config.vocab_size,
    )
    first_token = asyncio.Event()

    async def serve_one(prompt: str) -> list[int]:
        output: list[int] = []
        prompt_ids = tokenizer(prompt)["input_ids"]
        params = SamplingParams(max_tokens=MAX_TOKENS)
        async for chunk in async_engine.generate(prompt_ids, params, shared=pools.sources_for(None)):
            output += chunk.token_ids
            first_token.set()
        pools.publish(None, prompt_ids + output)
        return output

    async def run() -> None:
        await pools.start()
        assert _namespace_stats(pools)["state"] == "connected"
        # Phase 1: Redis dies (kill -9) while three requests are decoding.
        in_flight = [asyncio.create_task(serve_one(p)) for p in PROMPTS[:3]]
        await first_token.wait()
        server.kill()
        outputs = await asyncio.gather(*in_flight)
        # Phase 2: requests start and finish while Redis is down.
        outputs += await asyncio.gather(*(serve_one(p) for p in PROMPTS[3:]))
        assert outputs == expected, "a generation changed or failed because of the pool"
        assert await until(lambda: _namespace_stats(pools)["state"] == "down", 10)
        assert _namespace_stats(pools)["pending"] >= 3  # kept, not lost
        # Phase 3: Redis comes back empty on the same port; sync resumes by itself and
        # publishes everything finished meanwhile.
        server.start("--enable-debug-command", "yes")
        assert await until(lambda: _namespace_stats(pools)["pending"] == 0, 10), _namespace_stats(pools)
        client = redis.Redis.from_url(server.url)
        published = [tuple(e.token_ids) for e in (await _read_all(server.url, namespace))]
        finished = {tuple(tokenizer(p)["input_ids"] + out) for p, out in zip(PROMPTS, expected)}
        assert sorted(published) == sorted(finished)  # every one, once
        # Another replica's sequence after the restart reaches this replica's pool index.
        writer = RedisPool(server.url, namespace, config)
        await writer.publish("other", [[7, 8, 9, 10, 11, 12]])
        await writer.close()
        pool_index = pools.sources_for(None)[1][1]
        assert await until(lambda: pool_index.propose([7, 8, 9], 3)[0] == [10, 11, 12], 5)
        assert _namespace_stats(pools)["state"] == "connected"

        # Phase 4: Redis stalls (DEBUG SLEEP) longer than the socket timeout while a request runs.
        # A publish sent into the stall fails on its timeout, and goes out once the pool is back
        # with no other publish to wake the writer.
        stall = threading.Thread(target=lambda: client.execute_command("DEBUG", "SLEEP", "1.5"))
        stall.start()
        await asyncio.sleep(0.1)
        pools.publish(None, STALLED_SEQUENCE)
        assert await serve_one(PROMPTS[0]) == expected[0]
        stall.join()
        assert await until(lambda: _namespace_stats(pools)["state"] == "connected", 10)
        assert await until(lambda: _namespace_stats(pools)["pending"] == 0, 10), _namespace_stats(pools)
        published = [tuple(e.token_ids) for e in (await _read_all(server.url, namespace))]
        assert published.count(tuple(STALLED_SEQUENCE)) == 1
        await pools.stop()

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()
        server.stop()


async def _read_all(url: str, namespace: str):
    store = RedisPool(url, namespace)
    batch = await store.read("0-0", 10_000, 0)
    await store.close()
    return batch.entries
