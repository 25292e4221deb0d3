"""``auto`` against ``off`` by category through HTTP, on the server's CPU default (the GGUF blocks).

Issue 51's check that AUTO never loses: a local Ray Serve runs ``deployments.build_app`` three
times (speculation ``off``, ``auto`` and ``off`` again; one replica each, ``dtype="gguf"``, the
torch threads a lone replica gets by default: the cores but ``RAY_RESERVED_CPUS``, every core for
prompt chunks). The official
OpenAI client streams greedy chat completions of each category, one request at a time (C=1) and
eight at a time (C=8), to each server in turn, the order rotating by cell. Categories are this
project's workloads (``benchmarks.workloads``: the repetitive ones and the others, multi-turn
included) and long chats of 600-1600 prompt tokens. Every prompt is new to each server, and all
must give the same texts. The second ``off`` (``off:control``) is the noise floor: its tokens/s
over the first ``off``'s is what two servers doing the same work differ by in that cell.

A category's eight chats at C=8 are one wave: its time is its slowest chat's, and a chat's
accepted drafts save nothing once a faster one finishes. A server's load is rather a stream of
mixed requests kept eight in flight, where a finished chat's slot takes the next: the ``mixed``
cell sends ``MIXED_PER_CATEGORY`` new chats of every category, interleaved, that way, and
reads each category's tokens over its requests' own seconds there as well as the whole run's.
In that closed loop a faster server is also sent its next prompts sooner, so each request shares
more steps with other prompts' chunks. The ``arrivals`` cell sends as many new chats at a fixed
rate instead, the same for every server (``ARRIVAL_LOAD`` of the rate at which ``off`` finished
the mixed cell's chats, which are other ones: the load is near its capacity, not exactly that
share), and reads each category the same way: how long a server takes over the same requests
arriving at the same times. Both stream cells go to the servers in slices of ``STREAM_SLICE``
chats, the servers' order rotated at each slice as at each wave.

With ``--repeats N`` every cell is sent N times, each time with new prompts, and reads the N rounds
pooled (tokens over seconds). A category's round goes to the servers a wave at a time (``waves``:
one chat at C=1, all eight at C=8), the servers' order rotated at each wave; each wave's ratios
are kept beside (``rounds``), their spread what one wave of that cell can be trusted to.

    python -m benchmarks.http_categories               # 4 prompts per category at C=1, 8 at C=8
    python -m benchmarks.http_categories --quick       # 2 and 8, fewer categories
    python -m benchmarks.http_categories --repeats 3   # three rounds of new prompts per cell
    python -m benchmarks.http_categories --categories creative hot_sampled --repeats 4  # these alone
"""

from __future__ import annotations

import asyncio
from statistics import geometric_mean

from benchmarks.common import (
    grouped_bars,
    new_figure,
    publish_run,
    result_name,
    rotated,
    run_metadata,
    suite_parser,
)
from benchmarks.serving import (
    counters_delta,
    engine_counters,
    run_requests,
    served_modes,
    speculation_of,
    summarise,
)
from benchmarks.workloads import REPETITIVE, WORKLOADS, distinct_prompts, hot_sampled, long_chat_messages
from deployments.builder import RAY_RESERVED_CPUS, visible_cpus
from nasd_core.config import ModelConfig
from nasd_core.loader import load_model

# ``off:control``: a second ``off`` server; its tokens/s over the first's is the noise floor of a
# cell (two servers doing the same work), which a ratio of auto over off must be read against.
MODES = ("off", "auto", "off:control")
LONG_CHAT = "long_chat"
# The adversarial category: answers sampled hot, where next to no draft is accepted.
HOT_SAMPLED = "hot_sampled"
CATEGORIES = (*WORKLOADS, LONG_CHAT, HOT_SAMPLED)
QUICK_CATEGORIES = ("code_edit", "rag_quote", "creative", "multi_turn", LONG_CHAT, HOT_SAMPLED)
# Requests per category at each concurrency (C=8: one full wave).
REQUESTS = {1: 4, 8: 8}
QUICK_REQUESTS = {1: 2, 8: 8}
# The mixed cell: chats per category, eight in flight.
MIXED_PER_CATEGORY = 4
MIXED_CONCURRENCY = 8
# The stream cells go to the servers in slices of this many chats, the servers' order rotated at
# each: sent whole, one server after another, the first ran a quarter faster than its identical
# control on a 2-vCPU host whose clock drifts over a minute (docs/results.md).
STREAM_SLICE = 12
# The arrivals cell sends chats at this share of the rate at which off finished the mixed cell's:
# several requests in flight, yet well below capacity, where latency swings with small differences
# (0.8 came too near it: docs/results.md).
ARRIVAL_LOAD = 0.6


def category_prompts(tokenizer, category: str, count: int, skip: int) -> list:
    """``count`` conversations of ``category`` after its first ``skip`` (distinct across cells)."""
    if category == LONG_CHAT:
        return long_chat_messages(tokenizer, skip + count)[skip:]
    if category == HOT_SAMPLED:
        return hot_sampled(skip + count, seed=5)[skip:]
    return distinct_prompts([category], skip + count, seed=5)[skip:]


def run(
    tokenizer,
    categories: tuple[str, ...],
    requests: dict[int, int],
    max_tokens: int,
    num_cpus: int,
    app_args: dict,
    repeats: int = 1,
) -> tuple[dict, dict, dict]:
    """Every category's cells at each concurrency, then the mixed cell and the arrivals cell,
    each sent ``repeats`` times with new prompts: (cells, mixed, arrivals)."""
    cells: dict[str, dict] = {}
    # Prompts per category a round takes: its cells', the mixed cell's and the arrivals cell's.
    per_round = sum(requests.values()) + 2 * MIXED_PER_CATEGORY
    with served_modes(1, num_cpus, MODES, app_args) as urls:
        for index, category in enumerate(categories):
            skip = 0
            for level, count in requests.items():
                rounds = [
                    category_prompts(tokenizer, category, count, skip + r * per_round) for r in range(repeats)
                ]
                skip += count
                row, _ = run_modes(urls, waves(rounds, level), level, max_tokens, index + level)
                cells.setdefault(category, {})[str(level)] = row
                print(category, level, row["auto_over_off"], row["control_over_off"], flush=True)
        skip = sum(requests.values())
        mixed = run_mixed(urls, tokenizer, categories, skip, per_round, repeats, max_tokens)
        off = mixed["off"]
        interval_s = off["seconds"] / off["requests"] / ARRIVAL_LOAD
        arrivals = run_mixed(
            urls, tokenizer, categories, skip + MIXED_PER_CATEGORY, per_round, repeats, max_tokens, interval_s
        )
    return cells, mixed, arrivals


def waves(rounds: list[list], concurrency: int) -> list[list]:
    """Each round cut into waves of ``concurrency`` chats, the turns the servers take: one chat at
    a time at C=1, so the host's drift over seconds falls on the three servers alike (a C=1 round
    of four chats a server took 2-10 s, and two servers doing the same work differed by 12% a
    round; docs/results.md)."""
    return [
        chats[start : start + concurrency] for chats in rounds for start in range(0, len(chats), concurrency)
    ]


def run_modes(
    urls: dict,
    rounds: list[list],
    concurrency: int,
    max_tokens: int,
    shift: int,
    interval_s: float | None = None,
) -> tuple[dict, dict[str, list[dict]]]:
    """Each round's conversations through every mode's server in turn (the order rotated by
    ``shift``, and once more each round; ``interval_s``: sent at that fixed interval,
    ``run_requests``): the row of each mode's summary over the rounds and engine counters, the
    ratios to ``off``, each round's (``rounds``) and whether the texts agree; and each mode's
    per-request results, round after round."""
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    seconds = dict.fromkeys(MODES, 0.0)
    counters: dict[str, dict[str, int]] = {}
    per_round = []
    for number, conversations in enumerate(rounds):
        rates = {}
        for mode in rotated(MODES, shift + number):
            before = engine_counters(urls[mode])
            cell = run_requests(
                urls[mode], conversations, concurrency, speculation_of(mode), max_tokens, interval_s
            )
            mode_results, elapsed = asyncio.run(cell)
            results[mode] += mode_results
            seconds[mode] += elapsed
            # At fixed arrivals the run's rate is the arrival rate: a round reads its requests' own.
            if interval_s is None:
                rates[mode] = sum(result["tokens"] for result in mode_results) / elapsed
            else:
                rates[mode] = category_rates(["all"] * len(mode_results), mode_results)["all"]
            delta = counters_delta(before, engine_counters(urls[mode]))
            so_far = counters.get(mode, {})
            counters[mode] = {name: so_far.get(name, 0) + value for name, value in delta.items()}
        per_round.append(
            {
                "auto_over_off": round(rates["auto"] / rates["off"], 3),
                "control_over_off": round(rates["off:control"] / rates["off"], 3),
            }
        )
    row: dict = {mode: summarise(results[mode], seconds[mode]) | {"engine": counters[mode]} for mode in MODES}
    off = row["off"]["tokens_per_s"]
    row["auto_over_off"] = round(row["auto"]["tokens_per_s"] / off, 3)
    row["control_over_off"] = round(row["off:control"]["tokens_per_s"] / off, 3)
    row["rounds"] = per_round
    texts = {mode: [result["text"] for result in mode_results] for mode, mode_results in results.items()}
    row["identical"] = texts["auto"] == texts["off"] == texts["off:control"]
    return row, results


def category_rates(names: list[str], results: list[dict]) -> dict[str, float]:
    """Each category's tokens over its requests' own seconds (``names[i]``: request i's)."""
    totals: dict[str, list[float]] = {}
    for name, result in zip(names, results, strict=True):
        total = totals.setdefault(name, [0.0, 0.0])
        total[0] += result["tokens"]
        total[1] += result["seconds"]
    return {name: tokens / seconds for name, (tokens, seconds) in totals.items()}


def run_mixed(
    urls: dict,
    tokenizer,
    categories: tuple[str, ...],
    skip: int,
    per_round: int,
    repeats: int,
    max_tokens: int,
    interval_s: float | None = None,
) -> dict:
    """Every category's next ``MIXED_PER_CATEGORY`` chats, taken in turn, ``MIXED_CONCURRENCY``
    in flight (each of ``repeats`` rounds ``per_round`` prompts further on), sent in slices of
    ``STREAM_SLICE`` chats that the servers take in turn: the whole run's
    tokens/s by mode and each category's tokens over its requests' seconds (the client's
    queueing excluded). ``interval_s``: each chat is sent that long after the one before,
    however many are in flight, and the cell's own figure is every request's tokens over their
    own seconds (``request_tok_s`` by mode)."""
    rounds, names = [], []
    for number in range(repeats):
        by_category = {
            name: category_prompts(tokenizer, name, MIXED_PER_CATEGORY, skip + number * per_round)
            for name in categories
        }
        order = [(name, by_category[name][i]) for i in range(MIXED_PER_CATEGORY) for name in categories]
        rounds.append([messages for _, messages in order])
        names += [name for name, _ in order]
    concurrency = MIXED_CONCURRENCY if interval_s is None else STREAM_SLICE
    rounds = [
        chats[start : start + STREAM_SLICE]
        for chats in rounds
        for start in range(0, len(chats), STREAM_SLICE)
    ]
    # The arrivals cell starts its rotation one server later than the mixed cell's.
    shift = len(categories) + (interval_s is not None)
    row, results = run_modes(urls, rounds, concurrency, max_tokens, shift, interval_s)
    rates = {mode: category_rates(names, mode_results) for mode, mode_results in results.items()}
    row["categories"] = {
        name: {
            "auto_over_off": round(rates["auto"][name] / rates["off"][name], 3),
            "control_over_off": round(rates["off:control"][name] / rates["off"][name], 3),
        }
        for name in categories
    }
    if interval_s is not None:
        # Every server's tokens/s over the run is the arrival rate: the cell's own figure is every
        # request's tokens over their own seconds, as its categories' are.
        every = {
            mode: category_rates(["all"] * len(names), mode_results)["all"]
            for mode, mode_results in results.items()
        }
        for mode, rate in every.items():
            row[mode]["request_tok_s"] = round(rate, 2)
        row["auto_over_off"] = round(every["auto"] / every["off"], 3)
        row["control_over_off"] = round(every["off:control"] / every["off"], 3)
        row["interval_s"] = round(interval_s, 3)
    cell = "mixed" if interval_s is None else "arrivals"
    print(cell, row["auto_over_off"], row["control_over_off"], flush=True)
    return row


def overall(cells: dict, level: str) -> dict[str, float]:
    """Tokens/s of each mode over every category at one concurrency (tokens / seconds summed),
    and the geometric mean of the categories' ratios."""
    totals = {
        mode: sum(c[level][mode]["tokens"] for c in cells.values())
        / sum(c[level][mode]["seconds"] for c in cells.values())
        for mode in MODES
    }
    return {
        "off_tok_s": round(totals["off"], 2),
        "auto_tok_s": round(totals["auto"], 2),
        "auto_over_off": round(totals["auto"] / totals["off"], 3),
        "control_over_off": round(totals["off:control"] / totals["off"], 3),
        "geomean_ratio": round(geometric_mean(c[level]["auto_over_off"] for c in cells.values()), 3),
        "lowest": min((c[level]["auto_over_off"], name) for name, c in cells.items())[1],
    }


def streams(payload: dict) -> dict[str, dict]:
    """The run's stream cells (mixed, arrivals) that it has: older runs lack them."""
    return {name: payload[name] for name in ("mixed", "arrivals") if payload.get(name)}


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """``auto`` / ``off`` over every category, per cell (the README's headline reads these). With
    ``like`` (a quick run's payload): over the categories that run has, at each concurrency (its
    stream cells mix other categories, so they are left out)."""
    if like is not None:
        cells = {name: payload["cells"][name] for name in like["cells"] if name in payload["cells"]}
        return {f"C={level}": overall(cells, level)["auto_over_off"] for level in like["overall"]}
    found = {f"C={level}": row["auto_over_off"] for level, row in payload["overall"].items()}
    return found | {name: stream["auto_over_off"] for name, stream in streams(payload).items()}


def settings_line(payload: dict) -> str:
    """The host and the servers' settings, named where they differ from ``serve run``'s."""
    meta = payload.get("meta", {})
    # Runs before the key was recorded: every argument they set but the default threads.
    app_args = payload.get("app_args", {})
    changed = payload.get(
        "changed_settings", {name: value for name, value in app_args.items() if name != "prefill_threads"}
    )
    servers = "`serve run deployments:build_app speculation=MODE`, every other setting its default"
    if changed:
        servers += " except " + ", ".join(f"`{name}={value}`" for name, value in changed.items())
    host = f"{meta.get('processor', 'not recorded')}, {meta.get('isa', 'instruction set not recorded')}"
    repeats = payload.get("repeats", 1)
    pooled = f" Every cell: {repeats} rounds of new prompts, pooled." if repeats > 1 else ""
    return f"Host: {host}. Servers: {servers}; each answered one warm-up chat first.{pooled}"


def markdown_table(payload: dict) -> str:
    cells = payload["cells"]
    stream_cells = streams(payload)
    levels = list(next(iter(cells.values())))
    names = ["off tok/s", "auto / off", "control / off"]
    header = " | ".join(f"C={level} {name}" for level in levels for name in names)
    labels = {"mixed": f"mixed C={MIXED_CONCURRENCY}", "arrivals": "arrivals"}
    for name in stream_cells:
        header += f" | {labels[name]} auto / off | {name} control / off"
    columns = len(names) * len(levels) + 2 * len(stream_cells)
    lines = [settings_line(payload), "", f"| category | {header} |", "|---|" + "---|" * columns]

    def values(row: dict, key: str) -> str:
        bold = "**" if key == "all" else ""
        parts = [f"{row['off_tok_s'] if 'off_tok_s' in row else row['off']['tokens_per_s']:.1f}"]
        parts.append(f"{bold}{row['auto_over_off']:.2f}x{bold}")
        parts.append(f"{row['control_over_off']:.2f}x")
        if key != "all" and not row["identical"]:
            parts[1] += " ≠"
        return " | ".join(parts)

    def mixed_values(row: dict, key: str) -> str:
        bold = "**" if key == "all" else ""
        return f" | {bold}{row['auto_over_off']:.2f}x{bold} | {row['control_over_off']:.2f}x"

    for name, row in cells.items():
        kind = " (repetitive)" if name in REPETITIVE else " (adversarial)" if name == HOT_SAMPLED else ""
        line = f"| {name}{kind} | " + " | ".join(values(row[level], name) for level in levels)
        line += "".join(mixed_values(stream["categories"][name], name) for stream in stream_cells.values())
        lines.append(line + " |")
    line = "| all | " + " | ".join(values(payload["overall"][level], "all") for level in levels)
    lines.append(line + "".join(mixed_values(stream, "all") for stream in stream_cells.values()) + " |")
    return "\n".join(lines)


def plot(payload: dict):
    figure, axes = new_figure(1, width=8.0)
    cells = payload["cells"]
    levels = list(next(iter(cells.values())))
    series = {f"C={level}": [cells[name][level]["auto_over_off"] for name in cells] for level in levels}
    grouped_bars(axes[0], list(cells), series, "auto tokens/s over off")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_title("HTTP, GGUF blocks: auto over off by category")
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="the short version")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of new prompts per cell")
    parser.add_argument(
        "--categories", nargs="+", choices=CATEGORIES, help="these categories alone, in every cell"
    )
    parser.add_argument(
        "--probe-max-rows", type=int, default=None, help="the servers' start-up probe (default: theirs)"
    )
    parser.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="each replica's CPUs and torch threads for every step (default: a lone replica's)",
    )
    args = parser.parse_args()
    categories = tuple(args.categories or (QUICK_CATEGORIES if args.quick else CATEGORIES))
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    # The torch threads a lone replica gets by default: the cores Ray's own processes leave, and
    # every core for its prompt chunks.
    cores = visible_cpus()
    num_cpus = args.num_cpus or max(1, cores - RAY_RESERVED_CPUS)
    model, tokenizer = load_model(config=ModelConfig(dtype="gguf"))
    changed = {} if args.probe_max_rows is None else {"probe_max_rows": args.probe_max_rows}
    if args.num_cpus is not None:
        changed["num_cpus_per_replica"] = args.num_cpus
    # What a lone replica gets by default, set explicitly because the three servers share one Ray.
    app_args = dict(changed) if args.num_cpus is not None else {**changed, "prefill_threads": cores}
    cells, mixed, arrivals = run(
        tokenizer, categories, requests, args.max_tokens, num_cpus, app_args, args.repeats
    )
    payload = {
        "benchmark": "http_categories",
        "meta": run_metadata(model, "gguf", "benchmarks.http_categories"),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "app_args": app_args,
        "changed_settings": changed,
        "requests": {str(level): count for level, count in requests.items()},
        "cells": cells,
        "overall": {str(level): overall(cells, str(level)) for level in requests},
        "mixed": mixed,
        "arrivals": arrivals,
        "identical": mixed["identical"]
        and arrivals["identical"]
        and all(row["identical"] for c in cells.values() for row in c.values()),
    }
    publish_run(result_name("http_categories", "gguf", args.quick), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
