"""What drafted steps deliver of the throughput they promised, read off the clock per row-count
bucket (``DraftPayoff``): the planner discounts its promises by it and keeps the pace floor in
the clock's units."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the planner's plans are what this reads
    from nasd_core.speculation.policy import DraftPlan

# How fast DraftPayoff follows its steps: each step's reading weighs this much (~30 steps).
PAYOFF_WEIGHT = 0.03
# Drafted steps promising at most this gain are read (those near the bar).
MAX_READ_GAIN = 1.5
# A drafted step's excess over a plain one is read against its estimate only where the estimate
# adds at least this share of a plain step (below, the clock's noise is the whole reading)...
MIN_READ_EXCESS = 0.02
# ...and one reading counts for at most this multiple of it (a preempted step).
MAX_EXCESS_SCALE = 4.0
# A one-row step is not discounted: its draft was not picked as the best of many rows' (the
# winner's curse the discount corrects), and discounted, one-row creative text gained less.
MIN_PAYOFF_ROWS = 2
# Its factor stays in [MIN_PAYOFF, 1]: it only ever discounts promises (a drafted step that
# beats its promise does not make weaker drafts look better), and never below half.
MIN_PAYOFF = 0.5


def payoff_bucket(num_rows: int) -> int:
    """``DraftPayoff``'s bucket of a step's row count: 1, 2-3, 4-7, 8-15, 16-31, 32-63, ..."""
    return num_rows.bit_length()


class DraftPayoff:
    """What share of their promised throughput the policy's drafted steps deliver, read off
    the wall clock, by row count.

    A drafted step's promise is its expected tokens over its estimated time, against a plain
    step's rows over its estimated time. What it delivered is its emitted tokens over its
    measured time, against the plain steps' measured time: both estimates are read against
    steps as they really ran (the model's readings are clipped and its probe kept the fastest
    of several, so each arm's clock runs over its estimate; comparing the arms cancels that).

    Why: at 32 creative-text rows the chosen drafts promised >= 5% more tokens per second and
    the run came out 2% under plain decoding. The drafts were chosen because they looked good,
    so their acceptance came in at 82-93% of its estimate (a winner's curse), and the work
    around the forward is not in the step-time model; a per-step A/B of those steps gave 636
    tokens/s drafted against 644 withheld. Discounting every promise by the acceptance
    shortfall alone cost drafts that paid at four rows, so the discount is read per row-count
    bucket, in wall time, from the drafts it decides (``MAX_READ_GAIN``). Interleaved runs
    (creative text at 4 rows, 8 requests, 4 and then 9 runs of each): 1.00x of off with it,
    0.98x without, both times.
    """

    def __init__(self) -> None:
        # bucket -> moving average of log(measured / estimated seconds) of plain steps
        self._plain_overrun: dict[int, float] = {}
        # bucket -> moving average of a drafted step's excess over a plain one, measured over
        # estimated (``record_excess``)
        self._excess: dict[int, float] = {}
        # bucket -> moving average of log(delivered / promised) of drafted steps, before the
        # plain steps' overrun is taken out
        self._shortfall: dict[int, float] = {}
        self.num_read = 0  # steps read (plain and drafted)

    def record(
        self, num_rows: int, plan: DraftPlan, estimated_s: float, measured_s: float, num_tokens: int
    ) -> None:
        """One step of ``num_rows`` rows run as ``plan`` that took ``measured_s`` (``estimated_s``
        by the step-time model) and emitted ``num_tokens``.

        Only drafts whose promise is near the bar are read: they are the ones the discount
        decides, and the further a promise is above the bar the more it overstates (at one row
        the drafted steps of all promises delivered ~0.7 of them, and discounting by that cut
        drafts that paid: creative text 0.96x of off instead of 1.04x)."""
        if estimated_s <= 0 or measured_s <= 0:
            return
        bucket = payoff_bucket(num_rows)
        self.num_read += 1
        if not plan.num_chosen:
            _moving(self._plain_overrun, bucket, math.log(measured_s / estimated_s))
        elif num_tokens > 0 and plan.gain <= MAX_READ_GAIN:
            delivered = math.log(num_tokens / plan.expected_tokens) + math.log(estimated_s / measured_s)
            _moving(self._shortfall, bucket, delivered)

    def record_excess(self, num_rows: int, estimated_ratio: float, measured_ratio: float) -> None:
        """A drafted step of ``num_rows`` rows cost ``measured_ratio`` plain steps on the clock
        where the plan estimated ``estimated_ratio``: how far its excess over a plain step ran
        over the estimate's (steps whose estimate adds next to nothing are not read)."""
        if estimated_ratio - 1.0 < MIN_READ_EXCESS:
            return
        bucket = payoff_bucket(num_rows)
        sample = min(max(0.0, (measured_ratio - 1.0) / (estimated_ratio - 1.0)), MAX_EXCESS_SCALE)
        previous = self._excess.get(bucket, 1.0)
        self._excess[bucket] = previous + PAYOFF_WEIGHT * (sample - previous)

    def excess_scale(self, num_rows: int) -> float:
        """What a drafted step of ``num_rows`` rows costs beyond a plain one, as a multiple of its
        estimated excess (at least 1): the pace floor is planned and charged in the clock's units.
        Why: charged the estimates, rows that did not draft ran at 0.89x-0.94x of ``off`` beside
        rows whose drafts paid (docs/results.md), under a floor of 0.97x."""
        return max(1.0, self._excess.get(payoff_bucket(num_rows), 1.0))

    def factor(self, num_rows: int) -> float:
        """The share of a drafted step's promise that such steps deliver at ``num_rows`` rows
        (1 for a one-row step: see ``MIN_PAYOFF_ROWS``)."""
        bucket = payoff_bucket(num_rows)
        if num_rows < MIN_PAYOFF_ROWS or bucket not in self._shortfall:
            return 1.0
        log_share = self._shortfall[bucket] + self._plain_overrun.get(bucket, 0.0)
        return min(1.0, max(MIN_PAYOFF, math.exp(log_share)))


def _moving(averages: dict[int, float], key: int, value: float) -> None:
    """Move one bucket's average towards ``value`` (from 0: no discount until steps show one)."""
    previous = averages.get(key, 0.0)
    averages[key] = previous + PAYOFF_WEIGHT * (value - previous)
