"""What a step costs: an online model of a step's seconds by its rows and the positions it feeds
(``StepTimeModel``: an EWMA per batch shape on top of a prior shape), measured while serving,
and its curve at a fixed row count that the planner prices every total of draft positions on
(``Curve``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# Prior shape of a verification step, in one-row plain steps: each extra token costs this share,
# each extra row of a plain step this one. Both are the GGUF path's, a CPU server's default (its
# int8 multiply costs per row, where float32 reads the weights once whatever the rows): timed
# with ``calibration.measure_step_times`` on the embedded model, one thread, 300 cached tokens.
PRIOR_EXTRA_TOKEN_COST = 0.10
PRIOR_EXTRA_ROW_COST = 0.13
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


def snap_extra(num_extra: int) -> int:
    """The recorded bucket of a step's extra (draft or prompt) positions: exact up to 8, then
    on a grid of ~12% steps, so ragged steps of every total share a few columns."""
    if num_extra <= 8:
        return num_extra
    power = 1 << (num_extra.bit_length() - 1)  # 8 <= power <= num_extra
    step = power // 8
    return min(2 * power, power + step * round((num_extra - power) / step))


def snap_extras(num_extra: np.ndarray) -> np.ndarray:
    """``snap_extra`` of every value of ``num_extra`` (non-negative ints) at once."""
    num_extra = np.asarray(num_extra, dtype=np.int64)
    power = np.left_shift(1, np.maximum(0, np.floor(np.log2(np.maximum(num_extra, 1))).astype(np.int64)))
    step = np.maximum(1, power // 8)
    snapped = np.minimum(2 * power, power + step * np.round((num_extra - power) / step).astype(np.int64))
    return np.where(num_extra <= 8, num_extra, snapped)


class StepTimeModel:
    """Online model of a step's time by its shape: rows in the step x positions fed in all.

    A ragged step feeds every row its own positions, so the cost is a function of the row
    count (each row brings its own cache and attention) and of the total positions (every
    Linear layer runs over each of them). Measurements are kept per row count in columns of
    *extra* positions (beyond one per row; 0 = a plain decode step), bucketed by
    ``snap_extra``. Unmeasured shapes are interpolated linearly along rows within a column
    (a column not measured around that row count borrows the shape of one that is), then
    along extra positions between columns; beyond the measurements the last slope continues
    (at least the measured range's mean slope).
    A step with fewer positions never costs more than one with more, so a column's estimate
    is capped by every wider one: a noisy high reading cannot make the policy skip it for good.
    """

    def __init__(self) -> None:
        # extra positions -> rows -> seconds: estimates read one column at a time.
        self._seconds: dict[int, dict[int, float]] = {}
        self._num_samples: dict[tuple[int, int], int] = {}
        # curve() per row count, valid until the next observation (a step prices its drafts
        # with two policy calls and a decode estimate: one curve serves them all).
        self._curves: dict[int, Callable[[int], float]] = {}

    def observe(self, num_rows: int, num_positions: int, seconds: float, num_samples: int = 1) -> None:
        """Record one step of ``num_rows`` rows feeding ``num_positions`` positions in all.
        ``num_samples``: how many readings ``seconds`` stands for (a probe's fastest of several
        repeats is trusted at once, so the policy does not spend steps retiming it)."""
        extra = snap_extra(max(0, num_positions - num_rows))
        shape = (num_rows, extra)
        self._curves.clear()
        self._num_samples[shape] = self._num_samples.get(shape, 0) + num_samples
        column = self._seconds.setdefault(extra, {})
        previous = column.get(num_rows)
        if previous is None:
            column[num_rows] = seconds
        else:
            sample = min(seconds, MAX_SAMPLE_RATIO * previous)
            column[num_rows] = (1 - EWMA_WEIGHT) * previous + EWMA_WEIGHT * sample

    def measured(self, num_rows: int, num_positions: int) -> float | None:
        """The current measurement of this shape's bucket (None if never timed)."""
        return self._seconds.get(snap_extra(max(0, num_positions - num_rows)), {}).get(num_rows)

    def trusted(self, num_rows: int, num_positions: int) -> bool:
        """Whether this shape's bucket has been timed often enough to rule out one slow reading."""
        extra = snap_extra(max(0, num_positions - num_rows))
        return self._num_samples.get((num_rows, extra), 0) >= MIN_TRUSTED_SAMPLES

    def untrusted_extras(self, num_rows: int) -> set[int]:
        """The extra-position buckets measured at exactly ``num_rows`` rows but not yet trusted."""
        return {
            extra
            for extra, column in self._seconds.items()
            if num_rows in column and self._num_samples.get((num_rows, extra), 0) < MIN_TRUSTED_SAMPLES
        }

    def widest_measured(self, num_rows: int) -> int | None:
        """Most extra positions measured at ``num_rows`` rows or more (None: no such step)."""
        widths = [extra for extra, column in self._seconds.items() if max(column) >= num_rows]
        return max(widths) if widths else None

    def estimate(self, num_rows: int, num_positions: int) -> float:
        """Seconds for a step of ``num_rows`` rows feeding ``num_positions`` positions in all."""
        return self.curve(num_rows)(num_positions)

    def curve(self, num_rows: int) -> Curve:
        """``estimate`` at a fixed row count as a function of total positions (the per-column
        work done once: the policy prices many totals per step)."""
        curve = self._curves.get(num_rows)
        if curve is None:
            curve = self._curves[num_rows] = self._build_curve(num_rows)
        return curve

    def _build_curve(self, num_rows: int) -> Curve:
        if not self._seconds:
            return Curve(num_rows, {}, [])
        # Each measured column at num_rows: interpolated where its measurements span the row
        # count, else transferred from a column whose measurements do.
        spanned = {
            extra: seconds
            for extra, column in self._seconds.items()
            if (seconds := along_rows(column, num_rows)) is not None
        }
        at_rows = {
            extra: spanned[extra] if extra in spanned else self._transferred(extra, num_rows, spanned)
            for extra in self._seconds
        }
        # Capped by every wider column, then interpolated along extra positions between them.
        by_extra = {}
        cheapest_wider = float("inf")
        for extra in sorted(at_rows, reverse=True):
            cheapest_wider = min(cheapest_wider, at_rows[extra])
            by_extra[extra] = cheapest_wider
        return Curve(num_rows, by_extra, sorted(by_extra))

    def _transferred(self, extra: int, num_rows: int, spanned: dict[int, float]) -> float:
        """A column whose measurements do not span ``num_rows``: the nearest column that does
        (``spanned``: extra -> seconds at num_rows), scaled by the two columns' ratio at the
        row count both have measured closest to ``num_rows``.

        Why not extrapolate the column's own measurements: ``auto`` runs the shapes it believes
        cheap, so at 16 rows it may have timed only speculative steps, and a plain step
        extrapolated from 1-4 rows (linear in rows: 290 ms) was dearer than the measured
        speculative one (228 ms); capped by it, speculating looked free and never stopped,
        while the plain step really took ~146 ms (creative text, HTTP sweep, 0.66x of off).
        """
        column = self._seconds[extra]
        candidates = []
        for other, seconds in spanned.items():
            shared = column.keys() & self._seconds[other].keys()
            if shared:
                rows = min(
                    shared, key=lambda shared_rows: (abs(math.log(shared_rows / num_rows)), shared_rows)
                )
                scaled = seconds * column[rows] / self._seconds[other][rows]
                candidates.append((abs(other - extra), other, scaled))
        if candidates:
            return min(candidates)[2]
        return _beyond_rows(column, num_rows)


class Curve:
    """A step's estimated seconds at a fixed row count, by its total positions: one measured
    value per column of extra positions (``by_extra``; ``extras`` its sorted keys), linear
    between columns; wider than every column, the last measured slope continues, or the measured
    range's mean slope where that is steeper; narrower than every column, or beyond a lone one,
    the nearest column scaled by the prior shape."""

    def __init__(self, num_rows: int, by_extra: dict[int, float], extras: list[int]) -> None:
        self.num_rows = num_rows
        self.by_extra = by_extra
        self.extras = extras

    def __call__(self, num_positions: int) -> float:
        return float(self.many(np.array([num_positions]))[0])

    def many(self, num_positions: np.ndarray) -> np.ndarray:
        """``self(n)`` for every n of ``num_positions`` at once (a policy prices a step's every
        total of draft positions: up to a thousand at 64 rows)."""
        num_extra = np.maximum(0, num_positions - self.num_rows)
        prior = _prior_shape(self.num_rows, num_extra)
        if not self.extras:
            return prior
        xs = np.array(self.extras, dtype=float)
        ys = np.array([self.by_extra[extra] for extra in self.extras])
        out = np.interp(num_extra, xs, ys)
        first_prior = _prior_shape(self.num_rows, self.extras[0])
        below = num_extra < xs[0]
        out[below] = ys[0] * prior[below] / first_prior
        beyond = num_extra > xs[-1]
        if len(xs) >= 2:
            # Never below the measured range's mean slope: the last two columns alone can read
            # flat from noise, and a step carrying a prompt chunk, far wider than any decode step,
            # would then price its drafts as free.
            last = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            slope = max(0.0, last, (ys[-1] - ys[0]) / (xs[-1] - xs[0]))
            out[beyond] = ys[-1] + slope * (num_extra[beyond] - xs[-1])
        else:
            out[beyond] = ys[0] * prior[beyond] / first_prior
        return out


def along_rows(column: dict[int, float], num_rows: int) -> float | None:
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
    # a whole step).
    low, high = measured[-2], measured[-1]
    slope = max(0.0, (column[high] - column[low]) / (high - low))
    return column[high] + slope * (num_rows - high)


def _prior_shape(num_rows: int, num_extra):
    """Prior cost of a step of ``num_rows`` rows with ``num_extra`` extra positions, in plain
    one-row steps. An extra position is priced against the step it rides in, so the row term sets
    how dear a draft looks in a batch: too low, and a draft position looked 16x cheaper at 16 rows
    than it was (docs/results.md)."""
    return 1.0 + PRIOR_EXTRA_ROW_COST * (num_rows - 1) + PRIOR_EXTRA_TOKEN_COST * num_extra
