"""Package attributes imported on first use (PEP 562), so that importing a package costs only
what its caller touches."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable


class _LazyPackage(types.ModuleType):
    """A package whose exported names stay its own: importing a submodule of the same name
    (``nasd_core.generate``, the module of ``nasd_core.generate``, the function) binds the
    submodule on its parent, which would hide the export."""

    def __setattr__(self, name: str, value: object) -> None:
        namesake = isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}"
        if namesake and name in self.__dict__.get("_EXPORTS", {}):
            return
        super().__setattr__(name, value)


def lazy_attributes(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """A package's ``__getattr__`` and ``__dir__`` for ``exports`` (public name: the module that
    defines it, kept in the package as ``_EXPORTS``); each name is imported once, then kept."""
    module = sys.modules[package]
    module._EXPORTS = exports
    module.__class__ = _LazyPackage

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *exports})

    return __getattr__, __dir__
