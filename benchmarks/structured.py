"""Structured output under speculation: constrained ``auto`` against constrained ``off``, and
what the grammar's masks cost a step.

- JSON extraction: a short order note mentions a customer, a city, an item and a quantity; the
  answer is a JSON record of them under a strict schema (``response_format`` json_schema). The
  engine alone, C = 1 and 16, greedy, max_tokens 64, one run of each mode in one process;
  tokens/s, tokens per step and the share of accepted drafts the grammar itself drafted
  (jump-forward: keys and punctuation the schema forces). Every output is checked against the
  schema, and constrained ``auto`` against constrained ``off`` token for token.
- Agent tool calls: an assistant works through an order in three turns, each a forced tool call
  (``tool_choice`` required, the hermes format, tools described in the system message as the
  server does for the embedded template): look the customer up, check the stock, ship. Each
  turn's prompt is the conversation so far, with the earlier calls (the model's own, parsed)
  and the tools' answers; a turn's calls are checked against the tools' schemas.
- Mask cost: ``RequestGrammar.mask`` for rows of 1 and 17 positions at 1 and 64 rows (a step's
  grammar work), beside the same step's forward on this CPU (``measure_step_times``).

    python -m benchmarks.structured            # 32 extractions, 16 conversations per cell
    python -m benchmarks.structured --quick    # 16 and 8
"""

from __future__ import annotations

import json
import random
import time

import jsonschema

from benchmarks.common import grouped_bars, new_figure, publish_run, result_name, run_metadata, suite_parser
from benchmarks.workloads import _CITIES, _ITEMS, _NAMES, chat_ids
from deployments.tools import HERMES, ToolStream, chat_template_inputs
from nasd_core.config import EngineConfig, GrammarSpec, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.speculation.calibration import Calibration, measure_step_times
from nasd_core.structured import apply_masks, grammar_masks

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
WORKLOADS = ("JSON extraction", "agent tool calls")
MAX_TOKENS = 64


def _tool(function_name: str, description: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": function_name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


_TEXT = {"type": "string", "maxLength": 24}
AGENT_TOOLS = [
    _tool("find_customer", "Look a customer up by name and city.", {"name": _TEXT, "city": _TEXT}),
    _tool("check_stock", "Units of an item in the warehouse nearest a city.", {"item": _TEXT, "city": _TEXT}),
    _tool(
        "create_shipment",
        "Ship units of an item to a customer.",
        {"customer_id": _TEXT, "item": _TEXT, "quantity": {"type": "integer"}},
    ),
]
AGENT_SPEC = GrammarSpec(kind="lark", source=HERMES.grammar(AGENT_TOOLS, parallel=False), param="tool_choice")
AGENT_TURNS = 3
AGENT_SYSTEM = (
    "You are an order assistant. For each order: find the customer, check the stock of the item, "
    "then create the shipment. Call one tool per turn."
)


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


def summary(results: list, seconds: float) -> tuple[dict, list[list[int]]]:
    """A cell's figures from its requests' results, and their outputs (to compare modes)."""
    tokens = sum(len(result.token_ids) for result in results)
    steps = sum(result.stats.num_steps for result in results)
    accepted = sum(result.stats.num_accepted for result in results)
    by_grammar = sum(result.stats.accepted_by_source.get("grammar", 0) for result in results)
    return {
        "tokens_per_s": round(tokens / seconds, 2),
        "tokens_per_step": round(tokens / steps, 3),
        "accepted": accepted,
        "grammar_share_of_accepted": round(by_grammar / accepted, 3) if accepted else 0.0,
    }, [result.token_ids for result in results]


def run_cell(
    engine: Engine, prompts: list[list[int]], concurrency: int, mode: str
) -> tuple[dict, list[list[int]]]:
    """Every prompt through ``engine`` with at most ``concurrency`` running at once."""
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=SPEC)
    started = time.perf_counter()
    results = []
    for start in range(0, len(prompts), concurrency):
        for result in engine.generate(prompts[start : start + concurrency], params, SpecConfig(mode=mode)):
            jsonschema.validate(json.loads(result.text), SCHEMA)
            results.append(result)
    return summary(results, time.perf_counter() - started)


def agent_conversations(count: int, seed: int = 1) -> list[list[dict]]:
    """Each conversation's opening: the system message and an order to work through."""
    rng = random.Random(seed)
    openings = []
    for _ in range(count):
        name, city, item = rng.choice(_NAMES).title(), rng.choice(_CITIES), rng.choice(_ITEMS)
        order = f"New order: {name} in {city} wants {rng.randint(2, 40)} units of the {item}."
        openings.append([{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": order}])
    return openings


def tool_answer(call: dict) -> str:
    """What the named tool answers (made up from its arguments, the same for the same call)."""
    arguments = json.loads(call["function"]["arguments"])
    digest = sum(map(ord, json.dumps(arguments, sort_keys=True))) % 900 + 100
    name = call["function"]["name"]
    if name == "find_customer":
        return json.dumps(
            {"customer_id": f"C-{digest}", "name": arguments["name"], "city": arguments["city"]}
        )
    if name == "check_stock":
        return json.dumps({"item": arguments["item"], "warehouse": f"W-{digest % 7}", "units": digest})
    return json.dumps({"shipment_id": f"S-{digest}", "status": "scheduled"})


def run_agent_cell(
    engine: Engine, openings: list[list[dict]], concurrency: int, mode: str
) -> tuple[dict, list[list[int]]]:
    """Every conversation's turns through ``engine``, ``concurrency`` conversations at once, turn
    by turn (a turn's prompt holds the calls and answers before it)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=AGENT_SPEC)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in AGENT_TOOLS}
    started = time.perf_counter()
    results = []
    for start in range(0, len(openings), concurrency):
        conversations = [list(opening) for opening in openings[start : start + concurrency]]
        for _ in range(AGENT_TURNS):
            prompts = [
                chat_ids(engine.tokenizer, chat_template_inputs(messages, AGENT_TOOLS, HERMES, False)[0])
                for messages in conversations
            ]
            for messages, result in zip(
                conversations, engine.generate(prompts, params, SpecConfig(mode=mode))
            ):
                stream = ToolStream(HERMES)
                stream.push(result.text, finished=True)
                (call,) = [call.model_dump() for call in stream.calls]
                jsonschema.validate(
                    json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]]
                )
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_answer(call)})
                results.append(result)
    return summary(results, time.perf_counter() - started)


def mask_cost_ms(engine: Engine, num_rows: int, width: int, repeats: int = 5) -> float:
    """Milliseconds of one step's grammar masks as verification computes them: ``num_rows``
    rows of ``width`` positions filled in one call, then applied row by row; each row's matcher
    part way through a record (its drafts are the record's next tokens)."""
    import torch

    record = json.dumps({"customer": "Lena", "city": "Bergen", "item": "kettle", "quantity": 12})
    tokens = engine.tokenizer(record, add_special_tokens=False).input_ids
    grammars = []
    for _ in range(num_rows):
        grammar = engine.grammars.matcher(SPEC)
        grammar.observe(tokens[:4])
        grammars.append(grammar)
    draft = tokens[4 : 4 + width - 1]
    logits = torch.zeros(num_rows * width, engine.vocab_size)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        bitmask = grammar_masks(
            [(grammar, row * width, draft) for row, grammar in enumerate(grammars)], len(logits)
        )
        for row in range(num_rows):
            apply_masks(logits[row * width : (row + 1) * width], bitmask[row * width : (row + 1) * width])
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 3)


def ratios(payload: dict) -> dict[str, float]:
    """Constrained auto over constrained off, by workload and concurrency."""
    return {
        f"{workload}/C={level}": round(cell["auto"]["tokens_per_s"] / cell["off"]["tokens_per_s"], 3)
        for workload, cells in payload["workloads"].items()
        for level, cell in cells.items()
    }


def plot(payload: dict):
    """Constrained off and auto tokens/s by concurrency, a panel per workload."""
    figure, axes = new_figure(len(WORKLOADS))
    for axis, workload in zip(axes, WORKLOADS):
        cells = payload["workloads"][workload]
        grouped_bars(
            axis,
            [f"C={level}" for level in cells],
            {mode: [cell[mode]["tokens_per_s"] for cell in cells.values()] for mode in ("off", "auto")},
            "output tokens/s",
        )
        axis.set_title(f"{workload}: constrained off / auto")
    return figure


def markdown_table(payload: dict) -> str:
    lines = [
        "| workload | C | constrained off tok/s | constrained auto tok/s | auto / off | tokens/step off / "
        "auto | grammar's share of accepted drafts | outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells = [(name, level, cell) for name in WORKLOADS for level, cell in payload["workloads"][name].items()]
    for workload, level, cell in cells:
        off, auto = cell["off"], cell["auto"]
        lines.append(
            f"| {workload} | {level} | {off['tokens_per_s']:.1f} | {auto['tokens_per_s']:.1f} | "
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
    parser = suite_parser(__doc__, quick="16 extractions and 8 conversations per cell")
    args = parser.parse_args()
    model, tokenizer = load_model()
    calibration = Calibration()
    engine = Engine(model, tokenizer, EngineConfig(), calibration=calibration)
    count = 16 if args.quick else 32
    runs = {
        "JSON extraction": (run_cell, extraction_prompts(tokenizer, count)),
        "agent tool calls": (run_agent_cell, agent_conversations(count // 2)),
    }
    workloads: dict[str, dict] = {}
    for workload, (run, inputs) in runs.items():
        run(engine, inputs[:2], 2, "auto")  # first calls pay one-off costs
        workloads[workload] = {}
        for level in LEVELS:
            off, off_outputs = run(engine, inputs, level, "off")
            auto, auto_outputs = run(engine, inputs, level, "auto")
            identical = off_outputs == auto_outputs
            workloads[workload][str(level)] = {"off": off, "auto": auto, "identical": identical}
            print(f"{workload} C={level}: off {off}, auto {auto}, identical {identical}", flush=True)
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
        "requests": {"JSON extraction": count, "agent tool calls": f"{count // 2} x {AGENT_TURNS} turns"},
        "workloads": workloads,
        "mask_cost": mask_cost,
    }
    publish_run(result_name("structured", "float32", args.quick), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
