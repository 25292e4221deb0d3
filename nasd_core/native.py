"""The project's C++ CPU kernels (``nasd_core/csrc``), compiled on this machine on first use.

Why compiled here and not shipped: the kernels are built with ``-march=native`` (their loops
are vectorised for the CPU that runs them), so a build is only valid on the machine, torch
and source it was made for; the cache directory's name carries all three. ``make install``
builds them once (about 10 s); a process that finds no build makes it (torch's build lock
keeps concurrent replicas from racing).

Where no compiler is available, or ``NASD_NATIVE=0``, ``load()`` returns False and callers
use their pure-torch path, which computes the same thing (the tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build_directory() -> Path:
    """Where this machine's build for this torch and source lives."""
    from nasd_core.models import default_cache_dir

    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(_cpu_flags().encode())
    return default_cache_dir() / "native" / digest.hexdigest()[:16]


@functools.cache
def load() -> bool:
    """Build (if needed) and load the kernels into ``torch.ops.nasd``; False if unavailable."""
    if os.environ.get("NASD_NATIVE", "1") == "0":
        return False
    if hasattr(torch.ops.nasd, "paged_attention"):
        return True
    from torch.utils import cpp_extension

    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="nasd_native",
            sources=[str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # any failed build (no compiler, no headers) means: use the torch path
        logger.warning("NASD C++ kernels unavailable (%s); using the pure-torch attention path", exc)
        return False
    return True
