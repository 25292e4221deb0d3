"""Draft-length policy: speculate only as far as it pays for itself.

A step that verifies g drafts costs t(1 + g) instead of t(1) and emits, in expectation,
E(g) = 1 + sum_{j=1..g} a_first * a_next^(j-1) tokens, where a_first is the chance the
first draft is accepted and a_next the chance each further one is, given the previous
was. The policy picks the g that maximises E(g) / t(1 + g); g = 0 (no speculation) wins
whenever no draft is likely enough to repay the extra verification cost.

Its parts: acceptance estimates (``acceptance``), the step-time model (``step_time``), each
request's pace floor (``pace``) and what drafted steps deliver (``payoff``). A batch's plan
(``plan_batch_drafts``) maximises the step's expected tokens per second, within each request's
pace.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nasd_core.speculation.acceptance import AcceptanceEstimator
from nasd_core.speculation.pace import MIN_ROW_PACE, clock_ratio, keeps_pace
from nasd_core.speculation.step_time import EXPLORE_MARGIN, StepTimeModel, snap_extras

# A step of several rows drafts only if its drafts promise this much more throughput than none:
# the cost model leaves out building drafts and rows finishing out of step (part-full later
# steps). A one-row step has neither, and drafts whenever its drafts promise more than nothing.
MIN_DRAFT_GAIN = 0.05
# From this many rows the bar is LARGE_BATCH_MIN_DRAFT_GAIN: what the model leaves out grows with
# the batch, while a full batch's forward gains least from extra positions (docs/results.md,
# "Through the server").
LARGE_BATCH_ROWS = 16
LARGE_BATCH_MIN_DRAFT_GAIN = 0.15


def choose_draft_length(
    max_draft: int, match_length: int, acceptance: AcceptanceEstimator, step_time: StepTimeModel
) -> int:
    """The draft length in 0..max_draft with the most expected tokens per second (one row)."""
    return plan_batch_drafts([RowDraft("auto", max_draft, match_length, acceptance)], step_time).lengths[0]


# TensorRT-LLM's measured table, used as the cold-start cap before step times are known:
# batch <= 4: gamma 5; <= 32: gamma 3; larger: no speculation.
COLD_START_TABLE = ((4, 5), (32, 3))


def cold_start_cap(num_rows: int) -> int:
    """Largest draft length per row the cold-start table allows for a batch of ``num_rows``."""
    for max_rows, gamma in COLD_START_TABLE:
        if num_rows <= max_rows:
            return gamma
    return 0


@dataclass
class RowDraft:
    """What the batch policy knows about one row: its mode, available draft and acceptance."""

    mode: str
    num_available: int
    match_length: int
    acceptance: AcceptanceEstimator
    source: str | None = None  # the draft's source (acceptance is learned per source)
    # Per drafted token, whether the source's stored continuations split there (a built suffix
    # draft; empty for a best case or a source without counts: priced as unanimous).
    splits: Sequence[bool] = ()
    # How far the row is ahead of its pace floor, in plain steps (``pace_credit``); inf: the
    # row sets no floor on the step.
    pace_credit: float = math.inf

    def reaches(self) -> list[float]:
        """The chance that each available draft token is reached and accepted."""
        return self.acceptance.reaches(self.num_available, self.match_length, self.source, self.splits)


def draft_position_cap(num_rows: int, step_time: StepTimeModel) -> int:
    """Most draft positions an uncalibrated step may add: the cold-start table's per-row cap
    for every row, or twice the widest step measured at this many rows, whichever is more.

    Why twice: a cost model only extrapolates so far; but a step never tried is never timed,
    so a fixed cap would never be lifted (2 replicas answering a repeated question verified at
    most 5 drafts a step for good). Doubling what was measured reaches any width in a few steps.
    """
    widest = step_time.widest_measured(num_rows)
    return max(num_rows * cold_start_cap(num_rows), 2 * widest if widest else 0)


@dataclass
class DraftPlan:
    """One step's choice: per-row draft lengths; ``num_chosen`` of their positions are the
    policy's choice (the rest are ``on`` rows' whole drafts), after which the step should emit
    ``expected_tokens``, ``gain`` times the tokens per second of the step without them (what
    ``DraftPayoff`` checks against the step's outcome)."""

    lengths: list[int]
    num_chosen: int = 0
    expected_tokens: float = 0.0
    gain: float = 1.0
    # The step's estimated time over the same step's without the policy's drafts.
    cost_ratio: float = 1.0
    # Per row, the length the plan would have given it without the pace floor (None: the floor
    # held nothing back): a row held back only by another row's or a prompt's pace did not miss.
    wanted: list[int] | None = None


def plan_batch_drafts(
    rows: list[RowDraft],
    step_time: StepTimeModel,
    max_draft_positions: int | None = None,
    num_other_rows: int = 0,
    num_other_positions: int = 0,
    drafting_s_per_row: float = 0.0,
    payoff: float = 1.0,
    chunk_floor: float = math.inf,
    excess_scale: float = 1.0,
) -> DraftPlan:
    """Per-row draft lengths for one ragged step (each row pays only for its own positions).

    Row i's j-th draft token adds ``a_first * a_next^(j-1)`` expected tokens (falling with
    j), so for any total number of draft positions the best split takes the largest such
    gains over all rows; the step's total is then the one with the most expected tokens per
    second, ``(rows + sum of gains) / t(rows, positions)``, among the totals that keep every
    row at its pace floor (``MIN_ROW_PACE``, ``keeps_pace``). ``on`` rows always verify their
    whole draft, ``off`` rows none. ``num_other_rows`` / ``num_other_positions``: prompt
    chunks riding in the same step (their cost is sunk: drafts are priced by what they add);
    ``chunk_floor``: the lowest pace floor of their requests (``prefill_floor``), which the step's
    cost may not pass either.
    ``max_draft_positions`` caps the step's total draft positions (the engine passes
    ``draft_position_cap``).
    ``excess_scale``: what drafted steps' excess over a plain one has cost on the clock, as a
    multiple of the estimated excess (``DraftPayoff.excess_scale``): the pace floor is kept in the
    clock's units.
    ``drafting_s_per_row``: what building one row's draft costs, charged once per row that
    gets drafts (the engine passes it when deciding which rows to draft at all; once the
    drafts are built their cost is spent and it passes 0).
    ``payoff``: the share of a drafted step's promised throughput that such steps deliver
    (``DraftPayoff.factor``); a step of several rows drafts only if its promise times this
    beats plain decoding by ``min_draft_gain`` (5%, 15% from 16 rows), a one-row step if it
    beats it at all.
    """
    if not rows:
        return DraftPlan([])
    num_rows = len(rows) + num_other_rows
    forced = [row.num_available if row.mode == "on" else 0 for row in rows]
    base_positions = num_other_positions + len(rows) + sum(forced)
    own_base = np.ones(len(rows))  # each row's expected tokens without the policy's drafts
    reach_lists: list[list[float]] = []
    row_indices: list[int] = []
    for index, row in enumerate(rows):
        if row.mode == "off" or row.num_available == 0:
            continue
        reaches = row.reaches()
        if row.mode == "on":
            own_base[index] += sum(reaches)
            continue
        reach_lists.append(reaches)
        row_indices.append(index)
    if not reach_lists:  # nothing to choose (every row off, forced or without a draft): no pricing
        return DraftPlan(forced)
    # Every auto row's gains, largest first (a stable sort: equal gains keep row order).
    sizes = [len(reaches) for reaches in reach_lists]
    all_gains = np.fromiter(itertools.chain.from_iterable(reach_lists), dtype=float, count=sum(sizes))
    order = np.argsort(-all_gains, kind="stable")[:max_draft_positions]
    gain_values = all_gains[order]
    row_of = np.repeat(np.asarray(row_indices, dtype=np.int64), sizes)[order]
    cost = step_time.curve(num_rows)
    base_seconds = cost(base_positions)
    # Prompt chunks riding along are work done anyway: what drafts add to this step is weighed
    # against a decode step of the running rows alone, since an accepted token saves a share of
    # such a step, not of this dearer one (priced by the dearer one, poor drafts looked free).
    decode_seconds = (
        step_time.estimate(len(rows), len(rows) + sum(forced)) if num_other_positions else base_seconds
    )
    first_of_row = np.zeros(len(gain_values), dtype=np.int64)
    first_of_row[np.unique(row_of, return_index=True)[1]] = 1
    # Per total of draft positions (0..len(gain_values)): expected tokens, rows drafting, seconds.
    expected = own_base.sum() + np.concatenate(([0.0], np.cumsum(gain_values)))
    drafted_rows = np.concatenate(([0], np.cumsum(first_of_row)))
    added = cost.many(base_positions + np.arange(len(gain_values) + 1)) - base_seconds
    drafting_seconds = drafting_s_per_row * drafted_rows
    tokens_per_s = expected / (decode_seconds + added + drafting_seconds)
    # What each row waits for: this step, chunks and all, over the same step without drafts.
    cost_ratios = 1 + (added + drafting_seconds) / base_seconds
    unpaced = tokens_per_s
    paced = _paced_totals(
        rows, own_base, row_of, gain_values, clock_ratio(cost_ratios, excess_scale), chunk_floor
    )
    tokens_per_s = np.where(paced, tokens_per_s, -np.inf)
    best = _explored(tokens_per_s, num_rows, base_positions, step_time)
    if best and not beats_plain(tokens_per_s[best], tokens_per_s[0], payoff, num_rows):
        best = 0

    def lengths_at(total: int) -> list[int]:
        return (np.asarray(forced) + np.bincount(row_of[:total], minlength=len(rows))).tolist()

    wanted = None
    unpaced_best = int(np.argmax(unpaced))
    if unpaced_best > best and beats_plain(unpaced[unpaced_best], unpaced[0], payoff, num_rows):
        wanted = lengths_at(unpaced_best)
    return DraftPlan(
        lengths_at(best),
        best,
        float(expected[best]),
        float(tokens_per_s[best] / tokens_per_s[0]),
        float(cost_ratios[best]),
        wanted,
    )


def _paced_totals(
    rows: list[RowDraft],
    own_base: np.ndarray,
    row_of: np.ndarray,
    gain_values: np.ndarray,
    cost_ratios: np.ndarray,
    chunk_floor: float,
) -> np.ndarray:
    """Per total of draft positions (taking ``gain_values`` in order, ``row_of`` their rows),
    whether it keeps every row, and the prompt chunks' requests (``chunk_floor``), at their pace
    floors; a plain step always does (it is the floor's measure). Only the rows that get drafts
    expect more tokens as the total grows: the others are one floor."""
    credits = np.array([row.pace_credit for row in rows])
    floors = credits + own_base / MIN_ROW_PACE
    if min(floors.min(), chunk_floor) >= cost_ratios.max():  # every total keeps pace (rows in credit)
        return np.ones(len(cost_ratios), dtype=bool)
    drafting = np.unique(row_of)
    own = np.zeros((len(drafting), len(gain_values) + 1))
    own[np.searchsorted(drafting, row_of), np.arange(1, len(gain_values) + 1)] = gain_values
    own = own_base[drafting, None] + np.cumsum(own, axis=1)
    others = np.delete(floors, drafting)
    paced = keeps_pace(credits[drafting], own, cost_ratios, others.min(initial=chunk_floor))
    paced[0] = True
    return paced


def floors_leave_no_draft(
    credits: Sequence[float],
    may_draft: Sequence[bool],
    chunk_floor: float,
    step_time: StepTimeModel,
    num_rows: int,
    base_positions: int,
    excess_scale: float = 1.0,
) -> bool:
    """Whether no total of draft positions could keep the pace floors (``_paced_totals``' test,
    before any draft is looked up): for every row that ``may_draft``, another row's floor, or the
    prompt chunks' (``chunk_floor``), is under the cheapest drafted step's cost on the clock. A row
    of ``credits[i]`` has the floor ``credits[i] + 1 / MIN_ROW_PACE``; its own drafts add its own
    tokens, so its own floor is left out (one row alone is never held)."""
    floors = np.asarray(credits, dtype=float) + 1 / MIN_ROW_PACE
    lowest = int(np.argmin(floors))
    second = np.partition(floors, 1)[1] if len(floors) > 1 else math.inf
    others = np.minimum(np.where(np.arange(len(floors)) == lowest, second, floors[lowest]), chunk_floor)
    best_floor = others[np.asarray(may_draft, dtype=bool)].max(initial=-math.inf)
    if best_floor == math.inf:
        return False
    cost = step_time.curve(num_rows)
    extra = np.arange(1, draft_position_cap(num_rows, step_time) + 1)
    ratios = clock_ratio(cost.many(base_positions + extra) / cost(base_positions), excess_scale)
    return bool(best_floor < ratios.min(initial=math.inf))


def min_draft_gain(num_rows: int) -> float:
    """How much more throughput a step of ``num_rows`` rows must promise before it drafts."""
    if num_rows == 1:
        return 0.0
    return MIN_DRAFT_GAIN if num_rows < LARGE_BATCH_ROWS else LARGE_BATCH_MIN_DRAFT_GAIN


def beats_plain(rate: float, plain_rate: float, payoff: float, num_rows: int) -> bool:
    """Whether a drafted step's promised tokens per second, discounted by ``payoff``, beat the
    plain step's by the bar of ``num_rows`` rows (``min_draft_gain``)."""
    return payoff * rate > (1 + min_draft_gain(num_rows)) * plain_rate


def _explored(tokens_per_s: np.ndarray, num_rows: int, base_positions: int, step_time: StepTimeModel) -> int:
    """The draft total with the most expected tokens per second, unless its shape is trusted
    and an untrusted one comes within EXPLORE_MARGIN: then the best of those, to time it."""
    best = int(np.argmax(tokens_per_s))  # the smallest total among equals
    if not step_time.trusted(num_rows, base_positions + best):
        return best
    # Only shapes read too few times are retimed: an unmeasured total between two trusted
    # ones is an interpolation, not a suspect reading.
    untrusted = step_time.untrusted_extras(num_rows)
    if not untrusted:
        return best
    totals = np.flatnonzero(tokens_per_s >= (1 - EXPLORE_MARGIN) * tokens_per_s[best])
    extras = snap_extras(np.maximum(0, base_positions + totals - num_rows))
    close = totals[np.isin(extras, list(untrusted))]
    return int(max(close, key=lambda total: (tokens_per_s[total], -total))) if len(close) else best
