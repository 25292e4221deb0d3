"""Suffix-match drafting: the longest match against brute force, confidence-sized drafts,
sequence boundaries and the token budget, for the compiled store and the Python reference;
and the two equal draft for draft."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nasd_core.config import SpecConfig
from nasd_core.speculation import suffix
from nasd_core.speculation.drafter import RequestDrafter, longest_matches, propose_rows
from nasd_core.speculation.suffix import (
    MAX_MATCH,
    SharedSuffixIndex,
    SuffixIndex,
    best_draft,
    compiled_module,
    draft_best,
    draft_rows,
)

IMPLEMENTATIONS = ("compiled", "reference")


@pytest.fixture(params=IMPLEMENTATIONS)
def make_index(request):
    """Builds indexes of one implementation (the compiled one must build, except where
    NASD_NATIVE=0 turns it off on purpose)."""
    compiled = request.param == "compiled"
    if compiled and compiled_module() is None:
        if os.environ.get("NASD_NATIVE") == "0":
            pytest.skip("NASD_NATIVE=0: the compiled suffix store is turned off")
        pytest.fail("the compiled suffix store did not build (see the warning logged by nasd_core.native)")

    def make(max_tokens: int | None = None) -> SuffixIndex:
        index = SuffixIndex(max_tokens, compiled=compiled)
        assert index.compiled == compiled
        return index

    return make


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
    for compiled in (True, False):
        # Exact when every occurrence of an anchor is read (a lookup reads the newest 32).
        with mock.patch.object(suffix, "MAX_CANDIDATES", 10**6):
            index = SuffixIndex(compiled=compiled)
            for sequence in sequences:
                index.add_sequence(sequence)
            length, ends = index.match(context)
        assert length == brute_force_match(sequences, context)
        for end in ends:  # every reported occurrence really matches that long
            assert index.tokens[end - length + 1 : end + 1] == context[len(context) - length :]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 4), max_size=60), min_size=1, max_size=6),
    contexts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=80), min_size=1, max_size=4),
    max_tokens=st.integers(0, 16),
    factor=st.sampled_from([0.5, 1.0, 3.0, 99.0, float("inf")]),
    budget=st.sampled_from([None, 40, 100]),
)
def test_the_compiled_store_drafts_what_the_reference_drafts(sequences, contexts, max_tokens, factor, budget):
    if compiled_module() is None:
        pytest.skip("no compiled suffix store here (test_make_index_builds_the_compiled_store says why)")
    compiled, reference = SuffixIndex(budget), SuffixIndex(budget, compiled=False)
    for index in (compiled, reference):
        for sequence in sequences[:-1]:
            index.add_sequence(sequence)
        index.start_sequence()  # the last sequence grows as a request's own tokens do
        index.extend(sequences[-1][:10])
        index.extend(sequences[-1][10:])
    assert compiled.tokens == reference.tokens
    for context in [*contexts, sequences[-1]]:
        for exclude in (-1, len(reference) - 1):
            assert compiled.match(context, exclude) == reference.match(context, exclude)
            assert compiled.draft(context, max_tokens, exclude, factor) == reference.draft(
                context, max_tokens, exclude, factor
            )


def test_make_index_builds_the_compiled_store(make_index):
    make_index().add_sequence([1, 2, 3])


def test_a_long_match_beats_a_frequent_short_one_and_drafts_what_followed_it(make_index):
    index = make_index()
    long_context = list(range(100, 130))
    index.add_sequence([*long_context, 7, 8, 9, 10])
    for _ in range(5):  # the last token alone is followed by 1 five times
        index.add_sequence([129, 1])
    draft = index.draft(long_context, max_tokens=16)
    assert draft.match_length == 30 and draft.tokens == [7, 8, 9, 10] and draft.probs == [1.0] * 4


def test_draft_probabilities_are_continuation_frequencies_and_short_matches_draft_little(make_index):
    index = make_index()
    for follower in (5, 5, 6):
        index.add_sequence([1, 2, 3, follower, 9, 9, 9])
    draft = index.draft([0, 2, 3], max_tokens=16)  # matches "2 3": drafts at most 2 tokens
    assert draft.match_length == 2
    assert draft.tokens == [5, 9] and draft.probs[0] == 2 / 3 and draft.probs[1] == 2 / 3
    assert index.draft([7, 3], max_tokens=16).tokens == [5]  # a one-token match drafts one


def test_an_occurrence_at_the_end_of_the_store_stops_contributing_where_it_ends(make_index):
    index = make_index()
    index.add_sequence([1, 2, 3, 4, 5])
    index.start_sequence()
    index.extend([1, 2, 3, 4])  # the newest occurrence has no continuation beyond 4
    assert index.draft([1, 2, 3], max_tokens=3).tokens == [4, 5]


def test_improbable_continuations_are_not_drafted(make_index):
    index = make_index()
    for follower in range(20):  # 20 different continuations: none reaches MIN_TOKEN_PROB
        index.add_sequence([1, 2, 3, 4, follower])
    assert index.draft([1, 2, 3, 4], max_tokens=8).tokens == []


def test_no_match_crosses_a_sequence_boundary_and_the_own_end_is_excluded(make_index):
    index = make_index()
    index.add_sequence([1, 2])
    index.add_sequence([3, 4])
    assert index.match([2, 3])[0] == 1  # "2 3" spans the boundary: only "3" matches
    local = make_index()
    local.add_sequence([1, 2, 3, 1, 2])
    assert local.draft([1, 2, 3, 1, 2], 4, exclude=len(local) - 1).tokens == [3, 1]


def test_the_token_budget_keeps_the_newest_sequences(make_index):
    index = make_index(max_tokens=40)
    for number in range(10):
        index.add_sequence([1000 + number, 1, 2, 3, 4, 5, 6, 7])
    assert len(index) <= 40
    assert index.match([1009, 1])[0] == 2  # the newest survives
    assert index.match([1000, 1])[0] == 1  # the oldest is gone


def test_best_draft_prefers_the_most_expected_accepted_tokens(make_index):
    index = make_index()
    index.add_sequence([1, 2, 3, 4, 5, 6])
    weak = index.draft([9, 1], 4)
    strong = index.draft([1, 2, 3], 4)
    assert best_draft([weak, strong]) is strong and best_draft([]).tokens == []


def test_a_shared_store_keeps_its_budget_by_dropping_the_oldest_generation():
    shared = SharedSuffixIndex(max_tokens=400)
    for number in range(100):
        shared.update([1000 + number, 1, 2, 3, 4, 5, 6, 7])
        assert shared.num_entries <= 400
    assert shared.propose([1099, 1, 2], 3) == ([3, 4, 5], 3, 1)  # the newest is kept
    assert shared.lookup([1000, 1]).context_length == 1  # the oldest is gone (only "1" matches)
    long_sequence = list(range(2000, 2500))  # longer than a generation's share: kept whole
    shared.update(long_sequence)
    assert shared.propose(long_sequence[:20], 4)[0] == long_sequence[20:24]


def test_a_shared_store_drafts_from_the_generation_with_the_longest_match():
    shared = SharedSuffixIndex(max_tokens=40)  # 10 tokens a generation: one sequence each
    shared.update([1, 2, 3, 4, 5, 6])
    shared.update([9, 3, 4, 7, 7])
    shared.update([8, 8, 8, 8, 8])
    assert len(shared._generations) == 3
    assert shared.propose([2, 3, 4], 2) == ([5, 6], 3, 1)  # the oldest matches longest
    assert shared.propose([0, 3, 4], 1) == ([7], 2, 1)  # equal matches: the newer's draft
    assert shared.lookup([0, 0]) is None and shared.propose([0, 0], 2) == ([], 0, 0)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    own=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    others=st.lists(st.lists(st.integers(0, 4), max_size=40), max_size=4),
    max_tokens=st.integers(0, 8),
)
def test_one_call_over_several_stores_drafts_from_the_longest_match(own, others, max_tokens):
    """``draft_best``: the store holding the longest match drafts (a tie: the earlier); the
    compiled call equals the reference, and the reference equals asking each store alone."""
    results = []
    for compiled in (True, False) if compiled_module() is not None else (False,):
        stores = [SuffixIndex(compiled=compiled) for _ in range(1 + len(others))]
        stores[0].start_sequence()
        stores[0].extend(own)
        for store, sequence in zip(stores[1:], others):
            store.add_sequence(sequence)
        results.append(draft_best(stores, own, max_tokens, exclude_own_end=True, max_spec_factor=2.0))
    assert all(result == results[0] for result in results)
    lengths = [store.match(own, len(own) - 1 if i == 0 else -1)[0] for i, store in enumerate(stores)]
    draft, chosen = results[0]
    if max(lengths) == 0:
        assert chosen == -1 and draft.tokens == []
        return
    assert chosen == lengths.index(max(lengths)) and draft.match_length == max(lengths)
    exclude = len(own) - 1 if chosen == 0 else -1
    assert draft.tokens == stores[chosen].draft(own, max_tokens, exclude, 2.0).tokens


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(0, 8)), max_size=5
    ),
    shared=st.lists(st.lists(st.integers(0, 4), max_size=40), max_size=3),
)
def test_one_call_for_every_row_equals_each_row_asked_alone(rows, shared):
    """``draft_rows``: a step's rows in one call (each its own tokens, all the same shared
    stores) give what each row gets asked alone, compiled and reference alike."""
    results = []
    for compiled in (True, False) if compiled_module() is not None else (False,):
        shared_stores = [SuffixIndex(compiled=compiled) for _ in shared]
        for store, sequence in zip(shared_stores, shared):
            store.add_sequence(sequence)
        queries = []
        for own, max_tokens in rows:
            store = SuffixIndex(compiled=compiled)
            store.start_sequence()
            store.extend(own)
            queries.append(([store, *shared_stores], own, max_tokens))
        together = draft_rows(queries, exclude_own_end=True, max_spec_factor=2.0)
        assert together == [
            draft_rows([query], exclude_own_end=True, max_spec_factor=2.0)[0] for query in queries
        ]
        results.append(together)
    assert all(result == results[0] for result in results)


def test_a_step_asks_every_rows_drafter_at_once_and_each_gets_its_own_answer():
    """``propose_rows`` / ``longest_matches``: rows with suffix sources (asked in one call) and a
    row without (n-gram and prompt lookup, asked alone) each get what their drafter gives alone."""
    pool = SharedSuffixIndex(1000)
    pool.update([7, 8, 9, 10, 11, 12, 13])
    pool.update([1, 2, 3, 50, 51, 52])
    contexts = [[1, 2, 3, 4, 1, 2, 3], [5, 7, 8, 9], [6, 6, 6], [1, 2, 3, 4, 1, 2]]
    specs = [SpecConfig(local_index="suffix")] * 3 + [SpecConfig(local_index="hybrid")]
    drafters = []
    for spec, context in zip(specs, contexts):
        drafter = RequestDrafter(spec, [("pool", pool)])
        drafter.observe(context)
        drafters.append(drafter)
    caps = [4, 3, 2, 2]
    drafts = propose_rows(drafters, contexts, caps)
    assert drafts == [
        drafter.propose(context, cap) for drafter, context, cap in zip(drafters, contexts, caps)
    ]
    assert drafts[0].tokens[:1] == [4] and drafts[0].source == "request"  # its own tokens: 1 2 3 -> 4
    assert drafts[1].tokens == [10, 11, 12] and drafts[1].source == "pool"
    assert drafts[3].tokens[:2] == [3, 4]  # prompt lookup, asked alone
    matches = longest_matches(drafters, contexts)
    assert matches == [drafter.longest_match(context) for drafter, context in zip(drafters, contexts)]
    assert [length for length, _ in matches] == [draft.match_length for draft in drafts]


def test_a_draft_marks_the_tokens_where_its_stored_continuations_split(make_index):
    index = make_index()
    for ending in ([5, 6, 7], [5, 6, 8], [5, 9, 9]):
        index.add_sequence([1, 2, 3, 4, *ending])
    draft = index.draft([1, 2, 3, 4], 3, max_spec_factor=99.0)
    # 5 follows every occurrence; 6 two of three (split); then 7 and 8 one each (split again).
    assert draft.tokens[:2] == [5, 6] and draft.splits[:2] == (False, True)
    assert draft.probs[1] == pytest.approx(2 / 3)
    assert all(draft.splits[2:])


def test_memory_is_reported_and_grows_with_what_is_stored(make_index):
    index = make_index()
    empty = index.memory_bytes()
    index.add_sequence(list(range(1000)))
    held = index.memory_bytes()
    # At least the tokens and one chain link per anchor length for each (8 bytes apiece).
    assert held - empty >= 1000 * 8 * 2
    index.add_sequence(list(range(1000, 3000)))
    assert index.memory_bytes() > held
    shared = SharedSuffixIndex(4000, compiled=index.compiled)
    shared.update(list(range(1000)))
    shared.update(list(range(1000, 2000)))
    assert shared.memory_bytes() == sum(store.memory_bytes() for store in shared.stores) > 0
