"""Layered drafter: request-local sources first, then replica and pool indexes.

The request-local sources read the prompt and every accepted token (an n-gram index that
grows incrementally, and/or prompt lookup over the raw tokens). Shared sources (the
replica's index of finished requests, the index the shared pool feeds) are read-only
here. Among the sources that know the current context, the draft whose first token
matched the longest context wins, then the most frequent; ties go to the earlier layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nasd_core.config import DEFAULT_INDEX_MAX_ENTRIES, IndexConfig, SpecConfig
from nasd_core.speculation.ngram import NGramIndex, prompt_lookup
from nasd_core.speculation.suffix import RowQuery, SharedSuffixIndex, SuffixIndex, draft_rows

LOCAL_SOURCE = "request"
# A shared draft source: finished requests, read by every request of a replica.
SharedIndex = NGramIndex | SharedSuffixIndex


def new_shared_index(config: IndexConfig) -> SharedIndex:
    """A replica's or pool's index of finished requests, of ``config.kind``."""
    if config.kind == "suffix":
        return SharedSuffixIndex(config.max_entries)
    return NGramIndex(config)


@dataclass(frozen=True)
class Draft:
    """Proposed tokens, the source they came from and how long a context they matched."""

    tokens: list[int]
    source: str | None
    match_length: int = 0
    # Per token, whether the source's stored continuations split there (suffix stores only).
    splits: tuple[bool, ...] = ()


EMPTY_DRAFT = Draft([], None, 0)


def cut_draft(draft: Draft, length: int) -> Draft:
    """``draft``'s first ``length`` tokens (itself when it is no longer)."""
    if length >= len(draft.tokens):
        return draft
    return Draft(
        draft.tokens[:length], draft.source if length else None, draft.match_length, draft.splits[:length]
    )


class RequestDrafter:
    """Draft proposals for one request.

    Args:
        spec: speculation settings (draft sources, context lengths, unknown handling).
        shared: ``(name, index)`` pairs read after the request-local sources, in order.
        local_index: an index to use as the request-local index instead of a fresh one
            (the seeds' API passes its storage this way).
        vocab_size: range of filler tokens when ``spec.stop_if_unknown`` is False.
        seed: seed of the filler-token generator.
    """

    def __init__(
        self,
        spec: SpecConfig,
        shared: Sequence[tuple[str, SharedIndex]] = (),
        local_index: NGramIndex | None = None,
        vocab_size: int | None = None,
        seed: int | None = 0,
    ) -> None:
        self.spec = spec
        self.shared = list(shared)
        self.use_lookup = spec.local_index in ("prompt_lookup", "hybrid")
        self.local_index: NGramIndex | None = local_index
        # The request's own tokens matched by suffix (``spec.local_index == "suffix"``).
        self.local_suffix: SuffixIndex | None = None
        # A request that never drafts keeps no index of its tokens: indexing a 1000-token prompt
        # is 2-3 ms of the engine thread's time (3 levels x ~1 us per context update).
        if local_index is None and spec.local_index == "suffix" and spec.is_speculating:
            self.local_suffix = SuffixIndex()
            self.local_suffix.start_sequence()
        elif local_index is None and spec.local_index != "prompt_lookup" and spec.is_speculating:
            min_ngram = spec.max_ngram if spec.local_index == "one_level" else spec.min_ngram
            self.local_index = NGramIndex(
                IndexConfig(
                    max_ngram=spec.max_ngram, min_ngram=min_ngram, max_entries=DEFAULT_INDEX_MAX_ENTRIES
                )
            )
        # With the suffix source, shared suffix stores are read in the same call as the request's
        # own tokens, and every row of a step in one call (``suffix_drafts``).
        self._suffix_shared = (
            [(name, index) for name, index in self.shared if isinstance(index, SharedSuffixIndex)]
            if self.local_suffix is not None
            else []
        )
        self._other_shared = [pair for pair in self.shared if pair not in self._suffix_shared]
        self._num_learned = 0
        self._vocab_size = vocab_size
        self._filler_rng = np.random.default_rng(None if seed is None else seed % 2**64)

    def observe(self, tokens: Sequence[int]) -> None:
        """Learn the n-grams of ``tokens`` (the whole sequence so far) not learned yet. Every
        lookup catches up first, so a row learns its new tokens only when it next drafts: a
        resting row costs nothing per step, and one call learns the tokens of several steps."""
        if len(tokens) <= self._num_learned:
            return
        if self.local_index is not None:
            self.local_index.update(tokens, start=self._num_learned)
        if self.local_suffix is not None:
            self.local_suffix.extend(tokens[self._num_learned :])
        self._num_learned = len(tokens)

    def learn_alternatives(self, context: Sequence[int], tokens: Sequence[int]) -> None:
        """Record extra plausible next tokens after ``context`` (the seeds' filler top-k)."""
        if self.local_index is not None:
            for token in tokens:
                self.local_index.add(context, token)

    def propose(self, tokens: Sequence[int], max_tokens: int, suffix: Draft | None = None) -> Draft:
        """Best draft of up to ``max_tokens`` tokens to follow ``tokens``. ``suffix``: this
        drafter's ``suffix_drafts`` answer for the same tokens and cap, where a step asked for
        every row's at once (None: asked here)."""
        if max_tokens <= 0:
            return EMPTY_DRAFT
        self.observe(tokens)
        draft = self._best_draft(tokens, max_tokens, suffix)
        if self.spec.stop_if_unknown or self._vocab_size is None or len(draft.tokens) >= max_tokens:
            return draft
        return self._fill_unknown(tokens, draft, max_tokens)

    def longest_match(self, tokens: Sequence[int], suffix: Draft | None = None) -> tuple[int, str | None]:
        """The longest context the next draft can match and the source that holds it (the
        earlier layer on a tie, as ``propose`` prefers), from lookups alone. ``suffix``: this
        drafter's ``suffix_drafts`` answer for a match alone (None: asked here).

        Cheaper than ``propose`` (no draft built), so the engine can skip drafting a step that
        would not speculate even with the best drafts possible. The same length as the draft's
        ``match_length`` (on a tie the source may differ): prompt lookup only matches a context
        the request's own index holds too, except beyond the index's longest context, where it
        is scanned for.
        """
        self.observe(tokens)
        longest, source = 0, None
        if self.local_suffix is not None:
            match = suffix if suffix is not None else self._suffix_draft(tokens, 0)
            longest, source = match.match_length, match.source
        for name, index in self._indexes():
            match = index.lookup(tokens)
            if match is not None and match.context_length > longest:
                longest, source = match.context_length, name
        # Prompt lookup can only match longer than the request's own index where the index's
        # longest context is matched; then its real match length is looked up (one scan, a few
        # us). Why not assume it reaches ``lookup_max_ngram``: at 32 creative-text rows that
        # optimism had ~1300 drafts built in a 135-step run for ~260 the policy then took.
        lookup_reaches = self.local_index is None or longest >= self.local_index.max_ngram
        if self.use_lookup and lookup_reaches and self.spec.lookup_max_ngram > longest:
            _, length = prompt_lookup(tokens, 0, self.spec.lookup_max_ngram, self.spec.min_ngram)
            if length >= longest:  # a tie goes to the request's own tokens, as in propose
                longest, source = length, LOCAL_SOURCE
        return longest, source

    def _best_draft(self, tokens: Sequence[int], max_tokens: int, suffix: Draft | None = None) -> Draft:
        spec = self.spec
        best = EMPTY_DRAFT
        best_key = (0, 0)
        if self.local_suffix is not None:
            best = suffix if suffix is not None else self._suffix_draft(tokens, max_tokens)
            # Counted once, as a prompt lookup copy is; a match whose continuations are too
            # split to draft (``suffix.MIN_TOKEN_PROB``) still holds its length, as
            # ``longest_match`` reports it.
            best_key = (best.match_length, 1 if best.tokens else 0)
        if self.use_lookup:
            candidate, length = prompt_lookup(tokens, max_tokens, spec.lookup_max_ngram, spec.min_ngram)
            if candidate:
                # A latest-occurrence copy carries no frequency; count it once.
                best, best_key = Draft(candidate, LOCAL_SOURCE, length), (length, 1)
        for name, index in self._indexes():
            candidate, length, count = index.propose(tokens, max_tokens)
            # A match with no draft (a suffix store's continuations too split) keeps its length,
            # as ``longest_match`` reports it; an n-gram index has none without a draft.
            if length and (length, count) > best_key:
                best, best_key = Draft(candidate, name, length), (length, count)
        return best

    def _suffix_draft(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        """This drafter's ``suffix_drafts`` answer alone."""
        return suffix_drafts([self], [tokens], [max_tokens])[0]

    def suffix_query(self, tokens: Sequence[int], max_tokens: int) -> tuple[RowQuery, list[str]]:
        """This row's question to its suffix stores (the request's own tokens, then each shared
        suffix source's generations) and each store's source name."""
        stores, names = [self.local_suffix], [LOCAL_SOURCE]
        for name, index in self._suffix_shared:
            generations = index.stores
            stores += generations
            names += [name] * len(generations)
        return (stores, tokens, max_tokens), names

    def _indexes(self) -> list[tuple[str, SharedIndex]]:
        """Every index read one by one, request-local first (suffix stores read together are not)."""
        if self.local_index is None:
            return self._other_shared
        return [(LOCAL_SOURCE, self.local_index), *self._other_shared]

    def _fill_unknown(self, tokens: Sequence[int], draft: Draft, max_tokens: int) -> Draft:
        # The seeds' stop_if_unknown=False: guess a random token and keep drafting after it.
        drafted = list(draft.tokens)
        context = list(tokens)
        while len(drafted) < max_tokens:
            drafted.append(int(self._filler_rng.integers(self._vocab_size)))
            more = self._best_draft(context + drafted, max_tokens - len(drafted))
            drafted.extend(more.tokens)
        return Draft(drafted, draft.source or LOCAL_SOURCE, draft.match_length)


def suffix_drafts(
    drafters: Sequence[RequestDrafter], contexts: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> list[Draft | None]:
    """Each drafter's draft from its suffix stores (``max_tokens`` 0: the match alone; None: a
    drafter without suffix sources), every row in one call of the compiled store: whichever
    store holds the longest match drafts, up to the cap, as prompt lookup drafts (the policy
    sizes each draft by what drafts of its source and match length have been accepted)."""
    answers: list[Draft | None] = [None] * len(drafters)
    rows, queries, names = [], [], []
    for row, (drafter, context, cap) in enumerate(zip(drafters, contexts, max_tokens)):
        if drafter.local_suffix is not None:
            query, store_names = drafter.suffix_query(context, cap)
            rows.append(row)
            queries.append(query)
            names.append(store_names)
    drafts = draft_rows(queries, exclude_own_end=True, max_spec_factor=math.inf)
    for row, store_names, (draft, chosen) in zip(rows, names, drafts):
        answers[row] = (
            Draft(draft.tokens, store_names[chosen], draft.match_length, draft.splits)
            if chosen >= 0
            else EMPTY_DRAFT
        )
    return answers


def propose_rows(
    drafters: Sequence[RequestDrafter], contexts: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> list[Draft]:
    """``RequestDrafter.propose`` for every row of a step, the suffix stores asked in one call."""
    for drafter, context in zip(drafters, contexts):
        drafter.observe(context)
    suffix = suffix_drafts(drafters, contexts, max_tokens)
    return [
        drafter.propose(context, cap, answer)
        for drafter, context, cap, answer in zip(drafters, contexts, max_tokens, suffix)
    ]


def longest_matches(
    drafters: Sequence[RequestDrafter], contexts: Sequence[Sequence[int]]
) -> list[tuple[int, str | None]]:
    """``RequestDrafter.longest_match`` for every row of a step, the suffix stores asked in one call."""
    for drafter, context in zip(drafters, contexts):
        drafter.observe(context)
    suffix = suffix_drafts(drafters, contexts, [0] * len(drafters))
    return [
        drafter.longest_match(context, answer) for drafter, context, answer in zip(drafters, contexts, suffix)
    ]
