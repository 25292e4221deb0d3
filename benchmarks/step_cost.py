"""Cost of one verification step by batch shape (rows x positions per row), per dtype.

This is the surface the ``auto`` policy weighs drafts against. float32 is timed twice, with
transformers' stock CPU kernels and with the CPU fast path ``load_model`` applies by default
(``nasd_core/cpu_kernels.py``), in the same run.

python -m benchmarks.step_cost                      # float32 stock/fast and bfloat16, rows 1..32
"""

from __future__ import annotations

import argparse

from benchmarks.common import run_metadata, write_result
from nasd_core.calibration import PROBE_POSITIONS, measure_step_times
from nasd_core.config import ModelConfig
from nasd_core.models import load_model
from nasd_core.policy import StepTimeModel

# Model set-ups timed, by the name the results use.
VARIANTS = {
    "float32": ModelConfig(dtype="float32"),
    "float32_stock_kernels": ModelConfig(dtype="float32", cpu_fast_path=False),
    "bfloat16": ModelConfig(dtype="bfloat16"),
}


def shape_ms(step_time: StepTimeModel, num_rows: int) -> dict[int, float]:
    """Milliseconds of a step of ``num_rows`` rows by positions per row (fastest of the repeats)."""
    return {
        width: round(1000 * step_time.measured(num_rows, num_rows * width), 1) for width in PROBE_POSITIONS
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    surfaces: dict[str, dict[int, dict[int, float]]] = {}
    meta: dict[str, object] = {}
    for variant in args.variants:
        model, _ = load_model(config=VARIANTS[variant])
        step_time = measure_step_times(
            model, PROBE_POSITIONS, rows=args.rows, repeats=args.repeats, step_time=StepTimeModel()
        )
        surfaces[variant] = {rows: shape_ms(step_time, rows) for rows in args.rows}
        meta = run_metadata(model, VARIANTS[variant].dtype, "benchmarks.step_cost")
        for rows, by_positions in surfaces[variant].items():
            print(variant, f"{rows} rows, ms by positions per row:", by_positions)
        del model
    meta["dtype"] = sorted({VARIANTS[variant].dtype for variant in args.variants})
    write_result("step_cost", {"benchmark": "step_cost", "meta": meta, "ms_by_rows_and_positions": surfaces})


if __name__ == "__main__":
    main()
