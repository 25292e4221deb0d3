"""Step-time calibration: the warm-up probe that times steps before the first request.

The ``auto`` policy prices drafts with a step-time model learned online; the probe gives it
measured shapes up front (what a server does before its first request, and every benchmark
before its runs). Steps run through the same ``ModelRunner`` path as the engine's, over rows
holding ``context_length`` cached tokens, so attention costs what a real row's does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nasd_core.config import DEFAULT_KV_BLOCK_SIZE, RunnerConfig
from nasd_core.runner.model_runner import ModelRunner, StepRow
from nasd_core.speculation.acceptance import AcceptanceEstimator, pooled_acceptance
from nasd_core.speculation.gate import GateHistory
from nasd_core.speculation.graph_plan import GraphStepTimes
from nasd_core.speculation.payoff import DraftPayoff
from nasd_core.speculation.step_time import MIN_TRUSTED_SAMPLES, StepTimeModel

# Positions per row the probe times: every small width the policy weighs often, and sparse
# wide ones up to the default draft cap (16) that the model interpolates between.
PROBE_POSITIONS = (1, 2, 3, 4, 5, 6, 9, 17)


@dataclass(eq=False)
class Calibration:
    """What an engine learns of its model's step costs and of its drafts' acceptance.

    Each engine owns one (``Engine.calibration``); engines given the same one learn together, as
    a benchmark's runs on one model do, or ``generate`` calls passed the same one. Why share:
    an engine that starts from the fixed prior table drafts for its first wave of requests at
    the table's odds; on creative text at 16 rows those drafts (~140 positions riding in the
    prompt-chunk steps) had 2 tokens accepted where the table promised 14, ~2% of the run, paid
    again by every new engine. The pooled acceptance forgets (``POOLED_DECAY``), so it follows
    the current traffic.

    Attributes:
        step_time: seconds of packed steps by rows and positions.
        graph_step_times: seconds of fixed-shape (CUDA-graph) steps by shape.
        acceptance: acceptance pooled over the greedy requests, the prior of each new greedy
            request's own.
        sampled_acceptance: the same for sampled requests (``acceptance_prior``).
        payoff: what drafted packed steps deliver of their promise (read against ``step_time``).
        graph_payoff: the same for fixed-shape steps.
        gate_history: the first verdicts of the requests' draft gates, which size a new
            request's first window.
    """

    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    graph_step_times: GraphStepTimes = field(default_factory=GraphStepTimes)
    acceptance: AcceptanceEstimator = field(default_factory=pooled_acceptance)
    sampled_acceptance: AcceptanceEstimator = field(default_factory=pooled_acceptance)
    payoff: DraftPayoff = field(default_factory=DraftPayoff)
    graph_payoff: DraftPayoff = field(default_factory=DraftPayoff)
    gate_history: GateHistory = field(default_factory=GateHistory)

    def acceptance_prior(self, greedy: bool) -> AcceptanceEstimator:
        """The pool a new request's acceptance starts from: greedy and sampled requests apart.

        Why: a sampled row keeps a drafted token with the model's probability of it, not only
        when it is the top one, so the same match is accepted less often, and far less at a high
        temperature; pooled with greedy copies, sampled requests started from greedy odds.
        """
        return self.acceptance if greedy else self.sampled_acceptance


PROBE_ROW = "nasd-probe"


def probe_row(index: int) -> tuple[str, int]:
    """The id of the probe's row ``index`` (never a request's: those are strings)."""
    return (PROBE_ROW, index)


@torch.inference_mode()
def fill_rows(runner, num_rows: int, context_length: int, row_tokens: int) -> None:
    """Make ``num_rows`` probe rows (``probe_row``) in ``runner``'s cache, each with room for
    ``row_tokens`` positions, hold the same ``context_length`` cached tokens (one prefill,
    copied to the rest)."""
    cache = runner.cache
    for row in range(num_rows):
        cache.allocate(probe_row(row), row_tokens)
    vocab_size = runner.model.config.vocab_size
    runner.forward([StepRow(probe_row(0), [(7 * i) % vocab_size for i in range(context_length)], 0)])
    source = cache.slots(probe_row(0), 0, context_length)
    for row in range(1, num_rows):
        target = cache.slots(probe_row(row), 0, context_length)
        for keys, values in zip(cache.keys, cache.values):
            keys[:, target] = keys[:, source]
            values[:, target] = values[:, source]
        cache.set_length(probe_row(row), context_length)


def free_rows(runner, num_rows: int) -> None:
    for row in range(num_rows):
        runner.cache.free(probe_row(row))


def filled_runner(
    model,
    num_rows: int,
    context_length: int,
    max_width: int,
    step_graphs: bool = False,
    graph_attention: str | None = None,
    compiled_layers: bool | None = None,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    """A runner whose probe rows ``0..num_rows-1`` hold ``context_length`` cached tokens each,
    with room for steps of up to ``max_width`` positions per row (and the graphs' scratch block)."""
    row_tokens = context_length + max_width
    block_size = DEFAULT_KV_BLOCK_SIZE  # the engine's: paged graph steps read whole blocks
    row_blocks = -(-row_tokens // block_size)
    config = RunnerConfig(
        kv_cache_tokens=(num_rows * row_blocks + 1) * block_size,
        block_size=block_size,
        max_rows=num_rows,
        step_graphs=step_graphs,
        graph_attention=graph_attention,
        compiled_layers=compiled_layers,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(model, config)
    fill_rows(runner, num_rows, context_length, row_tokens)
    return runner


@torch.inference_mode()
def time_step(runner, widths: Sequence[int], context_length: int) -> float:
    """Seconds of one step where probe row i (filled by ``fill_rows``) feeds ``widths[i]``
    positions with logits; the rows are rolled back to ``context_length`` afterwards."""
    step = [StepRow(probe_row(row), [0] * width, width) for row, width in enumerate(widths)]
    started = time.perf_counter()
    runner.forward(step)[-1, 0].item()  # wait for the device, as verification does
    seconds = time.perf_counter() - started
    for row in range(len(widths)):
        runner.cache.set_length(probe_row(row), context_length)
    return seconds


@torch.inference_mode()
def measure_step_times(
    model,
    positions: int | Sequence[int],
    rows: Sequence[int] = (1,),
    context_length: int = 256,
    repeats: int = 3,
    calibration: Calibration | None = None,
    step_graphs: bool = False,
    runner=None,
    graph_attention: str | None = None,
    compiled_layers: bool | None = None,
) -> Calibration:
    """Time steps of every shape ``rows`` x ``positions`` per row (an int means 1..positions),
    and, for more than one row of packed steps, ragged steps where one row feeds that many
    positions and the others one each (the shape of one well-matched row in a batch).

    ``runner``: time the steps on this runner (an engine's own, its graphs warmed) in rows
    taken from its cache and given back; None: on a runner made for the probe. Packed steps go
    to ``calibration.step_time``, fixed-shape steps to its graph step times by shape; a step
    that captured its shape is not a reading. Returns ``calibration`` (None: a new one).

    Each shape's fastest repeat is recorded, as trusted: interference from other processes only
    adds time. (Counted as one reading, every probed shape within 10% of the best was retimed
    by the policy's exploration: creative text at 32 rows ran at 0.85x of plain decoding.)
    """
    calibration = calibration if calibration is not None else Calibration()
    positions = list(range(1, positions + 1)) if isinstance(positions, int) else list(positions)
    own_rows = runner is not None
    if own_rows:
        fill_rows(runner, max(rows), context_length, context_length + max(positions))
    else:
        runner = filled_runner(
            model, max(rows), context_length, max(positions), step_graphs, graph_attention, compiled_layers
        )
    ragged = runner.graph_widths is None  # a fixed shape costs its width whatever the rows use
    for num_rows in rows:
        shapes = [[width] * num_rows for width in positions]
        if num_rows > 1 and ragged:
            shapes += [[width] + [1] * (num_rows - 1) for width in positions if width > 1]
        fastest: dict[tuple[object, int, int], float] = {}
        for _ in range(repeats):
            for widths in shapes:
                seconds = time_step(runner, widths, context_length)
                if runner.last_captured:
                    continue
                shape = runner.last_graph_shape
                key = (
                    (calibration.graph_step_times, shape.num_rows, shape.num_positions)
                    if shape is not None
                    else (calibration.step_time, num_rows, sum(widths))
                )
                fastest[key] = min(seconds, fastest.get(key, seconds))
        for (times, shape_rows, shape_size), seconds in fastest.items():
            times.observe(shape_rows, shape_size, seconds, num_samples=MIN_TRUSTED_SAMPLES)
    if own_rows:
        free_rows(runner, max(rows))
    return calibration


def calibrate(
    model,
    max_rows: int,
    repeats: int = 2,
    step_graphs: bool = False,
    runner=None,
    calibration: Calibration | None = None,
) -> Calibration:
    """Probe step times at 1, 2, 4, ... rows up to ``max_rows`` into ``calibration`` (None: a
    new one), which is returned: through fixed-shape steps with ``step_graphs``, as the engines
    that use them run. ``runner``: probe on that runner (an engine's own) rather than one made
    for the probe; a runner with fixed-shape steps is probed at their widths up to
    ``PROBE_POSITIONS``' widest."""
    rows = {2**power for power in range(max_rows.bit_length()) if 2**power <= max_rows} | {max_rows}
    positions: Sequence[int] = PROBE_POSITIONS
    widths = runner.graph_widths if runner is not None else None
    if widths is not None:
        positions = [width for width in widths if width <= max(PROBE_POSITIONS)]
    return measure_step_times(
        model,
        positions,
        sorted(rows),
        repeats=repeats,
        calibration=calibration,
        step_graphs=step_graphs,
        runner=runner,
    )
