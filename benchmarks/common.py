"""Shared benchmark plumbing: run metadata, forward counting, result files."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_metadata(model, dtype: str, module: str) -> dict[str, object]:
    """Where and how a result was produced, so a table can be traced back to its run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "command": " ".join(["python", "-m", module, *sys.argv[1:]]),
        "commit": commit,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "dtype": dtype,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class ForwardCounter:
    """Counts target-model forward calls (a forward pre-hook), the same way for every system."""

    def __init__(self, model) -> None:
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


@contextmanager
def counting_forwards(model):
    counter = ForwardCounter(model)
    try:
        yield counter
    finally:
        counter.close()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, 0 for no values (a cell that produced none)."""
    return float(np.percentile(values, q)) if values else 0.0


def write_result(name: str, payload: dict[str, object]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
