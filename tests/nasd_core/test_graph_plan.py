"""Draft lengths for fixed-shape steps: priced by width, every row drafting up to it."""

from __future__ import annotations

import pytest

from nasd_core.runner.step_graphs import POSITION_BUCKETS
from nasd_core.speculation.acceptance import AcceptanceEstimator
from nasd_core.speculation.graph_plan import GraphStepTimes, plan_graph_drafts
from nasd_core.speculation.policy import RowDraft

WIDTHS = tuple(width for width in POSITION_BUCKETS if width <= 17)


def graph_times(ms_by_width: dict[int, float], rows: tuple[int, ...] = (1, 4, 16)) -> GraphStepTimes:
    step_times = GraphStepTimes()
    for num_rows in rows:
        for width, ms in ms_by_width.items():
            step_times.observe(num_rows, width, ms / 1000)
    return step_times


def copying(estimator: AcceptanceEstimator, match_length: int = 8) -> AcceptanceEstimator:
    for _ in range(50):
        estimator.record(match_length, 16, 16, "request")
    return estimator


# The H100 surface of a fixed-shape step at one row: 1 x 17 costs 1.15x a 1 x 1 step.
NEARLY_FREE = {1: 5.2, 2: 5.25, 4: 5.3, 8: 5.5, 17: 6.0}


def test_where_verification_is_nearly_free_a_well_matched_row_drafts_the_widest_shape():
    row = RowDraft("auto", 16, 8, copying(AcceptanceEstimator()), "request")
    plan = plan_graph_drafts([row], WIDTHS, graph_times(NEARLY_FREE))
    assert plan.lengths == [16] and plan.num_chosen == 16 and plan.gain > 1.5


def test_a_width_paid_for_by_one_row_is_filled_by_every_row():
    """Four rows, one copying and three with middling drafts: the step's width is the copy's, and
    the other rows draft up to it (their drafts cost the device nothing more)."""
    good = RowDraft("auto", 16, 8, copying(AcceptanceEstimator()), "request")
    middling = [RowDraft("auto", 10, 2, AcceptanceEstimator(), "request") for _ in range(3)]
    plan = plan_graph_drafts([good, *middling], WIDTHS, graph_times(NEARLY_FREE))
    assert plan.lengths == [16, 10, 10, 10]


def test_drafts_that_cannot_repay_a_dear_width_are_not_verified():
    steep = {1: 5.0, 2: 9.0, 4: 15.0, 8: 25.0, 17: 50.0}
    guesses = [RowDraft("auto", 16, 1, AcceptanceEstimator(), "request") for _ in range(4)]
    plan = plan_graph_drafts(guesses, WIDTHS, graph_times(steep))
    assert plan.lengths == [0] * 4 and plan.num_chosen == 0


def test_on_rows_set_the_narrowest_width_and_off_rows_never_draft():
    on = RowDraft("on", 5, 1, AcceptanceEstimator(), "request")
    off = RowDraft("off", 16, 8, copying(AcceptanceEstimator()), "request")
    auto = RowDraft("auto", 16, 8, copying(AcceptanceEstimator()), "request")
    plan = plan_graph_drafts([on, off, auto], WIDTHS, graph_times(NEARLY_FREE))
    assert plan.lengths == [5, 0, 16]
    assert plan.num_chosen == 16  # the policy chose the auto row's; the on row's were forced
    # A forced draft wider than any shape: nothing to choose (the step runs packed).
    wide = RowDraft("on", 40, 1, AcceptanceEstimator(), "request")
    assert plan_graph_drafts([wide, auto], WIDTHS, graph_times(NEARLY_FREE)).lengths == [40, 0]


def test_a_discounted_payoff_withholds_drafts_near_the_bar():
    rows = [RowDraft("auto", 4, 3, AcceptanceEstimator(), "request") for _ in range(4)]
    step_time = graph_times({1: 5.0, 2: 5.5, 4: 6.0, 8: 7.0, 17: 9.0})
    assert sum(plan_graph_drafts(rows, WIDTHS, step_time).lengths) > 0
    assert plan_graph_drafts(rows, WIDTHS, step_time, payoff=0.5).lengths == [0] * 4


def test_a_width_that_would_slow_a_row_below_its_pace_is_not_chosen():
    """Four rows, one copying: at a surface where a 1 x 17 step costs 1.6x a plain one, the
    copier's drafts pay for the batch, but the rows with nothing to draft would run at 1/1.6 of
    plain decoding; without credit they keep the step plain."""
    dear = {1: 5.0, 2: 5.5, 4: 6.0, 8: 6.5, 17: 8.0}
    copier = RowDraft("auto", 16, 8, copying(AcceptanceEstimator()), "request")
    idle = [RowDraft("auto", 0, 0, AcceptanceEstimator()) for _ in range(3)]  # no floor set
    plan = plan_graph_drafts([copier, *idle], WIDTHS, graph_times(dear))
    assert plan.lengths[0] == 16 and plan.cost_ratio == pytest.approx(8.0 / 5.0)
    idle = [RowDraft("auto", 0, 0, AcceptanceEstimator(), pace_credit=0.0) for _ in range(3)]
    assert plan_graph_drafts([copier, *idle], WIDTHS, graph_times(dear)).lengths == [0] * 4
