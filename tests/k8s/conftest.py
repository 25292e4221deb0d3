"""The committed manifests and Dockerfile, loaded once; tests mutate deep copies."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import DOCKERFILE, Manifest, load_manifests


@pytest.fixture(scope="session")
def manifests() -> list[Manifest]:
    return load_manifests()


@pytest.fixture(scope="session")
def dockerfile() -> str:
    return DOCKERFILE.read_text()
