"""Fixed-shape steps (``nasd_core/runner/step_graphs.py``) against the packed path, on this CPU.

On a GPU these steps are replayed from CUDA graphs (``test_gpu.py`` checks that); here they
run eagerly, which holds their layout to the packed path's logits: rows padded to a bucket
of rows and positions, keys gathered and padded to a power of two or read through the block
tables (FlexAttention, unfused and compiled), a scratch slot for every padded write, fragmented
rows and rolled-back drafts whose stale slots the padding must never read.
"""

from __future__ import annotations

import pytest
import torch

from nasd_core.config import EngineConfig, RunnerConfig, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.runner.model_runner import ModelRunner, StepRow
from nasd_core.runner.step_graphs import POSITION_BUCKETS, FixedStep, StepShape, bucket, key_bucket
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, FixedStepTimes, run_staggered


def test_buckets_hold_the_step():
    assert bucket(1, (1, 2, 4)) == 1 and bucket(3, (1, 2, 4)) == 4 and bucket(5, (1, 2, 4)) is None
    assert key_bucket(1) == 128 and key_bucket(129) == 256 and key_bucket(1024) == 1024


PAGE = 16


def fragmented_runner(
    model,
    prompts: list[list[int]],
    step_graphs: bool,
    graph_attention: str | None = None,
    prefill_chunk_tokens: int | None = None,
) -> ModelRunner:
    """A runner whose rows hold ``prompts`` with 8 spare positions each, row 1 fragmented
    around a hole left by a freed row."""
    # Exactly the rows' blocks (and the scratch block): row 1, allocated last, must take the hole.
    # Pages of 16: the smallest FlexAttention's CUDA tiles divide (a GPU runs this too).
    num_blocks = sum(-(-(len(prompt) + 8) // PAGE) for prompt in prompts) + step_graphs
    config = RunnerConfig(
        kv_cache_tokens=num_blocks * PAGE,
        block_size=PAGE,
        step_graphs=step_graphs,
        graph_attention=graph_attention,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )
    runner = ModelRunner(model, config)
    for row in (0, "hole", *range(2, len(prompts))):
        runner.cache.allocate(row, len(prompts[row]) + 8 if row != "hole" else 8)
    runner.cache.free("hole")
    runner.cache.allocate(1, len(prompts[1]) + 8)
    assert runner.cache.rows[1].start_slot is None, "row 1 should be fragmented"
    return runner


def run_steps(runner: ModelRunner, prompts: list[list[int]], widths: list[int]) -> list[torch.Tensor]:
    """Prefill all but each row's last ``widths`` tokens plus 3 junk positions (rolled back),
    verify the last ``widths`` tokens, then decode three steps of one token per row (the
    second with the last row left out); every step's logits."""
    cut = [len(prompt) - width for prompt, width in zip(prompts, widths)]
    runner.forward([StepRow(row, prompt[: cut[row]] + [0] * 3, 0) for row, prompt in enumerate(prompts)])
    for row in range(len(prompts)):
        runner.cache.set_length(row, cut[row])
    results = [
        runner.forward([StepRow(row, prompt[cut[row] :], widths[row]) for row, prompt in enumerate(prompts)])
    ]
    for step in range(3):
        rows = range(len(prompts) - 1) if step == 1 else range(len(prompts))
        results.append(runner.forward([StepRow(row, [(step * 31 + row) % 49152], 1) for row in rows]))
    return results


def fixed_and_packed_logits(
    model, graph_attention: str | None = None, compiled: bool | None = None
) -> tuple[ModelRunner, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``run_steps`` on fixed-shape steps (attending as ``graph_attention`` says, through a
    compiled kernel where ``compiled``; None: the runner's default) and on the packed path:
    the fixed-shape runner and each step's (fixed, packed) logits."""
    results = {}
    for step_graphs in (False, True, False):  # the first run warms up (see test_attention)
        runner, results[step_graphs] = step_logits(model, step_graphs, graph_attention, compiled)
        if step_graphs:
            fixed_runner = runner
    return fixed_runner, list(zip(results[True], results[False], strict=True))


def packed_logits(model) -> list[torch.Tensor]:
    """``fixed_and_packed_logits``' steps on the packed path alone."""
    step_logits(model, step_graphs=False)  # a warm-up run (see test_attention)
    return step_logits(model, step_graphs=False)[1]


def step_logits(
    model, step_graphs: bool, graph_attention: str | None = None, compiled: bool | None = None
) -> tuple[ModelRunner, list[torch.Tensor]]:
    """The runner and its logits for ``run_steps`` of 3 rows of up to 12 positions (a 4 x 17 step
    with a padded row) on random prompts, a fragmented KV-cache."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (70, 300, 33)]
    runner = fragmented_runner(model, prompts, step_graphs, graph_attention)
    if runner.graphs is not None and compiled is not None:
        runner.graphs.compiled = compiled
    return runner, run_steps(runner, prompts, [1, 5, 12])


@pytest.mark.parametrize("graph_attention", ["gathered", "paged"])
def test_fixed_shape_steps_get_the_logits_of_the_packed_path(model, graph_attention, request):
    if graph_attention == "paged":
        runner, logits = request.getfixturevalue("paged_steps")
    else:
        runner, logits = fixed_and_packed_logits(model, graph_attention)
    assert runner.graphs is not None and runner.graphs.paged == (graph_attention == "paged")
    # The prompt chunks took the packed path; every other step a fixed shape (with a key bucket
    # where keys are gathered, none where they are read through the block tables).
    keys = 0 if graph_attention == "paged" else 512
    assert set(runner.graphs.steps) == {StepShape(4, 17, keys), StepShape(4, 1, keys), StepShape(2, 1, keys)}
    for fixed, packed in logits:
        torch.testing.assert_close(fixed, packed, atol=2e-4, rtol=0)


def test_paged_steps_through_the_compiled_kernel_get_the_logits_of_the_packed_path(model):
    """The fused FlexAttention kernel (what a GPU runs in its graphs), compiled for this CPU."""
    runner, logits = fixed_and_packed_logits(model, "paged", compiled=True)
    assert runner.graphs is not None and runner.graphs.paged
    for fixed, packed in logits:
        torch.testing.assert_close(fixed, packed, atol=2e-4, rtol=0)


PAGED_CPU_PROMPTS = 7


def run_engine_on_fixed_steps(
    model, tokenizer, references: list[list[int]], mode: str, graph_attention: str | None = None
) -> Engine:
    """The staggered prompts (the first ``PAGED_CPU_PROMPTS`` for paged steps on a CPU) on an
    engine with fixed-shape steps: rows joining and leaving between steps (row counts off the
    buckets), drafts of every width, prompt chunks beside decode steps (those steps take the
    packed path); its greedy outputs must be those prompts' ``references``."""
    # On a CPU paged steps run FlexAttention's unfused reference, 22 ms a layer through vmap on a
    # Zen 5: there only the first PAGED_CPU_PROMPTS prompts run (rows still join and leave, drafts
    # of every width, chunks beside decode steps), in a pool of 512 positions (they take ~250).
    num_prompts = len(PROMPTS)
    kv_cache_tokens = None
    if graph_attention == "paged" and model.device.type == "cpu":
        num_prompts, kv_cache_tokens = PAGED_CPU_PROMPTS, 512
    config = EngineConfig(
        max_batch_rows=6,
        prefill_chunk_tokens=16,
        step_graphs=True,
        graph_attention=graph_attention,
        kv_cache_tokens=kv_cache_tokens,
    )
    engine = Engine(model, tokenizer, config)
    engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free: auto verifies them
    prompts, max_tokens = PROMPTS[:num_prompts], MAX_TOKENS[:num_prompts]
    outputs = run_staggered(engine, prompts, max_tokens, SpecConfig(mode=mode, num_draft_tokens=5))
    mismatches = [
        index for index, expected in enumerate(references[:num_prompts]) if outputs[index] != expected
    ]
    assert not mismatches, f"rows {mismatches} differ from their single-sequence runs"
    assert engine.stats.num_accepted > 0, "speculation was not exercised"
    assert engine.runner.graphs is not None and len(engine.runner.graphs.steps) > 2
    assert not engine.cache.rows, "every request's blocks are back (the scratch block is no row)"
    return engine


@pytest.mark.parametrize(
    ("mode", "graph_attention"), [("on", "gathered"), ("auto", "gathered"), ("on", "paged")]
)
def test_an_engine_on_fixed_shape_steps_emits_the_single_sequence_greedy_tokens(
    model, tokenizer, single_runs, mode, graph_attention
):
    engine = run_engine_on_fixed_steps(model, tokenizer, single_runs, mode, graph_attention)
    assert engine.runner.graphs is not None and engine.runner.graphs.paged == (graph_attention == "paged")


def run_chunk_steps(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prompt chunks through every layout a step of chunks can take, each step's logits: two
    chunks sharing a shape of their own, a chunk between two verifying rows (its logits in row
    order), two chunks too wide to share a shape, each alone, and one past every chunk shape."""
    steps = [
        [StepRow(0, prompts[0][:60], 0), StepRow(2, prompts[2][:20], 2)],
        [StepRow(0, prompts[0][60:65], 5), StepRow(1, prompts[1][:100], 1), StepRow(2, prompts[2][20:23], 3)],
        [StepRow(1, prompts[1][100:200], 0), StepRow(0, prompts[0][65:105], 40)],
        [StepRow(1, prompts[1][200:400], 1), StepRow(2, prompts[2][23:24], 1)],
    ]
    return [runner.forward(step) for step in steps]


def test_prompt_chunks_run_in_shapes_of_their_own_with_the_logits_of_the_packed_path(model):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (110, 400, 40)]
    results = {}
    for step_graphs in (False, True):
        runner = fragmented_runner(model, prompts, step_graphs, "paged", prefill_chunk_tokens=128)
        results[step_graphs] = run_chunk_steps(runner, prompts)
        if step_graphs:
            graphs = runner.graphs
    assert graphs is not None and graphs.chunk_tokens == 128 and graphs.chunk_failure is None
    # Chunks of 60 and 20 shared a 2 x 64 shape; the lone chunk of 100 took 1 x 128 beside the
    # verifying rows' 2 x 8; 100 and 40 (2 x 128 is over 128 tokens) took 1 x 128 and 1 x 64;
    # the 200-token chunk ran packed with the whole of its step.
    shapes = {StepShape(2, 64, 0), StepShape(1, 128, 0), StepShape(2, 8, 0), StepShape(1, 64, 0)}
    assert set(graphs.steps) == shapes
    assert [len(logits) for logits in results[True]] == [2, 9, 40, 2]
    for fixed, packed in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(fixed, packed, atol=2e-4, rtol=0)


def test_a_chunk_shape_that_fails_to_build_sends_chunks_to_the_packed_path_and_keeps_the_rest(
    model, monkeypatch
):
    """A fault injected where a GPU fails (a chunk's kernel that does not compile or capture):
    chunks run packed from then on, with the reason kept, and verification steps keep their
    paged shapes."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (110, 400, 40)]
    decode = [StepRow(0, [5], 1), StepRow(2, [6], 1)]
    packed_runner = fragmented_runner(model, prompts, False, prefill_chunk_tokens=128)
    packed = [*run_chunk_steps(packed_runner, prompts), packed_runner.forward(decode)]
    runner = fragmented_runner(model, prompts, True, "paged", prefill_chunk_tokens=128)
    run = FixedStep.run

    def failing_run(step: FixedStep) -> None:
        if step.shape.num_positions > POSITION_BUCKETS[-1]:
            raise RuntimeError("no kernel for this tile")
        run(step)

    monkeypatch.setattr(FixedStep, "run", failing_run)
    fixed = [*run_chunk_steps(runner, prompts), runner.forward(decode)]
    graphs = runner.graphs
    assert graphs is not None and graphs.paged and graphs.fallback is None
    assert graphs.chunk_failure == "RuntimeError: no kernel for this tile"
    assert runner.report()["step_graphs"]["prompt_chunk_failure"] == graphs.chunk_failure
    # Every step with a chunk ran packed; the decode step after them, in its paged shape.
    assert set(graphs.steps) == {StepShape(2, 1, 0)} and runner.last_graph_shape == StepShape(2, 1, 0)
    for fixed_logits, packed_logits in zip(fixed, packed, strict=True):
        torch.testing.assert_close(fixed_logits, packed_logits, atol=2e-4, rtol=0)
