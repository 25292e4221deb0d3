"""Draft-length policy: expected-token arithmetic and the speculate / don't-speculate decision."""

from __future__ import annotations

import math

import pytest

from nasd_core.metrics import SpecStats
from nasd_core.speculation.acceptance import (
    PRIOR_SPLIT_FIRST_ACCEPT,
    PRIOR_SPLIT_NEXT_ACCEPT,
    AcceptanceEstimator,
    match_bucket,
    pooled_acceptance,
)
from nasd_core.speculation.pace import MIN_ROW_PACE, pace_credit, prefill_floor
from nasd_core.speculation.payoff import MAX_READ_GAIN, MIN_PAYOFF, DraftPayoff
from nasd_core.speculation.policy import (
    LARGE_BATCH_MIN_DRAFT_GAIN,
    LARGE_BATCH_ROWS,
    MIN_DRAFT_GAIN,
    DraftPlan,
    RowDraft,
    choose_draft_length,
    cold_start_cap,
    draft_position_cap,
    plan_batch_drafts,
)
from nasd_core.speculation.step_time import MAX_SAMPLE_RATIO, MIN_TRUSTED_SAMPLES, StepTimeModel, snap_extra


def test_a_drafts_reaches_are_falling_products_of_its_tokens_rates():
    estimator = AcceptanceEstimator()
    a_first, a_next = estimator.rates(3)
    unanimous = RowDraft("auto", 3, 3, estimator).reaches()
    assert unanimous == pytest.approx([a_first, a_first * a_next, a_first * a_next**2])
    split_first, split_next = estimator.rates(3, split=True)
    assert (split_first, split_next) == (PRIOR_SPLIT_FIRST_ACCEPT, PRIOR_SPLIT_NEXT_ACCEPT)
    forked = RowDraft("auto", 3, 3, estimator, splits=(False, True, False)).reaches()
    assert forked == pytest.approx([a_first, a_first * split_next, a_first * split_next * a_next])
    # E(g), the tokens a step verifying g drafts emits, is 1 + the first g reaches.
    assert 1 + sum(unanimous) > 1 + sum(forked)


def test_split_and_unanimous_tokens_are_counted_apart():
    """A draft's tokens after a split in the stored continuations learn their own rates: the
    guesses among several continuations do not drag down the copies, nor the reverse."""
    estimator = AcceptanceEstimator()
    for _ in range(200):
        # Four drafted, the third a split: the first two accepted, the split rejected.
        estimator.record(8, 4, 2, "replica", splits=(False, False, True, False))
    a_first, a_next = estimator.rates(8, "replica")
    split_first, split_next = estimator.rates(8, "replica", split=True)
    assert a_first > 0.95 and a_next > 0.95  # the unanimous second token: always accepted
    assert split_next < 0.05  # the split third token: never
    assert split_first == pytest.approx(PRIOR_SPLIT_FIRST_ACCEPT)  # no split first token seen
    assert estimator.rates(8, "request") == AcceptanceEstimator().rates(8, "request")


def test_the_policy_drafts_up_to_a_split_and_not_past_it():
    step_time = StepTimeModel()
    for extra in range(9):  # one row; each extra position costs 15% of a plain step
        step_time.observe(1, 1 + extra, 0.1 * (1 + 0.15 * extra), 3)
    estimator = AcceptanceEstimator()
    for _ in range(100):
        estimator.record(16, 6, 3, "replica", splits=(False, False, False, True, False, False))
    copy = RowDraft("auto", 6, 16, estimator, "replica")
    assert plan_batch_drafts([copy], step_time).lengths == [6]  # priced as unanimous: all of it
    forked = RowDraft("auto", 6, 16, estimator, "replica", splits=(False, False, False, True, False, False))
    assert plan_batch_drafts([forked], step_time).lengths == [3]


def test_acceptance_estimator_learns_from_outcomes():
    estimator = AcceptanceEstimator()
    prior_first, prior_next = estimator.rates(2)
    for _ in range(50):
        estimator.record(2, num_drafted=4, num_accepted=4)
    first, following = estimator.rates(2)
    assert first > 0.9 > prior_first and following > 0.9 > prior_next
    for _ in range(50):
        estimator.record(5, num_drafted=3, num_accepted=0)
    assert estimator.rates(5)[0] < 0.1
    estimator.record(7, num_drafted=0, num_accepted=0)  # nothing drafted: nothing learned
    assert 7 not in estimator.first


def test_long_matches_share_acceptance_by_span():
    """The suffix source matches up to 64 tokens: lengths above 4 learn together by span
    (5-7, 8-15, 16-31, 32+), so a 12-token match is priced by what 9-token ones did."""
    estimator = AcceptanceEstimator()
    for _ in range(40):
        estimator.record(9, num_drafted=4, num_accepted=0)
    assert estimator.rates(12)[0] < 0.1
    untouched = AcceptanceEstimator().rates
    assert [estimator.rates(length) for length in (4, 7, 16, 40)] == [
        untouched(length) for length in (4, 7, 16, 40)
    ]
    assert [match_bucket(length) for length in (1, 4, 5, 7, 8, 15, 16, 31, 32, 64)] == [
        1,
        4,
        5,
        5,
        8,
        8,
        16,
        16,
        32,
        32,
    ]


def flat_then_expensive() -> StepTimeModel:
    step_time = StepTimeModel()
    step_time.observe(1, 1, 0.060)
    for num_positions in range(2, 10):
        step_time.observe(1, num_positions, 0.100)
    return step_time


def test_acceptance_is_learned_per_draft_source():
    """Matches of one length from other requests' tokens can be far less reliable than from
    the request's own: each source keeps its own counts, and the batch policy prices a row's
    draft by its source's rates."""
    estimator = AcceptanceEstimator()
    for _ in range(30):
        estimator.record(3, num_drafted=4, num_accepted=4, source="request")
        estimator.record(3, num_drafted=4, num_accepted=0, source="replica")
    assert estimator.rates(3, "request")[0] > 0.8 > 0.2 > estimator.rates(3, "replica")[0]
    assert estimator.rates(3) == AcceptanceEstimator().rates(3)  # an unnamed source: the prior
    step_time = StepTimeModel()
    for per_row in range(1, 6):
        step_time.observe(2, 2 * per_row, 0.05 * (1 + 0.05 * 2 * (per_row - 1)), num_samples=3)
    rows = [RowDraft("auto", 4, 3, estimator, "request"), RowDraft("auto", 4, 3, estimator, "replica")]
    assert plan_batch_drafts(rows, step_time).lengths == [4, 0]


def test_policy_skips_unlikely_drafts_and_takes_likely_ones():
    step_time = flat_then_expensive()
    unlikely, likely = AcceptanceEstimator(), AcceptanceEstimator()
    for _ in range(40):
        unlikely.record(1, num_drafted=3, num_accepted=0)
        likely.record(6, num_drafted=8, num_accepted=8)
    assert choose_draft_length(8, 1, unlikely, step_time) == 0
    assert choose_draft_length(8, 6, likely, step_time) == 8
    assert choose_draft_length(0, 6, likely, step_time) == 0


def test_step_time_model_uses_measurements_and_interpolates_by_shape():
    step_time = StepTimeModel()
    assert step_time.estimate(1, 3) > step_time.estimate(1, 1)  # prior shape before any measurement
    assert step_time.estimate(4, 4) > step_time.estimate(1, 1)
    step_time.observe(1, 4, 0.2)
    step_time.observe(1, 4, 0.1)
    assert step_time.estimate(1, 4) == pytest.approx(0.8 * 0.2 + 0.2 * 0.1)
    assert step_time.estimate(1, 5) > step_time.estimate(1, 4)  # wider than measured: prior shape

    # (rows, total positions, seconds): plain and speculative steps at 1 and 16 rows.
    surface = StepTimeModel()
    for rows, positions, seconds in [(1, 1, 0.1), (1, 3, 0.12), (16, 16, 0.2), (16, 48, 0.5), (16, 80, 0.8)]:
        surface.observe(rows, positions, seconds)
    # Linear along rows at a measured number of extra positions, then along extra positions;
    # 2 extra positions at 16 rows borrow the 1-row ratio to the plain step (0.2 x 0.12 / 0.1).
    assert surface.estimate(8, 8) == pytest.approx(0.1 + 0.1 * 7 / 15)
    assert surface.estimate(16, 18) == pytest.approx(0.24)
    assert surface.estimate(16, 32) == pytest.approx(0.24 + 0.26 * 14 / 30)
    # A batch is not a long row: 16 rows with 32 extra positions is priced as measured.
    assert surface.estimate(16, 48) == 0.5 and surface.estimate(1, 3) == 0.12
    # Beyond the widest measurement and beyond the most rows, the last slope continues.
    assert surface.estimate(16, 112) == pytest.approx(1.1)
    assert surface.estimate(32, 32) == pytest.approx(0.2 + 0.1 * 16 / 15)
    assert surface.widest_measured(16) == 64 and surface.widest_measured(17) is None


def test_extra_positions_are_bucketed_on_a_coarsening_grid():
    assert [snap_extra(extra) for extra in range(9)] == list(range(9))
    assert snap_extra(9) == 9 and snap_extra(19) == 20 and snap_extra(100) == 96 and snap_extra(127) == 128
    assert len({snap_extra(extra) for extra in range(1024)}) < 70


def test_step_time_model_borrows_the_shape_of_a_column_measured_at_more_rows():
    # What a server's auto had timed after repetitive traffic (ms): plain steps only at 1-4
    # rows, steps with 12 draft positions at 1-16 rows.
    step_time = StepTimeModel()
    for rows, seconds in {1: 0.0605, 2: 0.0674, 3: 0.0677, 4: 0.0725}.items():
        step_time.observe(rows, rows, seconds)
    for rows, seconds in {1: 0.0722, 4: 0.0973, 8: 0.1452, 16: 0.228}.items():
        step_time.observe(rows, rows + 12, seconds)
    # A plain 16-row step is the speculative one scaled by their ratio at 4 rows, not the 1-4
    # row slope extended (nor 16/4 x the 4-row step, 0.29 s, dearer than the wider step).
    assert step_time.estimate(16, 16) == pytest.approx(0.228 * 0.0725 / 0.0973)
    assert step_time.estimate(16, 16) < 0.8 * step_time.estimate(16, 28)
    # So a 16-row batch of rejected drafts steps plainly (before, speculating looked free).
    rows = [row("auto", 3, 1, accepted_all=False) for _ in range(16)]
    assert plan_batch_drafts(rows, step_time).lengths == [0] * 16
    # A column measured on neither side of the row count, with no other to borrow from,
    # continues its own last slope.
    lone = StepTimeModel()
    lone.observe(2, 2, 0.06)
    lone.observe(4, 4, 0.08)
    assert lone.estimate(8, 8) == pytest.approx(0.12)
    assert lone.estimate(1, 1) == 0.06


def test_batch_policy_retimes_a_close_alternative_read_only_once():
    step_time = StepTimeModel()
    step_time.observe(8, 8, 0.200)  # one (slow) reading of the plain 8-row step
    for _ in range(MIN_TRUSTED_SAMPLES):
        step_time.observe(8, 16, 0.217)
    rows = [row("auto", 1, 1, accepted_all=None) for _ in range(8)]  # prior: E(1 draft) = 1.15
    # One draft per row is the estimated best (8 x 1.15 / 0.217 s), but the plain step
    # (8 / 0.2 s) is within EXPLORE_MARGIN and was read once: the policy times it again.
    assert plan_batch_drafts(rows, step_time).lengths == [0] * 8
    # Retimed at its typical cost, it wins outright and the policy stays plain...
    retimed = StepTimeModel()
    retimed.observe(8, 8, 0.200)
    for _ in range(MIN_TRUSTED_SAMPLES):
        retimed.observe(8, 16, 0.217)
    for _ in range(MIN_TRUSTED_SAMPLES - 1):
        retimed.observe(8, 8, 0.120)
    assert retimed.trusted(8, 8)
    assert plan_batch_drafts(rows, retimed).lengths == [0] * 8
    # ...while a plain step confirmed slow leaves the drafts the better choice.
    for _ in range(MIN_TRUSTED_SAMPLES - 1):
        step_time.observe(8, 8, 0.200)
    assert plan_batch_drafts(rows, step_time).lengths == [1] * 8
    # A probe's reading (the fastest of its repeats) is trusted at once: nothing is retimed.
    probed = StepTimeModel()
    probed.observe(8, 8, 0.200, num_samples=MIN_TRUSTED_SAMPLES)
    probed.observe(8, 16, 0.217, num_samples=MIN_TRUSTED_SAMPLES)
    assert plan_batch_drafts(rows, probed).lengths == [1] * 8


def test_step_time_model_resists_one_sided_noise():
    step_time = StepTimeModel()
    step_time.observe(1, 1, 0.05)
    step_time.observe(1, 3, 0.20)  # a preempted probe: dearer than the wider shape below
    step_time.observe(1, 6, 0.08)
    # A narrower step could be padded to a wider one, so it is never priced above it...
    assert step_time.estimate(1, 3) == pytest.approx(0.08)
    assert step_time.measured(1, 3) == 0.20
    # ...while an honest narrower reading stands, and interpolation runs between the capped values.
    assert step_time.estimate(1, 1) == 0.05
    assert step_time.estimate(1, 2) == pytest.approx(0.065)
    # A spike moves the estimate by at most MAX_SAMPLE_RATIO times the current value.
    step_time.observe(1, 1, 1.0)
    assert step_time.measured(1, 1) == pytest.approx(0.8 * 0.05 + 0.2 * MAX_SAMPLE_RATIO * 0.05)


def test_spec_stats_count_acceptance_by_position_and_merge():
    stats = SpecStats()
    stats.record_step(num_drafted=3, num_accepted=2, num_emitted=3, source="request")
    stats.record_step(num_drafted=1, num_accepted=0, num_emitted=1, source="pool")
    stats.record_step(num_drafted=0, num_accepted=0, num_emitted=1, source=None)
    assert stats.drafted_by_position == [2, 1, 1]
    assert stats.accepted_by_position == [1, 1, 0]
    assert stats.acceptance_by_position == [0.5, 1.0, 0.0]
    assert stats.tokens_per_step == pytest.approx(5 / 3)
    assert stats.drafted_by_source == {"request": 3, "pool": 1}
    total = SpecStats()
    total.merge(stats)
    total.merge(stats)
    assert total.num_emitted == 10 and total.drafted_by_position == [4, 2, 2]
    assert total.accepted_by_source == {"request": 4, "pool": 0}


def row(mode: str, available: int, match_length: int, accepted_all: bool | None) -> RowDraft:
    estimator = AcceptanceEstimator()
    for _ in range(40):
        if accepted_all is not None:
            estimator.record(match_length, available or 1, (available or 1) if accepted_all else 0)
    return RowDraft(mode, available, match_length, estimator)


def test_batch_policy_speculates_for_small_batches_and_stops_for_large_ones():
    step_time = StepTimeModel()
    # Cost proportional to the tokens fed beyond a fixed part: speculation pays only for few rows.
    for num_rows in [1, 2, 4, 8, 16, 32, 64]:
        for per_row in range(1, 8):
            step_time.observe(num_rows, num_rows * per_row, 0.05 + 0.004 * num_rows * per_row)
    small = [row("auto", 6, 6, True) for _ in range(2)]
    assert plan_batch_drafts(small, step_time).lengths == [6, 6]
    large = [row("auto", 6, 1, False) for _ in range(64)]
    assert plan_batch_drafts(large, step_time).lengths == [0] * 64
    mixed = [row("on", 3, 1, False), row("off", 5, 6, True), row("auto", 2, 6, True)]
    assert plan_batch_drafts(mixed, step_time).lengths == [3, 0, 2]


def test_batch_policy_gives_draft_positions_to_the_rows_likely_to_accept_them():
    """Ragged steps: a well-matched row drafts long while poorly matched rows draft nothing,
    instead of one width for every row."""
    step_time = StepTimeModel()
    for per_row in range(1, 18):  # 16 rows; every extra position costs 1% of a plain step
        step_time.observe(16, 16 * per_row, 0.1 * (1 + 0.01 * 16 * (per_row - 1)))
    rows = [row("auto", 16, 8, True)] + [row("auto", 16, 1, False) for _ in range(15)]
    assert plan_batch_drafts(rows, step_time).lengths == [16] + [0] * 15


def test_a_step_drafts_only_for_a_clear_gain():
    """Drafts promising a sliver more throughput than none are not verified: what the cost
    model leaves out (building drafts, rows finishing out of step) costs more. At 32 rows the
    bar is LARGE_BATCH_MIN_DRAFT_GAIN: one good row's drafts (~8% here) are declined."""
    step_time = StepTimeModel()
    for per_row in range(1, 6):  # 32 rows; every extra position costs 1% of a plain step
        step_time.observe(32, 32 * per_row, 0.1 * (1 + 0.01 * 32 * (per_row - 1)), num_samples=3)
    one_good_row = [row("auto", 4, 8, True)] + [row("auto", 4, 1, False) for _ in range(31)]
    assert plan_batch_drafts(one_good_row, step_time).lengths == [0] * 32
    half_good = [row("auto", 4, 8, True) for _ in range(16)] + [row("auto", 4, 1, False) for _ in range(16)]
    assert plan_batch_drafts(half_good, step_time).lengths == [4] * 16 + [0] * 16


def test_uncalibrated_steps_are_capped_by_the_table_then_by_what_was_timed():
    assert cold_start_cap(1) == 5 and cold_start_cap(32) == 3 and cold_start_cap(33) == 0
    rows = [row("auto", 10, 8, True) for _ in range(4)]
    empty = StepTimeModel()
    assert draft_position_cap(4, empty) == 20
    assert plan_batch_drafts(rows, empty, draft_position_cap(4, empty)).lengths == [5] * 4
    assert plan_batch_drafts(rows, empty).lengths == [10] * 4  # what the prior alone would verify
    # Once a step is timed, twice its draft positions may be tried: widths are reachable.
    empty.observe(4, 4 + 20, 0.1)
    assert draft_position_cap(4, empty) == 40
    assert draft_position_cap(2, empty) == 40 and draft_position_cap(5, empty) == 15


def test_requests_start_from_the_engines_pooled_acceptance_and_their_own_evidence_wins():
    pooled = pooled_acceptance()
    fresh = AcceptanceEstimator(prior=pooled).rates(3)
    assert fresh == AcceptanceEstimator().rates(3)  # nothing pooled yet: the fixed table
    earlier = AcceptanceEstimator(prior=pooled)
    for _ in range(40):  # earlier requests' drafts at match length 3 were all rejected
        earlier.record(3, 4, 0)
    newcomer = AcceptanceEstimator(prior=pooled)
    assert newcomer.rates(3)[0] < 0.1 < fresh[0]
    assert newcomer.rates(1) == AcceptanceEstimator().rates(1)  # other match lengths keep their own prior
    for _ in range(20):  # this request's own drafts are accepted: its rate climbs past the pool's
        newcomer.record(3, 4, 4)
    assert newcomer.rates(3)[0] > 0.75
    # The pool forgets: after as many accepted drafts, it no longer says "never".
    for _ in range(60):
        AcceptanceEstimator(prior=pooled).record(3, 4, 4)
    assert pooled.rates(3)[0] > 0.5


def test_a_row_is_drafted_only_if_its_gain_also_pays_for_building_the_draft():
    step_time = StepTimeModel()
    for per_row in range(1, 18):  # 8 rows, 100 ms; each extra position 1 ms
        step_time.observe(8, 8 * per_row, 0.1 + 0.001 * 8 * (per_row - 1))
    rows = [row("auto", 2, 2, True)] + [row("auto", 0, 1, False) for _ in range(7)]
    assert plan_batch_drafts(rows, step_time).lengths[0] > 0
    # Building the draft costs as much as a few positions of verification: not worth it.
    assert plan_batch_drafts(rows, step_time, drafting_s_per_row=0.02).lengths == [0] * 8


def test_drafts_beside_prompt_chunks_are_priced_against_a_decode_step():
    """A step carrying 800 prompt positions costs 17x a decode step; an accepted draft still
    saves only a share of a decode step, so a weak draft is not worth a position there either."""
    step_time = StepTimeModel()
    for num_rows in (16, 17):  # 16 decoding rows, + 1 row of prompt chunk
        for extra in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 832, 1024):
            step_time.observe(num_rows, num_rows + extra, 0.1 + 0.002 * extra)  # 2 ms a position
    weak = AcceptanceEstimator()  # ~23% of first drafts accepted: worth ~1.4 ms of a 6.25 ms token
    for attempt in range(40):
        weak.record(3, 1, int(attempt % 5 == 0))
    rows = [RowDraft("auto", 1, 3, weak) for _ in range(16)]
    assert plan_batch_drafts(rows, step_time).lengths == [0] * 16
    assert plan_batch_drafts(rows, step_time, num_other_rows=1, num_other_positions=800).lengths == [0] * 16
    strong = [row("auto", 4, 6, accepted_all=True) for _ in range(16)]
    assert plan_batch_drafts(strong, step_time, num_other_rows=1, num_other_positions=800).lengths == [4] * 16


def marginal_rows(num_rows: int) -> tuple[list[RowDraft], StepTimeModel]:
    """``num_rows`` rows whose drafts promise a modest gain: a 2-token draft per row at the
    cold-start prior of a 3-token match, each extra position 1% of a plain step."""
    step_time = StepTimeModel()
    for per_row in (1, 2, 3):
        step_time.observe(num_rows, num_rows * per_row, 0.1 * (1 + 0.01 * num_rows * (per_row - 1)), 3)
    rows = [RowDraft("auto", 2, 3, AcceptanceEstimator()) for _ in range(num_rows)]
    return rows, step_time


def test_plan_reports_what_it_promises():
    rows, step_time = marginal_rows(16)
    plan = plan_batch_drafts(rows, step_time)
    a_first, a_next = AcceptanceEstimator().rates(3)
    assert plan.lengths == [2] * 16 and plan.num_chosen == 32
    assert plan.expected_tokens == pytest.approx(16 * (1 + a_first + a_first * a_next))
    plain_rate = 16 / step_time.estimate(16, 16)
    assert plan.gain == pytest.approx(plan.expected_tokens / step_time.estimate(16, 48) / plain_rate)
    assert 1.05 < plan.gain < MAX_READ_GAIN


def test_drafts_that_deliver_less_than_promised_stop_at_that_row_count():
    """Drafted 16-row steps that emit 60% of the tokens they promised in their estimated time
    discount the next promises at 16 rows (the marginal ones no longer draft) and nowhere else."""
    rows, step_time = marginal_rows(16)
    payoff = DraftPayoff()
    plan = plan_batch_drafts(rows, step_time, payoff=payoff.factor(16))
    assert plan.num_chosen
    delivered = round(0.6 * plan.expected_tokens)
    for _ in range(200):
        payoff.record(16, plan, 0.1, 0.1, delivered)
    assert payoff.factor(16) == pytest.approx(delivered / plan.expected_tokens, rel=0.02)
    assert plan_batch_drafts(rows, step_time, payoff=payoff.factor(16)).lengths == [0] * 16
    assert payoff.factor(4) == payoff.factor(64) == 1.0


def test_payoff_compares_drafted_steps_with_plain_steps_as_they_ran():
    """If every step runs 20% over the step-time model (its probe kept the fastest reading),
    drafted steps that deliver their promised tokens are not discounted; if only drafted steps
    run over, they are; a drafted step never counts for more than its promise."""
    rows, step_time = marginal_rows(16)
    plan = plan_batch_drafts(rows, step_time)
    tokens = round(plan.expected_tokens)
    both_slow, drafted_slow, drafted_fast = DraftPayoff(), DraftPayoff(), DraftPayoff()
    for _ in range(200):
        both_slow.record(16, DraftPlan([0] * 16), 0.1, 0.12, 16)
        both_slow.record(16, plan, 0.1, 0.12, tokens)
        drafted_slow.record(16, DraftPlan([0] * 16), 0.1, 0.1, 16)
        drafted_slow.record(16, plan, 0.1, 0.12, tokens)
        drafted_fast.record(16, plan, 0.1, 0.05, tokens)
    assert both_slow.factor(16) == pytest.approx(tokens / plan.expected_tokens, rel=0.02)
    assert drafted_slow.factor(16) == pytest.approx(tokens / plan.expected_tokens / 1.2, rel=0.02)
    assert drafted_fast.factor(16) == 1.0


def test_payoff_reads_only_promises_near_the_bar_and_never_a_single_row():
    rows, step_time = marginal_rows(16)
    strong = DraftPlan([4] * 16, 64, 40.0, MAX_READ_GAIN + 0.5)
    weak_one_row = DraftPlan([2], 2, 1.5, 1.2)
    payoff = DraftPayoff()
    for _ in range(200):
        payoff.record(16, strong, 0.1, 0.1, 20)  # delivered half, but far above the bar
        payoff.record(1, weak_one_row, 0.1, 0.2, 1)
    assert payoff.factor(16) == payoff.factor(1) == 1.0
    marginal = plan_batch_drafts(rows, step_time)
    for _ in range(500):
        payoff.record(16, marginal, 0.1, 0.1, 1)  # next to nothing delivered
    assert payoff.factor(16) == MIN_PAYOFF


def test_a_large_batch_needs_the_larger_margin():
    """The same drafts promising ~10% more tokens per second: taken by 8 rows, declined by 16
    (LARGE_BATCH_MIN_DRAFT_GAIN: in full batches promises of 5-15% did not pay)."""
    for num_rows, drafted in ((8, True), (LARGE_BATCH_ROWS, False)):
        step_time = StepTimeModel()
        step_time.observe(num_rows, num_rows, 0.1, MIN_TRUSTED_SAMPLES)
        step_time.observe(num_rows, 2 * num_rows, 0.105, MIN_TRUSTED_SAMPLES)
        rows = [row("auto", 1, 1, accepted_all=None) for _ in range(num_rows)]  # prior: E(1 draft) = 1.15
        plan = plan_batch_drafts(rows, step_time)
        assert (plan.num_chosen == num_rows) is drafted
        assert 1 + MIN_DRAFT_GAIN < 1.15 / 1.05 < 1 + LARGE_BATCH_MIN_DRAFT_GAIN


def test_one_row_drafts_whatever_pays_and_a_batch_needs_the_margin():
    """A one-token draft at a one-token match (prior 15% acceptance) where the extra position
    costs 12% of the step promises ~3% more tokens per second: one row takes it; two rows with
    the same draft each need MIN_DRAFT_GAIN (rows fall out of step, drafting costs add up)."""
    one_row, two_rows = StepTimeModel(), StepTimeModel()
    one_row.observe(1, 1, 0.1, 3)
    one_row.observe(1, 2, 0.112, 3)
    for extra in range(3):
        two_rows.observe(2, 2 + extra, 0.1 * (1 + 0.06 * extra), 3)
    row = RowDraft("auto", 1, 1, AcceptanceEstimator())
    plan = plan_batch_drafts([row], one_row)
    assert plan.lengths == [1] and 1.0 < plan.gain < 1.05
    assert plan_batch_drafts([row, RowDraft("auto", 1, 1, AcceptanceEstimator())], two_rows).lengths == [0, 0]


def paced_rows(credit: float) -> tuple[list[RowDraft], StepTimeModel]:
    """Eight rows: four copying (4-token drafts, always accepted), four with nothing to draft
    at ``credit``; each extra position costs 5% of a plain step (8 rows on 2 cores)."""
    step_time = StepTimeModel()
    for extra in (0, 4, 8, 16, 32):
        step_time.observe(8, 8 + extra, 0.025 * (1 + 0.05 * extra), 3)
    copying = [row("auto", 4, 6, accepted_all=True) for _ in range(4)]
    idle = [RowDraft("auto", 0, 0, AcceptanceEstimator(), pace_credit=credit) for _ in range(4)]
    return copying + idle, step_time


def test_no_row_is_slowed_below_its_pace_by_the_others_drafts():
    """The batch's best plan (16 positions: ~2.9x the tokens for 1.8x the time) would slow the
    rows with nothing to draft to 1/1.8 of plain decoding; at no credit they allow a step at
    most 1/MIN_ROW_PACE as dear, so no copying row drafts."""
    rows, step_time = paced_rows(credit=math.inf)
    unpaced = plan_batch_drafts(rows, step_time)
    assert unpaced.lengths == [4] * 4 + [0] * 4 and unpaced.cost_ratio == pytest.approx(1.8)
    rows, step_time = paced_rows(credit=0.0)
    assert plan_batch_drafts(rows, step_time).lengths == [0] * 8
    # With credit for ~one dear step, the rows allow it: 0.8 plain steps ahead (and 1/0.97) >= 1.8.
    rows, step_time = paced_rows(credit=0.8)
    assert plan_batch_drafts(rows, step_time).lengths == [4] * 4 + [0] * 4


def test_the_pace_floor_is_kept_in_the_clocks_units():
    """Drafted steps whose excess over a plain step ran twice the estimate's on the clock double
    the excess the pace check prices: the plan the floor allows at the estimate's cost (credit
    for ~one 1.8x step) gives way to a smaller one within the floor on the clock, and a credit that
    covers the clock's cost allows it again.
    Steps whose estimate adds next to nothing, or rows of another bucket, do not move it."""
    payoff = DraftPayoff()
    for _ in range(300):
        payoff.record_excess(8, 1.8, 2.6)  # excess 0.8 estimated, 1.6 on the clock
        payoff.record_excess(8, 1.01, 1.5)  # the clock's noise over a near-plain estimate
    assert payoff.excess_scale(8) == pytest.approx(2.0, rel=0.01)
    assert payoff.excess_scale(1) == payoff.excess_scale(32) == 1.0
    rows, step_time = paced_rows(credit=0.8)
    at_estimate = plan_batch_drafts(rows, step_time)
    assert at_estimate.lengths == [4] * 4 + [0] * 4
    on_clock = plan_batch_drafts(rows, step_time, excess_scale=payoff.excess_scale(8))
    assert sum(on_clock.lengths) < sum(at_estimate.lengths)
    assert 1 + (on_clock.cost_ratio - 1) * 2.0 <= 0.8 + 1 / MIN_ROW_PACE
    rows, step_time = paced_rows(credit=1.6)
    assert plan_batch_drafts(rows, step_time, excess_scale=2.0).lengths == [4] * 4 + [0] * 4
    # A clock that reads drafted steps cheaper than estimated never loosens the floor.
    cheap = DraftPayoff()
    for _ in range(300):
        cheap.record_excess(8, 1.8, 1.2)
    assert cheap.excess_scale(8) == 1.0


def test_a_row_pays_for_dear_steps_with_its_own_drafts():
    """A row expecting its own accepted drafts keeps pace in a dearer step: its credit is not
    needed where its own tokens cover the cost."""
    step_time = StepTimeModel()
    for extra in (0, 4, 8, 16, 32):
        step_time.observe(2, 2 + extra, 0.02 * (1 + 0.05 * extra), 3)
    copying = [row("auto", 8, 6, accepted_all=True) for _ in range(2)]
    copying[1].pace_credit = 0.0
    assert plan_batch_drafts(copying, step_time).lengths == [8, 8]


def test_pace_credit_runs_over_the_request():
    # A plain step earns 1/MIN_ROW_PACE - 1 of a step; a step twice as dear that emitted 3 tokens
    # earns 3/MIN_ROW_PACE - 2; one that emitted 1 token falls behind by 1 - 1/MIN_ROW_PACE.
    assert pace_credit(0.0, 1, 1.0) == pytest.approx(1 / MIN_ROW_PACE - 1)
    assert pace_credit(0.5, 3, 2.0) == pytest.approx(0.5 + 3 / MIN_ROW_PACE - 2)
    assert pace_credit(0.0, 1, 2.0) < 0


def test_a_row_held_back_by_another_rows_pace_did_not_miss():
    """The plan says what the floor held back (``wanted``), so that a copying row that got no
    positions only because another row is behind its pace does not rest as if its draft missed."""
    rows, step_time = paced_rows(credit=0.0)
    plan = plan_batch_drafts(rows, step_time)
    assert plan.lengths == [0] * 8 and plan.wanted == [4] * 4 + [0] * 4
    rows, step_time = paced_rows(credit=math.inf)
    assert plan_batch_drafts(rows, step_time).wanted is None


def test_pace_is_measured_against_the_step_with_its_prompt_chunks():
    """A row waits for the step it rides in, prompt chunks and all: drafts that add 16 positions
    to a step of 8 rows and 256 prompt positions slow it by their share of that whole step (6%,
    within 0.1 plain steps of credit), not of a decode step alone (1.8x, which it would not allow)."""
    step_time = StepTimeModel()
    for num_rows in (8, 9):
        for extra in (0, 4, 8, 16, 32, 256, 264, 272, 288):
            step_time.observe(num_rows, num_rows + extra, 0.025 * (1 + 0.05 * extra), 3)
    copying = [row("auto", 4, 6, accepted_all=True) for _ in range(4)]
    idle = [RowDraft("auto", 0, 0, AcceptanceEstimator(), pace_credit=0.1) for _ in range(4)]
    plan = plan_batch_drafts(copying + idle, step_time, num_other_rows=1, num_other_positions=256)
    chunk_step = step_time.estimate(9, 8 + 256)  # 8 decode positions and the chunk's
    assert plan.lengths == [4] * 4 + [0] * 4
    assert plan.cost_ratio == pytest.approx(step_time.estimate(9, 8 + 256 + 16) / chunk_step)


def test_drafts_beside_a_prompt_chunk_are_not_free_past_flat_widest_columns():
    """Without a probe the packed model holds only the decode steps it ran, and a step carrying
    a 256-position prompt chunk is far wider than any of them. Where the two widest columns read
    flat (noise), the estimate continues at the measured range's mean slope, not flat: drafts
    beside the chunk cost something, and the prompt's floor holds them back."""
    step_time = StepTimeModel()
    for extra, seconds in ((0, 0.015), (8, 0.021), (16, 0.027), (24, 0.027)):
        step_time.observe(9, 9 + extra, seconds, 3)
    copying = [row("auto", 4, 6, accepted_all=True) for _ in range(8)]
    chunk = {"num_other_rows": 1, "num_other_positions": 256}
    unpaced = plan_batch_drafts(copying, step_time, **chunk)
    assert sum(unpaced.lengths) > 0 and unpaced.cost_ratio > 1 / MIN_ROW_PACE
    paced = plan_batch_drafts(copying, step_time, **chunk, chunk_floor=prefill_floor([0.0]))
    assert paced.cost_ratio <= 1 / MIN_ROW_PACE and sum(paced.lengths) < sum(unpaced.lengths)


def test_a_prompts_chunks_keep_their_pace_in_the_step_they_ride_in():
    """The request whose prompt a step prefills waits for the whole step too: its chunks' floor
    (``prefill_floor``: no slack at first, then 1/MIN_ROW_PACE - 1 of a step per plain chunk
    step) holds the running rows' drafts to what it allows, however much credit those rows have."""
    step_time = StepTimeModel()
    for extra in (0, 4, 8, 16, 32, 64, 68, 72, 80, 96):
        step_time.observe(9, 9 + extra, 0.025 * (1 + 0.05 * extra), 3)
    copying = [row("auto", 4, 6, accepted_all=True) for _ in range(8)]
    chunk = {"num_other_rows": 1, "num_other_positions": 64}
    assert prefill_floor([]) == math.inf
    assert prefill_floor([0.5, 0.0]) == pytest.approx(1 / MIN_ROW_PACE)
    unpaced = plan_batch_drafts(copying, step_time, **chunk)
    assert sum(unpaced.lengths) == 32 and unpaced.cost_ratio > 1.3
    fresh = plan_batch_drafts(copying, step_time, **chunk, chunk_floor=prefill_floor([0.0]))
    assert fresh.cost_ratio <= 1 / MIN_ROW_PACE and sum(fresh.lengths) < 8
    assert fresh.wanted == unpaced.lengths  # held back by the prompt's pace: no row missed
    ahead = plan_batch_drafts(copying, step_time, **chunk, chunk_floor=prefill_floor([0.3]))
    assert sum(fresh.lengths) < sum(ahead.lengths) and ahead.cost_ratio <= 0.3 + 1 / MIN_ROW_PACE
