"""The engine's two kinds of draft sources side by side: `auto` with the n-gram sources (prompt
lookup + an n-gram index of the request, an n-gram replica index) against `auto` with the suffix
stores (the request's own tokens and the replica's finished requests, matched by suffix in the
compiled store), both beside `off`, in one process on the same prompts.

Each engine reads a replica index already holding what a server would have seen: the drafter
replay's recorded greedy traces (``benchmarks/traces``: 16 requests of each workload generator,
other prompts than the ones measured here; its long chats left out, since this suite's long-chat
prompts are the same ones), learned into an index of its own kind. Concurrency C runs 2C
requests of 64 tokens with ``max_batch_rows=C``; every system runs ``REPEATS`` times per cell,
interleaved, and its figures pool the runs.

    python -m benchmarks.drafter_ab            # C = 1, 4, 16 on the repetitive, creative and long-chat mixes
    python -m benchmarks.drafter_ab --quick    # C = 4 on the repetitive and creative mixes, each system once
"""

from __future__ import annotations

import argparse
import json
import time

from tqdm import tqdm

from benchmarks.common import concurrency_lines, new_figure, publish_run, run_metadata
from benchmarks.concurrency import SWEEP_MIXES, mix_prompts
from benchmarks.replay import TRACES
from nasd_core.config import EngineConfig, IndexConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.speculation.calibration import Calibration, calibrate
from nasd_core.speculation.drafter import new_shared_index

LEVELS = (1, 4, 16)
REPEATS = 2
# The quick run (part of `make bench-quick`, which must stay under 10 minutes): the full run's
# C=4 cells of two mixes, each system once (C = 1 and 4 on every mix, twice each, took ~10
# minutes alone on the AMD EPYC).
QUICK_LEVELS = (4,)
QUICK_MIXES = ("repetitive", "non_repetitive")
QUICK_REPEATS = 1
MAX_TOKENS = 64
# system -> (speculation, request-local source, replica index kind)
SYSTEMS = {
    "off": ("off", "suffix", None),
    "auto_ngram": ("auto", "hybrid", "ngram"),
    "auto_suffix": ("auto", "suffix", "suffix"),
}


def history() -> list[list[int]]:
    """What the replica index holds: the recorded traces, prompt + output, long chats left out."""
    recorded = json.loads(TRACES.read_text())["traces"]
    return [
        trace["prompt"] + trace["output"]
        for workload, traces in recorded.items()
        if workload != "long_chat"
        for trace in traces
    ]


def run_system(
    model,
    tokenizer,
    prompts: list[list[int]],
    level: int,
    system: str,
    sequences,
    calibration: Calibration,
) -> dict:
    """One run of ``system`` over ``prompts``: tokens, seconds, the engine's counters, outputs."""
    mode, local_index, kind = SYSTEMS[system]
    shared = []
    if kind is not None:
        replica = new_shared_index(IndexConfig(kind=kind))
        replica.update_many(sequences)
        shared = [("replica", replica)]
    config = EngineConfig(max_batch_rows=level, max_waiting=len(prompts))
    engine = Engine(model, tokenizer, config, shared=shared, calibration=calibration)
    spec = SpecConfig(mode=mode, local_index=local_index)
    started = time.perf_counter()
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS), spec) for prompt in prompts]
    while not engine.is_finished():
        engine.step()
    seconds = time.perf_counter() - started
    results = [engine.pop_result(request_id) for request_id in ids]
    return {
        "tokens": sum(len(result.token_ids) for result in results),
        "seconds": seconds,
        "stats": engine.stats,
        "drafting_s": sum(result.stats.drafting_time_s for result in results),
        "outputs": [result.token_ids for result in results],
    }


def run(levels: tuple[int, ...], repeats: int, mixes: tuple[str, ...] = SWEEP_MIXES) -> dict:
    model, tokenizer = load_model(config=ModelConfig(dtype="float32"))
    calibration = calibrate(model, max(levels))
    sequences = history()
    sweep: dict[str, dict] = {}
    for mix, level in tqdm([(mix, level) for mix in mixes for level in levels], unit="cell"):
        prompts = mix_prompts(tokenizer, mix, 2 * level)
        runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
        for repeat in range(repeats):
            order = list(SYSTEMS) if repeat % 2 == 0 else list(SYSTEMS)[::-1]
            for system in order:
                runs[system].append(
                    run_system(model, tokenizer, prompts, level, system, sequences, calibration)
                )
        reference = runs["off"][0]["outputs"]
        row = {}
        for system, system_runs in runs.items():
            tokens = sum(one["tokens"] for one in system_runs)
            seconds = sum(one["seconds"] for one in system_runs)
            steps = sum(one["stats"].num_steps for one in system_runs)
            drafted = sum(one["stats"].num_drafted for one in system_runs)
            accepted = sum(one["stats"].num_accepted for one in system_runs)
            row[system] = {
                "tokens_per_s": round(tokens / seconds, 2),
                "tokens_per_step": round(
                    sum(one["stats"].num_emitted for one in system_runs) / max(1, steps), 3
                ),
                "drafted_per_step": round(drafted / max(1, steps), 2),
                "acceptance": round(accepted / max(1, drafted), 3),
                "drafting_share": round(sum(one["drafting_s"] for one in system_runs) / seconds, 4),
                "run_tokens_per_s": [round(one["tokens"] / one["seconds"], 2) for one in system_runs],
                "identical_to_off": all(one["outputs"] == reference for one in system_runs),
            }
        for system in SYSTEMS:
            row[system]["ratio_to_off"] = round(row[system]["tokens_per_s"] / row["off"]["tokens_per_s"], 3)
        sweep.setdefault(mix, {})[str(level)] = row
    return {
        "benchmark": "drafter_ab",
        "meta": {
            **run_metadata(model, "float32", "benchmarks.drafter_ab"),
            "max_tokens": MAX_TOKENS,
            "repeats": repeats,
            "history_sequences": len(sequences),
            "history_tokens": sum(len(sequence) for sequence in sequences),
        },
        "sweep": sweep,
    }


def markdown_table(payload: dict) -> str:
    lines = [
        "| mix | C | off tok/s | auto ngram / off | auto suffix / off | suffix / ngram "
        "| tokens per step ngram / suffix | drafted per step ngram / suffix "
        "| drafting share ngram / suffix |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mix, levels in payload["sweep"].items():
        for level, row in levels.items():
            ngram, suffix = row["auto_ngram"], row["auto_suffix"]
            same = "" if all(row[system]["identical_to_off"] for system in SYSTEMS) else " ≠"
            lines.append(
                f"| {mix} | {level} | {row['off']['tokens_per_s']:.1f} | {ngram['ratio_to_off']:.2f}x "
                f"| {suffix['ratio_to_off']:.2f}x{same} "
                f"| {suffix['tokens_per_s'] / ngram['tokens_per_s']:.2f}x "
                f"| {ngram['tokens_per_step']:.2f} / {suffix['tokens_per_step']:.2f} "
                f"| {ngram['drafted_per_step']:.1f} / {suffix['drafted_per_step']:.1f} "
                f"| {100 * ngram['drafting_share']:.1f}% / {100 * suffix['drafting_share']:.1f}% |"
            )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """Each auto system's tokens/s over off's, keyed for comparing two runs."""
    return {
        f"{mix}/C={level}/{system}": row[system]["ratio_to_off"]
        for mix, levels in payload["sweep"].items()
        for level, row in levels.items()
        for system in SYSTEMS
        if system != "off"
    }


def plot(payload: dict):
    figure, axes = new_figure(len(payload["sweep"]))
    for axis, (mix, levels) in zip(axes, payload["sweep"].items()):
        concurrency_lines(
            axis, levels, {system: system for system in SYSTEMS}, "tokens_per_s", f"drafters, {mix}"
        )
        axis.set_ylabel("output tokens/s")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"C = {QUICK_LEVELS} on {QUICK_MIXES} only")
    args = parser.parse_args()
    payload = run(QUICK_LEVELS, QUICK_REPEATS, QUICK_MIXES) if args.quick else run(LEVELS, REPEATS)
    publish_run("drafter_ab", "float32", args.quick, payload, plot, markdown_table)


if __name__ == "__main__":
    main()
