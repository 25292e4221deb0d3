"""A real Ray Serve instance on loopback for the service tests: one per test module.

Starting Ray and Serve costs ~15 s on 2 cores and every application ~10 s more, so each
module starts the applications it needs once (``serve_apps``) and shares them.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import ray
from ray import serve

from deployments import build_app


@dataclass
class RawResponse:
    status: int
    body: Any  # parsed JSON, or the text when it is not JSON
    headers: dict[str, str] | None = None  # lower-cased names


@dataclass
class ServedApp:
    """One application's base URL and an OpenAI client for it."""

    base_url: str  # http://127.0.0.1:PORT/prefix
    metrics_url: str | None = None  # the local Ray node's Prometheus endpoint

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        # No retries: a retried request would hide exactly the failures these tests look for.
        return openai.OpenAI(base_url=self.api_url, api_key=api_key, max_retries=0, timeout=120)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.api_url, api_key=api_key, max_retries=0, timeout=300)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | list | None = None,
        headers: dict[str, str] | None = None,
    ) -> RawResponse:
        """A raw HTTP call (bodies the OpenAI client would refuse to send, such as broken JSON)."""
        host_port, _, prefix = self.base_url.removeprefix("http://").partition("/")
        host, port = host_port.split(":")
        payload = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            sent = {"Content-Type": "application/json"} if payload is not None else {}
            sent.update(headers or {})
            connection.request(method, f"/{prefix}{path}".replace("//", "/"), body=payload, headers=sent)
            response = connection.getresponse()
            text = response.read().decode()
            received = {name.lower(): value for name, value in response.getheaders()}
        finally:
            connection.close()
        try:
            return RawResponse(response.status, json.loads(text), received)
        except json.JSONDecodeError:
            return RawResponse(response.status, text, received)


def server_port() -> int:
    """A free loopback port for a server a test starts, from below the kernel's ephemeral range
    and above Ray's worker ports (10002-19999). Ray's own processes bind random ephemeral ports
    as they start: a port taken from that range (bind to 0, then released) was once handed to
    one of them before the test's server bound it, and the test read that process's bytes."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral_low = int(ports.read().split()[0])
    for port in random.sample(range(20000, max(20001, ephemeral_low)), 64):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port between 20000 and the ephemeral range")


@contextmanager
def serve_apps(apps: dict[str, dict[str, Any]], num_cpus: int = 2) -> Iterator[dict[str, ServedApp]]:
    """Start a local Ray with ``num_cpus`` logical CPUs, Serve on a free loopback port, and one
    application per ``name: build_app args`` (a single app at "/", several at "/name"),
    deployed in parallel; shut everything down afterwards."""
    metrics_port = server_port()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        # Ray pushes metrics to its exporter every 10 s by default; tests wait for them.
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        port = server_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        prefixes = {name: "/" if len(apps) == 1 else f"/{name}" for name in apps}
        serve.run_many(
            [
                serve.RunTarget(build_app(args), name=name, route_prefix=prefixes[name])
                for name, args in apps.items()
            ]
        )
        yield {
            name: ServedApp(
                f"http://127.0.0.1:{port}{prefix.rstrip('/')}", f"http://127.0.0.1:{metrics_port}/metrics"
            )
            for name, prefix in prefixes.items()
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def scrape(url: str, tags: Sequence[str] = ()) -> dict[str, float]:
    """This project's Prometheus samples (``ray_nasd_*``) summed by metric name and the values of
    ``tags``, keyed ``name[tag=value]...`` in the order of ``tags``."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    totals: dict[str, float] = {}
    for line in body.splitlines():
        if not line.startswith("ray_nasd_"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name, _, labels = name_and_labels.partition("{")
        values = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = name + "".join(f"[{tag}={values[tag]}]" for tag in tags if tag in values)
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def wait_for(condition, timeout_s: float, what: str):
    """``condition()``'s first truthy value, polled until ``timeout_s``; fails the test after."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def wait_for_samples(
    url: str, expected: dict[str, float], tags: Sequence[str] = (), timeout_s: float = 45.0
) -> dict[str, float]:
    """Scrape until every ``expected`` sample has its value (Ray exports metrics every second or
    so); the samples then. Fails with what was seen if they never do."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url, tags)
        seen = {name: samples.get(name) for name in expected}
        if seen == expected:
            return samples
        assert time.monotonic() < deadline, f"metrics {seen} never matched {expected}"
        time.sleep(1)
