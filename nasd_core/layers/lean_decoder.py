"""A llama-type model's step on a CPU as a short loop of fused calls (the GGUF path's forward;
Qwen2's and Qwen3's too: biases ride on the q/k/v matmul, per-head norms run before rotary).

Why: on a CPU a small tensor op's dispatch costs more than its arithmetic, and transformers runs
about forty a decoder layer (RMSNorm's five, rotary's dozen, views, transposes, the residual
adds, seven module calls): they were about 40% of a one-token step of the embedded model on its
GGUF blocks. Here a layer is nine calls: RMSNorm with the residual add before it, one q/k/v
matmul, rotary with the split into heads, paged attention, the output matmul, RMSNorm again, one
gate/up matmul, SiLU times up, the down matmul (``native/csrc/decoder_ops.cpp`` for the pointwise
ones). A step whose rows all go to the paged attention kernel (decode and verification: the bulk
of generation) makes the same calls for every layer in one C++ call (``decoder_layers``), with no
Python between them; steps with a prompt chunk loop over ``lean_layer`` in Python. The last norm
and the vocabulary projection run on the positions that need logits only. Why: on the GGUF path a
step is short enough that transformers' per-layer Python was a large share of it (docs/results.md,
"Where a step's time goes").

The arithmetic is transformers' up to the order of its sums (each fused kernel computes a token
with one thread and one fixed sequence of instructions, so a token's values do not depend on what
else is in the step). transformers' own forward stays in place for every call that is not a step
of the model runner (``generate``, tests' references).
"""

from __future__ import annotations

import logging

import torch

from nasd_core import native
from nasd_core.layers.attention import StepLayout, paged_attention
from nasd_core.layers.compiled_layers import merge_projections
from nasd_core.layers.model_state import model_state
from nasd_core.layers.quantized import QuantLinear

logger = logging.getLogger(__name__)

# Qwen2 is a llama with biases on its query, key and value (and a sliding window it may turn on);
# Qwen3 one that normalises each head's query and key before rotary.
LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def lean_decoder_fits(model) -> bool:
    """Whether ``model`` is one ``lean_forward`` computes: a Llama, Qwen2 or Qwen3 on a CPU, SiLU MLP, its
    projections GGUF blocks (``loader.gguf.gguf_model``) and the C++ kernels built here."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    if next(model.parameters()).device.type != "cpu" or not native.load():
        return False
    if not hasattr(torch.ops.nasd, "rotary_split"):
        return False
    decoder = model.get_decoder()
    for layer in decoder.layers:
        # The lean layers multiply by blocks only.
        linears = [
            *(layer.get_submodule(name) for name in _PROJECTIONS),
            layer.self_attn.o_proj,
            layer.mlp.down_proj,
        ]
        if not all(isinstance(linear, QuantLinear) for linear in linears):
            return False
    # decoder_layers takes one epsilon for every norm.
    norms = [decoder.norm] + [
        norm for layer in decoder.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    return len({norm.variance_epsilon for norm in norms}) == 1


def use_lean_decoder(model) -> bool:
    """Merge ``model``'s projections and mark it for ``lean_forward`` where it fits (idempotent).
    Returns whether the model runner's steps now take it."""
    state = model_state(model)
    if state.lean_decoder:
        return True
    if not lean_decoder_fits(model):
        return False
    merge_projections(model)
    state.lean_decoder = True
    # decoder_layers takes one block tensor for each of a layer's q, k, v and gate, up, no bias and
    # no per-head norm: layers whose types differ there (QuantLinears), with biases (Qwen2) or
    # per-head norms (Qwen3) run the Python loop of lean_layer.
    state.layers_fit_fused = all(
        all(
            isinstance(linear, QuantLinear) and linear.bias is None
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )
        and not hasattr(layer.self_attn, "q_norm")
        for layer in model.get_decoder().layers
    )
    logger.info("steps run the lean decoder (fused CPU kernels, merged projections)")
    return True


def lean_layer(
    layer, hidden: torch.Tensor, residual: torch.Tensor | None, cos, sin, step: StepLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer over ``[tokens, hidden]``; returns (its output, the residual stream
    before it), whose sum the next norm takes (transformers adds them at the layer's end)."""
    attention, mlp = layer.self_attn, layer.mlp
    config = attention.config
    norm = layer.input_layernorm
    residual, normed = torch.ops.nasd.rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
    qkv = attention.qkv_proj(normed)
    if hasattr(attention, "q_norm"):
        qkv = normed_heads(attention, qkv, config.num_attention_heads, config.num_key_value_heads)
    query, key, value = torch.ops.nasd.rotary_split(
        qkv, cos, sin, config.num_attention_heads, config.num_key_value_heads
    )
    # [tokens, heads, D] -> [1, heads, tokens, D] views, transformers' layout for attention.
    attended, _ = paged_attention(
        attention,
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        None,
        scaling=attention.scaling,
        nasd_step=step,
    )
    hidden = attention.o_proj(attended.reshape(hidden.shape[0], -1))
    norm = layer.post_attention_layernorm
    residual, normed = torch.ops.nasd.rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
    return mlp.down_proj(torch.ops.nasd.silu_mul(mlp.gate_up_proj(normed))), residual


def normed_heads(attention, qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """``qkv`` ``[tokens, width]`` with each head's query and key through Qwen3's per-head RMSNorm
    (``q_norm``, ``k_norm``), as transformers applies them before rotary."""
    head_dim = attention.head_dim
    query_width, key_width = heads * head_dim, kv_heads * head_dim
    parts = []
    for norm, start, width in (
        (attention.q_norm, 0, query_width),
        (attention.k_norm, query_width, key_width),
    ):
        by_head = qkv[:, start : start + width].reshape(-1, head_dim)
        _, normed = torch.ops.nasd.rms_norm(by_head, None, norm.weight, norm.variance_epsilon)
        parts.append(normed.reshape(qkv.shape[0], width))
    return torch.cat([*parts, qkv[:, query_width + key_width :]], dim=1)


def layer_weights(model) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Every layer's norms (input, post-attention), blocks and block kinds (q/k/v, output, gate/up,
    down): ``decoder_layers``' arguments, gathered once per model."""
    state = model_state(model)
    if state.layer_weights is None:
        norms, blocks, kinds = [], [], []
        for layer in model.get_decoder().layers:
            attention, mlp = layer.self_attn, layer.mlp
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
                blocks.append(linear.blocks)
                kinds.append(linear.kind)
        state.layer_weights = (norms, blocks, kinds)
    return state.layer_weights


def all_layers_fused(
    model, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lean_layer`` over every layer in one C++ call (``native/csrc/decoder_ops.cpp``), for a step
    whose rows all go to the paged attention kernel."""
    config, kernel_rows, cache = model.config, step.kernel_rows, step.cache
    norms, blocks, kinds = layer_weights(model)
    attention = model.get_decoder().layers[0].self_attn
    return torch.ops.nasd.decoder_layers(
        hidden,
        cos,
        sin,
        norms,
        blocks,
        kinds,
        model.get_decoder().norm.variance_epsilon,
        config.num_attention_heads,
        config.num_key_value_heads,
        cache.keys,
        cache.values,
        step.write_slots,
        kernel_rows.block_table,
        kernel_rows.info,
        attention.scaling,
        cache.block_size,
        kernel_rows.keys_per_unit,
        model.nasd.int8_activations,
    )


@torch.inference_mode()
def lean_forward(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, step: StepLayout, keep: torch.Tensor
) -> torch.Tensor:
    """Logits ``[len(keep), vocab]`` of the step's positions ``keep`` (``input_ids`` and
    ``position_ids``: ``[tokens]``, the rows' packed new positions)."""
    decoder = model.get_decoder()
    hidden = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(hidden, position_ids.unsqueeze(0))
    # Every row in the paged attention kernel: no prompt chunk, padded batch or graph layout.
    all_kernel_rows = step.kernel_rows is not None and not step.segments
    fused = model.nasd.fused_layers and model.nasd.layers_fit_fused
    if fused and all_kernel_rows and step.batched_rows is None and step.paged_rows is None:
        hidden, residual = all_layers_fused(model, hidden, cos[0], sin[0], step)
    else:
        residual = None
        for layer in decoder.layers:
            hidden, residual = lean_layer(layer, hidden, residual, cos[0], sin[0], step)
    norm = decoder.norm
    _, normed = torch.ops.nasd.rms_norm(hidden[keep], residual[keep], norm.weight, norm.variance_epsilon)
    return model.lm_head(normed)
