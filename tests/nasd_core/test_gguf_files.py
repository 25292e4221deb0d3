"""A user's own GGUF file as the model (``load_model("model.gguf", ModelConfig(dtype="gguf"))``).

The files are real GGUF files written here from the embedded one with gguf-py: the same
metadata (tokenizer included), some weights re-quantized to other block types. Weights whose
type has a kernel (Q4_0, Q4_1, Q8_0) are kept as the file's blocks; the others keep the float32
values transformers converts the file to. Either way the model holds the file's own values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nasd_core import SamplingParams, SpecConfig
from nasd_core.config import EngineConfig, ModelConfig
from nasd_core.engine.engine import Engine
from nasd_core.errors import ModelLoadError
from nasd_core.model.cpu_kernels import invariant_threads
from nasd_core.model.quantized import QuantEmbedding, QuantLinear, dequantize
from nasd_core.models import embedded_gguf_path, load_model
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, run_staggered
from tests.nasd_core.test_quantized import INT8_RELATIVE_ERROR, relative_error

Q = gguf.GGMLQuantizationType


def write_retyped_gguf(source: Path, target: Path, retype: Callable[[str], Q | None]) -> None:
    """A copy of ``source`` whose tensors ``retype(name)`` names a type for are re-quantized to it
    (from their dequantized values, rows in the file's order)."""
    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer's own header fields
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data, kind = np.array(tensor.data), tensor.tensor_type
        new_kind = retype(tensor.name)
        if new_kind is not None and new_kind != kind:
            data, kind = gguf.quants.quantize(gguf.quants.dequantize(data, kind), new_kind), new_kind
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def mixed_types(name: str) -> Q | None:
    """q, k, v, gate, up in Q8_0 and the attention output in Q4_0: every kernel type in one model
    (down stays the embedded Q4_1, the vocabulary Q8_0)."""
    if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight")):
        return Q.Q8_0
    return Q.Q4_0 if name.endswith("attn_output.weight") else None


def some_without_a_kernel(name: str) -> Q | None:
    """The first layer's down projection in Q5_0 and the vocabulary in F16: types with no kernel."""
    return {"blk.0.ffn_down.weight": Q.Q5_0, "token_embd.weight": Q.F16}.get(name)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    files = {"mixed": folder / "mixed.gguf", "no_kernel": folder / "no-kernel.gguf"}
    write_retyped_gguf(embedded_gguf_path(), files["mixed"], mixed_types)
    write_retyped_gguf(embedded_gguf_path(), files["no_kernel"], some_without_a_kernel)
    return files


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def mixed_model(gguf_files, cache_dir):
    return load_model(str(gguf_files["mixed"]), ModelConfig(dtype="gguf", cache_dir=cache_dir))


def test_a_gguf_files_weights_are_its_own_blocks(mixed_model, gguf_files, cache_dir):
    model, _ = mixed_model
    reference, _ = load_model(str(gguf_files["mixed"]), ModelConfig(cache_dir=cache_dir, cpu_fast_path=False))
    layer = model.get_decoder().layers[3]
    kinds = {
        name: layer.get_submodule(name).kind
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj")
    }
    assert kinds == {
        "self_attn.qkv_proj": int(Q.Q8_0),
        "self_attn.o_proj": int(Q.Q4_0),
        "mlp.down_proj": int(Q.Q4_1),
    }
    assert getattr(model, "nasd_lean_decoder", False), "every Linear has a kernel: the lean decoder runs"
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and not name.endswith(("qkv_proj", "gate_up_proj")):
            assert torch.equal(
                dequantize(module.blocks, module.kind), reference.get_submodule(name).weight
            ), name


def test_greedy_speculation_on_a_gguf_file_is_plain_decoding(mixed_model):
    model, tokenizer = mixed_model
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
        outputs = run_staggered(engine, prompts, max_tokens, SpecConfig(mode="auto", num_draft_tokens=8))
    finally:
        torch.set_num_threads(before)
    assert [outputs[index] for index in range(len(prompts))] == plain
    assert engine.stats.num_accepted > 0, "speculation was not exercised"


def test_types_without_a_kernel_keep_the_files_float_values(gguf_files, cache_dir, caplog):
    path = str(gguf_files["no_kernel"])
    with caplog.at_level(logging.INFO, logger="nasd_core.model.quantized"):
        model, tokenizer = load_model(
            path, ModelConfig(dtype="gguf", cache_dir=cache_dir, cpu_fast_path=False)
        )
    assert "1 Q5_0" in caplog.text and "1 F16" in caplog.text
    reference, _ = load_model(path, ModelConfig(cache_dir=cache_dir, cpu_fast_path=False))
    down = model.get_decoder().layers[0].mlp.down_proj
    assert type(down) is torch.nn.Linear and torch.equal(
        down.weight, reference.get_decoder().layers[0].mlp.down_proj.weight
    )
    assert not isinstance(model.get_decoder().embed_tokens, QuantEmbedding)
    assert isinstance(model.get_decoder().layers[1].mlp.down_proj, QuantLinear)
    assert not getattr(model, "nasd_lean_decoder", False), "a float Linear: transformers' forward runs"
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
    # The blocks' Linears round activations to int8 (quantized.INT8_ACTIVATIONS); 30 layers of it.
    assert relative_error(logits, expected) < 10 * INT8_RELATIVE_ERROR


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "absent.gguf"), ModelConfig(dtype="gguf"))
