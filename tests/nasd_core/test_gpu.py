"""The engine on a CUDA device: greedy identity, sampling, KV rollback, processors (issue 27).

These run only where CUDA is present (``pytest -m gpu`` selects them); elsewhere they skip
with the reason. Most call the CPU tests' own bodies with the model on the device, so the
two cannot drift apart.

float32 is held to the CPU's standard: batched greedy output equals each prompt's single
run, token for token. In bfloat16, a step of several rows and one of a single row run
different kernels whose sums round differently, so where the model's top two logits are
within that rounding either token is the model's output; there every divergence between a
batched and a single run must be such a near-tie of the plain forward
(``unexplained_divergences``), and any other divergence fails.
"""

from __future__ import annotations

import time

import pytest
import torch

from nasd_core import SamplingParams, SpecConfig, generate
from nasd_core.config import EngineConfig, ModelConfig, RunnerConfig
from nasd_core.engine import engine as engine_module
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.sampling import sample_tokens
from tests.nasd_core import test_engine, test_kv_cache, test_processors, test_step_graphs, test_verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="GPU tests: no CUDA device here (they run on a GPU machine)"
    ),
]


# Tests that start an engine as a server does, with its whole start-up grid.
STARTUP_TESTS = (
    "test_an_engine_captures_its_grid_at_start_and_nothing_while_serving",
    "test_the_default_engine_at_the_k8s_settings_plans_memory_warms_up_and_answers",
)


@pytest.fixture(autouse=True)
def lazy_graph_capture(request, monkeypatch):
    """Engines here capture each shape when first met: a whole start-up grid is ~60 paged
    shapes per engine. The start-up tests keep it."""
    if request.node.name not in STARTUP_TESTS:
        monkeypatch.setattr(engine_module, "warm_up", lambda runner, config: None)


# Top-two logit gap under which bfloat16 kernels of different shapes may order two tokens
# either way: bfloat16 keeps 8 bits of mantissa, so logits of magnitude ~16-32 are rounded
# to steps of 0.125, and a step's sums pass through 30 layers of such rounding.
BFLOAT16_TIE = 0.5


@pytest.fixture(scope="module")
def cuda_model():
    torch.manual_seed(0)
    return load_model(config=ModelConfig(device="cuda"))


@pytest.fixture(scope="module")
def cuda_bf16_model():
    return load_model(config=ModelConfig(device="cuda", dtype="bfloat16"))[0]


def unexplained_divergences(model, tokenizer, outputs, references, tie: float) -> list[str]:
    """Where an output first differs from its reference, unless the plain forward's top two
    logits there are the two tokens and within ``tie`` of each other."""
    problems = []
    for index, (output, reference) in enumerate(zip(outputs, references)):
        if output == reference:
            continue
        position = next(
            (i for i, (ours, theirs) in enumerate(zip(output, reference)) if ours != theirs),
            min(len(output), len(reference)),
        )
        if position == min(len(output), len(reference)):
            problems.append(f"prompt {index}: one output is a prefix of the other")
            continue
        context = tokenizer(test_engine.PROMPTS[index]).input_ids + reference[:position]
        with torch.inference_mode():
            logits = model(torch.tensor([context], device=model.device)).logits[0, -1].float()
        values, ids = torch.topk(logits, 2)
        gap = float(values[0] - values[1])
        if set(ids.tolist()) != {output[position], reference[position]} or gap > tie:
            problems.append(f"prompt {index} at token {position}: top-2 gap {gap:.3f}, ids {ids.tolist()}")
    return problems


def test_runner_logits_match_a_plain_forward_on_the_device(cuda_model):
    model = cuda_model[0]
    for batch_attention in (True, False):  # one padded attention call per layer, and one per row
        for ours, plain in test_kv_cache.runner_and_plain_logits(model, batch_attention):
            torch.testing.assert_close(ours, plain, atol=1e-3, rtol=0)


def test_runner_logits_in_bfloat16_are_the_plain_forwards_within_rounding(cuda_bf16_model):
    for batch_attention in (True, False):
        for ours, plain in test_kv_cache.runner_and_plain_logits(cuda_bf16_model, batch_attention):
            assert (ours - plain).abs().max() <= 0.05 * plain.abs().max()
            assert (ours.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.5


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_batched_greedy_equals_single_sequence_runs_on_the_device(cuda_model, mode):
    model, tokenizer = cuda_model
    test_engine.test_batched_greedy_equals_single_sequence_runs(
        model, tokenizer, test_engine.single_sequence_runs(model, tokenizer), mode, block_size=32
    )


@pytest.mark.parametrize("step_graphs", [False, True])
def test_bfloat16_batched_greedy_differs_from_single_runs_only_at_near_ties(
    cuda_model, cuda_bf16_model, step_graphs
):
    tokenizer = cuda_model[1]
    references = test_engine.single_sequence_runs(cuda_bf16_model, tokenizer)
    config = EngineConfig(max_batch_rows=8, prefill_chunk_tokens=16, step_graphs=step_graphs)
    engine = Engine(cuda_bf16_model, tokenizer, config)
    spec = SpecConfig(mode="on", num_draft_tokens=5)
    outputs = test_engine.run_staggered(engine, test_engine.PROMPTS, test_engine.MAX_TOKENS, spec)
    assert engine.stats.num_accepted > 0, "speculation was not exercised"
    if step_graphs:
        assert engine.runner.graphs is not None and not engine.runner.graphs.failed
    ordered = [outputs[index] for index in range(len(test_engine.PROMPTS))]
    assert not unexplained_divergences(cuda_bf16_model, tokenizer, ordered, references, BFLOAT16_TIE)


@pytest.mark.parametrize("graph_attention", ["paged", "gathered"])
def test_steps_replayed_from_cuda_graphs_get_the_packed_paths_logits(cuda_model, graph_attention):
    runner, logits = test_step_graphs.fixed_and_packed_logits(cuda_model[0], graph_attention)
    assert runner.graphs is not None and not runner.graphs.failed, "a capture failed (see the warning)"
    assert runner.graphs.paged == (graph_attention == "paged"), "paged steps fell back (see the warning)"
    assert all(step.graph is not None for step in runner.graphs.steps.values())
    for fixed, packed in logits:
        torch.testing.assert_close(fixed, packed, atol=1e-3, rtol=0)


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_an_engine_on_cuda_graphs_emits_the_single_sequence_greedy_tokens(cuda_model, mode):
    model, tokenizer = cuda_model
    references = test_engine.single_sequence_runs(model, tokenizer)
    engine = test_step_graphs.run_engine_on_fixed_steps(model, tokenizer, references, mode)
    assert engine.runner.graphs is not None and not engine.runner.graphs.failed
    assert engine.runner.graphs.paged, "the default paged steps fell back to gathered ones (see the warning)"
    assert all(step.graph is not None for step in engine.runner.graphs.steps.values())


def test_an_engine_captures_its_grid_at_start_and_nothing_while_serving(cuda_model):
    """CUDA graphs are on by default on CUDA; the engine captures every shape its rows, draft
    widths and cache can meet before its first step, and serving then captures none."""
    model, tokenizer = cuda_model
    references = test_engine.single_sequence_runs(model, tokenizer)
    spec = SpecConfig(mode="auto", num_draft_tokens=5)
    config = EngineConfig(max_batch_rows=4, prefill_chunk_tokens=16, kv_cache_tokens=4096, spec=spec)
    engine = Engine(model, tokenizer, config)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.is_warm and not graphs.failed and graphs.paged
    outputs = test_engine.run_staggered(engine, test_engine.PROMPTS, test_engine.MAX_TOKENS, spec)
    assert [outputs[index] for index in range(len(test_engine.PROMPTS))] == references
    assert graphs.num_captured_serving == 0


def test_deterministic_bfloat16_greedy_is_the_same_alone_batched_and_with_speculation():
    """Issue 74: on the Triton kernels (``nasd_core/layers/invariant_kernels.py``) a row's logits
    do not depend on its batch or on how many positions it verifies, so in bfloat16 greedy output
    is each prompt's single run, token for token, with speculation off, on and auto, where the
    default kernels differ at near-ties (the test above)."""
    model, tokenizer = load_model(config=ModelConfig(device="cuda", dtype="bfloat16"))  # changed in place
    runner = RunnerConfig(deterministic=True)
    single = Engine(model, tokenizer, EngineConfig(max_batch_rows=1, runner=runner))
    assert single.runner.triton_attention and model.dtype == torch.bfloat16
    references = [
        test_engine.run_staggered(single, [prompt], [max_tokens], SpecConfig(mode="off"))[0]
        for prompt, max_tokens in zip(test_engine.PROMPTS, test_engine.MAX_TOKENS)
    ]
    for mode in ("off", "on", "auto"):
        config = EngineConfig(max_batch_rows=8, prefill_chunk_tokens=16, runner=runner)
        engine = Engine(model, tokenizer, config)
        if mode == "auto":
            engine.step_time = test_engine.FixedStepTimes(lambda *_: 0.1)  # drafts look free
        spec = SpecConfig(mode=mode, num_draft_tokens=5)
        outputs = test_engine.run_staggered(engine, test_engine.PROMPTS, test_engine.MAX_TOKENS, spec)
        mismatches = [i for i, expected in enumerate(references) if outputs[i] != expected]
        assert not mismatches, f"{mode}: prompts {mismatches} differ from their single runs"
        assert mode == "off" or engine.stats.num_accepted > 0, "speculation was not exercised"


def test_the_default_engine_at_the_k8s_settings_plans_memory_warms_up_and_answers():
    """k8s/ serves Qwen2.5-1.5B (a 32k context) in bfloat16 with 64 rows per replica: the default
    engine there plans its memory within gpu_memory_utilization, captures its paged grid within
    the start-up budget, and answers. Random weights of that shape (no hub here), and token ids
    for a prompt (no tokenizer either: this runs before the embedded model is on the machine)."""
    from nasd_core.loader.random_weights import random_model

    model = random_model("qwen2-1.5b", "bfloat16", "cuda")
    torch.cuda.reset_peak_memory_stats()
    engine_config = EngineConfig(max_batch_rows=64)
    started = time.perf_counter()
    engine = Engine(model, None, engine_config)
    start_s = time.perf_counter() - started
    plan = engine.runner.memory_plan
    graphs = engine.runner.graphs
    assert plan is not None and plan.kv_tokens >= 32768 and plan.planned <= plan.budget
    assert graphs is not None and graphs.is_warm and graphs.paged, graphs.fallback
    assert start_s <= engine_config.graph_warmup_budget_s + 60, f"start took {start_s:.0f} s"
    request_id = engine.add_request(list(range(100, 400)), SamplingParams(max_tokens=24, ignore_eos=True))
    while not engine.is_finished():
        engine.step()
    assert len(engine.pop_result(request_id).token_ids) == 24
    assert graphs.num_captured_serving == 0
    # Nothing was allocated beyond the plan: it held.
    assert torch.cuda.max_memory_reserved() <= plan.budget


def test_single_sequence_greedy_equals_transformers_greedy_on_the_device(cuda_model):
    model, tokenizer = cuda_model
    # A model of its own: earlier engines compiled this module's (merged projections, its
    # forwards replaced), and transformers must run its own code here.
    reference, _ = load_model(config=ModelConfig(device="cuda"))
    for prompt, max_tokens in zip(test_engine.PROMPTS[:6], test_engine.MAX_TOKENS):
        ids = tokenizer(prompt).input_ids
        inputs = torch.tensor([ids], device=model.device)
        with torch.inference_mode():
            expected = reference.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(ids) :].tolist()
        ours = generate(model, tokenizer, ids, SamplingParams(max_tokens=max_tokens), SpecConfig(mode="on"))
        assert ours.token_ids == expected[: len(ours.token_ids)], prompt


def test_sampled_verification_on_the_device_keeps_the_target_distribution(cuda_model):
    probs, draft = test_verify.target_probs(*cuda_model)
    assert probs.device.type == "cuda"
    test_verify.test_sampled_rule_matches_target_distribution_at_two_positions((probs, draft))
    test_verify.test_the_same_test_rejects_a_lossy_rule((probs, draft))


def test_a_draw_lands_on_the_same_token_on_the_host_and_the_device():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(256, 49152, generator=generator), dim=-1)
    uniforms = torch.rand(256, generator=generator, dtype=torch.float64)
    on_host = sample_tokens(probs, uniforms)
    on_device = sample_tokens(probs.cuda(), uniforms)
    assert on_device.device.type == "cuda"
    assert on_host.tolist() == on_device.cpu().tolist()


def test_sampled_requests_keep_their_seed_whatever_the_batch_on_the_device(cuda_model):
    test_engine.test_sampled_requests_keep_their_seed_whatever_the_batch(*cuda_model)


@pytest.mark.parametrize("name", list(test_processors.PROCESSORS))
def test_processors_on_the_device_are_plain_decoding_with_the_processors(cuda_model, name):
    test_processors.test_processed_greedy_output_is_plain_decoding_with_the_processors(*cuda_model, name)


def test_logprobs_on_the_device_are_the_plain_forwards(cuda_model):
    test_processors.test_logprobs_are_the_plain_forwards_log_softmax(*cuda_model)
