"""Compiled decoder layers (``nasd_core/layers/compiled_layers.py``) on this CPU.

On a GPU the runner's graphs capture these compiled layers (``benchmarks/gpu_session.sh`` times
them); here they run as inductor's CPU code, which holds them to the packed path's logits: merged
projections that leave the weights and the state dict as they were, one compilation for every
layer and shape (a layer compiled per index or per shape would take minutes on a GPU's start),
attention kept out of the compiled code, and a layer that fails to compile falling back to
uncompiled layers with the reason in the runner's report.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from nasd_core.config import RunnerConfig
from nasd_core.layers.compiled_layers import compile_layers, merge_projections
from nasd_core.native.cache import INDUCTOR_CACHE_ENV
from nasd_core.runner.model_runner import ModelRunner, StepRow
from tests.nasd_core.test_step_graphs import fixed_and_packed_logits, packed_logits


@pytest.fixture(scope="module")
def compiled_model(stock_model):
    """A copy of the stock-kernel model with compiled layers (compiling changes a model in place)."""
    model = copy.deepcopy(stock_model)
    assert compile_layers(model) is None
    return model


def test_merged_projections_share_the_weights_and_keep_the_state_dict(stock_model):
    model = copy.deepcopy(stock_model)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    merge_projections(model)
    after = model.state_dict()
    assert before.keys() <= after.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0)
    layer = model.get_decoder().layers[0]
    qkv = layer.self_attn.qkv_proj.weight
    # Views of the merged weight, not copies: the model holds each weight once.
    attention = layer.self_attn
    assert attention.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attention.v_proj.weight.data_ptr() > attention.k_proj.weight.data_ptr() > qkv.data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() > layer.mlp.gate_up_proj.weight.data_ptr()


def tiny_model(model_type: str, attention: str):
    """A two-layer random model of ``model_type`` (Qwen2: biases on q, k, v; Qwen3: q and k
    normalised per head; Mistral: a sliding window)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"sliding_window": 4} if model_type == "mistral" else {}
    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        max_position_embeddings=512,
        **extra,
    )
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_merged_projections_give_transformers_logits(model_type, attention):
    """Each type's merged forward against transformers' own, in plain forwards (no runner)."""
    model = tiny_model(model_type, attention)
    merged = copy.deepcopy(model)
    merge_projections(merged)
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(merged(tokens).logits, model(tokens).logits, atol=1e-5, rtol=0)


def test_merging_refuses_the_cpus_packed_layers(model):
    with pytest.raises(ValueError, match=r"plain nn\.Linear"):
        merge_projections(model)


def test_compiled_layers_get_the_logits_of_the_packed_path_in_a_few_compilations(stock_model, compiled_model):
    """Fixed-shape paged steps (4 x 17, 4 x 1, 2 x 1) and prompt chunks on compiled layers,
    against the packed path of the uncompiled model; the layers' code compiles a handful of
    times in all, not once per layer (30 here) or per shape."""
    counters = torch._dynamo.utils.counters["stats"]
    graphs_before = counters["unique_graphs"]
    _, compiled = fixed_and_packed_logits(compiled_model, "paged", compiled=True)
    new_graphs = counters["unique_graphs"] - graphs_before
    # On a copy: a runner may switch its model's attention, and other modules share this one.
    reference = packed_logits(copy.deepcopy(stock_model))
    assert 0 < new_graphs <= 12, f"{new_graphs} graphs compiled for 3 fixed shapes and the packed path"
    for (fixed, packed), reference_packed in zip(compiled, reference, strict=True):
        torch.testing.assert_close(fixed, reference_packed, atol=2e-4, rtol=0)
        torch.testing.assert_close(packed, reference_packed, atol=2e-4, rtol=0)


def test_a_runner_compiles_the_layers_and_reports_it(compiled_model):
    runner = ModelRunner(
        compiled_model, RunnerConfig(kv_cache_tokens=256, block_size=16, compiled_layers=True)
    )
    report = runner.report()
    assert report["compiled_layers"] is True and report["compile_failure"] is None
    runner.cache.allocate("row", 8)
    logits = runner.forward([StepRow("row", [1, 2, 3, 4], 2)])
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()


def test_layers_that_fail_to_compile_run_uncompiled_with_the_reason(stock_model, monkeypatch, tmp_path):
    """A fault a real compiler does not give here: the backend raises. Compiled kernels would
    have gone under the NASD cache, where a restarted replica finds them."""
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("NASD_CACHE_DIR", str(tmp_path))

    def failing_backend(graph, example_inputs):
        raise RuntimeError("no compiler on this host")

    original = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: original(self, backend=failing_backend))
    model = copy.deepcopy(stock_model)
    torch._dynamo.reset()
    runner = ModelRunner(model, RunnerConfig(kv_cache_tokens=256, block_size=16, compiled_layers=True))
    report = runner.report()
    assert report["compiled_layers"] is False and "no compiler on this host" in report["compile_failure"]
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "inductor")
    assert all(layer._compiled_call_impl is None for layer in model.get_decoder().layers)
    runner.cache.allocate("row", 8)
    assert torch.isfinite(runner.forward([StepRow("row", [1, 2, 3], 1)])).all()
