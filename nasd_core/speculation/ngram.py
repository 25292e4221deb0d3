"""N-gram indexes: the drafter's memory of which token followed which context.

Two draft sources live here, both on plain Python ints and NumPy (never torch tensors,
which would cost more per call than the lookup itself):

* ``NGramIndex`` - counts of the next token after every context of ``min_ngram..max_ngram``
  tokens; drafting follows the most frequent continuation from the longest known context.
  With ``min_ngram == max_ngram`` it is the seeds' one-level storage. Incremental (O(new
  tokens x levels) per update), bounded by an entry budget with least-recently-updated
  eviction, and serialisable so the shared pool can ship it.
* ``prompt_lookup`` - a latest-first scan of the request's own tokens for the longest
  earlier occurrence of its suffix, proposing what followed that occurrence.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from nasd_core.config import IndexConfig

_SERIAL_VERSION = 1


# A context's successors are a plain dict {token: count} whose first key is the most frequent
# token (a tie keeps the earlier leader). A dict holding only ints is invisible to Python's
# cyclic garbage collector, where one small object per context was not: with a few million
# contexts in a pool-fed index, full collections paused every thread of the replica (the
# engine's included) for up to 0.4 s at a time.
Successors = dict[int, int]


def _led_by(counts: Successors, token: int) -> Successors:
    """``counts`` reordered so that ``token`` comes first."""
    reordered = {token: counts.pop(token)}
    reordered.update(counts)
    return reordered


@dataclass(frozen=True)
class Match:
    """The answer of one lookup: the most frequent next token after the longest known context."""

    token: int
    context_length: int
    count: int


class NGramIndex:
    """Multi-level n-gram counts with an entry budget.

    Args:
        config: bounds of the index (context lengths, entry budget, successors per context).

    An *entry* is one (context, next token) cell; ``num_entries`` never exceeds
    ``config.max_entries`` after any public call returns.
    """

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        if self.config.min_ngram > self.config.max_ngram:
            raise ValueError("min_ngram must be <= max_ngram")
        self.max_ngram = self.config.max_ngram
        self.min_ngram = self.config.min_ngram
        # Insertion order = recency of the last update; popitem(last=False) evicts in O(1).
        self._contexts: OrderedDict[tuple[int, ...], Successors] = OrderedDict()
        self.num_entries = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        """Number of distinct contexts held."""
        return len(self._contexts)

    # ------------------------------------------------------------------ updates
    def add(self, context: Sequence[int], token: int, count: int = 1) -> None:
        """Record that ``token`` followed every suffix of ``context`` of a stored length."""
        tail = tuple(context[-self.max_ngram :]) if self.max_ngram else ()
        for length in range(self.min_ngram, min(self.max_ngram, len(tail)) + 1):
            self._count(tail[len(tail) - length :], token, count)
        self._enforce_budget()

    def update(self, tokens: Sequence[int], start: int = 0) -> None:
        """Learn every n-gram whose next token sits at a position ``>= start`` of ``tokens``.

        Calling ``update(seq, start=len(seen))`` as a sequence grows learns each n-gram once.
        """
        count = self._count
        max_ngram, min_ngram = self.max_ngram, self.min_ngram
        for position in range(max(start, min_ngram), len(tokens)):
            token = tokens[position]
            longest = min(max_ngram, position)
            window = tuple(tokens[position - longest : position])
            for length in range(min_ngram, longest + 1):
                count(window[longest - length :], token, 1)
        self._enforce_budget()

    def update_many(self, sequences: Iterable[Sequence[int]]) -> None:
        """Learn whole sequences (e.g. finished requests replayed from the pool)."""
        for sequence in sequences:
            self.update(sequence)

    def _count(self, key: tuple[int, ...], token: int, count: int) -> None:
        contexts = self._contexts
        counts = contexts.get(key)
        if counts is None:
            contexts[key] = {token: count}
            self.num_entries += 1
            return
        contexts.move_to_end(key)
        best = next(iter(counts))
        if token in counts:
            counts[token] += count
        else:
            if len(counts) >= self.config.max_successors:
                # Forget the rarest continuation so one context cannot grow without bound.
                others = [other for other in counts if other != best]
                if not others:
                    return
                del counts[min(others, key=counts.__getitem__)]
                self.num_entries -= 1
            counts[token] = count
            self.num_entries += 1
        if token != best and counts[token] > counts[best]:
            contexts[key] = _led_by(counts, token)

    def _enforce_budget(self) -> None:
        contexts = self._contexts
        while self.num_entries > self.config.max_entries and contexts:
            _, counts = contexts.popitem(last=False)
            self.num_entries -= len(counts)
            self.num_evicted += 1

    def clear(self) -> None:
        self._contexts.clear()
        self.num_entries = 0

    # ------------------------------------------------------------------ lookups
    def lookup(self, context: Sequence[int]) -> Match | None:
        """Most frequent next token after the longest stored suffix of ``context``."""
        contexts = self._contexts
        longest = min(self.max_ngram, len(context))
        tail = tuple(context[len(context) - longest :])
        for length in range(longest, self.min_ngram - 1, -1):
            counts = contexts.get(tail[longest - length :])
            if counts is not None:
                best = next(iter(counts))
                return Match(best, length, counts[best])
        return None

    def propose(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int, int]:
        """Greedy draft of up to ``max_tokens`` tokens following the most frequent continuations.

        Returns:
            (draft, context length of the first match, count of the first drafted token);
            an empty draft with zeros when nothing is known.
        """
        contexts = self._contexts
        max_ngram, min_ngram = self.max_ngram, self.min_ngram
        window = list(context[-max_ngram:])
        draft: list[int] = []
        first_length = first_count = 0
        while len(draft) < max_tokens:
            longest = min(max_ngram, len(window))
            counts = None
            length = longest
            while length >= min_ngram:
                counts = contexts.get(tuple(window[len(window) - length :]))
                if counts is not None:
                    break
                length -= 1
            if counts is None:
                break
            best = next(iter(counts))
            if not draft:
                first_length, first_count = length, counts[best]
            draft.append(best)
            window.append(best)
            if len(window) > max_ngram:
                del window[0]
        return draft, first_length, first_count

    def successors(self, context: Sequence[int]) -> dict[int, int]:
        """Counts of every token seen after exactly ``context`` (a copy; empty if unknown)."""
        counts = self._contexts.get(tuple(context))
        return dict(counts) if counts else {}

    def contexts(self) -> Iterable[tuple[int, ...]]:
        return iter(self._contexts)

    # ------------------------------------------------------------ serialisation
    def to_bytes(self) -> bytes:
        """Pack the index (recency order kept) into a compact ``.npz`` byte string."""
        keys = list(self._contexts)
        values = list(self._contexts.values())
        arrays = {
            "header": np.array(
                [
                    _SERIAL_VERSION,
                    self.max_ngram,
                    self.min_ngram,
                    self.config.max_entries,
                    self.config.max_successors,
                ],
                dtype=np.int64,
            ),
            "context_lengths": np.fromiter((len(key) for key in keys), dtype=np.uint8, count=len(keys)),
            "context_tokens": np.fromiter((t for key in keys for t in key), dtype=np.int32),
            "num_successors": np.fromiter((len(v) for v in values), dtype=np.uint16, count=len(keys)),
            # The best token is history (first to reach the top count), not derivable from counts.
            "best_tokens": np.fromiter((next(iter(v)) for v in values), dtype=np.int32, count=len(keys)),
            "successor_tokens": np.fromiter((t for v in values for t in v), dtype=np.int32),
            "successor_counts": np.fromiter((c for v in values for c in v.values()), dtype=np.int64),
        }
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> NGramIndex:
        """Inverse of ``to_bytes``; raises ValueError on a foreign or corrupt payload."""
        try:
            arrays = np.load(io.BytesIO(data), allow_pickle=False)
            version, max_ngram, min_ngram, max_entries, max_successors = arrays["header"].tolist()
        except Exception as exc:  # np.load raises many kinds on garbage
            raise ValueError(f"not a serialised NGramIndex: {exc}") from None
        if version != _SERIAL_VERSION:
            raise ValueError(f"unsupported NGramIndex format version {version}")
        index = cls(
            IndexConfig(
                max_ngram=max_ngram,
                min_ngram=min_ngram,
                max_entries=max_entries,
                max_successors=max_successors,
            )
        )
        context_tokens = arrays["context_tokens"].tolist()
        successor_tokens = arrays["successor_tokens"].tolist()
        successor_counts = arrays["successor_counts"].tolist()
        token_at = successor_at = 0
        for length, num, best in zip(
            arrays["context_lengths"].tolist(),
            arrays["num_successors"].tolist(),
            arrays["best_tokens"].tolist(),
        ):
            key = tuple(context_tokens[token_at : token_at + length])
            token_at += length
            counts = dict(
                zip(
                    successor_tokens[successor_at : successor_at + num],
                    successor_counts[successor_at : successor_at + num],
                )
            )
            if best not in counts:
                raise ValueError("corrupt NGramIndex payload: best token without a count")
            index._contexts[key] = counts if next(iter(counts)) == best else _led_by(counts, best)
            successor_at += num
            index.num_entries += num
        index._enforce_budget()
        return index


def prompt_lookup(
    tokens: Sequence[int] | np.ndarray, max_tokens: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[list[int], int]:
    """Draft by copying what followed the latest earlier occurrence of the sequence's suffix.

    The longest suffix of ``max_ngram`` down to ``min_ngram`` tokens that occurred before wins;
    among its occurrences, the latest; the suffix's own position never matches (that would
    propose nothing useful).

    Why one scan: trying each suffix length in turn compared every window of the sequence up to
    ``max_ngram`` times (100-300 us a call at 200-1600 tokens, most of a creative-text step's
    drafting time at 32 rows); instead, the positions holding the last token are found once, and
    only they are extended backwards.

    Returns:
        (draft, matched suffix length); ``([], 0)`` when the suffix never occurred before.
    """
    sequence = np.asarray(tokens, dtype=np.int64)
    total = sequence.shape[0]
    longest = min(max_ngram, total - 1)
    if longest < max(min_ngram, 1):
        return [], 0
    # Earlier positions holding the last token: where an occurrence of the suffix may end.
    ends = np.flatnonzero(sequence[: total - 1] == sequence[total - 1])
    if not ends.size:
        return [], 0
    matched = np.ones(ends.size, dtype=np.int64)
    for back in range(1, longest):
        extending = np.flatnonzero((matched == back) & (ends >= back))
        extending = extending[sequence[ends[extending] - back] == sequence[total - 1 - back]]
        if not extending.size:
            break
        matched[extending] += 1
    length = int(matched.max())
    if length < min_ngram:
        return [], 0
    start = int(ends[np.flatnonzero(matched == length)[-1]]) + 1
    return sequence[start : start + max_tokens].tolist(), length
