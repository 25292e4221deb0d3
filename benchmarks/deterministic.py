"""Deterministic mode against the default, the embedded model in bfloat16 on this CPU.

Two engines on the same prompts in one run: the default (bfloat16 arithmetic, the kernels each
step's shape picks) and ``EngineConfig.deterministic`` (batch-invariant steps). Each runs every
prompt alone with speculation off (plain decoding, the reference), then alone with ``auto``, then
all prompts at once (4 rows a step) with ``auto``. For each engine: tokens/s of plain and ``auto``
decoding alone, and how many prompts' greedy outputs equal plain decoding's, alone and batched.
The prompts are one of each workload (``benchmarks/workloads.py``) and two long chats
(``long_chat_messages``).

    python -m benchmarks.deterministic
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import run_metadata, write_result
from benchmarks.workloads import WORKLOADS, chat_ids, long_chat_messages, make_workload
from nasd_core import Engine, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.loader import load_model, load_tokenizer

BATCH_ROWS = 4
ENGINES = {"default": False, "deterministic": True}


def prompts_of(tokenizer) -> dict[str, list[int]]:
    prompts = {name: chat_ids(tokenizer, make_workload(name, 1)[0]) for name in WORKLOADS}
    for index, messages in enumerate(long_chat_messages(tokenizer, 2)):
        prompts[f"long_chat_{index}"] = chat_ids(tokenizer, messages)
    return prompts


def run_engine(deterministic: bool, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    model, tokenizer = load_model(config=ModelConfig(dtype="bfloat16"))
    config = EngineConfig(max_batch_rows=BATCH_ROWS, deterministic=deterministic)
    engine = Engine(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens)
    engine.generate([next(iter(prompts.values()))], SamplingParams(max_tokens=8))  # warm-up
    outputs: dict[str, dict[str, list[int]]] = {}
    seconds: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for mode in ("off", "auto"):
        spec = SpecConfig(mode=mode)
        started = time.perf_counter()
        outputs[mode] = {
            name: engine.generate([ids], params, spec)[0].token_ids for name, ids in prompts.items()
        }
        seconds[mode] = time.perf_counter() - started
        tokens[mode] = sum(len(ids) for ids in outputs[mode].values())
    batched = engine.generate(list(prompts.values()), params, SpecConfig(mode="auto"))
    outputs["auto_batched"] = {name: result.token_ids for name, result in zip(prompts, batched, strict=True)}
    plain = outputs["off"]
    return {
        "tokens_per_s": {mode: round(tokens[mode] / seconds[mode], 2) for mode in seconds},
        "auto_over_off": round(tokens["auto"] / seconds["auto"] / (tokens["off"] / seconds["off"]), 3),
        "identical_to_plain": {
            run: sorted(name for name in prompts if outputs[run][name] == plain[name])
            for run in ("auto", "auto_batched")
        },
        "meta": run_metadata(model, "bfloat16", "benchmarks.deterministic"),
    }


def markdown_table(payload: dict) -> str:
    num_prompts = payload["num_prompts"]
    lines = [
        "| engine | plain tok/s | `auto` tok/s | `auto` / plain | `auto` alone = plain | `auto`, "
        f"{BATCH_ROWS} rows a step = plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, cell in payload["engines"].items():
        rates, same = cell["tokens_per_s"], cell["identical_to_plain"]
        lines.append(
            f"| {name} | {rates['off']:.1f} | {rates['auto']:.1f} | {cell['auto_over_off']:.2f}x "
            f"| {len(same['auto'])} / {num_prompts} | {len(same['auto_batched'])} / {num_prompts} |"
        )
    default, deterministic = (payload["engines"][name]["tokens_per_s"] for name in ENGINES)
    lines += [
        "",
        f"Deterministic / default, tokens/s: plain {deterministic['off'] / default['off']:.2f}x, "
        f"`auto` {deterministic['auto'] / default['auto']:.2f}x.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = prompts_of(load_tokenizer())
    engines = {}
    for name, deterministic in ENGINES.items():
        engines[name] = run_engine(deterministic, prompts, args.max_tokens)
        print(name, engines[name]["tokens_per_s"], engines[name]["identical_to_plain"], flush=True)
    meta = engines["deterministic"].pop("meta")
    engines["default"].pop("meta")
    meta["max_tokens"] = args.max_tokens
    payload = {
        "benchmark": "deterministic",
        "meta": meta,
        "num_prompts": len(prompts),
        "prompt_tokens": {name: len(ids) for name, ids in prompts.items()},
        "engines": engines,
    }
    print(markdown_table(payload))
    print(f"results: {write_result('deterministic_bfloat16', payload)}")


if __name__ == "__main__":
    main()
