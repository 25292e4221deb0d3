"""Drafter replay: greedy traces of the embedded model recorded once, replayed offline through
every drafter in seconds (no model in the loop).

A trace is a prompt's token ids and the model's greedy continuation. Replaying a drafter over
it is exactly what speculative decoding with greedy verification would do: at each step the
drafter proposes up to ``MAX_DRAFT`` tokens after the context so far, the step keeps the
longest prefix that equals the trace's next tokens plus one more (the model's own token at the
first mismatch, or the bonus after a fully accepted draft), and the drafter sees what was kept.
No cost policy runs here: every drafter verifies all it proposes, so "drafted per step" is what
its own sizing rule asks the verification step to carry.

Two scopes: ``local`` (each request alone: its prompt and its own output) and ``cross``
(requests in order, each drafter also holding every earlier finished request, as a replica's
index does). Workloads: the benchmark generators (repetitive and creative chat) and long chats
of 600-1600 prompt tokens built from several conversations (``long_chat``).

    python -m benchmarks.replay --record   # greedy traces -> benchmarks/traces/ (minutes)
    python -m benchmarks.replay            # replay the recorded traces (seconds per drafter)
"""

from __future__ import annotations

import gc
import heapq
import itertools
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from benchmarks.common import publish_run, result_name, run_metadata, suite_parser
from benchmarks.workloads import WORKLOADS, long_chats, make_workload, paraphrase
from nasd_core.config import DEFAULT_INDEX_MAX_ENTRIES, IndexConfig, SpecConfig
from nasd_core.speculation.drafter import RequestDrafter, longest_matches, new_shared_index, propose_rows
from nasd_core.speculation.ngram import prompt_lookup
from nasd_core.speculation.suffix import MAX_SPEC_FACTOR, SEPARATOR, SuffixIndex, best_draft, compiled_module
from pool_service.config import pool_index

TRACES = Path(__file__).resolve().parent / "traces" / "greedy_float32.json"
# The same questions reworded, answered greedily (also by ``--record``).
PARAPHRASE_TRACES = TRACES.with_name("paraphrase_float32.json")
# Workloads whose answers are free text, not copied from the prompt: where a pool holding
# another wording's answer is the only source of long matches (the pool benchmark's paraphrases).
FREE_TEXT = ("multi_turn", "summarisation", "creative")
MAX_DRAFT = 16
NUM_PROMPTS = 16
MAX_TOKENS = 128
SCOPES = ("local", "cross")
# The frontier: each drafter's sizing factor (a draft at most factor x its matched context)
# swept, so drafters are compared at the same drafted tokens per step, the verification work
# they ask for, rather than each at its one default.
FRONTIER_FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0)
FRONTIER_DRAFTERS = ("ngram", "suffix", "suffix_tree", "suffix_decoding")


# ----------------------------------------------------------------------------- recording
def record(num_prompts: int, max_tokens: int) -> tuple[dict, dict]:
    """Greedy continuations of every workload's prompts, then of the same questions reworded
    (``workloads.paraphrase``; speculation off, batched): the two trace files."""
    from nasd_core.loader import load_model

    model, tokenizer = load_model()

    def encode(conversation) -> list[int]:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    conversations = {name: make_workload(name, num_prompts, seed=7) for name in WORKLOADS}
    prompts = {name: [encode(conv) for conv in convs] for name, convs in conversations.items()}
    prompts["long_chat"] = long_chats(tokenizer, num_prompts)
    reworded = {name: [encode(paraphrase(conv)) for conv in convs] for name, convs in conversations.items()}
    meta = run_metadata(model, "float32", "benchmarks.replay")
    return (
        {"meta": meta, "traces": greedy_traces(model, tokenizer, prompts, max_tokens)},
        {"meta": meta, "traces": greedy_traces(model, tokenizer, reworded, max_tokens)},
    )


def greedy_traces(
    model, tokenizer, prompts: dict[str, list[list[int]]], max_tokens: int
) -> dict[str, list[dict[str, list[int]]]]:
    """Each workload's prompts (token ids) with the model's greedy continuation, batched 16 at
    a time with speculation off."""
    from nasd_core.config import EngineConfig, SamplingParams
    from nasd_core.config import SpecConfig as Spec
    from nasd_core.engine.engine import Engine

    traces: dict[str, list[dict[str, list[int]]]] = {}
    for name, workload in prompts.items():
        engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=16, max_waiting=len(workload)))
        ids = [
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), Spec(mode="off"))
            for prompt in workload
        ]
        while not engine.is_finished():
            engine.step()
        traces[name] = [
            {"prompt": list(prompt), "output": engine.pop_result(request_id).token_ids}
            for prompt, request_id in zip(workload, ids)
        ]
        print(f"recorded {name}: {sum(len(t['output']) for t in traces[name])} tokens", flush=True)
    return traces


# ------------------------------------------------------------------------------- drafters
class ReplayDrafter(Protocol):
    """What the replay drives: one request at a time, then what it learns when it finishes."""

    def start(self, prompt: list[int]) -> None: ...

    def propose(self, context: list[int], max_tokens: int) -> list[int] | TreeDraft: ...

    def observe(self, context: list[int]) -> None: ...

    def finish(self, sequence: list[int]) -> None: ...


class PromptLookup:
    """Prompt lookup decoding (vLLM's ``ngram`` method): copy what followed the latest earlier
    occurrence of the context's last 1-3 tokens."""

    def __init__(self, scope: str, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, context: list[int], max_tokens: int) -> list[int]:
        return prompt_lookup(context, max_tokens, self.max_ngram, 1)[0]

    def observe(self, context: list[int]) -> None:
        pass

    def finish(self, sequence: list[int]) -> None:
        pass


class NGramDrafter:
    """This project's drafter (``RequestDrafter``, the server's default settings); in the
    ``cross`` scope with a replica index of every finished request, as a replica keeps.
    ``max_spec_factor``: cut each draft to that many times its matched context (SuffixDecoding's
    sizing rule; None: the drafter's own length, as the server drafts before its policy)."""

    LOCAL_INDEX = "hybrid"
    SHARED_KIND = "ngram"

    def __init__(self, scope: str, max_spec_factor: float | None = None) -> None:
        self.max_spec_factor = max_spec_factor
        self.spec = SpecConfig(mode="on", num_draft_tokens=MAX_DRAFT, local_index=self.LOCAL_INDEX)
        shared = IndexConfig(kind=self.SHARED_KIND, max_entries=DEFAULT_INDEX_MAX_ENTRIES)
        self.replica = new_shared_index(shared) if scope == "cross" else None
        self.drafter: RequestDrafter | None = None

    def start(self, prompt: list[int]) -> None:
        shared = [("replica", self.replica)] if self.replica is not None else []
        self.drafter = RequestDrafter(self.spec, shared)
        self.drafter.observe(prompt)

    def propose(self, context: list[int], max_tokens: int) -> list[int]:
        draft = self.drafter.propose(context, max_tokens)
        if self.max_spec_factor is None:
            return draft.tokens
        return draft.tokens[: math.ceil(self.max_spec_factor * draft.match_length)]

    def observe(self, context: list[int]) -> None:
        self.drafter.observe(context)

    def finish(self, sequence: list[int]) -> None:
        if self.replica is not None:
            self.replica.update(sequence)


class EngineSuffixDrafter(NGramDrafter):
    """The same drafter with the suffix sources (``SpecConfig(local_index="suffix")`` and a
    replica index of ``IndexConfig(kind="suffix")``): the request's own tokens and finished
    requests matched by suffix in the compiled store, drafts up to the cap (the server's policy
    sizes them)."""

    LOCAL_INDEX = "suffix"
    SHARED_KIND = "suffix"


class SuffixDrafter:
    """``nasd_core.speculation.suffix``: the longest suffix match (up to 64 tokens) in the request's own
    tokens and, in the ``cross`` scope, in every finished request; drafts sized by confidence."""

    def __init__(self, scope: str, max_spec_factor: float = MAX_SPEC_FACTOR) -> None:
        self.shared = SuffixIndex() if scope == "cross" else None
        self.local = SuffixIndex()
        self.max_spec_factor = max_spec_factor

    def start(self, prompt: list[int]) -> None:
        self.local = SuffixIndex()
        self.local.add_sequence(prompt)

    def propose(self, context: list[int], max_tokens: int) -> list[int]:
        factor = self.max_spec_factor
        local = self.local.draft(context, max_tokens, exclude=len(self.local) - 1, max_spec_factor=factor)
        if self.shared is None:
            return local.tokens
        return best_draft([local, self.shared.draft(context, max_tokens, max_spec_factor=factor)]).tokens

    def observe(self, context: list[int]) -> None:
        self.local.extend(context[len(self.local) :])

    def finish(self, sequence: list[int]) -> None:
        if self.shared is not None:
            self.shared.add_sequence(sequence)


@dataclass(frozen=True)
class TreeDraft:
    """Candidate continuations sharing their prefixes: each node is its path from the root.
    Verified as a tree would be in one step (each node's position sees its ancestors only),
    greedy: the kept tokens are the longest path of nodes the model's own tokens follow."""

    nodes: frozenset[tuple[int, ...]]

    def __len__(self) -> int:
        return len(self.nodes)


# Tree drafts: nodes per step at most (two full 16-token paths), and the least probability
# (share of the match's occurrences that continue so) a node may have.
TREE_MAX_NODES = 32
TREE_MIN_PROB = 0.03


def suffix_tree(
    index: SuffixIndex, context: list[int], max_tokens: int, exclude: int, max_spec_factor: float
) -> tuple[TreeDraft, int]:
    """The tree of every continuation of ``context``'s longest match in ``index``, most probable
    nodes first (a node's probability: the share of the match's occurrences that continue with
    its path), up to ``TREE_MAX_NODES`` nodes of depth at most ``max_spec_factor`` x the match
    and ``max_tokens``; and the match length."""
    match_length, alive = index.match(context, exclude)
    if not alive or max_tokens <= 0:
        return TreeDraft(frozenset()), match_length
    tokens = index.tokens
    depth_limit = min(max_tokens, math.ceil(max_spec_factor * match_length))
    nodes: list[tuple[int, ...]] = []
    frontier: list[tuple[float, tuple[int, ...], list[int]]] = [(-1.0, (), alive)]
    while frontier and len(nodes) < TREE_MAX_NODES:
        negative_prob, path, positions = heapq.heappop(frontier)
        if path:
            nodes.append(path)
        if len(path) >= depth_limit:
            continue
        children: dict[int, list[int]] = {}
        for position in positions:
            following = position + len(path) + 1
            if following < len(tokens) and tokens[following] != SEPARATOR:
                children.setdefault(tokens[following], []).append(position)
        for token, members in children.items():
            prob = -negative_prob * len(members) / len(positions)
            if prob >= TREE_MIN_PROB:
                heapq.heappush(frontier, (-prob, (*path, token), members))
    return TreeDraft(frozenset(nodes)), match_length


class SuffixTreeDrafter(SuffixDrafter):
    """``SuffixDrafter``'s stores and sizing, drafting a tree of every likely continuation of
    the longest match instead of its one most likely path (measured here, not in the engine)."""

    def propose(self, context: list[int], max_tokens: int) -> TreeDraft:
        factor = self.max_spec_factor
        best = suffix_tree(self.local, context, max_tokens, len(self.local) - 1, factor)
        if self.shared is not None:
            shared = suffix_tree(self.shared, context, max_tokens, -1, factor)
            best = shared if shared[1] > best[1] else best
        return best[0]


class SuffixDecoding:
    """ArcticInference's SuffixDecoding with vLLM's defaults for its ``suffix`` method (tree
    depth 24, ``max_spec_factor`` 1, ``min_token_prob`` 0.1, path drafts): the request's own
    tokens and, in the ``cross`` scope, every earlier response (``benchmarks.baselines``)."""

    cache_class = None  # SuffixDecodingCache, set by ``available``
    MAX_TREE_DEPTH = 24

    @classmethod
    def available(cls) -> str | None:
        """None when the baseline can run, else why not."""
        from benchmarks.baselines import suffix_decoding

        cls.cache_class, why = suffix_decoding.load()
        return why

    def __init__(self, scope: str, max_spec_factor: float = 1.0) -> None:
        self.cache = self.cache_class(self.MAX_TREE_DEPTH, -1 if scope == "cross" else 0)
        self.max_spec_factor = max_spec_factor
        self.request_id = 0
        self.num_known = 0

    def start(self, prompt: list[int]) -> None:
        self.request_id += 1
        self.cache.start_request(self.request_id, prompt)
        self.num_known = len(prompt)

    def propose(self, context: list[int], max_tokens: int) -> list[int]:
        tail = context[-self.MAX_TREE_DEPTH :]
        draft = self.cache.speculate(
            self.request_id, tail, max_spec_tokens=max_tokens, max_spec_factor=self.max_spec_factor
        )
        return list(draft.token_ids)

    def observe(self, context: list[int]) -> None:
        self.cache.add_active_response(self.request_id, context[self.num_known :])
        self.num_known = len(context)

    def finish(self, sequence: list[int]) -> None:
        self.cache.stop_request(self.request_id)


DRAFTERS: dict[str, type] = {
    "prompt_lookup": PromptLookup,
    "ngram": NGramDrafter,
    "engine_suffix": EngineSuffixDrafter,
    "suffix": SuffixDrafter,
    "suffix_tree": SuffixTreeDrafter,
    "suffix_decoding": SuffixDecoding,
}


# --------------------------------------------------------------------------------- replay
@dataclass
class ReplayStats:
    num_steps: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    drafting_s: float = 0.0

    def verify(self, draft: Sequence[int] | TreeDraft, truth: Sequence[int]) -> list[int]:
        """One greedy verification step of ``draft`` (a path or a tree) against the trace's next
        tokens ``truth``: counted here; returns the tokens it emits (the accepted prefix and one
        more)."""
        num_accepted = accepted_prefix(draft, truth)
        emitted = list(truth[: num_accepted + 1])
        self.num_steps += 1
        self.num_emitted += len(emitted)
        self.num_drafted += len(draft)
        self.num_accepted += num_accepted
        return emitted

    def summary(self) -> dict[str, float]:
        steps = max(1, self.num_steps)
        return {
            "tokens_per_step": round(self.num_emitted / steps, 3),
            "drafted_per_step": round(self.num_drafted / steps, 2),
            "acceptance": round(self.num_accepted / max(1, self.num_drafted), 3),
            "us_per_row_step": round(1e6 * self.drafting_s / steps, 1),
            "steps": self.num_steps,
        }


def accepted_prefix(draft: Sequence[int] | TreeDraft, truth: Sequence[int]) -> int:
    """How many of the trace's next tokens the draft holds in order: its leading tokens (a
    path), or the deepest node on the trace's own path (a tree)."""
    if isinstance(draft, TreeDraft):
        num_accepted = 0
        while num_accepted < len(truth) and tuple(truth[: num_accepted + 1]) in draft.nodes:
            num_accepted += 1
        return num_accepted
    num_accepted = 0
    for drafted, actual in zip(draft, truth):
        if drafted != actual:
            break
        num_accepted += 1
    return num_accepted


def replay(
    drafter: ReplayDrafter, traces: list[dict[str, list[int]]], into: ReplayStats | None = None
) -> ReplayStats:
    """Greedy speculative decoding of every trace, in order, through ``drafter`` (counted in
    ``into`` if given)."""
    stats = into if into is not None else ReplayStats()
    clock = time.perf_counter
    for trace in traces:
        prompt, output = trace["prompt"], trace["output"]
        started = clock()
        drafter.start(prompt)
        stats.drafting_s += clock() - started
        context = list(prompt)
        position = 0
        while position < len(output):
            started = clock()
            draft = drafter.propose(context, min(MAX_DRAFT, len(output) - position))
            stats.drafting_s += clock() - started
            emitted = stats.verify(draft, output[position:])
            context.extend(emitted)
            position += len(emitted)
            started = clock()
            drafter.observe(context)
            stats.drafting_s += clock() - started
        drafter.finish(context)
    return stats


# Rows drafted together in ``batched``: a full batch of the server's default engine.
BATCH_ROWS = 32


def batched(traces: list[dict[str, list[int]]], one_call: bool, num_rows: int = BATCH_ROWS) -> ReplayStats:
    """The engine's drafting work at ``num_rows`` rows: traces replayed in waves of ``num_rows``
    rows in lockstep, each row's drafter on the suffix sources with a replica index of every
    finished trace; per step every row is asked for its match and its draft (up to
    ``MAX_DRAFT``, all verified: no policy) and then sees what was kept, timed together.
    ``one_call``: a step asks every row's suffix stores in one call (``longest_matches``,
    ``propose_rows``, what the engine does); else each row in a call of its own."""
    spec = SpecConfig(mode="on", num_draft_tokens=MAX_DRAFT, local_index="suffix")
    replica = new_shared_index(IndexConfig(kind="suffix", max_entries=DEFAULT_INDEX_MAX_ENTRIES))
    stats = ReplayStats()
    clock = time.perf_counter
    for wave_start in range(0, len(traces), num_rows):
        wave = traces[wave_start : wave_start + num_rows]
        drafters = [RequestDrafter(spec, [("replica", replica)]) for _ in wave]
        contexts = [list(trace["prompt"]) for trace in wave]
        positions = [0] * len(wave)
        for drafter, context in zip(drafters, contexts):
            drafter.observe(context)
        active = list(range(len(wave)))
        while active:
            caps = [min(MAX_DRAFT, len(wave[row]["output"]) - positions[row]) for row in active]
            rows = [drafters[row] for row in active]
            row_contexts = [contexts[row] for row in active]
            started = clock()
            if one_call:
                longest_matches(rows, row_contexts)
                drafts = propose_rows(rows, row_contexts, caps)
            else:
                for drafter, context in zip(rows, row_contexts):
                    drafter.longest_match(context)
                drafts = [
                    drafter.propose(context, cap) for drafter, context, cap in zip(rows, row_contexts, caps)
                ]
            stats.drafting_s += clock() - started
            for row, draft in zip(active, drafts):
                emitted = stats.verify(draft.tokens, wave[row]["output"][positions[row] :])
                contexts[row].extend(emitted)
                positions[row] += len(emitted)
            started = clock()
            for row in active:
                drafters[row].observe(contexts[row])
            stats.drafting_s += clock() - started
            for row in [row for row in active if positions[row] >= len(wave[row]["output"])]:
                replica.update(contexts[row])
            active = [row for row in active if positions[row] < len(wave[row]["output"])]
    return stats


def batch_drafting(traces: dict[str, list[dict[str, list[int]]]]) -> dict[str, dict[str, float]]:
    """``batched`` over every workload's traces together (workloads interleaved, as a server's
    batch mixes them), a call per row and one call per step, in one run."""
    mixed = [
        trace for group in itertools.zip_longest(*traces.values()) for trace in group if trace is not None
    ]
    result: dict[str, dict[str, float]] = {
        mode: batched(mixed, one_call=mode == "one_call").summary() for mode in ("call_per_row", "one_call")
    }
    result["index"] = shared_index_costs([trace["prompt"] + trace["output"] for trace in mixed])
    return result


def shared_index_costs(sequences: list[list[int]]) -> dict[str, float]:
    """What a pool index of each kind (the server's budgets) costs to fill with ``sequences``,
    as a replica replaying the pool at start does (µs per token), and the suffix store's bytes
    per stored token (``memory_bytes``: estimated from its containers' sizes)."""
    num_tokens = sum(len(sequence) for sequence in sequences)
    costs: dict[str, float] = {"tokens": num_tokens}
    for kind in ("suffix", "ngram"):
        index = new_shared_index(pool_index(kind))
        started = time.perf_counter()
        index.update_many(sequences)
        costs[f"{kind}_ingest_us_per_token"] = round(1e6 * (time.perf_counter() - started) / num_tokens, 2)
        if kind == "suffix":
            costs["suffix_bytes_per_token"] = round(index.memory_bytes() / index.num_entries, 1)
    return costs


# The host-time micro-benchmark: the server's drafter (suffix sources), the n-gram one, and
# prompt lookup as the yardstick hosts are compared by; timed passes after a warm one.
TIMED_DRAFTERS = ("prompt_lookup", "ngram", "engine_suffix")
TIMED_PASSES = 5


def host_time(traces: dict[str, list[dict[str, list[int]]]]) -> dict[str, float]:
    """Each of ``TIMED_DRAFTERS``' µs of drafting per step, cross scope, over every recorded
    trace whatever the run's size (so quick and full runs time the same work): the median of
    ``TIMED_PASSES``. The heap is frozen first: a full collection of the loaded traces landing
    inside one pass cost it ~180 µs a step, which is when, not what, the drafter spends."""
    gc.collect()
    gc.freeze()
    every_trace = [trace for workload in traces.values() for trace in workload]
    passes: dict[str, list[float]] = {name: [] for name in TIMED_DRAFTERS}
    for _ in range(1 + TIMED_PASSES):  # drafters take turns, so a busy moment of the host hits all
        for name, times in passes.items():
            times.append(replay(DRAFTERS[name]("cross"), every_trace).summary()["us_per_row_step"])
    return {name: statistics.median(times[1:]) for name, times in passes.items()}


def run(traces: dict[str, list[dict[str, list[int]]]], drafters: Sequence[str]) -> dict:
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for workload, workload_traces in traces.items():
        for scope in SCOPES:
            for name in drafters:
                summary = replay(DRAFTERS[name](scope), workload_traces).summary()
                results.setdefault(workload, {}).setdefault(scope, {})[name] = summary
    return results


def frontier(traces: dict[str, list[dict[str, list[int]]]]) -> dict:
    """Per drafter and scope: for each of ``FRONTIER_FACTORS``, its tokens and drafted tokens
    per step over SuffixDecoding's at its default (factor 1) on the same cell, averaged over
    the workloads; and the tokens per step it reaches at SuffixDecoding's drafted per step
    (interpolated along its curve; None outside it)."""
    baseline = {
        (workload, scope): replay(SuffixDecoding(scope), workload_traces).summary()
        for workload, workload_traces in traces.items()
        for scope in SCOPES
    }
    curves: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name in FRONTIER_DRAFTERS:
        for scope in SCOPES:
            points = []
            for factor in FRONTIER_FACTORS:
                tokens, drafted = [], []
                for workload, workload_traces in traces.items():
                    cell = replay(DRAFTERS[name](scope, factor), workload_traces).summary()
                    base = baseline[(workload, scope)]
                    tokens.append(cell["tokens_per_step"] / base["tokens_per_step"])
                    drafted.append(cell["drafted_per_step"] / base["drafted_per_step"])
                points.append(
                    {
                        "factor": factor,
                        "tokens": sum(tokens) / len(tokens),
                        "drafted": sum(drafted) / len(drafted),
                    }
                )
            curves.setdefault(name, {})[scope] = points
    return {
        "curves": curves,
        "tokens_at_equal_drafted": {
            name: {scope: at_drafted(points, 1.0) for scope, points in by_scope.items()}
            for name, by_scope in curves.items()
        },
    }


def paraphrase_gain(originals: dict[str, list[dict]], paraphrases: dict[str, list[dict]]) -> dict:
    """Tokens per step on the reworded questions of ``FREE_TEXT`` workloads with the original
    question and answer held as an earlier request (``warm``: what the shared pool gives a
    replica) and without (``cold``), for path and tree drafts; the pool benchmark's paraphrase
    workload asks warm / cold of the engine."""
    result: dict[str, dict[str, float]] = {}
    for name in ("suffix", "suffix_tree"):
        cell = {}
        for warmth in ("cold", "warm"):
            stats = ReplayStats()
            for workload in FREE_TEXT:
                for original, reworded in zip(originals[workload], paraphrases[workload]):
                    drafter = DRAFTERS[name]("cross" if warmth == "warm" else "local")
                    if warmth == "warm":
                        drafter.finish(original["prompt"] + original["output"])
                    replay(drafter, [reworded], into=stats)
            cell[warmth] = stats.summary()
        cell["warm_over_cold"] = round(cell["warm"]["tokens_per_step"] / cell["cold"]["tokens_per_step"], 3)
        result[name] = cell
    return result


def at_drafted(points: list[dict[str, float]], drafted: float) -> float | None:
    """Tokens ratio where a curve (points ordered by factor) passes ``drafted``, by linear
    interpolation between its neighbouring points; None where it never does."""
    ordered = sorted(points, key=lambda point: point["drafted"])
    for low, high in itertools.pairwise(ordered):
        if low["drafted"] <= drafted <= high["drafted"]:
            span = high["drafted"] - low["drafted"]
            weight = 0.0 if span == 0 else (drafted - low["drafted"]) / span
            return low["tokens"] + weight * (high["tokens"] - low["tokens"])
    return None


def markdown_table(payload: dict) -> str:
    drafters = payload["meta"]["drafters"]
    lines = [
        "| workload | scope | " + " | ".join(f"{name} tok/step / drafted / µs" for name in drafters) + " |",
        "|---|---|" + "---|" * len(drafters),
    ]
    for workload, scopes in payload["results"].items():
        for scope, by_drafter in scopes.items():
            cells = [
                f"{cell['tokens_per_step']:.2f} / {cell['drafted_per_step']:.1f} / "
                f"{cell['us_per_row_step']:.0f}"
                for cell in (by_drafter[name] for name in drafters)
            ]
            lines.append(f"| {workload} | {scope} | " + " | ".join(cells) + " |")
    if "host_us" in payload:
        host = payload["host_us"]
        lines += [
            "",
            f"Host time per step (every trace, cross scope, heap frozen, median of {TIMED_PASSES} passes): "
            + ", ".join(f"{name} {us:.1f} µs" for name, us in host.items())
            + ".",
        ]
    if "batch" in payload:
        batch = payload["batch"]
        lines += [
            "",
            f"The engine's drafting at {BATCH_ROWS} rows (every trace, workloads interleaved, suffix "
            "sources and a replica index; each row's match and draft asked every step and its kept "
            "tokens learned; µs per row-step):",
            "",
            "| asked | µs per row-step | tokens per step | drafted per step |",
            "|---|---|---|---|",
        ]
        for mode, label in (("call_per_row", "a call per row"), ("one_call", "one call per step")):
            cell = batch[mode]
            lines.append(
                f"| {label} | {cell['us_per_row_step']:.1f} | {cell['tokens_per_step']:.2f} "
                f"| {cell['drafted_per_step']:.1f} |"
            )
        index = batch["index"]
        lines += [
            "",
            f"A pool index filled with every trace ({index['tokens']:,} tokens, the server's budgets): "
            f"suffix store {index['suffix_ingest_us_per_token']:.2f} µs per token to fill, "
            f"{index['suffix_bytes_per_token']:.0f} bytes per stored token; "
            f"n-gram index {index['ngram_ingest_us_per_token']:.2f} µs per token.",
        ]
    if "frontier" in payload:
        lines += [
            "",
            "Frontier: each drafter with its drafts cut to factor x matched context, tokens / drafted "
            "per step over SuffixDecoding's default (factor 1), mean over workloads:",
            "",
            "| drafter | scope | "
            + " | ".join(f"factor {factor:g}" for factor in FRONTIER_FACTORS)
            + " | tokens at SuffixDecoding's drafted |",
            "|---|---|" + "---|" * (len(FRONTIER_FACTORS) + 1),
        ]
        front = payload["frontier"]
        for name, by_scope in front["curves"].items():
            for scope, points in by_scope.items():
                cells = [f"{point['tokens']:.2f} / {point['drafted']:.2f}" for point in points]
                equal = front["tokens_at_equal_drafted"][name][scope]
                lines.append(
                    f"| {name} | {scope} | "
                    + " | ".join(cells)
                    + f" | {'-' if equal is None else f'{equal:.3f}'} |"
                )
    if "paraphrase" in payload:
        lines += [
            "",
            f"Reworded questions ({', '.join(FREE_TEXT)}; `benchmarks/traces/paraphrase_float32.json`), "
            "with the original question and answer held as an earlier request (warm) and without (cold):",
            "",
            "| drafts | cold tok/step / drafted | warm tok/step / drafted | warm / cold |",
            "|---|---|---|---|",
        ]
        for name, cell in payload["paraphrase"].items():
            cold, warm = cell["cold"], cell["warm"]
            lines.append(
                f"| {name} | {cold['tokens_per_step']:.2f} / {cold['drafted_per_step']:.1f} "
                f"| {warm['tokens_per_step']:.2f} / {warm['drafted_per_step']:.1f} "
                f"| {cell['warm_over_cold']:.2f}x |"
            )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """Each drafter's tokens per step over prompt lookup's on the same traces, keyed for
    comparing two runs (a quick run replays the first 4 traces of each workload); and each
    timed drafter's host time per step over prompt lookup's (``host_us/...``: a drafter that
    got slower shows, whatever the host's speed)."""
    tokens = {
        f"{workload}/{scope}/{name}": cell["tokens_per_step"] / by_drafter["prompt_lookup"]["tokens_per_step"]
        for workload, scopes in payload["results"].items()
        for scope, by_drafter in scopes.items()
        for name, cell in by_drafter.items()
        if name != "prompt_lookup"
    }
    host = payload.get("host_us", {})
    return tokens | {
        f"host_us/{name}": us / host["prompt_lookup"] for name, us in host.items() if name != "prompt_lookup"
    }


def plot(payload: dict):
    from benchmarks.common import grouped_bars, new_figure

    front = payload.get("frontier")
    figure, axes = new_figure(len(SCOPES) * (2 if front else 1))
    drafters = payload["meta"]["drafters"]
    workloads = list(payload["results"])
    for axis, scope in zip(axes, SCOPES):
        series = {
            name: [payload["results"][workload][scope][name]["tokens_per_step"] for workload in workloads]
            for name in drafters
        }
        grouped_bars(axis, workloads, series, "tokens per step")
        axis.set_title(f"replay, {scope} scope (max draft {MAX_DRAFT})")
    for axis, scope in zip(axes[len(SCOPES) :], SCOPES if front else ()):
        for name, by_scope in front["curves"].items():
            points = by_scope[scope]
            axis.plot([p["drafted"] for p in points], [p["tokens"] for p in points], marker="o", label=name)
        axis.set_xlabel("drafted per step / SuffixDecoding's")
        axis.set_ylabel("tokens per step / SuffixDecoding's")
        axis.set_title(f"frontier, {scope} scope (factor {FRONTIER_FACTORS[0]:g}-{FRONTIER_FACTORS[-1]:g})")
        axis.legend()
    figure.tight_layout()
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="the first 4 traces of each workload")
    parser.add_argument("--record", action="store_true", help="record the greedy traces (both files) first")
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    args = parser.parse_args()
    if args.record:
        TRACES.parent.mkdir(parents=True, exist_ok=True)
        for path, recorded in zip((TRACES, PARAPHRASE_TRACES), record(NUM_PROMPTS, MAX_TOKENS)):
            path.write_text(json.dumps(recorded) + "\n")
    drafters = list(args.drafters)
    if "suffix_decoding" in drafters and (why := SuffixDecoding.available()) is not None:
        print(f"skipping suffix_decoding: {why}")
        drafters.remove("suffix_decoding")
    compiled_module()  # build or load the compiled store now, not inside the first timed cell
    recorded = json.loads(TRACES.read_text())
    traces = {name: workload[:4] if args.quick else workload for name, workload in recorded["traces"].items()}
    payload = {
        "benchmark": "replay",
        "meta": {
            **run_metadata(None, "float32", "benchmarks.replay"),
            "model": f"{recorded['meta']['model']} (recorded greedy traces)",
            "traces_recorded": recorded["meta"],
            "drafters": drafters,
            "max_draft": MAX_DRAFT,
        },
        "host_us": host_time(recorded["traces"]),
        "results": run(traces, drafters),
        "batch": batch_drafting(traces),
    }
    if "suffix_decoding" in drafters:
        payload["frontier"] = frontier(traces)
    if PARAPHRASE_TRACES.exists():
        payload["paraphrase"] = paraphrase_gain(traces, json.loads(PARAPHRASE_TRACES.read_text())["traces"])
    publish_run(result_name("replay", "float32", args.quick), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
