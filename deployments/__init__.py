"""NASD-Serve's Ray Serve application: OpenAI-compatible ingress + NASD replicas.

    serve run deployments.app                                   # embedded model, in-memory pool
    serve run deployments:build_app model=... redis_url=... num_replicas=2

``app`` is built from ``NASD_*`` environment variables (see ``builder.ENV_VARS``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AppArgs", "app", "args_from_env", "build_app"]


def __getattr__(name: str) -> Any:
    # Resolved on first use, not at import: Serve imports this package in the ingress process
    # too (to load the ingress class), which must not pay for torch and the model stack.
    builder = importlib.import_module("deployments.builder")
    if name == "app":
        globals()["app"] = builder.build_app(builder.args_from_env())
        return globals()["app"]
    if name in __all__:
        return getattr(builder, name)
    raise AttributeError(f"module 'deployments' has no attribute {name!r}")
