"""How a finished token sequence travels through the pool: fields of one stream entry.

An entry is ``{n: namespace, o: origin replica, t: token ids as little-endian uint32,
ts: publish time in ms}``. Everything read back is checked: a pool is shared state that
another version, another model or a bug may have written, so a bad entry is skipped and
counted, never trusted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_TOKEN_DTYPE = np.dtype("<u4")


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


def encode_entry(namespace: str, origin: str, packed: bytes, published_ms: int) -> dict[bytes, bytes]:
    return {
        b"n": namespace.encode(),
        b"o": origin.encode(),
        b"t": packed,
        b"ts": str(published_ms).encode(),
    }


def decode_entry(
    entry_id: str, fields: Mapping[bytes, bytes], namespace: str, vocab_size: int | None
) -> PoolEntry:
    """Check and decode one entry.

    Raises:
        ForeignEntryError: the entry names another namespace.
        MalformedEntryError: missing fields, a token payload that is not uint32s, ids outside
            the vocabulary, or a bad timestamp.
    """
    try:
        entry_namespace = fields[b"n"].decode()
        origin = fields[b"o"].decode()
        packed = fields[b"t"]
        published_ms = int(fields[b"ts"])
    except (KeyError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise MalformedEntryError(f"entry {entry_id}: bad fields ({exc!r})") from None
    if entry_namespace != namespace:
        raise ForeignEntryError(f"entry {entry_id}: namespace {entry_namespace!r}")
    if not isinstance(packed, bytes) or not packed or len(packed) % _TOKEN_DTYPE.itemsize:
        raise MalformedEntryError(f"entry {entry_id}: token payload of {len(packed)} bytes")
    tokens = np.frombuffer(packed, dtype=_TOKEN_DTYPE)
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        raise MalformedEntryError(f"entry {entry_id}: token id {int(tokens.max())} outside the vocabulary")
    return PoolEntry(entry_id, origin, tokens.tolist(), published_ms)
