"""Decoding while a large JSON schema compiles: does one tenant's 50 KB schema stall the others?

Four rows decode (greedy, speculation off, past their end of sequence) on the embedded model
through ``AsyncEngine``, as a replica runs them. What those rows feel is the time between two
steps, so the engine's step ends are timed. There are three windows:
- ``quiet``: nothing arrives.
- ``worker thread, first``: the engine's first constrained request arrives on the server's
  path, with a new ~50 KB schema. A worker thread compiles the schema (llguidance's tokenizer
  and mask kernel were built by ``AsyncEngine.start``); then the engine builds the matcher and
  prefills it.
- ``worker thread, again``: a second request of that kind, with another new schema.
- ``engine thread``: a new schema of the same size is compiled between two steps on the engine
  thread, as before the grammar work moved off it. This window is shown for contrast.

For each window: the steps in it, the p50 / p99 / max gap between step ends in ms, and the
window's length (for the schema windows: from arrival to the first token, or to the compile's
end).

    python -m benchmarks.grammar_stall
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from benchmarks.common import run_metadata, write_result
from nasd_core import Engine, EngineConfig
from nasd_core.config import GrammarSpec, SamplingParams, SpecConfig
from nasd_core.engine.async_engine import AsyncEngine
from nasd_core.loader import load_model

NUM_ROWS = 4
SCHEMA_CHARS = 50_000
QUIET_S = 3.0
# Enough to outlast the three windows.
DECODE_TOKENS = 1500
PROMPT = "Write a long story about a lighthouse keeper."


def large_schema(salt: str, target_chars: int = SCHEMA_CHARS) -> str:
    """A JSON schema of at least ``target_chars``: an order form of many nested, described,
    bounded fields. ``salt`` makes it new to the grammar cache."""
    properties: dict[str, dict] = {}
    size = 0
    while size < target_chars:
        number = len(properties)
        name = f"field_{number}_{salt}"
        properties[name] = {
            "type": "object",
            "description": f"Line {number} of the order ({salt}): the item, its count and how it ships.",
            "properties": {
                "item": {"type": "string", "maxLength": 40, "pattern": "^[A-Za-z0-9 -]+$"},
                "count": {"type": "integer", "minimum": 0, "maximum": 10_000},
                "shipping": {"enum": ["ground", "air", "sea", f"pickup-{number}"]},
                "notes": {"type": ["string", "null"], "maxLength": 200},
            },
            "required": ["item", "count", "shipping"],
            "additionalProperties": False,
        }
        size += len(json.dumps({name: properties[name]}))
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)[:8]})


def gaps_ms(step_ends: list[float], start: float, end: float) -> dict[str, float]:
    """The gaps between consecutive step ends that end inside [start, end]."""
    ends = np.array(step_ends)
    gaps = np.diff(ends)[(ends[1:] >= start) & (ends[1:] <= end)] * 1000
    if not len(gaps):
        return {"steps": 0}
    return {
        "steps": len(gaps),
        "p50_ms": round(float(np.percentile(gaps, 50)), 1),
        "p99_ms": round(float(np.percentile(gaps, 99)), 1),
        "max_ms": round(float(gaps.max()), 1),
        "window_s": round(end - start, 2),
    }


async def measure(async_engine: AsyncEngine, step_ends: list[float]) -> dict[str, dict[str, float]]:
    decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)

    async def drain(prompt: str, params: SamplingParams, first_token: asyncio.Event | None = None) -> None:
        async for _ in async_engine.generate(prompt, params):
            if first_token is not None:
                first_token.set()
                return

    # Built before the rows start: the main thread holding the GIL would stall the engine too.
    worker_schema, again_schema, engine_schema = (
        large_schema(salt) for salt in ("worker", "again", "engine")
    )
    rows = [asyncio.create_task(drain(f"{PROMPT} ({row})", decode)) for row in range(NUM_ROWS)]
    while len(step_ends) < 20:  # every row prefilled and decoding
        if failed := [row.exception() for row in rows if row.done()]:
            raise RuntimeError(f"a decoding row ended early: {failed[0]}")
        await asyncio.sleep(0.1)
    windows = {}
    start = time.perf_counter()
    await asyncio.sleep(QUIET_S)
    windows["quiet"] = gaps_ms(step_ends, start, time.perf_counter())

    for name, schema in (("worker thread, first", worker_schema), ("worker thread, again", again_schema)):
        constrained = SamplingParams(
            max_tokens=8, temperature=0, grammar=GrammarSpec(kind="json_schema", source=schema)
        )
        start = time.perf_counter()
        await drain("Fill in the order form as JSON.", constrained, asyncio.Event())
        windows[name] = gaps_ms(step_ends, start, time.perf_counter())

    spec = GrammarSpec(kind="json_schema", source=engine_schema)
    start = time.perf_counter()
    await asyncio.wrap_future(async_engine.call(lambda engine: engine.grammars.compile(spec)))
    await asyncio.sleep(0.5)  # the steps after it
    windows["engine thread"] = gaps_ms(step_ends, start, time.perf_counter())
    for row in rows:
        row.cancel()
    await asyncio.to_thread(async_engine.shutdown)  # while the loop still takes its last chunks
    return windows


def markdown_table(payload: dict) -> str:
    lines = [
        "| window | steps | gap between steps p50 / p99 / max ms | window s |",
        "|---|---|---|---|",
    ]
    for name, cell in payload["windows"].items():
        lines.append(
            f"| {name} | {cell['steps']} | {cell['p50_ms']} / {cell['p99_ms']} / {cell['max_ms']} "
            f"| {cell['window_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    model, tokenizer = load_model()
    engine = Engine(model, tokenizer, EngineConfig(spec=SpecConfig(mode="off")))
    step_ends: list[float] = []
    step = engine.step

    def timed_step() -> None:
        step()
        step_ends.append(time.perf_counter())

    engine.step = timed_step
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        windows = asyncio.run(measure(async_engine, step_ends))
    finally:
        async_engine.shutdown()
    payload = {
        "benchmark": "grammar_stall",
        "meta": {
            **run_metadata(model, "float32", "benchmarks.grammar_stall"),
            "rows": NUM_ROWS,
            "schema_chars": len(large_schema("worker")),
        },
        "windows": windows,
    }
    print(markdown_table(payload))
    print(f"results: {write_result('grammar_stall_float32', payload)}")


if __name__ == "__main__":
    main()
