"""Agent conversations on a cluster of CPU replicas: Ray's default routing against conversation
affinity (``conversation_affinity``, on by default with more than one replica).

Each conversation is an agent loop: a task, then turns whose input quotes a file of this
repository (a tool's output: code or a document), so the history grows by a few hundred tokens
a turn. Half the conversations continue through the Responses API's ``previous_response_id``;
the others send their whole history to chat completions each turn, as most agent frameworks
do. ``--concurrency`` conversations run at a time. Per turn it reports the prompt tokens served
from a replica's prefix cache (as a share of the turn's prompt and of the earlier turns'
history), turn latency p50 / p95, tokens per step; per run, each replica's requests against the
mean. Every setting is the server's default but the ones it names: ``num_replicas``,
``conversation_affinity`` false for the default-routing runs, and with ``--pool`` each routing
again with the shared pool on (``redis_url``: a redis-server of the run's own, a namespace per
run), so a replica also drafts from what the others finished.

    python -m benchmarks.agent_cluster [--replicas 2 4] [--conversations 16] [--turns 8] [--pool]
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from statistics import median

import openai
import ray
from ray import serve

from benchmarks.common import new_figure, percentile, publish_run, result_name, run_metadata, suite_parser
from deployments import build_app
from nasd_core.config import EMBEDDED_MODEL
from pool_service.local_redis import LocalRedis, free_port

REPO = Path(__file__).resolve().parents[1]
# The files a turn quotes (a tool's output), cut to QUOTE_CHARS each: code and documents.
QUOTED = [
    "nasd_core/speculation/verify.py",
    "docs/how-it-works.md",
    "deployments/router.py",
    "nasd_core/engine/scheduler.py",
    "docs/api.md",
    "pool_service/sync.py",
    "nasd_core/speculation/gate.py",
    "deployments/shutdown.py",
]
QUOTE_CHARS = 1800
TASKS = [
    "Review this project's code with me, one file at a time, and say what each part does.",
    "I am new to this repository. Help me understand it file by file.",
    "We are hunting a bug in the speculative decoder. Read each file I show you and note anything odd.",
    "Summarise each file I paste in two sentences, then suggest one test for it.",
]
INSTRUCTIONS = "You are a coding agent. Answer briefly."
MAX_TOKENS = 32
ROUTINGS = {"default": False, "affinity": True}


def quote(conversation: int, turn: int) -> str:
    path = QUOTED[(conversation + turn) % len(QUOTED)]
    text = (REPO / path).read_text()
    start = (conversation * 997 + turn * 3371) % max(1, len(text) - QUOTE_CHARS)
    return f"Tool output, {path}:\n{text[start : start + QUOTE_CHARS]}\nWhat does this part do?"


async def conversation(client: openai.AsyncOpenAI, index: int, turns: int) -> list[dict]:
    """One agent loop; each turn's latency, prompt and cached tokens, and tokens per step."""
    task = TASKS[index % len(TASKS)] + f" (session {index})"
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": task}]
    previous_id, records = None, []
    for turn in range(turns):
        user = quote(index, turn)
        started = time.perf_counter()
        if index % 2 == 0:  # Responses, continued by id
            response = await client.responses.create(
                model=EMBEDDED_MODEL,
                instructions=INSTRUCTIONS,
                input=task if turn == 0 else user,
                previous_response_id=previous_id,
                temperature=0,
                max_output_tokens=MAX_TOKENS,
            )
            previous_id, usage = response.id, response.usage
            prompt, cached, completion = (
                usage.input_tokens,
                usage.input_tokens_details.cached_tokens,
                usage.output_tokens,
            )
            nasd = response.model_extra["nasd"]
        else:  # chat completions, the whole history every turn
            if turn:
                history.append({"role": "user", "content": user})
            answer = await client.chat.completions.create(
                model=EMBEDDED_MODEL, messages=history, temperature=0, max_tokens=MAX_TOKENS
            )
            history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
            usage = answer.usage
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            nasd = answer.model_extra["nasd"]
        records.append(
            {
                "turn": turn,
                "seconds": time.perf_counter() - started,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": completion,
                "tokens_per_step": nasd["tokens_per_step"],
            }
        )
    return records


def replica_requests(base_url: str) -> dict[str, int]:
    stats = json.loads(urllib.request.urlopen(f"{base_url}/v1/nasd/stats", timeout=30).read())
    return {replica["replica_id"]: replica["num_requests"] for replica in stats["replicas"]}


async def run_conversations(base_url: str, conversations: int, turns: int, concurrency: int) -> list[list]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    slots = asyncio.Semaphore(concurrency)

    async def one(index: int) -> list[dict]:
        async with slots:
            return await conversation(client, index, turns)

    async with client:  # closed on this loop (asyncio.run closes it after)
        return await asyncio.gather(*(one(index) for index in range(conversations)))


def per_turn(runs: list[list[dict]], turns: int) -> list[dict]:
    rows = []
    for turn in range(turns):
        records = [run[turn] for run in runs]
        earlier = (
            [run[turn - 1]["prompt_tokens"] + run[turn - 1]["completion_tokens"] for run in runs]
            if turn
            else []
        )
        prompt = sum(record["prompt_tokens"] for record in records)
        cached = sum(record["cached_tokens"] for record in records)
        seconds = [record["seconds"] for record in records]
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": prompt,
                "computed_prompt_tokens": prompt - cached,
                "cached_share": round(cached / prompt, 3) if prompt else 0.0,
                "history_reused": round(cached / sum(earlier), 3) if earlier else None,
                "latency_p50_s": round(percentile(seconds, 50), 3),
                "latency_p95_s": round(percentile(seconds, 95), 3),
                "tokens_per_step": round(sum(r["tokens_per_step"] for r in records) / len(records), 3),
            }
        )
    return rows


def run_settings(num_replicas: int, redis_url: str | None) -> dict[str, dict]:
    """Each run's name and its application's arguments: each routing, and with ``redis_url`` each
    routing again with the shared pool there, in a namespace of the run's own."""
    runs = {
        name: {"num_replicas": num_replicas, "conversation_affinity": affinity}
        for name, affinity in ROUTINGS.items()
    }
    if redis_url is not None:
        runs |= {
            f"{name} + pool": {
                **args,
                "redis_url": redis_url,
                "pool_namespace": f"agents-{num_replicas}-{name}",
            }
            for name, args in runs.items()
        }
    return runs


def run_cluster(args: dict, conversations: int, turns: int, concurrency: int) -> dict:
    """One application built from ``args``, its conversations run through it."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name="agents", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        runs = asyncio.run(run_conversations(base_url, conversations, turns, concurrency))
        loads = replica_requests(base_url)
    finally:
        serve.shutdown()
    mean = sum(loads.values()) / len(loads)
    return {
        "app_args": args,
        "turns": per_turn(runs, turns),
        "replica_requests": loads,
        "max_over_mean_load": round(max(loads.values()) / mean, 3),
    }


def markdown_table(payload: dict) -> str:
    """One row per replica count and routing, over the turns after the first (their per-turn
    figures are in the result file and the plot)."""
    meta = payload["meta"]
    lines = [
        f"{payload['conversations']} conversations of {payload['turns']} turns, {payload['concurrency']} "
        f"at a time, {MAX_TOKENS} tokens a turn, greedy; {meta['isa']}; settings changed: "
        f"{', '.join(payload['changed_settings'])}. Over turns 2-{payload['turns']}, the ones with a history "
        f"to reuse; latencies over turns 3-{payload['turns']}.",
        "",
        "| replicas | routing | history reused: lowest / median | prompt tokens computed / sent | "
        "p50 s, turns 3+ | worst p95 s, turns 3+ | tokens/step | max / mean replica load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for replicas, runs in payload["runs"].items():
        for routing, run in runs.items():
            later, settled = run["turns"][1:], run["turns"][2:]
            reused = [row["history_reused"] for row in later]
            p50 = [row["latency_p50_s"] for row in settled]
            lines.append(
                f"| {replicas} | {routing} | {min(reused):.0%} / {median(reused):.0%} | "
                f"{sum(row['computed_prompt_tokens'] for row in later):,} / "
                f"{sum(row['prompt_tokens'] for row in later):,} | {min(p50):.2f}-{max(p50):.2f} | "
                f"{max(row['latency_p95_s'] for row in settled):.2f} | "
                f"{median(row['tokens_per_step'] for row in later):.2f} | {run['max_over_mean_load']} |"
            )
    return "\n".join(lines)


def plot(payload: dict):
    figure, axes = new_figure(2, width=6.0)
    for replicas, runs in payload["runs"].items():
        for routing, run in runs.items():
            turns = [row["turn"] for row in run["turns"]]
            label = f"{replicas} replicas, {routing}"
            axes[0].plot(turns, [row["cached_share"] for row in run["turns"]], marker="o", label=label)
            axes[1].plot(turns, [row["latency_p50_s"] for row in run["turns"]], marker="o", label=label)
    axes[0].set(xlabel="turn", ylabel="prompt tokens from the prefix cache", title="cached share")
    axes[1].set(xlabel="turn", ylabel="seconds", title="turn latency p50")
    axes[0].legend(fontsize=7)
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="2 replicas, 4 conversations of 3 turns")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool", action="store_true", help="each routing again with the shared pool on")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.conversations, args.turns = [2], 4, 3
    redis = LocalRedis().start() if args.pool else None
    ray.init(address="local", num_cpus=max(args.replicas), include_dashboard=False, log_to_driver=False)
    try:
        results = {
            str(replicas): {
                name: run_cluster(app_args, args.conversations, args.turns, args.concurrency)
                for name, app_args in run_settings(replicas, redis and redis.url).items()
            }
            for replicas in args.replicas
        }
    finally:
        ray.shutdown()
        if redis is not None:
            redis.stop()
    payload = {
        "benchmark": "agent_cluster",
        "meta": run_metadata(None, "gguf", "benchmarks.agent_cluster"),
        "conversations": args.conversations,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "changed_settings": [
            "num_replicas",
            "conversation_affinity (false for default routing)",
            *(["redis_url, pool_namespace (+ pool)"] if args.pool else []),
        ],
        "runs": results,
    }
    publish_run(result_name("agent_cluster", "gguf", args.quick), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
