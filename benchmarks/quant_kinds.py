"""Each GGUF block type's kernel on the embedded model's Linear shapes, int8 activations (issue 51).

A user's GGUF file may hold Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K weights
(``dtype="gguf"`` keeps them all as blocks; the K-quants and Q5 types repacked at load into blocks
of 32 with float32 scales). This times one
pass over every Linear of the embedded model's shapes (30 layers' q, k, v, o, gate, up, down, then
the vocabulary) with every weight in one type, at 1, 8 and 24 input rows (a decode, eight rows, eight
rows verifying two drafts), through ``quant_linear_q8``, the types' passes interleaved. The weights
are random blocks of each type: the time depends on the type's layout, not on its values.

    python -m benchmarks.quant_kinds      # prints the table, writes results/quant_kinds.json
"""

from __future__ import annotations

import argparse
from functools import partial

import gguf
import numpy as np
import torch

from benchmarks.common import fastest_interleaved_ms, run_metadata, write_result
from benchmarks.quant_matmul import model_shapes
from nasd_core.layers.quantized import BLOCK_FORMATS, FILE_BLOCKS, quant_kernel_available
from nasd_core.loader.gguf import repack

ROWS = (1, 8, 24)


# The K-quants gguf-py cannot quantize: random bytes with float16 scales in these bytes, of a size
# that gives weights of a normal layer's (Q3_K's d * 32 * 4, Q4_K's d * 63 * 15, Q5_K's d * 63 * 31,
# Q6_K's d * 127 * 32 near 1; dmin likewise).
RANDOM_FILE_SCALES = {
    11: (slice(108, 110), 8e-3),
    12: (slice(0, 4), 4e-3),
    13: (slice(0, 4), 2e-3),
    14: (slice(208, 210), 4e-4),
}


def file_blocks(kind: int, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """A tensor's bytes as a GGUF file holds them: gguf-py's quantization of normal weights, or
    random K-quant bytes (``RANDOM_FILE_SCALES``; in_features a multiple of 256)."""
    rng = np.random.default_rng(seed)
    if kind not in RANDOM_FILE_SCALES:
        weights = rng.standard_normal((out_features, in_features)).astype(np.float32)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType(kind))
    raw = rng.integers(0, 256, (out_features, in_features // 256, FILE_BLOCKS[kind][1]), dtype=np.uint8)
    fields, top = RANDOM_FILE_SCALES[kind]
    count = (fields.stop - fields.start) // 2
    raw[..., fields] = rng.uniform(top / 4, top, (*raw.shape[:2], count)).astype(np.float16).view(np.uint8)
    return raw.reshape(out_features, -1)


def random_blocks(kind: int, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Blocks as the kernels take them (the repacked types: from whole super-blocks of the file,
    then the first in_features / 32 blocks of each row)."""
    if kind not in FILE_BLOCKS:
        return torch.from_numpy(file_blocks(kind, out_features, in_features, seed))
    raw = file_blocks(kind, out_features, -(-in_features // 256) * 256, seed)
    return torch.from_numpy(repack(raw, kind))[:, : in_features // 32 * BLOCK_FORMATS[kind][1]].contiguous()


def build(kind: int) -> list[torch.Tensor]:
    """The model's weights in ``kind`` (a copy per use, as a model holds them)."""
    made = {shape: random_blocks(kind, *shape) for shape in set(model_shapes())}
    return [made[shape].clone() for shape in model_shapes()]


@torch.inference_mode()
def pass_ms(weights: dict[int, list[torch.Tensor]], rows: int, repeats: int) -> dict[str, float]:
    shapes = model_shapes()
    inputs = {width: torch.randn(rows, width) for _, width in shapes}

    def setup(kind: int):
        def one_pass() -> None:
            for blocks, (_, width) in zip(weights[kind], shapes):
                torch.ops.nasd.quant_linear_q8(inputs[width], blocks, kind)

        return one_pass

    timings = fastest_interleaved_ms({kind: partial(setup, kind) for kind in weights}, repeats)
    return {BLOCK_FORMATS[kind][0]: ms for kind, ms in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not quant_kernel_available():
        raise SystemExit("the C++ kernels did not build here")
    torch.set_num_threads(args.threads)
    weights = {kind: build(kind) for kind in sorted(BLOCK_FORMATS)}
    megabytes = {
        BLOCK_FORMATS[kind][0]: sum(blocks.numel() for blocks in weights[kind]) / 1e6 for kind in weights
    }
    cells = {}
    for rows in ROWS:
        cells[str(rows)] = pass_ms(weights, rows, args.repeats)
        print(rows, {name: round(ms, 2) for name, ms in cells[str(rows)].items()}, flush=True)
    payload = {
        "benchmark": "quant_kinds",
        "meta": run_metadata(None, "gguf", "benchmarks.quant_kinds"),
        "threads": args.threads,
        "megabytes": megabytes,
        "cells": cells,
    }
    print(markdown_table(payload))
    print(f"results: {write_result('quant_kinds', payload)}")


def markdown_table(payload: dict) -> str:
    names = list(payload["megabytes"])
    lines = [
        "| rows | " + " | ".join(f"{name} ({payload['megabytes'][name]:.0f} MB)" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for rows, cells in payload["cells"].items():
        lines.append(f"| {rows} | " + " | ".join(f"{cells[name]:.2f} ms" for name in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
