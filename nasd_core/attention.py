"""Ragged attention over the paged KV-cache, as a transformers attention implementation.

A step packs every row's new positions into one sequence (batch 1, no padding): row i
brings its own ``1 + draft_i`` positions, a prefilling row a chunk of its prompt. The
model's Linear layers run once over all of them; attention is the only per-row part. For
each layer this function writes the step's keys and values into the rows' slots, then
attends each row's queries to that row's keys: a plain view of the pool when the row's
blocks are contiguous (no copy), causal within the row's new positions.

Two ways to attend, chosen per row when the step is planned (``plan_step``):
- on a CPU in float32, rows of a few positions (decode and verification, the bulk of the
  reading) go to one C++ call per layer (``nasd_core/csrc/paged_attention.cpp``) that reads
  every row's blocks in place and splits the work by row, head and run of keys over the
  cores: a decode step of 32 rows x 1536 cached tokens took 198 ms where one SDPA call per
  row and layer took 294 (`python -m benchmarks.kv_steps`, a 2-core Xeon);
- prompt chunks (matrix-shaped work SDPA does well), other devices and dtypes, and machines
  where the kernel could not be built use one SDPA call per row over a view of the pool (a
  gathered copy for a fragmented row). On a GPU the same layout maps onto a paged/varlen
  kernel; this loop is the device-agnostic reference and the kernel's test oracle.

Grouped-query attention: the ``groups`` query heads that share a key/value head are folded
into the query-position axis, so one SDPA call serves them without copying keys.

Calls without a step layout (transformers' own ``generate``, a plain forward) go to the
implementation the model had before, with its own masks.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional

from nasd_core import native
from nasd_core.kv_cache import PagedKVCache

PAGED_ATTENTION = "nasd_paged"
# A 4-D attention mask makes transformers skip building its own (it would build a T x T mask
# for the packed sequence, which ragged attention never reads).
NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)
# Rows of at most this many new positions go to the kernel; longer ones (wide verifications,
# prompt chunks) to SDPA, whose matrix-shaped kernels win from there: a step of 16 rows x 1536
# tokens took 263 ms with every row at 5 positions in the kernel and 285 with SDPA, 403 and 369
# at 9 positions (embedded model, 2-core Xeon).
KERNEL_MAX_POSITIONS = 6
# Keys per unit of kernel work (a multiple of the kernel's 32-key tile): as long as possible,
# since each unit streams its keys from memory and longer streams read faster (at 32 rows x
# 1536 tokens: 131 ms of attention per step at 512, 128 at 1024), but short enough that every
# thread gets several units.
KERNEL_MAX_KEYS_PER_UNIT = 1024
KERNEL_MIN_KEYS_PER_UNIT = 128
KERNEL_UNITS_PER_THREAD = 8


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


@dataclass
class StepLayout:
    """Where every packed position belongs: passed to the model as a forward kwarg."""

    cache: PagedKVCache
    segments: list[Segment]  # the rows attended with SDPA
    write_slots: torch.Tensor
    groups: int
    kernel_rows: KernelRows | None = None


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps on this device and dtype can use the C++ kernel."""
    return device.type == "cpu" and dtype == torch.float32 and native.load()


def plan_step(
    cache: PagedKVCache, spans: list[Segment], write_slots: torch.Tensor, groups: int, use_kernel: bool
) -> StepLayout:
    """The step's layout from the rows' spans (segments without masks): short rows to the
    kernel when ``use_kernel``, the rest to SDPA with their causal masks."""
    to_kernel: list[Segment] = []
    to_sdpa: list[Segment] = []
    for span in spans:
        kernel = use_kernel and span.num_positions <= KERNEL_MAX_POSITIONS
        (to_kernel if kernel else to_sdpa).append(span)
    kernel_rows = None
    if to_kernel:
        kernel_rows = KernelRows(
            cache.block_table([span.row_id for span in to_kernel]),
            torch.tensor([[span.start, span.num_positions, span.length] for span in to_kernel]),
            keys_per_unit(sum(span.length for span in to_kernel), torch.get_num_threads()),
        )
    segments = [
        replace(span, mask=causal_mask(span.num_positions, span.length, groups, cache.device))
        for span in to_sdpa
    ]
    return StepLayout(cache, segments, write_slots, groups, kernel_rows)


def causal_mask(num_positions: int, length: int, groups: int, device: torch.device) -> torch.Tensor | None:
    """Mask of ``num_positions`` new queries (each group's copy stacked) over ``length`` keys,
    of which the last ``num_positions`` are the new ones. None where none is needed."""
    if num_positions == 1:
        return None
    earlier = length - num_positions
    query = torch.arange(num_positions, device=device).unsqueeze(1)
    key = torch.arange(length, device=device).unsqueeze(0)
    return (key <= earlier + query).repeat(groups, 1)


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
    kernel_rows = nasd_step.kernel_rows
    if kernel_rows is not None:
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
    for segment in nasd_step.segments:
        start, count = segment.start, segment.num_positions
        row_keys, row_values = cache.row_kv(layer, segment.row_id, segment.length)
        # [1, heads, n, D] -> [1, kv_heads, groups * n, D]: heads sharing a key/value head stack up.
        row_query = query[:, :, start : start + count].reshape(1, num_kv_heads, groups * count, head_dim)
        row_out = functional.scaled_dot_product_attention(
            row_query,
            row_keys,
            row_values,
            attn_mask=segment.mask,
            scale=scale,
        )
        out[start : start + count] = row_out.view(num_kv_heads * groups, count, head_dim).transpose(0, 1)
    return out.unsqueeze(0), None


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
