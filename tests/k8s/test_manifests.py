"""k8s/ as `kubectl apply -f k8s/` sees it: parseable, ordered, namespaced, valid against the
Kubernetes schemas, and free of committed secrets."""

from __future__ import annotations

import pytest
import yaml

from tests.k8s.manifests import (
    K8S_DIR,
    K8S_VERSIONS,
    NAMESPACE,
    Manifest,
    core_schema_problems,
    find,
    load_manifests,
    mutated,
)
from tests.k8s.repo_checks import namespace_problems, secret_problems

CORE_KINDS = ("Namespace", "ConfigMap", "Service", "Deployment", "NetworkPolicy")


def test_every_file_parses_to_the_expected_objects(manifests):
    files = sorted(K8S_DIR.glob("*.yaml"))
    # Only manifests: kubectl would try any .json/.yml too, and docs belong elsewhere.
    assert sorted(K8S_DIR.iterdir()) == files
    # kubectl applies a directory's files in name order: NN- prefixes make that order explicit.
    assert all(path.name[:2].isdigit() and path.name[2] == "-" for path in files), [p.name for p in files]
    for path in files:
        assert [doc for doc in yaml.safe_load_all(path.read_text()) if doc], f"{path.name} is empty"
    assert sorted(m.doc["kind"] for m in manifests) == sorted([*CORE_KINDS, "RayService"])
    assert {m.path.parent for m in manifests} == {K8S_DIR}


def test_namespace_first_and_every_object_in_it(manifests):
    assert namespace_problems(manifests) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda ms: [ms[-1], *ms[:-1]], "must be the first object applied"),
        (lambda ms: [ms[0], *ms[2:], ms[1]], "ConfigMap must be applied before"),
        (
            lambda ms: mutated(ms, "Service", lambda doc: doc["metadata"].update(namespace="default")),
            "Service is not in namespace",
        ),
        (
            lambda ms: mutated(ms, "RayService", lambda doc: doc["metadata"].pop("namespace")),
            "RayService is not",
        ),
    ],
)
def test_namespace_check_catches(manifests, change, expected):
    problems = namespace_problems(change(manifests))
    assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", CORE_KINDS)
def test_core_kind_matches_kubernetes_schema(manifests, kind, k8s_version):
    assert core_schema_problems(find(manifests, kind), k8s_version) == []


def _set_port_string(doc):
    doc["spec"]["ports"][0]["port"] = "6379"


def _typo_in_container(doc):
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": 6379}}


def _drop_pod_selector(doc):
    doc["spec"].pop("podSelector")


@pytest.mark.parametrize(
    ("kind", "change", "expected"),
    [
        ("Deployment", lambda doc: doc["spec"].update(replicas="1"), "is not of type 'integer'"),
        ("Deployment", _typo_in_container, "readinesProbe"),
        ("Service", _set_port_string, "is not of type 'integer'"),
        ("NetworkPolicy", _drop_pod_selector, "'podSelector' is a required property"),
        ("ConfigMap", lambda doc: doc.update(data={"redis.conf": 1}), "is not of type 'string'"),
    ],
)
def test_core_schema_check_catches(manifests, kind, change, expected):
    broken = find(mutated(manifests, kind, change), kind)
    problems = core_schema_problems(broken, K8S_VERSIONS[0])
    assert any(expected in problem for problem in problems), problems


def test_no_secret_values_committed(manifests, dockerfile):
    assert secret_problems(manifests, dockerfile) == []


def _with_secret(manifests: list[Manifest]) -> list[Manifest]:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "nasd-hf-token", "namespace": NAMESPACE},
        "stringData": {"token": "changeme"},
    }
    return [*manifests, Manifest(manifests[-1].path, secret)]


def _literal_token(doc):
    worker = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["env"] = [{"name": "HUGGING_FACE_HUB_TOKEN", "value": "not-a-real-token"}]


def _password_in_conf(doc):
    doc["data"]["redis.conf"] += "requirepass hunter2\n"


def _password_in_url(doc):
    doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace("redis://", "redis://:hunter2@")


@pytest.mark.parametrize(
    ("change", "dockerfile_extra", "expected"),
    [
        (_with_secret, "", "carries values"),
        (
            lambda ms: mutated(ms, "RayService", _literal_token),
            "",
            "HUGGING_FACE_HUB_TOKEN has a literal value",
        ),
        (lambda ms: mutated(ms, "ConfigMap", _password_in_conf), "", "a literal requirepass"),
        (lambda ms: mutated(ms, "RayService", _password_in_url), "", "credentials in a Redis URL"),
        (lambda ms: ms, "\nENV HF_TOKEN=abc\n", "bakes a secret into the image"),
        (lambda ms: ms, "\nRUN echo hf_0123456789abcdefghijABCDEFGHIJ > /tmp/t\n", "a Hugging Face token"),
    ],
)
def test_secret_check_catches(manifests, dockerfile, change, dockerfile_extra, expected):
    problems = secret_problems(change(manifests), dockerfile + dockerfile_extra)
    assert any(expected in problem for problem in problems), problems


def test_loader_reads_files_in_kubectl_order(tmp_path):
    # kubectl apply -f DIR walks files in lexical order; load_manifests must see the same.
    (tmp_path / "20-b.yaml").write_text("kind: B\n---\nkind: C\n")
    (tmp_path / "10-a.yaml").write_text("---\nkind: A\n")
    assert [m.doc["kind"] for m in load_manifests(tmp_path)] == ["A", "B", "C"]
