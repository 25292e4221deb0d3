"""Draft lengths for a fixed-shape step (``nasd_core/runner/step_graphs.py``), priced by its width.

A fixed-shape step runs every row at the step's width (positions per row, one of the graph
buckets), so its cost depends on that width and the row count, not on how many positions the
rows really use. Once a width is paid for, every row may draft up to it for nothing more on
the device. So the choice is one width per step: for each width, every ``auto`` row drafts as
far as it allows (each further draft adds the chance it is reached and accepted), and the
width with the most expected tokens per second wins, if it beats plain decoding by the
policy's bar and keeps every row at its pace floor (``pace.keeps_pace``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from nasd_core.runner.step_graphs import ROW_BUCKETS, bucket
from nasd_core.speculation.pace import keeps_pace
from nasd_core.speculation.policy import DraftPlan, RowDraft, beats_plain
from nasd_core.speculation.step_time import EWMA_WEIGHT, MAX_SAMPLE_RATIO, along_rows

# Before a width is timed: each position per row adds this share of a one-position step (an H100
# replaying a 1.5B model's graphs: 1 x 17 cost 1.15x 1 x 1, 64 x 17 1.86x 64 x 1).
PRIOR_WIDTH_COST = 0.01


class GraphStepTimes:
    """Seconds of a fixed-shape step by its shape (rows bucket, positions per row), learned from
    replays as they run (moving average; one slow reading counts for at most ``MAX_SAMPLE_RATIO``
    of the estimate). A width not timed at a row count is interpolated between the row counts
    where it was, else scaled from the nearest timed width there by ``PRIOR_WIDTH_COST``.

    Why not the packed path's ``StepTimeModel``: a fixed shape costs its padded width whatever its
    rows use, and pricing it per position made every step rebuild curves over columns no row
    count shares (a third of the host work of a simulated 16-row GPU step)."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int], float] = {}

    def observe(self, num_rows: int, width: int, seconds: float, num_samples: int = 1) -> None:
        """One replay of the shape ``num_rows`` (a row bucket) x ``width`` that took ``seconds``
        (``num_samples``: kept for the packed model's signature; a first reading is taken whole)."""
        key = (num_rows, width)
        previous = self._seconds.get(key)
        if previous is None:
            self._seconds[key] = seconds
        else:
            sample = min(seconds, MAX_SAMPLE_RATIO * previous)
            self._seconds[key] = previous + EWMA_WEIGHT * (sample - previous)

    def measured(self, num_rows: int, width: int) -> float | None:
        return self._seconds.get((bucket(num_rows, ROW_BUCKETS) or num_rows, width))

    def estimate(self, num_rows: int, width: int) -> float:
        """Seconds of a step of ``num_rows`` rows at ``width`` positions each."""
        rows = bucket(num_rows, ROW_BUCKETS) or num_rows
        seconds = self._seconds.get((rows, width))
        if seconds is not None:
            return seconds
        at_width = {timed: s for (timed, timed_width), s in self._seconds.items() if timed_width == width}
        if at_width:
            between = along_rows(at_width, rows)  # None outside the timed row counts: the nearest's
            return between if between is not None else at_width[min(at_width, key=lambda r: abs(r - rows))]
        at_rows = {timed_width: s for (timed, timed_width), s in self._seconds.items() if timed == rows}
        if not at_rows:
            return _prior(width)  # nothing timed: only ratios matter
        nearest = min(at_rows, key=lambda timed_width: abs(timed_width - width))
        return at_rows[nearest] * _prior(width) / _prior(nearest)


def _prior(width: int) -> float:
    return 1.0 + PRIOR_WIDTH_COST * (width - 1)


def plan_graph_drafts(
    rows: list[RowDraft],
    widths: Sequence[int],
    step_time: GraphStepTimes,
    drafting_s_per_row: float = 0.0,
    payoff: float = 1.0,
) -> DraftPlan:
    """Per-row draft lengths for one fixed-shape step.

    Args:
        rows: what the policy knows of each row (``on`` rows verify their whole draft, ``off``
            rows none, ``auto`` rows what the chosen width allows).
        widths: the positions per row the fixed shapes come in, ascending.
        step_time: seconds of a step by its rows and width.
        drafting_s_per_row: what building one row's draft costs, charged per drafting row.
        payoff: the share of a drafted step's promise such steps deliver (``DraftPayoff.factor``).

    Returns:
        The plan; ``gain`` is its expected tokens per second over the plain step's, and
        ``cost_ratio`` its step's estimated time over the plain step's.
    """
    if not rows:
        return DraftPlan([])
    num_rows = len(rows)
    forced = [row.num_available if row.mode == "on" else 0 for row in rows]
    narrowest_index = bisect.bisect_left(widths, 1 + max(forced))
    reaches = [row.reaches() if row.mode != "off" and row.num_available else [] for row in rows]
    # Each row's expected tokens without the chosen width's drafts (an "on" row's are forced).
    own_base = np.array([1 + (sum(reach) if row.mode == "on" else 0.0) for reach, row in zip(reaches, rows)])
    base_tokens = float(own_base.sum())
    auto = [index for index, row in enumerate(rows) if row.mode == "auto" and reaches[index]]
    if narrowest_index == len(widths) or not auto:  # nothing to choose, or no shape holds it
        return DraftPlan(forced)

    plain_s = step_time.estimate(num_rows, widths[narrowest_index])
    plain = base_tokens / plain_s
    candidates = widths[narrowest_index:]
    own = np.repeat(own_base[:, None], len(candidates), axis=1)  # each row's expected tokens by width
    for index in auto:
        own[index] += [sum(reaches[index][: width - 1]) for width in candidates]
    step_s = np.array([step_time.estimate(num_rows, width) for width in candidates])
    step_s += drafting_s_per_row * len(auto)
    rates = own.sum(axis=0) / step_s
    paced = keeps_pace(np.array([row.pace_credit for row in rows]), own, step_s / plain_s)
    best = _best_width(np.where(paced, rates, 0.0), plain, payoff, num_rows)
    if best is None:
        return DraftPlan(forced, 0, base_tokens, 1.0)
    unpaced = _best_width(rates, plain, payoff, num_rows)

    def lengths_at(candidate: int) -> list[int]:  # every auto row drafts up to the width
        lengths = list(forced)
        for index in auto:
            lengths[index] = min(len(reaches[index]), candidates[candidate] - 1)
        return lengths

    lengths = lengths_at(best)
    num_chosen = sum(lengths) - sum(forced)
    wanted = lengths_at(unpaced) if unpaced is not None and unpaced != best else None
    return DraftPlan(
        lengths,
        num_chosen,
        float(own[:, best].sum()),
        float(rates[best] / plain),
        float(step_s[best] / plain_s),
        wanted,
    )


def _best_width(rates: np.ndarray, plain: float, payoff: float, num_rows: int) -> int | None:
    """The index of the width with the most tokens per second, if it beats the plain step's
    ``plain`` by the policy's bar once discounted by ``payoff``; None: no width does."""
    best = int(np.argmax(rates))
    if rates[best] <= plain or not beats_plain(rates[best], plain, payoff, num_rows):
        return None
    return best
