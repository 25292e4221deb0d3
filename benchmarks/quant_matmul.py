"""Weight-only quantized matmuls on this CPU, on the embedded model's Linear shapes (issue 51).

A decode step on a CPU is bound by reading the weights: the engine multiplies by float32
weights (540 MB a step for the embedded SmolLM2-135M) where llama.cpp reads the GGUF's 4-bit
blocks (~85 MB). This times one pass over every Linear of the model (its 30 layers' q, k, v, o,
gate, up, down, then the vocabulary projection) at 1 to 17 input rows (a decode and the
verification widths), for each way torch can multiply on a CPU:

- ``float32``: the engine's weights today, through ``nn.functional.linear`` (MKL);
- ``bfloat16``: half the bytes, the same kernels' bfloat16 path;
- ``int8_channel``: ``_weight_int8pack_mm``, int8 weights with one scale per output channel;
- ``int4_group32``: ``_weight_int4pack_mm_for_cpu``, 4-bit weights in groups of 32 with a scale
  and an offset each: Q4_1's own layout, so the GGUF's blocks map onto it exactly;
- ``nasd_q4_1``: the Q4_1 blocks as the GGUF holds them, through NASD's own kernel
  (``nasd_core/native/csrc/quant_linear.cpp``), the one ``ModelConfig(dtype="gguf")`` uses;
- ``nasd_q4_1_q8``: the same blocks through ``quant_linear_q8``, which quantizes each input row
  to int8 per block of 32 and multiplies with integer dot products (``quantized.INT8_ACTIVATIONS``).

The methods' passes are timed interleaved (each repeat runs every method once per row count),
so a machine's load drifting during the run moves them all alike.

Besides the time, each row says whether the kernel is batch-invariant (a row's output has the
same bits multiplied alone and among 17 rows): greedy output with speculation on is then the
output without it, as the issue requires of the quantized path.

python -m benchmarks.quant_matmul          # prints the table, writes results/quant_matmul.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from torch.nn import functional

from benchmarks.common import fastest_interleaved_ms, run_metadata, write_result
from nasd_core.layers.quantized import QuantLinear

# SmolLM2-135M's widths (the embedded model): hidden 576, MLP 1536, 9 query and 3 key/value
# heads of 64, 30 layers, 49152 tokens.
HIDDEN, INTERMEDIATE, KV_WIDTH, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),  # q
    (KV_WIDTH, HIDDEN),  # k
    (KV_WIDTH, HIDDEN),  # v
    (HIDDEN, HIDDEN),  # o
    (INTERMEDIATE, HIDDEN),  # gate
    (INTERMEDIATE, HIDDEN),  # up
    (HIDDEN, INTERMEDIATE),  # down
]
ROWS = (1, 2, 5, 8, 9, 17)
GROUP = 32


def model_shapes() -> list[tuple[int, int]]:
    """(out, in) of every Linear a step multiplies by, in order."""
    return LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]


class Dense:
    """A float32 or bfloat16 weight, multiplied by ``nn.functional.linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return functional.linear(inputs, self.weight)

    def clone(self) -> Dense:
        return Dense(self.weight.clone())


class Int8Channel:
    """int8 codes with one scale per output channel."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.scales = weight.abs().amax(dim=1) / 127
        self.codes = torch.round(weight / self.scales[:, None]).to(torch.int8)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(inputs, self.codes, self.scales)

    def clone(self) -> Int8Channel:
        copy = Int8Channel.__new__(Int8Channel)
        copy.codes, copy.scales = self.codes.clone(), self.scales.clone()
        return copy


class Int4Group32:
    """A weight in Q4_1's layout: 4-bit codes q with a scale d and an offset m per group of 32
    inputs, w = d * q + m, packed for the CPU kernel (which computes (q - 8) * d + (m + 8d))."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        # [groups, out, 2]: per group and output, the scale and the value of code 8.
        self.scale_and_zero = torch.stack([scale.T, (offset + 8 * scale).T], dim=-1).contiguous()

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(inputs, self.packed, GROUP, self.scale_and_zero)

    def clone(self) -> Int4Group32:
        copy = Int4Group32.__new__(Int4Group32)
        copy.packed, copy.scale_and_zero = self.packed.clone(), self.scale_and_zero.clone()
        return copy


class GGUFBlocks:
    """The weight as Q4_1 blocks, multiplied by NASD's kernel with float32 activations."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        out_features, in_features = codes.shape
        grouped = codes.to(torch.uint8).view(out_features, -1, GROUP)
        nibbles = grouped[..., :16] | (grouped[..., 16:] << 4)  # byte j: weight j, then weight j + 16
        halves = torch.stack([scale, offset], dim=-1).half().view(torch.uint8)  # d then m, float16 each
        self.linear = QuantLinear(torch.cat([halves, nibbles], dim=-1).view(out_features, -1), 3, in_features)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.nasd.quant_linear(inputs, self.linear.blocks, self.linear.kind)

    def clone(self) -> GGUFBlocks:
        copy = type(self).__new__(type(self))
        copy.linear = QuantLinear(self.linear.blocks.clone(), 3, self.linear.in_features)
        return copy


class GGUFBlocksQ8(GGUFBlocks):
    """The Q4_1 blocks with int8 activations (``torch.ops.nasd.quant_linear_q8``)."""

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.nasd.quant_linear_q8(inputs, self.linear.blocks, self.linear.kind)


def random_q4_1(out_features: int, in_features: int, generator: torch.Generator):
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scale = torch.rand(out_features, in_features // GROUP, generator=generator) * 0.01 + 1e-3
    offset = -8 * scale + 1e-3 * torch.randn(out_features, in_features // GROUP, generator=generator)
    return codes, scale, offset


def dequantized(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    out_features, in_features = codes.shape
    grouped = codes.float().view(out_features, -1, GROUP) * scale[..., None] + offset[..., None]
    return grouped.view(out_features, in_features)


def make_weight(method: str, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
    """One Q4_1 weight as ``method`` holds it."""
    if method == "int4_group32":
        return Int4Group32(codes, scale, offset)
    if method == "nasd_q4_1":
        return GGUFBlocks(codes, scale, offset)
    if method == "nasd_q4_1_q8":
        return GGUFBlocksQ8(codes, scale, offset)
    weight = dequantized(codes, scale, offset)
    if method == "int8_channel":
        return Int8Channel(weight)
    return Dense(weight.bfloat16() if method == "bfloat16" else weight)


def build(method: str, shapes: list[tuple[int, int]]) -> list:
    """Each weight of ``shapes`` as ``method`` multiplies by it (random Q4_1 weights), a copy
    per use as a model holds them (one shared weight would sit in the cache)."""
    generator = torch.Generator().manual_seed(0)
    made = {}
    for shape in set(shapes):
        codes, scale, offset = random_q4_1(*shape, generator)
        made[shape] = make_weight(method, codes, scale, offset)
    return [made[shape].clone() for shape in shapes]


def input_dtype(method: str) -> torch.dtype:
    return torch.bfloat16 if method == "bfloat16" else torch.float32


@torch.inference_mode()
def pass_ms(
    methods: dict[str, list], shapes: list[tuple[int, int]], rows: int, repeats: int
) -> dict[str, float]:
    """Fastest ms of one pass over every weight at ``rows`` input rows, per method, the
    methods' passes interleaved."""
    widths = {shape[1] for shape in shapes}
    inputs = {width: torch.randn(rows, width) for width in widths}

    def setup(method: str, weights: list) -> Callable[[], None]:
        typed = {width: inputs[width].to(input_dtype(method)) for width in widths}

        def one_pass() -> None:
            for weight, (_, width) in zip(weights, shapes):
                weight(typed[width])

        return one_pass

    return fastest_interleaved_ms(
        {method: partial(setup, method, weights) for method, weights in methods.items()}, repeats
    )


@torch.inference_mode()
def batch_invariant(weights: list, shapes: list[tuple[int, int]], dtype: torch.dtype) -> bool:
    """Whether every weight's output for a row is the same bits alone and among 17 rows."""
    generator = torch.Generator().manual_seed(1)
    for weight, (_, width) in zip(
        weights[: len(LAYER_SHAPES)] + weights[-1:], shapes[: len(LAYER_SHAPES)] + shapes[-1:]
    ):
        batch = torch.randn(max(ROWS), width, generator=generator).to(dtype)
        if not torch.equal(weight(batch[:1])[0], weight(batch)[0]):
            return False
    return True


WEIGHT_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "int8_channel": 1.0,
    "int4_group32": 0.5 + 2 * 4 / GROUP,  # codes, then a float32 scale and zero per group
    "nasd_q4_1": 20 / GROUP,  # the GGUF's own blocks: 16 bytes of codes, float16 d and m
    "nasd_q4_1_q8": 20 / GROUP,  # the same blocks
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", nargs="+", choices=list(WEIGHT_BYTES), default=list(WEIGHT_BYTES))
    args = parser.parse_args()
    shapes = model_shapes()
    result: dict = {
        "benchmark": "quant_matmul",
        "meta": run_metadata(None, "float32", "benchmarks.quant_matmul"),
    }
    methods = {method: build(method, shapes) for method in args.methods}
    pass_ms(methods, shapes, 1, 1)  # first calls pay for kernel selection
    by_rows = {rows: pass_ms(methods, shapes, rows, args.repeats) for rows in ROWS}
    cells = {}
    for method, weights in methods.items():
        cells[method] = {
            "weight_mb": round(sum(o * i for o, i in shapes) * WEIGHT_BYTES[method] / 1e6, 1),
            "ms_by_rows": {rows: by_rows[rows][method] for rows in ROWS},
            "batch_invariant": batch_invariant(weights, shapes, input_dtype(method)),
        }
        print(method, cells[method], flush=True)
    result["ms_per_pass"] = cells
    result["threads"] = torch.get_num_threads()
    print(f"results: {write_result('quant_matmul', result)}")
    print(markdown_table(result))


def markdown_table(payload: dict) -> str:
    cells = payload["ms_per_pass"]
    rows = list(next(iter(cells.values()))["ms_by_rows"])
    lines = [
        "| weights | MB read a pass | "
        + " | ".join(f"{r} row{'s' if r != '1' and r != 1 else ''} (ms)" for r in rows)
        + " | batch-invariant |",
        "|---|---|" + "---|" * len(rows) + "---|",
    ]
    for method, cell in cells.items():
        lines.append(
            f"| {method} | {cell['weight_mb']} | "
            + " | ".join(f"{ms:.1f}" for ms in cell["ms_by_rows"].values())
            + f" | {'yes' if cell['batch_invariant'] else 'no'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
