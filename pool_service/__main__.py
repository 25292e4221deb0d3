"""``python -m pool_service stats|flush|export``: look after a Redis-backed pool.

    python -m pool_service stats  [--redis-url URL] [--namespace NS]
    python -m pool_service flush  [--redis-url URL] (--namespace NS | --all)
    python -m pool_service export [--redis-url URL] --namespace NS [--output FILE]

The URL defaults to $NASD_REDIS_URL, then redis://127.0.0.1:6379.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import redis
from redis.exceptions import RedisError

from pool_service.redis_pool import KEY_PREFIX, pool_keys
from pool_service.store import START_CURSOR, decode_batch

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
_EXPORT_CHUNK = 1000


def namespaces(client: redis.Redis) -> list[str]:
    """Every namespace with a pool in this Redis (found by its metadata key)."""
    found = []
    for key in client.scan_iter(match=f"{KEY_PREFIX}:{{*}}:meta", count=1000):
        namespace = client.hget(key, "namespace")
        if namespace is not None:
            found.append(namespace.decode(errors="replace"))
    return sorted(found)


def namespace_stats(client: redis.Redis, namespace: str) -> dict[str, object]:
    keys = pool_keys(namespace)
    meta = {k.decode(): v.decode(errors="replace") for k, v in client.hgetall(keys["meta"]).items()}
    memory = sum(client.memory_usage(key) or 0 for key in keys.values())
    return {
        "namespace": namespace,
        "entries": client.xlen(keys["seqs"]),  # each: one publish's new sequences
        "digests": client.zcard(keys["seen"]),
        "memory_bytes": memory,
        "meta": meta,
    }


def iter_entries(client: redis.Redis, namespace: str, counts: dict[str, int]) -> Iterator[dict[str, object]]:
    """Decoded entries of a namespace, oldest first; bad ones are counted in ``counts``."""
    stream, cursor = pool_keys(namespace)["seqs"], START_CURSOR
    while True:
        raw = client.xrange(stream, min=f"({cursor}", count=_EXPORT_CHUNK)
        if not raw:
            return
        batch = decode_batch([(i.decode(), f) for i, f in raw], namespace, None, cursor)
        counts["malformed"] += batch.num_malformed
        counts["foreign"] += batch.num_foreign
        for entry in batch.entries:
            yield {
                "id": entry.entry_id,
                "origin": entry.origin,
                "published_ms": entry.published_ms,
                "token_ids": entry.token_ids,
            }
        cursor = batch.cursor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pool_service", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["stats", "flush", "export"])
    parser.add_argument("--redis-url", default=os.environ.get("NASD_REDIS_URL", DEFAULT_REDIS_URL))
    parser.add_argument("--namespace", help="one pool namespace (default for stats: all of them)")
    parser.add_argument("--all", action="store_true", help="flush: every namespace")
    parser.add_argument("--output", help="export: write JSON lines here instead of stdout")
    args = parser.parse_args(argv)

    # The same password variable the replicas read (a password in the URL wins).
    password = os.environ.get("NASD_REDIS_PASSWORD") or None
    client = redis.Redis.from_url(args.redis_url, password=password, socket_timeout=10)
    try:
        if args.command == "stats":
            chosen = [args.namespace] if args.namespace else namespaces(client)
            print(json.dumps([namespace_stats(client, ns) for ns in chosen], indent=2))
        elif args.command == "flush":
            if not args.namespace and not args.all:
                parser.error("flush needs --namespace NS or --all")
            chosen = namespaces(client) if args.all else [args.namespace]
            deleted = sum(client.delete(*pool_keys(ns).values()) for ns in chosen)
            print(json.dumps({"namespaces": chosen, "keys_deleted": deleted}))
        else:
            if not args.namespace:
                parser.error("export needs --namespace NS")
            counts = {"exported": 0, "malformed": 0, "foreign": 0}
            out = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115 - stdout is not ours
            try:
                for entry in iter_entries(client, args.namespace, counts):
                    out.write(json.dumps(entry) + "\n")
                    counts["exported"] += 1
            finally:
                if out is not sys.stdout:
                    out.close()
            print(json.dumps(counts), file=sys.stderr)
    except RedisError as exc:
        print(f"error: redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
