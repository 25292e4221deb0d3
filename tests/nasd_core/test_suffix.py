"""Suffix-match drafting: the longest match against brute force, confidence-sized drafts,
sequence boundaries and the token budget."""

from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from nasd_core import suffix
from nasd_core.suffix import MAX_MATCH, SuffixIndex, best_draft


def brute_force_match(sequences: list[list[int]], context: list[int]) -> int:
    """The longest suffix of ``context`` (capped at MAX_MATCH) that occurs inside one stored
    sequence."""
    best = 0
    for sequence in sequences:
        for end in range(len(sequence)):
            length = 0
            while (
                length < min(MAX_MATCH, len(context), end + 1)
                and sequence[end - length] == context[len(context) - 1 - length]
            ):
                length += 1
            best = max(best, length)
    return best


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=20),
)
def test_the_match_is_the_longest_stored_suffix(sequences, context):
    index = SuffixIndex()
    for sequence in sequences:
        index.add_sequence(sequence)
    # Exact when every occurrence of an anchor is read (a lookup reads the newest 32).
    with mock.patch.object(suffix, "MAX_CANDIDATES", 10**6):
        length, ends = index.match(context)
    assert length == brute_force_match(sequences, context)
    for end in ends:  # every reported occurrence really matches that long
        assert index.tokens[end - length + 1 : end + 1] == context[len(context) - length :]


def test_a_long_match_beats_a_frequent_short_one_and_drafts_what_followed_it():
    index = SuffixIndex()
    long_context = list(range(100, 130))
    index.add_sequence([*long_context, 7, 8, 9, 10])
    for _ in range(5):  # the last token alone is followed by 1 five times
        index.add_sequence([129, 1])
    draft = index.draft(long_context, max_tokens=16)
    assert draft.match_length == 30 and draft.tokens == [7, 8, 9, 10] and draft.probs == [1.0] * 4


def test_draft_probabilities_are_continuation_frequencies_and_short_matches_draft_little():
    index = SuffixIndex()
    for follower in (5, 5, 6):
        index.add_sequence([1, 2, 3, follower, 9, 9, 9])
    draft = index.draft([0, 2, 3], max_tokens=16)  # matches "2 3": drafts at most 2 tokens
    assert draft.match_length == 2
    assert draft.tokens == [5, 9] and draft.probs[0] == 2 / 3 and draft.probs[1] == 2 / 3
    assert index.draft([7, 3], max_tokens=16).tokens == [5]  # a one-token match drafts one


def test_an_occurrence_at_the_end_of_the_store_stops_contributing_where_it_ends():
    index = SuffixIndex()
    index.add_sequence([1, 2, 3, 4, 5])
    index.start_sequence()
    index.extend([1, 2, 3, 4])  # the newest occurrence has no continuation beyond 4
    assert index.draft([1, 2, 3], max_tokens=3).tokens == [4, 5]


def test_improbable_continuations_are_not_drafted():
    index = SuffixIndex()
    for follower in range(20):  # 20 different continuations: none reaches MIN_TOKEN_PROB
        index.add_sequence([1, 2, 3, 4, follower])
    assert index.draft([1, 2, 3, 4], max_tokens=8).tokens == []


def test_no_match_crosses_a_sequence_boundary_and_the_own_end_is_excluded():
    index = SuffixIndex()
    index.add_sequence([1, 2])
    index.add_sequence([3, 4])
    assert index.match([2, 3])[0] == 1  # "2 3" spans the boundary: only "3" matches
    local = SuffixIndex()
    local.add_sequence([1, 2, 3, 1, 2])
    assert local.draft([1, 2, 3, 1, 2], 4, exclude=len(local) - 1).tokens == [3, 1]


def test_the_token_budget_keeps_the_newest_sequences():
    index = SuffixIndex(max_tokens=40)
    for number in range(10):
        index.add_sequence([1000 + number, 1, 2, 3, 4, 5, 6, 7])
    assert len(index) <= 40
    assert index.match([1009, 1])[0] == 2  # the newest survives
    assert index.match([1000, 1])[0] == 1  # the oldest is gone


def test_best_draft_prefers_the_most_expected_accepted_tokens():
    index = SuffixIndex()
    index.add_sequence([1, 2, 3, 4, 5, 6])
    weak = index.draft([9, 1], 4)
    strong = index.draft([1, 2, 3], 4)
    assert best_draft([weak, strong]) is strong and best_draft([]).tokens == []
