"""The draft gate: a request whose drafts do not pay, read in plain steps, goes to plain steps."""

from __future__ import annotations

import pytest

from nasd_core.speculation.gate import (
    FIRST_BACKOFF_STEPS,
    GATE_WINDOW,
    MAX_BACKOFF_STEPS,
    DraftGate,
    row_costs,
)


def run_window(gate: DraftGate, gain: float, cost: float) -> None:
    for _ in range(GATE_WINDOW):
        assert gate.is_open
        gate.record(gain, cost)


def plain_steps_until_open(gate: DraftGate) -> int:
    steps = 0
    while not gate.is_open:
        gate.skip()
        steps += 1
    return steps


def test_a_window_of_drafts_that_did_not_pay_closes_the_gate_for_longer_each_time():
    gate = DraftGate()
    backoffs = []
    for _ in range(8):
        run_window(gate, gain=0.1, cost=0.5)
        backoffs.append(plain_steps_until_open(gate))
    expected = [min(FIRST_BACKOFF_STEPS << n, MAX_BACKOFF_STEPS) for n in range(8)]
    assert backoffs == expected and gate.num_closures == 8


def test_a_window_that_paid_keeps_the_gate_open_and_resets_the_backoff():
    gate = DraftGate()
    run_window(gate, gain=0.0, cost=0.01)  # lookups that found nothing: they cost, they gave nothing
    assert plain_steps_until_open(gate) == FIRST_BACKOFF_STEPS
    run_window(gate, gain=0.0, cost=0.01)
    assert plain_steps_until_open(gate) == 2 * FIRST_BACKOFF_STEPS
    run_window(gate, gain=2.0, cost=1.0)
    assert gate.is_open and gate.num_failures == 0
    run_window(gate, gain=0.0, cost=0.0)  # nothing gained is no pay, even for free
    assert plain_steps_until_open(gate) == FIRST_BACKOFF_STEPS


def test_a_verdict_waits_for_a_whole_window():
    gate = DraftGate()
    for _ in range(GATE_WINDOW - 1):
        gate.record(0.0, 10.0)
    assert gate.is_open
    gate.record(100.0, 0.0)  # the window's total decides, not its last step
    assert gate.is_open and gate.num_failures == 0


def test_row_costs_split_lookups_among_lookers_and_positions_by_rows_drafts():
    # 4 rows, the step took 1.5 plain steps, 0.1 of them finding drafts; rows 0-2 looked up,
    # rows 0 and 1 drafted 3 and 1 positions.
    costs = row_costs(1.5, 0.1, [True, True, True, False], [3, 1, 0, 0])
    lookup, positions = 0.1 / 3, 0.4
    expected = [lookup + 0.75 * positions, lookup + 0.25 * positions, lookup, 0.0]
    assert costs == pytest.approx([4 * cost for cost in expected])
    # Each row's excess is paid by every row's wait: the batch's total is rows x excess.
    assert sum(costs) == pytest.approx(4 * 0.5)


def test_row_costs_never_charge_a_step_below_plain():
    assert row_costs(0.9, 0.05, [True], [2]) == [0.0]
    assert row_costs(1.02, 0.05, [True], [0]) == pytest.approx([0.02])  # the lookups cannot exceed it
