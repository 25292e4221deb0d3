"""The server measured through HTTP, as a client sees it (``http_categories``): one application
per speculation mode on a local Ray, each request streamed through the official client, each
cell's throughput, latency and engine counters.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import openai
import ray
from ray import serve

from benchmarks.common import percentile
from benchmarks.workloads import Messages, Sampled
from deployments import build_app
from nasd_core.config import EMBEDDED_MODEL
from pool_service.local_redis import free_port

# Warm-up requests, unlike any benchmark prompt.
WARMUP = [[{"role": "user", "content": "Count from one to ten in words."}]]


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
    num_replicas: int, num_cpus: int, modes: Sequence[str], app_args: dict | None = None
) -> dict[str, str]:
    """One application per mode (``/off``, ``/auto``), each ``num_replicas`` replicas over
    ``num_cpus`` CPUs; their API URLs. Only one of them is ever busy. A mode may name a
    second application of a mode as ``mode:name`` (``off:control``: a second ``off`` server,
    the noise floor of a comparison). ``app_args``: ``build_app`` arguments for every
    application beside these (its defaults otherwise, the server's own)."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cpus_per_replica = max(1, num_cpus // num_replicas)
    args = {"num_replicas": num_replicas, "num_cpus_per_replica": cpus_per_replica, **(app_args or {})}
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


@contextmanager
def served_modes(
    num_replicas: int, num_cpus: int, modes: Sequence[str], app_args: dict | None = None
) -> Iterator[dict[str, str]]:
    """A local Ray whose ``num_cpus`` CPUs each mode's application reserves in turn, one
    application per mode, each warmed up (code paths loaded, step times learned); their API
    URLs. Serve and Ray are shut down on the way out."""
    ray.init(address="local", num_cpus=num_cpus * len(modes), include_dashboard=False, log_to_driver=False)
    try:
        urls = serve_apps(num_replicas, num_cpus, modes, app_args)
        for url in urls.values():
            asyncio.run(run_cell(url, WARMUP * num_replicas, len(WARMUP) * num_replicas, "auto", 8))
        yield urls
    finally:
        serve.shutdown()
        ray.shutdown()
