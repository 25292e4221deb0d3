"""Checks that the Redis ConfigMap, Deployment, Service and NetworkPolicy agree with each
other and with the Ray pods that must reach Redis."""

from __future__ import annotations

import re

from tests.k8s.manifests import (
    RAY_CLUSTER_LABEL,
    Manifest,
    containers,
    find,
    selector_matches,
)


def redis_conf(manifests: list[Manifest]) -> dict[str, str]:
    """The Redis ConfigMap's redis.conf as directive -> value (last one wins, as in Redis)."""
    text = find(manifests, "ConfigMap")["data"]["redis.conf"]
    directives = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            directives[key.lower()] = value.strip()
    return directives


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("1536Mi", "8Gi", "1G") in bytes."""
    units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity)).groups()
    return int(number) * units[unit]


def redis_bytes(size: str) -> int:
    """A redis.conf size ("1gb", "100mb", "1g") in bytes: kb/mb/gb are powers of 1024, k/m/g of 1000."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    number, unit = re.fullmatch(r"(\d+)([a-z]*)", size.strip().lower()).groups()
    return int(number) * units[unit]


def redis_problems(manifests: list[Manifest]) -> list[str]:
    """Redis config, Deployment, Service and NetworkPolicy agree with each other and with
    the Ray pods that must reach Redis."""
    problems = []
    conf = redis_conf(manifests)
    deployment = find(manifests, "Deployment")
    (container,) = containers(deployment["spec"])
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    if conf.get("maxmemory-policy") != "allkeys-lru":
        problems.append("redis.conf: maxmemory-policy must be allkeys-lru (noeviction fails publishes)")
    if "maxmemory" not in conf or redis_bytes(conf["maxmemory"]) == 0:
        problems.append("redis.conf: maxmemory must bound the pool")
    elif limit is None or redis_bytes(conf["maxmemory"]) >= memory_bytes(limit):
        problems.append(f"redis.conf: maxmemory {conf['maxmemory']} must stay below the memory limit {limit}")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    if not selector_matches(deployment["spec"]["selector"], pod_labels):
        problems.append("Redis Deployment selector does not match its pod labels")
    container_ports = {port.get("name"): port["containerPort"] for port in container.get("ports", [])}
    service = find(manifests, "Service")
    if not selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels):
        problems.append("Redis Service selector does not match the Redis pods")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if target not in container_ports and target not in container_ports.values():
            problems.append(f"Redis Service targetPort {target!r} is not a Redis container port")
    config_maps = {
        volume["configMap"]["name"]
        for volume in deployment["spec"]["template"]["spec"].get("volumes", [])
        if "configMap" in volume
    }
    if config_maps != {find(manifests, "ConfigMap")["metadata"]["name"]}:
        problems.append(f"Redis Deployment mounts ConfigMaps {sorted(config_maps)}, not the Redis ConfigMap")
    problems += _network_policy_problems(manifests, pod_labels, container_ports)
    return problems


def _network_policy_problems(
    manifests: list[Manifest], redis_labels: dict[str, str], redis_ports: dict[str, int]
) -> list[str]:
    policy = find(manifests, "NetworkPolicy")["spec"]
    problems = []
    if not selector_matches(policy["podSelector"], redis_labels):
        problems.append("NetworkPolicy does not select the Redis pods")
    if "Ingress" not in policy.get("policyTypes", ["Ingress"]):
        problems.append("NetworkPolicy does not restrict ingress")
    peers = [peer for rule in policy.get("ingress", []) for peer in rule.get("from", [])]
    ports = {port.get("port") for rule in policy.get("ingress", []) for port in rule.get("ports", [])}
    if not set(redis_ports.values()) <= ports and not set(redis_ports) <= ports:
        problems.append(f"NetworkPolicy opens ports {sorted(ports, key=str)}, not Redis' {redis_ports}")
    for peer in peers:
        keys = {e["key"] for e in peer.get("podSelector", {}).get("matchExpressions", [])}
        keys |= set(peer.get("podSelector", {}).get("matchLabels", {}))
        if "podSelector" not in peer or RAY_CLUSTER_LABEL not in keys or set(peer) - {"podSelector"}:
            problems.append(f"NetworkPolicy peer {peer} is not limited to Ray pods ({RAY_CLUSTER_LABEL})")
    cluster = find(manifests, "RayService")["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates |= {group["groupName"]: group["template"] for group in cluster.get("workerGroupSpecs", [])}
    for group_name, template in templates.items():
        # KubeRay adds ray.io/cluster itself; the template provides the rest.
        labels = {**template.get("metadata", {}).get("labels", {}), RAY_CLUSTER_LABEL: "nasd-xxxxx"}
        if not any(selector_matches(peer.get("podSelector", {}), labels) for peer in peers):
            problems.append(f"NetworkPolicy keeps Ray pods of group {group_name!r} away from Redis")
        if selector_matches(policy["podSelector"], labels):
            problems.append(f"NetworkPolicy also selects Ray pods of group {group_name!r}, cutting them off")
    return problems
