"""What every benchmark suite shares: its command line, run metadata, result files and plots.

A suite is a module ``benchmarks/<suite>.py`` whose ``main()`` parses ``suite_parser(__doc__)``,
runs every compared system in one process, and hands its payload (``{"benchmark", "meta", ...}``)
to ``publish_run``. ``benchmarks.report`` reads the module's ``markdown_table(payload)``, and
where it has them ``plot(payload)`` (a figure) and ``ratios(payload)`` (ratio by key, for the
README's headline and the quick run's comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PLOTS_DIR = Path(__file__).resolve().parent / "plots"


def run_metadata(model, dtype: str, module: str) -> dict[str, object]:
    """Where and how a result was produced, so a table can be traced back to its run
    (``model`` None: a run that loads none, such as a replay of recorded traces)."""
    # NASD_COMMIT: where the tree was copied without its git history (a lent GPU machine).
    commit = os.environ.get("NASD_COMMIT", "")
    try:
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
        )
    except OSError:
        commit = "unknown"
    device = model.device if model is not None else torch.device("cpu")
    return {
        "command": " ".join(["python", "-m", module, *sys.argv[1:]]),
        "commit": commit,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "isa": cpu_isa(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model": (getattr(model.config, "_name_or_path", "") or type(model).__name__) if model else None,
        "dtype": dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# The widest integer-dot-product paths the CPU kernels choose between, widest first.
_ISA_FLAGS = (("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_isa() -> str:
    """The CPU's widest instruction set of those the kernels use, with its family/model numbers
    (an "AMD EPYC" name alone does not tell a Zen 3 from a Zen 5)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    fields = dict(line.split(":", 1) for line in info.split("\n\n", 1)[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = next((name for flag, name in _ISA_FLAGS if flag in flags), platform.machine())
    return f"{isa} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


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


T = TypeVar("T")


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` starting at ``shift`` (modulo their count): the run order of compared systems
    for the ``shift``-th job, so none always runs first (slow drift, caches) and each leads in turn."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def fastest_interleaved_ms(
    setups: dict[str, Callable[[], Callable[[], object]]], repeats: int, calls: int = 1
) -> dict[str, float]:
    """Per case, the fastest mean ms of ``calls`` calls of what its setup returns, over
    ``repeats`` rounds that take the cases in turn, so that load on the machine moves them alike
    (each round's setup runs untimed first: a switch of kernels, inputs in the case's dtype)."""
    fastest = dict.fromkeys(setups, float("inf"))
    for _ in range(repeats):
        for name, setup in setups.items():
            body = setup()
            started = time.perf_counter()
            for _ in range(calls):
                body()
            fastest[name] = min(fastest[name], (time.perf_counter() - started) / calls)
    return {name: round(1000 * seconds, 2) for name, seconds in fastest.items()}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, 0 for no values (a cell that produced none)."""
    return float(np.percentile(values, q)) if values else 0.0


def write_result(name: str, payload: dict[str, object]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def result_name(suite: str, dtype: str, quick: bool, device: str = "cpu") -> str:
    """The file stem a suite's run writes to (results and plot): ``<suite>_<dtype>[_quick]``,
    ``<suite>_<device type>_<dtype>[_quick]`` off the CPU (``concurrency_cuda_bfloat16``)."""
    device_type = device.split(":")[0]
    where = "" if device_type == "cpu" else f"{device_type}_"
    return f"{suite}_{where}{dtype}{'_quick' if quick else ''}"


def suite_parser(doc: str, quick: str | None = None) -> argparse.ArgumentParser:
    """A suite's command line: its module docstring as the help, and ``--quick`` (helped by
    ``quick``) where the suite has a short version that ``make bench-quick`` runs."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def publish_run(
    name: str,
    payload: dict,
    markdown_table: Callable[[dict], str] | None = None,
    plot: Callable[[dict], object] | None = None,
) -> Path:
    """Write a run's ``results/<name>.json`` (and ``plots/<name>.png`` with a ``plot``), print
    its table; the result's path."""
    path = write_result(name, payload)
    if plot is not None:
        save_figure(plot(payload), name)
    if markdown_table is not None:
        print(markdown_table(payload))
    print(f"\nresults: {path}")
    return path


def new_figure(num_panels: int, width: float = 6.0, height: float = 4.0):
    """A row of ``num_panels`` axes on a headless (Agg) figure; (figure, axes list)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, num_panels, figsize=(width * num_panels, height), squeeze=False)
    return figure, list(axes[0])


def save_figure(figure, name: str) -> Path:
    """Write ``benchmarks/plots/<name>.png`` and release the figure."""
    import matplotlib.pyplot as plt

    PLOTS_DIR.mkdir(parents=True, exist_ok=True)
    path = PLOTS_DIR / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def grouped_bars(axis, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """Bars for each group (x) side by side, one colour per series."""
    width = 0.8 / max(1, len(series))
    for offset, (label, values) in enumerate(series.items()):
        positions = [index + (offset - (len(series) - 1) / 2) * width for index in range(len(groups))]
        axis.bar(positions, values, width, label=label)
    axis.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    axis.set_ylabel(ylabel)
    axis.legend(fontsize="small")


def concurrency_lines(axis, levels: dict[str, dict], series: dict[str, str], metric: str, title: str) -> None:
    """``metric`` against concurrency (log-2 x axis), one line per ``series`` label → row key."""
    concurrency = sorted(int(level) for level in levels)
    for label, key in series.items():
        axis.plot(concurrency, [levels[str(c)][key][metric] for c in concurrency], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xticks(concurrency, [str(c) for c in concurrency])
    axis.set_xlabel("concurrent requests")
    axis.set_title(title)
    axis.legend(fontsize="small")
