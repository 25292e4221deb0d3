"""``auto`` against ``off`` in lockstep, by workload and row count, engines built as the server's.

Two engines share the model a replica of ``serve run deployments.app`` loads (on a CPU the
embedded GGUF blocks), one per mode, each built from the replica configuration of
``serve run deployments:build_app speculation=MODE`` with every other setting its default
(``builder.replica_config``: its engine settings, its draft sources, the torch threads a lone
replica gets), and each learns its finished requests into its own ``replica`` draft source as a
replica does (its ``pool`` source stays empty: a lone replica learns only others' requests from
the pool). They are handed the same requests, a wave of ``rows`` at a time; their steps
alternate, one of each in turn (which goes first alternating by wave), and each mode is timed
over its own steps only. Whatever the host does meanwhile (another tenant, a clock that boosts
and throttles) falls on both alike, so a difference of a percent shows in one run, where cells
of a few seconds through HTTP spread by 10% between two servers doing the same work
(docs/results.md). It measures the engine, not the server: the floor ``auto`` must keep,
without the HTTP path's noise.

Workloads: repetitive ones (``code_edit``, ``rag_quote``), free text (``creative``), the
adversarial ``hot_sampled`` (answers sampled at ``HOT_TEMPERATURE``, where next to no draft is
accepted), ``closed``: creative prompts with every ``auto`` request's gate closed for the whole
run, the plain step a request whose drafts do not pay is sent back to, which must cost what a
step of ``off`` does; and ``control``: creative prompts with both engines ``off``, what the
instrument itself reads between two engines doing the same work; and ``mixed``: a stream of every
category (``benchmarks.workloads``' own, long chats of 600-1600 prompt tokens and the adversarial
samples, interleaved) kept ``rows`` in flight on each engine, a finished request's slot taking
the next at once, as the HTTP benchmark's mixed cell sends them: there each engine learns a
request as it finishes, where a wave's are learned after its last step. Every answer must be the
same under both modes.

    python -m benchmarks.lockstep               # rows 1 and 8
    python -m benchmarks.lockstep --rows 8 --workloads creative hot_sampled
    python -m benchmarks.lockstep --rows 8 --workloads mixed
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import publish_run, result_name, rotated, run_metadata, suite_parser
from benchmarks.workloads import HOT_TEMPERATURE, chat_ids, distinct_prompts, hot_sampled, long_chats
from benchmarks.workloads import WORKLOADS as CATEGORIES
from deployments.builder import AppArgs, replica_config
from nasd_core.config import SamplingParams
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.speculation.drafter import SharedIndex, new_shared_index
from pool_service.shared import POOL_SOURCE, REPLICA_SOURCE

MODES = ("off", "auto")
CLOSED = "closed"
CONTROL = "control"
HOT_SAMPLED = "hot_sampled"
MIXED = "mixed"
LONG_CHAT = "long_chat"
# The mixed stream's categories, one request of each in turn.
MIXED_CATEGORIES = (*CATEGORIES, HOT_SAMPLED, LONG_CHAT)
WORKLOADS = ("code_edit", "rag_quote", "creative", HOT_SAMPLED, MIXED, CLOSED, CONTROL)
ROWS = (1, 8)
# Waves per cell: about as many tokens at one row as at eight take seconds.
WAVES = {1: 12, 8: 6}
# The mixed stream sends as many requests as this many waves, in one stream: its drain, where
# fewer than ``rows`` are left in flight, is then a small part of it.
MIXED_WAVES = 18
MAX_TOKENS = 128
CLOSED_STEPS = 10**6  # plain steps left on a closed gate: closed for the whole run

Request = tuple[list[int], dict]  # prompt ids and the sampling parameters beyond max_tokens


def workload_requests(tokenizer, workload: str, count: int) -> list[Request]:
    """``count`` new requests of ``workload``: greedy, but for ``hot_sampled``'s seeded samples."""
    if workload == HOT_SAMPLED:
        samples = hot_sampled(count, seed=5)
        return [(chat_ids(tokenizer, messages), dict(sampling)) for messages, sampling in samples]
    if workload == MIXED:  # request i is of MIXED_CATEGORIES[i % len(MIXED_CATEGORIES)]
        per_category = -(-count // len(MIXED_CATEGORIES))
        categories = [workload_requests(tokenizer, name, per_category) for name in (*CATEGORIES, HOT_SAMPLED)]
        categories.append([(prompt, {}) for prompt in long_chats(tokenizer, per_category)])
        return [request for requests in zip(*categories) for request in requests][:count]
    name = "creative" if workload in (CLOSED, CONTROL) else workload
    return [(chat_ids(tokenizer, messages), {}) for messages in distinct_prompts([name], count, seed=41)]


class ServerEngine:
    """An engine as a replica of ``serve run deployments:build_app speculation=mode`` builds it,
    and its ``replica`` draft source, which learns every request it finishes."""

    def __init__(self, model, tokenizer, mode: str) -> None:
        config = replica_config(AppArgs(speculation=mode))
        self.replica: SharedIndex = new_shared_index(config.pool.index)
        pool = new_shared_index(config.pool.index)
        sources = [(REPLICA_SOURCE, self.replica), (POOL_SOURCE, pool)]
        self.engine = Engine(model, tokenizer, config.engine, shared=sources)


def server_engines(model, tokenizer, workload: str) -> dict[str, ServerEngine]:
    """One engine per mode (both ``off`` for the control)."""
    return {mode: ServerEngine(model, tokenizer, "off" if workload == CONTROL else mode) for mode in MODES}


def run_wave(
    servers: dict[str, ServerEngine],
    wave: list[Request],
    workload: str,
    first: int,
    in_flight: int | None = None,
) -> dict[str, dict]:
    """``wave`` on each mode's engine, their steps alternating (``first``: the mode that leads):
    per mode, its steps' seconds, the step count, the requests' results, which its replica
    source learns, and each request's seconds (its steps', from its admission to its finish).
    All at once, learned after the last step; with ``in_flight``, a stream that keeps that many
    in flight on each engine, each request learned as it finishes."""
    engines = {mode: server.engine for mode, server in servers.items()}
    in_flight = in_flight or len(wave)
    streaming = in_flight < len(wave)
    params = [SamplingParams(max_tokens=MAX_TOKENS, **extra) for _, extra in wave]
    queued = {mode: iter(range(len(wave))) for mode in MODES}
    running = {mode: {} for mode in MODES}  # request id -> its index in the wave
    results = {mode: [None] * len(wave) for mode in MODES}
    request_seconds = {mode: [0.0] * len(wave) for mode in MODES}

    def admit(mode: str) -> None:
        engine = engines[mode]
        while len(running[mode]) < in_flight and (index := next(queued[mode], None)) is not None:
            request_id = engine.add_request(wave[index][0], params[index])
            running[mode][request_id] = index
            if workload == CLOSED and mode == "auto":
                engine.requests[request_id].gate.plain_steps_left = CLOSED_STEPS

    for mode in MODES:
        admit(mode)
    order = rotated(MODES, first)
    seconds = dict.fromkeys(MODES, 0.0)
    steps = dict.fromkeys(MODES, 0)
    while any(running.values()):
        for mode in order:
            if not running[mode]:
                continue
            started = time.perf_counter()
            finished = engines[mode].step()
            step_s = time.perf_counter() - started
            seconds[mode] += step_s
            steps[mode] += 1
            for index in running[mode].values():
                request_seconds[mode][index] += step_s
            for request in finished:
                index = running[mode].pop(request.request_id)
                results[mode][index] = result = engines[mode].pop_result(request.request_id)
                if streaming:
                    servers[mode].replica.update(result.prompt_ids + result.token_ids)
            admit(mode)
    ran = {}
    for mode in MODES:
        if not streaming:
            for result in results[mode]:
                servers[mode].replica.update(result.prompt_ids + result.token_ids)
        ran[mode] = {
            "seconds": seconds[mode],
            "steps": steps[mode],
            "results": results[mode],
            "request_seconds": request_seconds[mode],
        }
    return ran


def measure(model, tokenizer, workload: str, num_rows: int) -> dict:
    """One cell: ``WAVES[num_rows]`` waves of ``num_rows`` new requests through both modes (the
    mixed stream: one stream of ``MIXED_WAVES`` waves' worth, ``num_rows`` in flight)."""
    engines = server_engines(model, tokenizer, workload)
    num_waves = MIXED_WAVES if workload == MIXED else WAVES.get(num_rows, 6)
    requests = workload_requests(tokenizer, workload, (num_waves + 1) * num_rows)
    run_wave(engines, requests[:num_rows], workload, 0)  # warm both: kernels, first timings
    if workload == MIXED:
        rounds = [(requests[num_rows:], num_rows)]
    else:
        starts = range(num_rows, len(requests), num_rows)
        rounds = [(requests[start : start + num_rows], None) for start in starts]
    counters = ("steps", "tokens", "speculative_steps", "accepted")
    totals = {mode: {"seconds": 0.0} | dict.fromkeys(counters, 0) for mode in MODES}
    # Per mode and category of the mixed stream: its requests' tokens and their own seconds.
    paces = {mode: {name: [0, 0.0] for name in MIXED_CATEGORIES} for mode in MODES}
    identical = True
    for number, (wave, in_flight) in enumerate(rounds):
        ran = run_wave(engines, wave, workload, number % 2, in_flight)
        for mode, outcome in ran.items():
            total = totals[mode]
            total["seconds"] += outcome["seconds"]
            total["steps"] += outcome["steps"]
            for index, result in enumerate(outcome["results"]):
                total["tokens"] += len(result.token_ids)
                total["speculative_steps"] += result.stats.num_speculative_steps
                total["accepted"] += result.stats.num_accepted
                if workload == MIXED:
                    pace = paces[mode][MIXED_CATEGORIES[(num_rows + index) % len(MIXED_CATEGORIES)]]
                    pace[0] += len(result.token_ids)
                    pace[1] += outcome["request_seconds"][index]
        texts = {mode: [result.token_ids for result in outcome["results"]] for mode, outcome in ran.items()}
        identical &= texts["off"] == texts["auto"]
    rates = {mode: total["tokens"] / total["seconds"] for mode, total in totals.items()}
    auto = totals["auto"]
    categories = {}
    if workload == MIXED:  # each category's pace: its requests' tokens over their own seconds
        for name in MIXED_CATEGORIES:
            (auto_tokens, auto_s), (off_tokens, off_s) = paces["auto"][name], paces["off"][name]
            categories[name] = round((auto_tokens / auto_s) / (off_tokens / off_s), 3)
    return {
        "workload": workload,
        "rows": num_rows,
        "waves": num_waves,
        "off_tok_s": round(rates["off"], 2),
        "auto_tok_s": round(rates["auto"], 2),
        "auto_over_off": round(rates["auto"] / rates["off"], 3),
        "off_steps": totals["off"]["steps"],
        "auto_steps": auto["steps"],
        # auto's steps that ran a row's speculative path (a lookup at least), per token it emitted.
        "speculative_share": round(auto["speculative_steps"] / auto["tokens"], 3),
        "accepted": auto["accepted"],
        "identical": identical,
    } | ({"categories": categories} if categories else {})


def markdown_table(payload: dict) -> str:
    meta = payload["meta"]
    lines = [
        f"Host: {meta.get('processor')}, {meta.get('isa')}. Engines: a replica's of `serve run "
        "deployments:build_app speculation=MODE`, every other setting its default, its finished requests "
        f"its `replica` draft source; {payload['step_threads']} torch thread(s) a step as a lone replica; "
        f"{payload['max_tokens']} tokens a request, {HOT_TEMPERATURE} for hot_sampled, greedy otherwise.",
        "",
        "| workload | rows | auto / off | off tok/s | auto tok/s | steps off / auto "
        "| auto's lookups per token | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in payload["cells"]:
        lines.append(
            f"| {cell['workload']} | {cell['rows']} | **{cell['auto_over_off']:.3f}** "
            f"| {cell['off_tok_s']:.1f} | {cell['auto_tok_s']:.1f} "
            f"| {cell['off_steps']} / {cell['auto_steps']} "
            f"| {cell['speculative_share']:.0%} | {'yes' if cell['identical'] else '**no**'} |"
        )
    for cell in payload["cells"]:
        if "categories" in cell:
            paces = ", ".join(f"{name} {ratio:.3f}" for name, ratio in cell["categories"].items())
            lines.append(
                f"\nThe mixed stream at {cell['rows']} rows, each category's auto / off over its requests' "
                f"own seconds (their steps', admission to finish): {paces}."
            )
    return "\n".join(lines)


def main() -> None:
    parser = suite_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    args = parser.parse_args()
    server = replica_config(AppArgs())
    model, tokenizer = load_model(config=server.model)
    torch.set_num_threads(server.num_threads or torch.get_num_threads())
    cells = []
    for num_rows in args.rows:
        for workload in args.workloads:
            cells.append(measure(model, tokenizer, workload, num_rows))
            print(cells[-1], flush=True)
    payload = {
        "benchmark": "lockstep",
        "meta": run_metadata(model, "gguf", "benchmarks.lockstep"),
        "max_tokens": MAX_TOKENS,
        "step_threads": torch.get_num_threads(),
        "cells": cells,
    }
    publish_run(result_name("lockstep", "gguf", False), payload, markdown_table)


if __name__ == "__main__":
    main()
