"""N-gram index and prompt lookup: exact literal cases and hypothesis properties."""

from __future__ import annotations

import gc
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nasd_core.config import IndexConfig, SpecConfig
from nasd_core.speculation.drafter import RequestDrafter, new_shared_index
from nasd_core.speculation.ngram import Match, NGramIndex, prompt_lookup

token_lists = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=60)


def occurrences(sequence: list[int], pattern: list[int]) -> list[int]:
    """Start positions of every occurrence of ``pattern`` in ``sequence``."""
    return [i for i in range(len(sequence) - len(pattern) + 1) if sequence[i : i + len(pattern)] == pattern]


def test_lookup_prefers_longest_context_then_most_frequent():
    index = NGramIndex(IndexConfig(max_ngram=3, min_ngram=1))
    index.update([1, 2, 3, 9, 5, 2, 3, 4, 7, 2, 3, 4])
    # After (2, 3) came 9 once and 4 twice: the most frequent wins.
    assert index.lookup([0, 2, 3]) == Match(token=4, context_length=2, count=2)
    # The 3-token context (1, 2, 3) was seen once, followed by 9: longer beats more frequent.
    assert index.lookup([1, 2, 3]) == Match(token=9, context_length=3, count=1)
    # Unknown longer contexts fall back to the last token alone.
    assert index.lookup([8, 8, 7]) == Match(token=2, context_length=1, count=1)
    assert index.lookup([8, 8, 6]) is None


def test_a_tie_keeps_the_earlier_leader_and_a_rarer_token_can_overtake():
    index = NGramIndex(IndexConfig(max_ngram=1, min_ngram=1))
    index.update([7, 1, 7, 2, 7, 2])  # after 7: 1 once, then 2 twice
    assert index.lookup([7]) == Match(2, 1, 2)
    index.update([7, 1])  # 1 draws level at 2: the leader stays
    assert index.lookup([7]) == Match(2, 1, 2)
    index.update([7, 1])  # 1 goes ahead
    assert index.lookup([7]) == Match(1, 1, 3)
    assert NGramIndex.from_bytes(index.to_bytes()).lookup([7]) == Match(1, 1, 3)


def test_the_index_is_invisible_to_the_cyclic_garbage_collector():
    """A pool-fed index holds millions of contexts: if each were an object the cyclic GC
    tracks, every full collection would walk them all and pause the replica's threads."""
    rng = random.Random(3)
    index = NGramIndex(IndexConfig(max_ngram=3, min_ngram=1, max_successors=2))
    index.update_many([[rng.randrange(50) for _ in range(200)] for _ in range(20)])
    gc.collect()  # tuples of ints are untracked by the first collection that sees them
    contexts = index._contexts
    assert not any(gc.is_tracked(key) or gc.is_tracked(counts) for key, counts in contexts.items())


def test_propose_follows_continuations_and_stops_when_unknown():
    index = NGramIndex(IndexConfig(max_ngram=2, min_ngram=1))
    index.update([10, 11, 12, 13])
    draft, length, count = index.propose([5, 10], 8)
    assert draft == [11, 12, 13]
    assert (length, count) == (1, 1)
    assert index.propose([99], 8) == ([], 0, 0)


def test_one_level_index_never_falls_back():
    index = NGramIndex(IndexConfig(max_ngram=2, min_ngram=2))
    index.update([1, 2, 3, 4])
    assert index.lookup([1, 2]) == Match(3, 2, 1)
    assert index.lookup([9, 2]) is None  # (2,) alone is not stored at one level


def test_incremental_update_equals_bulk_update():
    sequence = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    bulk, incremental = NGramIndex(), NGramIndex()
    bulk.update(sequence)
    for end in range(0, len(sequence) + 1, 3):
        incremental.update(sequence[:end], start=max(0, end - 3))
    incremental.update(sequence, start=18)
    assert {c: bulk.successors(c) for c in bulk.contexts()} == {
        c: incremental.successors(c) for c in incremental.contexts()
    }


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    sequence=token_lists,
    query=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    max_ngram=st.integers(1, 4),
    max_tokens=st.integers(1, 8),
)
def test_every_drafted_token_was_seen_after_its_context(sequence, query, max_ngram, max_tokens):
    # Every successor kept, so counts are exact (past max_successors the rarest is forgotten).
    index = NGramIndex(IndexConfig(max_ngram=max_ngram, min_ngram=1, max_successors=256))
    index.update(sequence)
    draft, length, _ = index.propose(query, max_tokens)
    context = list(query)
    for position, token in enumerate(draft):
        # The draft token followed the longest stored suffix of the running context.
        longest = max(
            k for k in range(1, min(max_ngram, len(context)) + 1) if occurrences(sequence[:-1], context[-k:])
        )
        suffix = context[-longest:]
        followers = [
            sequence[i + longest] for i in occurrences(sequence, suffix) if i + longest < len(sequence)
        ]
        assert token in followers
        assert followers.count(token) == max(followers.count(f) for f in followers)
        if position == 0:
            assert length == longest
        context.append(token)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(sequence=token_lists, query=st.lists(st.integers(0, 7), min_size=1, max_size=6))
def test_lookup_uses_the_longest_seen_context(sequence, query):
    index = NGramIndex(IndexConfig(max_ngram=3, min_ngram=1))
    index.update(sequence)
    match = index.lookup(query)
    seen = [
        k
        for k in range(1, min(3, len(query)) + 1)
        if any(i + k < len(sequence) for i in occurrences(sequence, query[-k:]))
    ]
    if not seen:
        assert match is None
    else:
        assert match is not None and match.context_length == max(seen)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    sequences=st.lists(token_lists, min_size=1, max_size=6),
    budget=st.integers(1, 40),
    max_successors=st.integers(1, 4),
)
def test_memory_budget_is_never_exceeded(sequences, budget, max_successors):
    index = NGramIndex(
        IndexConfig(max_ngram=3, min_ngram=1, max_entries=budget, max_successors=max_successors)
    )
    for sequence in sequences:
        index.update(sequence)
        assert index.num_entries <= budget
        cells = sum(len(index.successors(c)) for c in index.contexts())
        assert cells == index.num_entries
        assert all(len(index.successors(c)) <= max_successors for c in index.contexts())


def test_eviction_drops_least_recently_updated_contexts():
    index = NGramIndex(IndexConfig(max_ngram=1, min_ngram=1, max_entries=2))
    index.update([1, 2])  # (1,) -> 2
    index.update([3, 4])  # (3,) -> 4
    index.update([1, 2])  # refresh (1,)
    index.update([5, 6])  # evicts (3,), the stalest
    assert index.lookup([3]) is None
    assert index.lookup([1]) == Match(2, 1, 2)
    assert index.num_evicted == 1


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(sequences=st.lists(token_lists, min_size=0, max_size=5), budget=st.integers(5, 200))
def test_serialisation_round_trips(sequences, budget):
    index = NGramIndex(IndexConfig(max_ngram=3, min_ngram=1, max_entries=budget))
    index.update_many(sequences)
    restored = NGramIndex.from_bytes(index.to_bytes())
    assert restored.config == index.config
    assert list(restored.contexts()) == list(index.contexts())  # recency order kept
    assert all(restored.successors(c) == index.successors(c) for c in index.contexts())
    assert restored.num_entries == index.num_entries
    for context in index.contexts():
        assert restored.lookup(list(context)) == index.lookup(list(context))


def test_from_bytes_rejects_garbage():
    with pytest.raises(ValueError):
        NGramIndex.from_bytes(b"not an index")


def test_prompt_lookup_latest_first_and_never_its_own_position():
    tokens = [7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2]
    # Suffix (1, 2): latest earlier occurrence is at 5, followed by 4, 9, 1, 2.
    assert prompt_lookup(tokens, 3, max_ngram=2) == ([4, 9, 1], 2)
    # A suffix that occurs only at the end proposes nothing.
    assert prompt_lookup([5, 6, 7], 3, max_ngram=3, min_ngram=1) == ([], 0)
    # Longest suffix first: (8, 1, 2) beats the later (1, 2) match.
    assert prompt_lookup([8, 1, 2, 5, 1, 2, 6, 8, 1, 2], 2, max_ngram=3) == ([5, 1], 3)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(sequence=st.lists(st.integers(0, 4), min_size=1, max_size=50), max_tokens=st.integers(1, 6))
def test_prompt_lookup_copies_a_real_earlier_continuation(sequence, max_tokens):
    draft, length = prompt_lookup(sequence, max_tokens, max_ngram=4, min_ngram=1)
    if not draft:
        assert length == 0
        assert not occurrences(sequence[:-1], sequence[-1:])
        return
    suffix = sequence[-length:]
    starts = [i for i in occurrences(sequence[:-1], suffix)]
    latest = max(starts)
    assert draft == sequence[latest + length : latest + length + max_tokens]


def brute_force_prompt_lookup(sequence: list[int], max_tokens: int, max_ngram: int, min_ngram: int):
    """The definition, spelled out: the longest suffix (max_ngram down to min_ngram) with an
    occurrence ending before the last token, its latest such occurrence, what followed it."""
    for length in range(min(max_ngram, len(sequence) - 1), min_ngram - 1, -1):
        starts = occurrences(sequence[:-1], sequence[len(sequence) - length :])
        if starts:
            follow = starts[-1] + length
            return sequence[follow : follow + max_tokens], length
    return [], 0


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    sequence=st.lists(st.integers(0, 3), min_size=0, max_size=60),
    max_tokens=st.integers(1, 8),
    max_ngram=st.integers(1, 9),
    min_ngram=st.integers(1, 4),
)
def test_prompt_lookup_equals_its_definition(sequence, max_tokens, max_ngram, min_ngram):
    assert prompt_lookup(sequence, max_tokens, max_ngram, min_ngram) == brute_force_prompt_lookup(
        sequence, max_tokens, max_ngram, min_ngram
    )


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    own=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    shared=st.lists(st.integers(0, 5), min_size=0, max_size=60),
    local_index=st.sampled_from(["hybrid", "prompt_lookup", "multi_level", "suffix"]),
    shared_kind=st.sampled_from(["ngram", "suffix"]),
)
def test_longest_match_is_the_length_the_draft_matches(own, shared, local_index, shared_kind):
    """The engine decides which rows to draft for from ``longest_match`` alone: it must be the
    match length the built draft reports (an optimistic guess built drafts the policy dropped)."""
    replica = new_shared_index(IndexConfig(kind=shared_kind))
    replica.update(shared)
    drafter = RequestDrafter(SpecConfig(local_index=local_index), [("replica", replica)])
    drafter.observe(own)
    length, _ = drafter.longest_match(own)
    assert length == drafter.propose(own, 8).match_length


def test_a_request_that_never_drafts_keeps_no_index_of_its_tokens():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    silent = RequestDrafter(SpecConfig(mode="off"))
    silent.observe(tokens)
    assert silent.local_index is None
    speculating = RequestDrafter(SpecConfig(mode="auto", local_index="hybrid"))
    speculating.observe(tokens)
    assert speculating.local_index.num_entries > 0
    assert RequestDrafter(SpecConfig(mode="off", local_index="suffix")).local_suffix is None
    by_suffix = RequestDrafter(SpecConfig(mode="auto", local_index="suffix"))
    by_suffix.observe(tokens)
    assert len(by_suffix.local_suffix) == len(tokens) and by_suffix.local_index is None
    # A storage passed in (the seeds' API) learns whatever the mode: its owner reads it.
    storage = NGramIndex(IndexConfig())
    RequestDrafter(SpecConfig(mode="off"), local_index=storage).observe(tokens)
    assert storage.num_entries > 0
