"""Decoder layers compiled once for every step shape, their projections merged.

Why: between two attention calls transformers runs about fifteen small kernels a layer (RMSNorm's
five, rotary's dozen, separate q, k and v and gate and up projections, SiLU and its product), each
reading and writing its activations once. A CUDA graph replays those launches cheaply but not their
memory traffic: a 1.5B model's graphed step cost 4.98 ms on an H200 where reading its weights takes
0.74. Inductor fuses the pointwise work (RMSNorm with its residual add, rotary, SiLU times up), and
the projections that read one input become one matmul (q, k and v; gate and up), as in vLLM and
gpt-fast.

How: attention stays outside the compiled code (``attention.paged_attention`` is
``torch.compiler.disable``d: its paged kernel is compiled on its own, and it reads the step's layout,
which no compiled graph may specialise on), so a layer compiles as the pieces before and after its
attention. Every layer runs the same code on its own weights, so one compilation, dynamic in the
number of tokens, serves every layer, every fixed shape and the packed path's prompt chunks. The
runner's graphs capture the compiled pieces; inductor's own CUDA graphs stay off (vLLM does the same).
"""

from __future__ import annotations

import logging
import sys
import types

import torch
from torch import nn

from nasd_core.layers.model_state import model_state
from nasd_core.layers.quantized import QuantLinear, QuantLinears
from nasd_core.native.cache import keep_compiled_kernels

logger = logging.getLogger(__name__)

# Model types whose attention and MLP ``merge_projections`` rewrites (their transformers code is
# that of Llama, plus a bias on q, k and v for Qwen2 and a per-head RMSNorm of q and k for Qwen3).
COMPILED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def merged_linear(linears: list[nn.Module]) -> nn.Module:
    """One Linear computing ``linears`` side by side; theirs become views of its weight and bias,
    so the model holds each weight once (its state dict gains the merged entries). GGUF-block
    Linears of one block type merge into one ``QuantLinear`` the same way; of several types, into
    ``QuantLinears`` (one multiply per part, outputs concatenated)."""
    first = linears[0]
    if isinstance(first, QuantLinear) and len({linear.kind for linear in linears}) > 1:
        return QuantLinears(linears)
    if isinstance(first, QuantLinear):
        biases = [linear.bias for linear in linears]
        if any(bias is None for bias in biases) and any(bias is not None for bias in biases):
            return QuantLinears(linears)  # some with a bias, some without: side by side
        bias = None if biases[0] is None else torch.cat(biases)
        blocks = torch.cat([linear.blocks for linear in linears])
        merged = QuantLinear(blocks, first.kind, first.in_features, bias, first.int8_activations)
        start = 0
        for linear in linears:
            end = start + linear.out_features
            linear.blocks = merged.blocks[start:end]
            if bias is not None:
                linear.bias = merged.bias[start:end]
            start = end
        return merged
    has_bias = first.bias is not None
    # On the meta device: no weights initialised only to be replaced.
    merged = nn.Linear(
        first.in_features, sum(linear.out_features for linear in linears), bias=has_bias, device="meta"
    )
    with torch.no_grad():
        merged.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
        if has_bias:
            merged.bias = nn.Parameter(torch.cat([linear.bias for linear in linears]), requires_grad=False)
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(merged.weight[start:end], requires_grad=False)
        if has_bias:
            linear.bias = nn.Parameter(merged.bias[start:end], requires_grad=False)
        start = end
    return merged


def merged_attention_forward(
    self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None, **kwargs
):
    """transformers' Llama / Mistral / Qwen2 / Qwen3 attention with one q, k, v projection."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = self.qkv_proj(hidden_states).split(self.nasd_qkv_sizes, dim=-1)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head before rotary
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings
    query, key = self.nasd_rotary(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.nasd_eager)
    # Qwen2 / Qwen3 keep a window per layer; Mistral passes its config's.
    if hasattr(self, "sliding_window"):
        sliding_window = self.sliding_window
    else:
        sliding_window = getattr(self.config, "sliding_window", None)
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    output, weights = attention(
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def merged_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def merge_projections(model) -> None:
    """Rewrite each decoder layer to run one q, k, v matmul and one gate, up matmul (idempotent:
    the lean decoder merges them at load, compiled layers again at the runner)."""
    if model.config.model_type not in COMPILED_MODEL_TYPES:
        served = sorted(COMPILED_MODEL_TYPES)
        raise ValueError(f"compiled layers serve model types {served}, not {model.config.model_type!r}")
    layers = model.get_decoder().layers
    if all(hasattr(layer.self_attn, "qkv_proj") for layer in layers):
        return
    for layer in layers:  # all checked before any is changed
        attention, mlp = layer.self_attn, layer.mlp
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
        plain = all(type(linear) is nn.Linear for linear in linears)
        quantized = all(isinstance(linear, QuantLinear) for linear in linears)
        if not (plain or quantized):
            raise ValueError(
                "compiled layers need plain nn.Linear projections (not the CPU's packed ones) or GGUF blocks"
            )
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        attention.nasd_qkv_sizes = [linear.out_features for linear in projections]
        attention.qkv_proj = merged_linear(projections)
        source = sys.modules[type(attention).__module__]
        attention.nasd_rotary = source.apply_rotary_pos_emb
        attention.nasd_eager = source.eager_attention_forward
        attention.forward = types.MethodType(merged_attention_forward, attention)
        mlp.gate_up_proj = merged_linear([mlp.gate_proj, mlp.up_proj])
        mlp.forward = types.MethodType(merged_mlp_forward, mlp)


def compile_layers(model) -> str | None:
    """Merge ``model``'s projections and compile its decoder layers for all of them at once (the
    number of tokens is a dynamic dimension; dynamo compiles one token apart), checked on
    forwards of both. Idempotent. Compiled kernels are kept on disk for the next start
    (``native.cache.keep_compiled_kernels``).

    Returns None, or why the layers run uncompiled (their projections stay merged)."""
    state = model_state(model)
    if not state.compile_tried:
        merge_projections(model)
        keep_compiled_kernels()
        layers = model.get_decoder().layers
        for layer in layers:
            layer.compile(dynamic=True)
        try:
            with torch.inference_mode():
                for num_tokens in (3, 1):
                    tokens = torch.ones(1, num_tokens, dtype=torch.long, device=model.device)
                    model.get_decoder()(input_ids=tokens, use_cache=False)
        except Exception as exc:  # an op inductor cannot lower or a compiler missing on this host
            for layer in layers:
                layer._compiled_call_impl = None
            state.compile_failure = f"{type(exc).__name__}: {exc}"[:500]
            logger.warning("decoder layers run uncompiled: %s", state.compile_failure)
        state.compile_tried = True
    return state.compile_failure
