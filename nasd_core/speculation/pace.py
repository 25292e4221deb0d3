"""Each request's pace floor: the batch's drafts may not slow a row below ``MIN_ROW_PACE`` of what
plain decoding would give it (``pace_credit``, ``keeps_pace``), nor a prompt being prefilled in
the step below that share of plain prefill's (``prefill_floor``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

# No request's tokens per second may fall below this share of what plain decoding would give it.
# Why per row: every row waits for the whole step, so drafts that pay for the batch can still slow
# a row whose own drafts rarely land (creative chats beside copying ones: docs/results.md).
MIN_ROW_PACE = 0.97
# A request starts one plain step ahead of its floor: at zero, every newcomer without a draft kept
# the whole batch plain (measured in docs/results.md, "Every request keeps its pace").
INITIAL_PACE_CREDIT = 1.0
# Its prompt's chunks keep their own pace, with no slack: a chunk step is many decode steps long on
# a CPU, so a step of slack would be a whole chunk step's worth of the rows' drafts (with no floor
# at all they made chunk steps far dearer: docs/results.md, "Where the time goes at eight requests").
INITIAL_PREFILL_PACE_CREDIT = 0.0


def pace_credit(credit: float, num_emitted: int, cost_ratio: float) -> float:
    """A row's credit after a step that emitted ``num_emitted`` of its tokens (a prompt's: 1 per
    chunk, ``prefill_floor``) at ``cost_ratio`` times the plain step's cost, in plain steps: what
    plain decoding would have spent on those tokens, allowed ``1 / MIN_ROW_PACE`` of it, less what
    the step spent. Uncapped, so the floor holds over the request's life: a row's accepted drafts
    pay for the other rows' later, and a row whose own drafts missed keeps the steps plain until
    it is back on pace. A decode step's cost is read off the clock, a step with prompt chunks is
    charged its estimate (``Speculator.charge``); ``on`` rows' forced drafts are not charged."""
    return credit + num_emitted / MIN_ROW_PACE - cost_ratio


def prefill_floor(credits: Iterable[float]) -> float:
    """The pace floor a step's prompt chunks set, from their requests' prefill credits: each
    chunk is one plain step of its prompt's progress, so a step may cost at most ``credit + 1 /
    MIN_ROW_PACE`` times the plain one (inf: no chunks). Charged as the rows' credit is
    (``pace_credit``: estimates, uncapped; ``on`` rows' forced drafts and building drafts
    uncharged); requests still queued, or waiting to copy another's prefill, set no floor."""
    return min(credits, default=math.inf) + 1 / MIN_ROW_PACE


def clock_ratio(estimated_ratio, excess_scale: float):
    """A step's cost in plain steps on the clock, from its estimate (a float or an array): its
    excess over a plain step times ``excess_scale`` (``DraftPayoff.excess_scale``)."""
    return 1 + (estimated_ratio - 1) * excess_scale


def keeps_pace(
    credits: np.ndarray, own_tokens: np.ndarray, cost_ratios: np.ndarray, floor: float = math.inf
) -> np.ndarray:
    """Per candidate plan (columns), whether every row stays at its pace floor: row i, ``credits[i]``
    plain steps ahead, expects ``own_tokens[i, plan]`` of its tokens from a step costing
    ``cost_ratios[plan]`` times the step without the plan's drafts. ``floor``: the lowest floor of
    rows left out of ``own_tokens`` because their tokens are the same in every plan."""
    floors = np.minimum((credits[:, None] + own_tokens / MIN_ROW_PACE).min(axis=0, initial=math.inf), floor)
    return cost_ratios <= floors
