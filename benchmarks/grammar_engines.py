"""llguidance against xgrammar on this server's work: what compiling a schema costs, and what
the token masks of a step cost, for the embedded model's tokenizer.

- Compile: a JSON schema the engine has not seen (its keys renamed each time, so no cache
  helps) to a matcher ready for its first mask; the median of ``--schemas`` schemas.
- Masks: rows of 1 and 17 positions (a plain step; a verification of 16 drafts, each position
  masked after the drafts before it, then rolled back) at 1 and 64 rows, each row's matcher part
  way through a record; the best of five repeats, one row after another (as the engine masks).

Both with JSON written compactly (no free whitespace). xgrammar is not a dependency of this
project: ``make bench-grammar-engines`` installs it beside the venv (``--no-deps``: its Triton
requirement is for GPU kernels this CPU run does not use) and runs this.

    python -m benchmarks.grammar_engines
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from benchmarks.common import publish_run, run_metadata, suite_parser
from benchmarks.structured import SCHEMA
from nasd_core.loader import load_model
from nasd_core.structured import JSON_OPTIONS, parser_limits

RECORD = {"customer": "Lena", "city": "Bergen", "item": "kettle", "quantity": 12}
SHAPES = ((1, 1), (1, 17), (64, 1), (64, 17))


def renamed(schema: dict, index: int) -> tuple[dict, dict]:
    """The schema and the record with every key suffixed by ``index``: new to any cache."""
    properties = {f"{key}_{index}": value for key, value in schema["properties"].items()}
    fresh = {**schema, "properties": properties, "required": list(properties)}
    return fresh, {f"{key}_{index}": value for key, value in RECORD.items()}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def matcher(self, schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return llguidance.LLMatcher(self.tokenizer, grammar, limits=parser_limits())

    def bitmask(self, num_positions: int) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(num_positions, self.vocab_size)

    def fill(self, matcher, bitmask: torch.Tensor, position: int) -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, position)

    def consume(self, matcher, tokens: list[int]) -> None:
        assert matcher.consume_tokens(tokens)

    def rollback(self, matcher, count: int) -> None:
        matcher.rollback(count)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, num_positions: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(num_positions, self.vocab_size)

    def fill(self, matcher, bitmask: torch.Tensor, position: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, position)

    def consume(self, matcher, tokens: list[int]) -> None:
        for token in tokens:
            assert matcher.accept_token(token)

    def rollback(self, matcher, count: int) -> None:
        matcher.rollback(count)


def compile_ms(engine, num_schemas: int) -> float:
    times = []
    for index in range(num_schemas):
        schema, _ = renamed(SCHEMA, 1000 + index)
        started = time.perf_counter()
        matcher = engine.matcher(schema)
        engine.fill(matcher, engine.bitmask(1), 0)
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def mask_ms(engine, tokenizer, num_rows: int, width: int, repeats: int = 5) -> float:
    schema, record = renamed(SCHEMA, 7)
    tokens = tokenizer(json.dumps(record), add_special_tokens=False).input_ids
    matchers = [engine.matcher(schema) for _ in range(num_rows)]
    for matcher in matchers:
        engine.consume(matcher, tokens[:4])
    draft = tokens[4 : 4 + width - 1]
    bitmask = engine.bitmask(width)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for matcher in matchers:
            for position in range(width):
                engine.fill(matcher, bitmask, position)
                if position + 1 < width:
                    engine.consume(matcher, [draft[position]])
            if width > 1:
                engine.rollback(matcher, width - 1)
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 3)


def masks_differ(engines: list, tokenizer) -> tuple[int, int]:
    """At how many positions along a record the engines' masks differ, of how many. They differ
    where they read a schema differently: xgrammar also allows other tokenizations of a forced
    key (``c`` + ``ustomer`` for ``customer``) and special tokens inside strings; llguidance also
    allows tokens that end in the backslash of an escape."""
    schema, record = renamed(SCHEMA, 3)
    tokens = tokenizer(json.dumps(record), add_special_tokens=False).input_ids
    masks = []
    for engine in engines:
        matcher, bitmask, rows = engine.matcher(schema), engine.bitmask(1), []
        for token in tokens:
            engine.fill(matcher, bitmask, 0)
            rows.append(bitmask.clone())
            engine.consume(matcher, [token])
        masks.append(torch.cat(rows))
    differ = (masks[0] != masks[1]).any(dim=1)
    return int(differ.sum()), len(tokens)


def markdown_table(payload: dict) -> str:
    names = list(payload["engines"])
    lines = [
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        "| compile a new schema, ms (median) | "
        + " | ".join(f"{payload['engines'][name]['compile_ms']:.1f}" for name in names)
        + " |",
    ]
    for shape in payload["engines"][names[0]]["mask_ms"]:
        cells = " | ".join(f"{payload['engines'][name]['mask_ms'][shape]:.2f}" for name in names)
        lines.append(f"| masks of {shape} rows x positions, ms | {cells} |")
    differ, total = payload["masks_differ"]
    lines.append(
        f"| positions of a record where the masks differ | {differ} of {total} |" + " |" * (len(names) - 1)
    )
    return "\n".join(lines)


def main() -> None:
    parser = suite_parser(__doc__)
    parser.add_argument("--schemas", type=int, default=20, help="schemas compiled per engine")
    args = parser.parse_args()
    model, tokenizer = load_model()
    vocab_size = model.config.vocab_size
    makers: list[Callable] = [LLGuidance, XGrammar]
    engines = [make(tokenizer, vocab_size) for make in makers]
    results = {}
    for engine in engines:
        compile_ms(engine, 2)  # first calls pay one-off costs
        results[engine.name] = {
            "compile_ms": compile_ms(engine, args.schemas),
            "mask_ms": {
                f"{rows} x {width}": mask_ms(engine, tokenizer, rows, width) for rows, width in SHAPES
            },
        }
        print(engine.name, results[engine.name], flush=True)
    payload = {
        "benchmark": "grammar_engines",
        "meta": run_metadata(model, "float32", "benchmarks.grammar_engines"),
        "engines": results,
        "masks_differ": masks_differ(engines, tokenizer),
    }
    publish_run("grammar_engines", payload, markdown_table)


if __name__ == "__main__":
    main()
