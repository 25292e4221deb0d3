"""Deprecated alias of ``nasd_core.loader``, where model loading now lives (``load_model`` is
also ``nasd_core.load_model``); this alias will be removed in a later release."""

from __future__ import annotations

import warnings
from typing import Any

from nasd_core import loader


def __getattr__(name: str) -> Any:
    warnings.warn(
        "nasd_core.models is deprecated: import from nasd_core.loader (or nasd_core.load_model)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(loader, name)
