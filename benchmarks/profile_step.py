"""Where a GPU step's time goes: torch.profiler over a decode step and a prompt chunk.

For each step (1 row x 1 position and 64 x 17 replayed from the paged step graphs; a
512-token prompt chunk in its chunk graph and on the packed path), with compiled layers on a
random-weight model: wall ms per step, the device's kernel ms per step (their sum: where the
wall is far above it, the host or the launches bound the step) and the kernels that take most.

python -m benchmarks.profile_step --arch qwen2-1.5b     # a GPU; prints, and writes the tables
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import publish_run, run_metadata, suite_parser
from nasd_core.layers.compiled_layers import compile_layers
from nasd_core.loader.random_weights import ARCHITECTURES, random_model
from nasd_core.runner.model_runner import StepRow
from nasd_core.speculation.calibration import filled_runner, probe_row

CONTEXT = 256
STEPS = {"decode_1x1": (1, 1), "verify_64x17": (64, 17), "chunk_512": (1, 512)}
TOP_KERNELS = 12


@torch.inference_mode()
def profile_step(runner, num_rows: int, width: int, repeats: int) -> dict:
    """Wall and kernel ms per step of ``num_rows`` x ``width`` (a prompt chunk where wider than
    a verification: one logit), and the top kernels by device time."""
    num_logits = width if width <= 32 else 1
    step = [StepRow(probe_row(row), [7] * width, num_logits) for row in range(num_rows)]

    def run() -> None:
        runner.forward(step)[-1, 0].item()
        for row in range(num_rows):
            runner.cache.set_length(probe_row(row), CONTEXT)

    for _ in range(3):  # compile, capture, settle
        run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    wall_ms = 1000 * (time.perf_counter() - started) / repeats
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
    events = [event for event in prof.key_averages() if event.device_type.name == "CUDA"]
    events.sort(key=lambda event: event.self_device_time_total, reverse=True)
    kernel_ms = sum(event.self_device_time_total for event in events) / 1000 / repeats
    return {
        "wall_ms": round(wall_ms, 3),
        "kernel_ms": round(kernel_ms, 3),
        "path": "graphs" if runner.graphs is not None else "packed",
        "top_kernels_ms": {
            event.key[:90]: round(event.self_device_time_total / 1000 / repeats, 3)
            for event in events[:TOP_KERNELS]
        },
    }


def main() -> None:
    parser = suite_parser(__doc__)
    parser.add_argument("--arch", choices=list(ARCHITECTURES), default="qwen2-1.5b")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model = random_model(args.arch, "bfloat16", "cuda")
    failure = compile_layers(model)
    result: dict = {
        "benchmark": "profile_step",
        "meta": {**run_metadata(model, "bfloat16", "benchmarks.profile_step"), "arch": args.arch},
        "compile_failure": failure,
    }
    graphs = filled_runner(
        model, 64, CONTEXT, 512, step_graphs=True, graph_attention="paged", compiled_layers=True
    )
    for name, (rows, width) in STEPS.items():
        result[name] = profile_step(graphs, rows, width, args.repeats)
    del graphs
    packed = filled_runner(model, 1, CONTEXT, 512, compiled_layers=True)
    result["chunk_512_packed"] = profile_step(packed, 1, 512, args.repeats)
    for name, cell in result.items():
        if isinstance(cell, dict) and "wall_ms" in cell:
            print(f"{name}: wall {cell['wall_ms']} ms, kernels {cell['kernel_ms']} ms ({cell['path']})")
            for kernel, ms in cell["top_kernels_ms"].items():
                print(f"    {ms:8.3f}  {kernel}")
    publish_run(f"profile_step_cuda_{args.arch}", result)


if __name__ == "__main__":
    main()
