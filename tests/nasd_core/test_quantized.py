"""The embedded model with its GGUF blocks kept quantized (``ModelConfig(dtype="gguf")``).

The reference is the quantized model itself: its weights are the GGUF reference's block values,
equal bit for bit to the float32 weights the embedded model converts to; a row's logits do not
depend on the step it rides in, so greedy speculation is token-identical to plain decoding, and
sampled rows keep the quantized model's distribution. Greedy identity is checked with
``deterministic=True``, which fixes attention's split as well.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional

from nasd_core import SamplingParams, SpecConfig
from nasd_core.config import EngineConfig, ModelConfig
from nasd_core.engine.engine import Engine
from nasd_core.errors import ModelLoadError
from nasd_core.model.cpu_kernels import invariant_threads
from nasd_core.model.quantized import BLOCK_FORMATS, QuantEmbedding, QuantLinear, dequantize
from nasd_core.models import load_model
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, run_staggered
from tests.nasd_core.test_generate import assert_sampling_matches_transformers

KINDS = sorted(BLOCK_FORMATS)


@pytest.fixture(scope="module")
def invariant_threads_only(gguf_model):
    """Deterministic mode's thread bound for this model (cpu_kernels.invariant_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, invariant_threads(gguf_model)))
    yield
    torch.set_num_threads(before)


def random_blocks(kind: int, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    weights = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType(kind)))


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_block_values_are_the_gguf_references(kind):
    blocks = random_blocks(kind, 24, 96)
    reference = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(kind))
    assert torch.equal(dequantize(blocks, kind), torch.from_numpy(reference))


def with_threads(count: int, compute):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return compute()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_kernel_multiplies_by_the_block_values_exactly(kind):
    """One-hot inputs read each weight back: the kernel's block values are the reference's bits."""
    blocks = random_blocks(kind, 37, 96)
    linear = QuantLinear(blocks, kind, 96)
    assert linear.native, "the C++ kernel did not build"
    assert torch.equal(linear(torch.eye(96)).T, dequantize(blocks, kind))


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_a_rows_output_bits_depend_neither_on_the_other_rows_nor_on_the_threads(kind):
    """Every row count a step can have (1 to 17, and a prompt chunk's 70), on 1 and 2 threads, an
    odd number of outputs (a tile's leftover): each row's output is the same bits as that row
    multiplied alone on one thread, and equals float32 linear up to rounding."""
    linear = QuantLinear(random_blocks(kind, 101, 160), kind, 160)
    assert linear.native, "the C++ kernel did not build"
    inputs = torch.randn(70, 160, generator=torch.Generator().manual_seed(1))
    alone = with_threads(1, lambda: torch.cat([linear(inputs[row : row + 1]) for row in range(70)]))
    for threads in (1, 2):
        for rows in [*range(1, 18), 70]:
            together = with_threads(threads, lambda rows=rows: linear(inputs[:rows]))
            assert torch.equal(together, alone[:rows]), f"{rows} rows on {threads} threads"
    torch.testing.assert_close(alone, functional.linear(inputs, dequantize(linear.blocks, kind)))


def test_kernel_keeps_leading_dimensions_and_takes_no_rows():
    linear = QuantLinear(random_blocks(3, 8, 64), 3, 64)
    assert linear(torch.randn(2, 3, 64)).shape == (2, 3, 8)
    assert linear(torch.randn(0, 64)).shape == (0, 8)
    with pytest.raises(ValueError, match="bytes per output"):
        QuantLinear(random_blocks(3, 8, 64), 3, 96)


def test_without_the_kernel_the_same_module_dequantizes():
    linear = QuantLinear(random_blocks(3, 40, 96), 3, 96)
    assert linear.native, "the C++ kernel did not build"
    inputs = torch.randn(5, 96)
    native = linear(inputs)
    linear.native = False
    torch.testing.assert_close(linear(inputs), native)


def test_the_quantized_model_holds_the_converted_weights_bit_for_bit(gguf_model, stock_model):
    """Every Linear (q and k rows back in transformers' rotary order) and the tied embedding."""
    modules = gguf_model.named_modules()
    quantized = {name: module for name, module in modules if isinstance(module, QuantLinear)}
    # The lean decoder's merged projections, whose parts are views of them.
    merged = [quantized.pop(name) for name in list(quantized) if name.endswith(("qkv_proj", "gate_up_proj"))]
    assert len(merged) == 2 * gguf_model.config.num_hidden_layers
    assert len(quantized) == 7 * gguf_model.config.num_hidden_layers + 1
    for name, module in quantized.items():
        weight = stock_model.get_submodule(name).weight
        assert torch.equal(dequantize(module.blocks, module.kind), weight), name
    embedding = gguf_model.get_decoder().embed_tokens
    assert isinstance(embedding, QuantEmbedding)
    ids = torch.tensor([[0, 17, 49151]])
    assert torch.equal(embedding(ids), stock_model.get_decoder().embed_tokens(ids))
    assert sum(module.blocks.numel() for module in quantized.values()) < 100e6  # bytes, against 538e6


def test_without_the_kernel_gguf_loads_the_float32_weights(monkeypatch, caplog):
    import nasd_core.models

    monkeypatch.setattr(nasd_core.models, "quant_kernel_available", lambda: False)
    model = load_model(config=ModelConfig(dtype="gguf"))[0]
    assert not any(isinstance(module, (QuantLinear, QuantEmbedding)) for module in model.modules())
    assert "using float32" in caplog.text


def test_gguf_is_for_the_embedded_model_on_a_cpu():
    with pytest.raises(ModelLoadError, match="gguf"):
        load_model("some/hub-model", ModelConfig(dtype="gguf"))


@pytest.fixture(scope="module")
def plain_runs(gguf_model, tokenizer, invariant_threads_only) -> list[list[int]]:
    """Each prompt decoded alone, one token a step."""
    engine = Engine(gguf_model, tokenizer, EngineConfig(max_batch_rows=1, deterministic=True))
    outputs = []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS, strict=True):
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), SpecConfig(mode="off"))
        while not engine.is_finished():
            engine.step()
        outputs.append(engine.pop_result(request_id).token_ids)
    return outputs


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_greedy_output_is_plain_decodings_in_any_batch(
    gguf_model, tokenizer, plain_runs, invariant_threads_only, mode
):
    """Prompts joining and leaving a batch of up to 6 rows, prompt chunks beside verification."""
    config = EngineConfig(max_batch_rows=6, prefill_chunk_tokens=16, deterministic=True)
    engine = Engine(gguf_model, tokenizer, config)
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, SpecConfig(mode=mode, num_draft_tokens=8))
    mismatches = [index for index, expected in enumerate(plain_runs) if outputs[index] != expected]
    assert not mismatches, f"prompts {mismatches} differ from plain decoding"
    assert engine.stats.num_accepted > 0, "speculation was not exercised"


def test_sampling_keeps_the_quantized_models_distribution(gguf_model, tokenizer):
    """Speculative sampling against transformers' sampler, both on the quantized model."""
    assert_sampling_matches_transformers(gguf_model, tokenizer)
