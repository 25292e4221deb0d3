"""``build_app(args) -> Application``: the NASD replicas behind the OpenAI ingress.

``serve run deployments:build_app model=... redis_url=... num_replicas=2`` passes its
``key=value`` arguments here as strings; ``AppArgs`` coerces them. ``args_from_env()`` reads
the same settings from ``NASD_*`` environment variables for ``serve run deployments.app``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.auth import AuthSettings, KeyLimits
from deployments.ingress import OpenAIIngress
from deployments.reasoning import ReasoningParser
from deployments.replica import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S, NASDReplica, ReplicaConfig
from deployments.response_store import (
    DEFAULT_RESPONSE_STORE_MAX_ITEMS,
    DEFAULT_RESPONSE_TTL_S,
    ResponseStoreSettings,
)
from deployments.router import ROUTER_CLASS
from deployments.shutdown import DEFAULT_DRAIN_TIMEOUT_S, drain_on_sigterm, is_serve_run
from deployments.tools import ToolCallParser
from nasd_core.config import (
    EMBEDDED_MODEL,
    EMBEDDED_MODEL_ALIASES,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SpecConfig,
    field_of,
)
from nasd_core.loader import default_dtype
from pool_service import PoolConfig
from pool_service.config import pool_index

logger = logging.getLogger(__name__)

DEFAULT_NUM_REPLICAS = 1
# Serve gives every replica one CPU unless told otherwise; a replica's torch threads follow it.
# CPUs (and torch threads) of each replica when several share a machine, or beside a GPU.
DEFAULT_NUM_CPUS_PER_REPLICA = 1.0
# A lone CPU replica leaves this many of the cores to Ray's own processes (raylet, GCS, the
# HTTP proxy, the ingress): on 2 cores (issue 25) the server did 18 tok/s with 1 torch thread and 16.7
# with 2, the model's threads then fighting Ray's for the cores.
RAY_RESERVED_CPUS = 1
# The ingress only awaits replicas, so the replicas' queues bound concurrency, not the ingress
# (Serve's default of 5 ongoing requests per ingress replica would serialise the service).
DEFAULT_INGRESS_MAX_ONGOING_REQUESTS = 10_000
REPLICA_DEPLOYMENT = "NASDReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"

# Off by default: a probe taken while other replicas load, or extrapolated past the rows it
# timed, steered auto wrong (docs/results.md); auto learns step times as it runs instead.
DEFAULT_PROBE_MAX_ROWS = 0
# Fields whose environment variable is not NASD_ and the field's name in capitals (``ENV_VARS``).
SHORT_ENV_VARS = {"num_cpus_per_replica": "NASD_NUM_CPUS", "num_gpus_per_replica": "NASD_NUM_GPUS"}


class AppArgs(BaseModel):
    """Arguments of the application (a typo is an error, not a silently ignored setting). The
    engine's own settings take their bounds, default and description from its configs
    (``field_of``), mapped onto them once in ``replica_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None,
        description="HF model id, local dir or GGUF file (*.gguf, its own blocks on a CPU); "
        "None = the embedded SmolLM2-135M.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients send as `model` (default: the model argument, or the embedded name)."
    )
    dtype: str | None = Field(
        None,
        description="Weights dtype: float32, bfloat16, float16, or gguf (the embedded model's own 4-bit "
        "blocks, on a CPU). None: gguf for the embedded model on a CPU, else float32.",
    )
    device: str | None = Field(None, description="torch device (default: cuda with GPUs, else cpu).")
    redis_url: str | None = Field(
        None, description="redis:// or rediss:// URL of the shared pool; None = in-memory."
    )
    pool_namespace: str | None = Field(
        None, description="Prefix of the pool namespace, to separate deployments sharing one Redis."
    )
    tool_call_parser: ToolCallParser = Field(
        "auto",
        description="How the model writes tool calls (vLLM's --tool-call-parser): hermes (Hermes, Qwen) or "
        "llama3_json (Llama 3.x); auto reads it from the chat template, else hermes.",
    )
    reasoning_parser: ReasoningParser = Field(
        "auto",
        description="How the model marks its reasoning (vLLM's --reasoning-parser), returned as "
        "`reasoning` apart from the answer: qwen3, deepseek_r1 or none; auto: qwen3 for a chat "
        "template that writes </think>, else none.",
    )
    tenant_isolation: bool | None = Field(
        None,
        description="Each tenant drafts only from its own pool namespace and reuses only its own cached "
        "prefixes. The tenant is the API key's (api_key / api_keys_file); without keys, the request's "
        "`user` field, which any caller may write. None: on with keys (false with keys then opts out, "
        "with a warning: tenants could read each other's texts off cached_tokens and drafts), off without.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="One API key (tenant 'default'): every route but /health then needs "
        "'Authorization: Bearer <key>'. Prefer NASD_API_KEY or a key file to a command line.",
    )
    api_keys_file: str | None = Field(
        None,
        description="A file of '<key> <tenant> [max_in_flight=N] [tokens_per_minute=N] [admin]' lines, "
        "re-read when it changes (in k8s, mounted from a Secret).",
    )
    key_max_in_flight: int | None = Field(
        None, ge=1, description="Generation requests in flight per key (429 beyond); None: unlimited."
    )
    key_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt + completion tokens per key over the last minute (429 beyond); None: unlimited.",
    )
    pool_partitions: int = Field(
        0,
        ge=0,
        description="Pool partitions per tenant; 0 = none (every replica tails the whole pool); N >= 1: "
        "requests are routed by tenant and partition and a replica tails only the partitions it serves "
        "(docs/api.md: what to set).",
    )
    num_replicas: int = Field(DEFAULT_NUM_REPLICAS, ge=1, description="Replicas (ignored with autoscaling).")
    num_cpus_per_replica: float | None = Field(
        None,
        ge=0,
        description="CPUs reserved per replica; also its torch thread count. Default: a single CPU replica "
        "takes every core this machine gives the process but one (left to Ray's own processes); "
        "otherwise 1.",
    )
    num_gpus_per_replica: float = Field(0.0, ge=0, description="GPUs per replica (0 = CPU only).")
    speculation: Literal["auto", "on", "off"] = field_of(
        SpecConfig,
        "mode",
        "Requests' speculation unless they set their own: off (plain decoding), on (always draft up to "
        "num_draft_tokens) or auto (the policy decides each step, row by row).",
    )
    num_draft_tokens: int = field_of(SpecConfig, "num_draft_tokens")
    drafter: Literal["suffix", "ngram"] = Field(
        "suffix",
        description="Draft sources: suffix (the request's own tokens and the replica and pool indexes "
        "matched by suffix, up to 64 tokens, in the compiled store) or ngram (prompt lookup with an n-gram "
        "index of the request, n-gram replica and pool indexes of contexts up to 3 tokens).",
    )
    max_batch_rows: int = field_of(EngineConfig, "max_batch_rows")
    max_waiting: int = field_of(EngineConfig, "max_waiting")
    probe_max_rows: int = Field(
        DEFAULT_PROBE_MAX_ROWS,
        ge=0,
        description="At replica start, time verification steps of 1, 2, 4, ... up to this many rows (8 rows: "
        "8 s on 2 CPU cores), so `auto` starts calibrated; 0 = no probe: auto starts from TensorRT-LLM's "
        "table and learns step times as it runs.",
    )
    prefix_cache_tokens: int | None = field_of(EngineConfig, "prefix_cache_tokens")
    prefill_threads: int | None = Field(
        None,
        ge=1,
        description="Torch threads of a CPU replica's steps that prefill 32 prompt tokens or more "
        "(RunnerConfig.prefill_threads, llama.cpp's --threads-batch); None: every visible core for a lone "
        "CPU replica on its default CPUs, whose other steps leave one to Ray's processes; else its CPUs.",
    )
    kv_cache_dtype: Literal["auto", "float32", "float16"] = field_of(RunnerConfig, "kv_cache_dtype")
    step_graphs: bool | None = field_of(RunnerConfig, "step_graphs")
    graph_attention: Literal["paged", "gathered"] | None = field_of(RunnerConfig, "graph_attention")
    compiled_layers: bool | None = field_of(RunnerConfig, "compiled_layers")
    deterministic: bool = field_of(RunnerConfig, "deterministic")
    gpu_memory_utilization: float = field_of(RunnerConfig, "gpu_memory_utilization")
    graph_warmup_budget_s: float = field_of(EngineConfig, "graph_warmup_budget_s")
    autoscaling: dict[str, Any] | None = Field(
        None, description="Serve autoscaling_config (min_replicas, max_replicas, ...); replaces num_replicas."
    )
    drain_timeout_s: float = Field(
        DEFAULT_DRAIN_TIMEOUT_S,
        ge=0,
        description="On SIGTERM, seconds `serve run IMPORT_PATH` and nasd-serve give requests in flight "
        "to finish (new ones get 503) before they stop. A Serve config file or RayService builds the app "
        "in Serve's controller, where this does not apply.",
    )

    conversation_affinity: bool | None = Field(
        None,
        description="Send every turn of a conversation (its opening: the messages up to the first user "
        "turn) to the replica that served the earlier ones, whose prefix cache holds them, unless that "
        "replica carries over 1.25x the mean load. None: on with more than one replica.",
    )
    response_store_ttl_s: float = Field(
        DEFAULT_RESPONSE_TTL_S,
        gt=0,
        description="Seconds the Responses API keeps a stored response (store, previous_response_id); "
        "in Redis with redis_url, so every ingress reads it, else in the ingress's memory.",
    )
    response_store_max_items: int = Field(
        DEFAULT_RESPONSE_STORE_MAX_ITEMS,
        ge=1,
        description="Stored responses kept at most; beyond it the oldest go first.",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        # `serve run ... redis_url=` and an empty environment variable mean "not set", and so does
        # None, which meant "the engine's default" before AppArgs took the engine's defaults.
        return cls.model_fields[info.field_name].get_default() if value is None or value == "" else value

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value


# AppArgs field -> the environment variable ``args_from_env`` reads it from.
ENV_VARS = {name: SHORT_ENV_VARS.get(name, f"NASD_{name.upper()}") for name in AppArgs.model_fields}


def lone_cpu_replica(args: AppArgs, device: str) -> bool:
    """Whether the application is one CPU replica with the machine to itself (a laptop's `make serve`)."""
    return not (device != "cpu" or args.num_gpus_per_replica > 0 or args.autoscaling or args.num_replicas > 1)


def default_cpus_per_replica(args: AppArgs, device: str) -> float:
    """``num_cpus_per_replica`` when unset: all visible cores but ``RAY_RESERVED_CPUS`` for one
    CPU replica alone (before, it ran one torch thread on any machine), ``DEFAULT_NUM_CPUS_PER_REPLICA``
    when replicas share the machine or a GPU does the work."""
    if not lone_cpu_replica(args, device):
        return DEFAULT_NUM_CPUS_PER_REPLICA
    return float(max(1, visible_cpus() - RAY_RESERVED_CPUS))


def default_prefill_threads(args: AppArgs, device: str) -> int | None:
    """``RunnerConfig.prefill_threads`` when unset: every visible core for a lone CPU replica on
    its default CPUs (its prompt chunks take the core its other steps leave to Ray's processes),
    None otherwise and for deterministic steps (one thread count for every step)."""
    if args.prefill_threads is not None:
        return args.prefill_threads
    if args.num_cpus_per_replica is not None or args.deterministic or not lone_cpu_replica(args, device):
        return None
    return visible_cpus()


def visible_cpus() -> int:
    """The CPUs of the Ray cluster this process is connected to, else the cores it may run on
    (its affinity mask: what the local Ray that `serve run` starts will count)."""
    if ray.is_initialized():
        return int(ray.cluster_resources().get("CPU", 1))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tenant_isolation(args: AppArgs) -> bool:
    """Whether tenants are isolated: as set, else exactly when API keys are on. Keys with isolation
    turned off is an operator's explicit choice, and it is logged: a response's cached_tokens and
    drafts then tell one tenant what another sent."""
    keys = args.api_key is not None or args.api_keys_file is not None
    if args.tenant_isolation is None:
        return keys
    if keys and not args.tenant_isolation:
        logger.warning(
            "tenant_isolation is off with API keys: tenants share the prefix cache and the draft pool, "
            "so one tenant can tell from cached_tokens and drafts whether another sent a text"
        )
    return args.tenant_isolation


def args_from_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The application arguments set through ``NASD_*`` environment variables."""
    environ = os.environ if environ is None else environ
    return {field: environ[name] for field, name in ENV_VARS.items() if environ.get(name)}


def replica_config(args: AppArgs) -> ReplicaConfig:
    """What each replica of the application of ``args`` is built from: its model, engine, pool
    and threads (``build_app``'s replicas; ``benchmarks.lockstep`` builds engines from it too).

    Raises:
        ValueError: ``dtype=gguf`` for a model that is not a GGUF file, or off a CPU.
    """
    device = args.device or ("cuda" if args.num_gpus_per_replica > 0 else "cpu")
    if args.dtype == "gguf" and default_dtype(args.model, device) != "gguf":
        raise ValueError(
            "dtype gguf serves a GGUF file's own blocks (the embedded model or a *.gguf path) on a CPU only"
        )
    dtype = args.dtype or default_dtype(args.model, device)
    if args.kv_cache_dtype not in ("auto", dtype) and (device != "cpu" or dtype not in ("float32", "gguf")):
        raise ValueError(f"kv_cache_dtype {args.kv_cache_dtype} needs a float32 or gguf model on a CPU")
    engine = EngineConfig(
        max_batch_rows=args.max_batch_rows,
        max_waiting=args.max_waiting,
        graph_warmup_budget_s=args.graph_warmup_budget_s,
        prefix_cache_tokens=args.prefix_cache_tokens,
        runner=RunnerConfig(
            step_graphs=args.step_graphs,
            graph_attention=args.graph_attention,
            compiled_layers=args.compiled_layers,
            deterministic=args.deterministic,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
            prefill_threads=default_prefill_threads(args, device),
        ),
        spec=SpecConfig(
            mode=args.speculation,
            num_draft_tokens=args.num_draft_tokens,
            local_index="suffix" if args.drafter == "suffix" else "hybrid",
        ),
    )
    return ReplicaConfig(
        model=ModelConfig(name=args.model, dtype=dtype, device=device),
        served_model_name=args.served_model_name or args.model or EMBEDDED_MODEL,
        num_threads=max(1, int(replica_cpus(args, device))) if device == "cpu" else None,
        engine=engine,
        pool=PoolConfig(
            redis_url=args.redis_url,
            tenant_isolation=tenant_isolation(args),
            partitions=args.pool_partitions,
            index=pool_index(args.drafter),
        ),
        pool_namespace=args.pool_namespace,
        probe_max_rows=args.probe_max_rows,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def replica_cpus(args: AppArgs, device: str) -> float:
    """The CPUs Ray gives each replica: ``num_cpus_per_replica``, else its default."""
    if args.num_cpus_per_replica is not None:
        return args.num_cpus_per_replica
    return default_cpus_per_replica(args, device)


def build_app(args: dict[str, Any] | AppArgs) -> Application:
    """Bind the OpenAI ingress to the NASD replica deployment.

    Args:
        args: ``AppArgs`` or a dict of its fields (strings are coerced).

    Returns:
        The application for ``serve.run`` or ``serve run``.

    Raises:
        pydantic.ValidationError: an unknown argument or an invalid value.
        ValueError: ``dtype=gguf`` for a model that is not a GGUF file, or off a CPU.
    """
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    if is_serve_run():  # nasd-serve sets its own; elsewhere (tests, Serve's controller) none
        drain_on_sigterm(args.drain_timeout_s)
    config = replica_config(args)
    engine, served_model_name = config.engine, config.served_model_name
    actor_options: dict[str, Any] = {"num_cpus": replica_cpus(args, config.model.device)}
    if args.num_gpus_per_replica > 0:
        actor_options["num_gpus"] = args.num_gpus_per_replica
    scaling = (
        {"autoscaling_config": args.autoscaling} if args.autoscaling else {"num_replicas": args.num_replicas}
    )
    # Partitions pay only if a partition's requests meet on the replicas that follow it, and a
    # conversation's later turns only if they meet its earlier ones' prefix cache.
    affinity = conversation_affinity(args)
    routing = (
        {"request_router_config": RequestRouterConfig(request_router_class=ROUTER_CLASS)}
        if args.pool_partitions or affinity
        else {}
    )
    replica = (
        serve.deployment(NASDReplica)
        .options(
            name=REPLICA_DEPLOYMENT,
            # Everything the engine can hold (running + queued); beyond it Serve queues the call.
            max_ongoing_requests=engine.max_batch_rows + engine.max_waiting,
            ray_actor_options=actor_options,
            graceful_shutdown_timeout_s=DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
            **scaling,
            **routing,
        )
        .bind(config)
    )
    return (
        serve.deployment(OpenAIIngress)
        .options(
            name=INGRESS_DEPLOYMENT,
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=DEFAULT_INGRESS_MAX_ONGOING_REQUESTS,
        )
        .bind(
            replica,
            served_model_name,
            EMBEDDED_MODEL_ALIASES if served_model_name == EMBEDDED_MODEL else (),
            args.pool_partitions,
            AuthSettings(
                api_key=args.api_key.get_secret_value() if args.api_key is not None else None,
                keys_file=args.api_keys_file,
                limits=KeyLimits(args.key_max_in_flight, args.key_tokens_per_minute),
            ),
            ResponseStoreSettings(
                pool=config.pool,
                namespace=args.pool_namespace or served_model_name,
                ttl_s=args.response_store_ttl_s,
                max_items=args.response_store_max_items,
            ),
            affinity,
        )
    )


def conversation_affinity(args: AppArgs) -> bool:
    """Whether requests are routed by conversation: as set, else with more than one replica."""
    if args.conversation_affinity is not None:
        return args.conversation_affinity
    return args.num_replicas > 1 or args.autoscaling is not None
