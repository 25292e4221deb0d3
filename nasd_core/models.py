"""Deprecated alias of ``nasd_core.loader``, where model loading now lives (``load_model`` is
also ``nasd_core.load_model``); this alias will be removed in a later release."""

from __future__ import annotations

import warnings
from typing import Any

from nasd_core import loader
from nasd_core.native import cache


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # the import system's questions (``__path__``...): a plain module
        raise AttributeError(name)
    warnings.warn(
        "nasd_core.models is deprecated: import from nasd_core.loader (or nasd_core.load_model)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(loader if hasattr(loader, name) else cache, name)
