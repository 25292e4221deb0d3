"""The speculator: each step's drafts and how far to verify them, priced by what steps cost.

On a runner without fixed shapes (a CPU) drafts are built only for the rows whose best case could
get draft positions (a large batch of poorly matching rows drafts little or nothing: building
every row's draft each step cost 1% of a creative-text step at 16 rows, for ~1% more tokens); a
runner with fixed shapes (a GPU) builds every looked-up row's draft at once and prices them once,
in steps with prompt chunks too (pricing best cases first doubled the host work of a step, a
tenth of a ~6 ms GPU step at 64 rows). A row that got no draft position
rests a few steps before its next lookup (``policy.dormant_steps``). A step of fixed shapes (CUDA
graphs) is priced by its width (``graph_plan``), any other by its rows and positions
(``policy.plan_batch_drafts``); after the step, its time goes to the model of the path that ran
it (on a CPU, steps without prompt chunks only: wider ones extrapolate from those), and what its
drafts delivered to that path's ``DraftPayoff``.
"""

from __future__ import annotations

import math
import time

from nasd_core.engine.scheduler import ScheduledStep
from nasd_core.engine.sequence import Request
from nasd_core.model.model_runner import ModelRunner, StepRow
from nasd_core.model.step_graphs import StepShape
from nasd_core.speculation.calibration import Calibration
from nasd_core.speculation.drafter import EMPTY_DRAFT, Draft, cut_draft, longest_matches, propose_rows
from nasd_core.speculation.graph_plan import GraphStepTimes, plan_graph_drafts
from nasd_core.speculation.policy import (
    DraftPayoff,
    DraftPlan,
    RowDraft,
    StepTimeModel,
    draft_position_cap,
    plan_batch_drafts,
    prefill_floor,
)
from nasd_core.structured import GRAMMAR_SOURCE

DRAFTING_COST_WEIGHT = 0.1  # moving-average weight of each step's drafting time per row


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

    def propose(self, step: ScheduledStep) -> tuple[list[Draft], DraftPlan]:
        """Each running row's draft and the plan of how much of it this step verifies."""
        rows = step.rows
        # A runner with fixed-shape steps (a GPU) builds every looked-up row's draft at once and
        # prices them once, prompt chunks or not: its host time is the step's bound.
        builds_all = self.runner.graph_widths is not None
        chunk_floor = prefill_floor(request.prefill_pace_credit for request, _ in step.chunks)
        if builds_all:
            drafts = self._build(rows, [request.looks_up for request in rows])
        else:
            drafts = self._drafts(rows, len(step.chunks), step.num_chunk_positions, chunk_floor)
        plan = self.plan(
            [request.row_draft(draft) for request, draft in zip(rows, drafts)],
            len(step.chunks),
            step.num_chunk_positions,
            chunk_floor=chunk_floor,
        )
        if builds_all:  # priced on the drafts themselves: rows that got none (nor wanted any) rest
            for request, length in zip(rows, plan.wanted or plan.lengths):
                request.rest(length, len(rows) + len(step.chunks))
        if rows:
            widest = max(plan.lengths)
            self.width_histogram[widest] = self.width_histogram.get(widest, 0) + 1
        return drafts, plan

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
        ``chunk_floor``: the prompt chunks' pace floor (``policy.prefill_floor``)."""
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
        )

    def learn(
        self,
        step: ScheduledStep,
        step_rows: list[StepRow],
        plan: DraftPlan,
        step_s: float,
        wall_s: float,
        num_emitted: int,
        shape: StepShape | None,
        captured: bool,
    ) -> None:
        """Record the step's time in the model of the path that ran it (``shape``: the fixed
        shape of a verification step; None: a step with prompt chunks, in graphs or not, or a
        packed one, which the packed model prices; a step with chunks is read there only on a
        runner with graphs), and what its drafts delivered
        (``num_emitted`` tokens in ``wall_s`` with drafting). A step that ``captured`` a shape
        is no reading: its time is the capture's, not the shape's. (``shape`` and ``captured``
        are the runner's at the step: the engine may call this during the next one.)"""
        if captured:
            return
        # Only steps of the policy's own choices are read: no prompt chunks, no "on" row's drafts.
        reads_payoff = step.rows and not step.chunks and sum(plan.lengths) == plan.num_chosen
        if shape is not None:
            if reads_payoff:
                estimate = self.graph_step_times.estimate(len(step.rows), shape.num_positions)
                self.graph_payoff.record(len(step.rows), plan, estimate, wall_s, num_emitted)
            self.graph_step_times.observe(shape.num_rows, shape.num_positions, step_s)
            return
        num_positions = sum(len(row.token_ids) for row in step_rows)
        if reads_payoff:
            estimate = self.step_time.estimate(len(step.rows), num_positions)
            self.payoff.record(len(step.rows), plan, estimate, wall_s, num_emitted)
        # A chunk step costs by its prompt's context, which the model does not key: read in, a cheap
        # one capped every narrower width and drafts beside chunks looked free (docs/results.md).
        # A graph runner's decode steps go to its graph model, so there chunk steps are kept.
        if not step.chunks or self.runner.graph_widths is not None:
            self.step_time.observe(len(step_rows), num_positions, step_s)

    def _drafts(
        self, rows: list[Request], num_other_rows: int, num_other_positions: int, chunk_floor: float
    ) -> list[Draft]:
        """This step's drafts, built only for the rows whose best case gets draft positions."""
        if not rows:
            return []
        looked_up = [request for request in rows if request.looks_up]
        matches = iter(
            longest_matches(
                [request.drafter for request in looked_up], [request.tokens for request in looked_up]
            )
        )
        best = self.plan(
            [
                request.best_case(next(matches)) if request.looks_up else request.best_case()
                for request in rows
            ],
            num_other_rows,
            num_other_positions,
            self.drafting_s_per_row,
            chunk_floor,
        )
        num_rows = len(rows) + num_other_rows
        # A row held back only by another row's or a prompt's pace did not miss: it rests by what it
        # wanted.
        for request, length in zip(rows, best.wanted or best.lengths):
            request.rest(length, num_rows)
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
