"""Host time of a plain step: ``auto`` with every row's gate closed against ``off``, by row count.

A step in which no row runs its speculative path (every gate closed: ``gate.DraftGate``) must
cost what a step of ``off`` does, since that is the step a request whose drafts do not pay is
sent back to. The engine runs the server's CPU default (the GGUF blocks) on the embedded model.
For each row count the same prompts decode ``DECODE_STEPS`` steps under ``off`` and under
``auto`` with every gate closed, the two alternating ``ROUNDS`` times on one engine (its
kernels and pool warm for both); each decode step is timed around ``Engine.step`` (steps with
prompt chunks are not counted), and a mode reads the median of its steps.

    python -m benchmarks.plain_step             # rows 1 and 8
"""

from __future__ import annotations

import argparse
import time
from statistics import median

from benchmarks.common import rotated, run_metadata, write_result
from benchmarks.workloads import chat_ids, distinct_prompts
from nasd_core.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.models import load_model

ROWS = (1, 8)
ROUNDS = 5
DECODE_STEPS = 48
CLOSED = 10**6  # plain steps left on a closed gate: closed for the whole run


def decode_step_seconds(engine: Engine, prompts: list[list[int]], mode: str) -> list[float]:
    """``prompts`` decoded together under ``mode`` (``auto``: every gate closed): each decode
    step's wall time."""
    spec = SpecConfig(mode=mode)
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    request_ids = [engine.add_request(prompt, params, spec) for prompt in prompts]
    for request_id in request_ids:
        engine.requests[request_id].gate.plain_steps_left = CLOSED
    seconds = []
    while not engine.is_finished():
        decoding = not engine.waiting and not engine.prefilling
        started = time.perf_counter()
        engine.step()
        if decoding:
            seconds.append(time.perf_counter() - started)
    for request_id in request_ids:
        result = engine.pop_result(request_id)
        assert result.stats.num_speculative_steps == 0, "a closed gate ran its speculative path"
    return seconds


def measure(engine: Engine, tokenizer, num_rows: int) -> dict:
    """``off`` and gated ``auto`` at ``num_rows`` rows, alternating, new prompts each round."""
    conversations = distinct_prompts(["creative"], 2 * ROUNDS * num_rows, seed=23)
    prompts = [chat_ids(tokenizer, messages) for messages in conversations]
    steps: dict[str, list[float]] = {"off": [], "auto": []}
    for number in range(ROUNDS):
        for index, mode in enumerate(rotated(("off", "auto"), number)):
            start = (2 * number + index) * num_rows
            steps[mode] += decode_step_seconds(engine, prompts[start : start + num_rows], mode)
    medians = {mode: median(seconds) * 1000 for mode, seconds in steps.items()}
    return {
        "rows": num_rows,
        "steps": {mode: len(seconds) for mode, seconds in steps.items()},
        "off_ms": round(medians["off"], 3),
        "auto_ms": round(medians["auto"], 3),
        "auto_over_off": round(medians["auto"] / medians["off"], 3),
    }


def markdown_table(payload: dict) -> str:
    meta = payload["meta"]
    lines = [
        f"Host: {meta.get('processor')}, {meta.get('isa')}. Engine: GGUF blocks, defaults.",
        "",
        "| rows | off step (median) | auto step, every gate closed | auto / off |",
        "|---|---|---|---|",
    ]
    for row in payload["rows"]:
        ratio = row["auto_over_off"]
        lines.append(f"| {row['rows']} | {row['off_ms']:.2f} ms | {row['auto_ms']:.2f} ms | {ratio:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = parser.parse_args()
    model, tokenizer = load_model(config=ModelConfig(dtype="gguf"))
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=max(args.rows)))
    payload = {
        "benchmark": "plain_step",
        "meta": run_metadata(model, "gguf", "benchmarks.plain_step"),
        "rounds": ROUNDS,
        "decode_steps": DECODE_STEPS,
        "rows": [measure(engine, tokenizer, num_rows) for num_rows in args.rows],
    }
    path = write_result("plain_step_gguf", payload)
    print(markdown_table(payload))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
