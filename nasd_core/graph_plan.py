"""Draft lengths for a fixed-shape step (``nasd_core/step_graphs.py``): priced by width.

A fixed-shape step runs every row at the step's width (positions per row, one of the graph
buckets), so its cost depends on that width and the row count, not on how many positions the
rows really use. Once a width is paid for, every row may draft up to it for nothing more on
the device. So the choice is one width per step: for each width, every ``auto`` row drafts as
far as it allows (each further draft adds the chance it is reached and accepted), and the
width with the most expected tokens per second wins, if it beats plain decoding by the
policy's bar.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from nasd_core.policy import DraftPlan, RowDraft, StepTimeModel, min_draft_gain


def plan_graph_drafts(
    rows: list[RowDraft],
    widths: Sequence[int],
    step_time: StepTimeModel,
    drafting_s_per_row: float = 0.0,
    payoff: float = 1.0,
) -> DraftPlan:
    """Per-row draft lengths for one fixed-shape step.

    Args:
        rows: what the policy knows of each row (``on`` rows verify their whole draft, ``off``
            rows none, ``auto`` rows what the chosen width allows).
        widths: the positions per row the fixed shapes come in, ascending.
        step_time: seconds of a step of ``rows`` rows at width ``w``, read as
            ``estimate(rows, rows * w)`` (the engine records graph steps that way).
        drafting_s_per_row: what building one row's draft costs, charged per drafting row.
        payoff: the share of a drafted step's promise such steps deliver (``DraftPayoff.factor``).

    Returns:
        The plan; ``gain`` is its expected tokens per second over the plain step's.
    """
    if not rows:
        return DraftPlan([])
    num_rows = len(rows)
    forced = [row.num_available if row.mode == "on" else 0 for row in rows]
    narrowest_index = bisect.bisect_left(widths, 1 + max(forced))
    reaches = [row.acceptance.reaches(row) if row.mode != "off" and row.num_available else [] for row in rows]
    base_tokens = num_rows + sum(sum(reach) for reach, row in zip(reaches, rows) if row.mode == "on")
    auto = [index for index, row in enumerate(rows) if row.mode == "auto" and reaches[index]]
    if narrowest_index == len(widths) or not auto:  # nothing to choose, or no shape holds it
        return DraftPlan(forced)

    def rate(width: int, expected: float, num_drafting: int) -> float:
        seconds = step_time.estimate(num_rows, num_rows * width) + drafting_s_per_row * num_drafting
        return expected / seconds

    plain = rate(widths[narrowest_index], base_tokens, 0)
    best_rate, best_width, best_expected = plain, 0, base_tokens
    for width in widths[narrowest_index:]:
        expected = base_tokens + sum(sum(reaches[index][: width - 1]) for index in auto)
        candidate = rate(width, expected, len(auto))
        if candidate > best_rate:
            best_rate, best_width, best_expected = candidate, width, expected
    if not best_width or payoff * best_rate <= (1 + min_draft_gain(num_rows)) * plain:
        return DraftPlan(forced, 0, base_tokens, 1.0)
    lengths = list(forced)
    for index in auto:
        lengths[index] = min(len(reaches[index]), best_width - 1)
    num_chosen = sum(lengths) - sum(forced)
    return DraftPlan(lengths, num_chosen, best_expected, best_rate / plain)
