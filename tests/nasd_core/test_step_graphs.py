"""Fixed-shape steps (``nasd_core/model/step_graphs.py``) against the packed path, on this CPU.

On a GPU these steps are replayed from CUDA graphs (``test_gpu.py`` checks that); here they
run eagerly, which holds their layout to the packed path's logits: rows padded to a bucket
of rows and positions, keys gathered and padded to a power of two or read through the block
tables (FlexAttention, unfused and compiled), a scratch slot for every padded write, fragmented
rows and rolled-back drafts whose stale slots the padding must never read.
"""

from __future__ import annotations

import pytest
import torch

from nasd_core.config import EngineConfig, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.model.model_runner import ModelRunner, StepRow
from nasd_core.model.step_graphs import StepShape, bucket, key_bucket
from tests.nasd_core.test_engine import MAX_TOKENS, PROMPTS, run_staggered, single_sequence_runs


@pytest.fixture(scope="module")
def single_runs(model, tokenizer):
    return single_sequence_runs(model, tokenizer)


def test_buckets_hold_the_step():
    assert bucket(1, (1, 2, 4)) == 1 and bucket(3, (1, 2, 4)) == 4 and bucket(5, (1, 2, 4)) is None
    assert key_bucket(1) == 128 and key_bucket(129) == 256 and key_bucket(1024) == 1024


PAGE = 16


def fragmented_runner(
    model, prompts: list[list[int]], step_graphs: bool, graph_attention: str | None = None
) -> ModelRunner:
    """A runner whose rows hold ``prompts`` with 8 spare positions each, row 1 fragmented
    around a hole left by a freed row."""
    # Exactly the rows' blocks (and the scratch block): row 1, allocated last, must take the hole.
    # Pages of 16: the smallest FlexAttention's CUDA tiles divide (a GPU runs this too).
    num_blocks = sum(-(-(len(prompt) + 8) // PAGE) for prompt in prompts) + step_graphs
    runner = ModelRunner(
        model,
        kv_cache_tokens=num_blocks * PAGE,
        block_size=PAGE,
        step_graphs=step_graphs,
        graph_attention=graph_attention,
    )
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
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (70, 300, 33)]
    widths = [1, 5, 12]  # 3 rows of up to 12 positions: a 4 x 17 step with a padded row
    results = {}
    for step_graphs in (False, True, False):  # the first run warms up (see test_attention)
        runner = fragmented_runner(model, prompts, step_graphs, graph_attention)
        if runner.graphs is not None and compiled is not None:
            runner.graphs.compiled = compiled
        results[step_graphs] = run_steps(runner, prompts, widths)
        if step_graphs:
            fixed_runner = runner
    return fixed_runner, list(zip(results[True], results[False], strict=True))


@pytest.mark.parametrize("graph_attention", ["gathered", "paged"])
def test_fixed_shape_steps_get_the_logits_of_the_packed_path(model, graph_attention):
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


def run_engine_on_fixed_steps(
    model, tokenizer, references: list[list[int]], mode: str, graph_attention: str | None = None
) -> Engine:
    """The staggered prompts on an engine with fixed-shape steps: rows joining and leaving
    between steps (row counts off the buckets), drafts of every width, prompt chunks beside
    decode steps (those steps take the packed path); its greedy outputs must be ``references``."""
    # On a CPU paged steps run FlexAttention's unfused reference, which scores the whole pool:
    # a small one keeps that quick.
    kv_cache_tokens = 2048 if graph_attention == "paged" and model.device.type == "cpu" else None
    config = EngineConfig(
        max_batch_rows=6,
        prefill_chunk_tokens=16,
        step_graphs=True,
        graph_attention=graph_attention,
        kv_cache_tokens=kv_cache_tokens,
    )
    engine = Engine(model, tokenizer, config)
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, SpecConfig(mode=mode, num_draft_tokens=5))
    mismatches = [index for index, expected in enumerate(references) if outputs[index] != expected]
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
