"""One step of the embedded model on its GGUF blocks, three ways, in one run (issue 51).

The same runner, rows and cache; only the forward differs:
- ``transformers``: transformers' own layers (the model without the lean decoder);
- ``lean_python``: the lean decoder's layers looped from Python (``lean_decoder.lean_layer``);
- ``lean_fused``: every layer in one C++ call (``nasd::decoder_layers``), what decode and
  verification steps run;
- ``lean_fused_q8``: the same with int8 activations in every matmul (``quantized.INT8_ACTIVATIONS``:
  each row quantized per block of 32, integer dot products).

Each cell is the fastest mean of 5 timings of 10 steps, rows of 256 cached tokens in the default
float16 KV-cache, 2 threads; a shape's timings take the variants in turn, so load on the machine
moves them alike.

A second table times ``lean_fused_q8`` with the KV-cache in float32 and in float16
(``EngineConfig.kv_cache_dtype``) at longer contexts, where a step reads more keys and values
than weights.

    python -m benchmarks.gguf_step
    python -m benchmarks.gguf_step --model qwen2.gguf   # another file: the forwards it runs, no KV table

With ``--model`` the table holds the forwards that file's model runs (a model whose layers the
fused loop cannot take, such as Qwen2's with biases, runs ``transformers`` and ``lean_python``
only) and goes to ``gguf_step_<file stem>.json``.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import fastest_interleaved_ms, run_metadata, write_result
from nasd_core.config import ModelConfig
from nasd_core.layers import lean_decoder, quantized
from nasd_core.loader import load_model
from nasd_core.runner.model_runner import StepRow
from nasd_core.speculation.calibration import filled_runner, probe_row

CONTEXT = 256
SHAPES = ((1, 1), (1, 5), (8, 1), (8, 3))  # rows x positions per row
VARIANTS = ("transformers", "lean_python", "lean_fused", "lean_fused_q8")
KV_CONTEXTS = (256, 1024, 2048)
KV_SHAPES = ((1, 1), (8, 1), (8, 3))
KV_DTYPES = ("float32", "float16")


def use_variant(model, variant: str) -> None:
    model.nasd_lean_decoder = variant != "transformers"
    lean_decoder.FUSED_LAYERS = variant.startswith("lean_fused")
    quantized.INT8_ACTIVATIONS = variant.endswith("_q8")


def repeated_step(runner, num_rows: int, width: int, context: int):
    """One step of ``num_rows`` probe rows x ``width`` positions, rolled back after it."""
    step = [StepRow(probe_row(row), [7] * width, width) for row in range(num_rows)]

    def run() -> None:
        runner.forward(step)
        for row in range(num_rows):
            runner.cache.set_length(probe_row(row), context)

    return run


def step_ms(
    runner, model, num_rows: int, width: int, variants: list[str], repeats: int = 5, steps: int = 10
) -> dict[str, float]:
    """Each variant's fastest mean ms of ``steps`` steps, the variants' timings interleaved."""
    run = repeated_step(runner, num_rows, width, CONTEXT)

    def setup(variant: str):
        use_variant(model, variant)
        return run

    for variant in variants:
        setup(variant)
        for _ in range(3):
            run()
    return fastest_interleaved_ms({variant: partial(setup, variant) for variant in variants}, repeats, steps)


def kv_dtype_cells(model, repeats: int = 5, steps: int = 10) -> dict[str, dict[str, dict[str, float]]]:
    """``lean_fused_q8`` steps by context and shape with each KV-cache dtype, interleaved."""
    use_variant(model, "lean_fused_q8")
    width = max(w for _, w in KV_SHAPES)
    cells: dict[str, dict[str, dict[str, float]]] = {}
    for context in KV_CONTEXTS:
        runners = {
            dtype: filled_runner(model, 8, context, width, kv_cache_dtype=dtype) for dtype in KV_DTYPES
        }
        for rows, positions in KV_SHAPES:
            runs = {
                dtype: repeated_step(runner, rows, positions, context) for dtype, runner in runners.items()
            }
            for run in runs.values():
                run()
            shape = f"{rows}x{positions}"
            timings = fastest_interleaved_ms(
                {dtype: partial(runs.get, dtype) for dtype in runs}, repeats, steps
            )
            cells.setdefault(str(context), {})[shape] = timings
            print(f"context {context} {shape}", timings, flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS)
    parser.add_argument("--model", help="a *.gguf file (default: the embedded model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, ModelConfig(dtype="gguf"))
    if args.variants is None:
        fused = getattr(model, "nasd_fused_layers", False)
        args.variants = [variant for variant in VARIANTS if fused or not variant.startswith("lean_fused")]
    runner = filled_runner(model, max(rows for rows, _ in SHAPES), CONTEXT, max(w for _, w in SHAPES))
    cells: dict[str, dict[str, float]] = {variant: {} for variant in args.variants}
    for rows, width in SHAPES:
        for variant, ms in step_ms(runner, model, rows, width, args.variants).items():
            cells[variant][f"{rows}x{width}"] = ms
        print(
            f"{rows}x{width}", {variant: cells[variant][f"{rows}x{width}"] for variant in cells}, flush=True
        )
    kv_cells = kv_dtype_cells(model) if args.model is None else None
    payload = {
        "benchmark": "gguf_step",
        "meta": run_metadata(model, "gguf", "benchmarks.gguf_step"),
        "threads": args.threads,
        "context": CONTEXT,
        "cells": cells,
        "kv_dtype_cells": kv_cells,
    }
    print(markdown_table(payload))
    name = "gguf_step" if args.model is None else f"gguf_step_{Path(args.model).stem}"
    print(f"results: {write_result(name, payload)}")


def markdown_table(payload: dict) -> str:
    cells = payload["cells"]
    shapes = list(next(iter(cells.values())))
    lines = [
        "| forward | " + " | ".join(f"{shape} (ms)" for shape in shapes) + " |",
        "|---|" + "---|" * len(shapes),
    ]
    for variant, row in cells.items():
        lines.append(f"| {variant} | " + " | ".join(f"{row[shape]:.1f}" for shape in shapes) + " |")
    kv_cells = payload.get("kv_dtype_cells")
    if kv_cells:
        kv_shapes = list(next(iter(kv_cells.values())))
        header = " | ".join(f"{shape} {dtype} (ms)" for shape in kv_shapes for dtype in KV_DTYPES)
        lines += [
            "",
            f"| cached tokens a row (lean_fused_q8) | {header} |",
            "|---|" + "---|" * 2 * len(kv_shapes),
        ]
        for context, row in kv_cells.items():
            values = " | ".join(f"{row[shape][dtype]:.1f}" for shape in kv_shapes for dtype in KV_DTYPES)
            lines.append(f"| {context} | {values} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
