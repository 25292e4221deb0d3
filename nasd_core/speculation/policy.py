"""Draft-length policy: speculate only as far as it pays for itself.

A step that verifies g drafts costs t(1 + g) instead of t(1) and emits, in expectation,
E(g) = 1 + sum_{j=1..g} a_first * a_next^(j-1) tokens, where a_first is the chance the
first draft is accepted and a_next the chance each further one is, given the previous
was. The policy picks the g that maximises E(g) / t(1 + g); g = 0 (no speculation) wins
whenever no draft is likely enough to repay the extra verification cost.

Acceptance is estimated per draft source by the length of the context the draft matched (a
one-token match is a weak guess, a six-token match usually a copy), Beta-smoothed towards priors.
The step time t(rows, positions) is measured online (EWMA per batch shape) on top of a prior shape.

A batch's plan maximises the step's expected tokens per second, within each request's pace: no
row may fall below ``MIN_ROW_PACE`` of what plain decoding would give it (``pace_credit``), nor a
prompt being prefilled in the step below that share of plain prefill's (``prefill_floor``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Prior chance the first draft is accepted, by matched context length (longer = likelier);
# measured on the benchmark workloads with the embedded model.
PRIOR_FIRST_ACCEPT = {1: 0.15, 2: 0.35, 3: 0.5, 4: 0.6}
PRIOR_FIRST_ACCEPT_LONG = 0.7
PRIOR_NEXT_ACCEPT = 0.75
# ...and for a drafted token where the stored continuations of the match split (a suffix
# store's draft: not every earlier occurrence went on with this token). Measured on the drafter
# replay's traces (suffix sources, a replica index of the earlier requests): a split first
# token was accepted 15-21% of the time (unanimous: 33-96% by match length), a split later one
# 25-40% (unanimous: 74-97%).
PRIOR_SPLIT_FIRST_ACCEPT = 0.2
PRIOR_SPLIT_NEXT_ACCEPT = 0.35
PRIOR_WEIGHT = 4.0  # pseudo-observations behind each prior
# The engine's pooled acceptance weighs its last ~50 drafts of each match length most.
POOLED_DECAY = 0.98
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
# A step drafts only if its drafts promise this much more throughput than none. The cost model
# leaves out what drafting does around the forward: building drafts (~1% of a 32-row creative
# run on 2 cores), and rows finishing out of step, which leaves later steps with ragged,
# part-full batches (traced at 32 creative rows: +0.6 s of part-full steps in a 15 s run).
# There the policy's chosen drafts promised a median 2% (90th percentile 6%) and the runs came
# out 2-5% under plain decoding; on repetitive text they promised 1.3x-3.3x (10th-90th pct).
# A one-row step has neither (no other rows to fall out of step with, a lookup is ~0.1% of the
# step) and drafts whenever its drafts promise more than nothing: interleaved runs at one row
# (6 x 2 requests each) gave 2.11x of off on repetitive text and 1.10x on creative text with
# no bar, 2.08x and 1.08x with it.
MIN_DRAFT_GAIN = 0.05
# From this many rows a step's drafts must promise LARGE_BATCH_MIN_DRAFT_GAIN. Why: what the cost
# model leaves out grows with the batch (more rows to fall out of step, more lookups and
# verification work per step), while a full batch's forward gains least from extra positions.
# Creative prompts with repeated instructions at 32 rows through HTTP (``benchmarks.http_ab``
# with the engine's step counters, before this bar): the policy drafted in 137 of 378 steps,
# 46% of drafts accepted, and the run came out 0.91x of off; the drafted steps' promises were
# mostly 5-20%. With this bar, 51 of 410 steps drafted and 0.97x. In process, closed loop (one-off script),
# the same prompts went 1.015x of off against 0.989x without the bar, and the repetitive mix
# at 32 rows 1.10x against 1.12x (its drafts promise 1.3x-3.3x, most above any bar).
LARGE_BATCH_ROWS = 16
LARGE_BATCH_MIN_DRAFT_GAIN = 0.15


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


# Matched context lengths above 4 share their acceptance counts by span (5-7, 8-15, 16-31,
# 32+): the suffix source matches up to 64 tokens, and a request verifies too few drafts to
# learn 60 lengths apart, while a 9- and a 12-token match are copies alike.
MATCH_BUCKET_EDGES = (5, 8, 16, 32)


def match_bucket(match_length: int) -> int:
    """The acceptance key of a match of ``match_length`` tokens (1-4 exact, then by span)."""
    if match_length < MATCH_BUCKET_EDGES[0]:
        return match_length
    return MATCH_BUCKET_EDGES[bisect.bisect_right(MATCH_BUCKET_EDGES, match_length) - 1]


def _prior_first(match_length: int) -> float:
    return PRIOR_FIRST_ACCEPT.get(match_length, PRIOR_FIRST_ACCEPT_LONG)


@dataclass
class _Counts:
    trials: float = 0.0
    accepted: float = 0.0

    def add(self, trials: float, accepted: float, decay: float) -> None:
        self.trials = decay * self.trials + trials
        self.accepted = decay * self.accepted + accepted


@dataclass
class AcceptanceEstimator:
    """Acceptance by draft source, matched context length and whether the draft's stored
    continuations split at that token, learned from verification outcomes.

    Why by source: a match of one length is a copy in the request's own tokens more often
    than in other requests' (32 concurrent creative requests with a replica index of the
    finished ones: request-local drafts 47-48% accepted, replica drafts 35-41%).

    Why by split: a suffix store drafts the most frequent continuation of the match, and where
    its earlier occurrences went on differently that token is a guess among several (on the
    replay's traces: 15-40% accepted against 33-97% where every occurrence agreed). Averaged
    together, the policy would overprice the guesses and underprice the copies. Drafts that
    carry no such information (n-gram indexes, prompt lookup) count as unanimous.

    A request's estimator starts from a prior worth ``PRIOR_WEIGHT`` drafts: the engine's
    pooled estimator (``prior``) where there is one, else the fixed ``PRIOR_*`` table. Every
    record also goes to the pooled one, which forgets (``decay`` per record) so it follows the
    traffic a replica gets now. Why pool: a chat request of 64 tokens verifies a handful of
    drafts in all, too few to learn its own rates, so with fixed priors every new creative-text
    request spent its first steps on drafts a 16-32 row batch then paid for (auto 0.95-0.97x of
    off at 32 rows); with the pool, the second wave of requests starts from what the first
    one measured.
    """

    first: dict[tuple[str | None, int, bool], _Counts] = field(default_factory=dict)
    following: dict[tuple[str | None, int, bool], _Counts] = field(default_factory=dict)
    prior: AcceptanceEstimator | None = None
    decay: float = 1.0

    def record(
        self,
        match_length: int,
        num_drafted: int,
        num_accepted: int,
        source: str | None = None,
        splits: Sequence[bool] = (),
    ) -> None:
        """Count one verified draft of ``num_drafted`` tokens of which ``num_accepted`` matched;
        ``splits``: per drafted token, whether its stored continuations split (none: unanimous)."""
        if num_drafted <= 0:
            return
        bucket = match_bucket(match_length)
        self.first.setdefault((source, bucket, _split_at(splits, 0)), _Counts()).add(
            1, num_accepted > 0, self.decay
        )
        # Positions 2..: tried while every earlier draft was accepted, counted by split.
        trials = {False: 0, True: 0}
        accepted = {False: 0, True: 0}
        for position in range(1, min(num_accepted, num_drafted - 1) + 1):
            split = _split_at(splits, position)
            trials[split] += 1
            accepted[split] += position < num_accepted
        for split in (False, True):
            if trials[split] or not split:  # the unanimous counts decay every record, as before
                self.following.setdefault((source, bucket, split), _Counts()).add(
                    trials[split], accepted[split], self.decay
                )
        if self.prior is not None:
            self.prior.record(match_length, num_drafted, num_accepted, source, splits)

    def rates(self, match_length: int, source: str | None = None, split: bool = False) -> tuple[float, float]:
        """(a_first, a_next) for a draft token from ``source`` that matched ``match_length``
        tokens, where its stored continuations ``split`` or not."""
        if self.prior is not None:
            prior_first, prior_next = self.prior.rates(match_length, source, split)
        elif split:
            prior_first, prior_next = PRIOR_SPLIT_FIRST_ACCEPT, PRIOR_SPLIT_NEXT_ACCEPT
        else:
            prior_first, prior_next = _prior_first(match_length), PRIOR_NEXT_ACCEPT
        key = (source, match_bucket(match_length), split)
        first = self.first.get(key, _Counts())
        following = self.following.get(key, _Counts())
        a_first = (first.accepted + PRIOR_WEIGHT * prior_first) / (first.trials + PRIOR_WEIGHT)
        a_next = (following.accepted + PRIOR_WEIGHT * prior_next) / (following.trials + PRIOR_WEIGHT)
        return a_first, a_next

    def reaches(self, row: RowDraft) -> list[float]:
        """The chance that each of ``row``'s available draft tokens is reached and accepted
        (every earlier one accepted too): a falling product of per-token rates."""
        rates = {False: self.rates(row.match_length, row.source)}
        if not any(row.splits[: row.num_available]):  # unanimous: one product, built in C
            a_first, a_next = rates[False]
            following = itertools.repeat(a_next, max(0, row.num_available - 1))
            return list(itertools.accumulate(following, operator.mul, initial=a_first))[: row.num_available]
        reach, reaches = 1.0, []
        for position in range(row.num_available):
            split = _split_at(row.splits, position)
            if split not in rates:
                rates[split] = self.rates(row.match_length, row.source, split)
            a_first, a_next = rates[split]
            reach *= a_first if position == 0 else a_next
            reaches.append(reach)
        return reaches


def _split_at(splits: Sequence[bool], position: int) -> bool:
    return position < len(splits) and splits[position]


def pooled_acceptance() -> AcceptanceEstimator:
    """An engine's pooled estimator: the prior of each of its requests' estimators."""
    return AcceptanceEstimator(decay=POOLED_DECAY)


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
    # a whole step: 16 plain rows took ~146 ms against one row's 60 ms, not 16x).
    low, high = measured[-2], measured[-1]
    slope = max(0.0, (column[high] - column[low]) / (high - low))
    return column[high] + slope * (num_rows - high)


def _prior_shape(num_rows: int, num_extra):
    """Prior cost of a step of ``num_rows`` rows with ``num_extra`` extra positions, in plain
    one-row steps. An extra position is priced against the step it rides in, so the row term sets
    how dear a draft looks in a batch: too low, and a draft position looked 16x cheaper at 16 rows
    than it was (docs/results.md)."""
    return 1.0 + PRIOR_EXTRA_ROW_COST * (num_rows - 1) + PRIOR_EXTRA_TOKEN_COST * num_extra


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
        reaches = row.acceptance.reaches(row)
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
    # such a step, not of this dearer one. (Priced by this step's rate, a 32-row step carrying
    # ~800 prompt positions made drafts at 5% acceptance look worth it: creative text at 32 rows,
    # 371 draft positions for 17 tokens, ~2.5% of the run.)
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
# winner's curse the discount corrects), and interleaved runs of creative text at one row
# (4 and then 9 runs of 2 requests) went 1.03x and 1.11x of off with it, 1.09x and 1.14x without.
MIN_PAYOFF_ROWS = 2
# Its factor stays in [MIN_PAYOFF, 1]: it only ever discounts promises (a drafted step that
# beats its promise does not make weaker drafts look better), and never below half.
MIN_PAYOFF = 0.5


def min_draft_gain(num_rows: int) -> float:
    """How much more throughput a step of ``num_rows`` rows must promise before it drafts."""
    if num_rows == 1:
        return 0.0
    return MIN_DRAFT_GAIN if num_rows < LARGE_BATCH_ROWS else LARGE_BATCH_MIN_DRAFT_GAIN


def beats_plain(rate: float, plain_rate: float, payoff: float, num_rows: int) -> bool:
    """Whether a drafted step's promised tokens per second, discounted by ``payoff``, beat the
    plain step's by the bar of ``num_rows`` rows (``min_draft_gain``)."""
    return payoff * rate > (1 + min_draft_gain(num_rows)) * plain_rate


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
