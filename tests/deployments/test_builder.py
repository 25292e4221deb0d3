"""build_app and its arguments: what `serve run deployments:build_app k=v ...`, a Serve config
file and the NASD_* environment variables turn into. Binding the graph loads no model."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest
from ray.serve import Application

from deployments import builder
from deployments.builder import (
    ENV_VARS,
    INGRESS_DEPLOYMENT,
    REPLICA_DEPLOYMENT,
    args_from_env,
    build_app,
)
from deployments.replica import ReplicaConfig
from deployments.router import ROUTER_CLASS
from nasd_core.config import EMBEDDED_MODEL


def replica_of(app: Application) -> tuple[object, ReplicaConfig]:
    """The replica deployment bound under the ingress, and the ReplicaConfig it gets."""
    ingress = app._bound_deployment
    assert ingress.name == INGRESS_DEPLOYMENT
    replica = ingress.init_args[0]._bound_deployment
    assert replica.name == REPLICA_DEPLOYMENT
    return replica, replica.init_args[0]


def test_defaults_serve_the_embedded_model_on_cpu_with_an_in_memory_pool(monkeypatch):
    monkeypatch.setattr(builder, "visible_cpus", lambda: 2)
    replica, config = replica_of(build_app({}))
    assert config.model.name is None and config.model.device == "cpu"
    assert config.served_model_name == EMBEDDED_MODEL
    assert config.pool.redis_url is None
    assert config.model.dtype == "gguf"  # the embedded model's own blocks on a CPU
    assert config.num_threads == 1
    assert replica.num_replicas == 1
    assert "num_gpus" not in replica.ray_actor_options
    # Serve routes at most what the engine can hold (running rows + queue) to a replica.
    assert replica.max_ongoing_requests == config.engine.max_batch_rows + config.engine.max_waiting


def test_a_lone_cpu_replica_takes_all_cores_but_one_for_ray_and_all_to_prefill(monkeypatch):
    monkeypatch.setattr(builder, "visible_cpus", lambda: 8)
    replica, config = replica_of(build_app({}))
    assert config.num_threads == 7 and replica.ray_actor_options == {"num_cpus": 7.0}
    assert config.engine.runner.prefill_threads == 8
    # Replicas sharing the machine, or a GPU doing the work: one CPU each unless set.
    for args in [{"num_replicas": 2}, {"autoscaling": {"max_replicas": 3}}, {"num_gpus_per_replica": 1}]:
        replica, config = replica_of(build_app(args))
        assert replica.ray_actor_options["num_cpus"] == 1.0, args
        assert config.engine.runner.prefill_threads is None, args
    replica, config = replica_of(build_app({"num_cpus_per_replica": 3}))
    assert config.num_threads == 3 and replica.ray_actor_options == {"num_cpus": 3.0}
    assert config.engine.runner.prefill_threads is None  # threads set by hand are every step's
    assert replica_of(build_app({"prefill_threads": "4"}))[1].engine.runner.prefill_threads == 4
    assert replica_of(build_app({"deterministic": "true"}))[1].engine.runner.prefill_threads is None
    monkeypatch.setattr(builder, "visible_cpus", lambda: 1)
    assert replica_of(build_app({}))[1].num_threads == 1


def test_string_arguments_from_the_cli_are_coerced():
    args = {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "dtype": "bfloat16",
        "redis_url": "redis://nasd-redis:6379",
        "num_replicas": "3",
        "num_gpus_per_replica": "1",
        "num_cpus_per_replica": "4",
        "speculation": "off",
        "num_draft_tokens": "5",
        "max_batch_rows": "8",
        "max_waiting": "16",
        "tenant_isolation": "true",
        "pool_namespace": "",
        "graph_warmup_budget_s": "",
        "step_graphs": "true",
        "prefix_cache_tokens": "0",
    }
    replica, config = replica_of(build_app(args))
    assert config.model.device == "cuda" and config.model.dtype == "bfloat16"
    assert config.num_threads is None  # torch's own choice on a GPU replica
    assert config.served_model_name == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.pool.redis_url == "redis://nasd-redis:6379" and config.pool.tenant_isolation
    assert config.pool_namespace is None  # empty means unset
    assert config.engine.graph_warmup_budget_s == builder.AppArgs().graph_warmup_budget_s
    assert builder.AppArgs(max_batch_rows=None, max_waiting=None) == builder.AppArgs()
    assert (config.engine.spec.mode, config.engine.spec.num_draft_tokens) == ("off", 5)
    assert (config.engine.max_batch_rows, config.engine.max_waiting) == (8, 16)
    assert config.engine.runner.step_graphs and config.engine.prefix_cache_tokens == 0
    assert replica.num_replicas == 3
    assert replica.ray_actor_options == {"num_cpus": 4.0, "num_gpus": 1.0}
    assert replica.max_ongoing_requests == 24


def test_a_float16_kv_cache_is_for_float32_or_gguf_models_on_a_cpu():
    assert replica_of(build_app({}))[1].engine.runner.kv_cache_dtype == "auto"
    assert replica_of(build_app({"kv_cache_dtype": "float32"}))[1].engine.runner.kv_cache_dtype == "float32"
    config = replica_of(build_app({"dtype": "float32", "kv_cache_dtype": "float16"}))[1]
    assert config.engine.runner.kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype float16"):
        build_app({"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": "float16"})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_app({"kv_cache_dtype": "int8"})


def test_dtype_defaults_to_the_gguf_blocks_for_gguf_files_on_a_cpu_only():
    assert replica_of(build_app({"dtype": "float32"}))[1].model.dtype == "float32"
    assert replica_of(build_app({"device": "cuda"}))[1].model.dtype == "float32"
    assert replica_of(build_app({"model": "Qwen/Qwen2.5-1.5B-Instruct"}))[1].model.dtype == "float32"
    assert replica_of(build_app({"model": "/models/llama-3.2-1b.Q4_0.gguf"}))[1].model.dtype == "gguf"
    for args in [{"model": "Qwen/Qwen2.5-1.5B-Instruct"}, {"device": "cuda:0"}]:
        with pytest.raises(ValueError, match="gguf"):
            build_app({**args, "dtype": "gguf"})


def test_drafter_chooses_the_request_and_pool_draft_sources():
    _, config = replica_of(build_app({}))
    assert config.engine.spec.local_index == "suffix" and config.pool.index.kind == "suffix"
    _, config = replica_of(build_app({"drafter": "ngram"}))
    assert config.engine.spec.local_index == "hybrid" and config.pool.index.kind == "ngram"
    with pytest.raises(pydantic.ValidationError):
        build_app({"drafter": "tree"})


def test_autoscaling_json_replaces_the_fixed_replica_count():
    replica, _ = replica_of(build_app({"autoscaling": '{"min_replicas": 1, "max_replicas": 4}'}))
    autoscaling = replica._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)


def test_pool_partitions_route_requests_by_partition():
    replica, config = replica_of(build_app({}))
    assert config.pool.partitions == 0
    assert replica._deployment_config.request_router_config.request_router_class != ROUTER_CLASS
    for partitions in (1, 8):  # 1: a partition per tenant, routed by tenant
        app = build_app({"pool_partitions": str(partitions), "num_replicas": "4"})
        replica, config = replica_of(app)
        assert config.pool.partitions == partitions
        assert replica._deployment_config.request_router_config.request_router_class == ROUTER_CLASS
        assert app._bound_deployment.init_args[3] == partitions  # the ingress sends each request's key


@pytest.mark.parametrize(
    ("args", "affinity"),
    [
        ({}, False),  # one replica: nowhere else to go
        ({"num_replicas": "2"}, True),
        ({"autoscaling": '{"min_replicas": 1, "max_replicas": 4}'}, True),
        ({"num_replicas": "4", "conversation_affinity": "false"}, False),
        ({"conversation_affinity": "true"}, True),
    ],
)
def test_several_replicas_route_by_conversation_unless_told_not_to(args, affinity):
    app = build_app(args)
    replica, _ = replica_of(app)
    router = replica._deployment_config.request_router_config.request_router_class
    assert (router == ROUTER_CLASS) == affinity
    assert app._bound_deployment.init_args[6] is affinity  # the ingress sends each request's key


@pytest.mark.parametrize(
    "args",
    [
        {"num_replica": "2"},
        {"pool_partitions": "-1"},  # a typo is an error, not an ignored setting
        {"num_replicas": "0"},
        {"num_replicas": "two"},
        {"speculation": "sometimes"},
        {"num_draft_tokens": "-1"},
        {"num_gpus_per_replica": "-1"},
        {"autoscaling": "{not json"},
    ],
)
def test_bad_arguments_are_validation_errors(args):
    with pytest.raises((pydantic.ValidationError, ValueError)):
        build_app(args)


def readme_settings() -> dict[str, str]:
    """The README's settings table: each argument and the environment variable it names."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    named = {}
    for line in readme.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `") or len(cells) < 3 or "`NASD_" not in cells[1]:
            continue
        fields, variables = (re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cell)) for cell in cells[:2])
        named.update(zip(fields, variables, strict=True))
    return named


def test_environment_variables_name_every_argument_as_the_readme_says():
    assert readme_settings() == ENV_VARS, "the README's settings table and AppArgs disagree"
    environ = {
        "NASD_MODEL": "HuggingFaceTB/SmolLM2-360M",
        "NASD_NUM_REPLICAS": "2",
        "NASD_REDIS_URL": "",
        "HOME": "/x",
    }
    assert args_from_env(environ) == {"model": "HuggingFaceTB/SmolLM2-360M", "num_replicas": "2"}
    _, config = replica_of(build_app(args_from_env(environ)))
    assert config.model.name == "HuggingFaceTB/SmolLM2-360M"
