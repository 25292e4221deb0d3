"""The CPU kernels' instruction paths against each other, on this host, in one run (issue 51).

Every path gives the same bits (the tests compare them), so which one runs is a matter of speed
alone. Two tables, each timed interleaved (every repeat takes the cases in turn, so a host's
load moving during the run moves them alike):

- ``matmul``: one pass over every Linear of the embedded model (``quant_matmul.model_shapes``,
  random Q4_1 blocks as the embedded file's layers, and Q8_0 ones, ``quant_kinds.build``) through
  ``quant_linear_q8`` at 8 to 256 input rows, on each instruction
  path from VNNI x 16 up (``nasd::quant_linear_q8_path``: 3 VNNI x 16, 4 AMX tiles from 64 rows
  on), one and two threads;
- ``step``: a whole step of the embedded model (8 rows x 1 and x 4 positions on one thread, as a
  server decodes; a 256-position prompt chunk on two) at 256 and 1024 cached tokens a row, with
  the defaults (``best``), the matmuls' VNNI x 16 path (``vnni16``), attention's loops 8 lanes
  wide (``lanes8``, ``nasd::paged_attention_lanes``), and both (``vnni16_lanes8``);
- ``attention``: one layer's ``paged_attention`` call on one thread with the embedded model's
  heads (9 query, 3 key/value heads of 64) over a float16 pool of random keys and values, rows in
  scattered blocks: 8 rows x 1 and x 4 positions at 512-2048 keys, a 256-position chunk over 512,
  its loops 16 lanes wide and 8.

On a host without AVX-512 VNNI there is nothing to compare; without AMX the matmul table has one
path.

    python -m benchmarks.cpu_paths              # prints, writes results/cpu_paths.json
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.common import fastest_interleaved_ms, run_metadata, write_result
from benchmarks.gguf_step import repeated_step, use_variant
from benchmarks.quant_kinds import build
from benchmarks.quant_matmul import model_shapes
from nasd_core import native
from nasd_core.config import ModelConfig
from nasd_core.layers import attention
from nasd_core.loader import load_model
from nasd_core.speculation.calibration import filled_runner

VNNI16, AMX = 3, 4
MATMUL_ROWS = (8, 32, 64, 256)
MATMUL_KINDS = {3: "Q4_1", 8: "Q8_0"}
STEP_SHAPES = ((1, (8, 1)), (1, (8, 4)), (2, (1, 256)))  # (threads, (rows, positions a row))
CONTEXTS = (256, 1024)
# (rows, positions a row, keys a row), one thread.
ATTENTION_SHAPES = ((8, 1, 512), (8, 4, 512), (8, 1, 1024), (8, 4, 1024), (8, 4, 2048), (1, 256, 512))
STEP_CASES = {"best": (None, 16), "vnni16": (VNNI16, 16), "lanes8": (None, 8), "vnni16_lanes8": (VNNI16, 8)}


@torch.inference_mode()
def matmul_cells(paths: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """ms of one pass over the model's Linears per block type, threads, rows and path."""
    shapes = model_shapes()
    cells: dict[str, dict[str, float]] = {}
    for kind, name in MATMUL_KINDS.items():
        weights = build(kind)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in MATMUL_ROWS:
                inputs = {width: torch.randn(rows, width) for width in {width for _, width in shapes}}

                def setup(path: int, inputs=inputs, weights=weights, kind=kind):
                    torch.ops.nasd.quant_linear_q8_path(path)
                    return lambda: [
                        torch.ops.nasd.quant_linear_q8(inputs[width], blocks, kind)
                        for blocks, (_, width) in zip(weights, shapes)
                    ]

                timings = fastest_interleaved_ms({str(path): partial(setup, path) for path in paths}, repeats)
                cells[f"{name}, {threads} threads, {rows} rows"] = timings
                print("matmul", name, threads, rows, timings, flush=True)
    torch.ops.nasd.quant_linear_q8_path(max(paths))
    return cells


@torch.inference_mode()
def step_cells(best_path: int, repeats: int) -> dict[str, dict[str, float]]:
    """ms of one step per context, shape and case (kernel paths)."""
    model, _ = load_model(None, ModelConfig(dtype="gguf"))
    use_variant(model, "lean_fused_q8")
    best_lanes = torch.ops.nasd.paged_attention_lanes()
    cells: dict[str, dict[str, float]] = {}
    for context in CONTEXTS:
        runner = filled_runner(model, 8, context, 256)
        for threads, (rows, width) in STEP_SHAPES:
            torch.set_num_threads(threads)
            run = repeated_step(runner, rows, width, context)

            def setup(case: str, run=run):
                path, lanes = STEP_CASES[case]
                torch.ops.nasd.quant_linear_q8_path(best_path if path is None else path)
                torch.ops.nasd.paged_attention_lanes(min(lanes, best_lanes))
                return run

            for case in STEP_CASES:
                setup(case)()
            calls = 5 if width < 100 else 2
            timings = fastest_interleaved_ms(
                {case: partial(setup, case) for case in STEP_CASES}, repeats, calls
            )
            cells[f"{context} cached, {rows}x{width}, {threads} threads"] = timings
            print("step", context, rows, width, threads, timings, flush=True)
    torch.ops.nasd.quant_linear_q8_path(best_path)
    torch.ops.nasd.paged_attention_lanes(best_lanes)
    return cells


def attention_case(rows: int, width: int, length: int, generator: torch.Generator):
    """One layer's ``paged_attention`` over ``rows`` rows of ``length`` keys, ``width`` new positions each."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 32
    blocks = -(-length // block_size)
    shape = (kv_heads, rows * blocks * block_size, head_dim)
    keys = torch.randn(shape, generator=generator).half()
    values = torch.randn(shape, generator=generator).half()
    table = torch.randperm(rows * blocks, generator=generator).to(torch.int32).view(rows, blocks)
    row_info = torch.tensor([[row * width, width, length] for row in range(rows)])
    query = torch.randn(rows * width, heads, head_dim, generator=generator)
    keys_per_unit = attention.keys_per_unit(rows * length, 1)
    return lambda: torch.ops.nasd.paged_attention(
        query, keys, values, table, row_info, head_dim**-0.5, block_size, keys_per_unit
    )


def attention_cells(repeats: int) -> dict[str, dict[str, float]]:
    """ms of one layer's attention per shape, 16 lanes and 8."""
    torch.set_num_threads(1)
    best_lanes = torch.ops.nasd.paged_attention_lanes()
    generator = torch.Generator().manual_seed(0)
    cells: dict[str, dict[str, float]] = {}
    for rows, width, length in ATTENTION_SHAPES:
        run = attention_case(rows, width, length, generator)

        def setup(lanes: int, run=run):
            torch.ops.nasd.paged_attention_lanes(lanes)
            return run

        lanes = {f"lanes{n}": partial(setup, n) for n in sorted({best_lanes, 8}, reverse=True)}
        for case in lanes.values():
            case()()
        cells[f"{rows}x{width}, {length} keys"] = timings = fastest_interleaved_ms(lanes, repeats, 20)
        print("attention", rows, width, length, timings, flush=True)
    torch.ops.nasd.paged_attention_lanes(best_lanes)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not native.load():
        raise SystemExit("the C++ kernels did not build here")
    best_path = torch.ops.nasd.quant_linear_q8_path()
    if best_path < VNNI16:
        raise SystemExit("no AVX-512 VNNI on this host: one path, nothing to compare")
    payload = {
        "benchmark": "cpu_paths",
        "meta": run_metadata(None, "gguf", "benchmarks.cpu_paths"),
        "best_path": best_path,
        "attention_lanes": torch.ops.nasd.paged_attention_lanes(),
        "matmul_ms": matmul_cells(list(range(VNNI16, best_path + 1)), args.repeats),
        "step_ms": step_cells(best_path, args.repeats),
        "attention_ms": attention_cells(args.repeats),
    }
    print(markdown_tables(payload))
    print(f"results: {write_result('cpu_paths', payload)}")


def markdown_tables(payload: dict) -> str:
    lines = []
    tables = (
        ("matmuls, one pass", payload["matmul_ms"]),
        ("step", payload["step_ms"]),
        ("attention, one layer, 1 thread", payload["attention_ms"]),
    )
    for title, cells in tables:
        cases = list(next(iter(cells.values())))
        lines += ["", f"| {title} | " + " | ".join(f"{case} (ms)" for case in cases) + " |"]
        lines.append("|---|" + "---|" * len(cases))
        lines += [
            f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in cases) + " |" for name, row in cells.items()
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
