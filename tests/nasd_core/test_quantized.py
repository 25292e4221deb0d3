"""The embedded model with its GGUF blocks kept quantized (``ModelConfig(dtype="gguf")``).

The reference is the quantized model itself: its weights are the GGUF reference's block values,
equal bit for bit to the float32 weights the embedded model converts to; a row's logits do not
depend on the step it rides in, so greedy speculation is token-identical to plain decoding, and
sampled rows keep the quantized model's distribution. Greedy identity holds by default on this
path: its attention is the deterministic one (every row, prompt chunks too, in the kernel's fixed
units), so neither the batch nor where a prompt's chunks start changes a row's logits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from torch.nn import functional

from nasd_core import SamplingParams, SpecConfig
from nasd_core.config import EngineConfig, ModelConfig
from nasd_core.engine.engine import Engine
from nasd_core.errors import ModelLoadError
from nasd_core.layers.cpu_kernels import invariant_threads
from nasd_core.layers.quantized import (
    BLOCK_FORMATS,
    FILE_BLOCKS,
    QuantEmbedding,
    QuantLinear,
    dequantize,
    layout,
)
from nasd_core.loader import load_model
from nasd_core.loader.gguf import repack
from tests.nasd_core.gguf_blocks import file_blocks, random_blocks
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, FixedStepTimes, run_staggered
from tests.nasd_core.test_generate import assert_sampling_matches_transformers

KINDS = sorted(BLOCK_FORMATS)
# With int8_activations on (ModelConfig's, each QuantLinear's), QuantLinear rounds each input row
# to int8 per block of 32: against float32 activations its outputs move by 0.54% (relative,
# Frobenius) on normal inputs (0.6-1.2% per Linear on the embedded model's own activations). Tests
# comparing a QuantLinear with a float32 reference hold it to this bound then, and to their own
# tolerance otherwise.
INT8_RELATIVE_ERROR = 0.01


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.fixture(scope="module")
def invariant_threads_only(gguf_model):
    """Deterministic mode's thread bound for this model (cpu_kernels.invariant_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, invariant_threads(gguf_model)))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_block_values_are_the_gguf_references(kind):
    """gguf-py's dequantization of the file's bytes, bit for bit (after the repacking, for the
    types repacked at load)."""
    raw = file_blocks(kind, 24, 512)
    blocks = torch.from_numpy(repack(raw, kind) if kind in FILE_BLOCKS else raw)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(kind))
    assert torch.equal(dequantize(blocks, kind), torch.from_numpy(reference))


def with_threads(count: int, compute):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return compute()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_kernel_multiplies_by_the_block_values_exactly(kind, int8_activations):
    """One-hot inputs read each weight back: the kernel's block values are the reference's bits."""
    blocks = random_blocks(kind, 37, 96)
    linear = QuantLinear(blocks, kind, 96, int8_activations=int8_activations)
    assert linear.native, "the C++ kernel did not build"
    weights = dequantize(blocks, kind)
    if int8_activations:
        # A one-hot row is exact in int8 (q = 127, d_x = fl(1/127)); only float rounding is left
        # (d_w * fl(1/127), fl(1/127) * 127 != 1): measured 1 ulp of the largest weight, bound 4.
        bound = 2**-22 * weights.abs().max()
        torch.testing.assert_close(linear(torch.eye(96)).T, weights, rtol=0, atol=bound)
        return
    assert torch.equal(linear(torch.eye(96)).T, weights)


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_a_rows_output_bits_depend_neither_on_the_other_rows_nor_on_the_threads(kind, int8_activations):
    """Every row count a step can have (1 to 17, and a prompt chunk's 70), on 1 and 2 threads, an
    odd number of outputs (a tile's leftover): each row's output is the same bits as that row
    multiplied alone on one thread, and equals float32 linear up to rounding."""
    linear = QuantLinear(random_blocks(kind, 101, 160), kind, 160, int8_activations=int8_activations)
    assert linear.native, "the C++ kernel did not build"
    inputs = torch.randn(70, 160, generator=torch.Generator().manual_seed(1))
    alone = with_threads(1, lambda: torch.cat([linear(inputs[row : row + 1]) for row in range(70)]))
    for threads in (1, 2):
        for rows in [*range(1, 18), 70]:
            together = with_threads(threads, lambda rows=rows: linear(inputs[:rows]))
            assert torch.equal(together, alone[:rows]), f"{rows} rows on {threads} threads"
    floats = functional.linear(inputs, dequantize(linear.blocks, kind))
    if int8_activations:
        assert relative_error(alone, floats) < INT8_RELATIVE_ERROR
    else:
        torch.testing.assert_close(alone, floats)


def test_kernel_keeps_leading_dimensions_and_takes_no_rows():
    linear = QuantLinear(random_blocks(3, 8, 64), 3, 64)
    assert linear(torch.randn(2, 3, 64)).shape == (2, 3, 8)
    assert linear(torch.randn(0, 64)).shape == (0, 8)
    with pytest.raises(ValueError, match="bytes per output"):
        QuantLinear(random_blocks(3, 8, 64), 3, 96)


def test_without_the_kernel_the_same_module_dequantizes(int8_activations):
    linear = QuantLinear(random_blocks(3, 40, 96), 3, 96, int8_activations=int8_activations)
    assert linear.native, "the C++ kernel did not build"
    inputs = torch.randn(5, 96)
    native = linear(inputs)
    linear.native = False
    if int8_activations:  # the fallback multiplies the float32 rows
        assert relative_error(native, linear(inputs)) < INT8_RELATIVE_ERROR
    else:
        torch.testing.assert_close(linear(inputs), native)


def q8_reference(inputs: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """quant_linear_q8's definition (csrc/quant_linear_q8.cpp) in torch: per row and block of 32,
    q = round_half_even(x * (127 / amax)), d_x = amax / 127, s = sum q; per output, a chain over
    the blocks of fma(d_w * d_x, isum, acc) (Q4_0: isum - 8 s; Q4_1: plus a chain of
    fma(m_w, d_x * s, acc_m), added last). The integer sums are exact (in float64); each fma is
    emulated in float64 (the product is exact there) and rounded to float32, which rounds twice
    and so could differ from a true fma in the last bit in about one case in 2^29: with these
    fixed inputs it does not, so the tests compare bits. Q4_K is Q4_1 with float32 d and m, and so
    are the Q5 types with a byte per code; Q6_K (and Q3_K, repacked as it) sums each half of a
    block apart and adds fma(d_half * d_x, isum_half, acc) for each in turn."""
    rows, width = inputs.shape
    num_blocks = width // 32
    x = inputs.reshape(rows, num_blocks, 32)
    amax = x.abs().amax(-1)
    scale = amax / 127
    # Blocks below 1e-36 (where 127 / amax overflows float32) are taken as zeros.
    inverse = torch.where(amax >= 1e-36, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(x * inverse[..., None])
    sums = q.sum(-1)
    name, size = layout(kind), BLOCK_FORMATS[kind][1]
    grouped = blocks.reshape(blocks.shape[0], num_blocks, size)
    floats = kind in FILE_BLOCKS  # the repacked types: float32 scales (and offset)
    scales = grouped[..., 0:8].contiguous().view(torch.float32) if floats else None
    # Per half of 16 weights: each half's d_w, and the columns it covers.
    if name == "Q6_K":
        halves = [(scales[..., 0], slice(0, 16)), (scales[..., 1], slice(16, 32))]
    else:
        weight_scale = (
            scales[..., 0] if floats else grouped[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
        )
        halves = [(weight_scale, slice(0, 32))]
    if name in ("Q8_0", "Q6_K"):
        codes = grouped[..., -32:].contiguous().view(torch.int8).double()
    elif name.startswith("Q5"):
        codes = grouped[..., -32:].double()
    else:
        packed = grouped[..., -16:]
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()
    acc = torch.zeros(rows, blocks.shape[0])
    terms = []
    for weight_scale, columns in halves:
        isum = torch.einsum("rbk,obk->rob", q[..., columns].double(), codes[..., columns])
        if name == "Q4_0":
            isum = isum - 8 * sums.double()[:, None, :]
        products = (weight_scale[None] * scale[:, None]).double()  # float32 products d_w * d_x
        terms.append((products, isum))
    for block in range(num_blocks):
        for products, isum in terms:
            acc = (products[..., block] * isum[..., block] + acc.double()).float()
    if name in ("Q4_1", "Q4_K") or name.startswith("Q5"):
        offset = (
            scales[..., 1] if floats else grouped[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        )
        offset = offset.double()
        terms = (scale * sums).double()  # float32 d_x * s
        acc_m = torch.zeros(rows, blocks.shape[0])
        for block in range(num_blocks):
            acc_m = (offset[None, :, block] * terms[:, None, block] + acc_m.double()).float()
        acc = acc + acc_m
    return acc


@pytest.fixture
def q8_paths():
    """quant_linear_q8's instruction paths on this build (0 scalar, 1 AVX2, 2 VNNI x 8 outputs,
    3 VNNI x 16, 4 AMX tiles from 64 rows on, VNNI x 16 below), each set in turn by the test; the
    best one is restored after it."""
    linear = QuantLinear(random_blocks(3, 8, 64), 3, 64)
    assert linear.native, "the C++ kernel did not build"
    best = torch.ops.nasd.quant_linear_q8_path()
    yield list(range(best + 1))
    torch.ops.nasd.quant_linear_q8_path(best)


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_int8_activations_are_their_definition_on_every_instruction_path(kind, q8_paths):
    """The scalar fallback, AVX2, VNNI and AMX paths all give the reference's bits: 70 rows, an odd
    number of outputs (a partial tile), a block of zeros, blocks of very different sizes and one
    too small to scale (1e-38: taken as zeros)."""
    blocks = random_blocks(kind, 101, 160, seed=2)
    inputs = torch.randn(70, 160, generator=torch.Generator().manual_seed(5))
    inputs[3, 32:64] = 0
    inputs[4, :32] *= 1e-30
    inputs[5, 64:96] *= 1e6
    inputs[6, 96:128] *= 1e-38
    expected = q8_reference(inputs, blocks, kind)
    for path in q8_paths:
        torch.ops.nasd.quant_linear_q8_path(path)
        assert torch.equal(torch.ops.nasd.quant_linear_q8(inputs, blocks, kind), expected), f"path {path}"


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_wide_rows_are_their_definition_on_every_instruction_path(kind, q8_paths):
    """Inputs of 10 blocks (the AMX path sums 8 blocks a pass: a whole pass and a partial one)
    at 75 and 79 rows (its last tile of rows 11 and 15 rows: epilogues of 12 and 16 rows)."""
    blocks = random_blocks(kind, 37, 320, seed=3)
    inputs = torch.randn(79, 320, generator=torch.Generator().manual_seed(6))
    for rows in (75, 79):
        expected = q8_reference(inputs[:rows], blocks, kind)
        for path in q8_paths:
            torch.ops.nasd.quant_linear_q8_path(path)
            result = torch.ops.nasd.quant_linear_q8(inputs[:rows], blocks, kind)
            assert torch.equal(result, expected), f"path {path}, {rows} rows"


def test_a_cpu_with_amx_multiplies_on_it(q8_paths):
    """Where the CPU has AMX (and so the -march=native build does), the OS granted its tiles and
    path 4 runs: a refused permission would otherwise fall back to VNNI silently."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    if not {"amx_tile", "amx_int8", "avx512_vnni"} <= set(flags):
        pytest.skip("this CPU has no AMX")
    assert max(q8_paths) == 4


# Each type's code bytes at the value that makes the integer sums largest: nibbles 15, Q5 codes 31,
# Q8_0 127, Q6_K -32.
EXTREME_CODES = {
    "Q4_0": (16, 0xFF),
    "Q4_1": (16, 0xFF),
    "Q4_K": (16, 0xFF),
    "Q8_0": (32, 127),
    "Q6_K": (32, 0xE0),
}


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_int8_sums_at_their_bounds_are_their_definition_on_every_instruction_path(kind, q8_paths):
    """Every code at its extreme times rows of +1 and -1 (int8 codes of 127 everywhere): the
    integer sums reach their bounds, the AVX2 path's 16-bit pair sums included (3810 a pair for
    nibbles over 8 groups, 7874 for Q5's codes, widened every group), and every path still gives
    the reference's bits (68 rows: the AMX path's four whole tiles of rows and a partial one)."""
    name, size = layout(kind), BLOCK_FORMATS[kind][1]
    blocks = random_blocks(kind, 40, 96).clone()
    width, code = EXTREME_CODES.get(name, (32, 31))
    blocks.view(40, -1, size)[..., -width:] = code
    inputs = torch.ones(68, 96)
    inputs[1::4] = -1
    inputs[2::4, ::2] = -1
    inputs[3::4, :48] = -1
    expected = q8_reference(inputs, blocks, kind)
    for path in q8_paths:
        torch.ops.nasd.quant_linear_q8_path(path)
        assert torch.equal(torch.ops.nasd.quant_linear_q8(inputs, blocks, kind), expected), f"path {path}"


@pytest.mark.parametrize("kind", KINDS, ids=[BLOCK_FORMATS[kind][0] for kind in KINDS])
def test_int8_activations_keep_a_rows_bits_alone_among_others_and_on_any_threads(kind, q8_paths):
    """As the float32-activation kernel: a row's outputs are the same bits alone on one thread
    and among 1..17 or 70 rows on 1 or 2 threads; and the float32 kernel's outputs up to the
    activations' rounding (INT8_RELATIVE_ERROR)."""
    blocks = random_blocks(kind, 101, 160)
    inputs = torch.randn(70, 160, generator=torch.Generator().manual_seed(1))

    def multiply(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.nasd.quant_linear_q8(rows, blocks, kind)

    for path in q8_paths:
        torch.ops.nasd.quant_linear_q8_path(path)
        single = with_threads(1, lambda: torch.cat([multiply(inputs[row : row + 1]) for row in range(70)]))
        for threads in (1, 2):
            for rows in [*range(1, 18), 70]:
                together = with_threads(threads, lambda rows=rows: multiply(inputs[:rows]))
                assert torch.equal(together, single[:rows]), f"path {path}: {rows} rows on {threads} threads"
    assert relative_error(single, torch.ops.nasd.quant_linear(inputs, blocks, kind)) < INT8_RELATIVE_ERROR


def test_the_int8_switch_picks_quant_linears_kernel():
    linear = QuantLinear(random_blocks(3, 40, 96), 3, 96)
    inputs = torch.randn(2, 5, 96)
    linear.int8_activations = True
    assert torch.equal(linear(inputs), torch.ops.nasd.quant_linear_q8(inputs, linear.blocks, 3))
    linear.int8_activations = False
    assert torch.equal(linear(inputs), torch.ops.nasd.quant_linear(inputs, linear.blocks, 3))
    assert torch.ops.nasd.quant_linear_q8(torch.randn(0, 96), linear.blocks, 3).shape == (0, 40)


def test_model_config_sets_the_gguf_paths_numerics_at_load(gguf_model):
    """``int8_activations`` and ``fused_layers`` reach every QuantLinear and the model's state."""
    assert gguf_model.nasd.int8_activations and gguf_model.nasd.fused_layers  # the defaults
    model, _ = load_model(config=ModelConfig(dtype="gguf", int8_activations=False, fused_layers=False))
    assert not model.nasd.int8_activations and not model.nasd.fused_layers
    assert model.nasd.lean_decoder and model.nasd.layers_fit_fused
    linears = [module for module in model.modules() if isinstance(module, QuantLinear)]
    assert linears and not any(linear.int8_activations for linear in linears)


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
    import nasd_core.loader

    monkeypatch.setattr(nasd_core.loader, "quant_kernel_available", lambda: False)
    model = load_model(config=ModelConfig(dtype="gguf"))[0]
    assert not any(isinstance(module, (QuantLinear, QuantEmbedding)) for module in model.modules())
    assert "using float32" in caplog.text


def test_gguf_is_for_gguf_files_on_a_cpu():
    with pytest.raises(ModelLoadError, match="gguf"):
        load_model("some/hub-model", ModelConfig(dtype="gguf"))


@pytest.fixture(scope="module")
def plain_runs(gguf_model, tokenizer, invariant_threads_only) -> list[list[int]]:
    """Each prompt decoded alone, one token a step."""
    engine = Engine(gguf_model, tokenizer, EngineConfig(max_batch_rows=1, prefill_chunk_tokens=16))
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
    config = EngineConfig(max_batch_rows=6, prefill_chunk_tokens=16)
    engine = Engine(gguf_model, tokenizer, config)
    engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free: auto verifies them
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, SpecConfig(mode=mode, num_draft_tokens=8))
    mismatches = [index for index, expected in enumerate(plain_runs) if outputs[index] != expected]
    assert not mismatches, f"prompts {mismatches} differ from plain decoding"
    assert engine.stats.num_accepted > 0, "speculation was not exercised"


def test_sampling_keeps_the_quantized_models_distribution(gguf_model, tokenizer):
    """Speculative sampling against transformers' sampler, both on the quantized model."""
    assert_sampling_matches_transformers(gguf_model, tokenizer)
