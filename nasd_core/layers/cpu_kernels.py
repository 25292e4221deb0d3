"""CPU fast path: Linear weights pre-packed for oneDNN, grouped-query attention without copies.

Why: a verification step feeds each row a handful of positions (the last token plus the
drafts). On CPU, ``nn.Linear`` runs those through MKL's general matrix multiply, which for
2-17 input rows is much slower per row than its matrix-vector path for one row (measured
on this project's AMD EPYC machine). With the weights reordered once into oneDNN's blocked layout, the same
multiply reads each weight once and costs about the same for 1 to ~8 rows, so drafted
positions become nearly free - which is what speculative decoding needs. The packed kernel
is also batch-invariant: a row's output does not depend on how many rows ride with it, so
a verified position gets bit-identical logits to the same position decoded alone.

Not every CPU gains at one or two rows: on an Intel Xeon with AVX-512 MKL's matrix-vector
path beat the packed kernel by ~2x per layer for 1-2 rows (a whole one-position step of the
embedded model: 34 ms stock, 42 ms packed), while the packed kernel kept its lead from ~5
rows. So at load ``measure_dense_max_rows`` times both on the model's own layer shapes, and
inputs of at most that many rows go to MKL with the original weight. Where that is more
than 0, the batch invariance above holds only among inputs of more rows (the logits of a
one-row step and of the same row verified among others then differ by float rounding, as
on GPUs); ``ModelConfig(cpu_dense_max_rows=0)`` keeps the packed kernel for every shape.

transformers' SDPA attention copies every key/value head ``num_key_value_groups`` times
whenever more than one query position comes with a mask (24 ms of a 101 ms step of the
embedded model fed 5 positions, with packed weights); ``gqa_sdpa_attention`` asks torch's
SDPA to share the heads instead (``enable_gqa``), which is the same arithmetic without the
copies.

``python -m benchmarks.step_cost`` measures both layouts side by side.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
from torch import nn
from torch.nn import functional
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from nasd_core import native
from nasd_core.layers.shape import ModelShape

logger = logging.getLogger(__name__)

# The packing's blocking is tuned for this many input rows: the engine's decode and verify steps,
# where it is 2-4x faster than MKL on 2 cores; from 64 rows the two are even.
_PACKING_ROWS_HINT = 16


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack Linear weights of ``dtype`` for oneDNN on CPU."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight reordered once into oneDNN's layout.

    Inputs of at most ``dense_max_rows`` rows run ``nn.Linear``'s own (MKL) multiply on the
    original weight instead, which is then kept beside the packed copy.
    """

    def __init__(self, linear: nn.Linear, dense_max_rows: int = 0) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dense_max_rows = dense_max_rows
        # oneDNN multiplies one row by another kernel than two or more (its sums then round
        # differently); batch-invariant steps multiply a lone row as two.
        self.single_row_as_two = False
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)
        # Buffers, not parameters: the packed layout is an inference-only copy of the weight.
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("dense_weight", weight if dense_max_rows > 0 else None, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        leading = inputs.shape[:-1]
        rows = inputs.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # a step that needs no logits (prompt chunks only)
            return inputs.new_empty(*leading, self.out_features)
        if rows.shape[0] <= self.dense_max_rows:
            out = functional.linear(rows, self.dense_weight, self.bias)
        else:
            lone = rows.shape[0] == 1 and self.single_row_as_two
            rows = rows.expand(2, -1).contiguous() if lone else rows
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
            out = out[:1] if lone else out
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn, "
            f"dense_max_rows={self.dense_max_rows}"
        )


# Row counts the dense path is tried for, and by how much it must win to be used: below
# ~10% the choice would follow this VM's noise, and keeping the original weights costs memory.
_DENSE_CANDIDATE_ROWS = (1, 2, 3, 4)
_DENSE_MIN_GAIN = 0.9


def _fastest_seconds(forward, inputs: torch.Tensor, calls: int, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timings of ``calls`` back-to-back calls (the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            forward(inputs)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_dense_max_rows(linears: list[nn.Linear]) -> int:
    """Most input rows for which MKL's multiply beats the packed one on these layers (0 = none).

    Each distinct layer shape is timed once at 1..4 rows with both kernels and weighted by how
    many layers have it, so the answer is about a whole forward, not one layer. Rows count
    from 1 up and stop at the first count where the dense path does not clearly win.
    """
    by_shape = Counter((linear.in_features, linear.out_features) for linear in linears)
    samples = {(linear.in_features, linear.out_features): linear for linear in linears}
    packed_samples = {shape: PackedLinear(linear) for shape, linear in samples.items()}  # packed once
    dense_max_rows = 0
    for num_rows in _DENSE_CANDIDATE_ROWS:
        dense_s = packed_s = 0.0
        for shape, count in by_shape.items():
            linear, packed = samples[shape], packed_samples[shape]
            inputs = torch.randn(num_rows, shape[0])
            # About 2M weight multiply-adds per row per timing: fewer calls for the large layers.
            calls = max(2, min(50, 2_000_000 // (shape[0] * shape[1])))
            for forward in (linear, packed):  # warm both (oneDNN builds its kernel on first use)
                forward(inputs)
            dense_s += count * _fastest_seconds(linear, inputs, calls) / calls
            packed_s += count * _fastest_seconds(packed, inputs, calls) / calls
        if dense_s >= _DENSE_MIN_GAIN * packed_s:
            break
        dense_max_rows = num_rows
    return dense_max_rows


# The attention implementation name the model is switched to (registered with transformers).
GQA_SDPA = "nasd_gqa_sdpa"


def gqa_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over SDPA with shared key/value heads."""
    if query.shape[2] == 1:
        # One position: transformers already folds the heads without copying (pack_gqa).
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # A mask, when given, already encodes causality; without one, a multi-position query
    # over an equally long key (prefill) is plainly causal.
    is_causal = bool(attention_mask is None and is_causal)
    out = functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: nn.Module) -> bool:
    """Switch a model that uses transformers' SDPA attention to ``gqa_sdpa_attention``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    # Same masks as "sdpa" (including skipping them where is_causal suffices).
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return True


def optimize_for_cpu(model: nn.Module, dense_max_rows: int | None = None) -> list[str]:
    """Apply the CPU fast path to a CPU float32 model; returns what was applied.

    ``dense_max_rows``: see ``pack_linear_layers``.
    """
    applied = []
    if pack_linear_layers(model, dense_max_rows):
        applied.append("packed_linear")
    parameter = next(model.parameters(), None)
    on_cpu = parameter is not None and parameter.device.type == "cpu"
    cpu_float32 = on_cpu and parameter.dtype == torch.float32
    if cpu_float32 and use_gqa_sdpa(model):
        applied.append(GQA_SDPA)
    return applied


def pack_linear_layers(model: nn.Module, dense_max_rows: int | None = 0) -> int:
    """Replace every ``nn.Linear`` of a CPU float32 ``model`` with a ``PackedLinear``.

    ``dense_max_rows``: inputs of at most this many rows keep MKL's multiply (None = measure
    it on this CPU with ``measure_dense_max_rows``; 0 = the packed kernel for every input).
    Returns the number of layers replaced (0 where packing is unavailable or the model is not
    a CPU float32 model). The model keeps its outputs up to float rounding; use it for
    inference only (the packed weights are buffers and are not trained or saved).
    """
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or not packed_linear_available(parameter.dtype):
        return 0
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    if dense_max_rows is None:
        dense_max_rows = measure_dense_max_rows([child for _, _, child in targets])
    for parent, child_name, child in targets:
        setattr(parent, child_name, PackedLinear(child, dense_max_rows))
    logger.info(
        "packed %d Linear layers for oneDNN (MKL for inputs of <= %d rows)", len(targets), dense_max_rows
    )
    return len(targets)


def use_batch_invariant_kernels(model: nn.Module) -> None:
    """Make ``model``'s steps batch-invariant on a CPU (deterministic mode): float32 arithmetic
    (a bfloat16 model's weights widen exactly), every Linear through oneDNN's packed kernel
    with at least two rows (its rows' sums then do not depend on how many rows it multiplies;
    MKL's depend on it from one to four), and attention through the C++ kernel in fixed key
    units (``attention.plan_step``). Idempotent.

    Raises:
        ValueError: the model is not on a CPU, or the kernels are not available here.
    """
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        raise ValueError("deterministic mode runs on a CPU; its GPU kernels are not built")
    if not packed_linear_available(torch.float32) or not native.load():
        raise ValueError("deterministic mode needs oneDNN's packed Linear and the C++ attention kernel")
    if parameter.dtype != torch.float32:
        model.float()
    threads = invariant_threads(model)
    if torch.get_num_threads() > threads:
        logger.warning(
            "deterministic mode: %d threads may split an elementwise op inside a row (%d or fewer do "
            "not for this model); steps can then differ by the batch",
            torch.get_num_threads(),
            threads,
        )
    pack_linear_layers(model, dense_max_rows=0)
    for module in model.modules():  # the packed kernel for every row count
        if isinstance(module, PackedLinear):
            module.dense_max_rows, module.dense_weight, module.single_row_as_two = 0, None, True


# Elements an elementwise kernel's vectorised loop takes at a time (two AVX-512 vectors): a thread's
# share that ends inside such a block ends in a scalar loop, which can round differently.
VECTOR_BLOCK = 32


def invariant_threads(model: nn.Module, most: int = 64) -> int:
    """The most intra-op threads whose every count from one up splits each of ``model``'s row
    widths into whole vector blocks: torch's elementwise ops share ``rows x width`` elements
    among up to that many threads, so each row's elements then take the same code whatever
    the rows."""
    shape = ModelShape.from_config(model.config, model.dtype, weight_bytes=0)
    widths = (
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.head_dim,
    )
    for threads in range(1, most + 1):
        if any(width % (VECTOR_BLOCK * threads) for width in widths):
            return threads - 1
    return most
