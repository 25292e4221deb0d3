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

import contextlib
import inspect
import logging
import os
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nasd_core.config import RunnerConfig
from nasd_core.layers.attention import (
    BATCH_MAX_KEYS,
    Segment,
    kernel_available,
    no_mask,
    plan_step,
    use_paged_attention,
)
from nasd_core.layers.compiled_layers import COMPILED_MODEL_TYPES, compile_layers
from nasd_core.layers.cpu_kernels import use_batch_invariant_kernels
from nasd_core.layers.kv_cache import PagedKVCache
from nasd_core.layers.lean_decoder import lean_forward
from nasd_core.layers.model_state import model_state
from nasd_core.runner.memory_plan import (
    MemoryPlan,
    MemoryPlanError,
    ModelShape,
    StepLimits,
    device_memory,
    plan_shrinking_chunk,
)
from nasd_core.runner.step_graphs import (
    GATHERED_MAX_KEYS,
    GRAPH_MODEL_TYPES,
    POSITION_BUCKETS,
    ROW_BUCKETS,
    RowInput,
    StepGraphs,
    StepShape,
    bucket,
)

logger = logging.getLogger(__name__)

# On a CPU the pool is reserved, not resident (untouched pages cost nothing), so the default
# budget can be generous; on a GPU the memory plan sizes it (``nasd_core/runner/memory_plan.py``).
DEFAULT_CPU_KV_FRACTION = 0.25
# Prompt tokens per step by default. On a CPU a step's cost grows with its tokens from the
# first ones, so chunks stay short and running rows keep their inter-token latency; on a GPU it
# hardly grows (a 1.5B model on an H100: 23-28 ms from 1 to 1088 positions,
# benchmarks/results/step_cost_cuda_qwen2-1.5b.json), so short chunks would only multiply a long
# prompt's steps: a 1000-token chat takes 4 steps of 256, 1 of 2048.
CPU_PREFILL_CHUNK_TOKENS = 256
GPU_PREFILL_CHUNK_TOKENS = 2048
# Steps that prefill at least this many prompt tokens take ``prefill_threads`` (llama.cpp's
# --threads-batch): long in their parallel loops for the tokens they stream, so a core kept free
# for the server's other processes pays more working on them (measured: docs/how-it-works.md).
# Verification steps keep the decode threads, so their costs stay one curve for the policy.
PREFILL_THREADS_MIN_TOKENS = 32


def default_prefill_chunk(device: torch.device) -> int:
    return CPU_PREFILL_CHUNK_TOKENS if device.type == "cpu" else GPU_PREFILL_CHUNK_TOKENS


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


@contextlib.contextmanager
def step_threads(prefill_threads: int | None, rows: Sequence[StepRow]) -> Iterator[None]:
    """Torch's threads for a step of ``rows``: ``prefill_threads`` where its positions that need no
    logits (prompt tokens) reach ``PREFILL_THREADS_MIN_TOKENS``, the caller's otherwise (set back
    after the step; torch's global count follows, so a thread whose first parallel op runs meanwhile
    keeps it, which only ever gives it more threads)."""
    before = torch.get_num_threads()
    num_prompt_tokens = sum(len(row.token_ids) - row.num_logits for row in rows)
    if prefill_threads is None or num_prompt_tokens < PREFILL_THREADS_MIN_TOKENS or prefill_threads == before:
        yield
        return
    torch.set_num_threads(prefill_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kv_dtype_for(model, setting: str = "auto") -> torch.dtype:
    """The KV-cache's element type for ``model`` (``RunnerConfig.kv_cache_dtype``)."""
    on_cpu_float32 = model.device.type == "cpu" and model.dtype == torch.float32
    if setting == "auto":
        return torch.float16 if on_cpu_float32 and model_state(model).lean_decoder else model.dtype
    dtype = getattr(torch, setting)
    if dtype != model.dtype and not on_cpu_float32:
        raise ValueError(f"a {setting} KV-cache needs a float32 model on a CPU (this one: {model.dtype})")
    return dtype


def default_cpu_kv_tokens(model, max_rows: int, dtype: torch.dtype) -> int:
    """Positions of KV-cache a CPU's default budget holds: a share of the machine's memory, no
    more than ``max_rows`` rows of the model's full context could use."""
    budget = DEFAULT_CPU_KV_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    context = getattr(model.config, "max_position_embeddings", None) or 8192
    num_layers, _, kv_heads, head_dim = attention_shape(model)
    bytes_per_token = 2 * num_layers * kv_heads * head_dim * dtype.itemsize
    return int(min(budget // bytes_per_token, max_rows * context))


def step_limits(
    model, max_rows: int, max_positions: int, prefill_chunk: int, block_size: int, graphs: bool
) -> StepLimits:
    """The widest steps a runner of ``model`` takes (what its memory plan sizes)."""
    return StepLimits(
        max_rows=max_rows,
        max_positions=max_positions,
        prefill_chunk=prefill_chunk,
        max_context=getattr(model.config, "max_position_embeddings", None) or 8192,
        graph_positions=POSITION_BUCKETS[-1] if graphs else 0,
        graph_rows=bucket(min(max_rows, ROW_BUCKETS[-1]), ROW_BUCKETS) or ROW_BUCKETS[-1],
        graph_keys=GATHERED_MAX_KEYS,
        batched_max_keys=BATCH_MAX_KEYS,
        block_size=block_size,
    )


@torch.inference_mode()
def profile_step_peak(runner: ModelRunner, limits: StepLimits) -> int:
    """Bytes a CUDA device's largest eager step takes beyond what is allocated before it: a
    prompt chunk at the end of the longest context, with the logits of a full batch's
    verification and their float32 softmax, on a KV-cache made for it and freed after."""
    model = runner.model
    chunk = min(limits.prefill_chunk, limits.max_context)
    num_layers, _, kv_heads, head_dim = attention_shape(model)
    num_blocks = -(-limits.max_context // limits.block_size)
    runner.cache = cache = PagedKVCache(
        num_layers, kv_heads, head_dim, num_blocks, limits.block_size, model.dtype, model.device
    )
    try:
        for pool in (*cache.keys, *cache.values):
            pool.zero_()
        cache.allocate("profile", limits.max_context)
        cache.set_length("profile", limits.max_context - chunk)
        torch.cuda.synchronize(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
        before = torch.cuda.memory_allocated(model.device)
        num_logits = min(chunk, limits.max_rows * limits.max_positions)
        tokens = [(7 * index) % model.config.vocab_size for index in range(chunk)]
        logits = runner._packed_forward([StepRow("profile", tokens, num_logits)])
        torch.softmax(logits.float(), dim=-1)
        torch.cuda.synchronize(model.device)
        return torch.cuda.max_memory_allocated(model.device) - before
    finally:
        del runner.cache, cache


def max_context(model, cache: PagedKVCache) -> int:
    """The longest row ``model`` may hold in ``cache``: its context, or the cache's if smaller."""
    context = getattr(model.config, "max_position_embeddings", None) or cache.capacity_tokens
    return min(cache.capacity_tokens, context)


class ModelRunner:
    """Runs steps of packed rows through ``model`` over a paged KV-cache it allocates once.

    On a CUDA device the KV-cache is sized by a memory plan (``nasd_core/runner/memory_plan.py``):
    what is left of ``gpu_memory_utilization`` of the device once the weights, the largest
    step's activations (profiled) and the step graphs are counted; a setting that cannot fit is
    refused here, at start.

    Args:
        model: a transformers causal LM whose attention goes through the attention interface.
            Compiled layers and deterministic steps change it in place.
        config: the KV-cache, step shapes and kernels (``RunnerConfig``; default: its defaults).
            ``self.prefill_chunk_tokens`` says what prompt chunk was chosen.
    """

    def __init__(self, model, config: RunnerConfig | None = None):
        config = config if config is not None else RunnerConfig()
        self.config = config
        self.model = model
        # Resolved below: None means "wherever the device and the model type allow".
        step_graphs, compiled_layers = config.step_graphs, config.compiled_layers
        deterministic = config.deterministic
        # Deterministic steps keep one thread count: torch's own kernels split work by it.
        self.prefill_threads = None if deterministic else config.prefill_threads
        self.deterministic = deterministic
        kernels = config.deterministic_kernels or ("native" if model.device.type == "cpu" else "triton")
        self.triton_attention = deterministic and kernels == "triton"
        if deterministic:
            if step_graphs or compiled_layers:
                raise ValueError("deterministic steps need step_graphs and compiled_layers off")
            step_graphs, compiled_layers = False, False
            if kernels == "triton":
                from nasd_core.layers.invariant_kernels import use_invariant_kernels

                use_invariant_kernels(model)
            else:
                use_batch_invariant_kernels(model)
        use_paged_attention(model)
        num_layers, heads, kv_heads, head_dim = attention_shape(model)
        self.groups = heads // kv_heads
        self.device = model.device
        self.use_kernel = kernel_available(model.device, model.dtype)
        self.kv_dtype = kv_dtype_for(model, config.kv_cache_dtype)
        self.model_state = state = model_state(model)
        # The GGUF path's multiplies are batch-invariant and round activations to int8, which turns
        # attention's last-bit differences into whole rounding steps: its attention is always the
        # deterministic one (every row in the kernel, fixed units), so greedy speculation is its
        # plain decoding token for token whatever the batch or the prompts' chunking.
        self.deterministic_attention = deterministic or state.lean_decoder
        # Off the CPU, short rows share one attention call per layer (see nasd_core/layers/attention.py).
        on_cpu = model.device.type == "cpu"
        self.batch_attention = not on_cpu if config.batch_attention is None else config.batch_attention
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if step_graphs is None:
            step_graphs = model.device.type == "cuda" and StepGraphs.supports(model)
        if step_graphs and not StepGraphs.supports(model):
            raise ValueError(
                f"step graphs serve model types {sorted(GRAPH_MODEL_TYPES)}, not {model.config.model_type!r}"
            )
        if self.kv_dtype != model.dtype and (step_graphs or self.batch_attention):
            # Their SDPA and FlexAttention calls read the pool as the query's dtype.
            if config.kv_cache_dtype != "auto":
                raise ValueError(
                    "a KV-cache of another dtype than the model's needs step graphs and batched attention off"
                )
            self.kv_dtype = model.dtype
        capture = self.device.type == "cuda"
        if compiled_layers is None:
            compiled_layers = capture and model.config.model_type in COMPILED_MODEL_TYPES
        # Before the memory plan's profile, which then measures the compiled step.
        if compiled_layers:
            compile_layers(model)
        # What the model runs (compiling changes it in place: another runner may have done it).
        self.compile_failure = state.compile_failure
        self.compiled_layers = state.layers_compiled
        self.prefill_chunk_tokens = config.prefill_chunk_tokens or default_prefill_chunk(model.device)
        self.memory_plan: MemoryPlan | None = None
        if capture:
            self.memory_plan = self._plan_memory(
                step_limits(
                    model,
                    config.max_rows,
                    config.max_positions,
                    self.prefill_chunk_tokens,
                    config.block_size,
                    step_graphs,
                ),
                config.gpu_memory_utilization,
                config.kv_cache_tokens,
                chunk_is_default=config.prefill_chunk_tokens is None,
            )
            self.prefill_chunk_tokens = self.memory_plan.prefill_chunk
            tokens = self.memory_plan.kv_tokens
        elif config.kv_cache_tokens is not None:
            tokens = config.kv_cache_tokens
        else:
            tokens = default_cpu_kv_tokens(model, config.max_rows, self.kv_dtype)
        block_size = config.block_size
        self.cache = PagedKVCache(
            num_layers, kv_heads, head_dim, -(-tokens // block_size), block_size, self.kv_dtype, model.device
        )
        self.graphs = (
            StepGraphs(
                model,
                self.cache,
                self.groups,
                capture,
                paged=config.graph_attention == "paged" or (config.graph_attention is None and capture),
                max_rows=config.max_rows,
                max_context=max_context(model, self.cache),
                max_chunk_tokens=self.prefill_chunk_tokens,
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

        # Whether ``forward`` returns before its step is done (kernels queued on a GPU), so the
        # engine's host work can overlap it until ``wait``.
        self.runs_async = self.device.type == "cuda"
        # What the last step was, for the policy: the fixed shape that ran it (None: the packed
        # path), and whether that shape was captured by this very step.
        self.last_graph_shape: StepShape | None = None
        self.last_captured = False

    def _plan_memory(
        self, limits: StepLimits, utilization: float, kv_cache_tokens: int | None, chunk_is_default: bool
    ) -> MemoryPlan:
        """The CUDA device's memory plan, each prompt chunk tried with its profiled peak; a
        default chunk shortened while it does not fit, a chunk set by hand refused instead."""

        def profiled(limits: StepLimits) -> int:
            try:
                return profile_step_peak(self, limits)
            except torch.OutOfMemoryError:
                raise MemoryPlanError(
                    f"the largest step (a {limits.prefill_chunk}-token prompt chunk at the end of "
                    f"a {limits.max_context}-token context) ran out of memory when profiled; lower "
                    "prefill_chunk_tokens or max_batch_rows, or use a device with more memory"
                ) from None

        plan = plan_shrinking_chunk(
            ModelShape.from_model(self.model),
            limits,
            lambda: device_memory(self.device),
            utilization,
            kv_cache_tokens,
            shrink=chunk_is_default,
            measure=profiled,
        )
        logger.info(plan.describe())
        return plan

    def report(self) -> dict[str, Any]:
        """JSON-able state for the stats endpoint: the KV-cache, the step graphs (their attention,
        and why paged attention fell back, if it did) and the device's memory plan."""
        graphs = self.graphs
        return {
            "device": str(self.device),
            "kv_cache_positions": self.cache.capacity_tokens,
            "kv_block_size": self.cache.block_size,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "deterministic": self.deterministic,
            "compiled_layers": self.compiled_layers,
            "compile_failure": self.compile_failure,
            "step_graphs": None
            if graphs is None
            else {
                "attention": "paged" if graphs.paged else "gathered",
                "paged_fallback": graphs.fallback,
                "shapes": len(graphs.steps),
                "captured_while_serving": graphs.num_captured_serving,
                "failed": graphs.failed,
                "prompt_chunk_tokens": graphs.chunk_tokens if graphs.chunk_failure is None else 0,
                "prompt_chunk_failure": graphs.chunk_failure,
            },
            "memory_plan": None if self.memory_plan is None else self.memory_plan.to_dict(),
        }

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

    def wait(self) -> None:
        """Until the device has run the last step (a CPU's steps are done when ``forward`` returns)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """One forward over every row's new tokens; ``[sum of num_logits, vocab]`` logits, in
        row order, on the model's device. Every fed position is cached afterwards."""
        logits = None
        if self.graphs is not None:
            cached = [self.cache.length(row.row_id) for row in rows]
            logits = self.graphs.forward(
                [
                    RowInput(row.row_id, row.token_ids, length, row.num_logits)
                    for row, length in zip(rows, cached)
                ]
            )
            self.last_graph_shape, self.last_captured = self.graphs.last_shape, self.graphs.last_captured
        if logits is None:
            with step_threads(self.prefill_threads, rows):
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
            self.cache,
            spans,
            torch.cat(slots),
            self.groups,
            self.use_kernel,
            self.batch_attention,
            self.deterministic_attention,
            self.triton_attention,
        )
        keep = torch.tensor(logit_index, dtype=torch.long, device=self.device)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        if self.model_state.lean_decoder:
            return lean_forward(self.model, input_ids[0], position_ids[0], layout, keep)
        extra = {"logits_to_keep": keep} if self._takes_logits_to_keep else {}
        output = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=no_mask(self.device),
            use_cache=False,
            nasd_step=layout,
            **extra,
        )
        logits = output.logits[0]
        return logits if self._takes_logits_to_keep else logits[keep]
