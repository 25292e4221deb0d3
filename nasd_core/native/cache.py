"""Where this project keeps what it builds on a machine: converted models, C++ builds and
inductor's compiled kernels (``NASD_CACHE_DIR``, else the user cache dir; a volume in k8s/)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "NASD_CACHE_DIR"


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("nasd-serve"))


# Where inductor keeps the kernels it compiles (compiled layers, paged attention, the grammar
# mask): under the NASD cache (a volume in k8s/), so a restarted replica loads them instead of
# compiling them again; unless the process chose a folder already.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keep_compiled_kernels(cache_dir: str | None = None) -> None:
    """Point inductor's on-disk cache into the NASD cache (once a process has compiled, inductor
    has chosen its folder: call this first)."""
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    os.environ.setdefault(INDUCTOR_CACHE_ENV, str(folder / "inductor"))
