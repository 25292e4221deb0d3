"""Redis fixtures of the pool tests: the machine's server, or a server the test owns."""

from __future__ import annotations

import time

import pytest
import redis

from tests.redis_server import MACHINE_REDIS_URL, is_up, own_redis_server, require


@pytest.fixture
def namespace(request) -> str:
    return f"test-{request.node.name[:40]}-{time.time_ns()}"


@pytest.fixture
def redis_url(namespace):
    """The machine's Redis; the test's namespace is deleted afterwards."""
    require(is_up(MACHINE_REDIS_URL), f"no Redis at {MACHINE_REDIS_URL}")
    yield MACHINE_REDIS_URL
    client = redis.Redis.from_url(MACHINE_REDIS_URL)
    for key in client.scan_iter(match=f"nasd:{{{namespace}*"):
        client.delete(key)


@pytest.fixture
def own_redis():
    """A redis-server of this test's own, on a free port."""
    server = own_redis_server()
    yield server
    server.stop()
