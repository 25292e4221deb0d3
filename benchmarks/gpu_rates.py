"""SIMULATION of GPU step rates on a CPU: the engine, drafter, policy and host path run for real
over a stand-in model whose steps cost what an H100 measured.

The stand-in (``SimulatedRunner``) replaces the model runner. Its logits make the embedded
model's recorded greedy continuation (``benchmarks/traces/greedy_float32.json``) the argmax at
every position on that continuation, so greedy output is exactly the trace whatever the engine
drafts, and a step waits out what the measured surface says such a step costs on the GPU:

- a fixed-shape (CUDA-graph) step: the graph surface of a random-weight Qwen2-1.5B in bfloat16
  (``benchmarks/surfaces/h100_qwen2-1.5b_graphs.json``), by its padded rows x positions;
- any other step (prompt chunks, shapes without a graph): the packed surface of the same model
  (``benchmarks/results/step_cost_cuda_qwen2-1.5b.json``), by rows and positions per row;
- the first replay of a shape not captured at start: ``WARMUP_RUNS + 1`` packed steps more (the
  warm-up runs and the capture, an estimate).

Its host-side cost (the argmax over its one-hot logits on this CPU) is measured at start and
taken out of the wait. A graph step loads its inputs as the real runner's does (``FixedStep.load``
into static buffers, here on the CPU), so that host work is counted. Host time per step is the
wall time less the simulated device time (argmax included: on a GPU it is device work) and less
the stand-in's own work (finding each position's trace token, writing one-hot logits), which
is no engine's. Two engines are compared, each with off / on / auto:

- ``c072471``: this engine with a runner behaving as it did then: graphs captured when first
  met, one per context bucket, the policy blind to them (one step-time model by positions,
  captures read as step times, best cases priced before drafts are built), probed on a runner
  of its own;
- ``grid``: the grid captured at start, paged (one shape per rows x positions whatever the
  context; the surface prices a shape the same at every context in both variants), the policy
  pricing fixed shapes by width from replays only, probed on the engine's own runner.

    python -m benchmarks.gpu_rates            # C = 1, 4, 16, 64; repetitive, creative, long chats
    python -m benchmarks.gpu_rates --quick    # C = 1, 16 on the repetitive mix
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS_DIR, percentile, run_metadata, write_result
from nasd_core.config import EngineConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.layers.kv_cache import PagedKVCache
from nasd_core.runner.model_runner import GPU_PREFILL_CHUNK_TOKENS, StepRow
from nasd_core.runner.step_graphs import (
    POSITION_BUCKETS,
    ROW_BUCKETS,
    WARMUP_RUNS,
    FixedStep,
    PagedTables,
    RowInput,
    StepBuffers,
    StepShape,
    captures_when_met,
    fixed_shape,
    grid_shapes,
)
from nasd_core.speculation.calibration import Calibration, calibrate

TRACES = Path(__file__).resolve().parent / "traces" / "greedy_float32.json"
GRAPH_SURFACE = Path(__file__).resolve().parent / "surfaces" / "h100_qwen2-1.5b_graphs.json"
PACKED_SURFACE = RESULTS_DIR / "step_cost_cuda_qwen2-1.5b.json"
MIXES = {
    "repetitive": ("code_edit", "rag_quote", "json_reformat", "translation"),
    "creative": ("creative",),
    "long_chat": ("long_chat",),
}
LEVELS = (1, 4, 16, 64)
MODES = ("off", "on", "auto")
VARIANTS = ("c072471", "grid")
MAX_TOKENS = 128
GQA_GROUPS = 6  # Qwen2-1.5B: 12 query heads per 2 key/value heads
EOS = 2  # SmolLM2's end of text
MIN_TOKENS = 32


def max_tokens_of(index: int) -> int:
    """Request ``index``'s max_tokens, spread over MIN_TOKENS..MAX_TOKENS. Equal lengths would run
    a closed batch in lockstep: its makespan is then its slowest slot's chain of requests, which
    tokens accepted on other rows cannot shorten (creative text, whose traces all reach 128
    tokens, ran 259 steps at C = 64 with and without drafting, 1244 drafted tokens accepted)."""
    return MIN_TOKENS + (index * 37) % (MAX_TOKENS - MIN_TOKENS + 1)


class Surface:
    """Milliseconds of a step by rows and positions per row, interpolated linearly in both
    between measured points (and held flat beyond them)."""

    def __init__(self, table: dict[str, dict[str, float]]) -> None:
        self.rows = sorted(int(rows) for rows in table)
        self.table = {int(rows): {int(width): ms for width, ms in by.items()} for rows, by in table.items()}

    def ms(self, num_rows: float, width: float) -> float:
        low, high, share = _bracket(self.rows, num_rows)
        return (1 - share) * self._at(low, width) + share * self._at(high, width)

    def _at(self, rows: int, width: float) -> float:
        by_width = self.table[rows]
        low, high, share = _bracket(sorted(by_width), width)
        return (1 - share) * by_width[low] + share * by_width[high]


def _bracket(points: list[int], value: float) -> tuple[int, int, float]:
    value = min(max(value, points[0]), points[-1])
    high = next(point for point in points if point >= value)
    low = max(point for point in points if point <= value)
    return low, high, 0.0 if high == low else (value - low) / (high - low)


CPU = torch.device("cpu")


@dataclass(eq=False)
class SimModel:
    """What the engine reads of a model: its config and device."""

    config: object
    device: torch.device = CPU
    dtype: torch.dtype = torch.float32


class CompactTokenizer:
    """The real tokenizer over a compact vocabulary (the traces' tokens only), so the stand-in's
    logits are narrow: an argmax over 49k columns on this CPU would cost more than a GPU step."""

    def __init__(self, tokenizer, vocab: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos_token_id = vocab.index(EOS)

    def decode(self, token_ids: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode([self.vocab[token] for token in token_ids], **kwargs)


class SimulatedRunner:
    """A model runner whose steps cost the measured GPU surface (module docstring).

    ``blind``: behave as the runner at c072471 did towards the engine: report no fixed shapes
    (one step-time model for every step, captures included), capture shapes when first met.
    """

    def __init__(
        self, model: SimModel, graphs: Surface, packed: Surface, kv_tokens: int, blind: bool, eos_id: int
    ) -> None:
        self.model = model
        self.eos_id = eos_id
        self.graphs_surface, self.packed_surface = graphs, packed
        self.cache = PagedKVCache(1, 1, 1, -(-kv_tokens // 32), 32, torch.float32, "cpu")
        self.blind = blind
        self.captured: set = set()
        self.is_warm = False
        self.traces: dict[object, np.ndarray] = {}
        self.vocab_size = model.config.vocab_size
        self.logits = torch.zeros(0, self.vocab_size)
        self.argmax_s = _argmax_cost(self.vocab_size)
        self.device_s = 0.0  # simulated GPU time (argmax included), for the host share
        self.simulation_s = 0.0  # the stand-in's own work (trace tokens, one-hot logits)
        # A graph step's inputs, loaded into static buffers as the real runner's are.
        self.scratch_slot = self.cache.reserve_block()
        num_blocks = self.cache.allocator.num_blocks
        max_row_blocks = min(num_blocks, self.cache.blocks_for(model.config.max_position_embeddings))
        self.tables = PagedTables(ROW_BUCKETS[-1], num_blocks, max_row_blocks, CPU)
        self.buffers = StepBuffers(
            ROW_BUCKETS[-1] * POSITION_BUCKETS[-1], ROW_BUCKETS[-1], max_row_blocks + 2, 1, torch.float32, CPU
        )
        self.fixed_steps: dict[StepShape, FixedStep] = {}
        self.start_s = 0.0  # simulated start-up capture time
        self.num_captured_serving = 0
        self.last_graph_shape: StepShape | None = None
        self.last_captured = False
        # As a GPU does: ``forward`` returns once the step is queued, ``wait`` until it is done.
        self.runs_async = True
        self.ready_at = 0.0

    @property
    def graph_widths(self) -> tuple[int, ...] | None:
        return None if self.blind else tuple(width for width in POSITION_BUCKETS if width <= 17)

    def warm_up(self, max_rows: int, max_positions: int, max_keys: int, budget_s: float) -> None:
        for shape in grid_shapes(max_rows, max_positions, max_keys, GQA_GROUPS, paged=not self.blind):
            self.captured.add(shape)
            self.start_s += self._capture_ms(shape) / 1000
        self.is_warm = True

    def expect(self, row_id: object, token_ids: Sequence[int]) -> None:
        """The trace row ``row_id`` follows: its prompt and the model's greedy continuation."""
        self.traces[row_id] = np.asarray(token_ids)

    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        cost_ms = self._cost_ms(rows)  # (a graph step's inputs loaded, as the runner does)
        simulation_started = time.perf_counter()
        targets = np.concatenate([self._targets(row) for row in rows]) if rows else np.zeros(0)
        if len(targets) > len(self.logits):
            self.logits = torch.zeros(2 * len(targets), self.vocab_size)
        self.logits.zero_()  # (cheap next to the wait: at most a few MB)
        logits = self.logits[: len(targets)]
        logits[torch.arange(len(targets)), torch.from_numpy(targets)] = 1.0
        self.simulation_s += time.perf_counter() - simulation_started
        for row in rows:
            self.cache.set_length(row.row_id, self.cache.length(row.row_id) + len(row.token_ids))
        # The engine's argmax runs on this CPU after the wait: the wait is the rest of the step.
        argmax_s = self.argmax_s(len(targets))
        self.device_s += cost_ms / 1000
        self.ready_at = time.perf_counter() + cost_ms / 1000 - argmax_s  # launched now
        return logits

    def wait(self) -> None:
        _wait_until(self.ready_at)

    def _cost_ms(self, rows: Sequence[StepRow]) -> float:
        self.last_graph_shape, self.last_captured = None, False
        num_positions = sum(len(row.token_ids) for row in rows)
        packed_ms = self._price(self.packed_surface, len(rows), num_positions / max(1, len(rows)))
        if not all(row.num_logits == len(row.token_ids) for row in rows):
            return packed_ms
        inputs = [
            RowInput(row.row_id, row.token_ids, self.cache.length(row.row_id), row.num_logits) for row in rows
        ]
        shape = fixed_shape(inputs, GQA_GROUPS, paged=not self.blind)
        if shape is None or (self.blind and shape.num_positions > 17):
            return packed_ms
        replay_ms = self._price(self.graphs_surface, shape.num_rows, shape.num_positions)
        if not self.blind:
            self.last_graph_shape = shape
            self._load(shape, inputs)
        if shape in self.captured:
            return replay_ms
        if not captures_when_met(len(self.captured), self.is_warm):
            self.last_graph_shape = None
            return packed_ms
        self.captured.add(shape)
        self.num_captured_serving += 1
        self.last_captured = not self.blind
        return self._capture_ms(shape) + replay_ms

    def _load(self, shape: StepShape, inputs: list[RowInput]) -> None:
        """The real runner's host work for a graph step: its inputs into the static buffers."""
        step = self.fixed_steps.get(shape)
        if step is None:
            step = FixedStep(
                self.model, self.cache, GQA_GROUPS, shape, self.scratch_slot, self.buffers, self.tables
            )
            self.fixed_steps[shape] = step
        step.load(inputs)

    def _capture_ms(self, shape) -> float:
        return (WARMUP_RUNS + 1) * self._price(self.packed_surface, shape.num_rows, shape.num_positions)

    def _price(self, surface: Surface, num_rows: float, width: float) -> float:
        """A step's milliseconds on ``surface``; the lookup is the stand-in's own work."""
        started = time.perf_counter()
        ms = surface.ms(num_rows, width)
        self.simulation_s += time.perf_counter() - started
        return ms

    def _targets(self, row: StepRow) -> np.ndarray:
        """The argmax of each of the row's last ``num_logits`` positions: the trace's next token
        where everything up to that position is on the trace (else end of text)."""
        if not row.num_logits:
            return np.zeros(0, dtype=np.int64)
        start = self.cache.length(row.row_id)
        trace = self.traces.get(row.row_id)
        targets = np.full(row.num_logits, self.eos_id, dtype=np.int64)
        if trace is None:
            return targets
        fed = np.asarray(row.token_ids)
        known = trace[start : start + len(fed)]
        on_trace = np.zeros(len(fed), dtype=bool)
        on_trace[: len(known)] = np.cumprod(fed[: len(known)] == known)
        first = len(fed) - row.num_logits
        for index in range(row.num_logits):
            position = start + first + index
            if on_trace[first + index] and position + 1 < len(trace):
                targets[index] = trace[position + 1]
        return targets


def _argmax_cost(vocab_size: int):
    """Seconds an argmax over ``n`` one-hot rows takes here, as a line fitted at two sizes."""
    samples = {}
    for rows in (16, 1024):
        logits = torch.zeros(rows, vocab_size)
        logits.argmax(dim=-1).tolist()
        started = time.perf_counter()
        for _ in range(5):
            logits.argmax(dim=-1).tolist()
        samples[rows] = (time.perf_counter() - started) / 5
    slope = (samples[1024] - samples[16]) / (1024 - 16)
    return lambda rows: max(0.0, samples[16] + slope * (rows - 16))


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0.0005:
        time.sleep(remaining - 0.0003)
    while time.perf_counter() < deadline:
        pass


# ------------------------------------------------------------------------------ the sweep
@dataclass
class Setup:
    """One compared engine: its stand-in model and the calibration its runs share."""

    variant: str
    model: SimModel
    graphs: Surface
    packed: Surface
    tokenizer: CompactTokenizer
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def blind(self) -> bool:
        return self.variant == "c072471"

    def runner(self, concurrency: int) -> SimulatedRunner:
        kv_tokens = concurrency * 2048 + 4096
        runner = SimulatedRunner(
            self.model, self.graphs, self.packed, kv_tokens, self.blind, self.tokenizer.eos_token_id
        )
        if not self.blind:
            runner.warm_up(concurrency, 17, 2048, budget_s=float("inf"))
        return runner


def run_once(setup: Setup, traces: list[dict], concurrency: int, mode: str) -> dict:
    """One engine run of ``traces`` (prompt and greedy output, compact ids) at ``concurrency``."""
    runner = setup.runner(concurrency)
    config = EngineConfig(
        max_batch_rows=concurrency,
        max_waiting=len(traces),
        prefill_chunk_tokens=GPU_PREFILL_CHUNK_TOKENS,
        prefix_cache_tokens=runner.cache.capacity_tokens,
    )
    engine = Engine(setup.model, setup.tokenizer, config, runner=runner, calibration=setup.calibration)
    started = time.perf_counter()
    ids = []
    for index, trace in enumerate(traces):
        request_id = f"r{index}"
        runner.expect(request_id, trace["prompt"] + trace["output"])
        ids.append(
            engine.add_request(
                trace["prompt"],
                SamplingParams(max_tokens=max_tokens_of(index)),
                SpecConfig(mode=mode),
                request_id,
            )
        )
    # As a replica does once started (deployments/replica.py): the heap so far is frozen, so
    # the collector's passes during steps do not walk it.
    gc.collect()
    gc.freeze()
    step_seconds = []
    try:
        while not engine.is_finished():
            step_started = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - step_started)
    finally:
        gc.unfreeze()  # the next run's engine starts from a heap the collector can clear
    seconds = time.perf_counter() - started
    outputs = [engine.pop_result(request_id).token_ids for request_id in ids]
    num_tokens = sum(len(output) for output in outputs)
    stats = engine.stats
    return {
        "tokens": num_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(num_tokens / seconds, 1),
        "steps": len(step_seconds),
        "drafted_positions": stats.num_drafted,
        "accepted": stats.num_accepted,
        "steps_drafting": sum(count for width, count in engine.width_histogram.items() if width),
        # The steps' own host work: request intake (tokenizing, the drafter's first index) is
        # per request, not per step.
        "host_ms_per_step": round(
            1000 * (sum(step_seconds) - runner.device_s - runner.simulation_s) / len(step_seconds), 3
        ),
        "step_ms_p50": round(1000 * percentile(step_seconds, 50), 3),
        "captured_while_serving": runner.num_captured_serving,
        "exact": outputs == [trace["output"][: len(output)] for trace, output in zip(traces, outputs)]
        and all(
            len(output) == min(max_tokens_of(index), len(trace["output"]))
            for index, (trace, output) in enumerate(zip(traces, outputs))
        ),
    }


def compact_traces(traces: dict[str, list[dict]]) -> tuple[list[int], dict[str, list[dict]]]:
    """The traces' vocabulary (sorted real ids, end of text among them) and the traces in it."""
    vocab = sorted(
        {EOS} | {token for runs in traces.values() for t in runs for token in t["prompt"] + t["output"]}
    )
    compact = {token: index for index, token in enumerate(vocab)}
    return vocab, {
        name: [{key: [compact[token] for token in t[key]] for key in ("prompt", "output")} for t in runs]
        for name, runs in traces.items()
    }


def mix_traces(traces: dict[str, list[dict]], mix: str, num_requests: int) -> list[dict]:
    """``num_requests`` of the mix's traces, its workloads interleaved (repeated past 16 each)."""
    interleaved = [t for group in zip(*(traces[name] for name in MIXES[mix])) for t in group]
    return list(itertools.islice(itertools.cycle(interleaved), num_requests))


def new_setup(variant: str, vocab: list[int], tokenizer, concurrency: int, probe: bool = True) -> Setup:
    """A compared engine with its own calibration, probed at up to ``concurrency`` rows as a
    replica's start does (c072471 on a runner of its own, the grid on one like the engine's)."""
    config = type("Config", (), {"vocab_size": len(vocab), "max_position_embeddings": 8192})()
    setup = Setup(
        variant,
        SimModel(config),
        Surface(json.loads(GRAPH_SURFACE.read_text())["ms_by_rows_and_positions"]),
        Surface(json.loads(PACKED_SURFACE.read_text())["ms_by_rows_and_positions"]["bfloat16"]),
        CompactTokenizer(tokenizer, vocab),
    )
    if probe:
        calibrate(
            setup.model, concurrency, 2, runner=setup.runner(concurrency), calibration=setup.calibration
        )
    return setup


def markdown_table(payload: dict) -> str:
    """The sweep as a table (labelled as a simulation): throughput ratios to ``off`` per engine."""
    lines = [
        "SIMULATION (CPU host, H100 step costs): tokens/s of `off`, `on` and `auto` as ratios to `off`.",
        "",
        "| engine | mix | C | off tok/s | on | auto | auto / best of on, off | auto steps drafting "
        "| host ms/step off / auto |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, mixes in payload["cells"].items():
        for mix, levels in mixes.items():
            for level, cell in levels.items():
                off, on, auto = (cell[mode] for mode in MODES)
                on_ratio = on["tokens_per_s"] / off["tokens_per_s"]
                exact = "" if all(cell[mode]["exact"] for mode in MODES) else " ≠"
                lines.append(
                    f"| {variant} | {mix} | {level} | {off['tokens_per_s']:.0f} "
                    f"| {on_ratio:.2f}x | {cell['auto_over_off']:.2f}x{exact} "
                    f"| {cell['auto_over_best']:.2f} | {auto['steps_drafting']}/{auto['steps']} "
                    f"| {off['host_ms_per_step']:.2f} / {auto['host_ms_per_step']:.2f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="C = 1 and 16, the repetitive mix only")
    parser.add_argument("--levels", type=int, nargs="+", default=None)
    parser.add_argument("--mixes", nargs="+", default=None, choices=sorted(MIXES))
    args = parser.parse_args(argv)
    levels = args.levels or ((1, 16) if args.quick else LEVELS)
    mixes = args.mixes or (("repetitive",) if args.quick else tuple(MIXES))
    from nasd_core.loader import load_tokenizer

    # The engine's host work is one thread; the stand-in's tensors are tiny. With a pool of
    # threads, each op after a simulated wait woke it (~1 ms a step at 64 rows, the argmax
    # mostly), a cost no GPU host pays for its device's tensors.
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    vocab, traces = compact_traces(json.loads(TRACES.read_text())["traces"])
    # An untimed run first: a process's first steps pay for imports and first calls.
    run_once(new_setup("grid", vocab, tokenizer, 4), mix_traces(traces, "repetitive", 8), 4, "auto")
    cells: dict[str, dict] = {variant: {} for variant in VARIANTS}
    for concurrency in levels:
        for variant in VARIANTS:
            setup = new_setup(variant, vocab, tokenizer, concurrency)
            for mix in mixes:
                work = mix_traces(traces, mix, max(8, 2 * concurrency))
                cell = {mode: run_once(setup, work, concurrency, mode) for mode in MODES}
                best = max(cell["off"]["tokens_per_s"], cell["on"]["tokens_per_s"])
                cell["auto_over_off"] = round(cell["auto"]["tokens_per_s"] / cell["off"]["tokens_per_s"], 3)
                cell["auto_over_best"] = round(cell["auto"]["tokens_per_s"] / best, 3)
                cells[variant].setdefault(mix, {})[str(concurrency)] = cell
                print(
                    f"{variant:8} {mix:11} C={concurrency:<3} off {cell['off']['tokens_per_s']:8.1f} "
                    f"on {cell['on']['tokens_per_s']:8.1f} auto {cell['auto']['tokens_per_s']:8.1f} tok/s "
                    f"(auto/off {cell['auto_over_off']:.2f}, drafting steps "
                    f"{cell['auto']['steps_drafting']}/{cell['auto']['steps']}, "
                    f"host {cell['auto']['host_ms_per_step']:.2f} ms/step)",
                    flush=True,
                )
    payload = {
        "benchmark": "gpu_rates_sim",
        "simulation": "SIMULATION: a stand-in model at measured H100 step costs (benchmarks/gpu_rates.py)",
        "meta": run_metadata(None, "bfloat16 (simulated)", "benchmarks.gpu_rates")
        | {"model": "stand-in replaying SmolLM2-135M greedy traces at Qwen2-1.5B H100 step costs"},
        "surfaces": {
            "graphs": json.loads(GRAPH_SURFACE.read_text())["source"],
            "packed": str(PACKED_SURFACE.relative_to(RESULTS_DIR.parent.parent)),
        },
        "cells": cells,
    }
    for variant in VARIANTS:
        single = cells[variant].get("repetitive", {}).get("1")
        if single is not None:
            key = "single_stream_auto_over_off" + ("" if variant == "grid" else f"_{variant}")
            payload[key] = single["auto_over_off"]
    write_result("gpu_rates_sim" + ("_quick" if args.quick else ""), payload)
    return payload


if __name__ == "__main__":
    main()
