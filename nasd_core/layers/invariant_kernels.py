"""Triton kernels whose result for a row does not depend on the other rows, nor on how many
positions of its own the step verifies: the GPU half of the deterministic mode (issue 74).

A row's output depends on the order of its reductions. Here that order is fixed by constants
alone, never by the step's shape:

- ``matmul``: every output row sums its K in the same ``BLOCK_K`` tiles, in order, in float32,
  with the same tile shape whatever M (no split-K, no tile choice by M), so a row multiplied
  alone, among 17 positions of its own verification or among 64 rows gets the same bits.
- ``rms_norm``: one program per row, the whole row in one block.
- ``paged_attention``: each query reduces its keys in units of ``keys_per_unit`` (a fixed split
  size, never a split count chosen by the rows or the queries), each unit in ``BLOCK_KEYS``
  chunks in order, and the units are combined in order. Decode (one query) and verification
  (k + 1 queries) are the same kernel.

Checked by ``tests/nasd_core/test_invariant_kernels.py``: compiled on a GPU, bfloat16 included; on a
CPU under Triton's interpreter (``TRITON_INTERPRET=1``; float16 and float32, since NumPy has no
bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

# Tile shape of every matmul, whatever its M: the invariance rests on these being constants.
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32
# Keys per chunk of a unit of attention work (the unit's size is the caller's, a multiple of it).
BLOCK_KEYS = 32


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + inner
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=(ks[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        # Float32 inputs at full precision, not TF32.
        acc = tl.dot(x, w, acc, input_precision="ieee") if IEEE else tl.dot(x, w, acc)
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``weight`` as a Linear's, [out, in]) with each row's sums in a fixed order."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {weight.shape[1]}")
    flat = x.reshape(-1, x.shape[-1])
    (num_rows, inner), outer = flat.shape, weight.shape[0]
    out = torch.empty(num_rows, outer, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(outer, BLOCK_N))
    _matmul_kernel[grid](
        flat,
        weight,
        out,
        num_rows,
        outer,
        inner,
        flat.stride(0),
        flat.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32,
    )
    return out.reshape(*x.shape[:-1], outer)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / N
    normed = (x / tl.sqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, w * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (``weight * normed``, normed in float32 and cast to x's dtype), per row."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(flat)
    width = flat.shape[1]
    _rms_norm_kernel[(flat.shape[0],)](
        flat, weight, out, width, flat.stride(0), out.stride(0), eps, BLOCK=triton.next_power_of_2(width)
    )
    return out.reshape(x.shape)


@triton.jit
def _attention_unit_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    query_row_ptr,
    query_last_key_ptr,
    partial_ptr,
    stats_ptr,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_table,
    stride_pt,
    stride_ph,
    stride_pu,
    stride_st,
    stride_sh,
    stride_su,
    scale,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UNIT_KEYS: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
):
    query = tl.program_id(0)
    head = tl.program_id(1)
    unit = tl.program_id(2)
    kv_head = head // GROUPS
    row = tl.load(query_row_ptr + query)
    last_key = tl.load(query_last_key_ptr + query)  # the query sees keys 0..last_key
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + query * stride_qt + head * stride_qh + dims).to(tl.float32)
    best = -float("inf")
    total = 0.0
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    first = unit * UNIT_KEYS
    # Chunks past the query's last key would add exactly nothing (a shift of 1, no weight): skipped.
    span = tl.minimum(UNIT_KEYS, tl.maximum(last_key + 1 - first, 0))
    for chunk in range(0, span, BLOCK_KEYS):
        keys = first + chunk + tl.arange(0, BLOCK_KEYS)
        visible = keys <= last_key
        block = tl.load(table_ptr + row * stride_table + keys // BLOCK_SIZE, mask=visible, other=0)
        slots = block * BLOCK_SIZE + keys % BLOCK_SIZE
        offsets = kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        # No key seen yet (a unit past the query's last key): nothing to shift, nothing added.
        base = tl.where(new_best == -float("inf"), 0.0, new_best)
        shift = tl.exp(best - base)
        weights = tl.exp(scores - base)
        v = tl.load(v_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        acc = acc * shift + tl.sum(weights[:, None] * v, axis=0)
        total = total * shift + tl.sum(weights, axis=0)
        best = new_best
    tl.store(partial_ptr + query * stride_pt + head * stride_ph + unit * stride_pu + dims, acc)
    stats = stats_ptr + query * stride_st + head * stride_sh + unit * stride_su
    tl.store(stats, best)
    tl.store(stats + 1, total)


@triton.jit
def _combine_units_kernel(
    partial_ptr,
    stats_ptr,
    out_ptr,
    num_units,
    stride_pt,
    stride_ph,
    stride_pu,
    stride_st,
    stride_sh,
    stride_su,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
):
    query = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    best = -float("inf")
    total = 0.0
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for unit in range(0, num_units):  # in order: the combination is the same whatever the grid
        stats = stats_ptr + query * stride_st + head * stride_sh + unit * stride_su
        unit_best = tl.load(stats)
        unit_total = tl.load(stats + 1)
        new_best = tl.maximum(best, unit_best)
        base = tl.where(new_best == -float("inf"), 0.0, new_best)  # an empty unit scales to 0
        old_scale = tl.exp(best - base)
        unit_scale = tl.exp(unit_best - base)
        partial = tl.load(partial_ptr + query * stride_pt + head * stride_ph + unit * stride_pu + dims)
        acc = acc * old_scale + partial * unit_scale
        total = total * old_scale + unit_total * unit_scale
        best = new_best
    out = (acc / total).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + query * stride_ot + head * stride_oh + dims, out)


def paged_attention(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    query_rows: torch.Tensor,
    query_last_keys: torch.Tensor,
    block_size: int,
    scale: float,
    keys_per_unit: int,
    num_keys: int,
) -> torch.Tensor:
    """Causal attention of each query over its row's keys in a paged cache, in units of
    ``keys_per_unit`` keys (a multiple of ``BLOCK_KEYS``: the same for every step, or a query's
    bits would follow the step).

    Args:
        queries: [num_queries, num_heads, head_dim], every row's new positions packed.
        key_pool, value_pool: one layer's cache, [kv_heads, num_slots, head_dim] (slot = block *
            ``block_size`` + offset), the step's keys and values already written.
        block_table: [rows, blocks per row] (int32), each row's blocks in order.
        query_rows: [num_queries], the row of each query.
        query_last_keys: [num_queries], the last key each query sees (its own position).
        num_keys: the most keys any query sees (known on the host: no device read to size the grid).
    Returns:
        [num_queries, num_heads, head_dim] in the queries' dtype.
    """
    num_queries, num_heads, head_dim = queries.shape
    out = torch.empty_like(queries)
    if not num_queries:
        return out
    groups = num_heads // key_pool.shape[0]
    num_units = triton.cdiv(num_keys, keys_per_unit)
    partial = torch.empty(
        num_queries, num_heads, num_units, head_dim, dtype=torch.float32, device=queries.device
    )
    stats = torch.empty(num_queries, num_heads, num_units, 2, dtype=torch.float32, device=queries.device)
    _attention_unit_kernel[(num_queries, num_heads, num_units)](
        queries,
        key_pool,
        value_pool,
        block_table,
        query_rows,
        query_last_keys,
        partial,
        stats,
        queries.stride(0),
        queries.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        block_table.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        stats.stride(0),
        stats.stride(1),
        stats.stride(2),
        scale,
        GROUPS=groups,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        UNIT_KEYS=keys_per_unit,
        BLOCK_KEYS=BLOCK_KEYS,
    )
    _combine_units_kernel[(num_queries, num_heads)](
        partial,
        stats,
        out,
        num_units,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        stats.stride(0),
        stats.stride(1),
        stats.stride(2),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
    )
    return out


class InvariantLinear(nn.Module):
    """A Linear through ``matmul`` (the bias added element by element, which no batch changes)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


class InvariantRMSNorm(nn.Module):
    """A Llama-style RMSNorm (``weight``, ``variance_epsilon``) through ``rms_norm``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


def use_invariant_kernels(model: nn.Module) -> int:
    """Put every Linear (``lm_head`` included) and every Llama-style RMSNorm of ``model`` on these
    kernels, in place (idempotent); how many modules were swapped. Attention goes to
    ``paged_attention`` through the step's layout (``attention.plan_step(triton=True)``), and the
    rest of a layer (rotary embedding, activation, residual adds) is element by element already."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        or (
            type(child) is not InvariantRMSNorm
            and type(child).__name__.endswith("RMSNorm")
            and hasattr(child, "variance_epsilon")
        )
    ]
    for parent, name, child in targets:
        setattr(
            parent, name, InvariantLinear(child) if isinstance(child, nn.Linear) else InvariantRMSNorm(child)
        )
    return len(targets)
