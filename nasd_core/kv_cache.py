"""Paged KV-cache: one pool of fixed-size blocks allocated once, a block table per row.

Why: a ``DynamicCache`` grows by concatenation, so every decode step copied every row's
whole cache, and a padded batch made every row as long as the longest one. Here each
layer's keys and values live in one tensor ``[kv_heads, num_blocks * block_size, head_dim]``
allocated at start-up; a step writes its new positions in place, and rolling back rejected
drafts is setting the row's length back (the next step overwrites those slots).

A row reserves the blocks for its whole request (prompt + max_tokens) when it is admitted,
so a running row never waits for memory and admission is a count of free blocks. The
allocator prefers one contiguous run of blocks: then the row's keys are a plain view of the
pool and attention reads them without a copy (a fragmented row is gathered, still exact).
On a CPU the pool is allocated untouched, so reserved slots cost no resident memory until
a token is written there, and a finished row's pages are handed back to the OS
(``madvise(MADV_DONTNEED)``): resident memory follows the tokens rows hold now, not every
token the pool has ever held (32 rows of ~800 tokens that finish at different times peaked at
1.53x their live KV bytes before, `python -m benchmarks.kv_steps`).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Hashable
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from nasd_core.errors import ContextLengthError

MADV_DONTNEED = 4  # Linux: the pages read as zeros afterwards, their memory is freed


@cache
def _madvise():
    """libc's ``madvise``, or None off Linux (there freed blocks simply stay resident)."""
    if not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def release_pages(tensor: torch.Tensor, first: int, count: int) -> None:
    """Give the OS back the memory of ``tensor[:, first : first + count]`` (a CPU pool of shape
    [heads, slots, head_dim]): every whole page inside that range of each head. Partly covered
    pages at the edges stay (they may hold a neighbour's slots)."""
    madvise = _madvise()
    if madvise is None:
        return
    heads, num_slots, head_dim = tensor.shape
    slot_bytes = head_dim * tensor.element_size()
    page = mmap.PAGESIZE
    for head in range(heads):
        start = tensor.data_ptr() + (head * num_slots + first) * slot_bytes
        end = start + count * slot_bytes
        aligned_start, aligned_end = -(-start // page) * page, end // page * page
        if aligned_end > aligned_start:
            madvise(aligned_start, aligned_end - aligned_start, MADV_DONTNEED)


@dataclass
class RowBlocks:
    """One row's reservation: its blocks in order and how many positions hold real tokens."""

    block_ids: list[int]
    length: int = 0
    written: int = 0  # most positions ever written (a rollback lowers length, not this)
    start_slot: int | None = None  # first slot when the blocks are one contiguous run
    _slots: torch.Tensor | None = None  # every reserved slot, for fragmented rows

    def capacity(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class BlockAllocator:
    """Free-block bookkeeping: contiguous runs first, any free blocks otherwise."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self.num_free = num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free block ids (a contiguous run where one exists); raises if too few."""
        if num_blocks > self.num_free:
            raise MemoryError(f"{num_blocks} blocks asked, {self.num_free} free")
        start = self._first_run(num_blocks)
        if start is not None:
            block_ids = list(range(start, start + num_blocks))
        else:
            block_ids = np.flatnonzero(self._free)[:num_blocks].tolist()
        self._free[block_ids] = False
        self.num_free -= num_blocks
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        self._free[block_ids] = True
        self.num_free += len(block_ids)

    def _first_run(self, num_blocks: int) -> int | None:
        """Start of the first run of ``num_blocks`` free blocks (first fit), or None."""
        if num_blocks == 0:
            return 0
        padded = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.diff(padded)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fitting = np.flatnonzero(ends - starts >= num_blocks)
        return int(starts[fitting[0]]) if fitting.size else None


class PagedKVCache:
    """Keys and values of every row of an engine, in place, in fixed-size blocks.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        num_blocks: blocks in the pool (its capacity is ``num_blocks * block_size`` positions).
        block_size: positions per block.
        dtype, device: of the pool (the model's).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        num_slots = num_blocks * block_size
        # torch.empty does not touch the memory: on a CPU, pages become resident when written.
        self.keys = [
            torch.empty(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.values = [
            torch.empty(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.allocator = BlockAllocator(num_blocks)
        self.rows: dict[Hashable, RowBlocks] = {}
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.keys[0].element_size()

    # ------------------------------------------------------------ capacity
    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a row of ``num_tokens`` fits the whole pool (else it must be refused)."""
        return self.blocks_for(num_tokens) <= self.allocator.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a row of ``num_tokens`` fits in the blocks free now."""
        return self.blocks_for(num_tokens) <= self.allocator.num_free

    # ---------------------------------------------------------------- rows
    def allocate(self, row_id: Hashable, num_tokens: int) -> None:
        """Reserve room for ``num_tokens`` positions of a new row (its length starts at 0).

        Raises:
            ContextLengthError: the row could never fit the pool.
            MemoryError: it does not fit now (check ``can_allocate`` first).
        """
        if not self.can_ever_fit(num_tokens):
            raise ContextLengthError(
                f"the request needs {num_tokens} positions of KV-cache and the engine holds "
                f"{self.capacity_tokens}; shorten the prompt or max_tokens",
                param="max_tokens",
            )
        if row_id in self.rows:
            raise ValueError(f"row {row_id!r} already holds blocks")
        block_ids = self.allocator.allocate(self.blocks_for(num_tokens))
        row = RowBlocks(block_ids)
        if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1:
            row.start_slot = block_ids[0] * self.block_size
        else:
            offsets = torch.arange(self.block_size)
            blocks = torch.tensor(block_ids).unsqueeze(1) * self.block_size
            row._slots = (blocks + offsets).flatten().to(self.device)
        self.rows[row_id] = row

    def free(self, row_id: Hashable) -> None:
        """Give a row's blocks back (finished, cancelled or aborted); unknown rows are ignored.
        On a CPU the memory of the slots it wrote goes back to the OS."""
        row = self.rows.pop(row_id, None)
        if row is None:
            return
        self.allocator.free(row.block_ids)
        if self.device.type != "cpu" or row.written == 0:
            return
        written_blocks = np.asarray(row.block_ids[: self.blocks_for(row.written)])
        # Runs of consecutive block ids are consecutive slots: one range per run and head.
        run_starts = np.flatnonzero(np.diff(written_blocks, prepend=-2) != 1)
        run_ends = np.append(run_starts[1:], len(written_blocks))
        for start, end in zip(run_starts.tolist(), run_ends.tolist()):
            first_slot = int(written_blocks[start]) * self.block_size
            for pool in (*self.keys, *self.values):
                release_pages(pool, first_slot, (end - start) * self.block_size)

    def length(self, row_id: Hashable) -> int:
        return self.rows[row_id].length

    def set_length(self, row_id: Hashable, length: int) -> None:
        """Positions of the row that hold real tokens: lowering it rolls back rejected drafts."""
        row = self.rows[row_id]
        if not 0 <= length <= row.capacity(self.block_size):
            raise ValueError(f"length {length} outside the row's {row.capacity(self.block_size)} slots")
        row.length = length
        row.written = max(row.written, length)

    def copy_prefix(self, source_id: Hashable, target_id: Hashable, length: int) -> None:
        """Give row ``target_id`` the first ``length`` positions of row ``source_id`` (the choices
        of one prompt share its prefill: a copy of its keys and values, not a forward)."""
        source, target = self.slots(source_id, 0, length), self.slots(target_id, 0, length)
        for pool in (*self.keys, *self.values):
            pool.index_copy_(1, target, pool.index_select(1, source))
        self.set_length(target_id, length)

    def block_table(self, row_ids: list[Hashable]) -> torch.Tensor:
        """``[len(row_ids), most blocks of any of them]`` int32 block ids, rows padded with 0."""
        width = max((len(self.rows[row_id].block_ids) for row_id in row_ids), default=0)
        table = np.zeros((len(row_ids), width), dtype=np.int32)
        for index, row_id in enumerate(row_ids):
            block_ids = self.rows[row_id].block_ids
            table[index, : len(block_ids)] = block_ids
        return torch.from_numpy(table)

    def slots(self, row_id: Hashable, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions ``start..end-1`` of a row (where a step writes them)."""
        row = self.rows[row_id]
        if end > row.capacity(self.block_size):
            raise ValueError(f"position {end - 1} beyond the row's {row.capacity(self.block_size)} slots")
        if row.start_slot is not None:
            return torch.arange(row.start_slot + start, row.start_slot + end, device=self.device)
        assert row._slots is not None
        return row._slots[start:end]

    def row_kv(self, layer: int, row_id: Hashable, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, length, head_dim]`` of a row's first ``length`` positions:
        a view of the pool for a contiguous row, a gathered copy for a fragmented one."""
        row = self.rows[row_id]
        keys, values = self.keys[layer], self.values[layer]
        if row.start_slot is not None:
            start = row.start_slot
            return keys[:, start : start + length].unsqueeze(0), values[:, start : start + length].unsqueeze(
                0
            )
        assert row._slots is not None
        index = row._slots[:length]
        return keys.index_select(1, index).unsqueeze(0), values.index_select(1, index).unsqueeze(0)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a step's ``[kv_heads, positions, head_dim]`` keys and values at ``slots``."""
        self.keys[layer].index_copy_(1, slots, keys)
        self.values[layer].index_copy_(1, slots, values)

    # ------------------------------------------------------------- reports
    def usage(self) -> dict[str, int]:
        """Bytes of the pool, reserved by rows, and holding real tokens now."""
        reserved = sum(row.capacity(self.block_size) for row in self.rows.values())
        live = sum(row.length for row in self.rows.values())
        return {
            "kv_bytes_pool": self.capacity_tokens * self.bytes_per_token,
            "kv_bytes_reserved": reserved * self.bytes_per_token,
            "kv_bytes_live": live * self.bytes_per_token,
            "kv_rows": len(self.rows),
        }
