"""A GGUF file's tensors as a transformers model whose Linears keep the file's blocks
(``gguf_model``, for ``ModelConfig(dtype="gguf")``): llama, Qwen2 and Qwen3 files, each tensor
read (``gguf_index``) and, for the types the kernels take in another layout, repacked into blocks
of 32 holding the same values (``repack``; ``layers.quantized`` multiplies by them)."""

from __future__ import annotations

import functools
import itertools
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from nasd_core.layers.quantized import BLOCK_FORMATS, FILE_BLOCKS, QuantEmbedding, QuantLinear
from nasd_core.loader.gguf_index import read_tensors

logger = logging.getLogger(__name__)

# Models whose GGUF tensors gguf_model knows (other files load as float32) -> whether llama.cpp's
# converter reordered their query and key rows for its rotary layout (llama's does; Qwen's keep
# transformers' order, as transformers' GGUF loader assumes too).
GGUF_MODEL_TYPES = {"llama": True, "qwen2": False, "qwen3": False}
# A layer's GGUF tensor names (llama.cpp's for these architectures) -> the transformers module they become.
LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ...and the norms a layer has of these (Qwen3 normalises each head's query and key).
LAYER_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def _unpermute_rows(blocks: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion, which reorders each query/key head's rows for its rotary
    layout (transformers' GGUF loader applies the same reverse permutation)."""
    rows = blocks.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
    return blocks[order].contiguous()


def _float16(fields: np.ndarray) -> np.ndarray:
    """Float16 fields (2 bytes on the last axis) as float32."""
    return fields.copy().view(np.float16).astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes as their 8 sub-blocks' 6-bit scales and mins (ggml's
    get_scale_min_k4)."""
    scales = np.concatenate(
        [packed[..., 0:4] & 63, (packed[..., 8:12] & 0xF) | ((packed[..., 0:4] >> 6) << 4)], -1
    )
    mins = np.concatenate(
        [packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1
    )
    return scales, mins


def _with_float_scales(rows: int, scales: list[np.ndarray], codes: np.ndarray) -> np.ndarray:
    """Blocks of float32 fields (each [rows, blocks] float32) then the codes ([rows, blocks, n] bytes)."""
    fields = [field.astype(np.float32).reshape(rows, -1, 1).view(np.uint8) for field in scales]
    return np.ascontiguousarray(np.concatenate([*fields, codes.astype(np.uint8)], axis=-1).reshape(rows, -1))


def _repack_q4_k(blocks: np.ndarray) -> np.ndarray:
    """d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: w = d sc q - dmin m."""
    rows = blocks.shape[0]
    scales, mins = _k_scales(blocks[..., 4:16])
    # Each 32 bytes hold sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles).
    quads = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    codes = np.concatenate([quads & 0xF, quads >> 4], axis=3).reshape(rows, -1, 32)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # Q4_1's order: byte j = weights j, j + 16
    return _with_float_scales(
        rows, [_float16(blocks[..., 0:2]) * scales, -(_float16(blocks[..., 2:4]) * mins)], nibbles
    )


def _repack_q5_k(blocks: np.ndarray) -> np.ndarray:
    """d, dmin, 12 bytes of scales and mins, 32 bytes of high bits (bit i of byte l: sub-block i's
    weight l), 128 of nibbles as Q4_K's: w = d sc q - dmin m."""
    rows = blocks.shape[0]
    scales, mins = _k_scales(blocks[..., 4:16])
    quads = blocks[..., 48:].reshape(rows, -1, 4, 1, 32)
    low = np.concatenate([quads & 0xF, quads >> 4], axis=3).reshape(rows, -1, 8, 32)
    high = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., sub-block, weight]
    codes = (low | (high << 4)).reshape(rows, -1, 32)
    return _with_float_scales(
        rows, [_float16(blocks[..., 0:2]) * scales, -(_float16(blocks[..., 2:4]) * mins)], codes
    )


def _repack_q5_01(blocks: np.ndarray, with_offset: bool) -> np.ndarray:
    """d (Q5_1: and m) in float16, 32 high bits (bit j: weight j), 16 bytes of nibbles (byte j:
    weights j, j + 16): w = (q - 16) d (Q5_0) or q d + m (Q5_1)."""
    rows = blocks.shape[0]
    at = 4 if with_offset else 2
    bits = np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little")  # [.., 32]
    nibbles = blocks[..., at + 4 :]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1) | (bits << 4)
    d = _float16(blocks[..., 0:2])[..., 0]
    offset = _float16(blocks[..., 2:4])[..., 0] if with_offset else -16 * d
    return _with_float_scales(rows, [d, offset], codes)


def _repack_q3_k(blocks: np.ndarray) -> np.ndarray:
    """32 bytes of high bits (bit j of byte l: weight l of the j-th 32), 64 bytes of low bit pairs
    (pair i of byte l: weight l of the i-th 32 of its half), 12 bytes of 6-bit scales, d
    (float16): w = d (sc - 32) (q - 4), with q - 4 in -4..3 (ggml's dequantize_row_q3_K)."""
    rows = blocks.shape[0]
    high = blocks[..., 0:32]
    low = blocks[..., 32:96].reshape(rows, -1, 2, 32)
    packed = blocks[..., 96:108].astype(np.int16)
    first, second, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = (
        np.concatenate(
            [
                (first & 0xF) | ((top & 3) << 4),
                (second & 0xF) | (((top >> 2) & 3) << 4),
                (first >> 4) | (((top >> 4) & 3) << 4),
                (second >> 4) | (((top >> 6) & 3) << 4),
            ],
            axis=-1,
        )
        - 32
    )  # [.., super-block, 16]: two for each 32 weights, in order
    groups = [
        ((low[..., group // 4, :] >> (2 * (group % 4))) & 3).astype(np.int16)
        - 4 * (1 - ((high >> group) & 1))
        for group in range(8)
    ]
    codes = np.stack(groups, axis=2).astype(np.int8).reshape(rows, -1, 32)
    halves = (_float16(blocks[..., 108:110]) * scales).reshape(rows, -1, 2)
    return _with_float_scales(rows, [halves[..., 0], halves[..., 1]], codes.view(np.uint8))


def _repack_q6_k(blocks: np.ndarray) -> np.ndarray:
    """128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (float16): w = d sc (q - 32)."""
    rows = blocks.shape[0]
    low = blocks[..., :128].reshape(rows, -1, 2, 2, 32)  # [.., half of 128, first / second 32 bytes, 32]
    high = blocks[..., 128:192].reshape(rows, -1, 2, 32)
    groups = [
        (low[..., 0, :] & 0xF) | ((high & 3) << 4),
        (low[..., 1, :] & 0xF) | (((high >> 2) & 3) << 4),
        (low[..., 0, :] >> 4) | (((high >> 4) & 3) << 4),
        (low[..., 1, :] >> 4) | (((high >> 6) & 3) << 4),
    ]
    codes = (np.stack(groups, axis=3).astype(np.int16) - 32).astype(np.int8).reshape(rows, -1, 32)
    scales = blocks[..., 192:208].copy().view(np.int8).reshape(rows, -1, 2, 4, 2)
    halves = _float16(blocks[..., 208:210])[..., None, None] * scales  # [.., half, group, 2]
    return _with_float_scales(rows, [halves[..., 0], halves[..., 1]], codes.view(np.uint8))


_REPACKS = {
    6: functools.partial(_repack_q5_01, with_offset=False),
    7: functools.partial(_repack_q5_01, with_offset=True),
    11: _repack_q3_k,
    12: _repack_q4_k,
    13: _repack_q5_k,
    14: _repack_q6_k,
}


def repack(raw: np.ndarray, kind: int) -> np.ndarray:
    """A Q5_0 / Q5_1 / Q3_K / Q4_K / Q5_K / Q6_K tensor's file bytes ``[rows, bytes]`` as the kernels'
    blocks of 32 (``BLOCK_FORMATS``), holding the same weights (ggml's dequantize_row_*: each
    product of a float16 scale and an integer scale of magnitude at most 128 is exact in float32;
    a zero weight may come out +0 where ggml gives -0)."""
    return _REPACKS[kind](raw.reshape(raw.shape[0], -1, FILE_BLOCKS[kind][1]))


def _gguf_tensors(gguf_path: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """Every tensor of the file: name -> (values, type id). The values of a type with a kernel
    here are its blocks ``[rows, bytes]`` (repacked where ``FILE_BLOCKS`` says); any other type's
    are float32, as gguf-py reads them (exact for F32 / F16 / BF16, its dequantization else)."""
    import gguf

    tensors = {}
    for tensor in read_tensors(gguf_path):
        kind = tensor.kind
        if kind in FILE_BLOCKS:
            values = torch.from_numpy(repack(np.asarray(tensor.data), kind))
        elif kind in BLOCK_FORMATS:
            values = torch.from_numpy(np.array(tensor.data))
        else:
            values = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, kind), dtype=np.float32))
        tensors[tensor.name] = (values, kind)
    return tensors


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module``'s submodule at ``path``, or None where it has none."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _type_name(kind: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def gguf_model(config, gguf_path: Path) -> nn.Module:
    """The transformers model of ``config`` (a llama, Qwen2 or Qwen3 converted from
    ``gguf_path``: ``GGUF_MODEL_TYPES``) with the file's own tensors: each Linear and the token
    embedding on its blocks where its type has a kernel here, any other weight (norms, biases,
    Q2_K, IQ*, F16...) float32 as gguf-py reads it.

    Built on the meta device and filled from the file, so no float32 copy of the blocks is ever
    made: an 8B Q4_K_M file's float32 conversion alone is ~32 GB, its blocks ~5 GB. A llama's
    query and key rows are put back in transformers' order (``_unpermute_rows``), as its GGUF
    loader does.

    Raises:
        ValueError: the architecture is not one of those, the file lacks a weight the model has,
            or a weight has another shape than the model's.
    """
    from transformers import AutoModelForCausalLM

    if config.model_type not in GGUF_MODEL_TYPES:
        raise ValueError(
            f"GGUF blocks are kept for {', '.join(GGUF_MODEL_TYPES)} files, not {config.model_type!r}"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = _gguf_tensors(gguf_path)
    decoder = model.model
    replaced, kept = 0, Counter()

    def values_of(key: str, rows: int, heads: int | None = None) -> tuple[torch.Tensor, int]:
        if key not in tensors:
            raise ValueError(f"{gguf_path.name} has no {key}")
        values, kind = tensors.pop(key)
        if values.shape[0] != rows:
            raise ValueError(f"{key} has {values.shape[0]} rows where the model has {rows}")
        if kind not in BLOCK_FORMATS and values.dim() == 2:
            kept[_type_name(kind)] += 1
        return (values if heads is None else _unpermute_rows(values, heads)), kind

    def weight(values: torch.Tensor, kind: int, shape: torch.Size) -> nn.Parameter:
        if kind in BLOCK_FORMATS or values.shape != shape:
            raise ValueError(f"a {_type_name(kind)} tensor of shape {tuple(values.shape)} for {tuple(shape)}")
        return nn.Parameter(values, requires_grad=False)

    permuted = GGUF_MODEL_TYPES[config.model_type]
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads} if permuted else {}
    for index, layer in enumerate(decoder.layers):
        for gguf_name, module_path in LAYER_LINEARS.items():
            parent_name, child_name = module_path.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, child_name)
            key = f"blk.{index}.{gguf_name}"
            values, kind = values_of(f"{key}.weight", linear.out_features, heads.get(gguf_name))
            bias = None
            if linear.bias is not None:
                # llama.cpp reorders a bias's rows with its weight's.
                bias_values = values_of(f"{key}.bias", linear.out_features, heads.get(gguf_name))
                bias = weight(*bias_values, linear.bias.shape)
            if kind in BLOCK_FORMATS:
                setattr(parent, child_name, QuantLinear(values, kind, linear.in_features, bias))
                replaced += 1
            else:
                linear.weight = weight(values, kind, linear.weight.shape)
                linear.bias = bias
        for gguf_name, module_path in LAYER_NORMS.items():
            norm = _submodule(layer, module_path)
            if norm is not None:
                values = values_of(f"blk.{index}.{gguf_name}.weight", norm.weight.shape[0])
                norm.weight = weight(*values, norm.weight.shape)
    decoder.norm.weight = weight(
        *values_of("output_norm.weight", config.hidden_size), decoder.norm.weight.shape
    )
    embedding = values_of("token_embd.weight", config.vocab_size)
    if embedding[1] in BLOCK_FORMATS:
        decoder.embed_tokens = QuantEmbedding(*embedding, config.hidden_size)
        replaced += 1
    else:
        decoder.embed_tokens.weight = weight(*embedding, decoder.embed_tokens.weight.shape)
    if "output.weight" in tensors:
        output = values_of("output.weight", config.vocab_size)
    elif config.tie_word_embeddings:
        output = embedding
    else:
        raise ValueError(f"{gguf_path.name} has no output.weight")
    if output[1] in BLOCK_FORMATS:
        model.lm_head = QuantLinear(*output, config.hidden_size)
        replaced += 1
    elif output is embedding:
        model.lm_head.weight = decoder.embed_tokens.weight
    else:
        model.lm_head.weight = weight(*output, model.lm_head.weight.shape)
    # The rotary frequencies are computed, not stored: built again off the meta device.
    decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
    left = [
        name
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
        if tensor.is_meta
    ]
    if left:
        raise ValueError(f"{gguf_path.name} leaves {', '.join(left[:4])} of the model unset")
    float_weights = ", ".join(f"{count} {name}" for name, count in sorted(kept.items()))
    logger.info(
        "kept %d weights of %s as GGUF blocks%s",
        replaced,
        gguf_path.name,
        f"; float32 for types without a kernel here: {float_weights}" if kept else "",
    )
    return model
