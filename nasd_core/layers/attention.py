"""Ragged attention over the paged KV-cache, as a transformers attention implementation.

A step packs every row's new positions into one sequence (batch 1, no padding): row i
brings its own ``1 + draft_i`` positions, a prefilling row a chunk of its prompt. The
model's Linear layers run once over all of them; attention is the only per-row part. For
each layer this function writes the step's keys and values into the rows' slots, then
attends each row's queries to that row's keys: a plain view of the pool when the row's
blocks are contiguous (no copy), causal within the row's new positions.

Two ways to attend, chosen per row when the step is planned (``plan_step``):
- on a CPU in float32, rows of a few positions (decode and verification, the bulk of the
  reading) go to one C++ call per layer (``nasd_core/native/csrc/paged_attention.cpp``) that reads
  every row's blocks in place and splits the work by row, head and run of keys over the
  cores, faster than one SDPA call per row and layer (docs/results.md, paged KV-cache);
- off the CPU (a GPU), rows of a few positions go to one SDPA call per layer for all of them
  (``BatchedRows``): each row's keys gathered from the pool into a padded batch, a mask per
  row. A call per row and layer there is a kernel launch per row and layer (32 rows x 30
  layers is ~1000 launches a step), which costs more than the attention itself; one padded
  call reads some extra keys instead, which a GPU's memory bandwidth makes cheap;
- steps laid out in fixed shapes for CUDA graphs (``nasd_core/runner/step_graphs.py``) read
  the pool through each row's block table with FlexAttention (``PagedRows``), so nothing in a
  graph's shape depends on context length; or, where that is off, gather a padded batch as above;
- prompt chunks (matrix-shaped work SDPA does well), CPU dtypes other than float32, and
  machines where the kernel could not be built use one SDPA call per row over a view of the
  pool (a gathered copy for a fragmented row): the device-agnostic reference and the other
  paths' test oracle.

Grouped-query attention: the ``groups`` query heads that share a key/value head are folded
into the query-position axis, so one SDPA call serves them without copying keys.

Calls without a step layout (transformers' own ``generate``, a plain forward) go to the
implementation the model had before, with its own masks.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from nasd_core import native
from nasd_core.layers.kv_cache import PagedKVCache

PAGED_ATTENTION = "nasd_paged"


# A 4-D attention mask makes transformers skip building its own (it would build a T x T mask
# for the packed sequence, which ragged attention never reads).
@functools.cache
def no_mask(device: torch.device) -> torch.Tensor:
    """An all-true ``[1, 1, 1, 1]`` mask on ``device``, made once per device (every step passes it)."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)


# Rows of at most this many new positions go to the kernel; longer ones (wide verifications,
# prompt chunks) to SDPA, whose matrix-shaped kernels win from there (timed between 5 and 9).
KERNEL_MAX_POSITIONS = 6
# Keys per unit of kernel work (a multiple of the kernel's 32-key tile): as long as possible,
# since each unit streams its keys from memory and longer streams read faster, but short
# enough that every thread gets several units.
KERNEL_MAX_KEYS_PER_UNIT = 1024
KERNEL_MIN_KEYS_PER_UNIT = 128
KERNEL_UNITS_PER_THREAD = 8
# Off the CPU, rows of at most this many new positions are attended in one padded call per
# layer: every verification width the policy drafts (up to 16 drafts + 1), not prompt chunks,
# whose padding would cost a chunk's width for every row.
BATCH_MAX_POSITIONS = 32
# ... and of at most this many keys: the batch pads every row to its longest, so one long row
# would make every short one gather its length (64 rows at a 32k context gathered 2 GB a layer
# on a 1.5B model); longer rows attend one by one.
BATCH_MAX_KEYS = 4096


# Keys per unit in deterministic mode: one fixed split for every step, so each query's partial
# softmaxes cover the same keys, merged in the same order, whatever else the step holds.
DETERMINISTIC_KEYS_PER_UNIT = 256


def keys_per_unit(total_keys: int, num_threads: int) -> int:
    """Unit length for a step whose kernel rows hold ``total_keys`` keys per head."""
    share = -(-total_keys // (KERNEL_UNITS_PER_THREAD * num_threads))
    share = -(-share // 32) * 32
    return max(KERNEL_MIN_KEYS_PER_UNIT, min(KERNEL_MAX_KEYS_PER_UNIT, share))


@dataclass
class Segment:
    """One row's part of a step: the positions it feeds and what attention needs of it."""

    row_id: Hashable
    start: int  # first index in the packed sequence
    num_positions: int
    length: int  # the row's cached positions after this step's are written
    mask: torch.Tensor | None = None  # [groups * num_positions, length]; None for one position


@dataclass
class KernelRows:
    """The rows a step sends to the C++ kernel, in its input format."""

    block_table: torch.Tensor  # [rows, max blocks] int32
    info: torch.Tensor  # [rows, 3] int64: (first packed position, new positions, cached length)
    keys_per_unit: int
    # For the Triton kernels instead (``invariant_kernels.paged_attention``): per query, its packed
    # position, its row in ``block_table`` and the last key it sees.
    triton_queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_keys: int = 0  # the longest row's keys


@dataclass
class BatchedRows:
    """Rows attended together by one SDPA call per layer, padded to the step's widest row and
    longest context. Padding reads only real data: a padded query repeats its row's last one,
    a padded key is the row's first (the pool's unwritten slots may hold NaN bit patterns,
    which a zero attention weight would not cancel), and both are masked or dropped."""

    key_slots: torch.Tensor  # [rows * keys] pool slot of each (padded) key
    mask: torch.Tensor | None  # [rows, 1, groups * positions, keys] bool: which keys a query sees
    num_positions: int
    num_keys: int
    # For rows packed without padding: the packed position of each padded query, the indices
    # of the real ones among them and their packed positions. None: the step itself is laid
    # out rows x num_positions (``nasd_core/runner/step_graphs.py``), so all three are the identity.
    query_index: torch.Tensor | None = None
    real_index: torch.Tensor | None = None
    out_index: torch.Tensor | None = None


# FlexAttention's tiles (CUDA): tl.dot's smallest is 16; vLLM's FlexAttention backend prefers 64
# in 16-bit dtypes and 32 in float32 (less shared memory per tile).
FLEX_MIN_TILE = 16
FLEX_PREFERRED_TILE = {2: 64, 4: 32}


def flex_kernel_options(
    block_size: int, num_positions: int, dtype: torch.dtype
) -> dict[str, int | bool] | None:
    """FlexAttention's kernel options for a paged step of ``num_positions`` queries per row over
    pages of ``block_size`` positions, or None where no tile fits the page (it must be a
    multiple of 16). Inductor's default H100 tile (BLOCK_M 128, BLOCK_N 64) does not divide a
    32-position page, and the lowering refuses a tile that does not divide its blocks; the
    decode kernel, which inductor picks for short queries, has other rules again, so the main
    kernel is forced, as vLLM's backend does."""
    preferred = FLEX_PREFERRED_TILE.get(dtype.itemsize, FLEX_MIN_TILE)
    tile_n = min(preferred, block_size & -block_size)  # the largest power of two dividing the page
    if tile_n < FLEX_MIN_TILE:
        return None
    tile_m = min(preferred, max(FLEX_MIN_TILE, 1 << (num_positions - 1).bit_length()))
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": tile_m, "BLOCK_N": tile_n}


@dataclass
class PagedRows:
    """Rows of a fixed-shape step attended straight from the pool: the pool is one long key
    sequence and ``block_mask`` lists, per row, the blocks it holds (its block table) and which
    of their keys each query sees. Nothing is gathered, and nothing in the step's shape depends
    on how long the rows are."""

    block_mask: BlockMask  # over ``num_rows`` rows: the step's, then idle ones
    num_rows: int  # rows attended, a few sizes for every step's so that few kernels are compiled
    num_positions: int  # queries per row
    compiled: bool  # a fused kernel (torch.compile); False: the unfused reference, for tests
    kernel_options: dict[str, int | bool] | None = None  # the compiled kernel's tiles (CUDA)


@dataclass
class StepLayout:
    """Where every packed position belongs: passed to the model as a forward kwarg."""

    cache: PagedKVCache
    segments: list[Segment]  # the rows attended with SDPA one by one
    write_slots: torch.Tensor
    groups: int
    kernel_rows: KernelRows | None = None
    batched_rows: BatchedRows | None = None
    paged_rows: PagedRows | None = None


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps on this device and dtype can use the C++ kernel."""
    return device.type == "cpu" and dtype == torch.float32 and native.load()


def plan_step(
    cache: PagedKVCache,
    spans: list[Segment],
    write_slots: torch.Tensor,
    groups: int,
    use_kernel: bool,
    batch_rows: bool = False,
    deterministic: bool = False,
    triton: bool = False,
) -> StepLayout:
    """The step's layout from the rows' spans (segments without masks): short rows to the
    kernel when ``use_kernel``, else to one padded SDPA call when ``batch_rows``, the rest to
    SDPA row by row with their causal masks. ``deterministic``: every row to the kernel, in
    units of ``DETERMINISTIC_KEYS_PER_UNIT`` keys (a query's output then depends on its own
    keys only: not on the row's other queries, the other rows or the step's size); ``triton``:
    with the Triton kernels (``invariant_kernels``) rather than the C++ one."""
    to_kernel: list[Segment] = []
    to_batch: list[Segment] = []
    to_sdpa: list[Segment] = []
    for span in spans:
        if deterministic or (use_kernel and span.num_positions <= KERNEL_MAX_POSITIONS):
            to_kernel.append(span)
        elif batch_rows and span.num_positions <= BATCH_MAX_POSITIONS and span.length <= BATCH_MAX_KEYS:
            to_batch.append(span)
        else:
            to_sdpa.append(span)
    kernel_rows = None
    if to_kernel:
        table = cache.block_table([span.row_id for span in to_kernel])
        kernel_rows = KernelRows(
            table.to(cache.device) if triton else table,
            torch.tensor([[span.start, span.num_positions, span.length] for span in to_kernel]),
            DETERMINISTIC_KEYS_PER_UNIT
            if deterministic
            else keys_per_unit(sum(span.length for span in to_kernel), torch.get_num_threads()),
            triton_queries(to_kernel, cache.device) if triton else None,
            max(span.length for span in to_kernel),
        )
    segments = [
        replace(span, mask=causal_mask(span.num_positions, span.length, groups, cache.device))
        for span in to_sdpa
    ]
    batched_rows = plan_batch(cache, to_batch, groups) if to_batch else None
    return StepLayout(cache, segments, write_slots, groups, kernel_rows, batched_rows)


def triton_queries(spans: list[Segment], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per query of ``spans``: its packed position, its row among them, the last key it sees."""
    positions, rows, last_keys = [], [], []
    for row, span in enumerate(spans):
        first_key = span.length - span.num_positions
        positions.extend(range(span.start, span.start + span.num_positions))
        rows.extend([row] * span.num_positions)
        last_keys.extend(range(first_key, span.length))
    return tuple(
        torch.tensor(values, dtype=dtype, device=device)
        for values, dtype in ((positions, torch.long), (rows, torch.int32), (last_keys, torch.int32))
    )


def plan_batch(cache: PagedKVCache, spans: list[Segment], groups: int) -> BatchedRows:
    """The padded batch of ``spans``, its index tensors built on the host and moved once."""
    counts = np.array([span.num_positions for span in spans])
    lengths = np.array([span.length for span in spans])
    starts = np.array([span.start for span in spans])
    num_positions, num_keys = int(counts.max()), int(lengths.max())
    query_offset, last_key = padded_queries(counts, lengths, num_positions)
    query_index = starts[:, None] + query_offset
    real_index = np.flatnonzero(np.arange(num_positions)[None, :] < counts[:, None])
    key_slots = padded_key_slots(cache, [span.row_id for span in spans], lengths, num_keys)
    device = cache.device
    return BatchedRows(
        key_slots=torch.from_numpy(key_slots.reshape(-1)).to(device),
        mask=row_mask(torch.from_numpy(last_key).to(device), num_keys, groups),
        num_positions=num_positions,
        num_keys=num_keys,
        query_index=torch.from_numpy(query_index.reshape(-1)).to(device),
        real_index=torch.from_numpy(real_index).to(device),
        out_index=torch.from_numpy(query_index.reshape(-1)[real_index]).to(device),
    )


def padded_queries(
    counts: np.ndarray, lengths: np.ndarray, num_positions: int
) -> tuple[np.ndarray, np.ndarray]:
    """For rows feeding ``counts`` new positions (``lengths`` cached after them), padded to
    ``num_positions`` queries each: which new position each query repeats (a padded one, the
    row's last) and the last key it sees (its own); both ``[rows, num_positions]``."""
    query_offset = np.minimum(np.arange(num_positions)[None, :], counts[:, None] - 1)
    return query_offset, (lengths - counts)[:, None] + query_offset


def padded_key_slots(
    cache: PagedKVCache, row_ids: list[Hashable], lengths: np.ndarray, num_keys: int
) -> np.ndarray:
    """``[rows, num_keys]`` pool slots of each row's first ``num_keys`` positions, those past
    its length replaced by its first (written, so finite; the mask hides them)."""
    positions = np.arange(num_keys)[None, :]
    positions = np.where(positions < lengths[:, None], positions, 0)
    table = cache.block_table(row_ids).numpy().astype(np.int64)
    block_size = cache.block_size
    return np.take_along_axis(table, positions // block_size, axis=1) * block_size + positions % block_size


def row_mask(last_key: torch.Tensor, num_keys: int, groups: int) -> torch.Tensor:
    """``[rows, 1, groups * positions, num_keys]`` mask of queries that see keys up to
    ``last_key`` (``[rows, positions]``), each group's copy stacked on the query axis."""
    mask = torch.arange(num_keys, device=last_key.device)[None, None, :] <= last_key[:, :, None]
    return mask.repeat(1, groups, 1).unsqueeze(1)


def causal_mask(num_positions: int, length: int, groups: int, device: torch.device) -> torch.Tensor | None:
    """Mask of ``num_positions`` new queries (each group's copy stacked) over ``length`` keys,
    of which the last ``num_positions`` are the new ones. None where none is needed."""
    if num_positions == 1:
        return None
    earlier = length - num_positions
    query = torch.arange(num_positions, device=device).unsqueeze(1)
    key = torch.arange(length, device=device).unsqueeze(0)
    return (key <= earlier + query).repeat(groups, 1)


# Outside any compiled code (``compiled_layers``): it reads the step's layout, on which a compiled
# graph would specialise, and its own kernels are compiled on their own.
@torch.compiler.disable
def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    nasd_step: StepLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``nasd_step`` selects the ragged paged path."""
    if nasd_step is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fallback = ALL_ATTENTION_FUNCTIONS[getattr(module.config, FALLBACK_ATTRIBUTE)]
        return fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = module.layer_idx
    cache, groups = nasd_step.cache, nasd_step.groups
    # query [1, heads, T, D]; key/value [1, kv_heads, T, D]
    cache.write(layer, nasd_step.write_slots, key[0], value[0])
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    scale = scaling if scaling is not None else head_dim**-0.5
    if nasd_step.paged_rows is not None:
        return attend_paged(query[0], cache, layer, nasd_step.paged_rows, groups, scale).unsqueeze(0), None
    batch = nasd_step.batched_rows
    if batch is not None and batch.out_index is None:  # a padded step: every query is the batch's
        return attend_batch(query[0], cache, layer, batch, groups, scale).unsqueeze(0), None
    kernel_rows = nasd_step.kernel_rows
    if kernel_rows is not None and kernel_rows.triton_queries is not None:
        from nasd_core.layers.invariant_kernels import paged_attention as invariant_attention

        positions, rows, last_keys = kernel_rows.triton_queries
        out = query.new_empty(query.shape[2], query.shape[1], head_dim)  # [T, heads, D]
        queries = query[0].transpose(0, 1).index_select(0, positions).contiguous()
        attended = invariant_attention(
            queries,
            cache.keys[layer],
            cache.values[layer],
            kernel_rows.block_table,
            rows,
            last_keys,
            cache.block_size,
            scale,
            kernel_rows.keys_per_unit,
            kernel_rows.num_keys,
        )
        out.index_copy_(0, positions, attended.to(out.dtype))
    elif kernel_rows is not None:
        out = torch.ops.nasd.paged_attention(
            query[0].transpose(0, 1).contiguous(),
            cache.keys[layer],
            cache.values[layer],
            kernel_rows.block_table,
            kernel_rows.info,
            scale,
            cache.block_size,
            kernel_rows.keys_per_unit,
        )
    else:
        out = query.new_empty(query.shape[2], query.shape[1], head_dim)  # [T, heads, D]
    if batch is not None:
        attended = attend_batch(query[0], cache, layer, batch, groups, scale)
        out.index_copy_(0, batch.out_index, attended.index_select(0, batch.real_index))
    for segment in nasd_step.segments:
        start, count = segment.start, segment.num_positions
        # A float16 pool widens to the query's float32 here (the kernel widens as it reads).
        row_kv = cache.row_kv(layer, segment.row_id, segment.length)
        row_keys, row_values = (pool.to(query.dtype) for pool in row_kv)
        # [1, heads, n, D] -> [1, kv_heads, groups * n, D]: heads sharing a key/value head stack up.
        row_query = query[:, :, start : start + count].reshape(1, num_kv_heads, groups * count, head_dim)
        row_out = functional.scaled_dot_product_attention(
            row_query,
            row_keys,
            row_values,
            attn_mask=segment.mask,
            scale=scale,
        )
        out[start : start + count] = row_out.reshape(num_kv_heads * groups, count, head_dim).transpose(0, 1)
    return out.unsqueeze(0), None


def attend_batch(
    query: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    batch: BatchedRows,
    groups: int,
    scale: float,
) -> torch.Tensor:
    """The attention of the batch's padded queries (from ``query``: [heads, T, D]) over their
    rows' keys in ``layer``, one SDPA call for every row: ``[rows * positions, heads, D]``."""
    heads, _, head_dim = query.shape
    num_rows = batch.key_slots.shape[0] // batch.num_keys
    kv_heads = heads // groups

    def gathered(pool: torch.Tensor) -> torch.Tensor:  # [kv_heads, slots, D] -> [rows, kv_heads, keys, D]
        rows_keys = pool.index_select(1, batch.key_slots).view(kv_heads, num_rows, batch.num_keys, head_dim)
        return rows_keys.transpose(0, 1)

    if batch.query_index is not None:
        query = query.index_select(1, batch.query_index)
    # [heads, rows * P, D] -> [rows, kv_heads, groups * P, D]: heads sharing a key/value head stack up.
    row_query = query.reshape(heads, num_rows, batch.num_positions, head_dim).transpose(0, 1)
    row_query = row_query.reshape(num_rows, kv_heads, groups * batch.num_positions, head_dim)
    row_out = functional.scaled_dot_product_attention(
        row_query,
        gathered(cache.keys[layer]),
        gathered(cache.values[layer]),
        attn_mask=batch.mask,
        scale=scale,
    )
    # [rows, kv_heads, groups * P, D] -> [rows * P, heads, D]
    row_out = row_out.reshape(num_rows, heads, batch.num_positions, head_dim).transpose(1, 2)
    return row_out.reshape(num_rows * batch.num_positions, heads, head_dim)


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled to a fused kernel, one per step shape (a compile with dynamic
    shapes failed to build on this CPU with torch 2.13); the default limit of 8 compiles would
    leave most of a graph grid's shapes on the unfused path."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4096
    )
    return torch.compile(flex_attention, dynamic=False)


def attend_paged(
    query: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    paged: PagedRows,
    groups: int,
    scale: float,
) -> torch.Tensor:
    """The attention of a fixed-shape step's queries (``query``: [heads, rows x positions, D])
    over the pool, read through ``paged.block_mask``: ``[rows x positions, heads, D]``."""
    heads, num_queries, head_dim = query.shape
    num_rows = num_queries // paged.num_positions
    row_query = query.view(heads, num_rows, paged.num_positions, head_dim).transpose(0, 1)
    # Idle rows (zero queries over the scratch block) pad the step to the attended rows.
    row_query = functional.pad(row_query, (0, 0, 0, 0, 0, 0, 0, paged.num_rows - num_rows)).contiguous()
    # The pool as every row's key sequence: [rows, kv_heads, slots, D], a broadcast view.
    keys = cache.keys[layer].unsqueeze(0).expand(paged.num_rows, -1, -1, -1)
    values = cache.values[layer].unsqueeze(0).expand(paged.num_rows, -1, -1, -1)
    attend = compiled_flex_attention() if paged.compiled else flex_attention
    options = {"kernel_options": paged.kernel_options} if paged.kernel_options else {}
    out = attend(
        row_query, keys, values, block_mask=paged.block_mask, scale=scale, enable_gqa=groups > 1, **options
    )
    return out[:num_rows].transpose(1, 2).reshape(num_queries, heads, head_dim)


# Where a model switched to paged attention keeps the name of the implementation it had.
FALLBACK_ATTRIBUTE = "nasd_fallback_attention"


def use_paged_attention(model: nn.Module) -> None:
    """Make ``model`` run ``paged_attention`` (idempotent); its previous implementation serves
    every forward that comes without a step layout ("eager" is served by SDPA, the same sums)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = model.config._attn_implementation
    if previous == PAGED_ATTENTION:
        return
    previous = "sdpa" if previous == "eager" else previous
    if previous not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"unsupported attention implementation {previous!r}")
    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    # Plain forwards keep the masks of the implementation they fall back to.
    masks = ALL_MASK_ATTENTION_FUNCTIONS.get(previous, sdpa_mask)
    AttentionMaskInterface.register(PAGED_ATTENTION, masks)
    setattr(model.config, FALLBACK_ATTRIBUTE, previous)
    model.set_attn_implementation(PAGED_ATTENTION)
