"""Offline checks of k8s/ and docker/Dockerfile: what `kubectl apply -f k8s/` would send and
what KubeRay, Ray Serve and Redis would make of it, without a cluster.

This module loads the manifests and validates them against schemas (Kubernetes' own for the
core kinds, the vendored KubeRay CRD for the RayService); ``rayservice_checks``,
``redis_checks`` and ``repo_checks`` hold the rules no schema states. Every ``*_problems``
function returns a list of human-readable problems (empty = fine), so a test asserts
``== []`` on the committed files and, on a mutated copy, that the problem it guards against
is reported.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "k8s"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
CRD_SCHEMA = Path(__file__).parent / "crds" / "ray.io_rayservices.v1.schema.json"

NAMESPACE = "nasd-serve"
IMPORT_PATH = "deployments:build_app"
# Oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
# KubeRay: a RayService name gets a 6-character suffix for its RayCluster, whose
# "<name>-serve-svc" must fit a 63-character DNS label (MaxRayServiceNameLength).
MAX_RAYSERVICE_NAME_LEN = 47
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GPU = "nvidia.com/gpu"
RAY_CLUSTER_LABEL = "ray.io/cluster"
# Ports KubeRay's head Service and probes expect on the Ray head container.
HEAD_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001}
CLUSTER_DOMAIN = "svc.cluster.local"


@dataclass(frozen=True)
class Manifest:
    path: Path
    doc: dict[str, Any]


def load_manifests(directory: Path = K8S_DIR) -> list[Manifest]:
    """Every object in ``directory/*.yaml``, in the order ``kubectl apply -f`` applies them
    (files by name, documents in file order)."""
    return [
        Manifest(path, doc)
        for path in sorted(directory.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


def find(manifests: Iterable[Manifest], kind: str) -> dict[str, Any]:
    """The one object of ``kind``."""
    (doc,) = [m.doc for m in manifests if m.doc["kind"] == kind]
    return doc


def mutated(manifests: list[Manifest], kind: str, change: Callable[[dict], Any]) -> list[Manifest]:
    """A deep copy of ``manifests`` with ``change`` applied to the object of ``kind``."""
    copies = [Manifest(m.path, copy.deepcopy(m.doc)) for m in manifests]
    change(find(copies, kind))
    return copies


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec["template"]["spec"]["containers"]


def env_by_name(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        ok = {
            "Exists": present,
            "DoesNotExist": not present,
            "In": present and labels[key] in values,
            "NotIn": not present or labels[key] not in values,
        }[operator]
        if not ok:
            return False
    return True


# --- schemas ---------------------------------------------------------------------------------


def core_schema_problems(doc: dict[str, Any], k8s_version: str) -> list[str]:
    """Validate a built-in kind against the Kubernetes OpenAPI schema bundled in
    kubernetes-validate (strict: an unknown field is an error, as with `kubectl apply`'s
    default server-side field validation)."""
    try:
        kubernetes_validate.validate(doc, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{doc['kind']} {'.'.join(map(str, error.path))}: {error.message}"]
    return []


def _strict(schema: Any) -> Any:
    # The API server prunes (or, with strict field validation, rejects) fields a structural
    # schema does not declare; jsonschema accepts them unless told additionalProperties: false.
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@cache
def crd_validator() -> jsonschema.protocols.Validator:
    schema = _strict(json.loads(CRD_SCHEMA.read_text()))
    return jsonschema.Draft202012Validator(schema)


def crd_problems(rayservice: dict[str, Any]) -> list[str]:
    """Validate the RayService against the vendored KubeRay CRD schema (strict, as above)."""
    return [
        f"RayService {'.'.join(map(str, error.path))}: {error.message}"
        for error in crd_validator().iter_errors(rayservice)
    ]
