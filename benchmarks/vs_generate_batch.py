"""This engine beside transformers' own continuous batching (``model.generate_batch``).

Same embedded model and Linear kernels, same prompts, greedy, ``max_new_tokens`` each; every
system runs in a process of its own (one model load, a warm-up batch, then the timed batch),
so neither inherits the other's allocations or threads. Mixes: short chat prompts (the
benchmark workloads' first turns) and long ones (conversations joined to 500-2000 tokens, mixed
lengths), at 8, 16 and 32 rows submitted at once.

python -m benchmarks.vs_generate_batch            # writes benchmarks/results/vs_generate_batch_float32.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

from benchmarks.common import run_metadata, write_result
from benchmarks.workloads import WORKLOADS, make_workload

SYSTEMS = ("transformers_generate_batch", "nasd_off", "nasd_auto")
MIXES = ("short", "long")
ROWS = (8, 16, 32)
MAX_NEW_TOKENS = 64


def prompts(tokenizer, mix: str, count: int, seed: int = 3) -> list[list[int]]:
    """``count`` chat prompts (token ids) of the mix, the same for every system."""
    conversations = [conv for name in WORKLOADS for conv in make_workload(name, 12, seed=seed)]
    rng = random.Random(seed)
    out = []
    for index in range(count):
        if mix == "short":
            messages = conversations[index % len(conversations)]
        else:
            target = rng.randint(500, 2000)
            messages, offset = [], index
            while len(tokenizer.encode(str(messages))) < target:
                messages = messages + conversations[offset % len(conversations)]
                offset += count
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def run_system(system: str, mix: str, num_rows: int) -> dict:
    """One system on one cell, in this process: outputs and seconds of the timed batch."""
    from nasd_core.config import EngineConfig, SamplingParams, SpecConfig
    from nasd_core.loader import load_model

    model, tokenizer = load_model()
    batch = prompts(tokenizer, mix, num_rows)
    warmup = prompts(tokenizer, "short", 4, seed=99)
    if system == "transformers_generate_batch":
        from transformers import GenerationConfig

        model.set_attn_implementation("sdpa")
        config = GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )

        def generate(inputs: list[list[int]]) -> list[list[int]]:
            results = model.generate_batch(inputs, generation_config=config, progress_bar=False)
            by_prompt = sorted(results.values(), key=lambda output: int(output.request_id.split("_")[-1]))
            return [list(output.generated_tokens) for output in by_prompt]

    else:
        from nasd_core.engine.engine import Engine

        engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=num_rows))
        spec = SpecConfig(mode="off" if system == "nasd_off" else "auto")
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)

        def generate(inputs: list[list[int]]) -> list[list[int]]:
            return [result.token_ids for result in engine.generate(inputs, params, spec)]

    generate(warmup)
    started = time.perf_counter()
    outputs = generate(batch)
    seconds = time.perf_counter() - started
    return {
        "outputs": outputs,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(len(output) for output in outputs) / seconds, 2),
        "prompt_tokens": [len(prompt) for prompt in batch],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    parser.add_argument("--mixes", nargs="*", default=list(MIXES), choices=MIXES)
    parser.add_argument("--cell", nargs=3, metavar=("SYSTEM", "MIX", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        system, mix, num_rows = args.cell
        print(json.dumps(run_system(system, mix, int(num_rows))))
        return
    cells: dict[str, dict[int, dict]] = {}
    for mix in args.mixes:
        for num_rows in args.rows:
            by_system = {}
            for system in SYSTEMS:
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.vs_generate_batch",
                    "--cell",
                    system,
                    mix,
                    str(num_rows),
                ]
                done = subprocess.run(command, check=True, capture_output=True, text=True)
                by_system[system] = json.loads(done.stdout.strip().splitlines()[-1])
            reference = by_system["transformers_generate_batch"]
            row = {"prompt_tokens_mean": round(sum(reference["prompt_tokens"]) / num_rows)}
            for system, result in by_system.items():
                row[system] = {
                    "tokens_per_s": result["tokens_per_s"],
                    "seconds": result["seconds"],
                    "ratio": round(result["tokens_per_s"] / reference["tokens_per_s"], 2),
                    "identical": result["outputs"] == reference["outputs"],
                }
            cells.setdefault(mix, {})[num_rows] = row
            print(mix, num_rows, json.dumps(row), flush=True)
    from nasd_core.loader import load_model

    model, _ = load_model()
    payload = {
        "benchmark": "vs_generate_batch",
        "meta": run_metadata(model, "float32", "benchmarks.vs_generate_batch"),
        "max_new_tokens": MAX_NEW_TOKENS,
        "cells": cells,
    }
    write_result("vs_generate_batch_float32", payload)


if __name__ == "__main__":
    main()
