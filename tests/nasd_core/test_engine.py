"""Continuous-batching engine on the real model: batched identity, seeds, cancellation, queue limits."""

from __future__ import annotations

import asyncio
import math
import threading
from types import SimpleNamespace

import pytest

from nasd_core import SamplingParams, SpecConfig, generate
from nasd_core.config import EngineConfig
from nasd_core.engine import speculator
from nasd_core.engine.async_engine import AsyncEngine
from nasd_core.engine.engine import Engine
from nasd_core.engine.scheduler import ScheduledStep
from nasd_core.errors import EngineOverloadedError, InvalidRequestError
from nasd_core.runner.model_runner import StepRow
from nasd_core.speculation import gate, graph_plan, payoff, policy
from nasd_core.speculation.acceptance import AcceptanceEstimator
from nasd_core.speculation.calibration import Calibration
from nasd_core.speculation.drafter import LOCAL_SOURCE, RequestDrafter
from nasd_core.speculation.payoff import MIN_PAYOFF
from nasd_core.speculation.policy import DraftPlan
from nasd_core.speculation.step_time import StepTimeModel

PROMPTS = [
    "one, two, three, four, five,",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Monday, Tuesday,",
    '{"name": "Ada", "age": 36}\n{"name": "Alan", "age": 41}\n{"name": "Grace", "age":',
    "To be, or not to be,",
    "The cat sat on the mat. The cat sat on the",
    "SELECT name FROM users WHERE age > 30;\nSELECT name FROM users WHERE",
    "Hi",
    "alpha beta gamma alpha beta gamma alpha",
    "<ul>\n  <li>apple</li>\n  <li>banana</li>\n  <li>",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MAX_TOKENS = [14, 20, 24, 10, 18, 12, 22, 16, 8, 20, 15, 24]


def single_sequence_runs(model, tokenizer) -> list[list[int]]:
    """Each prompt's single-sequence greedy output (itself equal to transformers' greedy)."""
    return [
        generate(
            model, tokenizer, prompt, SamplingParams(max_tokens=max_tokens), SpecConfig(mode="off")
        ).token_ids
        for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS)
    ]


@pytest.fixture(scope="module")
def model(gguf_model):
    """The server's default weights (GGUF blocks): these tests are about the engine's logic, and
    float32's batching identity is test_step_graphs' and test_cpu_kernels'."""
    return gguf_model


@pytest.fixture(scope="module")
def single_runs(model, tokenizer) -> list[list[int]]:
    return single_sequence_runs(model, tokenizer)


def run_staggered(
    engine: Engine, prompts, max_tokens, spec: SpecConfig, params_for=None
) -> dict[int, list[int]]:
    """Add the prompts a few at a time between steps, run to completion, outputs by prompt index."""
    ids: dict[int, str] = {}
    pending = list(range(len(prompts)))
    while pending or not engine.is_finished():
        for _ in range(min(3, len(pending))):
            index = pending.pop(0)
            params = params_for(index) if params_for else SamplingParams(max_tokens=max_tokens[index])
            ids[index] = engine.add_request(prompts[index], params, spec)
        for _ in range(2):
            engine.step()
    return {index: engine.pop_result(request_id).token_ids for index, request_id in ids.items()}


@pytest.mark.parametrize("mode", ["on", "auto"])
@pytest.mark.parametrize("block_size", [32, 4], ids=["blocks_of_32", "blocks_of_4"])
def test_batched_greedy_equals_single_sequence_runs(model, tokenizer, single_runs, mode, block_size):
    config = EngineConfig(max_batch_rows=8, prefill_chunk_tokens=16, kv_block_size=block_size)
    engine = Engine(model, tokenizer, config)
    engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free: auto verifies them
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, SpecConfig(mode=mode, num_draft_tokens=5))
    mismatches = [i for i, expected in enumerate(single_runs) if outputs[i] != expected]
    assert not mismatches, f"rows {mismatches} differ from their single-sequence runs"
    assert engine.stats.num_accepted > 0, "speculation was not exercised"
    assert max(engine.width_histogram) > 0
    assert not engine.cache.rows and not engine.requests
    assert engine.cache.num_available == engine.cache.num_row_blocks


def test_prefill_budget_is_shared_by_the_requests_of_a_step(model, tokenizer, single_runs):
    """Short prompts arriving together join in the same step while the budget lasts; the next
    one waits for the next step, and a prompt longer than the budget is fed in chunks."""
    lengths = [len(tokenizer(PROMPTS[index]).input_ids) - 1 for index in (1, 2, 11)]
    budget = lengths[0] + lengths[1]  # exactly the first two prompts
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=8, prefill_chunk_tokens=budget))
    ids = [
        engine.add_request(PROMPTS[index], SamplingParams(max_tokens=MAX_TOKENS[index]))
        for index in (1, 2, 11)
    ]
    engine.step()
    assert [request.request_id for request in engine.running] == ids[:2]
    assert engine.prefilling[0].num_prefilled == 0, "the budget was spent; the third prompt must wait"
    small = Engine(model, tokenizer, EngineConfig(max_batch_rows=8, prefill_chunk_tokens=7))
    long_id = small.add_request(PROMPTS[11], SamplingParams(max_tokens=MAX_TOKENS[11]))
    steps_to_join = 0
    while not small.running:
        small.step()
        steps_to_join += 1
    assert steps_to_join == -(-lengths[2] // 7)
    while not (engine.is_finished() and small.is_finished()):
        engine.step() if not engine.is_finished() else small.step()
    assert [engine.pop_result(request_id).token_ids for request_id in ids] == [
        single_runs[i] for i in (1, 2, 11)
    ]
    assert small.pop_result(long_id).token_ids == single_runs[11]


def test_sampled_requests_keep_their_seed_whatever_the_batch(model, tokenizer):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=1234)
    alone = Engine(model, tokenizer).generate([PROMPTS[1]], params)[0].token_ids
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=6))
    crowd = [SamplingParams(max_tokens=12, temperature=1.0, seed=seed) for seed in range(5)]
    outputs = run_staggered(
        engine,
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[4], PROMPTS[9], PROMPTS[3]],
        None,
        SpecConfig(mode="on"),
        params_for=lambda i: params if i == 2 else crowd[i % 5],
    )
    assert outputs[2] == alone


def test_cancellation_leaves_other_requests_untouched(model, tokenizer, single_runs):
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=4))
    ids = [engine.add_request(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i])) for i in range(4)]
    waiting_id = engine.add_request(PROMPTS[5], SamplingParams(max_tokens=10))
    for _ in range(3):
        engine.step()
    assert engine.cancel(ids[2])  # running
    assert engine.cancel(waiting_id)  # still queued
    assert not engine.cancel("no-such-request")
    while not engine.is_finished():
        engine.step()
    cancelled = engine.pop_result(ids[2])
    assert cancelled.finish_reason == "cancelled"
    assert single_runs[2][: len(cancelled.token_ids)] == cancelled.token_ids
    for i in (0, 1, 3):
        assert engine.pop_result(ids[i]).token_ids == single_runs[i]


def test_full_queue_refuses_new_requests_and_keeps_the_others(model, tokenizer, single_runs):
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=1, max_waiting=2))
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0]))
    second = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS[3]))
    with pytest.raises(EngineOverloadedError):
        engine.add_request(PROMPTS[5], SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError):
        engine.add_request("", SamplingParams(max_tokens=5))
    while not engine.is_finished():
        engine.step()
    assert engine.pop_result(first).token_ids == single_runs[0]
    assert engine.pop_result(second).token_ids == single_runs[3]


@pytest.mark.parametrize("overlapped", [False, True], ids=["tail_at_once", "tail_overlapped"])
def test_async_engine_streams_concurrent_requests(model, tokenizer, single_runs, overlapped):
    """``overlapped``: the engine runs as on a GPU, each step's streaming and learning left for
    the next step's device time (forced here: a CPU's forward is done when it returns)."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=4))
    engine.runner.runs_async = overlapped
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def collect(index: int) -> tuple[list[int], str | None]:
        tokens, reason = [], None
        async for chunk in async_engine.generate(
            PROMPTS[index], SamplingParams(max_tokens=MAX_TOKENS[index])
        ):
            tokens.extend(chunk.token_ids)
            reason = chunk.finish_reason
        return tokens, reason

    async def abandon() -> int:
        received = 0
        async for chunk in async_engine.generate(PROMPTS[11], SamplingParams(max_tokens=64)):
            received += len(chunk.token_ids)
            if received >= 3:
                break  # the client goes away: the request must be cancelled
        return received

    async def scenario():
        with pytest.raises(InvalidRequestError):
            async for _ in async_engine.generate([], SamplingParams(max_tokens=4)):
                pass
        return await asyncio.gather(*(collect(i) for i in range(6)), abandon())

    try:
        results = asyncio.run(scenario())
        for index, (tokens, reason) in enumerate(results[:6]):
            assert tokens == single_runs[index]
            assert reason in ("stop", "length")
        assert async_engine.call(lambda e: e.is_finished() and not e.requests).result(timeout=30)
        assert not engine.cache.rows and not engine._tail
    finally:
        async_engine.shutdown()


def test_async_engine_learns_prompts_off_the_engine_thread(model, tokenizer, single_runs, monkeypatch):
    """Encoding a prompt and indexing it for the drafter happen before the request reaches the
    engine thread, so a long prompt does not hold up the running requests' next step."""
    learned_on: list[str] = []
    observe = RequestDrafter.observe

    def recording(drafter: RequestDrafter, tokens) -> None:
        if drafter._num_learned == 0:  # the prompt: the first tokens a drafter learns
            learned_on.append(threading.current_thread().name)
        observe(drafter, tokens)

    monkeypatch.setattr(RequestDrafter, "observe", recording)
    async_engine = AsyncEngine(Engine(model, tokenizer, EngineConfig(max_batch_rows=2)))
    async_engine.start()
    engine_thread = async_engine._thread.name

    async def collect(index: int) -> list[int]:
        tokens = []
        async for chunk in async_engine.generate(
            PROMPTS[index], SamplingParams(max_tokens=MAX_TOKENS[index])
        ):
            tokens.extend(chunk.token_ids)
        return tokens

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(collect(0), collect(1)))

    try:
        outputs = asyncio.run(both())
    finally:
        async_engine.shutdown()
    assert outputs == [single_runs[0], single_runs[1]]  # the same tokens as ever
    assert len(learned_on) == 2 and engine_thread not in learned_on


class FixedStepTimes(StepTimeModel):
    """Step times given by a cost function everywhere the tests below batch, and kept fixed:
    the engine's own (noisy, machine-dependent) timings must not move the decision tested."""

    def __init__(self, seconds_for) -> None:
        super().__init__()
        for num_rows in range(1, 13):
            for num_positions in range(num_rows, 17 * num_rows + 1):
                super().observe(num_rows, num_positions, seconds_for(num_rows, num_positions))

    def observe(self, num_rows: int, num_positions: int, seconds: float) -> None:
        pass


def clock_agrees_with_model(monkeypatch) -> None:
    """Steps read as costing what the policy's cost model estimated, not what this host's clock
    says, so that the pace, the gates and the payoff follow the model a test sets (a payoff read
    off this host's clock drafted too little on a Zen 5 for a row's pace to be tested)."""
    monkeypatch.setattr(
        speculator.Speculator,
        "cost_ratio",
        lambda self, step, proposal, wall_s: (proposal.plan.cost_ratio, 0.0),
    )
    record = payoff.DraftPayoff.record
    monkeypatch.setattr(
        payoff.DraftPayoff,
        "record",
        lambda self, num_rows, plan, estimated_s, measured_s, num_tokens: record(
            self, num_rows, plan, estimated_s, estimated_s, num_tokens
        ),
    )


@pytest.mark.parametrize("cost", ["linear_in_positions", "flat"])
def test_auto_builds_no_draft_when_no_draft_could_pay(model, tokenizer, single_runs, monkeypatch, cost):
    """Where every extra position costs as much as a whole step, no draft can pay for itself,
    so auto must not even build drafts (that was 4% of a step at 16 rows), and rows go to plain
    steps after a window of lookups; where extra positions are free it must speculate. Greedy
    outputs are unchanged."""
    built: list[int] = []
    propose, longest_match = RequestDrafter.propose, RequestDrafter.longest_match
    num_lookups = 0

    def counting_propose(self, tokens, max_tokens, *suffix):
        draft = propose(self, tokens, max_tokens, *suffix)
        built.append(len(draft.tokens))
        return draft

    def counting_longest_match(self, tokens, *suffix):
        nonlocal num_lookups
        num_lookups += 1
        return longest_match(self, tokens, *suffix)

    monkeypatch.setattr(RequestDrafter, "propose", counting_propose)
    monkeypatch.setattr(RequestDrafter, "longest_match", counting_longest_match)
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=12))
    linear = cost == "linear_in_positions"
    # "linear": each extra position quadruples the step (a draft adds at most one token per row,
    # at most doubling a step's output), so no draft pays, prompt chunks riding along or not.
    engine.step_time = FixedStepTimes(
        (lambda rows, positions: 4.0 ** min(positions - rows, 400)) if linear else (lambda *_: 0.1)
    )
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, SpecConfig(mode="auto", num_draft_tokens=5))
    assert [outputs[i] for i in range(len(PROMPTS))] == single_runs
    num_row_steps = engine.stats.num_steps  # every decode step of every row
    if linear:
        assert built == [] and engine.stats.num_drafted == 0
        assert num_lookups == engine.stats.num_speculative_steps < num_row_steps
        # Lookups that never led to a draft close a longer request's gate (gate.LOOKUP_WINDOW).
        num_lookups = 0
        [result] = engine.generate([PROMPTS[11]], SamplingParams(max_tokens=80), SpecConfig(mode="auto"))
        assert result.stats.num_gate_closures >= 1 and result.stats.num_drafted == 0
        assert num_lookups == result.stats.num_speculative_steps < result.stats.num_steps - 3
    else:
        assert sum(built) > 0 and engine.stats.num_accepted > 0


REPEATING = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha"


def greedy_off(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens)
    return generate(model, tokenizer, prompt, params, SpecConfig(mode="off")).token_ids


def test_a_request_whose_drafts_stop_paying_goes_to_plain_steps(model, tokenizer, monkeypatch):
    """Drafts are charged what the step cost the batch, read off the clock (``gate.row_costs``);
    injected here as far more than any draft gives, the request's gate closes after a window and
    it runs plain steps, with no lookup, until its back-off ends. The output stays greedy's."""
    lookups = 0
    longest_match = RequestDrafter.longest_match

    def counting_longest_match(self, tokens, *suffix):
        nonlocal lookups
        lookups += 1
        return longest_match(self, tokens, *suffix)

    monkeypatch.setattr(RequestDrafter, "longest_match", counting_longest_match)
    monkeypatch.setattr(
        speculator, "row_costs", lambda ratio, share, looked_up, drafted: [100.0] * len(looked_up)
    )
    engine = Engine(model, tokenizer)
    engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free to the policy: it drafts
    params = SamplingParams(max_tokens=80)
    [result] = engine.generate([REPEATING], params, SpecConfig(mode="auto"))
    assert result.token_ids == greedy_off(model, tokenizer, REPEATING, 80)
    stats = result.stats
    assert stats.num_drafted > 0  # it did draft, at first
    assert stats.num_gate_closures >= 2  # closed, tested again after its back-off, closed again
    # Every speculative step belongs to a window, at most one of them unfinished; each closure
    # but the last sat out its whole back-off (8, 16, ... plain steps).
    closures = stats.num_gate_closures
    assert lookups == stats.num_speculative_steps <= (closures + 1) * gate.GATE_WINDOW
    backoffs = gate.FIRST_BACKOFF_STEPS * (2 ** (closures - 1) - 1)
    assert stats.num_steps - stats.num_speculative_steps >= backoffs
    # Its first verdict, and only that one, is the engine's history of first windows
    # (``gate.GateHistory``), which sizes the next requests' first windows.
    history = engine.calibration.gate_history
    assert history.num_verdicts == 1 and history.paid_share == 1.0 - gate.HISTORY_WEIGHT


def test_a_plain_step_in_auto_runs_no_drafting_code(model, tokenizer, single_runs, monkeypatch):
    """With every row's gate closed (and, on a new engine, in its first plain steps at a row
    count, which time the yardstick), ``auto`` asks no drafter, no policy and learns no acceptance:
    its plain step is ``off``'s."""

    def forbidden(*args, **kwargs):
        raise AssertionError("drafting code ran in a plain step")

    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=12))
    for name in ("longest_matches", "propose_rows", "row_costs"):
        monkeypatch.setattr(speculator, name, forbidden)
    monkeypatch.setattr(speculator.Speculator, "plan", forbidden)
    monkeypatch.setattr(Engine, "_learn_acceptance", forbidden)
    spec = SpecConfig(mode="auto")
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), spec)
        for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS)
    ]
    for request_id in ids:
        engine.requests[request_id].gate.plain_steps_left = 10**6
    while not engine.is_finished():
        engine.step()
    results = [engine.pop_result(request_id) for request_id in ids]
    assert [result.token_ids for result in results] == single_runs
    assert all(result.stats.num_speculative_steps == 0 for result in results)
    monkeypatch.undo()

    # A new engine's first steps at a row count are plain, to time it: no lookup before then.
    engine = Engine(model, tokenizer)
    lookups: list[int] = []
    longest_matches = speculator.longest_matches
    num_steps = 0

    def counting(drafters, tokens):
        lookups.append(num_steps)
        return longest_matches(drafters, tokens)

    monkeypatch.setattr(speculator, "longest_matches", counting)
    request_id = engine.add_request(REPEATING, SamplingParams(max_tokens=24), spec)
    while not engine.is_finished():
        num_steps += 1
        engine.step()
    assert engine.pop_result(request_id).token_ids == greedy_off(model, tokenizer, REPEATING, 24)
    # Step 1 is the prompt's chunk, steps 2-4 time plain steps of one row, then it looks up.
    assert lookups and min(lookups) == 2 + speculator.MIN_TRUSTED_SAMPLES


def test_rows_at_their_pace_floor_look_nothing_up_while_no_draft_could_keep_it(model, tokenizer, monkeypatch):
    """Two rows of a repeating prompt, where one extra position would make a step 1.5x as dear:
    with their pace credit spent, no draft could keep the other row's floor, so ``auto`` asks
    neither the drafter nor the policy (``Speculator._pace_bound``); with the credit a request
    starts with, the same steps look up. One row alone sets no floor on its own drafts."""
    lookups: list[int] = []
    longest_matches = speculator.longest_matches

    def counting(drafters, tokens):
        lookups.append(len(drafters))
        return longest_matches(drafters, tokens)

    monkeypatch.setattr(speculator, "longest_matches", counting)
    expected = greedy_off(model, tokenizer, REPEATING, 10)
    for spent, num_rows in ((True, 2), (False, 2), (True, 1)):
        lookups.clear()
        engine = Engine(model, tokenizer)
        engine.step_time = FixedStepTimes(lambda rows, positions: 0.01 * positions)
        ids = [
            engine.add_request(REPEATING, SamplingParams(max_tokens=10), SpecConfig(mode="auto"))
            for _ in range(num_rows)
        ]
        if spent:
            for request_id in ids:
                engine.requests[request_id].pace_credit = 0.0
        while not engine.is_finished():
            engine.step()
        assert [engine.pop_result(request_id).token_ids for request_id in ids] == [expected] * num_rows
        assert (not lookups) == (spent and num_rows == 2), (spent, num_rows, lookups)


def test_auto_drafts_less_where_drafted_steps_have_not_delivered(model, tokenizer, single_runs):
    """The engine prices drafts with its step-time model's ``DraftPayoff``: where drafted steps
    of 2+ rows delivered next to nothing, auto drafts less at those row counts (one-row steps
    are never discounted), and the engine reads its own steps into it. Outputs unchanged."""
    drafted = {}
    for discounted in (True, False):
        engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=12))
        engine.step_time = FixedStepTimes(lambda *_: 0.1)  # extra positions free: drafts promise much
        if discounted:
            for num_rows in (2, 4, 8, 16):
                for _ in range(500):
                    engine.payoff.record(
                        num_rows, DraftPlan([1] * num_rows, num_rows, 2.0 * num_rows, 1.2), 0.1, 0.1, 1
                    )
            assert engine.payoff.factor(12) == MIN_PAYOFF and engine.payoff.factor(1) == 1.0
        outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, SpecConfig(mode="auto", num_draft_tokens=5))
        assert [outputs[i] for i in range(len(PROMPTS))] == single_runs
        drafted[discounted] = engine.stats.num_drafted
        if not discounted:
            assert engine.payoff.num_read >= engine.stats.num_steps // len(PROMPTS)  # read its steps
    assert drafted[True] < drafted[False]


@pytest.mark.parametrize("floor", [True, False], ids=["paced", "unpaced"])
def test_other_rows_drafts_never_slow_a_row_below_its_pace(model, tokenizer, single_runs, monkeypatch, floor):
    """Copying rows in ``auto`` share steps with rows that do not speculate, and each drafted
    position costs 1% of a step: the copiers' drafts pay for the batch, but every position slows
    the plain rows. Started at no credit, their pace credit (plain steps ahead of 0.97x of plain
    decoding) never goes below zero; without the floor it does, and more is drafted. The clock
    is made to read what the cost model says (``clock_agrees_with_model``), so that the test
    does not depend on this host's speed. Outputs unchanged either way."""
    if not floor:
        for module in (policy, graph_plan):
            monkeypatch.setattr(module, "keeps_pace", lambda credits, own, ratios, floor=0: ratios > 0)
    clock_agrees_with_model(monkeypatch)
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=12))
    engine.step_time = FixedStepTimes(lambda rows, positions: 0.1 * (1 + 0.01 * (positions - rows)))
    copying = {1, 2, 4, 6, 9, 10}
    ids = [
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=max_tokens),
            SpecConfig(mode="auto" if index in copying else "off"),
        )
        for index, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS))
    ]
    for request_id in ids:
        engine.requests[request_id].pace_credit = 0.0
    plain = [engine.requests[request_id] for index, request_id in enumerate(ids) if index not in copying]
    lowest = 0.0
    while not engine.is_finished():
        engine.step()
        lowest = min(lowest, *(request.pace_credit for request in plain))
    assert [engine.pop_result(request_id).token_ids for request_id in ids] == single_runs
    assert engine.stats.num_accepted > 0
    assert (lowest >= 0) == floor


@pytest.mark.parametrize("floor", [True, False], ids=["paced", "unpaced"])
def test_running_rows_drafts_never_slow_a_prompts_chunks_below_their_pace(
    model, tokenizer, single_runs, monkeypatch, floor
):
    """A prompt prefilled in chunks beside copying rows in ``auto`` waits for every chunk step,
    drafts and all: its chunks keep their own pace, with no slack (``pace.prefill_floor``), so
    its prefill credit never goes below zero; without that floor it does. Outputs unchanged."""
    if not floor:
        monkeypatch.setattr(speculator, "prefill_floor", lambda credits: math.inf)
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=12, prefill_chunk_tokens=4))
    engine.step_time = FixedStepTimes(lambda rows, positions: 0.1 * (1 + 0.03 * (positions - rows)))
    late = 2  # a code prompt of ~30 tokens: seven chunk steps of 4 tokens
    spec = SpecConfig(mode="auto")
    ids = {
        index: engine.add_request(PROMPTS[index], SamplingParams(max_tokens=MAX_TOKENS[index]), spec)
        for index in (1, 4, 6, 9, 10)
    }
    for _ in range(12):  # the copiers are running (and drafting) when the prompt comes
        engine.step()
    ids[late] = engine.add_request(PROMPTS[late], SamplingParams(max_tokens=MAX_TOKENS[late]), spec)
    prompt = engine.requests[ids[late]]
    lowest, chunk_steps = 0.0, 0
    while not engine.is_finished():
        prefilling = prompt.num_prefilled < len(prompt.prompt_ids) - 1
        engine.step()
        chunk_steps += int(prefilling)
        lowest = min(lowest, prompt.prefill_pace_credit)
    assert {index: engine.pop_result(request_id).token_ids for index, request_id in ids.items()} == {
        index: single_runs[index] for index in ids
    }
    assert chunk_steps >= 5
    assert (lowest >= 0) == floor


def test_steps_with_prompt_chunks_are_not_read_into_the_packed_step_model(model, tokenizer):
    """A chunk step costs by its prompt's context, which the packed model does not key: only
    decode steps are read into it on a runner without graphs (a cheap early chunk read in capped
    every narrower width, and drafts beside later chunks looked free)."""
    engine = Engine(model, tokenizer, EngineConfig(prefill_chunk_tokens=8))
    request_id = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=4), SpecConfig(mode="off"))
    while not engine.is_finished():
        engine.step()
    assert len(engine.pop_result(request_id).token_ids) == 4
    assert engine.step_time.measured(1, 1) is not None  # the plain decode steps were read
    assert engine.step_time.widest_measured(1) == 0  # and no chunk step (up to 8 positions)


@pytest.mark.parametrize("graph_widths", [None, (1, 2, 4)])
def test_only_a_graph_runner_reads_chunk_steps_into_the_packed_model(graph_widths):
    """A graph runner's decode steps go to its graph model: its steps with prompt chunks stay the
    packed model's readings, where a runner without graphs reads none of them."""
    learner = speculator.Speculator(SimpleNamespace(graph_widths=graph_widths), Calibration())
    chunk = StepRow("prompt", [1] * 32, 0)
    step = ScheduledStep(rows=[], chunks=[(None, chunk)])
    proposal = speculator.Proposal([], DraftPlan([]), [])
    learner.learn(step, [chunk], proposal, 0.1, 0.1, 0, shape=None, captured=False)
    assert (learner.step_time.measured(1, 32) is not None) == (graph_widths is not None)


def test_engines_given_one_calibration_start_from_what_earlier_engines_learned(model, tokenizer):
    """A new engine's requests start from the acceptance that the earlier requests of engines
    sharing its calibration measured, not from the fixed prior table; an engine given none
    learns alone."""
    calibration = Calibration()
    first = Engine(model, tokenizer, calibration=calibration)
    second = Engine(model, tokenizer, calibration=calibration)
    assert first.acceptance is second.acceptance is calibration.acceptance
    assert Engine(model, tokenizer).acceptance is not calibration.acceptance
    pooled = first.acceptance
    before = {length: pooled.rates(length, LOCAL_SOURCE) for length in range(1, 8)}
    first.generate([PROMPTS[1]], SamplingParams(max_tokens=24), SpecConfig(mode="on"))
    learned = [length for length in before if pooled.rates(length, LOCAL_SOURCE) != before[length]]
    assert learned  # the "on" run verified drafts and the pool counted them
    request_id = second.add_request(PROMPTS[6], SamplingParams(max_tokens=4))
    newcomer = second.requests[request_id].acceptance
    assert all(
        newcomer.rates(length, LOCAL_SOURCE) == pooled.rates(length, LOCAL_SOURCE) for length in learned
    )
    assert any(
        newcomer.rates(length, LOCAL_SOURCE) != AcceptanceEstimator().rates(length) for length in learned
    )


def test_sampled_and_greedy_requests_start_from_pools_of_their_own(model, tokenizer):
    """A sampled row keeps a drafted token with the model's probability of it, a greedy row only
    when it is the top one: what greedy requests' drafts measured is no sampled request's prior,
    nor the other way round."""
    engine = Engine(model, tokenizer)
    greedy_pool, sampled_pool = engine.calibration.acceptance, engine.calibration.sampled_acceptance
    fixed = {length: AcceptanceEstimator().rates(length) for length in range(1, 8)}

    def learned(pool: AcceptanceEstimator) -> list[int]:
        return [length for length in fixed if pool.rates(length, LOCAL_SOURCE) != fixed[length]]

    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    engine.generate([PROMPTS[1]], sampled, SpecConfig(mode="on"))
    assert learned(sampled_pool) and not learned(greedy_pool)
    engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24), SpecConfig(mode="on"))
    assert learned(greedy_pool)
    for pool, params in ((greedy_pool, SamplingParams(max_tokens=4)), (sampled_pool, sampled)):
        newcomer = engine.requests[engine.add_request(PROMPTS[6], params)].acceptance
        assert newcomer.prior is pool
        assert all(newcomer.rates(n, LOCAL_SOURCE) == pool.rates(n, LOCAL_SOURCE) for n in fixed)
    assert any(
        greedy_pool.rates(length, LOCAL_SOURCE) != sampled_pool.rates(length, LOCAL_SOURCE)
        for length in learned(greedy_pool)
    )


def test_choices_of_one_prompt_share_its_prefill(model, tokenizer, single_runs):
    """``prefill_from``: a second choice copies the first's prompt keys and values instead of
    prefilling them; its greedy output is the prompt's, sampled choices keep their seeds."""
    engine = Engine(model, tokenizer, EngineConfig(prefill_chunk_tokens=8))
    prompt, max_tokens = PROMPTS[2], MAX_TOKENS[2]
    first = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    greedy = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), prefill_from=first)
    sampled = [
        engine.add_request(
            prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=seed), prefill_from=first
        )
        for seed in (1, 2)
    ]
    prefilled: list[int] = []
    forward = engine.runner.forward

    def counting_forward(rows):
        prefilled.extend(len(row.token_ids) for row in rows if row.num_logits == 0)
        return forward(rows)

    engine.runner.forward = counting_forward
    while not engine.is_finished():
        engine.step()
    prompt_length = len(engine.requests[first].prompt_ids)
    assert sum(prefilled) == prompt_length - 1  # the prompt went through the model once
    assert engine.pop_result(first).token_ids == engine.pop_result(greedy).token_ids == single_runs[2]
    for request_id, seed in zip(sampled, (1, 2)):
        alone = generate(model, tokenizer, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=seed))
        assert engine.pop_result(request_id).token_ids == alone.token_ids
    with pytest.raises(InvalidRequestError):
        engine.add_request("another prompt", prefill_from=engine.add_request(prompt))
    alone = engine.add_request(prompt, SamplingParams(max_tokens=2), prefill_from="gone")  # prefills itself
    while not engine.is_finished():
        engine.step()
    assert engine.pop_result(alone).token_ids == single_runs[2][:2]


def test_a_choice_whose_source_finished_first_prefills_itself(model, tokenizer, single_runs):
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=1))  # the choice waits for the row
    first = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS[1]))
    second = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS[1]), prefill_from=first)
    while not engine.is_finished():
        engine.step()
    assert engine.pop_result(first).token_ids == engine.pop_result(second).token_ids == single_runs[1]


def test_an_overlapped_tail_reaches_its_client_when_the_engine_stops_running(model, tokenizer, single_runs):
    """With each step's streaming left for the next step's device time, a request that finished
    while another waited gets all its tokens once that other one is cancelled, with no step
    after it; and an engine with a tail to stream is not finished."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=1))
    engine.runner.runs_async = True  # as on a GPU (a CPU's forward is done when it returns)
    streamed: list[int] = []
    first = engine.add_request(
        PROMPTS[3],
        SamplingParams(max_tokens=MAX_TOKENS[3]),
        on_tokens=lambda request, tokens: streamed.extend(tokens),
    )
    queued = engine.add_request(PROMPTS[5], SamplingParams(max_tokens=4))
    while not engine.requests[first].is_finished:
        engine.step()
    assert engine._tail and len(streamed) < len(single_runs[3]), "its last tokens wait for the next step"
    assert not engine.is_finished()
    assert engine.cancel(queued)
    assert streamed == single_runs[3] and not engine._tail and engine.is_finished()
