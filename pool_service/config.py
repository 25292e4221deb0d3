"""Settings of the shared n-gram pool, passed down from the service to the sync workers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nasd_core.config import IndexConfig

# Stream retention: ~20k entries (each one publish's new sequences, often one sequence of a
# few hundred tokens) is a few MB in Redis and replays into a local index in a few seconds;
# older text is less likely to recur.
DEFAULT_MAX_STREAM_LEN = 20_000
DEFAULT_MAX_SEQUENCE_TOKENS = 8_192
DEFAULT_PUBLISH_BATCH = 64
# Write-behind and read coalescing: a burst of finishing requests costs one publish and one
# read per replica. A finished sequence waits at most the flush interval before it is sent,
# a reader returns as soon as it arrives and pauses at most the read interval between reads,
# so the worst case is ~300 ms plus the round trips, inside a 500 ms lag budget (measured
# p99 254-269 ms at 50-5000 tok/s per replica, benchmarks/pool.py).
DEFAULT_FLUSH_INTERVAL_MS = 250
DEFAULT_READ_INTERVAL_MS = 50
DEFAULT_READ_BATCH = 512
# A blocking read returns as soon as an entry arrives, so the block time only bounds how often
# an idle replica polls: long blocks keep Redis commands per generated token low.
DEFAULT_READ_BLOCK_MS = 60_000
DEFAULT_MAX_PENDING = 4_096
DEFAULT_SOCKET_TIMEOUT_S = 2.0
DEFAULT_BACKOFF_INITIAL_S = 0.1
DEFAULT_BACKOFF_MAX_S = 5.0
DEFAULT_WARM_START_TIMEOUT_S = 5.0
DEFAULT_MAX_TENANTS = 64
# Partition streams a replica tails at once (per namespace). Routed by partition, a replica
# serves ~(tenants x partitions / replicas) keys: ~20-24 in the 64- and 512-replica cells of
# docs/results.md's cluster-scale simulation, at the partitions it suggests. Each costs a blocking read
# (one Redis connection; connects and publishes share the replica's command client); a replica
# that drifts onto more drops the least recently used.
DEFAULT_MAX_FOLLOWED_PARTITIONS = 32
# Tenants come and go and a new model or tokenizer means a new namespace: without an expiry
# the namespaces nobody publishes to would hold their memory in Redis for ever.
DEFAULT_KEY_TTL_S = 7 * 24 * 3600
# The pool-fed and replica indexes hold other requests' tokens, matched by suffix (one index
# each per namespace): the compiled store takes ~120 bytes per stored token on the drafter
# replay's chat traces and ~300 on text that never repeats (every window new; estimated by
# ``SuffixIndex.memory_bytes``), so 1M tokens is 120-300 MB per index. With the n-gram kind
# the budget counts (context, next token) cells.
DEFAULT_POOL_INDEX_TOKENS = 1_000_000
DEFAULT_POOL_NGRAM_ENTRIES = 2_000_000
DEFAULT_POOL_INDEX = IndexConfig(kind="suffix", max_entries=DEFAULT_POOL_INDEX_TOKENS)


def pool_index(kind: Literal["ngram", "suffix"]) -> IndexConfig:
    """The default replica and pool index of ``kind``."""
    if kind == "ngram":
        return IndexConfig(kind="ngram", max_entries=DEFAULT_POOL_NGRAM_ENTRIES)
    return DEFAULT_POOL_INDEX


SCHEMA_VERSION = 1


class PoolConfig(BaseModel):
    """Where the shared pool lives and how a replica syncs with it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str | None = Field(
        None,
        description="redis:// or rediss:// URL (password in the URL); None = an in-process pool "
        "(one replica, or several replicas in one process).",
    )
    redis_password_env: str | None = Field(
        "NASD_REDIS_PASSWORD",
        description="Environment variable holding the Redis password (e.g. from a Kubernetes Secret), "
        "used when the URL carries none, so the password never sits in a manifest or config.",
    )
    tenant_isolation: bool = Field(
        False,
        description="Each tenant (the request's `user`) drafts only from its own namespace. A shared "
        "draft pool is a timing side channel: a fast response tells one user that another wrote the text.",
    )
    max_tenants: int = Field(DEFAULT_MAX_TENANTS, ge=1, description="Most tenant namespaces per replica.")
    partitions: int = Field(
        0,
        ge=0,
        description="Pool partitions per tenant. 0 = none: every replica tails the whole pool. N >= 1: a "
        "tenant's sequences are split over N partitions by a hash of the conversation's opening, requests "
        "are routed by (tenant, partition), and a replica tails only the partitions it serves. About the "
        "busiest tenant's share of traffic x replicas / 2, at least 1 (docs/results.md, pool at scale). "
        "Replicas sharing a pool must agree on it.",
    )
    max_followed_partitions: int = Field(
        DEFAULT_MAX_FOLLOWED_PARTITIONS,
        ge=1,
        description="Partition streams a replica tails at once per namespace (least recently used dropped).",
    )
    key_ttl_s: int = Field(
        DEFAULT_KEY_TTL_S,
        ge=0,
        description="A namespace's keys expire this long after its last publish (0 = never), so pools "
        "of departed tenants and retired models free their Redis memory.",
    )
    max_stream_len: int = Field(
        DEFAULT_MAX_STREAM_LEN,
        ge=1,
        description="Stream entries the pool retains (approximate trim); an entry holds the new sequences "
        "of one publish, up to max_sequence_tokens tokens, so at least this many sequences are kept.",
    )
    max_sequence_tokens: int = Field(
        DEFAULT_MAX_SEQUENCE_TOKENS,
        ge=2,
        description="Longer sequences are published by their last tokens; also the size of a stream entry.",
    )
    # The publish script passes a call's digests to one ZMSCORE: Lua unpacks at most ~8000 values.
    publish_batch: int = Field(
        DEFAULT_PUBLISH_BATCH, ge=1, le=1024, description="Sequences per publish call."
    )
    flush_interval_ms: int = Field(
        DEFAULT_FLUSH_INTERVAL_MS, ge=1, description="Write-behind delay that lets publishes batch."
    )
    read_interval_ms: int = Field(
        DEFAULT_READ_INTERVAL_MS,
        ge=0,
        description="Pause after a read that learned something, so bursts batch.",
    )
    read_batch: int = Field(DEFAULT_READ_BATCH, ge=1, description="Entries per read call.")
    read_block_ms: int = Field(DEFAULT_READ_BLOCK_MS, ge=1, description="Longest wait of one blocking read.")
    max_pending: int = Field(
        DEFAULT_MAX_PENDING,
        ge=1,
        description="Unpublished sequences kept while Redis is away.",
    )
    socket_timeout_s: float = Field(
        DEFAULT_SOCKET_TIMEOUT_S, gt=0, description="A Redis call slower than this counts as Redis down."
    )
    backoff_initial_s: float = Field(DEFAULT_BACKOFF_INITIAL_S, gt=0, description="First reconnect delay.")
    backoff_max_s: float = Field(DEFAULT_BACKOFF_MAX_S, gt=0, description="Longest reconnect delay.")
    warm_start_timeout_s: float = Field(
        DEFAULT_WARM_START_TIMEOUT_S,
        ge=0,
        description="How long start() waits for the retained pool to replay before serving anyway.",
    )
    index: IndexConfig = Field(
        default_factory=lambda: DEFAULT_POOL_INDEX, description="Bounds of the replica and pool-fed indexes."
    )
