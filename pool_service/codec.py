"""How finished token sequences travel through the pool: the fields of one stream entry.

An entry holds the new sequences of one publish call: ``{n: namespace, o: origin replica,
t: their token ids, concatenated, as little-endian uint32, l: their lengths ("128,57"),
ts: when each finished, in ms ("1700000000000,1700000000004")}``. Without ``l`` an entry is
one sequence (the layout before batching, still read). One entry per publish rather than
per sequence is what keeps Redis's work per generated token low at high rates: a busy
replica's ten sequences cost one ``XADD`` instead of ten. Everything read back is checked: a
pool is shared state that another version, another model or a bug may have written, so a
bad entry is skipped and counted, never trusted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

_TOKEN_DTYPE = np.dtype("<u4")
TOKEN_BYTES = _TOKEN_DTYPE.itemsize
_Item = TypeVar("_Item")


class MalformedEntryError(ValueError):
    """A stream entry that is not a valid token sequence of this pool."""


class ForeignEntryError(MalformedEntryError):
    """A well-formed entry written for another namespace (another model or tenant)."""


@dataclass(frozen=True)
class PoolEntry:
    """One finished sequence read back from the pool."""

    entry_id: str
    origin: str
    token_ids: list[int]
    published_ms: int


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=_TOKEN_DTYPE).tobytes()


def sequence_digest(packed: bytes) -> bytes:
    """Content hash used to publish a sequence once however many replicas finish it."""
    return hashlib.blake2b(packed, digest_size=16).digest()


def bounded_runs(items: Sequence[_Item], sizes: Sequence[int], max_size: int) -> Iterator[list[_Item]]:
    """Consecutive runs of ``items`` whose ``sizes`` add up to at most ``max_size`` (an item
    larger than that is a run of its own)."""
    run: list[_Item] = []
    run_size = 0
    for item, size in zip(items, sizes):
        if run and run_size + size > max_size:
            yield run
            run, run_size = [], 0
        run.append(item)
        run_size += size
    if run:
        yield run


def encode_entry(
    namespace: str, origin: str, packed: Sequence[bytes], finished_ms: Sequence[int]
) -> dict[bytes, bytes]:
    """The fields of an entry holding the packed sequences ``packed`` (the Redis publish
    script builds the same fields inside Redis)."""
    return {
        b"n": namespace.encode(),
        b"o": origin.encode(),
        b"t": b"".join(packed),
        b"l": ",".join(str(len(tokens) // TOKEN_BYTES) for tokens in packed).encode(),
        b"ts": ",".join(map(str, finished_ms)).encode(),
    }


def decode_entry(
    entry_id: str, fields: Mapping[bytes, bytes], namespace: str, vocab_size: int | None
) -> list[PoolEntry]:
    """Check and decode one entry into its sequences.

    Raises:
        ForeignEntryError: the entry names another namespace.
        MalformedEntryError: missing fields, a token payload that is not uint32s, lengths or
            times that do not match it, ids outside the vocabulary.
    """
    try:
        entry_namespace = fields[b"n"].decode()
        origin = fields[b"o"].decode()
        packed = fields[b"t"]
        finished_ms = [int(stamp) for stamp in fields[b"ts"].split(b",")]
        lengths = [int(length) for length in fields[b"l"].split(b",")] if b"l" in fields else None
    except (KeyError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise MalformedEntryError(f"entry {entry_id}: bad fields ({exc!r})") from None
    if entry_namespace != namespace:
        raise ForeignEntryError(f"entry {entry_id}: namespace {entry_namespace!r}")
    if not isinstance(packed, bytes) or not packed or len(packed) % TOKEN_BYTES:
        raise MalformedEntryError(f"entry {entry_id}: token payload of {len(packed)} bytes")
    tokens = np.frombuffer(packed, dtype=_TOKEN_DTYPE)
    lengths = lengths or [len(tokens)]
    if len(finished_ms) != len(lengths) or min(lengths) < 1 or sum(lengths) != len(tokens):
        raise MalformedEntryError(f"entry {entry_id}: lengths {lengths} do not match the payload")
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        raise MalformedEntryError(f"entry {entry_id}: token id {int(tokens.max())} outside the vocabulary")
    token_ids = tokens.tolist()
    ends = np.cumsum(lengths).tolist()
    return [
        PoolEntry(entry_id, origin, token_ids[end - length : end], stamp)
        for length, end, stamp in zip(lengths, ends, finished_ms)
    ]
