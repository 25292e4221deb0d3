"""The lean decoder (``layers/lean_decoder.py``): the GGUF path's step as fused CPU calls.

Its kernels (``native/csrc/decoder_ops.cpp``) compute transformers' RMSNorm, rotary embedding and
SiLU-times-up up to the order of their sums, and a token's values are the same bits alone and
among other tokens, on one thread or two. The runner's steps on the GGUF model take it and give
the logits of transformers' own forward of the same model.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from nasd_core import native
from nasd_core.config import RunnerConfig
from nasd_core.layers.lean_decoder import lean_decoder_fits, use_lean_decoder
from nasd_core.runner.model_runner import ModelRunner, StepRow
from tests.nasd_core.test_quantized import relative_error, with_threads

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@pytest.fixture(autouse=True, scope="module")
def kernels():
    assert native.load(), "the C++ kernels did not build"


def rms_norm_case(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    weight = torch.linspace(-2, 2, rows.shape[-1])
    return torch.ops.nasd.rms_norm(rows, rows.flip(0) * 0.5, weight, 1e-5)


def rotary_case(gguf_model, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    positions = torch.arange(rows.shape[0]) * 37
    cos, sin = gguf_model.get_decoder().rotary_emb(rows, positions.unsqueeze(0))
    return torch.ops.nasd.rotary_split(rows, cos[0], sin[0], HEADS, KV_HEADS)


def test_rms_norm_is_transformers_with_the_residual_added_first():
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    inputs, residual = torch.randn(7, 96), torch.randn(7, 96)
    summed, normed = torch.ops.nasd.rms_norm(inputs, residual, norm.weight, 1e-5)
    assert torch.equal(summed, inputs + residual)
    torch.testing.assert_close(normed, norm(inputs + residual))
    same, normed = torch.ops.nasd.rms_norm(inputs, None, norm.weight, 1e-5)
    assert torch.equal(same, inputs)
    torch.testing.assert_close(normed, norm(inputs))


def test_rotary_split_is_transformers_rotary_on_the_fused_projection(gguf_model):
    tokens = 6
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    query, key, value = rotary_case(gguf_model, qkv)
    positions = torch.arange(tokens) * 37
    cos, sin = gguf_model.get_decoder().rotary_emb(qkv, positions.unsqueeze(0))

    def heads(start: int, count: int) -> torch.Tensor:  # transformers' [1, heads, tokens, D]
        columns = qkv[:, start * HEAD_DIM : (start + count) * HEAD_DIM]
        return columns.view(1, tokens, count, HEAD_DIM).transpose(1, 2)

    expected_query, expected_key = apply_rotary_pos_emb(heads(0, HEADS), heads(HEADS, KV_HEADS), cos, sin)
    torch.testing.assert_close(query, expected_query[0].transpose(0, 1))
    torch.testing.assert_close(key, expected_key[0].transpose(0, 1))
    assert torch.equal(value, heads(HEADS + KV_HEADS, KV_HEADS)[0].transpose(0, 1))


@pytest.mark.parametrize("width", [1536, 37])  # a width that leaves a tail past the 8-float vectors
def test_silu_mul_is_silu_of_the_gate_times_up(width):
    gate_up = torch.randn(5, 2 * width) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])  # where exp over- or underflows
    expected = functional.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(torch.ops.nasd.silu_mul(gate_up), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["rms_norm", "rotary_split", "silu_mul"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_tokens_values_are_the_same_bits_alone_and_among_others(gguf_model, kernel, threads):
    widths = {"rms_norm": 576, "rotary_split": (HEADS + 2 * KV_HEADS) * HEAD_DIM, "silu_mul": 2 * 1536}
    rows = torch.randn(40, widths[kernel])

    def run(part: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if kernel == "rms_norm":
            weight = torch.linspace(-2, 2, part.shape[-1])
            return torch.ops.nasd.rms_norm(part, part * 0.5, weight, 1e-5)
        if kernel == "rotary_split":
            return rotary_case(gguf_model, part)
        return (torch.ops.nasd.silu_mul(part),)

    every = with_threads(threads, lambda: run(rows))
    for count in (1, 3, 17):
        some = with_threads(threads, lambda count=count: run(rows[:count]))
        for whole, part in zip(every, some):
            assert torch.equal(part, whole[:count]), (kernel, count)


def test_the_gguf_model_takes_the_lean_decoder_and_others_do_not(gguf_model, model):
    assert gguf_model.nasd.lean_decoder and lean_decoder_fits(gguf_model)
    assert use_lean_decoder(gguf_model)  # idempotent
    assert not lean_decoder_fits(model) and not use_lean_decoder(model)  # float32 projections


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])  # float16: the GGUF path's default
def test_lean_steps_give_the_logits_of_transformers_forward(
    gguf_model_at_int8_activations, int8_activations, kv_cache_dtype
):
    """A prompt chunk beside another row's verification-shaped step, then one more position
    each: every logit against transformers' forward of the same model over the whole sequence
    (its keys and values in float32)."""
    gguf_model = gguf_model_at_int8_activations
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (40, 75)]
    runner = ModelRunner(
        gguf_model, RunnerConfig(kv_cache_tokens=512, block_size=16, kv_cache_dtype=kv_cache_dtype)
    )
    assert runner.cache.keys[0].dtype == getattr(torch, kv_cache_dtype)
    for row, prompt in enumerate(prompts):
        runner.cache.allocate(row, len(prompt))
    runner.forward([StepRow(0, prompts[0][:35], 0)])
    first = runner.forward([StepRow(0, prompts[0][35:39], 4), StepRow(1, prompts[1][:74], 74)])
    second = runner.forward([StepRow(0, prompts[0][39:], 1), StepRow(1, prompts[1][74:], 1)])
    with torch.inference_mode():
        expected = [gguf_model(torch.tensor([prompt])).logits[0] for prompt in prompts]
    actual = torch.cat([first, second])
    reference = torch.cat([expected[0][35:39], expected[1][:74], expected[0][39:40], expected[1][74:75]])
    if int8_activations:
        # Both forwards round activations to int8, but from inputs that differ by float rounding,
        # which can move a code by one step: they then differ by up to int8 rounding itself
        # (measured 1.2% relative, against 1.5% between int8 and float32 activations).
        assert relative_error(actual, reference) < 0.03
    elif kv_cache_dtype == "float16":
        # Keys and values rounded to float16 (11 significant bits): measured 0.017% relative
        # (int8 activations: 1.2%).
        assert relative_error(actual, reference) < 1e-3
    else:
        torch.testing.assert_close(actual, reference, atol=2e-4, rtol=1e-4)


def test_the_fused_layer_loop_is_the_python_loop_bit_for_bit(gguf_model, monkeypatch):
    """A decode/verification step (every row in the attention kernel) runs all layers in one C++
    call; the same step from Python gives the same bits, and both write the same cache."""
    from nasd_core.layers import lean_decoder

    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (30, 51, 9)]
    runner = ModelRunner(gguf_model, RunnerConfig(kv_cache_tokens=512, block_size=16))
    for row, prompt in enumerate(prompts):
        runner.cache.allocate(row, len(prompt) + 8)
    runner.forward([StepRow(row, prompt, 0) for row, prompt in enumerate(prompts)])
    # 11 positions: the multiplies take the float panel (9 rows and more) inside the C++ loop.
    step = [StepRow(0, [5], 1), StepRow(1, [6, 7, 8, 9, 10, 11], 6), StepRow(2, [12, 13, 14, 15], 4)]
    calls = []
    fused_call = lean_decoder.all_layers_fused
    monkeypatch.setattr(lean_decoder, "all_layers_fused", lambda *args: calls.append(1) or fused_call(*args))
    fused = runner.forward(step)
    assert calls == [1]  # the prompts' step ran from Python, this one in one call
    lengths = [len(prompt) + len(row.token_ids) for prompt, row in zip(prompts, step)]
    slots = torch.cat([runner.cache.slots(row, 0, length) for row, length in enumerate(lengths)])
    pools = list(zip(runner.cache.keys, runner.cache.values))
    cached = [(keys[:, slots], values[:, slots]) for keys, values in pools]
    for row, prompt in enumerate(prompts):
        runner.cache.set_length(row, len(prompt))
    monkeypatch.setattr(gguf_model.nasd, "fused_layers", False)  # ModelConfig.fused_layers
    assert torch.equal(runner.forward(step), fused)
    for (keys, values), pool_keys, pool_values in zip(cached, runner.cache.keys, runner.cache.values):
        assert torch.equal(keys, pool_keys[:, slots]) and torch.equal(values, pool_values[:, slots])


def test_prompt_chunks_run_on_the_prefill_threads_with_the_same_bits(gguf_model, monkeypatch):
    """A step that prefills ``PREFILL_THREADS_MIN_TOKENS`` prompt tokens or more runs on
    ``prefill_threads`` (a lone server replica's every core); a verification step as wide stays on
    the caller's threads, which are set back after; the GGUF path's logits are the same bits
    either way."""
    from nasd_core.runner import model_runner

    width = model_runner.PREFILL_THREADS_MIN_TOKENS
    tokens = torch.randint(0, 49152, (2 * width + 2,), generator=torch.Generator().manual_seed(5)).tolist()
    threads_seen: list[int] = []

    def logits(prefill_threads: int | None) -> list[torch.Tensor]:
        runner = ModelRunner(
            gguf_model, RunnerConfig(kv_cache_tokens=256, block_size=16, prefill_threads=prefill_threads)
        )
        packed = runner._packed_forward
        monkeypatch.setattr(
            runner,
            "_packed_forward",
            lambda rows: threads_seen.append(torch.get_num_threads()) or packed(rows),
        )
        runner.cache.allocate(0, len(tokens))
        chunk = runner.forward([StepRow(0, tokens[: width + 1], 1)])  # 32 tokens without logits
        return [chunk, runner.forward([StepRow(0, tokens[width + 1 :], width + 1)])]  # 33 with

    def with_prefill_threads() -> list[torch.Tensor]:
        threads_seen.clear()
        steps = logits(2)
        assert threads_seen == [2, 1] and torch.get_num_threads() == 1
        return steps

    plain = with_threads(1, lambda: logits(None))
    assert threads_seen == [1, 1]
    for expected, actual in zip(plain, with_threads(1, with_prefill_threads)):
        assert torch.equal(expected, actual)


def test_the_kv_cache_is_float16_on_the_gguf_path_and_float32_models_may_choose_it(gguf_model, model):
    """``kv_cache_dtype="auto"``: float16 where the lean decoder runs, the model's dtype elsewhere.
    A float32 model may take float16 too: its prompt chunks attend with SDPA over the pool widened
    back to float32, its decode rows in the kernel, within float16's rounding of float32's logits."""
    assert ModelRunner(gguf_model, RunnerConfig(kv_cache_tokens=64)).cache.keys[0].dtype == torch.float16
    assert ModelRunner(model, RunnerConfig(kv_cache_tokens=64)).cache.keys[0].dtype == torch.float32
    with pytest.raises(ValueError, match="batched attention off"):
        ModelRunner(
            gguf_model, RunnerConfig(kv_cache_tokens=64, batch_attention=True, kv_cache_dtype="float16")
        )
    # "auto" falls back to the model's dtype where batched attention reads the pool.
    assert (
        ModelRunner(gguf_model, RunnerConfig(kv_cache_tokens=64, batch_attention=True)).cache.keys[0].dtype
        == torch.float32
    )
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(6)).tolist()

    def logits(kv_cache_dtype: str) -> torch.Tensor:
        runner = ModelRunner(
            model, RunnerConfig(kv_cache_tokens=64, block_size=16, kv_cache_dtype=kv_cache_dtype)
        )
        assert runner.cache.keys[0].dtype == getattr(torch, kv_cache_dtype)
        runner.cache.allocate(0, len(prompt))
        chunk = runner.forward([StepRow(0, prompt[:-1], len(prompt) - 1)])
        return torch.cat([chunk, runner.forward([StepRow(0, prompt[-1:], 1)])])

    assert relative_error(logits("float16"), logits("float32")) < 1e-3
