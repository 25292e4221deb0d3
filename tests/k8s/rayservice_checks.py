"""Checks of the RayService beyond its CRD schema: KubeRay's and Ray's rules, and
serveConfigV2 resolved against this repo (what Serve would do on the cluster)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from tests.k8s.manifests import (
    CLUSTER_DOMAIN,
    DNS1035_LABEL,
    GPU,
    HEAD_PORTS,
    IMPORT_PATH,
    MAX_RAYSERVICE_NAME_LEN,
    Manifest,
    env_by_name,
    find,
)


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    """serveConfigV2 parsed: it is a YAML string inside the manifest."""
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def cpu_cores(quantity: str | float) -> float:
    """A Kubernetes CPU quantity ("500m", "4", 2) in cores."""
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def rayservice_problems(rayservice: dict[str, Any]) -> list[str]:
    """What KubeRay's validation, the scheduler and Ray would reject or get wrong."""
    problems = []
    name = rayservice["metadata"]["name"]
    if len(name) > MAX_RAYSERVICE_NAME_LEN or not DNS1035_LABEL.match(name):
        problems.append(
            f"name {name!r}: KubeRay needs a DNS-1035 label of <= {MAX_RAYSERVICE_NAME_LEN} chars"
        )
    cluster = rayservice["spec"]["rayClusterConfig"]
    if cluster.get("rayVersion") != ray.__version__:
        problems.append(f"rayVersion {cluster.get('rayVersion')!r} != installed Ray {ray.__version__}")
    serve_port = ServeDeploySchema.model_validate(serve_config(rayservice)).http_options.port
    head = cluster["headGroupSpec"]
    problems += _head_problems(head, serve_port)
    images = {head["template"]["spec"]["containers"][0]["image"]}
    for group in cluster.get("workerGroupSpecs", []):
        problems += _worker_problems(group, serve_port)
        images.add(group["template"]["spec"]["containers"][0]["image"])
    if len(images) != 1:
        problems.append(f"head and workers must run one image (Ray versions must match): {sorted(images)}")
    problems += api_key_problems(rayservice)
    return problems


def api_key_problems(rayservice: dict[str, Any]) -> list[str]:
    """No API key written in the manifest, and the key file, where the app reads one, mounted
    read-only from a required Secret on every pod the ingress may run on (head and workers)."""
    problems = []
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster.get("workerGroupSpecs", [])
    ]
    for template in templates:
        for container in template["spec"]["containers"]:
            if "value" in env_by_name(container).get("NASD_API_KEY", {}):
                problems.append(f"container {container['name']!r}: NASD_API_KEY must come from a Secret")
    for application in serve_config(rayservice)["applications"]:
        args = application.get("args", {})
        if "api_key" in args:
            problems.append(f"application {application['name']!r}: an api_key arg puts a key in the manifest")
        keys_file = args.get("api_keys_file")
        if not keys_file:
            continue
        directory = keys_file.rsplit("/", 1)[0]
        for template in templates:
            spec = template["spec"]
            container = spec["containers"][0]
            mounts = {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}
            mount = mounts.get(directory)
            volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
            secret = volumes.get(mount["name"], {}).get("secret") if mount else None
            if not mount or not secret or not mount.get("readOnly"):
                problems.append(
                    f"container {container['name']!r}: {directory} must be a read-only mount of a Secret "
                    "(api_keys_file)"
                )
            elif secret.get("optional"):
                problems.append(
                    f"container {container['name']!r}: the API key Secret must not be optional (fail closed)"
                )
    return problems


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {port.get("name"): port["containerPort"] for port in container.get("ports", [])}


def _head_problems(head: dict[str, Any], serve_port: int) -> list[str]:
    problems = []
    for param in ("num-cpus", "num-gpus"):
        if head["rayStartParams"].get(param) != "0":
            problems.append(f"head rayStartParams.{param} must be '0': no replica may land on the head")
    ports = _ports(head["template"]["spec"]["containers"][0])
    for port_name, number in {**HEAD_PORTS, "serve": serve_port}.items():
        if ports.get(port_name) != number:
            problems.append(f"head container port {port_name!r} must be {number}")
    return problems


def _worker_problems(group: dict[str, Any], serve_port: int) -> list[str]:
    problems = []
    label = f"worker group {group.get('groupName')!r}"
    if not group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]:
        problems.append(f"{label}: needs minReplicas <= replicas <= maxReplicas")
    container = group["template"]["spec"]["containers"][0]
    limits = container.get("resources", {}).get("limits", {})
    requests = container.get("resources", {}).get("requests", {})
    gpus = str(limits.get(GPU, "0"))
    if group["rayStartParams"].get("num-gpus") != gpus:
        problems.append(f"{label}: rayStartParams.num-gpus must equal the {GPU} limit ({gpus})")
    if GPU in requests and str(requests[GPU]) != gpus:
        problems.append(f"{label}: {GPU} request must equal its limit (an extended resource)")
    tolerated = {t.get("key") for t in group["template"]["spec"].get("tolerations", [])}
    if gpus != "0" and GPU not in tolerated:
        problems.append(f"{label}: GPU pods need a toleration for the {GPU} taint")
    # KubeRay's injected readiness probe checks the Serve proxy on the port named "serve".
    if _ports(container).get("serve", serve_port) != serve_port:
        problems.append(f"{label}: port 'serve' must be Serve's HTTP port {serve_port}")
    token = env_by_name(container).get("HUGGING_FACE_HUB_TOKEN", {})
    ref = token.get("valueFrom", {}).get("secretKeyRef", {})
    if ref.get("optional") is not True:
        problems.append(f"{label}: HUGGING_FACE_HUB_TOKEN must come from an optional secretKeyRef")
    return problems


def build_serve_app(application: dict[str, Any]) -> list[dict[str, Any]]:
    """Resolve one serveConfigV2 application as Serve does on the cluster (import the
    builder, validate the args, build the deployment graph) and return its deployments'
    options as `serve build` writes them. Builds the graph only: no model is loaded and Ray
    is not started."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.deployment import deployment_to_schema

    builder = import_attr(application["import_path"])
    app = call_user_app_builder_with_args_if_necessary(builder, application.get("args", {}))
    built = build_app(app, name=application["name"])
    return [deployment_to_schema(d).model_dump(exclude_unset=True) for d in built.deployments]


def serve_config_problems(manifests: list[Manifest]) -> list[str]:
    """serveConfigV2 is valid for Ray Serve, its application builds from this repo with its
    args, its replicas fit the GPU worker groups and its redis_url names the Redis Service."""
    rayservice = find(manifests, "RayService")
    config = serve_config(rayservice)
    try:
        ServeDeploySchema.model_validate(config)
    except ValueError as error:
        return [f"serveConfigV2 is not a valid Serve config: {error}"]
    problems = []
    groups = rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])
    for application in config["applications"]:
        if application["import_path"] != IMPORT_PATH:
            problems.append(f"import_path {application['import_path']!r} != {IMPORT_PATH!r}")
        try:
            deployments = build_serve_app(application)
        except Exception as error:  # what Serve would report as DEPLOY_FAILED
            problems.append(f"application {application['name']!r} does not build: {error}")
            continue
        names = {deployment["name"] for deployment in deployments}
        for override in application.get("deployments", []):
            if override["name"] not in names:
                problems.append(
                    f"override for unknown deployment {override['name']!r} (have {sorted(names)})"
                )
        for deployment in deployments:
            problems += capacity_problems(deployment, groups)
        redis_url = application.get("args", {}).get("redis_url")
        if redis_url:
            problems += redis_url_problems(redis_url, find(manifests, "Service"))
    return problems


def capacity_problems(deployment: dict[str, Any], groups: list[dict[str, Any]]) -> list[str]:
    """A GPU deployment's replicas (its autoscaling maximum) fit the worker groups at maxReplicas."""
    options = deployment.get("ray_actor_options", {})
    gpus, cpus = float(options.get("num_gpus", 0)), float(options.get("num_cpus", 1))
    if gpus == 0:
        return []
    autoscaling = deployment.get("autoscaling_config")
    wanted = autoscaling["max_replicas"] if autoscaling else deployment.get("num_replicas", 1)
    capacity = 0
    for group in groups:
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        pod_gpus = float(group["rayStartParams"].get("num-gpus", limits.get(GPU, 0)))
        pod_cpus = cpu_cores(group["rayStartParams"].get("num-cpus", limits.get("cpu", 0)))
        per_pod = int(pod_gpus // gpus)
        if cpus > 0:
            per_pod = min(per_pod, int(pod_cpus // cpus))
        capacity += per_pod * group["maxReplicas"]
    if capacity < wanted:
        return [
            f"deployment {deployment['name']}: {wanted} replicas of {gpus:g} GPU + {cpus:g} CPU fit "
            f"only {capacity} times in the worker groups at maxReplicas"
        ]
    return []


def redis_url_problems(redis_url: str, service: dict[str, Any]) -> list[str]:
    url = urlsplit(redis_url)
    meta = service["metadata"]
    host = f"{meta['name']}.{meta['namespace']}.{CLUSTER_DOMAIN}"
    ports = [port["port"] for port in service["spec"]["ports"]]
    problems = []
    if url.scheme not in ("redis", "rediss"):
        problems.append(f"redis_url scheme {url.scheme!r} is not redis:// or rediss://")
    if url.hostname != host:
        problems.append(f"redis_url host {url.hostname!r} is not the Redis Service {host!r}")
    if url.port not in ports:
        problems.append(f"redis_url port {url.port} is not a port of the Redis Service {ports}")
    if url.password:
        problems.append("redis_url carries a password: it would be committed in the manifest")
    return problems
