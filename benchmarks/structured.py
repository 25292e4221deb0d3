"""Structured output under speculation: constrained ``auto`` against constrained ``off``, and
what the grammar's masks cost a step.

- JSON extraction: a short order note mentions a customer, a city, an item and a quantity; the
  answer is a JSON record of them under a strict schema (``response_format`` json_schema). The
  engine alone, C = 1 and 16, greedy, max_tokens 64, one run of each mode in one process;
  tokens/s, tokens per step and the share of accepted drafts the grammar itself drafted
  (jump-forward: keys and punctuation the schema forces). Every output is checked against the
  schema, and constrained ``auto`` against constrained ``off`` token for token.
- Mask cost: ``RequestGrammar.mask`` for rows of 1 and 17 positions at 1 and 64 rows (a step's
  grammar work), beside the same step's forward on this CPU (``measure_step_times``).

    python -m benchmarks.structured            # 32 requests per cell
    python -m benchmarks.structured --quick    # 16
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jsonschema

from benchmarks.common import run_metadata, write_result
from benchmarks.workloads import _CITIES, _ITEMS, _NAMES, chat_ids
from nasd_core.config import EngineConfig, GrammarSpec, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.models import load_model
from nasd_core.speculation.calibration import Calibration, measure_step_times

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 24},
        "item": {"type": "string", "maxLength": 24},
        "quantity": {"type": "integer"},
    },
    "required": ["customer", "city", "item", "quantity"],
    "additionalProperties": False,
}
SPEC = GrammarSpec(kind="json_schema", source=json.dumps(SCHEMA), param="response_format")
LEVELS = (1, 16)
MAX_TOKENS = 64


def extraction_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Order notes to extract, as chat prompts (token ids)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        name, city, item, quantity = (
            rng.choice(_NAMES).title(),
            rng.choice(_CITIES),
            rng.choice(_ITEMS),
            rng.randint(2, 40),
        )
        note = (
            f"Order note: {name} from {city} called this morning and asked for {quantity} units of the "
            f"{item} model we showed last week; deliver before Friday."
        )
        content = (
            f'{note}\n\nExtract the order as JSON with the keys "customer", "city", "item" and "quantity".'
        )
        prompts.append(chat_ids(tokenizer, [{"role": "user", "content": content}]))
    return prompts


def run_cell(
    engine: Engine, prompts: list[list[int]], concurrency: int, mode: str
) -> tuple[dict, list[list[int]]]:
    """Every prompt through ``engine`` with at most ``concurrency`` running at once."""
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=SPEC)
    spec = SpecConfig(mode=mode)
    started = time.perf_counter()
    outputs, steps, accepted, by_grammar = [], 0, 0, 0
    for start in range(0, len(prompts), concurrency):
        for result in engine.generate(prompts[start : start + concurrency], params, spec):
            jsonschema.validate(json.loads(result.text), SCHEMA)
            outputs.append(result.token_ids)
            steps += result.stats.num_steps
            accepted += result.stats.num_accepted
            by_grammar += result.stats.accepted_by_source.get("grammar", 0)
    seconds = time.perf_counter() - started
    tokens = sum(len(output) for output in outputs)
    return {
        "tokens_per_s": round(tokens / seconds, 2),
        "tokens_per_step": round(tokens / steps, 3),
        "accepted": accepted,
        "grammar_share_of_accepted": round(by_grammar / accepted, 3) if accepted else 0.0,
    }, outputs


def mask_cost_ms(engine: Engine, num_rows: int, width: int, repeats: int = 5) -> float:
    """Milliseconds of one step's grammar masks: ``num_rows`` rows of ``width`` positions, each
    row's matcher part way through a record (its drafts are the record's next tokens)."""
    import torch

    record = json.dumps({"customer": "Lena", "city": "Bergen", "item": "kettle", "quantity": 12})
    tokens = engine.tokenizer(record, add_special_tokens=False).input_ids
    grammars = []
    for _ in range(num_rows):
        grammar = engine.grammars.matcher(SPEC)
        grammar.observe(tokens[:4])
        grammars.append(grammar)
    draft = tokens[4 : 4 + width - 1]
    logits = torch.zeros(len(draft) + 1, engine.vocab_size)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for grammar in grammars:
            grammar.mask(logits, draft)
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 3)


def markdown_table(payload: dict) -> str:
    lines = [
        "| C | constrained off tok/s | constrained auto tok/s | auto / off | tokens/step off / auto "
        "| grammar's share of accepted drafts | outputs |",
        "|---|---|---|---|---|---|---|",
    ]
    for level, cell in payload["cells"].items():
        off, auto = cell["off"], cell["auto"]
        lines.append(
            f"| {level} | {off['tokens_per_s']:.1f} | {auto['tokens_per_s']:.1f} | "
            f"{auto['tokens_per_s'] / off['tokens_per_s']:.2f}x | {off['tokens_per_step']:.2f} / "
            f"{auto['tokens_per_step']:.2f} | {auto['grammar_share_of_accepted']:.0%} | "
            f"{'identical' if cell['identical'] else 'DIFFER'} |"
        )
    lines += [
        "",
        "| rows x positions | grammar masks ms | forward ms | masks / forward |",
        "|---|---|---|---|",
    ]
    for shape, cell in payload["mask_cost"].items():
        share = cell["mask_ms"] / cell["forward_ms"]
        lines.append(f"| {shape} | {cell['mask_ms']:.2f} | {cell['forward_ms']:.1f} | {share:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 requests per cell")
    args = parser.parse_args()
    model, tokenizer = load_model()
    calibration = Calibration()
    engine = Engine(model, tokenizer, EngineConfig(), calibration=calibration)
    prompts = extraction_prompts(tokenizer, 16 if args.quick else 32)
    run_cell(engine, prompts[:2], 2, "auto")  # first calls pay one-off costs
    cells = {}
    for level in LEVELS:
        off, off_outputs = run_cell(engine, prompts, level, "off")
        auto, auto_outputs = run_cell(engine, prompts, level, "auto")
        cells[str(level)] = {"off": off, "auto": auto, "identical": off_outputs == auto_outputs}
        print(f"C={level}: off {off}, auto {auto}, identical {off_outputs == auto_outputs}", flush=True)
    forward = measure_step_times(model, [1, 17], rows=[1, 64], repeats=3).step_time
    mask_cost = {
        f"{rows} x {width}": {
            "mask_ms": mask_cost_ms(engine, rows, width),
            "forward_ms": round(1000 * forward.estimate(rows, rows * width), 1),
        }
        for rows in (1, 64)
        for width in (1, 17)
    }
    payload = {
        "benchmark": "structured",
        "meta": run_metadata(model, "float32", "benchmarks.structured"),
        "requests": len(prompts),
        "cells": cells,
        "mask_cost": mask_cost,
    }
    print(markdown_table(payload))
    print(f"results: {write_result('structured_float32' + ('_quick' if args.quick else ''), payload)}")


if __name__ == "__main__":
    main()
