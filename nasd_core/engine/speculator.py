"""The speculator: each step's drafts and how far to verify them, priced by what steps cost.

On a runner without fixed shapes (a CPU) drafts are built only for the rows whose best case could
get draft positions (a large batch of poorly matching rows drafts little or nothing: building
every row's draft each step cost 1% of a creative-text step at 16 rows, for ~1% more tokens); a
runner with fixed shapes (a GPU) builds every looked-up row's draft at once and prices them once,
in steps with prompt chunks too (pricing best cases first doubled the host work of a step, a
tenth of a ~6 ms GPU step at 64 rows). A step of fixed shapes (CUDA graphs) is priced by its width
(``graph_plan``), any other by its rows and positions (``policy.plan_batch_drafts``).

After the step, each row is charged what the step cost, read off the clock: its pace credit
(``pace.pace_credit``) and its gate (``gate.DraftGate``), which sends a request whose drafts do
not pay to plain steps, where none of this runs. A step in which no row's gate is open, or whose
rows' pace floors leave no draft position (``_pace_bound``), costs what a step of ``off`` does.
The packed model learns whole steps' wall times (drafting, forward, verification and commit);
its plain steps, the yardstick of every charge, are read at each row count before the first
drafts there and again every ``PLAIN_REFRESH_STEPS`` steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from nasd_core.engine.scheduler import ScheduledStep
from nasd_core.engine.sequence import Request
from nasd_core.runner.model_runner import ModelRunner, StepRow
from nasd_core.runner.step_graphs import StepShape
from nasd_core.speculation.calibration import Calibration
from nasd_core.speculation.drafter import EMPTY_DRAFT, Draft, cut_draft, longest_matches, propose_rows
from nasd_core.speculation.gate import row_costs
from nasd_core.speculation.graph_plan import GraphStepTimes, plan_graph_drafts
from nasd_core.speculation.pace import clock_ratio, prefill_floor
from nasd_core.speculation.payoff import DraftPayoff
from nasd_core.speculation.policy import (
    DraftPlan,
    RowDraft,
    draft_position_cap,
    floors_leave_no_draft,
    plan_batch_drafts,
)
from nasd_core.speculation.step_time import MAX_SAMPLE_RATIO, MIN_TRUSTED_SAMPLES, StepTimeModel
from nasd_core.structured import GRAMMAR_SOURCE

DRAFTING_COST_WEIGHT = 0.1  # moving-average weight of each step's drafting time per row
# A row count's plain step is retimed after this many steps (a plain step in place of a drafted
# one): contexts grow and the host's load drifts, and every charge is read against it.
PLAIN_REFRESH_STEPS = 64


@dataclass
class Proposal:
    """One step's drafts, the plan of how far to verify them, which rows ran their speculative
    path (``looked_up``), and the seconds the speculator took."""

    drafts: list[Draft]
    plan: DraftPlan
    looked_up: list[bool]
    seconds: float = 0.0

    @property
    def speculated(self) -> bool:
        return any(self.looked_up)


class Speculator:
    """One engine's drafting and draft-length policy.

    Args:
        runner: the engine's model runner (its fixed-shape widths, and which path ran a step).
        calibration: the engine's step times and payoffs, read and updated here.
    """

    def __init__(self, runner: ModelRunner, calibration: Calibration) -> None:
        self.runner = runner
        self.calibration = calibration
        # Seconds to build one row's draft (moving average): the policy weighs it when choosing
        # which rows to draft for at all.
        self.drafting_s_per_row = 0.0
        self.width_histogram: dict[int, int] = {}  # steps by their widest draft
        # Row count -> (plain steps of that many rows timed, steps of that many rows since the last).
        self._plain_timings: dict[int, tuple[int, int]] = {}

    @property
    def step_time(self) -> StepTimeModel:
        return self.calibration.step_time

    @property
    def graph_step_times(self) -> GraphStepTimes:
        return self.calibration.graph_step_times

    @property
    def payoff(self) -> DraftPayoff:
        """What drafted packed steps deliver of their promise (``DraftPayoff``)."""
        return self.calibration.payoff

    @property
    def graph_payoff(self) -> DraftPayoff:
        """The same for fixed-shape steps, priced by their own step times."""
        return self.calibration.graph_payoff

    def propose(self, step: ScheduledStep) -> Proposal:
        """Each running row's draft and the plan of how much of it this step verifies; a plain step
        (no row's gate open, or a plain step to time) asks the drafter and the policy nothing."""
        started = time.perf_counter()
        rows = step.rows
        looked_up = [request.looks_up for request in rows]
        chunk_floor = prefill_floor(request.prefill_pace_credit for request, _ in step.chunks)
        if not any(looked_up) or self._times_plain(step) or self._pace_bound(step, looked_up, chunk_floor):
            if rows:
                self.width_histogram[0] = self.width_histogram.get(0, 0) + 1
            return Proposal([EMPTY_DRAFT] * len(rows), DraftPlan([0] * len(rows)), [False] * len(rows))
        # A runner with fixed-shape steps (a GPU) builds every looked-up row's draft at once and
        # prices them once, prompt chunks or not: its host time is the step's bound.
        if self.runner.graph_widths is not None:
            drafts = self._build(rows, looked_up)
        else:
            drafts = self._drafts(rows, looked_up, len(step.chunks), step.num_chunk_positions, chunk_floor)
        plan = self.plan(
            [request.row_draft(draft) for request, draft in zip(rows, drafts)],
            len(step.chunks),
            step.num_chunk_positions,
            chunk_floor=chunk_floor,
        )
        if rows:
            widest = max(plan.lengths)
            self.width_histogram[widest] = self.width_histogram.get(widest, 0) + 1
        return Proposal(drafts, plan, looked_up, time.perf_counter() - started)

    def _pace_bound(self, step: ScheduledStep, looked_up: list[bool], chunk_floor: float) -> bool:
        """Whether the pace floors leave this packed step no draft position at all
        (``policy.floors_leave_no_draft``): the policy would then plan nothing, so neither it nor
        the drafter is asked (rows held at their floor otherwise looked up and were priced in
        every step, for nothing). Not with an ``on`` row, whose drafts are forced."""
        rows = step.rows
        if self.runner.graph_widths is not None or any(request.mode == "on" for request in rows):
            return False
        num_rows = len(rows) + len(step.chunks)
        return floors_leave_no_draft(
            [request.pace_credit for request in rows],
            looked_up,
            chunk_floor,
            self.step_time,
            num_rows,
            step.num_chunk_positions + len(rows),
            self.payoff.excess_scale(num_rows),
        )

    def _times_plain(self, step: ScheduledStep) -> bool:
        """Whether this step runs plain to time a plain step of its rows on the packed path, the
        yardstick of ``charge``: one timed fewer than ``MIN_TRUSTED_SAMPLES`` times, or not in its
        last ``PLAIN_REFRESH_STEPS`` steps of as many rows. Not with prompt chunks, nor with an
        ``on`` row (forced)."""
        if step.chunks or self.runner.graph_widths is not None:
            return False
        if any(request.mode == "on" for request in step.rows):
            return False
        num_rows = len(step.rows)
        num_timed, since = self._plain_timings.get(num_rows, (0, 0))
        self._plain_timings[num_rows] = (num_timed, since + 1)
        return num_timed < MIN_TRUSTED_SAMPLES or since >= PLAIN_REFRESH_STEPS

    def charge(
        self, step: ScheduledStep, proposal: Proposal, emitted_rows: list[list[int]], wall_s: float
    ) -> None:
        """Charge each row the step's cost in plain steps: its pace credit the plan's estimate with
        its excess scaled as drafted steps' excess has run over theirs on the clock
        (``DraftPayoff.excess_scale``, which the plan's pace check applies too), and the gate of
        each row that ran its speculative path what the clock read (``cost_ratio``,
        ``gate.row_costs``). Why not each step's clock reading for the pace: the floor is a
        constraint the policy plans against; charged the clock's noisy readings, credits ran
        below what the plans allowed and a mixed stream of eight requests drafted in 17 of 436
        steps, while charged the bare estimates, rows that did not draft ran at 0.89x-0.94x
        (docs/results.md)."""
        rows, plan = step.rows, proposal.plan
        if not proposal.speculated:
            for request, emitted in zip(rows, emitted_rows):
                request.charge(0, len(emitted), 1.0, None)
            return
        cost_ratio, lookup_share = self.cost_ratio(step, proposal, wall_s)
        costs = row_costs(cost_ratio, lookup_share, proposal.looked_up, plan.lengths)
        # The pace is charged the estimate scaled as drafted steps have run over theirs, in the
        # units the plan kept the floor in (the clock's own readings are too noisy a step each).
        pace_ratio = clock_ratio(plan.cost_ratio, self.payoff.excess_scale(len(rows)))
        if not step.chunks and self.runner.graph_widths is None:
            self.payoff.record_excess(len(rows), plan.cost_ratio, cost_ratio)
        for request, emitted, looked, length, cost in zip(
            rows, emitted_rows, proposal.looked_up, plan.lengths, costs
        ):
            request.charge(length, len(emitted), pace_ratio, cost if looked else None)

    def cost_ratio(self, step: ScheduledStep, proposal: Proposal, wall_s: float) -> tuple[float, float]:
        """What a step with speculation cost, in plain steps of as many rows, and the share of a
        plain step the speculator took of it. A decode step on the packed path is read off the
        clock, at most ``MAX_SAMPLE_RATIO`` times twice its estimate (a preempted step) and
        unclipped below, so that a noisy clock charges nothing on average (a step under its
        plain estimate is noise, as one over it may be); any other is charged its estimate."""
        plan = proposal.plan
        if step.chunks or self.runner.graph_widths is not None:
            return plan.cost_ratio, 0.0
        plain_s = self.step_time.estimate(len(step.rows), len(step.rows))
        cap = MAX_SAMPLE_RATIO * 2 * plan.cost_ratio
        return min(wall_s / plain_s, cap), proposal.seconds / plain_s

    def plan(
        self,
        row_drafts: list[RowDraft],
        num_other_rows: int,
        num_other_positions: int,
        drafting_s_per_row: float = 0.0,
        chunk_floor: float = math.inf,
    ) -> DraftPlan:
        """The policy's draft length per row: a fixed-shape step's by its width; a packed step's
        with its total draft positions capped by what has been timed (``draft_position_cap``);
        promises discounted by what drafted steps of this many rows delivered (``DraftPayoff``);
        ``chunk_floor``: the prompt chunks' pace floor (``pace.prefill_floor``)."""
        num_rows = len(row_drafts) + num_other_rows
        widths = self.runner.graph_widths
        if widths is not None and not num_other_rows:
            return plan_graph_drafts(
                row_drafts,
                widths,
                self.graph_step_times,
                drafting_s_per_row,
                self.graph_payoff.factor(num_rows),
            )
        return plan_batch_drafts(
            row_drafts,
            self.step_time,
            draft_position_cap(num_rows, self.step_time),
            num_other_rows,
            num_other_positions,
            drafting_s_per_row,
            self.payoff.factor(num_rows),
            chunk_floor,
            self.payoff.excess_scale(num_rows),
        )

    def learn(
        self,
        step: ScheduledStep,
        step_rows: list[StepRow],
        proposal: Proposal,
        step_s: float,
        wall_s: float,
        num_emitted: int,
        shape: StepShape | None,
        captured: bool,
    ) -> None:
        """Record the step's time in the model of the path that ran it, and what its drafts
        delivered (``num_emitted`` tokens in ``wall_s``).

        ``shape``: the fixed shape of a verification step, whose device time ``step_s`` the graph
        model keeps; None: a packed step (or one with prompt chunks, in graphs or not), which the
        packed model prices by its whole wall time (less the speculator's, where it drafted
        nothing: such a step is a plain one); a step with chunks is read there only on a runner
        with graphs. A step that ``captured`` a shape is no reading: its time is the capture's.
        (``shape`` and ``captured`` are the runner's at the step: the engine may call this during
        the next one.)"""
        if captured:
            return
        plan = proposal.plan
        # Only steps of the policy's own choices are read: no prompt chunks, no "on" row's drafts.
        reads_payoff = step.rows and not step.chunks and sum(plan.lengths) == plan.num_chosen
        if shape is not None:
            if reads_payoff:
                estimate = self.graph_step_times.estimate(len(step.rows), shape.num_positions)
                self.graph_payoff.record(len(step.rows), plan, estimate, wall_s, num_emitted)
            self.graph_step_times.observe(shape.num_rows, shape.num_positions, step_s)
            return
        num_positions = sum(len(row.token_ids) for row in step_rows)
        graphs = self.runner.graph_widths is not None
        # A chunk step costs by its prompt's context, which the model does not key: read in, a cheap
        # one capped every narrower width and drafts beside chunks looked free (docs/results.md).
        # A graph runner's decode steps go to its graph model, so there chunk steps are kept.
        if step.chunks and not graphs:
            return
        # Packed steps beside graphs keep their device time, as graph steps do (payoffs: wall time).
        plain = not any(plan.lengths)
        measured_s = wall_s - proposal.seconds if plain and not graphs else wall_s
        seconds = step_s if graphs else measured_s
        if reads_payoff:
            estimate = self.step_time.estimate(len(step.rows), num_positions)
            self.payoff.record(len(step.rows), plan, estimate, measured_s, num_emitted)
        self.step_time.observe(len(step_rows), num_positions, seconds)
        if num_positions == len(step_rows) and not graphs:
            num_timed = self._plain_timings.get(num_positions, (0, 0))[0]
            self._plain_timings[num_positions] = (num_timed + 1, 0)

    def _drafts(
        self,
        rows: list[Request],
        looked_up: list[bool],
        num_other_rows: int,
        num_other_positions: int,
        chunk_floor: float,
    ) -> list[Draft]:
        """This step's drafts, built only for the rows whose best case gets draft positions."""
        lookups = [request for request, looks in zip(rows, looked_up) if looks]
        matches = iter(longest_matches([row.drafter for row in lookups], [row.tokens for row in lookups]))
        best = self.plan(
            [
                request.best_case(next(matches)) if looks else request.best_case()
                for request, looks in zip(rows, looked_up)
            ],
            num_other_rows,
            num_other_positions,
            self.drafting_s_per_row,
            chunk_floor,
        )
        return self._build(rows, [length > 0 for length in best.lengths])

    def _build(self, rows: list[Request], wanted: list[bool]) -> list[Draft]:
        """The drafts of the ``wanted`` rows (the others get none), built in one call, timed."""
        chosen = [request for request, want in zip(rows, wanted) if want]
        started = time.perf_counter()
        built = iter(
            propose_rows(
                [request.drafter for request in chosen],
                [request.tokens for request in chosen],
                [request.draft_cap for request in chosen],
            )
        )
        drafts = [
            within_grammar(request, next(built) if want else EMPTY_DRAFT)
            for request, want in zip(rows, wanted)
        ]
        if chosen:
            per_row = (time.perf_counter() - started) / len(chosen)
            self.drafting_s_per_row += DRAFTING_COST_WEIGHT * (per_row - self.drafting_s_per_row)
        return drafts


def within_grammar(request: Request, draft: Draft) -> Draft:
    """For a request with a grammar: ``draft`` cut before its first token the grammar forbids
    (such a token could never be accepted, and the grammar's masks past it would have no state
    to follow), or the tokens the grammar forces next where the draft does not start with them."""
    grammar = request.processors.grammar if request.processors is not None else None
    if grammar is None or request.draft_cap <= 0:
        return draft
    draft = cut_draft(draft, grammar.valid_prefix(draft.tokens))
    forced = grammar.forced_tokens()[: request.draft_cap]
    if not forced or draft.tokens[: len(forced)] == forced:
        return draft
    return Draft(forced, GRAMMAR_SOURCE, len(forced))
