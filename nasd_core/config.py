"""Configuration objects passed down through the library.

Every boundary takes one of these pydantic models; defaults live in the ``DEFAULT_*``
constants so the CLI, the service and the benchmarks agree on them.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nasd_core.errors import InvalidRequestError

# Draft-length cap. TensorRT-LLM's batch<=4 row uses gamma=5, transformers' prompt lookup 10.
# A copied span (a quote, unchanged code) is accepted ~95% per token, and on the embedded
# model a 17-token verification step costs ~2.5x a 1-token one, so `auto` is allowed up to
# 16 and drafts less (or nothing) when the match is weak.
DEFAULT_NUM_DRAFT_TOKENS = 16
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1
DEFAULT_MAX_TOKENS = 128
DEFAULT_GRAPH_WARMUP_BUDGET_S = 120.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_BATCH_ROWS = 32
DEFAULT_KV_BLOCK_SIZE = 32
# The engine's largest KV block; a runner alone may take any (generate() holds its request in one).
MAX_KV_BLOCK_SIZE = 4096
DEFAULT_INT8_ACTIVATIONS = True
DEFAULT_FUSED_LAYERS = True
DEFAULT_INDEX_MAX_ENTRIES = 1_000_000
DEFAULT_MAX_SUCCESSORS = 4
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
# Names the embedded model also answers to: its Hugging Face id, which clients written for
# other servers send.
EMBEDDED_MODEL_ALIASES = ("HuggingFaceTB/SmolLM2-135M-Instruct",)

SpeculationMode = Literal["off", "on", "auto"]
LocalIndexKind = Literal["hybrid", "multi_level", "one_level", "prompt_lookup", "suffix"]
DEFAULT_LOOKUP_MAX_NGRAM = 8


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def build(config_cls: type[_Config], **fields: object) -> _Config:
    """Construct a config, turning pydantic's ValidationError into a typed InvalidRequestError."""
    try:
        return config_cls(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise InvalidRequestError(f"{param}: {first['msg']}", param=param) from None


def at_most(name: str, value: int, bound_name: str, bound: int) -> int:
    """``value`` if it does not exceed ``bound`` (a validator's check of one field against another)."""
    if value > bound:
        raise ValueError(f"{name} ({value}) must be <= {bound_name} ({bound})")
    return value


def field_of(config: type[BaseModel], name: str, description: str | None = None) -> Any:
    """``config``'s field ``name`` (its default, bounds and description, or ``description``), to
    declare the same setting in another model, the server's ``AppArgs``, without its defaults again."""
    field = copy.deepcopy(config.model_fields[name])
    field.description = description or field.description
    return field


class GrammarSpec(_Config):
    """A constraint on a request's output (structured output, ``nasd_core/structured.py``)."""

    kind: Literal["json_schema", "regex", "choice", "lark"] = Field(
        description="json_schema: JSON matching a schema; regex: text matching it; choice: one of a "
        "list of strings; lark: a Lark grammar (llguidance's dialect)."
    )
    source: str = Field(
        description="The schema (JSON text), the regex, the choices (a JSON list) or the grammar."
    )
    param: str = Field("grammar", description="The request field it came from, named in errors.")


class ReasoningSpec(_Config):
    """Where a reasoning model's thinking lies in its answer: the request's grammar constrains
    only what follows it (the answer proper), as vLLM's structured output does."""

    end_ids: list[int] = Field(min_length=1, description="The tokens that close the reasoning.")
    start_id: int | None = Field(
        None,
        description="The token that opens reasoning when it is the answer's first (None: the answer "
        "cannot open it).",
    )
    open: bool = Field(False, description="Reasoning is open from the answer's first token.")


class SamplingParams(_Config):
    """How one request is decoded. ``temperature == 0`` means greedy."""

    # Declared first: max_tokens may be 0 only with it (validators see the fields before theirs).
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Each prompt token's log-probability after the first, and this many "
        "top ones (scoring a text).",
    )
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, ge=0, description="Most tokens to generate (0 only to score the prompt)."
    )
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; > 0 samples from softmax(logits / T).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: smallest set with mass >= top_p.")
    seed: int | None = Field(
        None, description="Seed of this request's generator (None = random; any integer, taken modulo 2**64)."
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings; the text ends before them.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end the text.")
    ignore_eos: bool = Field(False, description="Keep going past the tokenizer's end-of-sequence token.")
    min_tokens: int = Field(
        0, ge=0, description="End-of-sequence and stop ids are banned until this many tokens are out."
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="> 1 discourages tokens seen in the prompt or output (vLLM's; 1 = off)."
    )
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every token already in the output."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted once per occurrence of a token in the output."
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict, description="Token id -> bias added to its logit, in [-100, 100]."
    )
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return each output token's log-probability and this many top ones."
    )
    grammar: GrammarSpec | None = Field(
        None, description="Constrain the output to a grammar (JSON schema, regex, choice, Lark)."
    )
    reasoning: ReasoningSpec | None = Field(
        None, description="With a grammar: the reasoning it lets through before constraining the rest."
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(stop == "" for stop in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {token} ({bias}) is outside [-100, 100]")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _positive_unless_scoring(cls, value: int, info) -> int:  # type: ignore[no-untyped-def]
        if value == 0 and info.data.get("prompt_logprobs") is None:
            raise ValueError("max_tokens must be at least 1 (0 only with prompt_logprobs)")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_le_max_tokens(cls, value: int, info) -> int:  # type: ignore[no-untyped-def]
        return at_most("min_tokens", value, "max_tokens", info.data.get("max_tokens", DEFAULT_MAX_TOKENS))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class SpecConfig(_Config):
    """How a request speculates: where drafts come from and how many to verify per step."""

    mode: SpeculationMode = Field(
        "auto",
        description="off: plain decoding; on: always draft up to num_draft_tokens; auto: the policy decides "
        "(single-sequence generate uses the batch-1 row of the cold-start table, i.e. 'on').",
    )
    num_draft_tokens: int = Field(DEFAULT_NUM_DRAFT_TOKENS, ge=0, le=64, description="Draft length gamma.")
    max_ngram: int = Field(DEFAULT_MAX_NGRAM, ge=1, le=16, description="Longest context matched (k).")
    min_ngram: int = Field(DEFAULT_MIN_NGRAM, ge=1, le=16, description="Shortest context matched.")
    local_index: LocalIndexKind = Field(
        "suffix",
        description="Request-local draft source over the prompt and the output: a multi-level or "
        "one-level n-gram index, prompt lookup (latest earlier occurrence), hybrid (both; the "
        "longer match wins), or suffix (the longest earlier match of up to 64 tokens, compiled; "
        "nasd_core.speculation.suffix).",
    )
    lookup_max_ngram: int = Field(
        DEFAULT_LOOKUP_MAX_NGRAM, ge=1, le=64, description="Longest suffix prompt lookup tries to match."
    )
    stop_if_unknown: bool = Field(
        True, description="End a draft at the first context no source knows (else the step drafts less)."
    )
    filler_top_k: int = Field(
        1,
        ge=1,
        le=64,
        description="Also learn the target's top-k tokens at each verified position into the request's "
        "n-gram index (seeds; no effect with local_index suffix or prompt_lookup, which hold no counts).",
    )

    @field_validator("min_ngram")
    @classmethod
    def _min_le_max(cls, value: int, info) -> int:  # type: ignore[no-untyped-def]
        return at_most("min_ngram", value, "max_ngram", info.data.get("max_ngram", DEFAULT_MAX_NGRAM))

    @property
    def is_speculating(self) -> bool:
        return self.mode != "off" and self.num_draft_tokens > 0


class IndexConfig(_Config):
    """Kind and bounds of a replica-level or pool-fed index of finished requests."""

    kind: Literal["ngram", "suffix"] = Field(
        "ngram",
        description="ngram: multi-level n-gram counts (contexts of min_ngram..max_ngram tokens); suffix: "
        "the sequences themselves, matched by suffix up to 64 tokens (compiled; max_entries then counts "
        "stored tokens).",
    )
    max_ngram: int = Field(DEFAULT_MAX_NGRAM, ge=1, le=16, description="Longest context stored.")
    min_ngram: int = Field(DEFAULT_MIN_NGRAM, ge=1, le=16, description="Shortest context stored.")
    max_entries: int = Field(
        DEFAULT_INDEX_MAX_ENTRIES, ge=1, description="Budget of (context, next token) cells; LRU eviction."
    )
    max_successors: int = Field(
        DEFAULT_MAX_SUCCESSORS, ge=1, le=256, description="Distinct next tokens kept per context."
    )


class RunnerConfig(_Config):
    """The model runner's KV-cache, step shapes and kernels (``nasd_core/runner/model_runner.py``)."""

    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="Positions the paged KV-cache holds over all rows (None: 25% of the machine's memory "
        "on a CPU, reserved but resident only once written; on a GPU what gpu_memory_utilization leaves "
        "once the weights, the largest step and the step graphs are counted).",
    )
    block_size: int = Field(DEFAULT_KV_BLOCK_SIZE, ge=1, description="Positions per KV-cache block.")
    max_rows: int = Field(
        DEFAULT_MAX_BATCH_ROWS,
        ge=1,
        description="Most rows per step: what the default KV budget and the step graphs are sized for.",
    )
    max_positions: int = Field(
        1 + DEFAULT_NUM_DRAFT_TOKENS,
        ge=1,
        description="Widest verification per row (1 + the draft cap), what the memory plan sizes for.",
    )
    prefill_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens prefilled per step, over all new requests (running rows keep decoding); "
        "None: 256 on a CPU, 2048 on a GPU, shortened where a GPU's memory plan needs it.",
    )
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        gt=0.0,
        le=1.0,
        description="Share of a GPU's total memory the engine plans for (weights, activations, step graphs, "
        "KV-cache: nasd_core/runner/memory_plan.py), as vLLM's setting of that name; settings that cannot "
        "fit are refused at start.",
    )
    prefill_threads: int | None = Field(
        None,
        ge=1,
        description="Torch threads for CPU steps that prefill 32 prompt tokens or more, as llama.cpp's "
        "--threads-batch; None: the process's for every step (always, with deterministic steps). A lone "
        "server replica on a CPU decodes with a core left to the server's other processes and prefills on "
        "every core.",
    )
    kv_cache_dtype: Literal["auto", "float32", "float16"] = Field(
        "auto",
        description="Element type of the KV-cache. 'auto': float16 where the CPU attention kernel reads it "
        "(the GGUF path, whose decode steps read more KV than weights once rows hold a few hundred "
        "tokens; llama.cpp's default cache type), the model's dtype elsewhere, step graphs and batched "
        "attention included. 'float16' on a float32 model is for CPUs only (the kernel widens each element "
        "exactly as it reads it).",
    )
    batch_attention: bool | None = Field(
        None,
        description="Attend short rows in one padded call per layer (nasd_core/layers/attention.py); "
        "None: off the CPU.",
    )
    step_graphs: bool | None = Field(
        None,
        description="Run decode and verification steps in fixed shapes, replayed from CUDA graphs on a "
        "GPU (nasd_core/runner/step_graphs.py; Llama, Mistral and Qwen2/3 models). None: on wherever "
        "the model is on CUDA and of such a type.",
    )
    graph_attention: Literal["paged", "gathered"] | None = Field(
        None,
        description="How fixed-shape steps attend: 'paged' reads each row's KV blocks through its block "
        "table (FlexAttention), so one graph per rows x positions serves every context length; 'gathered' "
        "copies keys into a padded batch, a graph per context bucket. None: paged where graphs are "
        "captured (a GPU; gathered if its kernels fail to compile or capture), gathered otherwise.",
    )
    compiled_layers: bool | None = Field(
        None,
        description="Merge each decoder layer's q, k, v and gate, up projections and compile the layers with "
        "torch.compile, once for every step shape (nasd_core/layers/compiled_layers.py; Llama, Mistral and "
        "Qwen2/3 models; the model is changed in place); None: on wherever the model is on CUDA and of "
        "such a type.",
    )
    deterministic: bool = Field(
        False,
        description="Batch-invariant steps: a position's logits do not depend on what else its step "
        "computes (the row's drafts, other rows), so greedy output is token-identical with speculation "
        "off, on or auto, whatever the batch. On a CPU: float32 arithmetic (bfloat16 weights widen "
        "exactly, so the model is changed in place to float32 and takes twice the memory), packed oneDNN "
        "Linears and the C++ attention kernel in fixed key units; the packed path only (no step graphs or "
        "compiled layers). On a GPU: Triton kernels with the same property (deterministic_kernels), not "
        "yet run on a GPU.",
    )
    deterministic_kernels: Literal["native", "triton"] | None = Field(
        None,
        description="The deterministic mode's kernels: 'native' (oneDNN and the C++ attention kernel, a "
        "CPU's), 'triton' (nasd_core/layers/invariant_kernels.py; on a CPU only under Triton's interpreter, "
        "TRITON_INTERPRET=1, for tests); None: native on a CPU, triton on a GPU.",
    )


# EngineConfig's keyword arguments that set a field of its runner (``kv_block_size`` its ``block_size``).
FLAT_RUNNER_FIELDS = {"kv_block_size": "block_size"} | {
    name: name
    for name in (
        "kv_cache_tokens",
        "prefill_chunk_tokens",
        "gpu_memory_utilization",
        "prefill_threads",
        "kv_cache_dtype",
        "step_graphs",
        "graph_attention",
        "compiled_layers",
        "deterministic",
        "deterministic_kernels",
    )
}


class EngineConfig(_Config):
    """Limits and behaviour of a continuous-batching engine, and its model runner's settings
    (``runner``; also accepted flat, as ``EngineConfig(kv_cache_tokens=..., kv_block_size=...)``)."""

    max_batch_rows: int = Field(
        DEFAULT_MAX_BATCH_ROWS, ge=1, le=1024, description="Most requests decoding in one forward."
    )
    max_waiting: int = Field(
        256, ge=0, description="Most queued requests; beyond this add_request is refused."
    )
    prefix_cache_tokens: int | None = Field(
        None,
        ge=0,
        description="Positions of finished requests' keys and values kept for later prompts that start "
        "with the same tokens (the next turn of a chat, a shared system prompt), in whole KV blocks; None: "
        "8192 on a CPU (resident memory), the whole pool on a GPU; 0: off.",
    )
    graph_warmup_budget_s: float = Field(
        DEFAULT_GRAPH_WARMUP_BUDGET_S,
        ge=0,
        description="Seconds the engine's start may spend capturing the grid of fixed-shape steps "
        "(rows x draft widths, x context buckets where keys are gathered); shapes left out run packed; 0: "
        "each shape is captured when first met instead.",
    )
    spec: SpecConfig = Field(
        default_factory=lambda: SpecConfig(), description="Default speculation settings."
    )
    # After max_batch_rows and spec, which its validator reads.
    runner: RunnerConfig = Field(
        default_factory=RunnerConfig,
        validate_default=True,
        description="The model runner's settings; its max_rows and max_positions follow max_batch_rows and "
        "spec's draft cap.",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_runner_fields(cls, data: object) -> object:
        # Moved into ``runner``, over what an explicit ``runner`` sets.
        if not isinstance(data, dict) or not FLAT_RUNNER_FIELDS.keys() & data.keys():
            return data
        data = dict(data)
        runner = data.get("runner", {})
        runner = runner.model_dump(exclude_unset=True) if isinstance(runner, RunnerConfig) else dict(runner)
        for name, field in FLAT_RUNNER_FIELDS.items():
            if name in data:
                runner[field] = data.pop(name)
        data["runner"] = runner
        return data

    @field_validator("runner")
    @classmethod
    def _runner_sized_for_the_engine(cls, runner: RunnerConfig, info) -> RunnerConfig:  # type: ignore[no-untyped-def]
        at_most("kv_block_size", runner.block_size, "the engine's largest", MAX_KV_BLOCK_SIZE)
        spec = info.data.get("spec")
        sizes = {
            "max_rows": info.data.get("max_batch_rows", runner.max_rows),
            "max_positions": runner.max_positions if spec is None else 1 + spec.num_draft_tokens,
        }
        return runner.model_copy(update=sizes)


class ModelConfig(_Config):
    """Which model to load and how."""

    name: str | None = Field(
        None, description="HF model id, local dir or GGUF file (*.gguf); None = the embedded SmolLM2-135M."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "gguf"] = Field(
        "auto",
        description="Weights dtype; 'auto' is what the server loads: 'gguf' for a GGUF file on a CPU, else "
        "float32. 'gguf' keeps a GGUF file's blocks (the embedded model's or a *.gguf "
        "name's) on a CPU where a kernel multiplies them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, "
        "Q6_K; other types are float32, and files of other architectures than llama, Qwen2 and Qwen3 "
        "load as float32; nasd_core/loader/gguf.py).",
    )
    device: str = Field("cpu", description="torch device string.")
    cache_dir: str | None = Field(None, description="Where converted GGUF files' weights are cached.")
    cpu_fast_path: bool = Field(
        True,
        description="On CPU in float32: pack Linear weights for oneDNN and share key/value heads in "
        "attention instead of copying them (nasd_core/layers/cpu_kernels.py); outputs equal up to float "
        "rounding.",
    )
    cpu_dense_max_rows: int | None = Field(
        None,
        ge=0,
        description="With the CPU fast path: inputs of at most this many rows keep MKL's multiply where "
        "it beats the packed kernel (some CPUs, at 1-2 rows). None = measured at load; 0 = packed for "
        "every input, which makes a row's logits bit-identical whatever rides with it.",
    )
    int8_activations: bool = Field(
        DEFAULT_INT8_ACTIVATIONS,
        description="With dtype 'gguf': round each input row of the blocks' multiplies to int8 per block "
        "of 32 and multiply with integer dot products, as llama.cpp does (faster and still batch-invariant, "
        "but llama.cpp's arithmetic rather than the dequantized float32 model's); False: multiply the "
        "float32 rows (nasd_core/layers/quantized.py).",
    )
    fused_layers: bool = Field(
        DEFAULT_FUSED_LAYERS,
        description="With dtype 'gguf': run a decode or verification step's decoder layers in one C++ call "
        "where the layers allow it (nasd_core/layers/lean_decoder.py); False: a Python loop over them, "
        "the same bits (the fused loop's reference).",
    )
