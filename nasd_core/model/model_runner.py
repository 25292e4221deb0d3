"""Model runner: one forward per engine step over the rows' packed positions.

The runner owns the model's paged KV-cache. A step is a list of ``StepRow``: each row feeds
its own tokens (the last token plus its drafts, or a chunk of its prompt) at the positions
after its cached ones; the runner packs them into one sequence with no padding, runs the
model once and returns the logits of only the positions that ask for them (verification
positions: prefill chunks need none, and the vocabulary projection is the dearest layer of a
small model). After the forward every fed position is cached; the engine rolls back
rejected drafts with ``cache.set_length``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from nasd_core.model.attention import Segment, kernel_available, no_mask, plan_step, use_paged_attention
from nasd_core.model.kv_cache import PagedKVCache
from nasd_core.model.step_graphs import GRAPH_MODEL_TYPES, POSITION_BUCKETS, RowInput, StepGraphs, StepShape

logger = logging.getLogger(__name__)

# On a CPU the pool is reserved, not resident (untouched pages cost nothing), so the default
# budget can be generous; on a GPU it is real memory taken from what the model left free.
DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_GPU_KV_FRACTION = 0.6


@dataclass
class StepRow:
    """One row's input to a step: ``token_ids`` go in after the row's cached positions; the
    last ``num_logits`` of them need logits."""

    row_id: Hashable
    token_ids: list[int]
    num_logits: int


def attention_shape(model) -> tuple[int, int, int, int]:
    """(layers, heads, kv heads, head dim) of a transformers causal LM."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, kv_heads, head_dim


def default_kv_tokens(model, max_rows: int) -> int:
    """Positions of KV-cache a default budget holds: a share of the device's memory, no more
    than ``max_rows`` rows of the model's full context could use."""
    num_layers, _, kv_heads, head_dim = attention_shape(model)
    bytes_per_token = 2 * num_layers * kv_heads * head_dim * model.dtype.itemsize
    device = model.device
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = DEFAULT_GPU_KV_FRACTION * free_bytes
    else:
        budget = DEFAULT_CPU_KV_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    context = getattr(model.config, "max_position_embeddings", None) or 8192
    return int(min(budget // bytes_per_token, max_rows * context))


def max_context(model, cache: PagedKVCache) -> int:
    """The longest row ``model`` may hold in ``cache``: its context, or the cache's if smaller."""
    context = getattr(model.config, "max_position_embeddings", None) or cache.capacity_tokens
    return min(cache.capacity_tokens, context)


class ModelRunner:
    """Runs steps of packed rows through ``model`` over a paged KV-cache it allocates once.

    Args:
        model: a transformers causal LM whose attention goes through the attention interface.
        kv_cache_tokens: positions the pool holds (None: ``default_kv_tokens``).
        block_size: positions per block.
        max_rows: rows the default budget is sized for.
        batch_attention: attend short rows in one padded call per layer (None: off the CPU).
        step_graphs: run decode and verification steps in fixed shapes (``nasd_core/model/step_graphs.py``),
            replayed from CUDA graphs on a GPU; needs a model type ``StepGraphs.supports``.
            None: on wherever the model is on CUDA and its type is supported.
        graph_attention: how fixed-shape steps attend, "paged" or "gathered" (``StepGraphs``);
            None: paged where graphs are captured, gathered otherwise.
    """

    def __init__(
        self,
        model,
        kv_cache_tokens: int | None = None,
        block_size: int = 32,
        max_rows: int = 32,
        batch_attention: bool | None = None,
        step_graphs: bool | None = None,
        graph_attention: str | None = None,
    ):
        self.model = model
        use_paged_attention(model)
        num_layers, heads, kv_heads, head_dim = attention_shape(model)
        self.groups = heads // kv_heads
        tokens = kv_cache_tokens if kv_cache_tokens is not None else default_kv_tokens(model, max_rows)
        self.cache = PagedKVCache(
            num_layers, kv_heads, head_dim, -(-tokens // block_size), block_size, model.dtype, model.device
        )
        self.device = model.device
        self.use_kernel = kernel_available(model.device, model.dtype)
        # Off the CPU, short rows share one attention call per layer (see nasd_core/model/attention.py).
        self.batch_attention = model.device.type != "cpu" if batch_attention is None else batch_attention
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if step_graphs is None:
            step_graphs = model.device.type == "cuda" and StepGraphs.supports(model)
        if step_graphs and not StepGraphs.supports(model):
            raise ValueError(
                f"step graphs serve model types {sorted(GRAPH_MODEL_TYPES)}, not {model.config.model_type!r}"
            )
        capture = self.device.type == "cuda"
        self.graphs = (
            StepGraphs(
                model,
                self.cache,
                self.groups,
                capture,
                paged=graph_attention == "paged" or (graph_attention is None and capture),
                max_rows=max_rows,
                max_context=max_context(model, self.cache),
            )
            if step_graphs
            else None
        )
        logger.info(
            "paged KV-cache: %d positions in blocks of %d (%.2f GB reserved)",
            self.cache.capacity_tokens,
            block_size,
            self.cache.capacity_tokens * self.cache.bytes_per_token / 1e9,
        )

        # What the last step was, for the policy: the fixed shape that ran it (None: the packed
        # path), and whether that shape was captured by this very step.
        self.last_graph_shape: StepShape | None = None
        self.last_captured = False

    @property
    def graph_widths(self) -> tuple[int, ...] | None:
        """Positions per row the fixed-shape steps come in (None: every step is packed)."""
        if self.graphs is None or self.graphs.failed:
            return None
        return tuple(width for width in POSITION_BUCKETS if width <= self.graphs.max_positions)

    def warm_up(self, max_rows: int, max_positions: int, max_keys: int, budget_s: float) -> None:
        """Capture the fixed-shape steps of the whole grid before serving (no-op without them)."""
        if self.graphs is not None:
            self.graphs.warm_up(max_rows, max_positions, max_keys, budget_s)

    @torch.inference_mode()
    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """One forward over every row's new tokens; ``[sum of num_logits, vocab]`` logits, in
        row order, on the model's device. Every fed position is cached afterwards."""
        logits = None
        if self.graphs is not None and all(row.num_logits == len(row.token_ids) for row in rows):
            inputs = [RowInput(row.row_id, row.token_ids, self.cache.length(row.row_id)) for row in rows]
            shape = self.graphs.shape_for(inputs)
            logits = self.graphs.forward(inputs, shape) if shape is not None else None
            self.last_graph_shape, self.last_captured = shape, self.graphs.last_captured
        if logits is None:
            logits = self._packed_forward(rows)
            self.last_graph_shape, self.last_captured = None, False
        for row in rows:
            cached = self.cache.length(row.row_id) + len(row.token_ids)
            self.cache.set_length(row.row_id, cached)
        return logits

    def _packed_forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """The step as one sequence of every row's positions, no padding."""
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        spans: list[Segment] = []
        logit_index: list[int] = []
        for row in rows:
            start = self.cache.length(row.row_id)
            count = len(row.token_ids)
            end = start + count
            spans.append(Segment(row.row_id, len(token_ids), count, end))
            logit_index.extend(range(len(token_ids) + count - row.num_logits, len(token_ids) + count))
            token_ids.extend(row.token_ids)
            positions.extend(range(start, end))
            slots.append(self.cache.slots(row.row_id, start, end))
        layout = plan_step(
            self.cache, spans, torch.cat(slots), self.groups, self.use_kernel, self.batch_attention
        )
        keep = torch.tensor(logit_index, dtype=torch.long, device=self.device)
        extra = {"logits_to_keep": keep} if self._takes_logits_to_keep else {}
        output = self.model(
            input_ids=torch.tensor([token_ids], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
            attention_mask=no_mask(self.device),
            use_cache=False,
            nasd_step=layout,
            **extra,
        )
        logits = output.logits[0]
        return logits if self._takes_logits_to_keep else logits[keep]
