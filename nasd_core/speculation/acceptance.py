"""How likely a draft's tokens are to be accepted: per draft source and by the length of the
context the draft matched (a one-token match is a weak guess, a six-token match usually a copy),
Beta-smoothed towards priors (``AcceptanceEstimator``); an engine pools its requests' counts as
their prior (``pooled_acceptance``)."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def reaches(
        self, num_available: int, match_length: int, source: str | None, splits: Sequence[bool] = ()
    ) -> list[float]:
        """The chance that each of a row's ``num_available`` draft tokens is reached and accepted
        (every earlier one accepted too): a falling product of per-token rates."""
        rates = {False: self.rates(match_length, source)}
        if not any(splits[:num_available]):  # unanimous: one product, built in C
            a_first, a_next = rates[False]
            following = itertools.repeat(a_next, max(0, num_available - 1))
            return list(itertools.accumulate(following, operator.mul, initial=a_first))[:num_available]
        reach, reaches = 1.0, []
        for position in range(num_available):
            split = _split_at(splits, position)
            if split not in rates:
                rates[split] = self.rates(match_length, source, split)
            a_first, a_next = rates[split]
            reach *= a_first if position == 0 else a_next
            reaches.append(reach)
        return reaches


def _split_at(splits: Sequence[bool], position: int) -> bool:
    return position < len(splits) and splits[position]


def pooled_acceptance() -> AcceptanceEstimator:
    """An engine's pooled estimator: the prior of each of its requests' estimators."""
    return AcceptanceEstimator(decay=POOLED_DECAY)
