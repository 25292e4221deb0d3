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
token the pool has ever held (docs/results.md, paged KV-cache).

Prefix cache: a finished row's full blocks stay indexed by the tokens they hold (and the
block before them), so a later prompt that starts with the same tokens (the next turn of a
chat, a shared system prompt) reuses their keys and values instead of computing them again.
Such blocks are shared read-only: a row only writes positions after the blocks it reused.
A cached block no row holds is kept until its room is needed or more than
``prefix_cache_blocks`` are kept, oldest use first; then its memory is freed as above.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import sys
from collections import OrderedDict
from collections.abc import Hashable, Sequence
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
    salt: Hashable = None  # prefix-cache entries of this row are found only with the same salt

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
        dtype, device: of the pool (the model's; float16 under a float32 model on a CPU).
        prefix_cache_blocks: most blocks kept for later prompts once no row holds them (0: none).
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
        prefix_cache_blocks: int = 0,
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
        self.num_reserved = 0  # blocks taken out of circulation (held by no row)
        self.rows: dict[Hashable, RowBlocks] = {}
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.keys[0].element_size()
        # Prefix cache. A block's key is (the block before it, that block's generation, the salt,
        # its tokens): the generation counts the block's allocations, so a key made before its
        # parent was reused for other tokens can never match again.
        self.prefix_cache_blocks = prefix_cache_blocks
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._generation = np.zeros(num_blocks, dtype=np.int64)
        self._cached: dict[tuple, int] = {}  # key -> block
        self._block_key: dict[int, tuple] = {}  # block -> its key, for the cached blocks
        self._unused: OrderedDict[int, None] = OrderedDict()  # cached blocks no row holds, oldest first

    # ------------------------------------------------------------ capacity
    @property
    def num_row_blocks(self) -> int:
        """Blocks rows may hold: the pool's, less those reserved (``reserve_block``)."""
        return self.allocator.num_blocks - self.num_reserved

    @property
    def capacity_tokens(self) -> int:
        """Positions rows may hold."""
        return self.num_row_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a row of ``num_tokens`` fits the whole pool (else it must be refused)."""
        return self.blocks_for(num_tokens) <= self.num_row_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a row of ``num_tokens`` fits in the blocks free now (cached ones no row holds
        count as free: they are given up for it)."""
        return self.blocks_for(num_tokens) <= self.num_available

    @property
    def num_available(self) -> int:
        """Blocks a new row can take: free, or cached and held by no row."""
        return self.allocator.num_free + len(self._unused)

    # ---------------------------------------------------------------- rows
    def allocate(
        self, row_id: Hashable, num_tokens: int, prefix: Sequence[int] = (), salt: Hashable = None
    ) -> int:
        """Reserve room for ``num_tokens`` positions of a new row; returns how many of its first
        positions already hold keys and values: the longest run of whole cached blocks that
        ``prefix`` starts with (under ``salt``), which the row shares (its length starts there).

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
        num_blocks = self.blocks_for(num_tokens)
        if num_blocks > self.num_available:
            raise MemoryError(f"{num_blocks} blocks asked, {self.num_available} available")
        shared = self._cached_prefix(prefix, salt)[:num_blocks]
        for block in shared:
            self._unused.pop(block, None)
        self._refs[shared] += 1
        self._evict(max(0, num_blocks - len(shared) - self.allocator.num_free))
        fresh = self.allocator.allocate(num_blocks - len(shared))
        self._refs[fresh] = 1
        self._generation[fresh] += 1
        block_ids = shared + fresh
        row = RowBlocks(block_ids, salt=salt)
        row.length = row.written = len(shared) * self.block_size
        # One run in order (reused blocks come first, so the ids need not be sorted).
        if all(later == earlier + 1 for earlier, later in itertools.pairwise(block_ids)):
            row.start_slot = block_ids[0] * self.block_size
        else:
            offsets = torch.arange(self.block_size)
            blocks = torch.tensor(block_ids).unsqueeze(1) * self.block_size
            row._slots = (blocks + offsets).flatten().to(self.device)
        self.rows[row_id] = row
        return row.length

    def reserve_block(self) -> int:
        """Take one free block out of circulation for good, held by no row (the step graphs'
        scratch block, which padded positions write and read): its first slot."""
        (block,) = self.allocator.allocate(1)
        self.num_reserved += 1
        return block * self.block_size

    def free(self, row_id: Hashable) -> None:
        """Give a row's blocks back (finished, cancelled or aborted); unknown rows are ignored.
        Its cached blocks stay for later prompts (up to ``prefix_cache_blocks`` of them); on a
        CPU the memory of the other slots it wrote goes back to the OS."""
        row = self.rows.pop(row_id, None)
        if row is None:
            return
        self._refs[row.block_ids] -= 1
        released = [block for block in row.block_ids if not self._refs[block]]
        for block in released:
            if block in self._block_key:
                self._unused[block] = None  # newest use last
        written = set(row.block_ids[: self.blocks_for(row.written)])
        self._release([block for block in released if block not in self._block_key], written)
        self._evict(len(self._unused) - self.prefix_cache_blocks)

    def _release(self, block_ids: list[int], written: set[int]) -> None:
        """Free ``block_ids``; on a CPU hand the pages of the ``written`` ones back to the OS."""
        self.allocator.free(block_ids)
        if self.device.type != "cpu":
            return
        written_blocks = np.asarray(sorted(block for block in block_ids if block in written))
        if not written_blocks.size:
            return
        # Runs of consecutive block ids are consecutive slots: one range per run and head.
        run_starts = np.flatnonzero(np.diff(written_blocks, prepend=-2) != 1)
        run_ends = np.append(run_starts[1:], len(written_blocks))
        for start, end in zip(run_starts.tolist(), run_ends.tolist()):
            first_slot = int(written_blocks[start]) * self.block_size
            for pool in (*self.keys, *self.values):
                release_pages(pool, first_slot, (end - start) * self.block_size)

    # -------------------------------------------------------- prefix cache
    def _key(self, parent: int | None, salt: Hashable, tokens: Sequence[int]) -> tuple:
        if parent is None:
            return (-1, 0, salt, tuple(tokens))
        return (parent, int(self._generation[parent]), salt, tuple(tokens))

    def _cached_prefix(self, prefix: Sequence[int], salt: Hashable) -> list[int]:
        """The cached blocks holding ``prefix``'s first whole blocks, as long a run as there is."""
        blocks: list[int] = []
        parent = None
        size = self.block_size
        for start in range(0, len(prefix) - size + 1, size):
            block = self._cached.get(self._key(parent, salt, prefix[start : start + size]))
            if block is None:
                break
            blocks.append(block)
            parent = block
        return blocks

    def cache_prefix(self, row_id: Hashable, tokens: Sequence[int]) -> None:
        """Index the row's whole blocks among its first ``len(tokens)`` positions (which hold
        the keys and values of ``tokens``) for later prompts starting with those tokens. A
        block whose tokens are cached already (in another block) is left out."""
        row = self.rows[row_id]
        parent = None
        size = self.block_size
        for index in range(min(len(tokens), row.length) // size):
            block = row.block_ids[index]
            if block not in self._block_key:
                key = self._key(parent, row.salt, tokens[index * size : (index + 1) * size])
                if key in self._cached:
                    block = self._cached[key]  # the same tokens: later blocks follow that one
                else:
                    self._cached[key] = block
                    self._block_key[block] = key
            parent = block

    def drop_prefix_cache(self) -> None:
        """Forget every cached prefix no row holds (a benchmark's runs must not reuse each other's)."""
        self._evict(len(self._unused))

    def _evict(self, num_blocks: int) -> None:
        """Give up the ``num_blocks`` cached blocks unused longest (their entries and memory)."""
        evicted = []
        for _ in range(min(num_blocks, len(self._unused))):
            block, _ = self._unused.popitem(last=False)
            del self._cached[self._block_key.pop(block)]
            evicted.append(block)
        if evicted:
            self._release(evicted, set(evicted))

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
        """Store a step's ``[kv_heads, positions, head_dim]`` keys and values at ``slots`` (rounded to
        nearest into a float16 pool)."""
        self.keys[layer].index_copy_(1, slots, keys.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(1, slots, values.to(self.values[layer].dtype))

    # ------------------------------------------------------------- reports
    def usage(self) -> dict[str, int]:
        """Bytes of the pool, reserved by rows, holding real tokens now, and kept by the prefix
        cache with no row holding them (a block two rows share counts for each)."""
        reserved = sum(row.capacity(self.block_size) for row in self.rows.values())
        live = sum(row.length for row in self.rows.values())
        return {
            "kv_bytes_pool": self.allocator.num_blocks * self.block_size * self.bytes_per_token,
            "kv_bytes_reserved": reserved * self.bytes_per_token,
            "kv_bytes_live": live * self.bytes_per_token,
            "kv_bytes_cached": len(self._unused) * self.block_size * self.bytes_per_token,
            "kv_rows": len(self.rows),
        }
