"""``python -m pool_service stats|flush|export`` against the machine's Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import redis

from pool_service.codec import encode_entry, pack_tokens
from pool_service.redis_pool import RedisPool, pool_keys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pool_service", *args], capture_output=True, text=True, timeout=60
    )


def test_stats_export_flush(redis_url, namespace, tmp_path):
    async def fill():
        store = RedisPool(redis_url, namespace)
        await store.connect()
        await store.publish("replica-a", [[1, 2, 3], [4, 5]])
        await store.close()

    asyncio.run(fill())
    redis.Redis.from_url(redis_url).xadd(
        pool_keys(namespace)["seqs"], encode_entry("x", "y", [pack_tokens([1])], [0])
    )

    stats = _cli("stats", "--redis-url", redis_url, "--namespace", namespace)
    assert stats.returncode == 0, stats.stderr
    (entry,) = json.loads(stats.stdout)
    assert (entry["entries"], entry["digests"], entry["meta"]["schema_version"]) == (2, 2, "1")
    everything = json.loads(_cli("stats", "--redis-url", redis_url).stdout)
    assert namespace in {item["namespace"] for item in everything}

    out = tmp_path / "pool.jsonl"
    export = _cli("export", "--redis-url", redis_url, "--namespace", namespace, "--output", str(out))
    assert export.returncode == 0, export.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["origin"], row["token_ids"]) for row in rows] == [
        ("replica-a", [1, 2, 3]),
        ("replica-a", [4, 5]),
    ]
    assert json.loads(export.stderr) == {"exported": 2, "malformed": 0, "foreign": 1}

    flush = _cli("flush", "--redis-url", redis_url, "--namespace", namespace)
    assert json.loads(flush.stdout)["keys_deleted"] == 3
    assert redis.Redis.from_url(redis_url).exists(*pool_keys(namespace).values()) == 0


def test_cli_errors_are_clear():
    unreachable = _cli("stats", "--redis-url", "redis://127.0.0.1:1")
    assert unreachable.returncode == 1 and "error: redis at redis://127.0.0.1:1" in unreachable.stderr
    no_target = _cli("flush")
    assert no_target.returncode == 2 and "--namespace NS or --all" in no_target.stderr
