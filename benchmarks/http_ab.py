"""``auto`` against ``off`` through HTTP where the two are closest: interleaved rounds, each on
prompts neither server has seen.

The HTTP sweep (``benchmarks/http.py``) runs each mode once per cell. Where ``auto`` drafts
next to nothing (creative text at 16 and 32 concurrent requests) it differs from ``off`` by
less than two runs of one mode differ on this machine, so one run each cannot tell them
apart. This suite serves ``off`` and ``auto`` (one replica each, as the sweep does) and runs
each of ``CELLS`` ``ROUNDS`` times, on fresh prompts every round (a server that saw a prompt
drafts its answer from memory), the order of the servers rotating by round; it reports every
round's ``auto`` / ``off`` tokens/s and their geometric mean. A third server, a second ``off``
(``off:control``), runs every round too: its tokens/s over the first ``off``'s is the noise
floor of the round, two servers doing the same work.

    python -m benchmarks.http_ab            # creative text at C = 16 and 32, 3 rounds
    python -m benchmarks.http_ab --quick    # one round at C = 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
from statistics import geometric_mean

from benchmarks.common import grouped_bars, new_figure, publish_run, rotated, run_metadata
from benchmarks.concurrency import MIXES
from benchmarks.http import (
    MAX_TOKENS,
    counters_delta,
    engine_counters,
    run_cell,
    served_modes,
    speculation_of,
)
from benchmarks.workloads import distinct_prompts
from nasd_core.loader import load_model

MODES = ("off", "auto", "off:control")
CELLS = {"non_repetitive": (16, 32)}
QUICK_CELLS = {"non_repetitive": (16,)}
ROUNDS = 3
SEED = 11  # prompts other than the sweep's (seed 3), though each run starts fresh servers


def run(cells: dict[str, tuple[int, ...]], rounds: int, num_cpus: int) -> dict:
    """Every round of every (mix, C) in ``cells``: both modes' cell summaries and the ratio."""
    with served_modes(1, num_cpus, MODES) as urls:
        results: dict[str, dict] = {}
        for mix, levels in cells.items():
            prompts = distinct_prompts(MIXES[mix], rounds * sum(2 * level for level in levels), seed=SEED)
            for level in levels:
                runs = []
                for number in range(rounds):
                    batch, prompts = prompts[: 2 * level], prompts[2 * level :]
                    row, texts = {}, {}
                    # Each server goes first, second and last in turn, so slow drift favours none.
                    for mode in rotated(MODES, number):
                        before = engine_counters(urls[mode])
                        row[mode], texts[mode] = asyncio.run(
                            run_cell(urls[mode], batch, level, speculation_of(mode), MAX_TOKENS)
                        )
                        # What the engine did: how many of its steps verified drafts, and how
                        # many of those drafts were accepted.
                        row[mode]["engine"] = counters_delta(before, engine_counters(urls[mode]))
                    ratio = row["auto"]["tokens_per_s"] / row["off"]["tokens_per_s"]
                    control = row["off:control"]["tokens_per_s"] / row["off"]["tokens_per_s"]
                    identical = texts["auto"] == texts["off"] == texts["off:control"]
                    rounded = {"ratio": round(ratio, 3), "control": round(control, 3)}
                    runs.append({**row, **rounded, "identical": identical})
                    print(mix, level, number, runs[-1]["ratio"], runs[-1]["control"], row["auto"]["engine"])
                geomean = geometric_mean([entry["ratio"] for entry in runs])
                results.setdefault(mix, {})[str(level)] = {
                    "rounds": runs,
                    "geomean_ratio": round(geomean, 3),
                    "geomean_control": round(geometric_mean([entry["control"] for entry in runs]), 3),
                    "identical": all(entry["identical"] for entry in runs),
                }
        return results


def markdown_table(payload: dict) -> str:
    lines = [
        "| mix | C | auto / off, each round | geometric mean | control: off / off, each round "
        "| geometric mean | off tok/s (mean) | ITL p50 ms off / auto (mean) | auto steps with drafts "
        "| auto drafts accepted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mix, levels in payload["results"].items():
        for level, cell in levels.items():
            runs = cell["rounds"]
            flag = "" if cell["identical"] else " ≠"
            off_rate = sum(entry["off"]["tokens_per_s"] for entry in runs) / len(runs)
            itl = [sum(entry[mode]["itl_p50_ms"] for entry in runs) / len(runs) for mode in ("off", "auto")]
            engine = {
                name: sum(entry["auto"]["engine"][name] for entry in runs)
                for name in ("steps", "drafted_steps", "drafted", "accepted")
            }
            drafted_steps = f"{engine['drafted_steps']} / {engine['steps']}" if engine["steps"] else "-"
            accepted = f"{engine['accepted']} / {engine['drafted']}" if engine["drafted"] else "-"
            lines.append(
                f"| {mix} | {level} | {', '.join(format(entry['ratio'], '.3f') for entry in runs)} "
                f"| {cell['geomean_ratio']:.3f}x{flag} "
                f"| {', '.join(format(entry['control'], '.3f') for entry in runs)} "
                f"| {cell['geomean_control']:.3f}x | {off_rate:.1f} | {itl[0]:.0f} / {itl[1]:.0f} "
                f"| {drafted_steps} | {accepted} |"
            )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """The geometric mean of ``auto`` / ``off`` per cell, keyed for comparing two runs."""
    return {
        f"{mix}/C={level}/auto": cell["geomean_ratio"]
        for mix, levels in payload["results"].items()
        for level, cell in levels.items()
    }


def plot(payload: dict):
    figure, axes = new_figure(1)
    cells = [(mix, level) for mix, levels in payload["results"].items() for level in levels]
    num_rounds = max(len(payload["results"][mix][level]["rounds"]) for mix, level in cells)
    series = {
        f"round {number + 1}": [
            payload["results"][mix][level]["rounds"][number]["ratio"]
            if number < len(payload["results"][mix][level]["rounds"])
            else 0.0
            for mix, level in cells
        ]
        for number in range(num_rounds)
    }
    series["control: off / off, geometric mean"] = [
        payload["results"][mix][level]["geomean_control"] for mix, level in cells
    ]
    grouped_bars(axes[0], [f"{mix} C={level}" for mix, level in cells], series, "tokens/s over off")
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_title("HTTP, auto against off by round; a second off server as control")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cells, rounds = (QUICK_CELLS, 1) if args.quick else (CELLS, ROUNDS)
    num_cpus = os.cpu_count() or 2
    results = run(cells, rounds, num_cpus)
    model, _ = load_model()  # for the metadata only (the replicas load their own copy)
    payload = {
        "benchmark": "http_ab",
        "meta": {
            **run_metadata(model, "float32", "benchmarks.http_ab"),
            "max_tokens": MAX_TOKENS,
            "rounds": rounds,
            "ray_cpus": num_cpus,
        },
        "results": results,
    }
    publish_run("http_ab", "float32", args.quick, payload, plot, markdown_table)


if __name__ == "__main__":
    main()
