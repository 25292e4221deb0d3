"""Decode and verification steps in fixed shapes, replayed from CUDA graphs.

Why: on a GPU the engine's step is bound by the host, not the GPU. A step of a 1.5B model on
an H100 cost 23-28 ms from 1 row x 1 position to 64 rows x 17 positions
(``benchmarks/results/step_cost_cuda_qwen2-1.5b.json``), where its arithmetic and weight
reads are ~5 ms: the rest is Python launching a few hundred small kernels layer by layer
(the embedded 135M model's step cost the same 23.5 ms there). A CUDA graph records those
launches once and replays them in one call.

A graph fixes every shape and every address, so a step is laid out as ``rows x positions``
(both rounded up to a bucket: 5 rows verifying 4, 2, 7, 1 and 1 positions run as 8 x 8) and
its inputs are copied into buffers the graph reads: the tokens, their positions, the pool
slots their keys and values go to, the last key each query sees, and how each row's keys are
found. Two ways to find them:
- paged (the default where graphs are captured): attention reads the pool through each row's
  block table (FlexAttention with a block mask, ``attention.PagedRows``), so a shape is rows x
  positions whatever the context: the grid is ~60 shapes and one capture serves every length;
- gathered: every row's keys are gathered into a padded batch of ``keys`` keys (its length
  rounded up to a power of two), so each doubling of context is a new shape.
Padding only ever reads real, finite data and writes one scratch slot the engine never hands
out: a padded query repeats its row's last token at its last position and writes the scratch
slot, a padded row reads and writes only that slot.

Prompt chunks run in fixed shapes of their own where attention is paged: a few rows of up to
the runner's prompt chunk (``CHUNK_POSITION_BUCKETS``), captured beside the verification grid.
A step holding both runs as two sub-steps, its verification rows in one shape and its chunks in
another, rather than padding every row to a chunk's width. Eagerly, a 512-token chunk of a 1.5B
model on an H200 cost 21 ms, about 4x its arithmetic (vLLM captures its prefill the same way,
at token-count buckets).

Only the decoder runs in the graph; the vocabulary projection runs eagerly on the hidden states
of the positions that want logits (a graph would project every padded one too, and keep a
``[rows x positions, vocab]`` output alive per shape). Steps a graph does not serve (shapes
over ``MAX_GRAPH_MASK_BYTES``, chunks past the largest bucket, prompt chunks where keys are
gathered, a model type not listed) take the packed path.

A runner's start-up captures the whole grid of shapes its rows, draft widths and context can
meet (``StepGraphs.warm_up``, two warm-up runs and a capture per shape, within a time budget),
all in one memory pool: only one runs at a time, and what outlives a replay is either
allocated outside the pool (the input buffers) or rebuilt at the start of each replay (the
mask), or read right after it (the hidden states). Capturing while serving would make that
step cost ~3 steps' time, which the policy would then read as the shape's cost.

Off a GPU the same fixed-shape steps run eagerly (``capture=False``): that is how the tests
hold them to the packed path's logits on a CPU (paged steps there run FlexAttention's unfused
reference, or its CPU kernel where a test compiles it). A paged step that fails to compile or
capture makes the runner fall back to gathered steps, with a warning.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional
from torch.nn.attention.flex_attention import BlockMask

from nasd_core.layers.attention import (
    BatchedRows,
    PagedRows,
    StepLayout,
    flex_kernel_options,
    no_mask,
    padded_key_slots,
    padded_queries,
    row_mask,
)
from nasd_core.layers.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# 17: one position and 16 drafts, the widest verification the policy plans by default.
POSITION_BUCKETS = (1, 2, 4, 8, 17, 32)
# Prompt chunks longer than every verification: up to ``CHUNK_MAX_ROWS`` rows of a bucket's
# positions, no more tokens than the runner's prompt chunk (rounded up to a bucket).
CHUNK_POSITION_BUCKETS = (64, 128, 256, 512, 1024, 2048)
CHUNK_MAX_ROWS = 8
MIN_KEY_BUCKET = 128
# Longest context a gathered step serves (the fallback where paged steps fail): each key bucket
# is a grid of its own, and its gathered keys grow with it; longer rows run packed.
GATHERED_MAX_KEYS = 1024
# Queries per FlexAttention query block: more than a verification row ever has, so each row is
# one block (a prompt chunk's row too: its block is the chunk's width).
FLEX_QUERY_BLOCK = 128
# Rows a paged step's attention runs over (its rows, then idle ones): a kernel is compiled per
# size and width, not per row bucket (dynamic shapes did not compile on this CPU).
ATTENTION_ROW_BUCKETS = (8, 64, 256)
# The largest mask a graph keeps (rows x groups x positions x keys bytes); wider steps (long
# contexts at many rows) take the packed path.
MAX_GRAPH_MASK_BYTES = 32 << 20
MAX_GRAPHS = 96
WARMUP_RUNS = 2
# Model types whose logits are their decoder's last hidden state through ``lm_head`` and
# nothing else (no logit scaling or soft-capping), so the projection can run outside the graph.
GRAPH_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def bucket(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest of ``buckets`` (sorted) holding ``value``, or None if none does."""
    index = bisect.bisect_left(buckets, value)
    return buckets[index] if index < len(buckets) else None


def key_bucket(num_keys: int) -> int:
    return max(MIN_KEY_BUCKET, 1 << (num_keys - 1).bit_length())


def chunk_graph_tokens(prefill_chunk: int) -> int:
    """Tokens of the largest prompt-chunk shape a runner of ``prefill_chunk``-token chunks
    captures (0: its chunks fit the verification grid's widths)."""
    if prefill_chunk <= POSITION_BUCKETS[-1]:
        return 0
    return bucket(min(prefill_chunk, CHUNK_POSITION_BUCKETS[-1]), CHUNK_POSITION_BUCKETS) or 0


@dataclass(frozen=True)
class StepShape:
    num_rows: int
    num_positions: int  # per row
    num_keys: int  # per row, gathered; 0 for a paged step (it reads the block tables)


@dataclass
class RowInput:
    """What a fixed-shape step needs of one row: its new tokens, its cached length before them
    and how many of its last positions want logits."""

    row_id: object
    token_ids: list[int]
    cached: int
    num_logits: int

    @property
    def is_chunk(self) -> bool:
        """A prompt chunk (not every position wants logits, or wider than any verification)."""
        return self.num_logits < len(self.token_ids) or len(self.token_ids) > POSITION_BUCKETS[-1]


class PagedTables:
    """The block tables of a paged step in the form FlexAttention reads, shared by every paged
    shape (one step runs at a time; a graph keeps the addresses it was captured with).

    Args:
        max_rows: most rows a paged step may have.
        num_blocks: the pool's blocks: FlexAttention sees the pool as one sequence of them.
        max_row_blocks: most blocks a row may read (its longest context).
    """

    def __init__(self, max_rows: int, num_blocks: int, max_row_blocks: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.num_blocks = num_blocks
        self.max_row_blocks = max_row_blocks
        # Per row, the blocks whose keys need a mask (``partial``) and those every query sees
        # whole (``full``), as FlexAttention's kv_indices; only the first entries are read.
        self.partial = torch.zeros(max_rows, 1, 1, num_blocks, dtype=torch.int32, device=device)
        self.full = torch.zeros_like(self.partial)
        # Per row, the index in its table of each block it holds (``num_blocks`` for the rest);
        # the last column takes the tables' padding entries (never a real block's index).
        self.logical = torch.zeros(max_rows, num_blocks + 1, dtype=torch.int32, device=device)
        self.block_order = torch.arange(max_row_blocks, device=device)
        self.block_order_int32 = self.block_order.to(torch.int32)  # the map's values, made once

    def block_mask(
        self,
        blocks: torch.Tensor,
        num_full: torch.Tensor,
        num_held: torch.Tensor,
        last_key: torch.Tensor,
        block_size: int,
    ) -> BlockMask:
        """The mask of rows reading ``blocks`` ([rows, max_row_blocks], their tables in order,
        padded with ``num_blocks``), of which the first ``num_full`` are seen whole by every
        query and ``num_held`` hold keys; a query sees its row's keys up to ``last_key``
        ([rows, positions]). Built from tensors only, so a graph replay rebuilds it."""
        num_rows, num_positions = last_key.shape
        width = self.max_row_blocks
        logical = self.logical[:num_rows]
        # A block the row does not hold sits past every key it may see (the unfused reference
        # path applies ``sees`` to the whole pool; the kernels only to the blocks listed).
        logical.fill_(self.num_blocks)
        logical.scatter_(1, blocks, self.block_order_int32.expand(num_rows, width))
        held = blocks.clamp(max=self.num_blocks - 1).to(torch.int32)
        self.full[:num_rows, 0, 0, :width] = held
        after_full = (self.block_order[None, :] + num_full[:, None]).clamp(max=width - 1)
        self.partial[:num_rows, 0, 0, :width] = torch.gather(held, 1, after_full)

        def sees(batch, head, query, key):
            position = logical[batch, key // block_size] * block_size + key % block_size
            return position <= last_key[batch, query]

        return BlockMask.from_kv_blocks(
            (num_held - num_full).to(torch.int32)[:, None, None],
            self.partial[:num_rows],
            num_full.to(torch.int32)[:, None, None],
            self.full[:num_rows],
            BLOCK_SIZE=(max(FLEX_QUERY_BLOCK, num_positions), block_size),
            mask_mod=sees,
            seq_lengths=(num_positions, self.num_blocks * block_size),
            compute_q_blocks=False,
        )


class StepBuffers:
    """The one set of static buffers every fixed-shape step reads and writes, sized for the
    largest shape: each step's inputs are a prefix of ``inputs`` and its hidden states a prefix
    of ``hidden``, so the grid's graphs hold no buffers of their own (vLLM's runner does the
    same). Allocated outside the graph pool; one step runs at a time.

    Args:
        max_tokens: rows x positions of the largest shape.
        max_rows: rows of the shape with the most.
        max_keys: per row, the most block-table entries (plus two counts) of a paged step or
            the most key slots of a gathered one.
    """

    def __init__(
        self, max_tokens: int, max_rows: int, max_keys: int, hidden_size: int, dtype, device
    ) -> None:
        self.inputs = torch.zeros(5 * max_tokens + max_rows * max_keys, dtype=torch.long, device=device)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + self.hidden.nbytes


class FixedStep:
    """One shape's slices of the static buffers, its layout and, on a GPU, captured graph.
    ``tables``: the paged step's block tables (None: the step gathers its keys,
    ``shape.num_keys`` per row)."""

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        groups: int,
        shape: StepShape,
        scratch_slot: int,
        buffers: StepBuffers,
        tables: PagedTables | None = None,
        compiled: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.groups = groups
        self.shape = shape
        self.scratch_slot = scratch_slot
        self.tables = tables
        self.compiled = compiled
        num_rows = shape.num_rows
        # One int64 buffer, filled by one copy per step: tokens, positions, write slots, last
        # keys, the positions whose hidden states get logits (one row of each per row), then
        # how the rows' keys are found: gathered, every key's slot; paged, each attended row's
        # blocks, blocks seen whole and blocks held.
        self.attention_rows = attention_rows(shape, tables.max_rows) if tables is not None else num_rows
        self.part_rows = (num_rows,) * 5 + ((self.attention_rows,) * 3 if tables is not None else (num_rows,))
        row_sizes = (shape.num_positions,) * 5 + (
            (tables.max_row_blocks, 1, 1) if tables is not None else (shape.num_keys,)
        )
        self.sizes = tuple(rows * size for rows, size in zip(self.part_rows, row_sizes, strict=True))
        if sum(self.sizes) > buffers.inputs.numel():
            raise ValueError(f"{shape} is larger than the static buffers were sized for")
        self.buffer = buffers.inputs[: sum(self.sizes)]
        (
            self.token_ids,
            self.positions,
            self.write_slots,
            self.last_key,
            self.logit_index,
            *self.key_inputs,
        ) = self.buffer.split(self.sizes)
        batched_rows = (
            None
            if tables is not None
            else BatchedRows(self.key_inputs[0], None, shape.num_positions, shape.num_keys)
        )
        self.layout = StepLayout(cache, [], self.write_slots, groups, batched_rows=batched_rows)
        self.hidden = buffers.hidden[: num_rows * shape.num_positions]
        on_cuda = cache.device.type == "cuda"
        self.kernel_options = (
            flex_kernel_options(cache.block_size, shape.num_positions, model.dtype)
            if tables is not None and compiled and on_cuda
            else None
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self._idle = self._make_idle_inputs()  # every step starts from a copy
        self._host = self._idle.copy()
        self._host_parts = self.parts(self._host)

    def capture(self, pool) -> None:
        """Record the step as a CUDA graph, the buffers holding an idle step (every position
        writes and reads the scratch slot) while it is warmed up and captured."""
        self.buffer.copy_(torch.from_numpy(self.idle_inputs()))
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # lets libraries pick (and compile) their kernels first
                self.run()
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.run()
        self.graph = graph

    def run(self) -> None:
        """The decoder over the buffers; its last hidden states land in ``self.hidden``."""
        shape = self.shape
        last_key = self.last_key.view(shape.num_rows, shape.num_positions)
        # Built from the buffers inside the step, so a replay rebuilds them.
        if self.tables is not None:
            blocks, num_full, num_held = self.key_inputs
            idle = self.attention_rows - shape.num_rows
            block_mask = self.tables.block_mask(
                blocks.view(self.attention_rows, -1),
                num_full,
                num_held,
                functional.pad(last_key, (0, 0, 0, idle)),
                self.cache.block_size,
            )
            self.layout.paged_rows = PagedRows(
                block_mask, self.attention_rows, shape.num_positions, self.compiled, self.kernel_options
            )
        else:
            assert self.layout.batched_rows is not None
            self.layout.batched_rows.mask = row_mask(last_key, shape.num_keys, self.groups)
        output = self.model.get_decoder()(
            input_ids=self.token_ids.view(1, -1),
            position_ids=self.positions.view(1, -1),
            attention_mask=no_mask(self.cache.device),
            use_cache=False,
            nasd_step=self.layout,
        )
        # Into the static output: the graph's own output is then an intermediate the next
        # capture reuses, not memory each graph keeps.
        self.hidden.copy_(output.last_hidden_state[0])

    def replay(self, num_logits: int) -> torch.Tensor:
        """Run the step on the buffers' inputs; the hidden states of the ``num_logits``
        positions ``load`` listed, a copy (the next step overwrites the shared output)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        return self.hidden.index_select(0, self.logit_index[:num_logits])

    def idle_inputs(self) -> np.ndarray:
        """Buffers of a step whose every query writes and reads the scratch slot (a copy)."""
        return self._idle.copy()

    def _make_idle_inputs(self) -> np.ndarray:
        host = np.zeros(sum(self.sizes), dtype=np.int64)
        parts = self.parts(host)
        parts[2][:] = self.scratch_slot  # write slots
        if self.tables is None:
            parts[5][:] = self.scratch_slot  # key slots
        else:
            blocks, num_held = parts[5], parts[7]
            blocks[:] = self.tables.num_blocks
            blocks[:, 0] = self.scratch_slot // self.cache.block_size
            num_held[:] = 1
        return host

    def parts(self, host: np.ndarray) -> list[np.ndarray]:
        """Views of a host copy of the buffer, one ``[rows, ...]`` array per input."""
        parts = np.split(host, np.cumsum(self.sizes)[:-1])
        return [part.reshape(rows, -1) for part, rows in zip(parts, self.part_rows, strict=True)]

    def load(self, rows: Sequence[RowInput]) -> int:
        """Copy ``rows`` into the buffers (padded to the shape), with the indices of the
        positions that want logits (each row's last ``num_logits``) among the step's ``rows x
        positions``, in row order, at the start of ``logit_index``; returns how many."""
        shape = self.shape
        num_real = len(rows)
        counts = np.fromiter((len(row.token_ids) for row in rows), dtype=np.int64, count=num_real)
        lengths = np.fromiter((row.cached for row in rows), dtype=np.int64, count=num_real) + counts
        query_offset, last_key = padded_queries(counts, lengths, shape.num_positions)
        # One host array per shape, refilled each step (the copy below reads it before the next
        # load: synchronously on a CPU, from a pinned copy on a GPU).
        np.copyto(self._host, self._idle)
        tokens, positions, write_slots, last_keys, logit_index, *key_inputs = self._host_parts
        # Every row's tokens in one array; each query takes its row's token at its offset.
        every_token = itertools.chain.from_iterable(row.token_ids for row in rows)
        flat = np.fromiter(every_token, dtype=np.int64, count=int(counts.sum()))
        row_starts = np.cumsum(counts) - counts
        tokens[:num_real] = flat[row_starts[:, None] + query_offset]
        positions[:num_real] = (lengths - counts)[:, None] + query_offset
        last_keys[:num_real] = last_key
        real = np.arange(shape.num_positions)[None, :] < counts[:, None]
        row_ids = [row.row_id for row in rows]
        if self.tables is None:
            key_slots = padded_key_slots(self.cache, row_ids, lengths, shape.num_keys)
            key_inputs[0][:num_real] = key_slots
            own_slots = np.take_along_axis(key_slots, last_key, axis=1)
        else:
            block_size = self.cache.block_size
            table = self.cache.block_table(row_ids).numpy()
            num_held = -(-lengths // block_size)
            width = min(table.shape[1], self.tables.max_row_blocks)
            held = np.arange(width)[None, :] < num_held[:, None]
            blocks, num_full_rows, num_held_rows = key_inputs
            blocks[:num_real, :width] = np.where(held, table[:, :width], self.tables.num_blocks)
            # The first new position's keys and all before it are seen by every query of the row.
            num_full_rows[:num_real, 0] = (lengths - counts + 1) // block_size
            num_held_rows[:num_real, 0] = num_held
            own_blocks = np.take_along_axis(table, last_key // block_size, axis=1).astype(np.int64)
            own_slots = own_blocks * block_size + last_key % block_size
        # A real query's own key is where it is written; padded queries write the scratch slot.
        write_slots[:num_real] = np.where(real, own_slots, self.scratch_slot)
        first_logit = counts - np.fromiter((row.num_logits for row in rows), dtype=np.int64, count=num_real)
        wanted = np.flatnonzero(real & (np.arange(shape.num_positions)[None, :] >= first_logit[:, None]))
        logit_index.reshape(-1)[: len(wanted)] = wanted
        self.buffer.copy_(to_device_source(self._host, self.buffer.device), non_blocking=True)
        return len(wanted)


def logit_order(rows: Sequence[RowInput], order: np.ndarray, device: torch.device) -> torch.Tensor:
    """Where each logit of ``rows``, in row order, lies among the logits of the rows in
    ``order`` (each row's ``num_logits`` in a run)."""
    counts = np.array([row.num_logits for row in rows])
    starts = np.zeros(len(rows), dtype=np.int64)
    starts[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]])
    index = np.concatenate([np.arange(start, start + count) for start, count in zip(starts, counts)])
    return to_device_source(index.astype(np.int64), device).to(device, non_blocking=True)


def to_device_source(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` as the source of a copy to ``device`` that leaves the host free: pinned for a
    GPU (a copy from pageable memory waits for the device's queue, so a step's second sub-step
    would wait for its first; the pinned allocator keeps the block until the copy is done)."""
    source = torch.from_numpy(host)
    return source.pin_memory() if device.type == "cuda" else source


def attention_rows(shape: StepShape, max_rows: int) -> int:
    """Rows a paged step of ``shape`` attends over: a verification's ``ATTENTION_ROW_BUCKETS``
    (at most ``max_rows``), a prompt chunk's own (padding it would pad a chunk's width per row)."""
    if is_chunk_shape(shape):
        return shape.num_rows
    return min(bucket(shape.num_rows, ATTENTION_ROW_BUCKETS) or max_rows, max_rows)


def is_chunk_shape(shape: StepShape) -> bool:
    """A prompt-chunk shape (wider than every verification)."""
    return shape.num_positions > POSITION_BUCKETS[-1]


def fixed_shape(rows: Sequence[RowInput], groups: int, paged: bool = False) -> StepShape | None:
    """The fixed shape a step of ``rows`` runs in, or None where none may (too many rows or
    positions, or a gathered step's mask over ``MAX_GRAPH_MASK_BYTES``)."""
    if not rows:
        return None
    num_rows = bucket(len(rows), ROW_BUCKETS)
    num_positions = bucket(max(len(row.token_ids) for row in rows), POSITION_BUCKETS)
    if num_rows is None or num_positions is None:
        return None
    if paged:
        return StepShape(num_rows, num_positions, 0)
    num_keys = key_bucket(max(row.cached + len(row.token_ids) for row in rows))
    shape = StepShape(num_rows, num_positions, num_keys)
    return shape if fits(shape, groups) else None


def chunk_shape(rows: Sequence[RowInput], max_tokens: int, max_positions: int) -> StepShape | None:
    """The fixed shape of a step of prompt chunks (always paged): a verification grid's shape
    where they are no wider than its ``max_positions``, else a chunk shape of at most
    ``max_tokens``; None where none holds them."""
    num_rows = bucket(len(rows), ROW_BUCKETS)
    widths = [width for width in POSITION_BUCKETS if width <= max_positions] + list(CHUNK_POSITION_BUCKETS)
    num_positions = bucket(max(len(row.token_ids) for row in rows), widths)
    if num_rows is None or num_positions is None:
        return None
    if num_positions > POSITION_BUCKETS[-1] and (
        num_rows > CHUNK_MAX_ROWS or num_rows * num_positions > max_tokens
    ):
        return None
    return StepShape(num_rows, num_positions, 0)


def chunk_grid_shapes(max_rows: int, max_tokens: int) -> list[StepShape]:
    """Every prompt-chunk shape a runner of ``max_rows`` rows and chunks of ``max_tokens``
    (``chunk_graph_tokens``) can meet, widest first."""
    return [
        StepShape(num_rows, num_positions, 0)
        for num_positions in reversed(CHUNK_POSITION_BUCKETS)
        for num_rows in reversed(ROW_BUCKETS)
        if num_rows <= min(max_rows, CHUNK_MAX_ROWS) and num_rows * num_positions <= max_tokens
    ]


def fits(shape: StepShape, groups: int) -> bool:
    return shape.num_rows * groups * shape.num_positions * shape.num_keys <= MAX_GRAPH_MASK_BYTES


def captures_when_met(num_captured: int, is_warm: bool) -> bool:
    """Whether a shape not captured yet is captured by the step that meets it: not once the grid
    was captured at start (it runs packed), and at most ``MAX_GRAPHS`` shapes without one."""
    return not is_warm and num_captured < MAX_GRAPHS


def grid_shapes(
    max_rows: int, max_positions: int, max_keys: int, groups: int, paged: bool = False
) -> list[StepShape]:
    """Every fixed shape a runner of ``max_rows`` rows, verification steps of up to
    ``max_positions`` positions per row and contexts of up to ``max_keys`` keys can meet, in the
    order a start-up captures them: the largest first, so that the smaller ones reuse the graph
    pool's memory (vLLM captures in the same order). Paged steps have one shape per rows x
    positions, whatever the context; gathered steps a grid per key bucket, short contexts first
    (they serve most steps if the start-up budget runs out), up to ``GATHERED_MAX_KEYS``."""
    row_top = bucket(min(max_rows, ROW_BUCKETS[-1]), ROW_BUCKETS)
    position_top = bucket(min(max_positions, POSITION_BUCKETS[-1]), POSITION_BUCKETS)
    key_buckets = [0] if paged else [MIN_KEY_BUCKET]
    while not paged and key_buckets[-1] < min(max_keys, GATHERED_MAX_KEYS):
        key_buckets.append(2 * key_buckets[-1])
    shapes = [
        StepShape(num_rows, num_positions, num_keys)
        for num_keys in key_buckets
        for num_rows in reversed(ROW_BUCKETS)
        if num_rows <= row_top
        for num_positions in reversed(POSITION_BUCKETS)
        if num_positions <= position_top
    ]
    return [shape for shape in shapes if fits(shape, groups)]


class StepGraphs:
    """The runner's fixed-shape steps, captured as CUDA graphs when ``capture``.

    ``warm_up`` captures the whole grid of shapes before serving; from then on a shape left out
    (past the start-up budget) takes the packed path rather than a capture mid-serving. Without
    a warm-up, shapes are captured when first met (at most ``MAX_GRAPHS``). Every step reads and
    writes slices of one set of static buffers (``StepBuffers``) and records into one graph
    pool; building and capturing run under ``torch.inference_mode`` (FlexAttention compiled
    with autograd on asks for the backward's block indices, which a paged step never builds).

    Args:
        model: the runner's model (its type must be in ``GRAPH_MODEL_TYPES``: see ``supports``).
        cache: the runner's KV-cache; one block of it is taken for the scratch slot.
        groups: query heads per key/value head.
        capture: record graphs (a GPU); False runs the same fixed-shape steps eagerly.
        paged: attention reads the block tables (see the module's docstring); else keys are
            gathered per context bucket.
        max_rows: most rows a step may have.
        max_context: longest row a paged step may read.
        compiled: paged attention as a compiled kernel (default: when capturing).
        max_chunk_tokens: the runner's prompt chunk, which sizes the prompt-chunk shapes
            (paged steps only).
    """

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        groups: int,
        capture: bool,
        paged: bool = False,
        max_rows: int = 64,
        max_context: int = 8192,
        compiled: bool | None = None,
        max_chunk_tokens: int = 0,
    ) -> None:
        self.model = model
        self.cache = cache
        self.groups = groups
        self.capture = capture
        self.compiled = capture if compiled is None else compiled
        self.scratch_slot = cache.reserve_block()
        # Why paged steps gave way to gathered ones (None: they did not), shown in the stats.
        self.fallback: str | None = None
        on_cuda = cache.device.type == "cuda"
        if (
            paged
            and self.compiled
            and on_cuda
            and flex_kernel_options(cache.block_size, 1, model.dtype) is None
        ):
            self._fall_back(f"kv_block_size {cache.block_size} is not a multiple of FlexAttention's 16")
            paged = False
        row_top = bucket(min(max_rows, ROW_BUCKETS[-1]), ROW_BUCKETS) or ROW_BUCKETS[-1]
        max_row_blocks = min(cache.blocks_for(max_context), cache.allocator.num_blocks)
        self.tables: PagedTables | None = None
        if paged:
            # A paged step reads whole blocks, masked keys included: every slot must be finite.
            for pool in (*cache.keys, *cache.values):
                pool.zero_()
            self.tables = PagedTables(row_top, cache.allocator.num_blocks, max_row_blocks, cache.device)
        for pool in (*cache.keys, *cache.values):
            pool[:, self.scratch_slot] = 0  # read by padded rows: must be finite
        self.max_rows = row_top  # the most rows a step may have (its buffers' and tables')
        self.chunk_tokens = chunk_graph_tokens(max_chunk_tokens) if paged else 0
        # Why prompt-chunk shapes gave way to the packed path (None: they did not).
        self.chunk_failure: str | None = None
        self.buffers = StepBuffers(
            max(row_top * POSITION_BUCKETS[-1], self.chunk_tokens),
            row_top,
            max(max_row_blocks + 2, GATHERED_MAX_KEYS),
            model.config.hidden_size,
            model.dtype,
            cache.device,
        )
        self.steps: dict[StepShape, FixedStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = False
        self.is_warm = False  # the grid is captured: no capture while serving
        self.max_positions = POSITION_BUCKETS[-1]  # the widest positions per row a step may take
        self.num_captured_serving = 0  # shapes captured by serving steps (none once warm)
        self.last_captured = False  # the last step captured a shape (its time is no step's cost)
        # The verification shape that ran the last step (None: it held prompt chunks, or ran packed).
        self.last_shape: StepShape | None = None

    @property
    def paged(self) -> bool:
        return self.tables is not None

    @staticmethod
    def supports(model) -> bool:
        return getattr(model.config, "model_type", None) in GRAPH_MODEL_TYPES and hasattr(model, "lm_head")

    @torch.inference_mode()
    def warm_up(self, max_rows: int, max_positions: int, max_keys: int, budget_s: float) -> int:
        """Build (and on a GPU capture) every shape of the grid (``grid_shapes``) within
        ``budget_s`` seconds; returns how many shapes are ready. Only a capturing runner (a
        GPU) warms up: eager fixed shapes cost nothing to build when first met; a budget of 0
        leaves every shape to be captured when first met."""
        if not self.capture or budget_s <= 0:
            return len(self.steps)
        started = time.perf_counter()
        self.max_positions = bucket(min(max_positions, POSITION_BUCKETS[-1]), POSITION_BUCKETS) or 1
        paged = self.paged
        shapes = grid_shapes(max_rows, max_positions, max_keys, self.groups, paged)
        chunks = chunk_grid_shapes(self.max_rows, self.chunk_tokens) if paged else []
        if chunks:
            # The largest chunk shape first where it is the largest of all (the later captures
            # reuse its pool memory, as the memory plan counts), the other chunk shapes after the
            # verification grid (which serves most steps, should the budget run out).
            tokens = [shape.num_rows * shape.num_positions for shape in (chunks[0], *shapes[:1])]
            shapes = [chunks[0], *shapes, *chunks[1:]] if tokens[0] >= max(tokens) else shapes + chunks
        for shape in shapes:
            if self.failed or time.perf_counter() - started > budget_s:
                break
            if is_chunk_shape(shape) and self.chunk_failure is not None:
                continue
            if shape not in self.steps and self.build(shape) is None and paged and not self.paged:
                # Paged steps failed and gave way to gathered ones: warm those up instead.
                remaining = budget_s - (time.perf_counter() - started)
                return self.warm_up(max_rows, max_positions, max_keys, remaining)
        self.is_warm = True
        logger.info(
            "step graphs (%s attention): %d shapes ready in %.1f s (budget %.0f s)",
            "paged" if self.paged else "gathered",
            len(self.steps),
            time.perf_counter() - started,
            budget_s,
        )
        return len(self.steps)

    def sub_steps(self, rows: Sequence[RowInput]) -> list[tuple[StepShape, list[int]]] | None:
        """How a step of ``rows`` runs in fixed shapes: its verification rows in one shape, its
        prompt chunks in another (each chunk alone where together they fit none); each shape
        with the indices of its rows. None: the packed path takes the step."""
        verifying = [index for index, row in enumerate(rows) if not row.is_chunk]
        chunks = [index for index, row in enumerate(rows) if row.is_chunk]
        if self.failed or (chunks and (not self.paged or self.chunk_failure is not None)):
            return None  # gathered steps serve verifications only
        planned = []
        if verifying:
            planned.append(
                (fixed_shape([rows[index] for index in verifying], self.groups, self.paged), verifying)
            )
        if chunks:
            together = chunk_shape([rows[index] for index in chunks], self.chunk_tokens, self.max_positions)
            planned += (
                [(together, chunks)]
                if together is not None
                else [
                    (chunk_shape([rows[index]], self.chunk_tokens, self.max_positions), [index])
                    for index in chunks
                ]
            )
        if not all(self._serves(shape, [rows[index] for index in group]) for shape, group in planned):
            return None
        return planned

    def _serves(self, shape: StepShape | None, rows: Sequence[RowInput]) -> bool:
        """Whether ``shape`` (None: no shape holds ``rows``) can run ``rows`` now."""
        if shape is None or shape.num_keys > GATHERED_MAX_KEYS or shape.num_rows > self.max_rows:
            return False
        if self.tables is not None and (
            shape.num_rows > self.tables.max_rows
            or max(row.cached + len(row.token_ids) for row in rows)
            > self.tables.max_row_blocks * self.cache.block_size
        ):
            return False
        return shape in self.steps or captures_when_met(len(self.steps), self.is_warm)

    def forward(self, rows: Sequence[RowInput]) -> torch.Tensor | None:
        """Logits of the positions of ``rows`` that want them, in row order, from fixed-shape
        steps (``sub_steps``); None where the step is not theirs (the packed path takes it)."""
        planned = self.sub_steps(rows)
        self.last_shape, self.last_captured = None, False
        if not planned:
            return None
        steps = []
        for shape, _ in planned:  # every shape ready before any writes the cache
            step = self.steps.get(shape)
            if step is None:
                self.last_captured = True
                step = self.build(shape)
                if step is None:
                    return None
                self.num_captured_serving += 1
            steps.append(step)
        hidden = [
            step.replay(step.load([rows[index] for index in group]))
            for step, (_, group) in zip(steps, planned)
        ]
        if len(planned) == 1:
            self.last_shape = planned[0][0] if not rows[0].is_chunk else None
            return self.model.lm_head(hidden[0])
        order = np.concatenate([group for _, group in planned])
        return self.model.lm_head(
            torch.cat(hidden).index_select(0, logit_order(rows, order, self.cache.device))
        )

    @torch.inference_mode()
    def build(self, shape: StepShape) -> FixedStep | None:
        """The step of ``shape``, run once on idle inputs (which compiles its kernels) and
        captured on a GPU; None where that failed: paged steps then give way to gathered ones,
        gathered steps to the packed path."""
        step = FixedStep(
            self.model,
            self.cache,
            self.groups,
            shape,
            self.scratch_slot,
            self.buffers,
            self.tables,
            self.compiled,
        )
        try:
            if self.capture:
                step.capture(self.pool)
            else:
                step.buffer.copy_(torch.from_numpy(step.idle_inputs()))
                step.run()
        except Exception as exc:  # an op a graph cannot record, a kernel that does not compile
            if is_chunk_shape(shape):  # chunks run packed from now on
                self.chunk_failure = f"{type(exc).__name__}: {exc}"
                logger.warning("prompt chunks run without graphs (slower; /v1/nasd/stats): %s", exc)
            elif self.paged:
                self._fall_back(f"{type(exc).__name__}: {exc}")
                self.tables = None
                self.steps.clear()
            elif self.capture:
                logger.warning("CUDA graph capture failed, steps run without graphs: %s", exc)
                self.failed = True
            else:
                raise
            return None
        self.steps[shape] = step
        return step

    def _fall_back(self, reason: str) -> None:
        self.fallback = reason
        logger.warning(
            "paged attention is off, steps gather keys instead (slower; /v1/nasd/stats): %s", reason
        )
