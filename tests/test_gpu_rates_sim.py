"""The GPU-rates simulator (``benchmarks/gpu_rates.py``): its stand-in must be exact, or its
figures mean nothing, and the engine must read no graph capture as a step's cost."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_rates import (
    MODES,
    TRACES,
    compact_traces,
    mix_traces,
    new_setup,
    run_once,
)
from nasd_core.loader import load_tokenizer
from nasd_core.runner.step_graphs import POSITION_BUCKETS


@pytest.fixture(scope="module")
def sim_inputs():
    vocab, traces = compact_traces(json.loads(TRACES.read_text())["traces"])
    return vocab, traces, load_tokenizer()


@pytest.mark.parametrize("variant", ["c072471", "grid"])
def test_the_stand_in_replays_the_recorded_greedy_tokens_in_every_mode(sim_inputs, variant):
    vocab, traces, tokenizer = sim_inputs
    setup = new_setup(variant, vocab, tokenizer, 4)
    work = mix_traces(traces, "repetitive", 8)
    cells = {mode: run_once(setup, work, 4, mode) for mode in MODES}
    assert all(cell["exact"] for cell in cells.values()), "an engine's output left the recorded trace"
    assert cells["on"]["drafted_positions"] > 0 and cells["auto"]["accepted"] > 0
    # The grid is captured at start: serving captures nothing. Without it, shapes are captured
    # when first met.
    captured = [cell["captured_while_serving"] for cell in cells.values()]
    assert (max(captured) == 0) if variant == "grid" else (min(captured) > 0)


def test_a_step_that_captured_its_shape_is_not_read_as_that_shapes_cost(sim_inputs):
    """Runners that capture when a shape is first met (no start-up grid): the capture step costs
    ~3 packed steps (~70 ms simulated), a replay 5-8 ms; the graph step-time model holds replays
    only. No probe first: a capture read as a step time would be that shape's first reading."""
    vocab, traces, tokenizer = sim_inputs
    setup = new_setup("grid", vocab, tokenizer, 4, probe=False)
    cold_runner = setup.runner

    def lazy_runner(concurrency: int):
        runner = cold_runner(concurrency)
        runner.captured.clear()
        runner.is_warm = False
        return runner

    setup.runner = lazy_runner
    cell = run_once(setup, mix_traces(traces, "repetitive", 8), 4, "auto")
    assert cell["exact"] and cell["captured_while_serving"] > 0
    step_times = setup.calibration.graph_step_times
    readings = [
        step_times.measured(rows, width)
        for rows in range(1, 5)
        for width in POSITION_BUCKETS
        if step_times.measured(rows, width) is not None
    ]
    assert readings and max(readings) < 0.03
