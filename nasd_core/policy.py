"""Draft-length policy: speculate only as far as it pays for itself.

A step that verifies g drafts costs t(1 + g) instead of t(1) and emits, in expectation,
E(g) = 1 + sum_{j=1..g} a_first * a_next^(j-1) tokens, where a_first is the chance the
first draft is accepted and a_next the chance each further one is, given the previous
was. The policy picks the g that maximises E(g) / t(1 + g); g = 0 (no speculation) wins
whenever no draft is likely enough to repay the extra verification cost.

Acceptance is estimated by the length of the context the draft matched (a one-token
match is a weak guess, a six-token match usually a copy), Beta-smoothed towards priors.
The step time t(rows, positions) is measured online (EWMA per batch shape) on top of a prior shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Prior chance the first draft is accepted, by matched context length (longer = likelier);
# measured on the benchmark workloads with the embedded model (benchmarks/acceptance.py).
PRIOR_FIRST_ACCEPT = {1: 0.15, 2: 0.35, 3: 0.5, 4: 0.6}
PRIOR_FIRST_ACCEPT_LONG = 0.7
PRIOR_NEXT_ACCEPT = 0.75
PRIOR_WEIGHT = 4.0  # pseudo-observations behind each prior
# Prior shape of a verification step: each extra token costs this share of a 1-token step.
PRIOR_EXTRA_TOKEN_COST = 0.08
EWMA_WEIGHT = 0.2
# Timing noise on a shared CPU is one-sided (a preempted step reads 2x, none reads 0.5x):
# a sample counts for at most this multiple of the current estimate.
MAX_SAMPLE_RATIO = 1.5
# A shape is trusted after this many samples. Until then, a width whose estimated rate is
# within EXPLORE_MARGIN of a trusted best is tried instead, so that one slow first reading
# (a 16-row plain step timed once at 207 ms, typically ~160) cannot keep the policy off a
# shape for good: it never reruns a shape it believes dearer.
MIN_TRUSTED_SAMPLES = 3
EXPLORE_MARGIN = 0.1


def _prior_first(match_length: int) -> float:
    return PRIOR_FIRST_ACCEPT.get(match_length, PRIOR_FIRST_ACCEPT_LONG)


@dataclass
class _Counts:
    trials: float = 0.0
    accepted: float = 0.0


@dataclass
class AcceptanceEstimator:
    """Acceptance by matched context length, learned from verification outcomes."""

    first: dict[int, _Counts] = field(default_factory=dict)
    following: dict[int, _Counts] = field(default_factory=dict)

    def record(self, match_length: int, num_drafted: int, num_accepted: int) -> None:
        """Count one verified draft of ``num_drafted`` tokens of which ``num_accepted`` matched."""
        if num_drafted <= 0:
            return
        first = self.first.setdefault(match_length, _Counts())
        first.trials += 1
        first.accepted += num_accepted > 0
        # Positions 2..: tried while every earlier draft was accepted.
        following = self.following.setdefault(match_length, _Counts())
        following.trials += min(num_accepted, num_drafted - 1)
        following.accepted += max(0, num_accepted - 1)

    def rates(self, match_length: int) -> tuple[float, float]:
        """(a_first, a_next) for a draft that matched ``match_length`` tokens of context."""
        first = self.first.get(match_length, _Counts())
        following = self.following.get(match_length, _Counts())
        a_first = (first.accepted + PRIOR_WEIGHT * _prior_first(match_length)) / (first.trials + PRIOR_WEIGHT)
        a_next = (following.accepted + PRIOR_WEIGHT * PRIOR_NEXT_ACCEPT) / (following.trials + PRIOR_WEIGHT)
        return a_first, a_next


class StepTimeModel:
    """Online model of a verification step's time by batch shape: rows x positions per row.

    Keyed by shape, not by the total token count: rows each bring their own cache and
    attention, so a batch widens very differently from one row (measured on the embedded
    model, 256-token contexts: 6 positions cost 3.7x the 1-position step at 16 rows, 1.2x
    at 4 rows). Unmeasured shapes are interpolated linearly along rows at each measured
    width (a width not measured around that row count borrows the shape of one that is),
    then along positions between widths; beyond the measurements the last slope continues.
    A narrower step never costs more than a wider one (it could be padded to that width),
    so a width's estimate is capped by every wider measurement: a noisy high reading at one
    width cannot make the policy skip it for good.
    """

    def __init__(self) -> None:
        # positions per row -> rows -> seconds: estimates read one width's column at a time.
        self._seconds: dict[int, dict[int, float]] = {}
        self._num_samples: dict[tuple[int, int], int] = {}

    def observe(self, num_rows: int, num_positions: int, seconds: float) -> None:
        shape = (num_rows, num_positions)
        self._num_samples[shape] = self._num_samples.get(shape, 0) + 1
        column = self._seconds.setdefault(num_positions, {})
        previous = column.get(num_rows)
        if previous is None:
            column[num_rows] = seconds
        else:
            sample = min(seconds, MAX_SAMPLE_RATIO * previous)
            column[num_rows] = (1 - EWMA_WEIGHT) * previous + EWMA_WEIGHT * sample

    def measured(self, num_rows: int, num_positions: int) -> float | None:
        """The current measurement of exactly this shape (None if never timed)."""
        return self._seconds.get(num_positions, {}).get(num_rows)

    def trusted(self, num_rows: int, num_positions: int) -> bool:
        """Whether this exact shape has been timed often enough to rule out one slow reading."""
        return self._num_samples.get((num_rows, num_positions), 0) >= MIN_TRUSTED_SAMPLES

    def covers(self, num_rows: int, num_positions: int) -> bool:
        """Whether a shape at least this wide has been measured for at least this many rows."""
        return any(
            positions >= num_positions and max(column) >= num_rows
            for positions, column in self._seconds.items()
        )

    def estimate(self, num_rows: int, num_positions: int) -> float:
        """Seconds for a step feeding ``num_positions`` tokens to each of ``num_rows`` rows."""
        if not self._seconds:
            return num_rows * _prior_shape(num_positions)
        # Each measured width at num_rows: interpolated where its measurements span the row
        # count, else transferred from a width whose measurements do.
        spanned = {
            positions: seconds
            for positions, column in self._seconds.items()
            if (seconds := _along_rows(column, num_rows)) is not None
        }
        at_rows = {
            positions: spanned[positions]
            if positions in spanned
            else self._transferred(positions, num_rows, spanned)
            for positions in self._seconds
        }
        # Capped by every wider width, then interpolated along positions between widths.
        by_positions = {}
        cheapest_wider = float("inf")
        for positions in sorted(at_rows, reverse=True):
            cheapest_wider = min(cheapest_wider, at_rows[positions])
            by_positions[positions] = cheapest_wider
        return _along_positions(by_positions, num_positions)

    def _transferred(self, num_positions: int, num_rows: int, spanned: dict[int, float]) -> float:
        """A width whose measurements do not span ``num_rows``: the nearest width that does
        (``spanned``: width -> seconds at num_rows), scaled by the two widths' ratio at the
        row count both have measured closest to ``num_rows``.

        Why not extrapolate the width's own column: ``auto`` runs the shapes it believes
        cheap, so at 16 rows it may have timed only 4-position steps, and a plain step
        extrapolated from 1-4 rows (linear in rows: 290 ms) was dearer than the measured
        4-position one (228 ms); capped by it, speculating looked free and never stopped,
        while the plain step really took ~146 ms (creative text, HTTP sweep, 0.66x of off).
        """
        column = self._seconds[num_positions]
        candidates = []
        for other, seconds in spanned.items():
            shared = column.keys() & self._seconds[other].keys()
            if shared:
                rows = min(
                    shared, key=lambda shared_rows: (abs(math.log(shared_rows / num_rows)), shared_rows)
                )
                scaled = seconds * column[rows] / self._seconds[other][rows]
                candidates.append((abs(other - num_positions), other, scaled))
        if candidates:
            return min(candidates)[2]
        return _beyond_rows(column, num_rows)


def _along_positions(by_positions: dict[int, float], num_positions: int) -> float:
    """Linear interpolation in positions between measured widths (``by_positions``: width -> s)."""
    below = sorted(p for p in by_positions if p <= num_positions)
    above = sorted(p for p in by_positions if p >= num_positions)
    if below and above:
        low, high = below[-1], above[0]
        if low == high:
            return by_positions[low]
        share = (num_positions - low) / (high - low)
        return by_positions[low] + share * (by_positions[high] - by_positions[low])
    if len(below) >= 2:
        # Wider than any measurement: continue the last measured slope (never cheaper).
        low, high = below[-2], below[-1]
        slope = max(0.0, (by_positions[high] - by_positions[low]) / (high - low))
        return by_positions[high] + slope * (num_positions - high)
    nearest = below[-1] if below else above[0]
    return by_positions[nearest] * _prior_shape(num_positions) / _prior_shape(nearest)


def _along_rows(column: dict[int, float], num_rows: int) -> float | None:
    """Linear interpolation in rows within one width's measurements (``column``: rows -> s);
    None when they do not span ``num_rows``."""
    below = [rows for rows in column if rows <= num_rows]
    above = [rows for rows in column if rows >= num_rows]
    if not below or not above:
        return None
    low_rows, high_rows = max(below), min(above)
    if high_rows == low_rows:
        return column[low_rows]
    share = (num_rows - low_rows) / (high_rows - low_rows)
    return column[low_rows] + share * (column[high_rows] - column[low_rows])


def _beyond_rows(column: dict[int, float], num_rows: int) -> float:
    """One width's cost outside its measured rows, when no other width spans ``num_rows``."""
    if num_rows < min(column):
        return column[min(column)]  # fewer rows than any measured: no cheaper than the fewest
    measured = sorted(column)
    if len(measured) == 1:
        return column[measured[0]] * num_rows / measured[0]  # one point: grows with rows
    # More rows than measured: continue the last slope (a row adds its cache and tokens, not
    # a whole step: 16 plain rows took ~146 ms against one row's 60 ms, not 16x).
    low, high = measured[-2], measured[-1]
    slope = max(0.0, (column[high] - column[low]) / (high - low))
    return column[high] + slope * (num_rows - high)


def _prior_shape(num_positions: int) -> float:
    """Cost of a step of ``num_positions`` positions per row relative to a plain step."""
    return 1.0 + PRIOR_EXTRA_TOKEN_COST * (num_positions - 1)


def expected_tokens(a_first: float, a_next: float, num_draft: int) -> float:
    """E(g): mean tokens emitted by a step verifying ``num_draft`` drafts (bonus included)."""
    total, reach = 1.0, a_first
    for _ in range(num_draft):
        total += reach
        reach *= a_next
    return total


def choose_draft_length(
    max_draft: int, match_length: int, acceptance: AcceptanceEstimator, step_time: StepTimeModel
) -> int:
    """The draft length in 0..max_draft with the most expected tokens per second (one row)."""
    return choose_batch_draft_lengths(
        [RowDraft("auto", max_draft, match_length, acceptance)], step_time, True
    )[0]


# TensorRT-LLM's measured table, used as the cold-start cap before step times are known:
# batch <= 4: gamma 5; <= 32: gamma 3; larger: no speculation.
COLD_START_TABLE = ((4, 5), (32, 3))


def _explored(tokens_per_s: dict[int, float], num_rows: int, step_time: StepTimeModel) -> int:
    """The width with the most expected tokens per second, unless its shape is trusted and
    an untrusted one comes within EXPLORE_MARGIN: then the best of those, to time it."""
    best_width = max(tokens_per_s, key=lambda width: (tokens_per_s[width], -width))
    if not step_time.trusted(num_rows, 1 + best_width):
        return best_width
    close = [
        width
        for width, rate in tokens_per_s.items()
        if rate >= (1 - EXPLORE_MARGIN) * tokens_per_s[best_width]
        and not step_time.trusted(num_rows, 1 + width)
    ]
    return max(close, key=lambda width: (tokens_per_s[width], -width)) if close else best_width


def cold_start_cap(num_rows: int) -> int:
    """Largest draft length the cold-start table allows for a batch of ``num_rows``."""
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


def choose_batch_draft_lengths(rows: list[RowDraft], step_time: StepTimeModel, calibrated: bool) -> list[int]:
    """Per-row draft lengths for one batched verification step.

    Every row feeds ``1 + width`` positions (shorter rows are padded), so a row drafting up
    to the width costs nothing extra: the choice is the width, and it is the one with the
    most expected tokens per second over the whole batch, ``sum_i E_i(min(width, g_i)) /
    t(rows, 1 + width)``. ``on`` rows always verify their whole draft, ``off`` rows none.
    Until step times are ``calibrated`` the width is capped by the cold-start table.
    """
    if not rows:
        return []
    forced = max((row.num_available for row in rows if row.mode == "on"), default=0)
    available = max((row.num_available for row in rows if row.mode == "auto"), default=0)
    cap = available if calibrated else min(available, cold_start_cap(len(rows)))
    rates = [row.acceptance.rates(row.match_length) for row in rows]
    tokens_per_s = {}
    for width in range(forced, max(forced, cap) + 1):
        expected = 0.0
        for row, (a_first, a_next) in zip(rows, rates):
            if row.mode == "off":
                expected += 1.0
            else:
                expected += expected_tokens(a_first, a_next, min(width, row.num_available))
        tokens_per_s[width] = expected / step_time.estimate(len(rows), 1 + width)
    best_width = _explored(tokens_per_s, len(rows), step_time)
    return [0 if row.mode == "off" else min(best_width, row.num_available) for row in rows]
