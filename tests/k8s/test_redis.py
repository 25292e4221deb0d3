"""Redis for the pool: config, Deployment, Service and NetworkPolicy agree, and the committed
redis.conf and start command really run (a local redis-server started the container's way)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from pool_service.local_redis import LocalRedis, free_port, is_up
from tests.k8s.manifests import containers, find, mutated
from tests.k8s.redis_checks import redis_conf, redis_problems
from tests.redis_server import require

CONF_MOUNT = "/usr/local/etc/redis/redis.conf"
START_TIMEOUT_S = 10


def test_redis_objects_agree(manifests):
    assert redis_problems(manifests) == []
    conf = redis_conf(manifests)
    assert (conf["maxmemory"], conf["maxmemory-policy"]) == ("1gb", "allkeys-lru")


def _redis_pod(doc):
    return doc["spec"]["template"]


def _ray_worker_labels(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]


def _policy_peer(doc):
    return doc["spec"]["ingress"][0]["from"][0]


@pytest.mark.parametrize(
    ("kind", "change", "expected"),
    [
        ("ConfigMap", lambda d: d["data"].update({"redis.conf": "maxmemory 1gb\n"}), "allkeys-lru"),
        (
            "ConfigMap",
            lambda d: d["data"].update({"redis.conf": "maxmemory-policy allkeys-lru\n"}),
            "maxmemory must bound",
        ),
        (
            "ConfigMap",
            lambda d: d["data"].update({"redis.conf": d["data"]["redis.conf"] + "maxmemory 2gb\n"}),
            "must stay below the memory limit",
        ),
        (
            "Service",
            lambda d: d["spec"].update(selector={"app.kubernetes.io/name": "redis"}),
            "Service selector",
        ),
        ("Service", lambda d: d["spec"]["ports"][0].update(targetPort="db"), "targetPort 'db'"),
        (
            "Deployment",
            lambda d: _redis_pod(d)["spec"]["volumes"][0]["configMap"].update(name="redis-config"),
            "mounts ConfigMaps ['redis-config']",
        ),
        (
            "Deployment",
            lambda d: _redis_pod(d)["metadata"]["labels"].update({"app.kubernetes.io/name": "cache"}),
            "selector does not match its pod labels",
        ),
        # An empty podSelector would fence in every pod of the namespace, Ray's included.
        (
            "NetworkPolicy",
            lambda d: d["spec"]["podSelector"].clear(),
            "also selects Ray pods of group 'head'",
        ),
        (
            "NetworkPolicy",
            lambda d: d["spec"]["ingress"][0]["ports"][0].update(port=6380),
            "opens ports [6380]",
        ),
        (
            "NetworkPolicy",
            lambda d: _policy_peer(d)["podSelector"].pop("matchExpressions"),
            "not limited to Ray pods",
        ),
        ("NetworkPolicy", lambda d: _policy_peer(d).update(namespaceSelector={}), "not limited to Ray pods"),
        (
            "RayService",
            lambda d: _ray_worker_labels(d).pop("app.kubernetes.io/part-of"),
            "keeps Ray pods of group 'gpu-workers' away from Redis",
        ),
    ],
)
def test_redis_check_catches(manifests, kind, change, expected):
    problems = redis_problems(mutated(manifests, kind, change))
    assert any(expected in problem for problem in problems), problems


def _start_script(manifests) -> str:
    (container,) = containers(find(manifests, "Deployment")["spec"])
    command = [*container.get("command", []), *container.get("args", [])]
    assert command[:2] == ["sh", "-c"], command
    return command[2]


@contextmanager
def _redis_started_like_the_pod(manifests, tmp_path: Path, password: str | None) -> Iterator[str]:
    """Run the container's start command with the ConfigMap's redis.conf, on loopback and a free
    port (extra arguments override the file, as they do in redis-server)."""
    require(LocalRedis.available(), "redis-server is not installed")
    conf = tmp_path / "redis.conf"
    conf.write_text(find(manifests, "ConfigMap")["data"]["redis.conf"])
    script = _start_script(manifests)
    assert CONF_MOUNT in script
    port = free_port()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"} | ({"REDIS_PASSWORD": password} if password else {})
    extra = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    process = subprocess.Popen(
        ["sh", "-c", script.replace(CONF_MOUNT, str(conf)), "sh", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    auth = f":{password}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not is_up(url):
            assert process.poll() is None, "redis-server rejected the committed redis.conf"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_committed_config_runs_with_its_limits(manifests, tmp_path):
    with _redis_started_like_the_pod(manifests, tmp_path, password=None) as url:
        client = redis.Redis.from_url(url, decode_responses=True)
        settings = client.config_get("*")
        assert settings["maxmemory"] == str(2**30)
        assert settings["maxmemory-policy"] == "allkeys-lru"
        assert (settings["save"], settings["appendonly"]) == ("", "no")
        assert settings["lazyfree-lazy-eviction"] == "yes"
        assert settings["requirepass"] == ""


def test_password_from_the_secret_is_required(manifests, tmp_path):
    password = "test-only-password"
    with _redis_started_like_the_pod(manifests, tmp_path, password=password) as url:
        open_url = url.replace(f":{password}@", "")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(open_url).ping()
        assert redis.Redis.from_url(url).ping()
        # The readiness probe, pointed at this server, passes only with REDISCLI_AUTH set.
        probe = find(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        command = probe["exec"]["command"]
        port = url.rsplit(":", 1)[1]
        command = [*command[:-1], command[-1].replace("redis-cli", f"redis-cli -p {port}")]
        base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
        assert subprocess.run(command, env=base_env | {"REDISCLI_AUTH": password}).returncode == 0
        assert subprocess.run(command, env=base_env).returncode != 0


def test_a_broken_config_is_noticed(manifests, tmp_path):
    broken = mutated(
        manifests,
        "ConfigMap",
        lambda d: d["data"].update({"redis.conf": d["data"]["redis.conf"] + "maxmemory-polcy lru\n"}),
    )
    with (
        pytest.raises(AssertionError, match=r"rejected the committed redis\.conf"),
        _redis_started_like_the_pod(broken, tmp_path, password=None),
    ):
        pass
