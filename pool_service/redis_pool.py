"""RedisPool: the shared pool on Redis, one bounded stream per namespace.

Keys (the braces are a Redis Cluster hash tag, so a namespace's keys share a slot and the
publish script may touch them together):

* ``nasd:{ns}:seqs`` - stream of finished sequences, ``XADD ... MAXLEN ~ max_stream_len``;
  an entry holds the new sequences of one publish, up to ``max_sequence_tokens`` tokens;
* ``nasd:{ns}:seen`` - sorted set of content digests, trimmed to 2 x max_stream_len, so a
  sequence that several replicas (or users) finish is stored once;
* ``nasd:{ns}:meta`` - hash: schema version, epoch (new when the pool is recreated), created.

All three expire ``key_ttl_s`` after the namespace's last publish (refreshed by a publish
at most every tenth of it, so the expiry costs no command on most publishes).

A publish is one ``EVALSHA`` for a whole batch (dedup + append + trims run atomically in
Redis); a read is one blocking ``XREAD``. Memory is bounded by the stream length times the
entry size (``max_stream_len`` x ``max_sequence_tokens`` x 4 bytes) plus the digests; run
Redis with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (or ``volatile-lru``) as a
last resort, never ``noeviction``, which would turn a full pool into failed publishes (which
the worker survives, but the pool then stops learning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Sequence

import redis.asyncio as redis
from redis.exceptions import RedisError

from pool_service.codec import TOKEN_BYTES, pack_tokens, sequence_digest
from pool_service.config import SCHEMA_VERSION, PoolConfig
from pool_service.store import START_CURSOR, PoolUnavailableError, ReadBatch, decode_batch, now_ms

logger = logging.getLogger(__name__)

KEY_PREFIX = "nasd"
# Connections of a replica's shared command client: its commands are a few short round trips
# a second (write-behind publishes, reconnects), so two keep one free while one is busy.
COMMAND_CONNECTIONS = 2

# KEYS: stream, seen, meta. ARGV: maxlen, seen_cap, namespace, origin, entry_bytes, ttl_s
# (0: leave the expiry alone), then (digest, packed tokens, finished ms) triples. One ZMSCORE
# tests every digest and one ZADD records the new ones; the new sequences go into entries of
# at most entry_bytes (the fields of codec.encode_entry): a call costs 5 commands inside
# Redis (EVALSHA included) however many sequences it carries (one ZADD NX and one XADD per
# sequence cost 23 for ten), 8 when it refreshes the expiry.
_PUBLISH_SCRIPT = """
local digests = {}
for i = 7, #ARGV, 3 do digests[#digests + 1] = ARGV[i] end
local scores = redis.call('ZMSCORE', KEYS[2], unpack(digests))
local in_call, new_members = {}, {}
local tokens, lengths, stamps, num_bytes = {}, {}, {}, 0
local function add_entry()
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'n', ARGV[3], 'o', ARGV[4],
             't', table.concat(tokens), 'l', table.concat(lengths, ','), 'ts', table.concat(stamps, ','))
  tokens, lengths, stamps, num_bytes = {}, {}, {}, 0
end
for j, digest in ipairs(digests) do
  local i = 3 * j + 4
  if not scores[j] and not in_call[digest] then
    in_call[digest] = true
    new_members[#new_members + 1] = ARGV[i + 2]
    new_members[#new_members + 1] = digest
    local size = #ARGV[i + 1]
    if num_bytes > 0 and num_bytes + size > tonumber(ARGV[5]) then add_entry() end
    tokens[#tokens + 1] = ARGV[i + 1]
    lengths[#lengths + 1] = size / 4
    stamps[#stamps + 1] = ARGV[i + 2]
    num_bytes = num_bytes + size
  end
end
if num_bytes > 0 then add_entry() end
if #new_members > 0 then
  redis.call('ZADD', KEYS[2], unpack(new_members))
  -- Keep the seen_cap newest digests (a negative end rank needs no ZCARD first).
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[2]) - 1)
end
local ttl = tonumber(ARGV[6])
if ttl > 0 then  -- after the writes: EXPIRE on a key that does not exist yet does nothing
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
end
return #new_members / 2
"""


def pool_keys(namespace: str) -> dict[str, str]:
    """The Redis keys of one namespace."""
    tag = namespace.replace("{", "(").replace("}", ")")
    return {name: f"{KEY_PREFIX}:{{{tag}}}:{name}" for name in ("seqs", "seen", "meta")}


class RedisPool:
    """A namespace's pool on Redis (redis-py asyncio). Construct, then ``connect()``.

    Args:
        url: ``redis://`` or ``rediss://`` URL; a password goes in it (``redis://:pw@host``).
        namespace: model + tokenizer fingerprint (+ tenant); pools of different namespaces
            never mix.
        config: retention and timeouts.
        vocab_size: token ids at or above it are malformed entries.
        client: a command client (``command_client``) shared with other namespaces' pools, which
            then stays open when this one closes; None: its own. Blocking reads always get a
            connection of their own.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        config: PoolConfig | None = None,
        vocab_size: int | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.url = url
        self.namespace = namespace
        self.config = config or PoolConfig(redis_url=url)
        self.vocab_size = vocab_size
        self.keys = pool_keys(namespace)
        self.num_calls = 0
        self._expiry_set_at: float | None = None  # monotonic time of the last TTL refresh
        self._shared_client = client
        self._client: redis.Redis | None = None
        self._reader: redis.Redis | None = None
        self._publish = None

    def _clients(self) -> tuple[redis.Redis, redis.Redis]:
        if self._client is None or self._reader is None:
            self._client = self._shared_client or command_client(self.url, self.config)
            # A blocking read legitimately waits read_block_ms: its socket must wait longer.
            self._reader = open_client(self.url, self.config, self.config.read_block_ms / 1000)
            self._publish = self._client.register_script(_PUBLISH_SCRIPT)
        return self._client, self._reader

    async def connect(self) -> str:
        client, _ = self._clients()
        meta = self.keys["meta"]
        try:
            async with client.pipeline(transaction=True) as pipe:
                pipe.hsetnx(meta, "schema_version", SCHEMA_VERSION)
                pipe.hsetnx(meta, "epoch", secrets.token_hex(8))
                pipe.hsetnx(meta, "created_ms", now_ms())
                pipe.hsetnx(meta, "namespace", self.namespace)
                if self.config.key_ttl_s:  # a namespace nobody ever publishes to expires too
                    pipe.expire(meta, self.config.key_ttl_s)
                pipe.hmget(meta, "schema_version", "epoch")
                *_, (version, epoch) = await pipe.execute()
            self.num_calls += 1
        except (RedisError, OSError) as exc:
            raise PoolUnavailableError(f"redis unreachable: {exc}") from exc
        self._expiry_set_at = None  # Redis may have restarted empty: set the expiry again
        try:
            version_number = int(version)
        except (TypeError, ValueError):
            version_number = None
        if version_number != SCHEMA_VERSION or not epoch:
            raise PoolUnavailableError(
                f"pool {self.namespace!r} has schema {version!r}, this replica speaks {SCHEMA_VERSION}"
            )
        return epoch.decode(errors="replace")

    async def publish(
        self, origin: str, sequences: Sequence[Sequence[int]], finished_ms: Sequence[int] | None = None
    ) -> int:
        if not sequences:
            return 0
        self._clients()
        ttl_s = self.config.key_ttl_s
        now = time.monotonic()
        last_set = self._expiry_set_at
        refresh_expiry = ttl_s > 0 and (last_set is None or now - last_set >= ttl_s / 10)
        args: list[object] = [
            self.config.max_stream_len,
            2 * self.config.max_stream_len,
            self.namespace,
            origin,
            TOKEN_BYTES * self.config.max_sequence_tokens,
            ttl_s if refresh_expiry else 0,
        ]
        for sequence, published_ms in zip(sequences, finished_ms or [now_ms()] * len(sequences)):
            packed = pack_tokens(sequence)
            args += [sequence_digest(packed), packed, published_ms]
        try:
            self.num_calls += 1
            keys = [self.keys["seqs"], self.keys["seen"], self.keys["meta"]]
            num_added = int(await self._publish(keys=keys, args=args))
        except (RedisError, OSError) as exc:
            raise PoolUnavailableError(f"publish failed: {exc}") from exc
        if refresh_expiry:
            self._expiry_set_at = now
        return num_added

    async def read(self, cursor: str, count: int, block_ms: int) -> ReadBatch:
        _, reader = self._clients()
        try:
            self.num_calls += 1
            # BLOCK 0 means "for ever" to Redis; no BLOCK is what a zero wait means here.
            reply = await reader.xread({self.keys["seqs"]: cursor}, count=count, block=block_ms or None)
        except (RedisError, OSError) as exc:
            raise PoolUnavailableError(f"read failed: {exc}") from exc
        raw: list[tuple[str, dict[bytes, bytes]]] = []
        for _stream, entries in reply or []:
            raw.extend((entry_id.decode(), fields) for entry_id, fields in entries)
        return decode_batch(raw, self.namespace, self.vocab_size, cursor)

    async def close(self) -> None:
        for client in (self._client, self._reader):
            if client is not None and client is not self._shared_client:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
        self._client = self._reader = self._publish = None


def command_client(url: str, config: PoolConfig) -> redis.Redis:
    """A client for the pool's short commands (connect, publish), to share between every
    namespace a replica follows: at most ``COMMAND_CONNECTIONS`` connections, a command
    waiting (up to the socket timeout) for one while they are all busy, where each blocking
    reader holds a connection of its own for as long as it waits."""
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=COMMAND_CONNECTIONS,
        timeout=config.socket_timeout_s,
        password=_password(config),
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=config.socket_timeout_s,
    )
    return redis.Redis.from_pool(pool)


def _password(config: PoolConfig) -> str | None:
    env = config.redis_password_env
    return os.environ.get(env) or None if env else None


def open_client(url: str, config: PoolConfig, extra_timeout_s: float = 0.0) -> redis.Redis:
    """A client of the Redis at ``url`` with ``config``'s password variable and socket timeout
    (``extra_timeout_s`` more for blocking reads)."""
    timeout_s = config.socket_timeout_s
    # A password in the URL wins (redis-py lets URL options override keyword arguments).
    return redis.Redis.from_url(
        url,
        password=_password(config),
        socket_timeout=timeout_s + extra_timeout_s,
        socket_connect_timeout=timeout_s,
    )


__all__ = ["START_CURSOR", "RedisPool", "command_client", "open_client", "pool_keys"]
