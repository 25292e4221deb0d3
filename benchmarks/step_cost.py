"""Cost of one verification step by the number of tokens fed, per dtype (the policy's input).

python -m benchmarks.step_cost                      # float32 and bfloat16, 1..17 tokens
"""

from __future__ import annotations

import argparse

from benchmarks.common import run_metadata, write_result
from nasd_core.config import ModelConfig
from nasd_core.generate import measure_step_times
from nasd_core.models import load_model
from nasd_core.policy import StepTimeModel


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    curves: dict[str, dict[int, float]] = {}
    meta: dict[str, object] = {}
    for dtype in args.dtypes:
        model, _ = load_model(config=ModelConfig(dtype=dtype))
        step_time = measure_step_times(
            model, args.max_tokens, repeats=args.repeats, step_time=StepTimeModel()
        )
        curves[dtype] = {n: round(1000 * step_time.estimate(n), 1) for n in range(1, args.max_tokens + 1)}
        meta = run_metadata(model, dtype, "benchmarks.step_cost")
        print(dtype, "ms by tokens fed:", curves[dtype])
    meta["dtype"] = args.dtypes
    write_result("step_cost", {"benchmark": "step_cost", "meta": meta, "ms_by_tokens": curves})


if __name__ == "__main__":
    main()
