"""The service end to end: tokens/s, TTFT and inter-token latency through real HTTP.

A local Ray Serve runs ``deployments.build_app`` three times, speculation ``off``, ``on`` and
``auto`` (the same replica count each); the official OpenAI client streams greedy chat
completions at each concurrency C (``2*C`` requests, at least 6, C at a time) to each
application in turn (the order rotates by cell), in the same run on the same prompts. Each
application sees every prompt once, and all must give the same texts.

    python -m benchmarks.http                  # 1 replica, C = 1, 4, 16, 32, 64 tokens
    python -m benchmarks.http --replicas 1 2   # the same, then again with 2 replicas
    python -m benchmarks.http --quick          # the full run's C = 4 cell alone (same prompts)

Every prompt is new to each application (``distinct_prompts``): past the creative
generator's 64 prompts, C=32 gets earlier ones with an instruction added.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import openai
import ray
from ray import serve
from tqdm import tqdm

from benchmarks.common import (
    concurrency_lines,
    new_figure,
    percentile,
    publish_run,
    rotated,
    run_metadata,
)
from benchmarks.concurrency import MIXES, MODES, add_ratios_to_off, sweep_ratios
from benchmarks.workloads import Messages, Sampled, distinct_prompts
from deployments import build_app
from nasd_core.config import EMBEDDED_MODEL
from nasd_core.loader import load_model
from pool_service.local_redis import free_port

# Warm-up requests, unlike any benchmark prompt.
WARMUP = [[{"role": "user", "content": "Count from one to ten in words."}]]
MAX_TOKENS = 64


async def stream_one(
    client: openai.AsyncOpenAI, conversation: Messages | Sampled, mode: str, max_tokens: int
) -> dict:
    """One streamed request, greedy unless ``conversation`` brings its own sampling (``Sampled``):
    its text, token count, time to first token and mean ITL."""
    messages, sampling = conversation if isinstance(conversation, tuple) else (conversation, {})
    started = time.perf_counter()
    arrivals: list[float] = []
    parts: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model=EMBEDDED_MODEL,
        messages=messages,
        max_tokens=max_tokens,
        **({"temperature": 0} | sampling),
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": mode},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    finished = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    # Speculation delivers several tokens per chunk: ITL is the decode time per token after the
    # first, as a user reading the stream sees it.
    itl = (arrivals[-1] - arrivals[0]) / (tokens - 1) if len(arrivals) > 1 and tokens > 1 else None
    return {
        "text": "".join(parts),
        "tokens": tokens,
        "seconds": finished - started,
        "ttft_s": (arrivals[0] if arrivals else finished) - started,
        "itl_s": itl,
    }


async def run_requests(
    base_url: str,
    conversations: list[Messages | Sampled],
    concurrency: int,
    mode: str,
    max_tokens: int,
    interval_s: float | None = None,
) -> tuple[list[dict], float]:
    """All ``conversations``, ``concurrency`` at a time, through one client: each one's
    ``stream_one`` result, in order, and the seconds they took together. ``interval_s``: request
    i is sent no sooner than ``i * interval_s`` after the first (arrivals at a fixed rate)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def gated(index: int, messages: Messages | Sampled) -> dict:
        if interval_s is not None:
            await asyncio.sleep(max(0.0, started + index * interval_s - time.perf_counter()))
        async with gate:
            return await stream_one(client, messages, mode, max_tokens)

    try:
        results = await asyncio.gather(*itertools.starmap(gated, enumerate(conversations)))
    finally:
        await client.close()
    return results, time.perf_counter() - started


async def run_cell(
    base_url: str, conversations: list[Messages], concurrency: int, mode: str, max_tokens: int
):
    """``run_requests``' summary and texts."""
    results, elapsed = await run_requests(base_url, conversations, concurrency, mode, max_tokens)
    return summarise(results, elapsed), [result["text"] for result in results]


def engine_counters(base_url: str) -> dict[str, int]:
    """The application's engine counters summed over replicas (``/v1/nasd/stats``): steps,
    steps that verified drafts, drafted and accepted tokens. Two snapshots around a cell give
    what its engine did there (``counters_delta``)."""
    with urllib.request.urlopen(f"{base_url}/nasd/stats", timeout=60) as response:
        total = json.load(response)["total"]
    widths = {int(width): count for width, count in total["width_histogram"].items()}
    return {
        "steps": sum(widths.values()),
        "drafted_steps": sum(count for width, count in widths.items() if width),
        "drafted": total["num_drafted"],
        "accepted": total["num_accepted"],
    }


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after}


def summarise(results: list[dict], elapsed: float) -> dict:
    """One cell's throughput and latency percentiles from its requests' ``stream_one`` results."""
    tokens = sum(result["tokens"] for result in results)
    ttfts = [result["ttft_s"] for result in results]
    itls = [result["itl_s"] for result in results if result["itl_s"] is not None]
    return {
        "requests": len(results),
        "tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
        "itl_p50_ms": round(1000 * percentile(itls, 50), 1),
        "itl_p99_ms": round(1000 * percentile(itls, 99), 1),
    }


def serve_apps(
    num_replicas: int,
    num_cpus: int,
    modes: Sequence[str] = MODES,
    dtype: str = "float32",
    app_args: dict | None = None,
) -> dict[str, str]:
    """One application per mode (``/off``, ``/auto``), each ``num_replicas`` replicas over
    ``num_cpus`` CPUs; their API URLs. Only one of them is ever busy. A mode may name a
    second application of a mode as ``mode:name`` (``off:control``: a second ``off`` server,
    the noise floor of a comparison). ``dtype``: float32 by default, as most results are
    labelled (a CPU server's own default is the GGUF blocks, ``"gguf"``); ``app_args``: more
    ``build_app`` arguments for every application."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cpus_per_replica = max(1, num_cpus // num_replicas)
    args = {"num_replicas": num_replicas, "num_cpus_per_replica": cpus_per_replica, "dtype": dtype}
    args.update(app_args or {})
    names = {mode: mode.replace(":", "_") for mode in modes}
    serve.run_many(
        [
            serve.RunTarget(
                build_app({**args, "speculation": speculation_of(mode)}),
                name=names[mode],
                route_prefix=f"/{names[mode]}",
            )
            for mode in modes
        ]
    )
    return {mode: f"http://127.0.0.1:{port}/{names[mode]}/v1" for mode in modes}


def speculation_of(mode: str) -> str:
    """The speculation mode of an application named by ``serve_apps``' ``mode[:name]``."""
    return mode.split(":")[0]


LEVELS = (1, 4, 16, 32)
QUICK_LEVELS = (4,)


def cell_sizes(levels: Sequence[int]) -> list[int]:
    """Requests per cell: two waves of C, at least 6."""
    return [max(2 * level, 6) for level in levels]


@contextmanager
def served_modes(
    num_replicas: int,
    num_cpus: int,
    modes: Sequence[str] = MODES,
    dtype: str = "float32",
    app_args: dict | None = None,
) -> Iterator[dict[str, str]]:
    """A local Ray whose ``num_cpus`` CPUs each mode's application reserves in turn, one
    application per mode, each warmed up (code paths loaded, step times learned); their API
    URLs. Serve and Ray are shut down on the way out."""
    ray.init(address="local", num_cpus=num_cpus * len(modes), include_dashboard=False, log_to_driver=False)
    try:
        urls = serve_apps(num_replicas, num_cpus, modes, dtype, app_args)
        for url in urls.values():
            asyncio.run(run_cell(url, WARMUP * num_replicas, len(WARMUP) * num_replicas, "auto", 8))
        yield urls
    finally:
        serve.shutdown()
        ray.shutdown()


def run_replicas(
    num_replicas: int, levels: Sequence[int], max_tokens: int, num_cpus: int, progress: tqdm
) -> dict:
    """Every cell of ``levels`` (some of ``LEVELS``) on ``num_replicas`` replicas per mode.

    A cell's prompts and mode order are the full run's for that C whichever cells run, so a
    quick run repeats some full-run cells exactly.
    """
    sizes = cell_sizes(LEVELS)
    with served_modes(num_replicas, num_cpus) as urls:
        table: dict[str, dict] = {}
        for mix, names in MIXES.items():
            # Every prompt goes once to each application: a server learns the answers it gives,
            # and a repeated greedy prompt would measure that memory instead of the workload.
            prompts = distinct_prompts(names, sum(sizes), seed=3)
            for level in levels:
                index = LEVELS.index(level)
                batch = prompts[sum(sizes[:index]) : sum(sizes[: index + 1])]
                row, texts = {}, {}
                # Rotate which mode goes first, so slow drift does not favour one of them.
                for mode in rotated(MODES, index):
                    row[mode], texts[mode] = asyncio.run(run_cell(urls[mode], batch, level, mode, max_tokens))
                    progress.update()
                add_ratios_to_off(row)
                row["identical"] = all(texts[mode] == texts["off"] for mode in MODES)
                table.setdefault(mix, {})[str(level)] = row
        return table


def markdown_table(payload: dict) -> str:
    lines = [
        "| replicas | mix | C | off tok/s | on / off | auto / off | TTFT p50 ms off / on / auto "
        "| ITL p50 ms off / on / auto | ITL p99 ms off / on / auto |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for replicas, mixes in payload["results"].items():
        for mix, levels in mixes.items():
            for level, row in levels.items():
                flag = "" if row["identical"] else " ≠"
                triples = " | ".join(
                    " / ".join(f"{row[mode][name]:.0f}" for mode in MODES)
                    for name in ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")
                )
                on, auto = row["on"]["ratio_to_off"], row["auto"]["ratio_to_off"]
                lines.append(
                    f"| {replicas} | {mix} | {level} | {row['off']['tokens_per_s']:.1f} "
                    f"| {on:.2f}x | {auto:.2f}x{flag} | {triples} |"
                )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """tokens/s over ``off`` in the same cell, keyed for comparing two runs (a quick run's
    cells are some of the full run's, on the same prompts, so ``like`` changes nothing)."""
    ratios: dict[str, float] = {}
    for replicas, mixes in payload["results"].items():
        ratios.update(sweep_ratios(mixes, prefix=f"{replicas} replica(s)/"))
    return ratios


def plot(payload: dict):
    """Per mix: tokens/s and TTFT p50 against concurrency, one line per mode (and replica count)."""
    mixes = list(next(iter(payload["results"].values())))
    figure, axes = new_figure(2 * len(mixes), width=5.0)
    for panel, mix in enumerate(mixes):
        for axis, metric, label in (
            (axes[2 * panel], "tokens_per_s", "output tokens/s"),
            (axes[2 * panel + 1], "ttft_p50_ms", "TTFT p50 (ms)"),
        ):
            for replicas, results in payload["results"].items():
                suffix = f", {replicas} replica{'s' if replicas != '1' else ''}"
                concurrency_lines(
                    axis, results[mix], {mode + suffix: mode for mode in MODES}, metric, f"HTTP, {mix} mix"
                )
            axis.set_ylabel(label)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replicas", type=int, nargs="+", help="replica counts (default: 1)")
    args = parser.parse_args()
    replica_counts = args.replicas or [1]
    levels = QUICK_LEVELS if args.quick else LEVELS
    max_tokens = MAX_TOKENS
    num_cpus = os.cpu_count() or 2
    progress = tqdm(
        total=len(replica_counts) * len(MIXES) * len(levels) * len(MODES), desc="http", unit="cell"
    )
    results = {
        str(count): run_replicas(count, levels, max_tokens, num_cpus, progress) for count in replica_counts
    }
    progress.close()
    model, _ = load_model()  # for the metadata only (the replicas load their own copy)
    payload = {
        "benchmark": "http",
        "meta": {
            **run_metadata(model, "float32", "benchmarks.http"),
            "max_tokens": max_tokens,
            "requests_per_cell": dict(zip(map(str, levels), cell_sizes(levels))),
            "ray_cpus": num_cpus,
        },
        "results": results,
    }
    publish_run("http", "float32", args.quick, payload, plot, markdown_table)


if __name__ == "__main__":
    main()
