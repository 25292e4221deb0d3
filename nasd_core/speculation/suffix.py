"""Suffix-match draft source: the longest earlier occurrence of the context's suffix (up to
``MAX_MATCH`` tokens) in stored sequences, and a draft sized by how often its continuation
followed that suffix (SuffixDecoding's rule, without its tree).

Storage is zlib's matcher, hash chains: sequences are appended to one flat token list; for
each anchor length L in ``ANCHOR_LENGTHS``, ``heads[L][window]`` is the latest position where
an L-token window ends and ``prev[L][position]`` the previous position where the same window
ends, so the occurrences of a context's last L tokens are read newest first. The longest
anchor that occurs gives the candidates; each is extended backwards token by token to its
full match length. Memory: one int per stored token per anchor length, one dict entry per
distinct window, no node per suffix.

Drafting from the longest match's occurrences (its *support*): at each drafted position the
most frequent next token among the occurrences still agreeing with the draft (ties: the most
recent), its probability the product of those frequencies; the draft stops below
``MIN_TOKEN_PROB`` or at ``MAX_SPEC_FACTOR`` times the match length, so a one-token match on
fresh text proposes at most a token or two while a 30-token copy proposes a long draft.

Two implementations of one definition: ``ReferenceSuffixIndex`` here in Python, and the same
store compiled (``csrc/suffix_index.cpp``, built on this machine by ``nasd_core.native``:
``compiled_module``), which ``SuffixIndex`` uses wherever it builds; the tests hold the two equal
draft for draft.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nasd_core import native

ANCHOR_LENGTHS = (1, 2, 4, 8, 16)
MAX_MATCH = 64
# Occurrences of one anchor read per lookup, newest first.
MAX_CANDIDATES = 32
# SuffixDecoding's defaults (ArcticInference / vLLM's `suffix` method).
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
SEPARATOR = -1
# The compiled store: a Python module (a class with state), no OpenMP.
SOURCES = [Path(__file__).parent / "csrc" / "suffix_index.cpp"]
CFLAGS = ["-O3", "-march=native"]


@functools.cache
def compiled_module():
    """The compiled store's module (``SuffixIndex``), or None where it cannot be built."""
    return native.build("nasd_suffix", SOURCES, CFLAGS, python_module=True, what="suffix drafter")


@dataclass(frozen=True)
class SuffixDraft:
    """Drafted tokens, each one's estimated chance of being right (falling), and the length of
    the context the draft matched."""

    tokens: list[int]
    probs: list[float]
    match_length: int

    @property
    def expected_accepted(self) -> float:
        return sum(self.probs)

    @property
    def splits(self) -> tuple[bool, ...]:
        """Per token, whether the match's stored continuations split there (its chance fell)."""
        return tuple(prob < previous for previous, prob in zip([1.0, *self.probs], self.probs))


EMPTY = SuffixDraft([], [], 0)


class ReferenceSuffixIndex:
    """Stored token sequences, matched by suffix (pure Python: the definition).

    Args:
        max_tokens: token budget; past it the oldest sequences are dropped (None: unbounded).
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self._heads: dict[int, dict[tuple[int, ...], int]] = {length: {} for length in ANCHOR_LENGTHS}
        self._prev: dict[int, list[int]] = {length: [] for length in ANCHOR_LENGTHS}
        self._sequence_start = 0
        self._sequence_starts: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def memory_bytes(self) -> int:
        """Bytes of the store's lists and dicts and their window keys (shallow: the token ints
        themselves, mostly shared small ints, are not counted); an estimate."""
        heads = sum(
            sys.getsizeof(windows) + sum(sys.getsizeof(window) for window in windows)
            for windows in self._heads.values()
        )
        return sys.getsizeof(self.tokens) + sum(sys.getsizeof(prev) for prev in self._prev.values()) + heads

    # ------------------------------------------------------------------ updates
    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Store a whole sequence (a finished request, a pool entry)."""
        self.start_sequence()
        self.extend(tokens)
        self._enforce_budget()

    def start_sequence(self) -> None:
        """Begin a new sequence: no match crosses into the previous one."""
        if self.tokens and self.tokens[-1] != SEPARATOR:
            self._append(SEPARATOR)
        self._sequence_start = len(self.tokens)
        self._sequence_starts.append(self._sequence_start)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current sequence."""
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        tokens = self.tokens
        position = len(tokens)
        tokens.append(token)
        for length in ANCHOR_LENGTHS:
            prev = self._prev[length]
            start = position + 1 - length
            if token == SEPARATOR or start < self._sequence_start:
                prev.append(-1)
                continue
            window = tuple(tokens[start : position + 1])
            heads = self._heads[length]
            prev.append(heads.get(window, -1))
            heads[window] = position

    def _enforce_budget(self) -> None:
        """Past the budget, keep the newest sequences that fit in half of it (rebuilt: the
        chains hold absolute positions)."""
        if self.max_tokens is None or len(self.tokens) <= self.max_tokens:
            return
        keep_from = len(self.tokens) - self.max_tokens // 2
        starts = [start for start in self._sequence_starts if start >= keep_from]
        kept = [
            self.tokens[start : end - 1] for start, end in zip(starts, [*starts[1:], len(self.tokens) + 1])
        ]
        ReferenceSuffixIndex.__init__(self, self.max_tokens)
        for sequence in kept:
            self.start_sequence()
            self.extend(sequence)

    # ------------------------------------------------------------------ lookups
    def match(self, context: Sequence[int], exclude: int = -1) -> tuple[int, list[int]]:
        """(length of the longest stored suffix of ``context``, the positions where its
        occurrences end, newest first); ``exclude``: a position not to count (the context's
        own end when the context is the stored sequence itself)."""
        for length in reversed(ANCHOR_LENGTHS):
            if len(context) < length:
                continue
            position = self._heads[length].get(tuple(context[len(context) - length :]), -1)
            prev = self._prev[length]
            found: list[tuple[int, int]] = []
            while position >= 0 and len(found) < MAX_CANDIDATES:
                if position != exclude:
                    found.append((self._extend_back(context, position, length), position))
                position = prev[position]
            if found:
                best = max(matched for matched, _ in found)
                return best, [position for matched, position in found if matched == best]
        return 0, []

    def _extend_back(self, context: Sequence[int], position: int, matched: int) -> int:
        tokens = self.tokens
        limit = min(MAX_MATCH, len(context), position + 1)
        while matched < limit and tokens[position - matched] == context[len(context) - 1 - matched]:
            matched += 1
        return matched

    def draft(
        self,
        context: Sequence[int],
        max_tokens: int,
        exclude: int = -1,
        max_spec_factor: float = MAX_SPEC_FACTOR,
    ) -> SuffixDraft:
        """The draft following ``context`` (see the module docstring for the sizing rule)."""
        match_length, support = self.match(context, exclude)
        if not support or max_tokens <= 0:
            return EMPTY
        limit = min(max_tokens, math.ceil(min(max_spec_factor * match_length, max_tokens)))
        tokens = self.tokens
        drafted: list[int] = []
        probs: list[float] = []
        prob = 1.0
        alive = support
        for offset in range(1, limit + 1):
            counts: dict[int, int] = {}
            for position in alive:  # newest first: a tie keeps the most recent continuation
                if position + offset < len(tokens) and (token := tokens[position + offset]) != SEPARATOR:
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            prob *= counts[token] / len(alive)
            if prob < MIN_TOKEN_PROB:
                break
            drafted.append(token)
            probs.append(prob)
            alive = [
                position
                for position in alive
                if position + offset < len(tokens) and tokens[position + offset] == token
            ]
        return SuffixDraft(drafted, probs, match_length)


class SuffixIndex:
    """Stored token sequences, matched by suffix: the compiled store where it builds, else
    ``ReferenceSuffixIndex`` (``compiled=False`` asks for the reference).

    Lookups pass the compiled store only the context's last ``MAX_MATCH`` tokens (no match is
    longer), so a call costs the same at any context length.
    """

    def __init__(self, max_tokens: int | None = None, compiled: bool = True) -> None:
        module = compiled_module() if compiled else None
        self.compiled = module is not None
        self._store = (
            module.SuffixIndex(-1 if max_tokens is None else max_tokens, MAX_MATCH, MAX_CANDIDATES)
            if module is not None
            else ReferenceSuffixIndex(max_tokens)
        )

    def __len__(self) -> int:
        return len(self._store)

    @property
    def tokens(self) -> list[int]:
        return list(self._store.tokens)

    def memory_bytes(self) -> int:
        """Bytes the store holds, estimated from its containers' sizes."""
        return self._store.memory_bytes()

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Store a whole sequence (a finished request, a pool entry)."""
        self._store.add_sequence(list(tokens))

    def start_sequence(self) -> None:
        """Begin a new sequence: no match crosses into the previous one."""
        self._store.start_sequence()

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current sequence."""
        self._store.extend(list(tokens))

    def match(self, context: Sequence[int], exclude: int = -1) -> tuple[int, list[int]]:
        """See ``ReferenceSuffixIndex.match``."""
        return self._store.match(list(context[-MAX_MATCH:]), exclude)

    def draft(
        self,
        context: Sequence[int],
        max_tokens: int,
        exclude: int = -1,
        max_spec_factor: float = MAX_SPEC_FACTOR,
    ) -> SuffixDraft:
        """See ``ReferenceSuffixIndex.draft``."""
        tail = list(context[-MAX_MATCH:])
        if not self.compiled:
            return self._store.draft(tail, max_tokens, exclude, max_spec_factor)
        tokens, probs, match_length = self._store.draft(
            tail, max_tokens, exclude, max_spec_factor, MIN_TOKEN_PROB
        )
        return SuffixDraft(tokens, probs, match_length)


# One row's query: its stores (the request's own first when ``exclude_own_end``), its context,
# the most tokens to draft (0: the match alone).
RowQuery = tuple[Sequence["SuffixIndex"], Sequence[int], int]


def draft_rows(
    queries: Sequence[RowQuery], exclude_own_end: bool = False, max_spec_factor: float = MAX_SPEC_FACTOR
) -> list[tuple[SuffixDraft, int]]:
    """Every row's draft from its stores, one compiled call for all rows where every store is
    compiled: per row, the store with the longest match drafts (a tie: the earlier). Returns
    each row's draft, whose ``match_length`` is the match's even when nothing is drafted
    (``max_tokens`` 0 asks for the match alone), and that store's index in the row's stores
    (-1: none matched). With ``exclude_own_end`` each row's first store is the row's own
    tokens, whose last position is the context's own end."""
    every_store = [store for stores, _, _ in queries for store in stores]
    if every_store and all(store.compiled for store in every_store):
        answers = compiled_module().draft_rows(
            [[store._store for store in stores] for stores, _, _ in queries],
            [list(context[-MAX_MATCH:]) for _, context, _ in queries],
            [max_tokens for _, _, max_tokens in queries],
            exclude_own_end,
            max_spec_factor,
            MIN_TOKEN_PROB,
        )
        return [(SuffixDraft(tokens, probs, length), chosen) for tokens, probs, length, chosen in answers]
    return [
        _reference_draft(stores, context, max_tokens, exclude_own_end, max_spec_factor)
        for stores, context, max_tokens in queries
    ]


def _reference_draft(
    stores: Sequence[SuffixIndex],
    context: Sequence[int],
    max_tokens: int,
    exclude_own_end: bool,
    max_spec_factor: float,
) -> tuple[SuffixDraft, int]:
    """``draft_rows`` for one row, store by store (the definition the compiled call follows)."""
    excludes = [
        len(store) - 1 if position == 0 and exclude_own_end else -1 for position, store in enumerate(stores)
    ]
    best_length, chosen = 0, -1
    for position, (store, exclude) in enumerate(zip(stores, excludes)):
        length = store.match(context, exclude)[0]
        if length > best_length:
            best_length, chosen = length, position
    if chosen < 0:
        return EMPTY, -1
    draft = stores[chosen].draft(context, max_tokens, excludes[chosen], max_spec_factor)
    return SuffixDraft(draft.tokens, draft.probs, best_length), chosen


def draft_best(
    stores: Sequence[SuffixIndex],
    context: Sequence[int],
    max_tokens: int,
    exclude_own_end: bool = False,
    max_spec_factor: float = MAX_SPEC_FACTOR,
) -> tuple[SuffixDraft, int]:
    """One row's ``draft_rows``."""
    return draft_rows([(stores, context, max_tokens)], exclude_own_end, max_spec_factor)[0]


def best_draft(drafts: Sequence[SuffixDraft]) -> SuffixDraft:
    """The draft expected to have the most tokens accepted (ties: the earlier source)."""
    best = EMPTY
    for draft in drafts:
        if draft.expected_accepted > best.expected_accepted:
            best = draft
    return best


# A shared store keeps its token budget in this many generations (see SharedSuffixIndex).
NUM_GENERATIONS = 4


class SharedSuffixIndex:
    """Finished sequences of many requests (a replica's own, what the pool brings in), matched
    by suffix, within a token budget; the interface of the drafter's shared sources
    (``update`` / ``update_many`` / ``lookup`` / ``propose`` / ``num_entries``).

    Why generations: dropping the oldest sequences from one hash-chain store means rebuilding
    it (the chains hold absolute positions), seconds at a pool's budget, on the engine thread
    where shared sources are updated. Instead the budget is split over ``NUM_GENERATIONS``
    stores; sequences go into the newest, and when it is full a new one starts and the oldest
    is dropped whole. A lookup asks every generation, newest first, and the longest match wins
    (a tie: the newer). At most ``max_tokens`` tokens are stored (a sequence longer than a
    generation's share is stored whole, alone in its generation).
    """

    def __init__(self, max_tokens: int, compiled: bool = True) -> None:
        self.max_tokens = max_tokens
        self.compiled = compiled
        self.generation_tokens = max(1, max_tokens // NUM_GENERATIONS)
        self._generations: list[SuffixIndex] = []  # oldest first

    @property
    def num_entries(self) -> int:
        """Stored tokens, over every generation."""
        return sum(len(generation) for generation in self._generations)

    def memory_bytes(self) -> int:
        """Bytes held over every generation (``SuffixIndex.memory_bytes``)."""
        return sum(generation.memory_bytes() for generation in self._generations)

    def update(self, tokens: Sequence[int]) -> None:
        """Store one finished sequence."""
        newest = self._generations[-1] if self._generations else None
        # + 1: the separator before it
        if newest is None or (len(newest) and len(newest) + len(tokens) + 1 > self.generation_tokens):
            self._generations.append(SuffixIndex(compiled=self.compiled))
            if len(self._generations) > NUM_GENERATIONS:
                del self._generations[0]
        self._generations[-1].add_sequence(tokens)

    def update_many(self, sequences: Sequence[Sequence[int]]) -> None:
        for sequence in sequences:
            self.update(sequence)

    @property
    def stores(self) -> list[SuffixIndex]:
        """The generations, newest first (the order a lookup asks them in)."""
        return self._generations[::-1]

    def draft(
        self, context: Sequence[int], max_tokens: int, max_spec_factor: float = math.inf
    ) -> SuffixDraft:
        """The draft of the generation with the longest match (newest on a tie)."""
        return draft_best(self.stores, context, max_tokens, max_spec_factor=max_spec_factor)[0]

    def longest_match(self, context: Sequence[int]) -> int:
        """The longest stored suffix of ``context`` (what ``draft`` would match)."""
        return draft_best(self.stores, context, 0)[0].match_length

    # The drafter reads its shared sources through NGramIndex's two lookups.
    def lookup(self, context: Sequence[int]) -> SuffixMatch | None:
        length = self.longest_match(context)
        return SuffixMatch(length) if length else None

    def propose(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int, int]:
        """(draft up to ``max_tokens``, its match length, 1; 0 when the match drafts nothing)."""
        draft = self.draft(context, max_tokens)
        return draft.tokens, draft.match_length, 1 if draft.tokens else 0


@dataclass(frozen=True)
class SuffixMatch:
    """A shared suffix store's answer to ``lookup``: how long a context it matched."""

    context_length: int
