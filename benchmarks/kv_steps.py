"""The paged KV-cache's figures: decode step time by context, ragged cost, memory.

- Step time by context: a plain decode step (one position per row) of 16 and 32 rows holding
  64 / 512 / 1536 cached tokens each; the ratio ctx 1536 / ctx 64 is what the cache layout
  costs beyond the attention arithmetic (reading the KV itself is the floor).
- Ragged cost: the same rows where one row verifies 16 drafts and the others none, over the
  plain step (a padded batch fed every row 17 positions).
- Memory: 32 chat-like prompts of ~800 tokens + 64 new tokens through the engine; peak
  resident memory above the loaded model against the KV bytes the rows hold at most.

python -m benchmarks.kv_steps            # writes benchmarks/results/kv_steps_float32.json
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import run_metadata, write_result
from benchmarks.workloads import WORKLOADS, make_workload
from nasd_core.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.runner.model_runner import ModelRunner
from nasd_core.speculation.calibration import fill_rows, time_step

CONTEXTS = (64, 512, 1536)
ROWS = (16, 32)
RAGGED_DRAFT = 16


def fastest_step_ms(runner: ModelRunner, widths: list[int], context: int, repeats: int) -> float:
    """Fastest of ``repeats`` steps where row i feeds ``widths[i]`` positions (then rolled back)."""
    return round(1000 * min(time_step(runner, widths, context) for _ in range(repeats)), 1)


def step_costs(model, repeats: int) -> dict:
    runner = ModelRunner(model, kv_cache_tokens=max(ROWS) * (max(CONTEXTS) + 64))
    by_rows = {}
    for num_rows in ROWS:
        plain, ragged = {}, {}
        for context in CONTEXTS:
            for row in list(runner.cache.rows):
                runner.cache.free(row)
            fill_rows(runner, num_rows, context, context + RAGGED_DRAFT + 1)
            one_wide = [1 + RAGGED_DRAFT] + [1] * (num_rows - 1)
            plain[context] = fastest_step_ms(runner, [1] * num_rows, context, repeats)
            ragged[context] = fastest_step_ms(runner, one_wide, context, repeats)
            print(f"{num_rows} rows, ctx {context}: plain {plain[context]} ms, one wide {ragged[context]} ms")
        by_rows[num_rows] = {
            "plain_ms_by_context": plain,
            "ragged_ms_by_context": ragged,
            "ctx_ratio": round(plain[max(CONTEXTS)] / plain[min(CONTEXTS)], 2),
            "ragged_over_plain": {ctx: round(ragged[ctx] / plain[ctx], 2) for ctx in CONTEXTS},
        }
    return by_rows


def long_prompts(tokenizer, count: int, target_tokens: int) -> list[list[int]]:
    """Chat prompts of about ``target_tokens`` tokens: several workload conversations joined."""
    conversations = [conv for name in WORKLOADS for conv in make_workload(name, 8, seed=5)]
    prompts = []
    for index in range(count):
        messages, ids = [], []
        offset = index
        while len(ids) < target_tokens:
            messages.extend(conversations[offset % len(conversations)])
            offset += count
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(list(ids[-target_tokens:]))
    return prompts


def resident_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def memory(model, tokenizer, num_rows: int, prompt_tokens: int, new_tokens: int) -> dict:
    prompts = long_prompts(tokenizer, num_rows, prompt_tokens)
    before_kb = resident_kb()
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=num_rows))
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens), SpecConfig(mode="off"))
    peak_kb, live_bytes = before_kb, 0
    started = time.perf_counter()
    while not engine.is_finished():
        engine.step()
        peak_kb = max(peak_kb, resident_kb())
        live_bytes = max(live_bytes, engine.cache.usage()["kv_bytes_live"])
    result = {
        "rows": num_rows,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "kv_bytes_pool": engine.cache.usage()["kv_bytes_pool"],
        "kv_bytes_live_peak": live_bytes,
        "rss_above_model_peak_bytes": (peak_kb - before_kb) * 1024,
        "seconds": round(time.perf_counter() - started, 1),
    }
    result["rss_over_live"] = round(result["rss_above_model_peak_bytes"] / live_bytes, 2)
    print(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_model(config=ModelConfig())
    payload = {
        "benchmark": "kv_steps",
        "meta": run_metadata(model, "float32", "benchmarks.kv_steps"),
        "step_ms": step_costs(model, args.repeats),
    }
    if not args.skip_memory:
        payload["memory"] = memory(model, tokenizer, 32, 800, 64)
    write_result("kv_steps_float32", payload)


if __name__ == "__main__":
    main()
