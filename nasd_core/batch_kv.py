"""KV-cache of a batch of sequences that join, speculate and leave at different times.

Rows are left-padded to a common width. A 2-D mask marks which cache columns hold a real
token of that row; explicit per-row position ids keep RoPE positions right whatever the
padding. A verification step appends ``width`` columns to every row; the columns of a
row's rejected drafts (or of a row that drafted less than the widest row) stay in the
cache as holes, masked out, until a compaction gathers each row's real columns again.
Columns that are holes in every row at the right end are cropped at once.

Only public cache API is used: ``DynamicCache(ddp_cache_data=...)``, iteration over its
layers' (keys, values), ``crop`` and ``batch_select_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


class BatchKV:
    """Cache plus validity mask for the running rows of an engine.

    Args:
        compact_waste_ratio: compact when hole columns exceed this share of all columns.
        min_compact_columns: never compact a cache narrower than this (not worth a copy).
    """

    def __init__(self, compact_waste_ratio: float = 0.5, min_compact_columns: int = 64) -> None:
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.compact_waste_ratio = compact_waste_ratio
        self.min_compact_columns = min_compact_columns
        self.num_compactions = 0

    @property
    def num_rows(self) -> int:
        return self.mask.shape[0]

    @property
    def device(self) -> torch.device:
        """Where the keys and values live (the mask stays on the CPU: it is bookkeeping)."""
        assert self.cache is not None
        keys, *_ = next(iter(self.cache))
        return keys.device

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def lengths(self) -> torch.Tensor:
        """Real tokens held per row (= the RoPE position of each row's next token)."""
        return self.mask.sum(dim=1)

    # ----------------------------------------------------------------- rows
    @classmethod
    def replicated(cls, row_cache: DynamicCache, num_tokens: int, num_rows: int) -> BatchKV:
        """A batch of ``num_rows`` copies of one prefilled row (the step-time probe's batch)."""
        batch = cls()
        batch.cache = DynamicCache(
            ddp_cache_data=[
                (keys.repeat(num_rows, 1, 1, 1), values.repeat(num_rows, 1, 1, 1))
                for keys, values, *_ in row_cache
            ]
        )
        batch.mask = torch.ones((num_rows, num_tokens), dtype=torch.long)
        return batch

    def add_row(self, row_cache: DynamicCache, num_tokens: int) -> None:
        """Append a prefilled sequence (a 1-row cache of ``num_tokens`` columns) as the last row."""
        row_layers = [(keys, values) for keys, values, *_ in row_cache]
        if self.cache is None or self.num_rows == 0:
            self.cache = DynamicCache(ddp_cache_data=row_layers)
            self.mask = torch.ones((1, num_tokens), dtype=torch.long)
            return
        width = max(self.width, num_tokens)
        merged = []
        for (batch_keys, batch_values, *_), (keys, values) in zip(self.cache, row_layers):
            merged.append(
                (
                    torch.cat([_left_pad(batch_keys, width), _left_pad(keys, width)], dim=0),
                    torch.cat([_left_pad(batch_values, width), _left_pad(values, width)], dim=0),
                )
            )
        self.cache = DynamicCache(ddp_cache_data=merged)
        row_mask = torch.ones((1, num_tokens), dtype=torch.long)
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(row_mask, width, dim=1)], dim=0)

    def keep_rows(self, indices: Sequence[int]) -> None:
        """Keep only the rows at ``indices`` (in that order); the others leave the batch."""
        if len(indices) == self.num_rows:
            return
        if not indices:
            self.cache = None
            self.mask = torch.zeros((0, 0), dtype=torch.long)
            return
        index = torch.tensor(list(indices), dtype=torch.long)
        assert self.cache is not None
        self.cache.batch_select_indices(index.to(self.device))
        self.mask = self.mask[index]
        self._crop_shared_padding()

    # ----------------------------------------------------------------- steps
    def step_inputs(self, num_real: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask ``[rows, cache width + width]`` and position ids ``[rows, width]`` of a step
        in which row i feeds ``num_real[i]`` real tokens followed by padding (on the cache's device)."""
        real = torch.tensor(list(num_real), dtype=torch.long).unsqueeze(1)
        offsets = torch.arange(width, dtype=torch.long).unsqueeze(0)
        step_mask = (offsets < real).long()
        position_ids = self.lengths().unsqueeze(1) + offsets
        return torch.cat([self.mask, step_mask], dim=1).to(self.device), position_ids.to(self.device)

    def commit(self, num_kept: Sequence[int], width: int) -> None:
        """After a step of ``width`` columns: row i keeps its first ``num_kept[i]`` of them."""
        kept = torch.tensor(list(num_kept), dtype=torch.long).unsqueeze(1)
        step_mask = (torch.arange(width, dtype=torch.long).unsqueeze(0) < kept).long()
        self.mask = torch.cat([self.mask, step_mask], dim=1)
        self._crop_trailing_holes()
        if self.width >= self.min_compact_columns and self.waste() > self.compact_waste_ratio:
            self.compact()

    def waste(self) -> float:
        """Share of cache columns that hold no real token."""
        total = self.mask.numel()
        return 1.0 - float(self.mask.sum()) / total if total else 0.0

    def compact(self) -> None:
        """Gather each row's real columns, left-padded to the longest row."""
        assert self.cache is not None
        lengths = self.lengths()
        width = int(lengths.max())
        # Source column of every (row, new column); padding slots point at column 0 (masked).
        order = torch.argsort(self.mask, dim=1, stable=True)  # holes first, real columns in order
        index = order[:, -width:]
        new_mask = (torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
        index = torch.where(new_mask.bool(), index, torch.zeros_like(index))
        compacted = []
        index = index.to(self.device)
        for keys, values, *_ in self.cache:
            gather = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            compacted.append((torch.gather(keys, 2, gather), torch.gather(values, 2, gather)))
        self.cache = DynamicCache(ddp_cache_data=compacted)
        self.mask = new_mask
        self.num_compactions += 1

    def _crop_trailing_holes(self) -> None:
        real_columns = torch.nonzero(self.mask.any(dim=0)).flatten()
        last_real = int(real_columns[-1]) + 1 if real_columns.numel() else 0
        trailing = self.width - last_real
        if trailing > 0 and self.cache is not None:
            self.cache.crop(-trailing)
            self.mask = self.mask[:, :last_real]

    def _crop_shared_padding(self) -> None:
        # Left columns that are padding in every remaining row: drop them (a leaving long row).
        real_columns = torch.nonzero(self.mask.any(dim=0)).flatten()
        first_real = int(real_columns[0]) if real_columns.numel() else self.width
        if first_real > 0 and self.cache is not None:
            trimmed = [
                (keys[:, :, first_real:], values[:, :, first_real:]) for keys, values, *_ in self.cache
            ]
            self.cache = DynamicCache(ddp_cache_data=trimmed)
            self.mask = self.mask[:, first_real:]
        self._crop_trailing_holes()


def _left_pad(tensor: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad ``tensor`` on the left of ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=dim)
