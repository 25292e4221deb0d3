"""A throwaway redis-server on a free port, for tests and benchmarks that must own (and may
kill and restart) their Redis. Needs the ``redis-server`` binary on PATH."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_up(url: str) -> bool:
    """Whether a Redis server answers at ``url`` (one that demands a password counts)."""
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except (redis.AuthenticationError, redis.ResponseError):
        return True
    except redis.RedisError:
        return False


class LocalRedis:
    """A redis-server process of our own on a free port, keeping nothing on disk."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, *extra_args: str) -> LocalRedis:
        """Start (or restart, on the same port) and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        command = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.process = subprocess.Popen(
            [*command, *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
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

    def commands_processed(self) -> int:
        """Commands this server has processed since it started (INFO stats)."""
        return int(redis.Redis.from_url(self.url).info("stats")["total_commands_processed"])

    def net_output_bytes(self) -> int:
        """Bytes this server has sent to its clients since it started (INFO stats)."""
        return int(redis.Redis.from_url(self.url).info("stats")["total_net_output_bytes"])
