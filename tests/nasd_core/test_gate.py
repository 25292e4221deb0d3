"""The draft gate: a request whose drafts do not pay, read in plain steps, goes to plain steps."""

from __future__ import annotations

import pytest

from nasd_core.speculation.gate import (
    FIRST_BACKOFF_STEPS,
    GATE_WINDOW,
    IDLE_LOOKUPS,
    LOOKUP_WINDOW,
    LOSS_BUDGET,
    MAX_BACKOFF_STEPS,
    RETEST_SHARE,
    DraftGate,
    GateHistory,
    row_costs,
)


def run_window(gate: DraftGate, gain: float, cost: float, drafted: bool = True) -> int:
    """Steps of ``gain`` and ``cost`` until the window's verdict: how many it took."""
    steps = 0
    while True:
        assert gate.is_open
        gate.record(drafted, gain, cost)
        steps += 1
        if gate.window_steps == 0:
            return steps


def plain_steps_until_open(gate: DraftGate) -> int:
    steps = 0
    while not gate.is_open:
        gate.skip()
        steps += 1
    return steps


def test_a_window_of_drafts_that_did_not_pay_closes_the_gate_for_longer_each_time():
    gate = DraftGate()
    backoffs = []
    for _ in range(9):
        run_window(gate, gain=0.1, cost=0.5)
        backoffs.append(plain_steps_until_open(gate))
    assert backoffs == [min(FIRST_BACKOFF_STEPS << n, MAX_BACKOFF_STEPS) for n in range(9)]
    assert backoffs[-1] == MAX_BACKOFF_STEPS and gate.num_closures == 9


def test_a_window_that_paid_keeps_the_gate_open_and_resets_the_backoff():
    gate = DraftGate()
    run_window(gate, gain=0.0, cost=0.01, drafted=False)  # lookups that found nothing cost, gave nothing
    assert plain_steps_until_open(gate) == FIRST_BACKOFF_STEPS
    run_window(gate, gain=0.0, cost=0.01, drafted=False)
    assert plain_steps_until_open(gate) == 2 * FIRST_BACKOFF_STEPS
    run_window(gate, gain=2.0, cost=1.0)
    assert gate.is_open and gate.num_failures == 0
    run_window(gate, gain=0.0, cost=0.0)  # nothing gained is no pay, even for free
    assert plain_steps_until_open(gate) == FIRST_BACKOFF_STEPS


def test_a_window_that_loses_its_budget_ends_at_once_and_a_retest_is_a_quarter_window():
    gate = DraftGate()
    # Misses of 0.3 tokens each: the fourth passes the first window's budget of 1 token.
    assert run_window(gate, gain=0.0, cost=0.3) == 4 == int(LOSS_BUDGET / 0.3) + 1
    assert plain_steps_until_open(gate) == FIRST_BACKOFF_STEPS
    retest_budget = RETEST_SHARE * LOSS_BUDGET
    assert run_window(gate, gain=0.0, cost=0.3, drafted=False) == 1 == int(retest_budget / 0.3) + 1
    assert plain_steps_until_open(gate) == 2 * FIRST_BACKOFF_STEPS
    # Lookups that cost next to nothing and never drafted get their verdict at a re-test's end.
    assert run_window(gate, gain=0.0, cost=0.001, drafted=False) == RETEST_SHARE * IDLE_LOOKUPS
    assert not gate.is_open and gate.num_failures == 3
    # Drafts that pay in a re-test's drafted steps give the next window its whole size back.
    plain_steps_until_open(gate)
    assert run_window(gate, gain=1.0, cost=0.5) == RETEST_SHARE * GATE_WINDOW and gate.num_failures == 0
    assert run_window(gate, gain=0.0, cost=0.3) == 4
    assert run_window(DraftGate(), gain=0.0, cost=0.001, drafted=False) == IDLE_LOOKUPS


def test_a_verdict_waits_for_a_whole_window_and_lookups_alone_wait_longer():
    gate = DraftGate()
    for _ in range(GATE_WINDOW - 1):
        gate.record(True, 0.0, 0.1)
    assert gate.is_open
    gate.record(True, 100.0, 0.0)  # the window's total decides, not its last step
    assert gate.is_open and gate.num_failures == 0
    # One drafted step that paid for a long run of cheap lookups: they are judged together.
    gate.record(True, 1.0, 0.1)
    for _ in range(LOOKUP_WINDOW - 2):
        gate.record(False, 0.0, 0.01)
    assert gate.window_steps == LOOKUP_WINDOW - 1
    gate.record(False, 0.0, 0.01)
    assert gate.is_open and gate.window_steps == 0


def test_lookups_that_never_draft_end_their_window_early_and_one_draft_keeps_it_whole():
    gate = DraftGate()
    for _ in range(IDLE_LOOKUPS - 1):
        gate.record(False, 0.0, 0.0)
    assert gate.is_open and gate.window_steps == IDLE_LOOKUPS - 1
    gate.record(False, 0.0, 0.0)
    assert not gate.is_open and gate.window_steps == 0 and gate.num_failures == 1
    # A window whose lookups drafted once is judged over the whole lookup window, and can pay.
    gate = DraftGate()
    gate.record(True, 3.0, 0.2)
    for _ in range(LOOKUP_WINDOW - 2):
        gate.record(False, 0.0, 0.01)
    assert gate.is_open and gate.window_steps == LOOKUP_WINDOW - 1
    gate.record(False, 0.0, 0.01)
    assert gate.is_open and gate.window_steps == 0 and gate.num_failures == 0


def test_new_requests_first_windows_are_retests_while_most_recent_first_windows_failed():
    history = GateHistory()
    first_windows = []
    for _ in range(4):  # requests whose lookups never found a draft worth its cost
        gate = history.new_gate()
        first_windows.append(run_window(gate, gain=0.0, cost=0.001, drafted=False))
        assert not gate.is_open
        # Only a request's first verdict is the history's: its re-tests say nothing new.
        plain_steps_until_open(gate)
        run_window(gate, gain=0.0, cost=0.001, drafted=False)
    retest = int(RETEST_SHARE * IDLE_LOOKUPS)
    assert first_windows == [IDLE_LOOKUPS, IDLE_LOOKUPS, IDLE_LOOKUPS, retest]
    assert history.num_verdicts == 4 and history.paid_share < 0.5
    # A re-test-sized first window that pays: the request keeps drafting, in whole windows.
    gate = history.new_gate()
    assert run_window(gate, gain=1.0, cost=0.5) == RETEST_SHARE * GATE_WINDOW
    assert gate.is_open and run_window(gate, gain=1.0, cost=0.5) == GATE_WINDOW
    # Requests whose drafts pay bring whole first windows back.
    while history.paid_share < 0.5:
        run_window(history.new_gate(), gain=1.0, cost=0.5)
    assert run_window(history.new_gate(), gain=1.0, cost=0.5) == GATE_WINDOW
    # A gate of no history (a lone request) starts whole.
    assert run_window(DraftGate(), gain=0.0, cost=0.001, drafted=False) == IDLE_LOOKUPS


def test_row_costs_split_lookups_among_lookers_and_positions_by_rows_drafts():
    # 4 rows, the step took 1.5 plain steps, 0.1 of them finding drafts; rows 0-2 looked up,
    # rows 0 and 1 drafted 3 and 1 positions.
    costs = row_costs(1.5, 0.1, [True, True, True, False], [3, 1, 0, 0])
    lookup, positions = 0.1 / 3, 0.4
    expected = [lookup + 0.75 * positions, lookup + 0.25 * positions, lookup, 0.0]
    assert costs == pytest.approx([4 * cost for cost in expected])
    # Each row's excess is paid by every row's wait: the batch's total is rows x excess.
    assert sum(costs) == pytest.approx(4 * 0.5)


def test_row_costs_charge_lookups_always_and_leave_the_clocks_noise_to_the_drafts():
    # Read under a plain step: the drafts are credited the noise, so it averages out over a window.
    assert row_costs(0.9, 0.05, [True], [2]) == pytest.approx([0.05 - 0.15])
    # A lookup that found nothing costs its own time, whatever the clock read of the whole step.
    assert row_costs(0.98, 0.05, [True, True], [0, 0]) == pytest.approx([0.05, 0.05])
