"""Device memory planned at start (``nasd_core/runner/memory_plan.py``), and the GPU failure
classes the first H200 start met, each held here on the CPU:
- the KV pool took 0.6 of free memory before any graph existed, and 191 graph shapes each
  allocated their own buffers until capture ran out of memory: every device x model x rows cell
  of the shipped deployments is planned within its budget, steps share one set of static
  buffers, and no graph shape has a context axis (gathered ones stop at GATHERED_MAX_KEYS);
- paged attention compiled with autograd on (q_indices): a paged step built with grad enabled
  and parameters that require grad stays paged;
- inductor's H100 tile did not divide a 32-position page: the kernel options divide every page
  size the engine accepts for paged steps, and force the kernel whose rules they satisfy.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from nasd_core.config import DEFAULT_NUM_DRAFT_TOKENS, MAX_KV_BLOCK_SIZE, EngineConfig, RunnerConfig
from nasd_core.engine import engine as engine_module
from nasd_core.engine.engine import Engine
from nasd_core.layers.attention import BATCH_MAX_KEYS, flex_kernel_options
from nasd_core.loader.random_weights import ARCHITECTURES
from nasd_core.runner.memory_plan import (
    GIB,
    MIN_DEFAULT_PREFILL_CHUNK,
    MemoryPlanError,
    ModelShape,
    StepLimits,
    plan_memory,
    plan_shrinking_chunk,
)
from nasd_core.runner.model_runner import GPU_PREFILL_CHUNK_TOKENS, ModelRunner, StepRow
from nasd_core.runner.step_graphs import (
    FLEX_QUERY_BLOCK,
    GATHERED_MAX_KEYS,
    POSITION_BUCKETS,
    StepShape,
    grid_shapes,
)

# What cudaMemGetInfo reports as total on each card (a "24 GB" L4 or A10 shows ~22.5 GiB).
DEVICES = {
    "24GB (L4/A10)": int(22.49 * GIB),
    "80GB (H100)": int(79.19 * GIB),
    "141GB (H200)": int(139.8 * GIB),
}
# The CUDA context and the allocator's own reserve, held before any plan.
CONTEXT_BYTES = GIB // 2
MODELS = {
    "SmolLM2-135M": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "Qwen2-1.5B": ARCHITECTURES["qwen2-1.5b"],  # what k8s/ serves (Qwen2.5-1.5B: the same shape)
    "Qwen2-7B": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
}


def limits_for(shape: ModelShape, rows: int, chunk: int = GPU_PREFILL_CHUNK_TOKENS) -> StepLimits:
    return StepLimits(
        max_rows=rows,
        max_positions=1 + DEFAULT_NUM_DRAFT_TOKENS,
        prefill_chunk=chunk,
        max_context=shape.context,
        graph_positions=POSITION_BUCKETS[-1],
        graph_rows=rows,
        graph_keys=GATHERED_MAX_KEYS,
        batched_max_keys=BATCH_MAX_KEYS,
        block_size=32,
    )


@pytest.mark.parametrize("rows", [32, 64])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("device", list(DEVICES))
def test_the_plan_fits_every_device_model_and_batch_within_its_budget(device, model_name, rows):
    shape = ModelShape.from_config(SimpleNamespace(**MODELS[model_name]), torch.bfloat16)
    total, in_use = DEVICES[device], shape.weight_bytes + CONTEXT_BYTES
    plan = plan_shrinking_chunk(shape, limits_for(shape, rows), lambda: (total, in_use))
    assert plan.planned <= plan.budget == int(0.9 * total)
    assert plan.kv_tokens >= shape.context and plan.full_context_rows >= 1
    assert plan.kv_tokens % 32 == 0 and plan.kv_bytes >= plan.kv_tokens * shape.kv_bytes_per_token
    assert plan.prefill_chunk >= MIN_DEFAULT_PREFILL_CHUNK
    assert f"{plan.kv_tokens} positions" in plan.describe()


def test_a_small_device_shortens_the_default_prompt_chunk_before_it_refuses():
    shape = ModelShape.from_config(SimpleNamespace(**MODELS["Qwen2-7B"]), torch.bfloat16)
    total, in_use = DEVICES["24GB (L4/A10)"], shape.weight_bytes + CONTEXT_BYTES
    with pytest.raises(MemoryPlanError):
        plan_memory(shape, limits_for(shape, 64), total, in_use)
    fitted = plan_shrinking_chunk(shape, limits_for(shape, 64), lambda: (total, in_use))
    assert MIN_DEFAULT_PREFILL_CHUNK <= fitted.prefill_chunk < GPU_PREFILL_CHUNK_TOKENS
    with pytest.raises(MemoryPlanError):  # a chunk set by hand is refused, never shortened
        plan_shrinking_chunk(shape, limits_for(shape, 64), lambda: (total, in_use), shrink=False)


def test_a_profiled_peak_that_does_not_fit_shortens_the_default_chunk_further():
    """What a CUDA runner does with each candidate chunk's profiled peak: a profile that runs out
    of memory, or a measured peak over the budget, tries the next shorter chunk."""
    shape = ModelShape.from_config(SimpleNamespace(**MODELS["Qwen2-1.5B"]), torch.bfloat16)
    total, in_use = DEVICES["80GB (H100)"], shape.weight_bytes + CONTEXT_BYTES
    tried = []

    def measure(limits: StepLimits) -> int:
        tried.append(limits.prefill_chunk)
        if limits.prefill_chunk > 1024:
            raise MemoryPlanError("the profile step ran out of memory")
        return 80 * GIB if limits.prefill_chunk > 512 else GIB

    plan = plan_shrinking_chunk(shape, limits_for(shape, 64), lambda: (total, in_use), measure=measure)
    assert tried == [2048, 1024, 512] and plan.prefill_chunk == 512 and plan.planned <= plan.budget
    with pytest.raises(MemoryPlanError, match="ran out of memory"):
        plan_shrinking_chunk(
            shape, limits_for(shape, 64), lambda: (total, in_use), shrink=False, measure=measure
        )


def test_a_setting_that_cannot_fit_is_refused_naming_it_and_what_would_fit():
    shape = ModelShape.from_config(SimpleNamespace(**MODELS["Qwen2-7B"]), torch.bfloat16)
    total = DEVICES["24GB (L4/A10)"]
    in_use = shape.weight_bytes + CONTEXT_BYTES
    limits = limits_for(shape, 64)  # at 0.8, no prompt chunk fits
    with pytest.raises(MemoryPlanError):
        plan_shrinking_chunk(shape, limits, lambda: (total, in_use), utilization=0.8)
    with pytest.raises(MemoryPlanError, match=r"gpu_memory_utilization 0\.8") as refused:
        plan_memory(shape, limits, total, in_use, utilization=0.8)
    assert "32768-token row" in str(refused.value) and "positions" in str(refused.value)
    # The share it names is enough (rounded up); where none is, it says so.
    share = float(str(refused.value).split("Raise gpu_memory_utilization to ")[1][:4])
    assert plan_memory(shape, limits, total, in_use, utilization=share).kv_tokens >= shape.context
    with pytest.raises(MemoryPlanError, match="No share of this device is enough"):
        plan_memory(shape, limits, 16 * GIB, in_use)
    roomy = DEVICES["80GB (H100)"]
    fits = plan_memory(shape, limits_for(shape, 64), roomy, in_use).kv_tokens
    with pytest.raises(MemoryPlanError, match=f"kv_cache_tokens={fits + 32} .* at most {fits} positions fit"):
        plan_memory(shape, limits_for(shape, 64), roomy, in_use, kv_tokens=fits + 32)
    assert plan_memory(shape, limits_for(shape, 64), roomy, in_use, kv_tokens=fits).kv_tokens == fits


def test_a_measured_peak_above_the_estimate_takes_its_room_from_the_kv_cache():
    shape = ModelShape.from_config(SimpleNamespace(**MODELS["Qwen2-1.5B"]), torch.bfloat16)
    total, in_use = DEVICES["80GB (H100)"], shape.weight_bytes + CONTEXT_BYTES
    estimated = plan_memory(shape, limits_for(shape, 64), total, in_use)
    measured = plan_memory(shape, limits_for(shape, 64), total, in_use, measured_activation=8 * GIB)
    assert measured.activation == 8 * GIB > estimated.activation
    assert measured.kv_bytes < estimated.kv_bytes and measured.planned <= measured.budget
    lower = plan_memory(shape, limits_for(shape, 64), total, in_use, measured_activation=1)
    assert lower.activation == estimated.activation  # the estimate is a floor


def test_weights_counted_from_a_config_are_the_models_own():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    for config_class, model_class in ((LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)):
        for tied in (True, False):
            config = config_class(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=300,
                tie_word_embeddings=tied,
            )
            counted = ModelShape.from_config(config, torch.float32).weight_bytes
            assert counted == ModelShape.from_model(model_class(config)).weight_bytes, (config_class, tied)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flex_tiles_divide_every_page_and_query_block_the_engine_accepts(dtype):
    accepted = range(1, MAX_KV_BLOCK_SIZE + 1)  # RunnerConfig.block_size, within the engine's bound
    assert RunnerConfig.model_fields["block_size"].metadata[0].ge == 1 and MAX_KV_BLOCK_SIZE == 4096
    for page in accepted:
        for positions in POSITION_BUCKETS:
            options = flex_kernel_options(page, positions, dtype)
            if page % 16:
                assert options is None, page
                continue
            assert options is not None, page
            tile_m, tile_n = options["BLOCK_M"], options["BLOCK_N"]
            assert page % tile_n == 0 and FLEX_QUERY_BLOCK % tile_m == 0, (page, positions, options)
            assert tile_m >= 16 and tile_n >= 16  # tl.dot's smallest tile
            assert tile_m & (tile_m - 1) == 0 and tile_n & (tile_n - 1) == 0
            # The decode kernel inductor picks for short queries has other rules (the group
            # size a power of two): the main one, whose rules these are, is forced.
            assert options["FORCE_USE_FLEX_ATTENTION"] is True
    # The engine's default page: inductor's default H100 tile (BLOCK_N 64) did not divide it.
    assert flex_kernel_options(32, 17, torch.bfloat16)["BLOCK_N"] == 32


def tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_paged_step_built_with_autograd_on_stays_paged(compiled):
    """Served models' parameters require grad; a step built outside inference mode made
    FlexAttention ask for its backward (on CUDA: "BlockMask q_indices is None")."""
    model = tiny_qwen()
    assert all(parameter.requires_grad for parameter in model.parameters())
    runner = ModelRunner(
        model, RunnerConfig(kv_cache_tokens=512, block_size=16, step_graphs=True, graph_attention="paged")
    )
    graphs = runner.graphs
    assert graphs is not None and graphs.paged
    graphs.compiled = compiled
    with torch.enable_grad():
        assert torch.is_grad_enabled()
        for shape in (StepShape(4, 17, 0), StepShape(1, 1, 0)):
            assert graphs.build(shape) is not None
    assert graphs.paged and graphs.fallback is None, graphs.fallback
    runner.cache.allocate("row", 64)
    with torch.enable_grad():
        logits = runner.forward([StepRow("row", list(range(20)), 20)])
    assert runner.last_graph_shape == StepShape(1, 32, 0) and torch.isfinite(logits).all()


def test_a_paged_step_that_fails_falls_back_loudly_and_says_so_in_the_report(caplog, monkeypatch):
    model = tiny_qwen()
    runner = ModelRunner(
        model, RunnerConfig(kv_cache_tokens=512, block_size=16, step_graphs=True, graph_attention="paged")
    )

    def broken(*args, **kwargs):  # a kernel that does not compile, as on the first H200 run
        raise RuntimeError("no kernel for this tile")

    monkeypatch.setattr("nasd_core.runner.step_graphs.PagedRows", broken)
    with caplog.at_level(logging.WARNING):
        assert runner.graphs.build(StepShape(1, 1, 0)) is None
    assert "paged attention is off" in caplog.text and "no kernel for this tile" in caplog.text
    report = runner.report()["step_graphs"]
    assert report["attention"] == "gathered" and "no kernel for this tile" in report["paged_fallback"]
    monkeypatch.undo()
    runner.cache.allocate("row", 64)
    runner.forward([StepRow("row", list(range(20)), 20)])
    assert runner.last_graph_shape is not None and runner.last_graph_shape.num_keys == 128


def test_every_step_reads_and_writes_one_set_of_static_buffers(paged_steps):
    runner, _ = paged_steps
    graphs = runner.graphs
    assert len(graphs.steps) >= 3
    inputs, hidden = graphs.buffers.inputs, graphs.buffers.hidden
    for step in graphs.steps.values():
        assert step.buffer.data_ptr() == inputs.data_ptr() and step.buffer.numel() <= inputs.numel()
        assert step.hidden.data_ptr() == hidden.data_ptr()


def test_graph_grids_have_no_context_axis_and_capture_the_largest_shape_first():
    paged = grid_shapes(64, 17, 32768, groups=6, paged=True)
    assert {shape.num_keys for shape in paged} == {0}
    assert paged[0] == StepShape(64, 17, 0) and paged[-1] == StepShape(1, 1, 0)
    assert grid_shapes(64, 17, 1 << 20, groups=6, paged=True) == paged
    gathered = grid_shapes(64, 17, 32768, groups=6)
    assert max(shape.num_keys for shape in gathered) == GATHERED_MAX_KEYS
    assert gathered[0].num_keys == 128 and gathered[0].num_rows == 64


def test_an_engine_builds_its_drafter_at_start_not_in_its_first_request(model, tokenizer, monkeypatch):
    built = []
    monkeypatch.setattr(engine_module, "compiled_module", lambda: built.append(True))
    Engine(model, tokenizer, EngineConfig(kv_cache_tokens=1024))
    assert built, "the engine did not build its drafter at start"
