"""The project's C++ code, compiled on this machine on first use: the CPU attention,
quantized-matmul and decoder-layer kernels (``csrc/`` here, ``load``), and any other extension a
package builds through ``build`` (speculation's suffix store, ``speculation/csrc``).

Why compiled here and not shipped: the kernels are built with ``-march=native`` (their loops
are vectorised for the CPU that runs them), so a build is only valid on the machine, torch
and source it was made for; the cache directory's name carries all three. ``make install``
builds them once (about 10 s); a process that finds no build makes it (torch's build lock
keeps concurrent replicas from racing).

Where no compiler is available, or ``NASD_NATIVE=0``, ``load()`` returns False and ``build``
None, and callers use their pure-torch / pure-Python path, which computes the same thing (the
tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
from pathlib import Path

import torch

from nasd_core.native.cache import default_cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / "paged_attention.cpp",
    CSRC / "quant_linear.cpp",
    CSRC / "quant_linear_q8.cpp",
    CSRC / "decoder_ops.cpp",
]
# Included by the sources (their build must change when these do).
HEADERS = [CSRC / "kernels.h", CSRC / "simd.h", CSRC / "quant_blocks.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build_directory(sources: list[Path], cflags: list[str], headers: list[Path]) -> Path:
    """Where this machine's build of ``sources`` (and the ``headers`` they include) for this
    torch lives."""
    digest = hashlib.sha256()
    for source in [*sources, *headers]:
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(cflags).encode())
    digest.update(_cpu_flags().encode())
    return default_cache_dir() / "native" / digest.hexdigest()[:16]


def _load_built(name: str, library: Path, python_module: bool):
    """A finished build loaded as it is. Its folder's name is its sources, torch, flags and CPU,
    so nothing could make it stale; ninja, asked again, would compile it anew for each checkout
    and virtual environment (its build file names their paths)."""
    if not python_module:
        torch.ops.load_library(str(library))
        return str(library)
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _enabled() -> bool:
    return os.environ.get("NASD_NATIVE", "1") != "0"


def build(
    name: str,
    sources: list[Path],
    cflags: list[str],
    python_module: bool,
    what: str,
    headers: list[Path] | None = None,
):
    """Build (if needed) and load one extension from ``sources`` and the ``headers`` they include:
    a Python module with ``python_module``, else torch ops; None (after a warning) where it
    cannot be built or ``NASD_NATIVE=0``."""
    if not _enabled():
        return None
    from torch.utils import cpp_extension

    try:
        directory = build_directory(sources, cflags, headers or [])
        library = directory / f"{name}.so"
        if library.is_file() and not (directory / "lock").exists():
            return _load_built(name, library, python_module)
        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [],
            build_directory=str(directory),
            is_python_module=python_module,
            verbose=False,
        )
    except Exception as exc:  # any failed build (no compiler, no headers) means: use the Python path
        logger.warning("NASD C++ %s unavailable (%s); using the pure-Python path", what, exc)
        return None


@functools.cache
def load() -> bool:
    """Build (if needed) and load the kernels into ``torch.ops.nasd``; False if unavailable."""
    if not _enabled():
        return False
    if not hasattr(torch.ops.nasd, "paged_attention"):
        build("nasd_native", SOURCES, CFLAGS, python_module=False, what="attention kernels", headers=HEADERS)
    return hasattr(torch.ops.nasd, "paged_attention")
