"""Shared pool benchmark: a replica warmed only through Redis vs a cold, local-only replica.

Two replicas (each an engine on its own thread with its own pool worker) share one
redis-server that this benchmark starts, so every Redis command is counted. Replica A serves
phase 1; replica B then serves phase 2 twice, in the same run on the same prompts: once
cold (its requests see only their own tokens) and once warm (they also see what the pool
brought from A). Then the sync protocol alone runs at higher generation rates than this CPU
reaches (``sync_load``: replicas finishing synthetic sequences, no model). Workloads, one
line each:

* repeat_question  - other users ask the same questions A answered (popular question, retry).
* paraphrase       - other users ask A's questions in other words (answers overlap, not equal).
* multi_turn       - turn 1 of each chat ran on A; turn 2 ("repeat it with a change") runs on B.
* unrelated        - A writes stories, B summarises reports: the control, the pool cannot help.

    python -m benchmarks.pool            # 8 conversations per workload, 96 new tokens
    python -m benchmarks.pool --quick    # 3 conversations, 48 new tokens
"""

from __future__ import annotations

import asyncio
import random
import time

from tqdm import tqdm

from benchmarks.common import grouped_bars, new_figure, publish_run, result_name, run_metadata, suite_parser
from benchmarks.workloads import Messages, make_workload, paraphrase
from nasd_core.config import EngineConfig, ModelConfig, SamplingParams
from nasd_core.engine.async_engine import AsyncEngine
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.metrics import SpecStats
from nasd_core.speculation.calibration import Calibration, calibrate
from pool_service import PoolConfig, SharedPools, namespace_for
from pool_service.local_redis import LocalRedis

CONCURRENCY = 4
# Sync load: new tokens per finished sequence, and generation rates per replica (this CPU
# makes 30-90 tokens/s; a GPU replica batching many requests makes thousands).
LOAD_OUTPUT_TOKENS = 128
LOAD_RATES = (50, 500, 5000)


def _questions(num: int) -> list[Messages]:
    """Questions whose answers are free text (not copied from the prompt)."""
    packing = [conv[:1] for conv in make_workload("multi_turn", num, seed=7)]
    stories = make_workload("creative", num, seed=7)
    summaries = make_workload("summarisation", num, seed=7)
    mixed = [conv for triple in zip(packing, stories, summaries) for conv in triple]
    return mixed[:num]


class Replica:
    """An engine thread plus its pool view, as a Serve replica holds them."""

    def __init__(
        self,
        model,
        tokenizer,
        pool_config: PoolConfig,
        namespace: str,
        origin: str,
        calibration: Calibration,
    ) -> None:
        self.tokenizer = tokenizer
        config = EngineConfig(max_batch_rows=CONCURRENCY)
        self.engine = AsyncEngine(Engine(model, tokenizer, config, calibration=calibration))
        self.pools = SharedPools(
            pool_config,
            namespace,
            apply=lambda fn: self.engine.call(lambda engine: fn()),
            origin=origin,
            vocab_size=model.config.vocab_size,
        )

    async def start(self) -> None:
        self.engine.start()
        await self.pools.start()

    async def stop(self) -> None:
        await self.pools.stop()
        self.engine.shutdown()

    async def serve(self, conversations: list[Messages], max_tokens: int, use_pool: bool) -> dict:
        """Serve the conversations together (batched); publish each when it finishes."""
        stats = SpecStats()
        outputs: list[list[int]] = []

        async def one(conversation: Messages) -> list[int]:
            prompt_ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            output: list[int] = []
            shared = self.pools.sources_for(None) if use_pool else []
            async for chunk in self.engine.generate(
                prompt_ids, SamplingParams(max_tokens=max_tokens), shared=shared
            ):
                output += chunk.token_ids
                if chunk.stats is not None:
                    stats.merge(chunk.stats)
            if use_pool:  # a local-only replica neither reads nor writes the pool
                self.pools.publish(None, prompt_ids + output)
            return output

        started = time.perf_counter()
        outputs = await asyncio.gather(*(one(conversation) for conversation in conversations))
        elapsed = time.perf_counter() - started
        num_tokens = sum(len(output) for output in outputs)
        return {
            "tokens": num_tokens,
            "seconds": round(elapsed, 3),
            "tokens_per_s": round(num_tokens / elapsed, 2),
            "tokens_per_step": round(stats.tokens_per_step, 3),
            "drafted_by_source": stats.drafted_by_source,
            "accepted_by_source": stats.accepted_by_source,
            "outputs": outputs,
        }


def workloads(num: int) -> dict[str, tuple[list[Messages], list[Messages] | None]]:
    """Phase-1 conversations for A and phase-2 ones for B (None: built from A's answers)."""
    questions = _questions(num)
    return {
        "repeat_question": (questions, questions),
        "paraphrase": (questions, [paraphrase(conv) for conv in questions]),
        "multi_turn": ([conv[:1] for conv in make_workload("multi_turn", num, seed=11)], None),
        "unrelated": (make_workload("creative", num, seed=21), make_workload("summarisation", num, seed=22)),
    }


def _second_turns(first_turns: list[Messages], answers: list[str]) -> list[Messages]:
    follow_up = "Repeat the same answer, but add one more item or sentence at the end."
    return [
        [*conv, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
        for conv, answer in zip(first_turns, answers)
    ]


async def run_workload(
    model, tokenizer, redis: LocalRedis, name: str, phases, max_tokens: int, calibration: Calibration
) -> dict:
    namespace = f"{namespace_for('bench', tokenizer)}-{name}-{time.time_ns()}"
    config = PoolConfig(redis_url=redis.url)
    replica_a = Replica(model, tokenizer, config, namespace, "A", calibration)
    replica_b = Replica(model, tokenizer, config, namespace, "B", calibration)
    await replica_a.start()
    await replica_b.start()
    commands_before = redis.commands_processed()
    first, second = phases
    served_a = await replica_a.serve(first, max_tokens, use_pool=True)
    if second is None:
        answers = [tokenizer.decode(output, skip_special_tokens=True) for output in served_a["outputs"]]
        second = _second_turns(first, answers)
    # B must have learned all of A's sequences before phase 2 (normally well under a second).
    b_sync = replica_b.pools.stats()["namespaces"][0]
    deadline = time.monotonic() + 10
    while b_sync["received"] < len(first) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        b_sync = replica_b.pools.stats()["namespaces"][0]
    cold = await replica_b.serve(second, max_tokens, use_pool=False)
    warm = await replica_b.serve(second, max_tokens, use_pool=True)
    await replica_a.stop()
    await replica_b.stop()
    # The first INFO call of our own is in the count.
    num_commands = redis.commands_processed() - commands_before - 1
    num_round_trips = sum(round_trips(replica.pools) for replica in (replica_a, replica_b))
    num_tokens = served_a["tokens"] + cold["tokens"] + warm["tokens"]
    identical = warm.pop("outputs") == cold.pop("outputs")
    served_a.pop("outputs")
    return {
        "replica_a": served_a,
        "cold": cold,
        "warm": warm,
        "identical_outputs": identical,
        "tokens_per_step_ratio": round(warm["tokens_per_step"] / cold["tokens_per_step"], 3),
        "tokens_per_s_ratio": round(warm["tokens_per_s"] / cold["tokens_per_s"], 3),
        "redis_commands": num_commands,
        "redis_commands_per_token": round(num_commands / num_tokens, 5),
        "redis_round_trips": num_round_trips,
        "redis_round_trips_per_token": round(num_round_trips / num_tokens, 5),
        "sync_lag_ms_p50": b_sync["lag_ms_p50"],
        "sync_lag_ms_p99": b_sync["lag_ms_p99"],
        "sequences_received_by_b": b_sync["received"],
    }


def round_trips(pools: SharedPools) -> int:
    """Calls a replica's pool worker made to Redis (connect, publish scripts, reads). Redis's own
    command count is higher: it also counts the calls a publish script makes inside Redis."""
    return sum(namespace["store_calls"] for namespace in pools.stats()["namespaces"])


async def sync_load(
    redis: LocalRedis, vocab_size: int, tokens_per_s: float, seconds: float, num_replicas: int = 2
) -> dict:
    """The sync protocol alone at a given generation rate: ``num_replicas`` replicas (real
    ``SharedPools`` on the real Redis, no model) each finish sequences of
    ``LOAD_OUTPUT_TOKENS`` new tokens (published with a prompt of as many) at Poisson times
    adding up to ``tokens_per_s`` per replica. Measures Redis commands per generated token and
    sync lag at rates this CPU cannot generate, such as a GPU replica's."""
    namespace = f"bench-load-{time.time_ns()}"
    config = PoolConfig(redis_url=redis.url)
    replicas = [
        SharedPools(config, namespace, origin=f"R{index}", vocab_size=vocab_size)
        for index in range(num_replicas)
    ]
    for replica in replicas:
        await replica.start()
    rng = random.Random(int(tokens_per_s))
    commands_before = redis.commands_processed()
    num_sequences = 0

    async def finish_sequences(replica: SharedPools) -> None:
        nonlocal num_sequences
        deadline = time.monotonic() + seconds
        while (wait := rng.expovariate(tokens_per_s / LOAD_OUTPUT_TOKENS)) < deadline - time.monotonic():
            await asyncio.sleep(wait)
            replica.publish(None, [rng.randrange(vocab_size) for _ in range(2 * LOAD_OUTPUT_TOKENS)])
            num_sequences += 1

    await asyncio.gather(*(finish_sequences(replica) for replica in replicas))
    for replica in replicas:
        await replica.stop()
    num_commands = redis.commands_processed() - commands_before - 1  # our INFO call
    num_round_trips = sum(round_trips(replica) for replica in replicas)
    stats = [replica.stats()["namespaces"][0] for replica in replicas]
    p99s = [stat["lag_ms_p99"] for stat in stats if stat["lag_ms_p99"] is not None]
    num_tokens = num_sequences * LOAD_OUTPUT_TOKENS
    return {
        "replicas": num_replicas,
        "tokens_per_s_per_replica": tokens_per_s,
        "seconds": seconds,
        "sequences": num_sequences,
        "received": sum(stat["received"] for stat in stats),
        "redis_commands": num_commands,
        "redis_commands_per_token": round(num_commands / max(1, num_tokens), 5),
        "redis_round_trips": num_round_trips,
        "redis_round_trips_per_token": round(num_round_trips / max(1, num_tokens), 5),
        "sync_lag_ms_p50": max(stat["lag_ms_p50"] or 0 for stat in stats),
        "sync_lag_ms_p99": max(p99s) if p99s else None,
    }


def markdown_table(payload: dict) -> str:
    lines = [
        "| workload | cold tokens/step | warm tokens/step | ratio | cold tok/s | warm tok/s | ratio "
        "| Redis calls/token | sync lag p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in payload["workloads"].items():
        mark = "" if row["identical_outputs"] else " ≠"
        lines.append(
            f"| {name}{mark} | {row['cold']['tokens_per_step']:.2f} | {row['warm']['tokens_per_step']:.2f} "
            f"| {row['tokens_per_step_ratio']:.2f}x | {row['cold']['tokens_per_s']:.1f} "
            f"| {row['warm']['tokens_per_s']:.1f} | {row['tokens_per_s_ratio']:.2f}x "
            f"| {_calls(row)} | {_lags(row)} |"
        )
    lines += [
        "",
        "| sync load: replicas | tok/s per replica | sequences | Redis calls/token | sync lag p50 / p99 ms |",
        "|---|---|---|---|---|",
    ]
    for row in payload.get("sync_load", []):
        lines.append(
            f"| {row['replicas']} | {row['tokens_per_s_per_replica']:.0f} | {row['sequences']} "
            f"| {_calls(row)} | {_lags(row)} |"
        )
    return "\n".join(lines)


def _calls(row: dict) -> str:
    """Client round trips per generated token (and, in brackets, every command Redis ran,
    those inside publish scripts included)."""
    if "redis_round_trips_per_token" not in row:  # results from before round trips were counted
        return f"({row['redis_commands_per_token']:.4f})"
    return f"{row['redis_round_trips_per_token']:.4f} ({row['redis_commands_per_token']:.4f})"


def _lags(row: dict) -> str:
    return " / ".join(
        "-" if row[key] is None else f"{row[key]:.0f}" for key in ("sync_lag_ms_p50", "sync_lag_ms_p99")
    )


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """Warm over cold replica B, keyed for comparing two runs (``like`` changes nothing: the
    quick run has fewer and shorter conversations; the band is wider there)."""
    return {
        f"{name}/{metric}": row[f"{metric}_ratio"]
        for name, row in payload["workloads"].items()
        for metric in ("tokens_per_step", "tokens_per_s")
    }


def plot(payload: dict):
    """Cold vs warm replica B, by workload: tokens per target forward and tokens/s."""
    figure, axes = new_figure(2)
    names = list(payload["workloads"])
    for axis, metric, label in zip(
        axes, ("tokens_per_step", "tokens_per_s"), ("tokens per target forward", "tokens/s")
    ):
        grouped_bars(
            axis,
            names,
            {
                phase: [payload["workloads"][name][phase][metric] for name in names]
                for phase in ("cold", "warm")
            },
            label,
        )
        axis.set_title(f"shared pool: {label}, cold vs warmed through Redis")
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="3 conversations, 48 tokens")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    num, max_tokens = (3, 48) if args.quick else (8, 96)
    model, tokenizer = load_model(config=ModelConfig(dtype=args.dtype))
    calibration = calibrate(model, CONCURRENCY)
    redis = LocalRedis().start()
    results: dict[str, dict] = {}
    load: list[dict] = []
    load_seconds = 3.0 if args.quick else 15.0
    try:
        for name, phases in tqdm(workloads(num).items(), desc="pool", unit="workload"):
            results[name] = asyncio.run(
                run_workload(model, tokenizer, redis, name, phases, max_tokens, calibration)
            )
        for rate in tqdm(LOAD_RATES, desc="pool sync load", unit="rate"):
            load.append(asyncio.run(sync_load(redis, model.config.vocab_size, rate, load_seconds)))
    finally:
        redis.stop()
    payload = {
        "benchmark": "pool",
        "meta": {
            **run_metadata(model, args.dtype, "benchmarks.pool"),
            "conversations": num,
            "max_tokens": max_tokens,
            "concurrency": CONCURRENCY,
        },
        "workloads": results,
        "sync_load": load,
    }
    publish_run(result_name("pool", args.dtype, args.quick), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
