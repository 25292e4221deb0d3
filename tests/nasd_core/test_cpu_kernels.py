"""The CPU fast path: packed Linear weights and copy-free grouped-query attention."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from nasd_core.config import ModelConfig
from nasd_core.layers import cpu_kernels
from nasd_core.layers.attention import FALLBACK_ATTRIBUTE
from nasd_core.layers.cpu_kernels import GQA_SDPA, PackedLinear, measure_dense_max_rows, pack_linear_layers
from nasd_core.loader import load_model

PROMPTS = [
    "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List three colours of the rainbow:",
]


def test_fast_path_is_on_by_default(model):
    # An engine switches the shared model to paged attention, which falls back to GQA SDPA.
    implementation = model.config._attn_implementation
    assert getattr(model.config, FALLBACK_ATTRIBUTE, implementation) == GQA_SDPA
    assert not [module for module in model.modules() if type(module) is nn.Linear]
    assert sum(isinstance(module, PackedLinear) for module in model.modules()) == 211


def test_stock_model_keeps_stock_kernels(stock_model):
    assert stock_model.config._attn_implementation == "sdpa"
    assert not [module for module in stock_model.modules() if isinstance(module, PackedLinear)]


def test_packed_linear_matches_linear_and_is_batch_invariant():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    packed = PackedLinear(linear)
    inputs = torch.randn(3, 17, 96)
    with torch.inference_mode():
        expected = linear(inputs)
        out = packed(inputs)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        # A row's output is the same bits however many rows ride with it: a verified
        # position gets the logits it would get decoded alone.
        for num_rows in (1, 2, 5, 17, 51):
            rows = inputs.reshape(-1, 96)[:num_rows]
            assert torch.equal(packed(rows), out.reshape(-1, 200)[:num_rows])


def test_packed_linear_gives_small_inputs_to_the_dense_multiply():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    hybrid = PackedLinear(linear, dense_max_rows=2)
    packed_only = PackedLinear(linear)
    assert packed_only.dense_weight is None  # no second copy of the weight kept
    with torch.inference_mode():
        for num_rows in (1, 2):
            inputs = torch.randn(num_rows, 96)
            assert torch.equal(hybrid(inputs), functional.linear(inputs, linear.weight, linear.bias))
        # Above the bound, the packed kernel, with its batch invariance among those shapes.
        inputs = torch.randn(2, 9, 96)
        out = hybrid(inputs)
        assert torch.equal(out, packed_only(inputs))
        assert torch.equal(hybrid(inputs[:1]), out[:1])
        torch.testing.assert_close(out, linear(inputs), rtol=1e-5, atol=1e-5)


def test_dense_bound_counts_rows_until_the_dense_multiply_stops_winning(monkeypatch):
    """The rule, with the clock replaced: dense wins clearly at 1-2 rows, narrowly at 3, and at 4."""
    dense_share = {1: 0.5, 2: 0.8, 3: 0.95, 4: 0.5}  # dense time / packed time, by rows

    def fake_seconds(forward, inputs, calls, repeats=5):
        share = 1.0 if isinstance(forward, PackedLinear) else dense_share[inputs.shape[0]]
        return share * calls

    monkeypatch.setattr(cpu_kernels, "_fastest_seconds", fake_seconds)
    layers = [nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)]
    assert measure_dense_max_rows(layers) == 2
    dense_share[1] = 0.95
    assert measure_dense_max_rows(layers) == 0


def test_the_dense_bound_is_measured_at_load_or_set(model):
    bounds = {module.dense_max_rows for module in model.modules() if isinstance(module, PackedLinear)}
    assert len(bounds) == 1 and bounds.pop() in range(5)
    pinned, _ = load_model(config=ModelConfig(dtype="float32", cpu_dense_max_rows=0))
    layers = [module for module in pinned.modules() if isinstance(module, PackedLinear)]
    assert {layer.dense_max_rows for layer in layers} == {0}
    assert all(layer.dense_weight is None for layer in layers)


def test_pack_skips_models_it_cannot_speed_up():
    assert pack_linear_layers(nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)) == 0
    assert pack_linear_layers(nn.Sequential(nn.ReLU())) == 0


@torch.inference_mode()
def test_fast_path_logits_match_stock_on_a_padded_cached_batch(model, tokenizer, stock_model):
    """Left-padded batch, mask, cache, then several positions per row: the engine's step shape."""
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    steps = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    logits = []
    for candidate in (stock_model, model):
        prefill = candidate(**batch, use_cache=True)
        mask = torch.cat([batch.attention_mask, torch.ones_like(steps)], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -steps.shape[1] :]
        step = candidate(
            input_ids=steps,
            attention_mask=mask,
            position_ids=positions,
            cache=prefill.cache,
            use_cache=True,
        )
        logits.append((prefill.logits[:, -1], step.logits))
    for stock, fast in zip(*logits):
        torch.testing.assert_close(fast, stock, rtol=1e-4, atol=2e-3)


@torch.inference_mode()
def test_fast_path_greedy_tokens_match_stock(model, tokenizer, stock_model):
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        stock = stock_model.generate(**inputs, max_new_tokens=32, do_sample=False)
        fast = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        assert torch.equal(fast, stock), prompt
