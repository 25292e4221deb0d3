"""A user's own GGUF file as the model (``load_model("model.gguf", ModelConfig(dtype="gguf"))``).

The files are real GGUF files written here from the embedded one with gguf-py: the same
metadata, its first few layers and its tokenizer's first ``TINY_VOCAB`` tokens (the vocabulary's
rows cut to them), some weights re-quantized to other block types (the K-quants by
plain rounding here, as gguf-py has no quantizer for them). Weights whose type has a kernel
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K) are kept as the file's blocks (Q3_K is
covered by the kernel tests only: neither gguf-py nor these tests quantize to it); the others are
float32 as gguf-py reads them. Either way the model holds the file's own values, those of
transformers' float32 conversion (the reference here), and no float32 copy of the blocks is made.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nasd_core import SamplingParams, SpecConfig
from nasd_core.config import EngineConfig, ModelConfig, RunnerConfig
from nasd_core.engine.engine import Engine
from nasd_core.errors import ModelLoadError
from nasd_core.layers.cpu_kernels import invariant_threads
from nasd_core.layers.quantized import QuantLinear, QuantLinears, dequantize, set_int8_activations
from nasd_core.loader import load_model, resolve_model_dir
from nasd_core.loader.gguf_index import read_tensors
from nasd_core.runner.model_runner import ModelRunner, StepRow
from tests.nasd_core.random_gguf import SHAPES, embedded_reader, tokenizer_fields, write_random_gguf
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, FixedStepTimes, run_staggered
from tests.nasd_core.test_quantized import INT8_RELATIVE_ERROR, relative_error

Q = gguf.GGMLQuantizationType


def _min_max_k(weights: np.ndarray, top: int):
    """Q4_K / Q5_K's fields of ``weights`` ``[rows, 256 k]`` by a plain min / max rounding (gguf-py
    has no quantizer for them; llama.cpp's searches for better scales, which changes values, not
    the layout): d, dmin (float16), the 8 sub-blocks' 6-bit scales and mins, codes 0..top."""
    rows = weights.shape[0]
    x = weights.reshape(rows, -1, 8, 32).astype(np.float32)  # super-blocks of 8 sub-blocks
    low = np.maximum(0.0, -x.min(-1))  # w = d sc q - dmin m, with m >= 0
    step = (x.max(-1) + low) / top
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (low.max(-1, keepdims=True) / 63).astype(np.float16)
    scales = np.where(d > 0, np.rint(step / np.maximum(d, 1e-30)), 0).clip(0, 63).astype(np.uint8)
    mins = np.where(dmin > 0, np.rint(low / np.maximum(dmin, 1e-30)), 0).clip(0, 63).astype(np.uint8)
    d_sub = (d.astype(np.float32) * scales)[..., None]
    m_sub = (dmin.astype(np.float32) * mins)[..., None]
    q = np.where(d_sub > 0, np.rint((x + m_sub) / np.maximum(d_sub, 1e-30)), 0).clip(0, top).astype(np.uint8)
    packed = np.concatenate(
        [
            scales[..., :4] | ((scales[..., 4:] >> 4) << 6),
            mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
            (scales[..., 4:] & 0xF) | ((mins[..., 4:] & 0xF) << 4),
        ],
        axis=-1,
    )
    return [d.view(np.uint8), dmin.view(np.uint8), packed], q


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2i and 2i + 1's low 4 bits in one 32 bytes each (low and high nibbles)."""
    pairs = (q & 0xF).reshape(*q.shape[:2], 4, 2, 32)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Q4_K bytes of ``weights`` ``[rows, 256 k]``: d, dmin, scales and mins, 128 bytes of nibbles."""
    fields, q = _min_max_k(weights, 15)
    return np.concatenate([*fields, _nibble_pairs(q)], axis=-1).reshape(weights.shape[0], -1)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """Q5_K bytes: as Q4_K's, with 32 bytes of fifth bits (bit i of byte l: sub-block i's weight l)
    before the nibbles."""
    fields, q = _min_max_k(weights, 31)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2).astype(np.uint8)
    return np.concatenate([*fields, high, _nibble_pairs(q)], axis=-1).reshape(weights.shape[0], -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """Q6_K bytes of ``weights`` ``[rows, 256 k]`` (plain rounding, as ``quantize_q4_k``)."""
    rows = weights.shape[0]
    x = weights.reshape(rows, -1, 16, 16).astype(np.float32)  # super-blocks of 16 sub-blocks
    step = np.abs(x).max(-1) / 31
    d = (step.max(-1, keepdims=True) / 127).astype(np.float16)
    scales = np.where(d > 0, np.rint(step / np.maximum(d, 1e-30)), 0).clip(-128, 127).astype(np.int8)
    d_sub = d.astype(np.float32) * scales
    q = np.where(d_sub[..., None] > 0, np.rint(x / np.maximum(d_sub[..., None], 1e-30)), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # halves of 128, groups of 32
    low = np.concatenate(
        [
            (q[..., 0, :] & 0xF) | ((q[..., 2, :] & 0xF) << 4),
            (q[..., 1, :] & 0xF) | ((q[..., 3, :] & 0xF) << 4),
        ],
        axis=-1,
    )
    high = (
        (q[..., 0, :] >> 4)
        | ((q[..., 1, :] >> 4) << 2)
        | ((q[..., 2, :] >> 4) << 4)
        | ((q[..., 3, :] >> 4) << 6)
    )
    parts = [low.reshape(rows, -1, 128), high.reshape(rows, -1, 64), scales.view(np.uint8), d.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}
# A vocabulary's rows (the embedded model ties its output to the embedding).
VOCABULARY_TENSORS = ("token_embd.weight", "output.weight")
# The files' vocabulary: the embedded tokenizer's first tokens. Each load of a file with all 49k
# of them (and their merges) parsed its metadata for seconds, several times over.
TINY_VOCAB = 1024


def write_retyped_gguf(
    reader: gguf.GGUFReader, target: Path, retype: Callable[[str], Q | None], layers: int, vocab_size: int
) -> None:
    """A copy of ``reader``'s file with its first ``layers`` layers and ``vocab_size`` tokens
    (``tokenizer_fields``; the vocabulary's rows cut to them), whose tensors ``retype(name)``
    names a type for are re-quantized to it (from their dequantized values, rows in the file's
    order)."""
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), architecture)
    counts = {f"{architecture}.block_count": layers, f"{architecture}.vocab_size": vocab_size}
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
            continue  # the writer's own header fields; the tokenizer's below
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = counts[name] if name in counts else field.contents()
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for name, (value, value_type, sub_type) in tokenizer_fields(reader, vocab_size).items():
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        data, kind = np.array(tensor.data), tensor.tensor_type
        if tensor.name in VOCABULARY_TENSORS:
            data = data[:vocab_size]
        new_kind = retype(tensor.name)
        if new_kind is not None and new_kind != kind:
            values = gguf.quants.dequantize(data, kind)
            quantize = QUANTIZERS.get(new_kind, partial(gguf.quants.quantize, qtype=new_kind))
            data, kind = quantize(values), new_kind
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# The down projections' types, layer by layer in turn: the K-quants only fit them in this model
# (their inputs, 1536, are whole super-blocks of 256; the others' 576 are not).
DOWN_TYPES = [Q.Q6_K, Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q5_1]


def every_kernel_type(name: str) -> Q | None:
    """Every type with a kernel in one model: q, k, v, gate, up in Q8_0, the attention output in
    Q4_0, the down projections in ``DOWN_TYPES`` (a Q4_K_M file has Q4_K and Q6_K ones); the
    vocabulary stays the embedded Q8_0 and the norms float32."""
    if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight")):
        return Q.Q8_0
    if name.endswith("attn_output.weight"):
        return Q.Q4_0
    if name.endswith("ffn_down.weight"):
        return DOWN_TYPES[int(name.split(".")[1]) % len(DOWN_TYPES)]
    return None


def mixed_layers(name: str) -> Q | None:
    """The vocabulary in F16, a type with no kernel; the second layer's v in Q8_0 beside its Q4_1 q
    and k, and the third layer's up in Q4_0 beside its Q4_1 gate (as llama.cpp's Q4_K_M puts some
    layers' v in Q6_K beside Q4_K q and k): parts the lean decoder cannot merge into one matmul."""
    return {"token_embd.weight": Q.F16, "blk.1.attn_v.weight": Q.Q8_0, "blk.2.ffn_up.weight": Q.Q4_0}.get(
        name
    )


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    retypes = {"every_kernel_type": every_kernel_type, "mixed_layers": mixed_layers}
    files = {name: folder / f"{name}.gguf" for name in retypes}
    # As many layers as it takes to hold every down projection type: re-quantizing (in numpy) and
    # loading all 30 of the embedded model's took ~40 s more of this module's setup.
    for name, retype in retypes.items():
        write_retyped_gguf(embedded_reader(), files[name], retype, len(DOWN_TYPES), TINY_VOCAB)
    return files


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def file_models(gguf_files, cache_dir) -> dict[str, tuple]:
    """Each file's (model on its blocks, tokenizer, float32 conversion, log of the load)."""
    models = {}
    for name, path in gguf_files.items():
        float32 = ModelConfig(dtype="float32", cache_dir=cache_dir, cpu_fast_path=False)
        float32_conversion = partial(load_model, str(path), float32)
        # mixed_layers' float32 load first: its conversion (tokenizer included) then serves the
        # blocks' load too. every_kernel_type's blocks first: the cache then holds its config
        # and tokenizer alone (test_a_gguf_load_makes_no_float32_copy_of_the_blocks).
        reference = float32_conversion()[0] if name == "mixed_layers" else None
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = records.append
        logger = logging.getLogger("nasd_core.loader.gguf")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            model, tokenizer = load_model(str(path), ModelConfig(dtype="gguf", cache_dir=cache_dir))
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        if reference is None:
            reference = float32_conversion()[0]
        models[name] = (model, tokenizer, reference, " ".join(record.getMessage() for record in records))
    return models


def test_a_gguf_files_weights_are_its_own_blocks(file_models):
    model, _, reference, log = file_models["every_kernel_type"]
    for index, down in enumerate(DOWN_TYPES):
        layer = model.get_decoder().layers[index]
        linears = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        assert [linear.kind for linear in linears] == [Q.Q8_0, Q.Q4_0, Q.Q8_0, down]
    assert model.nasd.lean_decoder and model.nasd.layers_fit_fused, "one type per merged group: one C++ call"
    assert "float32" not in log
    for module_name, module in model.named_modules():
        if isinstance(module, QuantLinear) and not module_name.endswith(("qkv_proj", "gate_up_proj")):
            weight = reference.get_submodule(module_name).weight
            assert torch.equal(dequantize(module.blocks, module.kind), weight), module_name


def test_a_gguf_load_makes_no_float32_copy_of_the_blocks(file_models, cache_dir):
    """Only the norms are float32 in a file whose every weight has a kernel, and the cache holds
    the file's config and tokenizer, not a float32 conversion (an 8B file's would be ~32 GB)."""
    model, _, reference, _ = file_models["every_kernel_type"]
    config = model.config
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert sum(parameter.numel() for parameter in model.parameters()) == norms
    assert sum(parameter.numel() for parameter in reference.parameters()) > 1000 * norms
    converted = list(Path(cache_dir, "models").glob("every-kernel-type-*-config"))
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
    assert not list(converted[0].glob("*.safetensors"))


@pytest.mark.parametrize("name", ["every_kernel_type", "mixed_layers"])
def test_greedy_speculation_on_a_gguf_file_is_plain_decoding(file_models, name):
    """The C++ layer loop (every_kernel_type) and the Python one (mixed_layers' unmerged parts)."""
    model, tokenizer, _, _ = file_models[name]
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, invariant_threads(model)))
    try:
        prompts, max_tokens = PROMPTS[:4], MAX_TOKENS[:4]
        plain = []
        engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=1, prefill_chunk_tokens=16))
        for prompt, tokens in zip(prompts, max_tokens, strict=True):
            request_id = engine.add_request(prompt, SamplingParams(max_tokens=tokens), SpecConfig(mode="off"))
            while not engine.is_finished():
                engine.step()
            plain.append(engine.pop_result(request_id).token_ids)
        engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=4, prefill_chunk_tokens=16))
        engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free: auto verifies them
        outputs = run_staggered(engine, prompts, max_tokens, SpecConfig(mode="auto", num_draft_tokens=8))
    finally:
        torch.set_num_threads(before)
    assert [outputs[index] for index in range(len(prompts))] == plain
    assert engine.stats.num_accepted > 0, "speculation was not exercised"


@pytest.fixture(scope="module")
def file_readers(gguf_files) -> dict[str, gguf.GGUFReader]:
    return {name: gguf.GGUFReader(path) for name, path in gguf_files.items()}


def test_the_tensor_index_gives_each_tensor_as_gguf_py_reads_it(gguf_files, file_readers, tmp_path):
    """``read_tensors`` (what the blocks are loaded from) against gguf-py's reader, on files of
    F32, F16 and every block type written here; files that are no GGUF file, or a partial one,
    are refused."""
    kinds = set()
    for name, path in gguf_files.items():
        ours, theirs = read_tensors(path), file_readers[name].tensors
        assert [tensor.name for tensor in ours] == [tensor.name for tensor in theirs]
        for mine, reference in zip(ours, theirs, strict=True):
            assert mine.kind == int(reference.tensor_type), mine.name
            assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
            assert np.array_equal(mine.data, reference.data), mine.name
            kinds.add(mine.kind)
    assert kinds >= {Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    not_gguf = tmp_path / "not-a-model.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tensors(not_gguf)
    partial = tmp_path / "partial.gguf"
    partial.write_bytes(gguf_files["mixed_layers"].read_bytes()[:-4096])
    with pytest.raises(ValueError, match="ends inside tensor"):
        read_tensors(partial)


def test_types_without_a_kernel_keep_the_files_values_and_mixed_types_their_own_blocks(
    file_models, file_readers
):
    model, tokenizer, reference, log = file_models["mixed_layers"]
    assert "float32 for types without a kernel here: 1 F16" in log
    # The F16 vocabulary (tied to the output) is the file's values: gguf-py's reading of them.
    file_tensors = {tensor.name: tensor for tensor in file_readers["mixed_layers"].tensors}
    embedding = torch.from_numpy(np.array(file_tensors["token_embd.weight"].data, dtype=np.float32))
    assert torch.equal(model.get_decoder().embed_tokens.weight, embedding)
    assert not isinstance(model.lm_head, QuantLinear)  # tied to it: float32 (packed for oneDNN here)
    # Parts of two types stay apart, each on its own blocks; the lean layers run from Python.
    qkv, gate_up = (
        model.get_decoder().layers[1].self_attn.qkv_proj,
        model.get_decoder().layers[2].mlp.gate_up_proj,
    )
    assert isinstance(qkv, QuantLinears) and [part.kind for part in qkv.parts] == [Q.Q4_1, Q.Q4_1, Q.Q8_0]
    assert isinstance(gate_up, QuantLinears) and [part.kind for part in gate_up.parts] == [Q.Q4_1, Q.Q4_0]
    assert model.nasd.lean_decoder and not model.nasd.layers_fit_fused
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
    # The blocks' Linears round activations to int8 (ModelConfig.int8_activations) in every layer.
    assert relative_error(logits, expected) < 10 * INT8_RELATIVE_ERROR


@pytest.mark.parametrize(("architecture", "head_dim"), [("qwen2", None), ("qwen3", 32)])
def test_a_qwen_files_blocks_are_transformers_weights_and_greedy_speculation_is_exact(
    tmp_path, cache_dir, architecture, head_dim
):
    """Qwen files keep their rows in transformers' order (no rotary reordering to undo) and
    Qwen2's biases ride on the blocks' Linears. Both run the lean decoder's Python layer loop
    (the fused C++ one takes neither Qwen2's biases nor Qwen3's per-head norms), and the runner's
    steps give transformers' logits. A Qwen3 file's heads need not be 128 wide (the file's
    ``key_length``, which transformers' GGUF mapping reads only for Qwen3-MoE). Once the float32
    load has converted the file with its weights, its config and tokenizer come from there."""
    path = tmp_path / f"tiny-{architecture}-{head_dim}.gguf"
    shape = dataclasses.replace(SHAPES["tiny"], head_dim=head_dim)
    write_random_gguf(path, architecture, shape, vocab_size=TINY_VOCAB)
    model, tokenizer = load_model(str(path), ModelConfig(dtype="gguf", cache_dir=cache_dir))
    float32 = ModelConfig(dtype="float32", cache_dir=cache_dir, cpu_fast_path=False)
    reference, _ = load_model(str(path), float32)
    assert model.config.model_type == architecture
    assert head_dim is None or model.config.head_dim == reference.config.head_dim == head_dim
    # The float32 load converted the file with its weights: config and tokenizer now come from there.
    full = resolve_model_dir(str(path), cache_dir)
    assert resolve_model_dir(str(path), cache_dir, weights=False) == full
    assert model.nasd.lean_decoder and not model.nasd.layers_fit_fused
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear) and not name.endswith(("qkv_proj", "gate_up_proj"))
    }
    assert len(linears) == 2 * 7 + 1  # every projection, and the output on the vocabulary's blocks
    for name, linear in linears.items():
        expected = reference.get_submodule(name)
        assert torch.equal(dequantize(linear.blocks, linear.kind), expected.weight), name
        assert (linear.bias is None) == (expected.bias is None), name
        assert linear.bias is None or torch.equal(linear.bias, expected.bias), name
    # With float activations the blocks' Linears are the reference's to float32 rounding (a random
    # model's activations are too far from a trained one's for the int8 rounding's bound).
    ids = tokenizer("The capital of France is Paris; of Italy,", return_tensors="pt").input_ids
    loaded = model.nasd.int8_activations
    set_int8_activations(model, False)
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
    assert relative_error(logits, expected) < 1e-5
    runner = ModelRunner(model, RunnerConfig(kv_cache_tokens=64, block_size=16, kv_cache_dtype="float32"))
    runner.cache.allocate(0, ids.shape[1])
    stepped = torch.cat(
        [
            runner.forward([StepRow(0, ids[0, :4].tolist(), 4)]),
            runner.forward([StepRow(0, ids[0, 4:].tolist(), 2)]),
        ]
    )
    torch.testing.assert_close(stepped, torch.cat([logits[0, :4], logits[0, -2:]]), atol=2e-4, rtol=1e-4)
    set_int8_activations(model, loaded)
    prompts, max_tokens = PROMPTS[:3], [24, 16, 20]
    plain = run_staggered(Engine(model, tokenizer), prompts, max_tokens, SpecConfig(mode="off"))
    drafted = run_staggered(Engine(model, tokenizer), prompts, max_tokens, SpecConfig(mode="on"))
    assert drafted == plain


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "absent.gguf"), ModelConfig(dtype="gguf"))
