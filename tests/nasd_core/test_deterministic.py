"""Deterministic mode (``RunnerConfig.deterministic``) on this CPU, with the embedded model in
bfloat16.

Without it, a bfloat16 step's logits depend on what else the step computes (the row's drafts, other
rows, the split of keys among threads), so greedy output with speculation can leave plain
decoding's at a near-tie. With it, a position's logits are the same bits however it is batched,
and greedy output is token-identical with speculation off, on or auto.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nasd_core.config import EngineConfig, RunnerConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.layers.cpu_kernels import invariant_threads
from nasd_core.runner.model_runner import ModelRunner, StepRow
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, FixedStepTimes, run_staggered
from tests.nasd_core.test_quantized import with_threads

MAX_NEW = [2 * count for count in MAX_TOKENS]


@pytest.fixture(scope="module")
def bf16_model(stock_model):
    """The embedded model in bfloat16 (a copy: deterministic mode changes a model in place)."""
    return copy.deepcopy(stock_model).to(torch.bfloat16)


def engine_of(model, tokenizer, max_rows: int) -> Engine:
    config = EngineConfig(max_batch_rows=max_rows, prefill_chunk_tokens=16, deterministic=True)
    return Engine(model, tokenizer, config)


@pytest.fixture(scope="module")
def plain_runs(bf16_model, tokenizer) -> list[list[int]]:
    """The prompts decoded one token a step (speculation off), as rows of one batch: a row's
    logits here do not depend on its batch (test_a_positions_logits_do_not_depend_on_its_step),
    so these are each prompt's run alone."""
    engine = engine_of(bf16_model, tokenizer, len(PROMPTS))
    request_ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), SpecConfig(mode="off"))
        for prompt, max_tokens in zip(PROMPTS, MAX_NEW, strict=True)
    ]

    def run() -> None:
        while not engine.is_finished():
            engine.step()

    with_threads(min(torch.get_num_threads(), invariant_threads(engine.runner.model)), run)
    return [engine.pop_result(request_id).token_ids for request_id in request_ids]


@pytest.fixture(params=[1, 2], ids=["1_thread", "2_threads"])
def threads(request):
    """Intra-op threads (``cpu_kernels.invariant_threads``: this model's widths hold for 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_a_positions_logits_do_not_depend_on_its_step(bf16_model, threads):
    """A row's next 9 tokens decoded one a step alone, then verified in one step beside a
    prompt chunk and a decoding row: bit for bit the same logits."""
    runner = ModelRunner(bf16_model, RunnerConfig(kv_cache_tokens=1024, block_size=16, deterministic=True))
    assert invariant_threads(runner.model) >= threads
    assert runner.report()["deterministic"] and runner.model.dtype == torch.float32
    generator = torch.Generator().manual_seed(5)
    prompt, other, chunk, following = (
        torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (300, 40, 70, 9)
    )
    for row, tokens in (("a", prompt), ("b", other), ("c", chunk)):
        runner.cache.allocate(row, len(tokens) + 16)
    runner.forward([StepRow("a", prompt, 0), StepRow("b", other, 0)])
    alone = torch.cat([runner.forward([StepRow("a", [token], 1)]) for token in following])
    runner.cache.set_length("a", len(prompt))
    batched = runner.forward(
        [StepRow("b", [7], 1), StepRow("a", following, len(following)), StepRow("c", chunk, 1)]
    )
    assert torch.equal(batched[1 : 1 + len(following)], alone)


@pytest.mark.parametrize("setting", ["step_graphs", "compiled_layers"])
def test_deterministic_steps_refuse_graphs_and_compiled_layers(bf16_model, setting):
    with pytest.raises(ValueError, match=setting):
        ModelRunner(
            bf16_model,
            RunnerConfig(kv_cache_tokens=256, block_size=16, deterministic=True, **{setting: True}),
        )


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_greedy_output_is_plain_decodings_with_speculation_in_any_batch(
    bf16_model, tokenizer, plain_runs, mode
):
    """Prompts joining and leaving a batch of up to 6 rows, drafts of up to 16 tokens (wider
    than the kernel's usual 6 positions), prompt chunks beside verification."""
    engine = engine_of(bf16_model, tokenizer, 6)
    engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free: auto verifies them
    outputs = run_staggered(engine, PROMPTS, MAX_NEW, SpecConfig(mode=mode, num_draft_tokens=16))
    mismatches = [index for index, expected in enumerate(plain_runs) if outputs[index] != expected]
    assert not mismatches, f"prompts {mismatches} differ from plain decoding"
    assert engine.stats.num_accepted > 0, "speculation was not exercised"
