"""CPU fast path: Linear weights pre-packed for oneDNN, grouped-query attention without copies.

Why: a verification step feeds each row a handful of positions (the last token plus the
drafts). On CPU, ``nn.Linear`` runs those through MKL's general matrix multiply, which for
2-17 input rows is much slower per row than its matrix-vector path for one row (measured
on this project's AMD EPYC machine). With the weights reordered once into oneDNN's blocked layout, the same
multiply reads each weight once and costs about the same for 1 to ~8 rows, so drafted
positions become nearly free - which is what speculative decoding needs. The packed kernel
is also batch-invariant: a row's output does not depend on how many rows ride with it, so
a verified position gets bit-identical logits to the same position decoded alone.

transformers' SDPA attention copies every key/value head ``num_key_value_groups`` times
whenever more than one query position comes with a mask (24 ms of a 101 ms step of the
embedded model fed 5 positions, with packed weights); ``gqa_sdpa_attention`` asks torch's
SDPA to share the heads instead (``enable_gqa``), which is the same arithmetic without the
copies.

``python -m benchmarks.step_cost`` measures both layouts side by side.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional
from transformers.integrations.sdpa_attention import sdpa_attention_forward

logger = logging.getLogger(__name__)

# The packing's blocking is tuned for this many input rows. Measured on 2 cores (60 layers of
# 1536x576): 2-4x faster than MKL from 2 to 17 rows, within noise of it from 64 to 544 rows
# (the engine's largest step); a whole 32-row plain step of the embedded model took 322 ms
# against 273 ms stock (benchmarks.step_cost), the one shape measured slower.
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
    """``nn.Linear``'s forward over a weight reordered once into oneDNN's layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)
        # Buffers, not parameters: the packed layout is an inference-only copy of the weight.
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        leading = inputs.shape[:-1]
        rows = inputs.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


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


def optimize_for_cpu(model: nn.Module) -> list[str]:
    """Apply the CPU fast path to a CPU float32 model; returns what was applied."""
    applied = []
    if pack_linear_layers(model):
        applied.append("packed_linear")
        if use_gqa_sdpa(model):
            applied.append(GQA_SDPA)
    return applied


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU float32 ``model`` with a ``PackedLinear``.

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
    for parent, child_name, child in targets:
        setattr(parent, child_name, PackedLinear(child))
    logger.info("packed %d Linear layers for oneDNN", len(targets))
    return len(targets)
