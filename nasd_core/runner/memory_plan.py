"""Device memory planned once at start: weights, the largest step's activations, the step
graphs, and the KV-cache given what is left under ``gpu_memory_utilization``.

Why: the first GPU start of the default engine gave the KV pool 0.6 of free memory, then let
each of 191 graph shapes allocate its own buffers until a capture ran out of memory, and the
probe after it died at ``lm_head``. The engines that work on GPUs plan instead (vLLM's
``determine_available_memory``, TensorRT-LLM's ``kv_cache_free_gpu_mem_fraction``, SGLang's
``mem_fraction_static``): everything but the KV pool is counted first, and the pool takes
the rest of a fixed share of the device. Here:

    budget     = gpu_memory_utilization x device total
    in use     = what the device already holds (weights, the CUDA context, other processes)
    activation = the peak of the largest eager step (measured on CUDA, never below the estimate)
    graphs     = the fixed-shape steps' static buffers and the largest shape's intermediates
    KV         = budget - in use - activation - graphs, in whole blocks

A plan whose KV pool cannot hold one row of the longest context is refused at start with an
error naming the settings and what would fit, never on the first request. The estimates
follow what the step's code allocates (``activation_bytes``, ``graph_bytes``); a CPU test
plans every device x model x rows cell of the deployments this project ships.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from nasd_core.config import DEFAULT_GPU_MEMORY_UTILIZATION
from nasd_core.errors import NASDError
from nasd_core.layers.shape import ModelShape
from nasd_core.runner.step_graphs import chunk_graph_tokens

GIB = 1 << 30
# The shortest prompt chunk a default plan shrinks to where the default (GPU_PREFILL_CHUNK_TOKENS)
# does not fit, as SGLang sizes its chunked prefill by the device's memory.
MIN_DEFAULT_PREFILL_CHUNK = 256


class MemoryPlanError(NASDError, ValueError):
    """The settings cannot fit the device: raised at start, naming the settings and what fits."""


@dataclass(frozen=True)
class StepLimits:
    """The widest steps an engine runs, which size its activations and graphs."""

    max_rows: int  # rows per step
    max_positions: int  # verification positions per row (1 + drafts)
    prefill_chunk: int  # prompt tokens per step
    max_context: int  # longest row
    graph_positions: int  # positions per row of the widest fixed-shape step (0: no graphs)
    graph_rows: int  # rows of the largest fixed-shape step
    graph_keys: int  # keys per row of the largest gathered step (the fallback's)
    batched_max_keys: int  # keys per row of a padded batch of short rows (the packed path)
    block_size: int


def activation_bytes(model: ModelShape, limits: StepLimits) -> int:
    """Estimated peak of the largest eager (packed) step: a prompt chunk at the end of the longest
    context beside every row verifying its widest draft. One layer's transients are alive at a
    time; the prompt chunk's causal mask over its keys (and SDPA's copy of it in the model's
    dtype); the short rows' keys and values gathered into one padded batch with its mask; the
    logits of every verified position with their float32 copies."""
    decode_tokens = limits.max_rows * limits.max_positions
    tokens = limits.prefill_chunk + decode_tokens
    chunk_mask = model.groups * limits.prefill_chunk * limits.max_context * (1 + model.dtype_bytes)
    batch_keys = limits.max_rows * min(limits.max_context, limits.batched_max_keys)
    gathered = 2 * batch_keys * model.num_kv_heads * model.head_dim * model.dtype_bytes
    batch_mask = batch_keys * model.groups * limits.max_positions * (1 + model.dtype_bytes)
    scores = 4 * model.num_heads * decode_tokens * min(limits.max_context, limits.batched_max_keys)
    return (
        model.layer_bytes(tokens)
        + chunk_mask
        + gathered
        + batch_mask
        + scores
        + model.logits_bytes(decode_tokens + 1)
    )


def graph_bytes(model: ModelShape, limits: StepLimits) -> int:
    """The fixed-shape steps' memory besides the KV pool's: their one set of static inputs and
    outputs, sized for the largest shape, and the graph pool, which holds the intermediates of
    the largest shape (captured first; the others reuse its memory). The block tables, which
    grow with the pool, are counted per KV position in ``table_bytes_per_token``."""
    if not limits.graph_positions:
        return 0
    # The widest verification shape or the largest prompt-chunk shape (paged steps capture both).
    tokens = max(limits.graph_rows * limits.graph_positions, chunk_graph_tokens(limits.prefill_chunk))
    max_row_blocks = -(-limits.max_context // limits.block_size)
    inputs = 8 * (5 * tokens + limits.graph_rows * (max_row_blocks + 2))
    outputs = tokens * model.hidden_size * model.dtype_bytes
    # The largest shape's decoder pass, its attention's float32 accumulators and row masks; or,
    # where steps gather keys instead (the fallback), the gathered keys, values, mask and scores.
    paged = model.layer_bytes(tokens) + 4 * tokens * model.num_heads * (model.head_dim + 2)
    keys = limits.graph_rows * limits.graph_keys
    gathered = (
        model.layer_bytes(tokens)
        + 2 * keys * model.num_kv_heads * model.head_dim * model.dtype_bytes
        + keys * model.groups * limits.graph_positions * (1 + model.dtype_bytes)
        + 4 * tokens * model.num_heads * limits.graph_keys
    )
    return inputs + outputs + max(paged, gathered)


def table_bytes_per_token(limits: StepLimits) -> float:
    """The paged steps' block tables per KV position: three int32 entries per block and row."""
    if not limits.graph_positions:
        return 0.0
    return 3 * 4 * limits.graph_rows / limits.block_size


@dataclass(frozen=True)
class MemoryPlan:
    """How a device's memory is shared out at start (bytes, except ``kv_tokens``)."""

    total: int
    utilization: float
    in_use: int  # held when the plan was made: weights, the CUDA context, other processes
    weights: int
    activation: int
    graphs: int
    kv_tokens: int
    kv_bytes: int
    max_rows: int
    max_context: int
    prefill_chunk: int

    @property
    def budget(self) -> int:
        return int(self.utilization * self.total)

    @property
    def planned(self) -> int:
        return self.in_use + self.activation + self.graphs + self.kv_bytes

    @property
    def full_context_rows(self) -> int:
        """Rows of the longest context the KV pool holds at once."""
        return self.kv_tokens // self.max_context

    def describe(self) -> str:
        return (
            f"device memory plan: {self.budget / GIB:.2f} GiB budget (gpu_memory_utilization "
            f"{self.utilization} of {self.total / GIB:.2f} GiB): weights {self.weights / GIB:.2f} GiB "
            f"(in use at start {self.in_use / GIB:.2f}), activations {self.activation / GIB:.2f}, step "
            f"graphs {self.graphs / GIB:.2f}, KV-cache {self.kv_bytes / GIB:.2f} GiB = {self.kv_tokens} "
            f"positions ({self.full_context_rows} rows of the {self.max_context}-token context at once; "
            f"{self.max_rows} rows per step, {self.prefill_chunk}-token prompt chunks)"
        )

    def to_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "budget": self.budget, "full_context_rows": self.full_context_rows}


def plan_memory(
    model: ModelShape,
    limits: StepLimits,
    total: int,
    in_use: int,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_tokens: int | None = None,
    measured_activation: int | None = None,
) -> MemoryPlan:
    """Share out a device of ``total`` bytes, ``in_use`` of them held already (the weights
    among them). ``kv_tokens``: the pool's size when set by hand (checked, not planned).
    ``measured_activation``: a profiled step's peak (the estimate is kept if it is larger).

    Raises:
        MemoryPlanError: the KV pool left cannot hold one row of ``limits.max_context``
            positions (or the pool set by hand does not fit); the message says what would.
    """
    activation = max(activation_bytes(model, limits), measured_activation or 0)
    graphs = graph_bytes(model, limits)
    budget = int(utilization * total)
    per_token = model.kv_bytes_per_token + table_bytes_per_token(limits)
    left = budget - in_use - activation - graphs
    block = limits.block_size
    fitting_tokens = max(0, int(left // per_token) // block * block)
    # One row of the longest context, and the step graphs' scratch block beside it.
    one_row = (-(-limits.max_context // block) + bool(limits.graph_positions)) * block
    needed = in_use + activation + graphs + one_row * per_token
    if kv_tokens is None and fitting_tokens < one_row:
        # Rounded up: the share named must be enough.
        share = math.ceil(100 * needed / total) / 100
        remedy = (
            f"Raise gpu_memory_utilization to {share:.2f}, or lower"
            if share <= 1.0
            else "No share of this device is enough: lower"
        )
        raise MemoryPlanError(
            f"the model does not fit this device with room for one {limits.max_context}-token row: "
            f"{needed / GIB:.2f} GiB needed (in use at start {in_use / GIB:.2f} of which weights "
            f"{model.weight_bytes / GIB:.2f}, activations {activation / GIB:.2f} for {limits.max_rows} rows "
            f"and {limits.prefill_chunk}-token prompt chunks, step graphs {graphs / GIB:.2f}, one row's "
            f"KV-cache {one_row * per_token / GIB:.2f}), and gpu_memory_utilization {utilization} of "
            f"{total / GIB:.2f} GiB allows {budget / GIB:.2f}; the KV-cache left holds {fitting_tokens} "
            f"positions. {remedy} max_batch_rows or prefill_chunk_tokens, or use a device with more memory"
        )
    if kv_tokens is not None:
        kv_tokens = -(-kv_tokens // block) * block
        if kv_tokens > fitting_tokens:
            raise MemoryPlanError(
                f"kv_cache_tokens={kv_tokens} needs {kv_tokens * per_token / GIB:.2f} GiB and "
                f"gpu_memory_utilization {utilization} of {total / GIB:.2f} GiB leaves "
                f"{max(0, left) / GIB:.2f} GiB after weights, activations and step graphs: at most "
                f"{fitting_tokens} positions fit"
            )
    else:
        kv_tokens = fitting_tokens
    return MemoryPlan(
        total=total,
        utilization=utilization,
        in_use=in_use,
        weights=model.weight_bytes,
        activation=activation,
        graphs=graphs,
        kv_tokens=kv_tokens,
        kv_bytes=int(kv_tokens * per_token),
        max_rows=limits.max_rows,
        max_context=limits.max_context,
        prefill_chunk=limits.prefill_chunk,
    )


def plan_shrinking_chunk(
    model: ModelShape,
    limits: StepLimits,
    device: Callable[[], tuple[int, int]],
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_tokens: int | None = None,
    shrink: bool = True,
    measure: Callable[[StepLimits], int | None] = lambda limits: None,
) -> MemoryPlan:
    """``plan_memory`` at ``limits``' prompt chunk, halved (with ``shrink``: a default chunk)
    down to ``MIN_DEFAULT_PREFILL_CHUNK`` while the plan does not fit, so that a small device
    takes more, shorter prompt steps rather than refusing to start. ``device()``: its (total, in
    use) bytes, read after ``measure(limits)``, a profiled peak (None: the estimate alone; it
    raises ``MemoryPlanError`` where the profile itself does not fit).

    Raises:
        MemoryPlanError: the last chunk tried does not fit either (the message says why).
    """
    while True:
        try:
            measured = measure(limits)
            return plan_memory(model, limits, *device(), utilization, kv_tokens, measured)
        except MemoryPlanError:
            if not shrink or limits.prefill_chunk // 2 < MIN_DEFAULT_PREFILL_CHUNK:
                raise
            limits = replace(limits, prefill_chunk=limits.prefill_chunk // 2)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of a CUDA device, after handing the caching allocator's unused
    blocks back (a previous engine's pool, freed, must not count as in use)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free
