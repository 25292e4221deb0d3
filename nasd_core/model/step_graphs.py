"""Decode and verification steps in fixed shapes, replayed from CUDA graphs.

Why: on a GPU the engine's step is bound by the host, not the GPU. A step of a 1.5B model on
an H100 cost 23-28 ms from 1 row x 1 position to 64 rows x 17 positions
(``benchmarks/results/step_cost_cuda_qwen2-1.5b.json``), where its arithmetic and weight
reads are ~5 ms: the rest is Python launching a few hundred small kernels layer by layer
(the embedded 135M model's step cost the same 23.5 ms there). A CUDA graph records those
launches once and replays them in one call.

A graph fixes every shape and every address, so a step is laid out as ``rows x positions``
(both rounded up to a bucket: 5 rows verifying 4, 2, 7, 1 and 1 positions run as 8 x 8), every
row attends over ``keys`` keys (its length rounded up to a power of two), and the step's
inputs are copied into buffers the graph reads: the tokens, their positions, the pool slots
their keys and values go to, the slots of every row's keys and the last key each query sees.
Padding only ever reads real, finite data (see ``attention.BatchedRows``) and writes one
scratch slot the engine never hands out: a padded query repeats its row's last token at its
last position and writes the scratch slot, a padded row reads and writes only that slot.

Only the decoder runs in the graph; the vocabulary projection runs eagerly on the real
positions' hidden states (a graph would project every padded one too, and keep a
``[rows x positions, vocab]`` output alive per shape). Steps a graph does not serve (prompt
chunks, shapes over ``MAX_GRAPH_MASK_BYTES``, a model type not listed) take the packed path.

A runner's start-up captures the whole grid of shapes its rows, draft widths and context can
meet (``StepGraphs.warm_up``, two warm-up runs and a capture per shape, within a time budget),
all in one memory pool: only one runs at a time, and what outlives a replay is either
allocated outside the pool (the input buffers) or rebuilt at the start of each replay (the
mask), or read right after it (the hidden states). Capturing while serving would make that
step cost ~3 steps' time, which the policy would then read as the shape's cost.

Off a GPU the same fixed-shape steps run eagerly (``capture=False``): that is how the tests
hold them to the packed path's logits on a CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nasd_core.model.attention import (
    BatchedRows,
    StepLayout,
    no_mask,
    padded_key_slots,
    padded_queries,
    row_mask,
)
from nasd_core.model.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# 17: one position and 16 drafts, the widest verification the policy plans by default.
POSITION_BUCKETS = (1, 2, 4, 8, 17, 32)
MIN_KEY_BUCKET = 128
# The largest mask a graph keeps (rows x groups x positions x keys bytes); wider steps (long
# contexts at many rows) take the packed path.
MAX_GRAPH_MASK_BYTES = 32 << 20
MAX_GRAPHS = 96
WARMUP_RUNS = 2
# Model types whose logits are their decoder's last hidden state through ``lm_head`` and
# nothing else (no logit scaling or soft-capping), so the projection can run outside the graph.
GRAPH_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SCRATCH_ROW = "nasd-step-graphs-scratch"


def bucket(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest of ``buckets`` (sorted) holding ``value``, or None if none does."""
    index = bisect.bisect_left(buckets, value)
    return buckets[index] if index < len(buckets) else None


def key_bucket(num_keys: int) -> int:
    return max(MIN_KEY_BUCKET, 1 << (num_keys - 1).bit_length())


@dataclass(frozen=True)
class StepShape:
    num_rows: int
    num_positions: int  # per row
    num_keys: int  # per row


@dataclass
class RowInput:
    """What a fixed-shape step needs of one row: its new tokens and its cached length before them."""

    row_id: object
    token_ids: list[int]
    cached: int


class FixedStep:
    """One shape's input buffers, layout and, on a GPU, captured graph."""

    def __init__(self, model, cache: PagedKVCache, groups: int, shape: StepShape, scratch_slot: int) -> None:
        self.model = model
        self.cache = cache
        self.groups = groups
        self.shape = shape
        self.scratch_slot = scratch_slot
        num_queries = shape.num_rows * shape.num_positions
        # One int64 buffer, filled by one copy per step: tokens, positions, write slots, last
        # keys (one per query each), then the key slots.
        self.sizes = (num_queries, num_queries, num_queries, num_queries, shape.num_rows * shape.num_keys)
        self.buffer = torch.zeros(sum(self.sizes), dtype=torch.long, device=cache.device)
        self.token_ids, self.positions, self.write_slots, self.last_key, self.key_slots = self.buffer.split(
            self.sizes
        )
        self.layout = StepLayout(
            cache,
            [],
            self.write_slots,
            groups,
            batched_rows=BatchedRows(self.key_slots, None, shape.num_positions, shape.num_keys),
        )
        self.hidden: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self, pool) -> None:
        """Record the step as a CUDA graph, the buffers holding an idle step (every position
        writes and reads the scratch slot) while it is warmed up and captured."""
        self.buffer.copy_(torch.from_numpy(self.idle_inputs()))
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # lets libraries pick and cache their kernels first
                self.run()
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.run()
        self.graph = graph

    def run(self) -> None:
        """The decoder over the buffers; its last hidden states land in ``self.hidden``."""
        shape = self.shape
        batch = self.layout.batched_rows
        assert batch is not None
        # Built from the buffers inside the step, so a replay rebuilds it.
        batch.mask = row_mask(
            self.last_key.view(shape.num_rows, shape.num_positions), shape.num_keys, self.groups
        )
        output = self.model.get_decoder()(
            input_ids=self.token_ids.view(1, -1),
            position_ids=self.positions.view(1, -1),
            attention_mask=no_mask(self.cache.device),
            use_cache=False,
            nasd_step=self.layout,
        )
        self.hidden = output.last_hidden_state[0]

    def replay(self) -> torch.Tensor:
        """Run the step on the buffers' inputs; ``[rows x positions, hidden]`` states."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        assert self.hidden is not None
        return self.hidden

    def idle_inputs(self) -> np.ndarray:
        shape = self.shape
        num_queries = shape.num_rows * shape.num_positions
        host = np.zeros(sum(self.sizes), dtype=np.int64)
        write_start = 2 * num_queries
        host[write_start : write_start + num_queries] = self.scratch_slot
        host[sum(self.sizes[:4]) :] = self.scratch_slot
        return host

    def load(self, rows: Sequence[RowInput]) -> np.ndarray:
        """Copy ``rows`` into the buffers (padded to the shape); the indices of their real
        positions among the step's ``rows x positions``, in row order."""
        shape = self.shape
        num_real = len(rows)
        counts = np.array([len(row.token_ids) for row in rows])
        lengths = np.array([row.cached for row in rows]) + counts
        query_offset, last_key = padded_queries(counts, lengths, shape.num_positions)
        token_ids = np.zeros((shape.num_rows, shape.num_positions), dtype=np.int64)
        for index, row in enumerate(rows):
            token_ids[index] = np.asarray(row.token_ids)[query_offset[index]]
        positions = np.zeros_like(token_ids)
        positions[:num_real] = (lengths - counts)[:, None] + query_offset
        real = np.arange(shape.num_positions)[None, :] < counts[:, None]
        key_slots = np.full((shape.num_rows, shape.num_keys), self.scratch_slot, dtype=np.int64)
        key_slots[:num_real] = padded_key_slots(
            self.cache, [row.row_id for row in rows], lengths, shape.num_keys
        )
        last_keys = np.zeros_like(token_ids)
        last_keys[:num_real] = last_key
        # A real query's own key is where it is written; padded queries write the scratch slot.
        write_slots = np.full_like(token_ids, self.scratch_slot)
        write_slots[:num_real] = np.where(
            real, np.take_along_axis(key_slots[:num_real], last_key, axis=1), self.scratch_slot
        )
        host = np.concatenate(
            [part.reshape(-1) for part in (token_ids, positions, write_slots, last_keys, key_slots)]
        )
        self.buffer.copy_(torch.from_numpy(host))
        return np.flatnonzero(real)


def fixed_shape(rows: Sequence[RowInput], groups: int) -> StepShape | None:
    """The fixed shape a step of ``rows`` runs in, or None where none may (too many rows or
    positions, or a mask over ``MAX_GRAPH_MASK_BYTES``)."""
    if not rows:
        return None
    num_rows = bucket(len(rows), ROW_BUCKETS)
    num_positions = bucket(max(len(row.token_ids) for row in rows), POSITION_BUCKETS)
    if num_rows is None or num_positions is None:
        return None
    num_keys = key_bucket(max(row.cached + len(row.token_ids) for row in rows))
    shape = StepShape(num_rows, num_positions, num_keys)
    return shape if fits(shape, groups) else None


def fits(shape: StepShape, groups: int) -> bool:
    return shape.num_rows * groups * shape.num_positions * shape.num_keys <= MAX_GRAPH_MASK_BYTES


def captures_when_met(num_captured: int, is_warm: bool) -> bool:
    """Whether a shape not captured yet is captured by the step that meets it: not once the grid
    was captured at start (it runs packed), and at most ``MAX_GRAPHS`` shapes without one."""
    return not is_warm and num_captured < MAX_GRAPHS


def grid_shapes(max_rows: int, max_positions: int, max_keys: int, groups: int) -> list[StepShape]:
    """Every fixed shape a runner of ``max_rows`` rows, verification steps of up to
    ``max_positions`` positions per row and contexts of up to ``max_keys`` keys can meet, in the
    order a start-up captures them: short contexts first (most rows), then by rows and positions."""
    row_top = bucket(min(max_rows, ROW_BUCKETS[-1]), ROW_BUCKETS)
    position_top = bucket(min(max_positions, POSITION_BUCKETS[-1]), POSITION_BUCKETS)
    key_buckets = [MIN_KEY_BUCKET]
    while key_buckets[-1] < max_keys:
        key_buckets.append(2 * key_buckets[-1])
    shapes = [
        StepShape(num_rows, num_positions, num_keys)
        for num_keys in key_buckets
        for num_rows in ROW_BUCKETS
        if num_rows <= row_top
        for num_positions in POSITION_BUCKETS
        if num_positions <= position_top
    ]
    return [shape for shape in shapes if fits(shape, groups)]


class StepGraphs:
    """The runner's fixed-shape steps, captured as CUDA graphs when ``capture``.

    ``warm_up`` captures the whole grid of shapes before serving; from then on a shape left out
    (past the start-up budget) takes the packed path rather than a capture mid-serving. Without
    a warm-up, shapes are captured when first met (at most ``MAX_GRAPHS``).

    Args:
        model: the runner's model (its type must be in ``GRAPH_MODEL_TYPES``: see ``supports``).
        cache: the runner's KV-cache; one block of it is taken for the scratch slot.
        groups: query heads per key/value head.
        capture: record graphs (a GPU); False runs the same fixed-shape steps eagerly.
    """

    def __init__(self, model, cache: PagedKVCache, groups: int, capture: bool) -> None:
        self.model = model
        self.cache = cache
        self.groups = groups
        self.capture = capture
        cache.allocate(SCRATCH_ROW, 1)
        self.scratch_slot = int(cache.slots(SCRATCH_ROW, 0, 1)[0])
        for pool in (*cache.keys, *cache.values):
            pool[:, self.scratch_slot] = 0  # read by padded rows: must be finite
        self.steps: dict[StepShape, FixedStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = False
        self.is_warm = False  # the grid is captured: no capture while serving
        self.max_positions = POSITION_BUCKETS[-1]  # the widest positions per row a step may take
        self.num_captured_serving = 0  # shapes captured by serving steps (none once warm)
        self.last_captured = False  # the last step captured its shape (its time is no step's cost)

    @staticmethod
    def supports(model) -> bool:
        return getattr(model.config, "model_type", None) in GRAPH_MODEL_TYPES and hasattr(model, "lm_head")

    def warm_up(self, max_rows: int, max_positions: int, max_keys: int, budget_s: float) -> int:
        """Build (and on a GPU capture) every shape of the grid (``grid_shapes``) within
        ``budget_s`` seconds; returns how many shapes are ready. Only a capturing runner (a
        GPU) warms up: eager fixed shapes cost nothing to build when first met; a budget of 0
        leaves every shape to be captured when first met."""
        if not self.capture or budget_s <= 0:
            return len(self.steps)
        started = time.perf_counter()
        self.max_positions = bucket(min(max_positions, POSITION_BUCKETS[-1]), POSITION_BUCKETS) or 1
        for shape in grid_shapes(max_rows, max_positions, max_keys, self.groups):
            if self.failed or time.perf_counter() - started > budget_s:
                break
            if shape not in self.steps:
                self._build(shape)
        self.is_warm = True
        logger.info(
            "step graphs: %d shapes ready in %.1f s (budget %.0f s)",
            len(self.steps),
            time.perf_counter() - started,
            budget_s,
        )
        return len(self.steps)

    def shape_for(self, rows: Sequence[RowInput]) -> StepShape | None:
        """The fixed shape serving ``rows``, or None (the packed path takes the step)."""
        if self.failed:
            return None
        shape = fixed_shape(rows, self.groups)
        if shape is None or shape in self.steps:
            return shape
        return shape if captures_when_met(len(self.steps), self.is_warm) else None

    def forward(self, rows: Sequence[RowInput], shape: StepShape) -> torch.Tensor:
        """Logits of every position of ``rows`` (all of them, in row order) from the step of ``shape``."""
        step = self.steps.get(shape)
        self.last_captured = step is None
        if step is None:
            step = self._build(shape)
            self.num_captured_serving += 1
        real = step.load(rows)
        hidden = step.replay().index_select(0, torch.from_numpy(real).to(self.cache.device))
        return self.model.lm_head(hidden)

    def _build(self, shape: StepShape) -> FixedStep:
        step = FixedStep(self.model, self.cache, self.groups, shape, self.scratch_slot)
        if self.capture:
            try:
                step.capture(self.pool)
            except RuntimeError as exc:  # an op a graph cannot record: run without graphs
                logger.warning("CUDA graph capture failed, steps run without graphs: %s", exc)
                self.failed = True
        self.steps[shape] = step
        return step
