"""A GGUF model's weights kept quantized on a CPU (``ModelConfig(dtype="gguf")``).

Why: a decode step on a CPU is bound by reading the weights. The embedded model ships as Q4_1
blocks (its vocabulary as Q8_0): about 96 MB a step, where the dequantized float32 weights are
540 MB. A user's GGUF file may hold Q4_0, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K or Q6_K blocks
too; weights of other types are float32, as gguf-py reads them. ``QuantLinear`` keeps a Linear's blocks (Q4_0,
Q4_1 and Q8_0 as the file holds them, the others repacked at load into blocks of 32 with the same
values, ``loader.gguf.repack``) and multiplies by them with ``native/csrc/quant_linear_q8.cpp``. By default
(``ModelConfig.int8_activations``) each input row is rounded to int8 per block of 32, as llama.cpp does for
these blocks, and multiplied with integer dot products (AVX-512 VNNI, AVX-VNNI or AVX2), every row
of a step multiplied by each tile of repacked weights: a verification step reads the weights
once, not once per position. Otherwise (``quant_linear.cpp``) the blocks are turned into floats in
registers and multiplied by the float32 rows. Norms and attention stay float32.

The block values are the GGUF reference's (``q * d + m``, exact in float32). Each output's sum
runs in one fixed order, and a row's int8 rounding reads that row alone, so a Linear's output for
a row is the same bits whatever else the step multiplies. The runner gives this path the
deterministic attention (fixed units whatever the batch), so greedy speculation is
token-identical to plain decoding of this model by default.

Where the C++ kernels are unavailable (no compiler, ``NASD_NATIVE=0``) ``load_model`` keeps the
float32 weights instead (a dequantizing fallback would be slower than them); the modules then
still work, dequantizing in torch, for tests and direct use.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.nn import functional

from nasd_core import native
from nasd_core.config import DEFAULT_INT8_ACTIVATIONS
from nasd_core.layers.model_state import model_state

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per block in every format the kernels take
# ggml type id -> (name, bytes per block of 32 as the kernels take it). The K-quants (super-blocks of
# 256 with 6- or 8-bit sub-block scales) and the Q5 types (5-bit codes split over two fields) are
# repacked at load into blocks of 32 whose scales are multiplied out into float32 (exact: a float16
# times an integer of magnitude at most 128): Q4_K as Q4_1 with float32 d and m, Q6_K as Q8_0 with
# a float32 d for each 16 weights (and so Q3_K, whose weights are d sc q with integers sc and
# q), Q5_0 / Q5_1 / Q5_K as a byte per code with float32 d and m (``loader.gguf.repack``).
BLOCK_FORMATS = {
    2: ("Q4_0", 18),
    3: ("Q4_1", 20),
    6: ("Q5_0", 40),
    7: ("Q5_1", 40),
    8: ("Q8_0", 34),
    11: ("Q3_K", 40),
    12: ("Q4_K", 24),
    13: ("Q5_K", 40),
    14: ("Q6_K", 40),
}
# The repacked types as the file holds them: (weights, bytes) per block of the file.
FILE_BLOCKS = {6: (32, 22), 7: (32, 24), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
# Types repacked into another's layout: the kernels (and ``dequantize``) read them as that type.
SAME_LAYOUT = {11: 14}


def layout(kind: int) -> str:
    """The name of the block layout ``kind``'s blocks have once loaded (``SAME_LAYOUT``)."""
    return BLOCK_FORMATS[SAME_LAYOUT.get(kind, kind)][0]


def dequantize(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """Float32 weights ``[out, in]`` of GGUF ``blocks`` ``[out, bytes]`` (the reference's q * d + m)."""
    name, size = layout(kind), BLOCK_FORMATS[kind][1]
    num_blocks = blocks.shape[-1] // size
    grouped = blocks.reshape(*blocks.shape[:-1], num_blocks, size)
    if name in ("Q8_0", "Q6_K"):  # int8 codes times d (Q6_K: a float32 d for each 16 weights)
        if name == "Q8_0":
            scale = grouped[..., 0:2].contiguous().view(torch.float16).float()
        else:
            scale = grouped[..., 0:8].contiguous().view(torch.float32).repeat_interleave(16, dim=-1)
        values = grouped[..., -32:].contiguous().view(torch.int8).float() * scale
    else:  # codes q times d, plus m
        if kind in FILE_BLOCKS:  # repacked: float32 d and m
            scale = grouped[..., 0:4].contiguous().view(torch.float32)
            offset = grouped[..., 4:8].contiguous().view(torch.float32)
        else:
            scale = grouped[..., 0:2].contiguous().view(torch.float16).float()
            offset = (
                grouped[..., 2:4].contiguous().view(torch.float16).float() if name == "Q4_1" else -8 * scale
            )
        codes = grouped[..., 8:] if kind in FILE_BLOCKS else grouped[..., -16:]
        if name.startswith("Q4"):
            # Byte j holds weight j in its low nibble and weight j + 16 in its high one.
            codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1)
        values = codes.float() * scale + offset
    return values.reshape(*blocks.shape[:-1], num_blocks * BLOCK)


@functools.cache
def quant_kernel_available() -> bool:
    """Whether ``torch.ops.nasd.quant_linear`` is built here (and traceable by torch.compile)."""
    if not (native.load() and hasattr(torch.ops.nasd, "quant_linear")):
        return False

    @torch.library.register_fake("nasd::quant_linear")
    def _(inputs: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
        return inputs.new_empty(*inputs.shape[:-1], blocks.shape[0])

    @torch.library.register_fake("nasd::quant_linear_q8")
    def _(inputs: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
        return inputs.new_empty(*inputs.shape[:-1], blocks.shape[0])

    return True


class QuantLinear(nn.Module):
    """``nn.Linear`` over a weight kept as GGUF blocks, ``[out_features, bytes]`` uint8, and an
    optional float32 ``bias`` (Qwen2's query, key and value have one). With ``int8_activations``
    (``ModelConfig.int8_activations``) each input row is rounded to int8 per block of 32 and
    multiplied with integer dot products (``quant_linear_q8``), as llama.cpp does; otherwise the
    float32 rows are multiplied."""

    def __init__(
        self,
        blocks: torch.Tensor,
        kind: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        int8_activations: bool = DEFAULT_INT8_ACTIVATIONS,
    ) -> None:
        super().__init__()
        if kind not in BLOCK_FORMATS:
            raise ValueError(f"unsupported GGUF block type {kind}")
        if blocks.shape[1] != in_features // BLOCK * BLOCK_FORMATS[kind][1] or in_features % BLOCK:
            raise ValueError(f"{blocks.shape[1]} bytes per output do not hold {in_features} inputs")
        self.in_features, self.out_features, self.kind = in_features, blocks.shape[0], kind
        self.register_buffer("blocks", blocks, persistent=False)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"a bias of {tuple(bias.shape)} for {self.out_features} outputs")
        self.register_buffer("bias", bias, persistent=False)
        self.int8_activations = int8_activations
        self.native = quant_kernel_available()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.native:
            kernel = torch.ops.nasd.quant_linear_q8 if self.int8_activations else torch.ops.nasd.quant_linear
            outputs = kernel(inputs.float(), self.blocks, self.kind)
        else:
            outputs = functional.linear(inputs.float(), dequantize(self.blocks, self.kind))
        return outputs if self.bias is None else outputs + self.bias

    def extra_repr(self) -> str:
        name = BLOCK_FORMATS[self.kind][0]
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={name}"


def set_int8_activations(model: nn.Module, enabled: bool) -> None:
    """``ModelConfig.int8_activations`` on ``model``: its QuantLinears' kernel and the lean
    decoder's fused layer loop."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.int8_activations = enabled
    model_state(model).int8_activations = enabled


class QuantLinears(nn.Module):
    """GGUF-block Linears of different block types side by side, their outputs concatenated: what
    ``merged_linear`` makes of a layer's q, k, v (or gate, up) when their types differ, as
    llama.cpp's Q4_K_M files make some layers' v Q6_K beside Q4_K q and k."""

    def __init__(self, linears: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(linears)
        self.in_features = linears[0].in_features
        self.out_features = sum(linear.out_features for linear in linears)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(inputs) for part in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` whose table is GGUF blocks: the looked-up rows are dequantized."""

    def __init__(self, blocks: torch.Tensor, kind: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.kind = blocks.shape[0], embedding_dim, kind
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.blocks[ids], self.kind)
