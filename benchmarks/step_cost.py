"""Cost of one verification step by batch shape (rows x positions per row), per dtype.

This is the surface the ``auto`` policy weighs drafts against.

python -m benchmarks.step_cost                      # float32 and bfloat16, rows 1..32
"""

from __future__ import annotations

import argparse

from benchmarks.common import run_metadata, write_result
from nasd_core.config import ModelConfig
from nasd_core.generate import PROBE_POSITIONS, measure_step_times
from nasd_core.models import load_model
from nasd_core.policy import StepTimeModel


def shape_ms(step_time: StepTimeModel, num_rows: int) -> dict[int, float]:
    """Milliseconds of a step of ``num_rows`` rows by positions per row."""
    return {width: round(1000 * step_time.estimate(num_rows, width), 1) for width in PROBE_POSITIONS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    surfaces: dict[str, dict[int, dict[int, float]]] = {}
    meta: dict[str, object] = {}
    for dtype in args.dtypes:
        model, _ = load_model(config=ModelConfig(dtype=dtype))
        step_time = measure_step_times(
            model, PROBE_POSITIONS, rows=args.rows, repeats=args.repeats, step_time=StepTimeModel()
        )
        surfaces[dtype] = {rows: shape_ms(step_time, rows) for rows in args.rows}
        meta = run_metadata(model, dtype, "benchmarks.step_cost")
        for rows, by_positions in surfaces[dtype].items():
            print(dtype, f"{rows} rows, ms by positions per row:", by_positions)
    meta["dtype"] = args.dtypes
    write_result("step_cost", {"benchmark": "step_cost", "meta": meta, "ms_by_rows_and_positions": surfaces})


if __name__ == "__main__":
    main()
