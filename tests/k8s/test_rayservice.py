"""The RayService: valid for the KubeRay CRD, consistent with KubeRay's and Ray's rules, and
its serveConfigV2 builds this repo's application with its arguments."""

from __future__ import annotations

import pytest
import ray
import yaml

from tests.k8s.manifests import IMPORT_PATH, crd_problems, find, mutated
from tests.k8s.rayservice_checks import (
    build_serve_app,
    rayservice_problems,
    serve_config,
    serve_config_problems,
)


def _workers(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def _head(doc):
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]


def _worker_container(doc):
    return _workers(doc)[0]["template"]["spec"]["containers"][0]


def _set_args(**changes):
    def change(doc):
        config = serve_config(doc)
        config["applications"][0]["args"].update(changes)
        doc["spec"]["serveConfigV2"] = yaml.safe_dump(config)

    return change


def _set_config(text):
    return lambda doc: doc["spec"].update(serveConfigV2=text)


def _edit_config(old, new):
    def change(doc):
        assert old in doc["spec"]["serveConfigV2"]
        doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace(old, new)

    return change


def _append_to_config(text):
    return lambda doc: doc["spec"].update(serveConfigV2=doc["spec"]["serveConfigV2"] + text)


def test_rayservice_matches_kuberay_crd(manifests):
    assert crd_problems(find(manifests, "RayService")) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # The API server would drop (or, with strict field validation, reject) a misspelt field.
        (lambda doc: _workers(doc)[0].update(minReplica=1), "'minReplica' was unexpected"),
        (lambda doc: _workers(doc)[0]["rayStartParams"].update({"num-gpus": 1}), "is not of type 'string'"),
        (lambda doc: _workers(doc)[0].pop("groupName"), "'groupName' is a required property"),
        (lambda doc: doc["spec"].update(serveConfigV2=serve_config(doc)), "is not of type 'string'"),
    ],
)
def test_crd_check_catches(manifests, change, expected):
    problems = crd_problems(find(mutated(manifests, "RayService", change), "RayService"))
    assert any(expected in problem for problem in problems), problems


def test_rayservice_follows_kuberay_and_ray_rules(manifests):
    rayservice = find(manifests, "RayService")
    assert rayservice_problems(rayservice) == []
    # The facts the checks rest on, stated once: a pinned Ray, and one GPU per worker pod.
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    assert _workers(rayservice)[0]["rayStartParams"]["num-gpus"] == "1"
    assert _worker_container(rayservice)["resources"]["limits"]["nvidia.com/gpu"] == "1"


def _gpu_limit(count):
    def change(doc):
        for part in ("limits", "requests"):
            _worker_container(doc)["resources"][part]["nvidia.com/gpu"] = count

    return change


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda doc: doc["metadata"].update(name="n" * 48), "DNS-1035 label of <= 47"),
        (lambda doc: doc["metadata"].update(name="Nasd"), "DNS-1035 label"),
        (lambda doc: doc["spec"]["rayClusterConfig"].update(rayVersion="2.9.0"), "!= installed Ray"),
        (lambda doc: _head(doc)["rayStartParams"].update({"num-gpus": "1"}), "num-gpus must be '0'"),
        (lambda doc: _head(doc)["rayStartParams"].pop("num-cpus"), "num-cpus must be '0'"),
        (_gpu_limit("2"), "num-gpus must equal the nvidia.com/gpu limit (2)"),
        (
            lambda doc: _worker_container(doc)["resources"]["requests"].update({"nvidia.com/gpu": "2"}),
            "request must equal its limit",
        ),
        (lambda doc: _workers(doc)[0]["template"]["spec"].pop("tolerations"), "toleration"),
        (lambda doc: _workers(doc)[0].update(replicas=9), "minReplicas <= replicas <= maxReplicas"),
        (lambda doc: _worker_container(doc).update(image="other:1"), "one image"),
        (lambda doc: _worker_container(doc).pop("env"), "HUGGING_FACE_HUB_TOKEN must come from"),
        (
            lambda doc: _worker_container(doc)["env"][0]["valueFrom"]["secretKeyRef"].pop("optional"),
            "optional secretKeyRef",
        ),
        (
            lambda doc: _head(doc)["template"]["spec"]["containers"][0]["ports"].pop(0),
            "head container port 'gcs' must be 6379",
        ),
        (_append_to_config("http_options:\n  port: 9000\n"), "Serve's HTTP port 9000"),
        (lambda doc: _worker_container(doc).pop("volumeMounts"), "must be a read-only mount of a Secret"),
        (lambda doc: _head(doc)["template"]["spec"].pop("volumes"), "must be a read-only mount of a Secret"),
        (
            lambda doc: _workers(doc)[0]["template"]["spec"]["volumes"][1]["secret"].update(optional=True),
            "must not be optional",
        ),
        (
            lambda doc: _worker_container(doc)["env"].append({"name": "NASD_API_KEY", "value": "sk-1"}),
            "NASD_API_KEY must come from a Secret",
        ),
        (_set_args(api_key="sk-in-the-manifest"), "puts a key in the manifest"),
    ],
)
def test_rayservice_check_catches(manifests, change, expected):
    problems = rayservice_problems(find(mutated(manifests, "RayService", change), "RayService"))
    assert any(expected in problem for problem in problems), problems


def test_serve_config_builds_this_repos_app_with_its_args(manifests):
    assert serve_config_problems(manifests) == []
    (application,) = serve_config(find(manifests, "RayService"))["applications"]
    assert application["import_path"] == IMPORT_PATH
    # build_app only binds the deployment graph: nothing was loaded and Ray did not start.
    deployments = {d["name"]: d for d in build_serve_app(application)}
    assert not ray.is_initialized()
    replica = deployments["NASDReplica"]
    assert replica["ray_actor_options"]["num_gpus"] == float(application["args"]["num_gpus_per_replica"])
    assert replica["num_replicas"] == application["args"]["num_replicas"]
    assert deployments["OpenAIIngress"]["ray_actor_options"]["num_cpus"] == 0


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_set_args(num_replica=2), "does not build"),  # AppArgs forbids unknown names
        (_set_args(speculation="sometimes"), "does not build"),
        (_set_args(num_replicas=9), "9 replicas of 1 GPU + 1 CPU fit only 4 times"),
        (_set_args(num_gpus_per_replica=2), "fit only 0 times"),
        (_set_args(autoscaling={"min_replicas": 1, "max_replicas": 8}), "8 replicas"),
        (
            _set_args(redis_url="redis://nasd-redis.default.svc.cluster.local:6379"),
            "is not the Redis Service",
        ),
        (_set_args(redis_url="redis://nasd-redis.nasd-serve.svc.cluster.local:6380"), "port 6380"),
        (_set_args(redis_url="http://nasd-redis.nasd-serve.svc.cluster.local:6379"), "scheme 'http'"),
        (_edit_config(IMPORT_PATH, "deployments:app"), "import_path 'deployments:app'"),
        (_edit_config(IMPORT_PATH, "deployments:nope"), "does not build"),
        (_set_config("applications:\n  - name: nasd\n"), "not a valid Serve config"),
        (
            _append_to_config("    deployments:\n      - name: NasdReplica\n"),
            "unknown deployment 'NasdReplica'",
        ),
    ],
)
def test_serve_config_check_catches(manifests, change, expected):
    problems = serve_config_problems(mutated(manifests, "RayService", change))
    assert any(expected in problem for problem in problems), problems
