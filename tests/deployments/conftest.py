"""A real Ray Serve instance on loopback for the service tests: one per ``pytest`` run
(``serve_session``), each module's applications deployed on it once and shared by its tests."""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import time
import urllib.request
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import ray
from ray import serve

from deployments import build_app
from pool_service.local_redis import LocalRedis
from tests.redis_server import own_redis_server


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


# The logical CPUs of the tests' Ray: the pool modules' three apps (four one-CPU replicas) are
# deployed together; the physical cores are the machine's two either way.
SESSION_CPUS = 4
# The server's defaults (the embedded model on its GGUF blocks) on both cores, shared by the
# modules that ask for it (test_ingress and test_lm_eval).
DEFAULT_APP = {"num_cpus_per_replica": 2}


class ServeSession:
    """One local Ray and Serve for the whole ``pytest`` run (starting them costs ~15 s on 2
    cores, and each application ~10 s more). Modules deploy their applications through
    ``deploy``; a set equal to the one deployed is shared as it is, any other replaces it."""

    running: ServeSession | None = None

    def __init__(self) -> None:
        self.metrics_port = server_port()
        ray.init(
            address="local",
            num_cpus=SESSION_CPUS,
            include_dashboard=False,
            _metrics_export_port=self.metrics_port,
            # Ray pushes metrics to its exporter every 10 s by default; tests wait for them.
            _system_config={"metrics_report_interval_ms": 1000},
        )
        self.port = server_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        except BaseException:
            ray.shutdown()
            raise
        self.deployed: dict[str, dict[str, Any]] = {}
        ServeSession.running = self

    def deploy(self, apps: dict[str, dict[str, Any]]) -> dict[str, ServedApp]:
        """One application per ``name: build_app args`` (a single app at "/", several at
        "/name"), deployed in parallel unless exactly these are deployed already."""
        assert ServeSession.running is self, "the tests' Ray was stopped: no module after it may deploy"
        prefixes = {name: "/" if len(apps) == 1 else f"/{name}" for name in apps}
        if apps != self.deployed:
            self.clear()
            serve.run_many(
                [
                    serve.RunTarget(build_app(args), name=name, route_prefix=prefixes[name])
                    for name, args in apps.items()
                ]
            )
            self.deployed = dict(apps)
        return {
            name: ServedApp(
                f"http://127.0.0.1:{self.port}{prefix.rstrip('/')}",
                f"http://127.0.0.1:{self.metrics_port}/metrics",
            )
            for name, prefix in prefixes.items()
        }

    def clear(self) -> None:
        """Delete the deployed applications (their replicas stop)."""
        if ServeSession.running is not self:
            return
        for name in self.deployed:
            serve.delete(name)
        self.deployed = {}

    def shutdown(self) -> None:
        if ServeSession.running is self:
            ServeSession.running = None
            self.deployed = {}
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_session() -> Iterator[ServeSession]:
    session = ServeSession()
    try:
        yield session
    finally:
        session.shutdown()


@pytest.fixture(scope="module", autouse=True)
def stop_serve_after_its_last_module(request):
    """Stop the tests' Ray once no module left in the run asks for it: the modules after it
    (in-process servers, `serve run` in a subprocess) get the cores to themselves."""
    yield
    items = request.session.items
    last = max(index for index, item in enumerate(items) if item.module is request.module)
    session = ServeSession.running
    if session and not any("serve_session" in item.fixturenames for item in items[last + 1 :]):
        session.shutdown()


@dataclass
class PoolApps:
    """The apps on a Redis pool (``redis_url``): ``a`` and ``b`` (one replica each, one shared
    namespace) and ``p`` (two replicas, ``POOL_PARTITIONS`` partitions, its own namespace)."""

    apps: dict[str, ServedApp]
    shared_namespace: str
    partitioned_namespace: str
    redis_url: str


POOL_PARTITIONS = 8


@pytest.fixture(scope="session")
def pool_redis() -> Iterator[LocalRedis]:
    """The pool apps' Redis: a redis-server of the suite's own, which test_pool_redis_outage stops."""
    server = own_redis_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pool_apps(serve_session, pool_redis) -> PoolApps:
    """test_multi_replica's, test_partitions' and test_pool_redis_outage's apps, deployed together (four
    one-CPU replicas on the session's logical CPUs): later modules find them deployed by the first."""
    shared, partitioned = "test-deployments", "test-partitions"
    pooled = {"redis_url": pool_redis.url, "num_cpus_per_replica": 1}
    replica_args = {**pooled, "pool_namespace": shared}
    partitioned_args = {
        **pooled,
        "pool_namespace": partitioned,
        "pool_partitions": POOL_PARTITIONS,
        "num_replicas": 2,
    }
    apps = serve_session.deploy({"a": replica_args, "b": replica_args, "p": partitioned_args})
    return PoolApps(apps, shared, partitioned, pool_redis.url)


def scrape(
    url: str, tags: Sequence[str] = (), only: Mapping[str, Collection[str]] | None = None
) -> dict[str, float]:
    """This project's Prometheus samples (``ray_nasd_*``) summed by metric name and the values of
    ``tags``, keyed ``name[tag=value]...`` in the order of ``tags``; with ``only``, just the
    samples whose every named tag has one of the values given (the session's Ray keeps the
    series of earlier modules' replicas)."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    totals: dict[str, float] = {}
    for line in body.splitlines():
        if not line.startswith("ray_nasd_"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name, _, labels = name_and_labels.partition("{")
        values = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if only and any(values.get(tag) not in allowed for tag, allowed in only.items()):
            continue
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
    url: str,
    expected: dict[str, float],
    tags: Sequence[str] = (),
    timeout_s: float = 45.0,
    only: Mapping[str, Collection[str]] | None = None,
) -> dict[str, float]:
    """Scrape until every ``expected`` sample has its value (Ray exports metrics every second or
    so); the samples then. Fails with what was seen if they never do."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url, tags, only)
        seen = {name: samples.get(name) for name in expected}
        if seen == expected:
            return samples
        assert time.monotonic() < deadline, f"metrics {seen} never matched {expected}"
        time.sleep(1)
