"""Baseline: SuffixDecoding as ArcticInference ships it (the engine behind vLLM's ``suffix``
speculative method), built on this machine from the package registry's sdist.

Nothing of it is committed here: ``load()`` downloads ``arctic-inference`` (sdist only),
builds its ``csrc/suffix_decoding`` alone with CMake and nanobind (the ``bench`` extra pins the
version its pyproject builds with) into a cache directory, and
imports its ``SuffixDecodingCache`` from there. Where any step fails (no network, no CMake,
no compiler), ``load()`` says why and the replay skips the baseline.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.0"
CACHE = Path.home() / ".cache" / "nasd-serve" / f"arctic_inference-{VERSION}"


def _run(command: list[str], cwd: Path | None = None) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])}... failed: {(result.stderr or result.stdout)[-400:]}")


def _build() -> Path:
    """The directory holding an importable ``arctic_inference.suffix_decoding`` (built once)."""
    package = CACHE / "site" / "arctic_inference" / "suffix_decoding"
    if any(package.glob("_C*.so")):
        return CACHE / "site"
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"arctic_inference-{VERSION}.tar.gz"
    if not archive.exists():
        _run(
            [
                *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"),
                *("--no-binary", ":all:", "--no-build-isolation", f"arctic-inference=={VERSION}"),
                *("-d", str(CACHE)),
            ]
        )
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    source = CACHE / f"arctic_inference-{VERSION}"
    build = CACHE / "build"
    _run(
        [
            *("cmake", "-S", str(source / "csrc" / "suffix_decoding"), "-B", str(build)),
            *("-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"),
        ]
    )
    _run(["cmake", "--build", str(build), "-j", "2"])
    package.mkdir(parents=True, exist_ok=True)
    (package.parent / "__init__.py").write_text("")
    for name in ("__init__.py", "cache.py"):
        shutil.copy(source / "arctic_inference" / "suffix_decoding" / name, package / name)
    for library in build.glob("_C*.so"):
        shutil.copy(library, package / library.name)
    return CACHE / "site"


def load():
    """``(SuffixDecodingCache, None)``, or ``(None, why it is unavailable)``."""
    try:
        site = str(_build())
        if site not in sys.path:
            sys.path.insert(0, site)
        module = importlib.import_module("arctic_inference.suffix_decoding")
        return module.SuffixDecodingCache, None
    except Exception as exc:  # any failure means: run without the baseline, and say why
        return None, f"SuffixDecoding baseline unavailable ({type(exc).__name__}: {exc})"
