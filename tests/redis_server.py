"""Real Redis servers for tests: the machine's at 127.0.0.1:6379, or one a test owns.

Outside CI a missing server skips the test with a loud reason; in CI (CI=true) it fails,
because CI is where these tests must run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import redis

MACHINE_REDIS_URL = os.environ.get("NASD_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def require(condition: bool, reason: str) -> None:
    """Skip (outside CI) or fail (in CI) when a real server the test needs is missing."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test, but: {reason}")
    pytest.skip(f"!!! SKIPPED: {reason} !!!")


def is_up(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server process of the test's own on a free port, that it may kill and restart."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, *extra: str) -> RedisServer:
        binary = shutil.which("redis-server")
        require(binary is not None, "redis-server is not installed")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not is_up(self.url):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """kill -9: no shutdown, no goodbye to clients."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None
