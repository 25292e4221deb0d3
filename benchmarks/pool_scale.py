"""The shared pool at cluster scale, simulated: what one replica pays to ingest the pool and
which pool drafts it keeps, at 8 / 64 / 512 replicas of 5000 tokens/s each, by design.

No model runs. Four parts, the first three printed in the first table:

1. **Traffic** (computed from a workload model, below): which finished sequences each replica
   ingests under a design, so its ingest tokens/s, Redis egress bytes/s, and, with this
   machine's measured cost of indexing a token, its ingest CPU. The pool-fed index is bounded
   (``PoolConfig.index.max_entries``), so the faster a replica ingests, the sooner it forgets:
   its *retention* is the budget's tokens over the ingest rate.
2. **Hit rate** (replayed from recorded greedy traces): what pool drafts are worth to a request
   whose related earlier sequence (the same question again, the question reworded, the same
   question from another tenant) is in its replica's index, measured as pool-drafted tokens
   accepted per request, against the same replay with nothing related in the pool. A design's
   hit rate weighs that by how often the related sequence is in view: published in a partition
   the replica follows (or produced by the replica itself) and not yet forgotten when the
   related request comes (the gap between them is exponential, mean ``GAP_S``).
3. **Redis** (real): for the busiest replica of each cell, real ``PoolSync`` workers tail the
   partitions it follows on a real redis-server, fed at the modelled rate (capped at what this
   machine can publish, shown): measured egress and sync lag p99, and whether it kept up.
4. **The service** (real, second table): ``SERVICE_REPLICAS`` real ``SharedPools`` with
   ``pool_partitions`` 0 / 1 / the rule in docs/api.md / twice it, requests routed as the service
   routes them (``service_cell``): ingest against unpartitioned, and repeats drafted.

The workload: ``TENANTS`` tenants (applications) with Zipf popularity; a request is a repeat of
a question its tenant asked before, a rewording of one, another tenant's question, or
unrelated (the long tail), in ``KIND_SHARES``. Designs:

* ``full``: today; every replica ingests every sequence, requests routed anywhere.
* ``sampled``: every replica ingests a random ``SAMPLE_SHARE`` of the sequences.
* ``tenant``: a sequence goes to its tenant's partition; requests are routed by tenant with
  bounded-load consistent hashing (a tenant's traffic spread over as many replicas as it
  needs); a replica ingests only the partitions of tenants it serves.
* ``tenant_split``: as ``tenant``, but a tenant that needs more than ``SPLIT_REPLICAS``
  replicas is split by a hash of the prompt's first tokens into sub-partitions of about that
  size (the same question stays together; a rewording may not).
* ``prefix``: every tenant split alike into as many sub-partitions as the busiest tenant
  needs (a fixed setting, where ``tenant_split`` needs each tenant's traffic share).

    python -m benchmarks.pool_scale --record   # paraphrase traces -> benchmarks/traces/ (minutes)
    python -m benchmarks.pool_scale            # the simulation (a few minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import math
import random
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from benchmarks.common import grouped_bars, new_figure, publish_run, run_metadata
from benchmarks.replay import MAX_DRAFT, PARAPHRASE_TRACES, TRACES, accepted_prefix, greedy_traces
from benchmarks.workloads import WORKLOADS, make_workload, paraphrase
from deployments.router import DEFAULT_LOAD_BOUND, bounded_load_order, load_capacity
from deployments.routing import pool_partition, routing_key
from deployments.schemas import GenerateRequest
from nasd_core.config import SpecConfig
from nasd_core.speculation.drafter import RequestDrafter
from nasd_core.speculation.ngram import NGramIndex
from pool_service import PoolConfig, SharedPools
from pool_service.backends import open_store
from pool_service.codec import TOKEN_BYTES
from pool_service.local_redis import LocalRedis
from pool_service.sync import PoolSync

REPLICA_COUNTS = (8, 64, 512)
TOKENS_PER_S = 5000  # per replica: a GPU replica batching many requests
TENANTS = 256
ZIPF_EXPONENT = 1.0
KIND_SHARES = {"repeat": 0.30, "paraphrase": 0.10, "cross_tenant": 0.05, "unrelated": 0.55}
GAP_S = 60.0  # mean time from a sequence to the request it could help
SAMPLE_SHARE = 0.1
SPLIT_REPLICAS = 2
# Bounded-load consistent hashing, as the service routes: a replica takes at most this
# multiple of the mean load before a key's traffic spills to the next replica on the ring.
BOUNDED_LOAD = DEFAULT_LOAD_BOUND
DESIGNS = ("full", "sampled", "tenant", "tenant_split", "prefix")
# Bytes on the wire per ingested token: 4 per token id plus the entry's fields and framing,
# spread over a sequence (measured in part 3; this is its prior for the traffic model).
WIRE_BYTES_PER_TOKEN = TOKEN_BYTES
# Real Redis part: at most this many tokens/s are published (what 2 cores push with room for a
# reader), for this long per cell.
MAX_PUBLISH_TOKENS_PER_S = 400_000
REDIS_SECONDS = 6.0
TICK_S = 0.05
# Part 4, the service's own pool layer and routing at a size this machine holds in one
# process: 16 replicas, 32 Zipf tenants; partitions by the rule in docs/api.md (busiest tenant's
# share x replicas / 2, rounded up: 2).
SERVICE_REPLICAS = 16
SERVICE_TENANTS = 32
SERVICE_QUESTIONS = 40
SERVICE_ROWS = 4
SERVICE_TICKS = 20
SERVICE_ANSWER_TOKENS = 128
# Between ticks the pool syncs until every replica has read every entry of the streams it
# follows (a fixed wait made the figures depend on the machine: a repeat hit rate of 0.70 on one
# host, over 0.8 on another), at most this long.
SERVICE_SETTLE_TIMEOUT_S = 30.0
RING_VNODES = 100  # as Ray's ConsistentHashRouter


# ---------------------------------------------------------------------------- recording
def record_paraphrases(num_prompts: int = 16, max_tokens: int = 128) -> dict:
    """Greedy answers to the replay traces' questions reworded (``workloads.paraphrase``)."""
    from nasd_core.loader import load_model

    model, tokenizer = load_model()
    prompts = {
        name: [
            tokenizer.apply_chat_template(
                paraphrase(conv), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for conv in make_workload(name, num_prompts, seed=7)
        ]
        for name in WORKLOADS
    }
    traces = greedy_traces(model, tokenizer, prompts, max_tokens)
    return {"meta": run_metadata(model, "float32", "benchmarks.pool_scale"), "traces": traces}


# ------------------------------------------------------------------- part 2: draft values
def pool_accepted(trace: dict[str, list[int]], pool: NGramIndex) -> int:
    """Tokens of ``trace``'s output accepted from drafts out of ``pool`` (the replica's
    pool-fed index) when it is decoded with the server's drafter (request-local and pool)."""
    drafter = RequestDrafter(SpecConfig(mode="on", num_draft_tokens=MAX_DRAFT), [("pool", pool)])
    prompt, output = trace["prompt"], trace["output"]
    context = list(prompt)
    drafter.observe(context)
    position = num_from_pool = 0
    while position < len(output):
        draft = drafter.propose(context, min(MAX_DRAFT, len(output) - position))
        num_accepted = accepted_prefix(draft.tokens, output[position:])
        if draft.source == "pool":
            num_from_pool += num_accepted
        context.extend(output[position : position + num_accepted + 1])
        position += num_accepted + 1
        drafter.observe(context)
    return num_from_pool


def draft_values(originals: list[dict], paraphrases: list[dict]) -> dict[str, float]:
    """Pool-accepted tokens per request by how the request relates to what the pool holds:
    the same question (``repeat``, also ``cross_tenant``: another tenant's), the question
    reworded (``paraphrase``), and nothing related (``unrelated``: every other trace in the
    pool, the generic phrases any text shares)."""
    sums = dict.fromkeys(("repeat", "paraphrase", "unrelated"), 0.0)
    for index, (original, reworded) in enumerate(zip(originals, paraphrases)):
        alone = NGramIndex(PoolConfig().index)
        alone.update(original["prompt"] + original["output"])
        sums["repeat"] += pool_accepted(original, alone)
        sums["paraphrase"] += pool_accepted(reworded, alone)
        others = NGramIndex(PoolConfig().index)
        others.update_many(t["prompt"] + t["output"] for j, t in enumerate(originals) if j != index)
        sums["unrelated"] += pool_accepted(original, others)
    values = {kind: total / len(originals) for kind, total in sums.items()}
    values["cross_tenant"] = values["repeat"]
    return values


# ---------------------------------------------------------------------- part 1: traffic
@dataclass
class IndexCosts:
    """This machine's cost of the pool-fed index, measured on the traces."""

    us_per_token: float  # CPU to index one ingested token
    entries_per_token: float  # budget cells one new token of text takes
    bytes_per_entry: float  # resident memory per cell

    @property
    def budget_tokens(self) -> float:
        """Tokens of new text the default pool index holds before it starts forgetting."""
        return PoolConfig().index.max_entries / self.entries_per_token


def measure_index(sequences: list[list[int]], vocab_size: int, seed: int = 0) -> IndexCosts:
    """Index the traces, then as much random text (unrelated text shares few n-grams: the
    long tail) again, timing the updates and counting cells and traced memory."""
    rng = random.Random(seed)
    text = [list(sequence) for sequence in sequences]
    text += [[rng.randrange(vocab_size) for _ in range(len(sequence))] for sequence in sequences]
    num_tokens = sum(len(sequence) for sequence in text)
    timed = NGramIndex(PoolConfig().index)
    started = time.perf_counter()
    timed.update_many(text)
    seconds = time.perf_counter() - started
    traced = NGramIndex(PoolConfig().index)  # apart: tracing allocations slows them ~3x
    tracemalloc.start()
    traced.update_many(text)
    memory, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return IndexCosts(1e6 * seconds / num_tokens, timed.num_entries / num_tokens, memory / traced.num_entries)


def tenant_shares(num_tenants: int = TENANTS) -> np.ndarray:
    weights = 1.0 / np.arange(1, num_tenants + 1) ** ZIPF_EXPONENT
    return weights / weights.sum()


@dataclass
class Partition:
    """A routing key's traffic and the replicas that serve it."""

    tenant: int
    share: float  # of the cluster's tokens
    replicas: list[int]
    taken: list[float]  # the share each of them serves

    def same_replica(self) -> float:
        """Chance that two of its requests land on the same replica."""
        return sum((part / self.share) ** 2 for part in self.taken)


def route(shares: list[tuple[int, float]], num_replicas: int, rng: random.Random) -> list[Partition]:
    """Bounded-load consistent hashing: each key's traffic (``(tenant, share)``, shares adding
    up to 1) fills replicas clockwise from a random ring position, a replica taking up to
    ``BOUNDED_LOAD`` times the mean load in all (a replica already full is skipped)."""
    load = np.zeros(num_replicas)
    capacity = BOUNDED_LOAD / num_replicas  # a replica's most share of the cluster's tokens
    partitions = []
    for tenant, share in sorted(shares, key=lambda item: -item[1]):
        start = rng.randrange(num_replicas)
        replicas, taken, left = [], [], share
        for step in range(num_replicas):
            replica = (start + step) % num_replicas
            room = capacity - load[replica]
            if room <= 1e-12:
                continue
            served = min(room, left)
            load[replica] += served
            replicas.append(replica)
            taken.append(served)
            left -= served
            if left <= 1e-12:
                break
        partitions.append(Partition(tenant, share, replicas, taken))
    return partitions


def partitions_for(share: float, num_replicas: int) -> int:
    """Sub-partitions that bring a key of ``share`` of the traffic to about ``SPLIT_REPLICAS``
    replicas' worth each: the rule in docs/api.md for ``pool_partitions`` with the busiest tenant's."""
    return max(1, math.ceil(share * num_replicas / SPLIT_REPLICAS))


def partitions_of(design: str, num_replicas: int, rng: random.Random) -> list[Partition]:
    """The routing keys of ``design`` at ``num_replicas`` replicas and who serves each."""
    shares = tenant_shares()
    if design == "tenant":
        keys = list(enumerate(shares))
    else:  # sub-partitions of about SPLIT_REPLICAS replicas' traffic (the busiest tenant's, for prefix)
        keys = []
        for tenant, share in enumerate(shares):
            num_parts = partitions_for(shares[0] if design == "prefix" else share, num_replicas)
            keys += [(tenant, share / num_parts)] * num_parts
    return route(keys, num_replicas, rng)


@dataclass
class Cell:
    """One (design, replica count): the busiest replica's ingest and what a request keeps."""

    ingest_tokens_per_s: float  # the busiest replica's
    mean_ingest_tokens_per_s: float
    followed_partitions: int  # by the busiest replica
    hit_rate: float  # pool-accepted tokens per request, over the ideal (everything in view, forever)
    retention_s: float  # how long the busiest replica's pool index holds a sequence


def visible(gap_budget_s: float) -> float:
    """Chance that a related sequence is still in an index that holds ``gap_budget_s`` seconds."""
    return 1.0 - math.exp(-gap_budget_s / GAP_S) if math.isfinite(gap_budget_s) else 1.0


def simulate(design: str, num_replicas: int, costs: IndexCosts, values: dict[str, float]) -> Cell:
    """The traffic model and the expected pool-accepted tokens per request for one cell."""
    rng = random.Random(num_replicas)
    cluster = num_replicas * TOKENS_PER_S
    budget = costs.budget_tokens
    own = visible(budget / TOKENS_PER_S)  # the replica index: its own sequences, same budget
    if design in ("full", "sampled"):
        share = 1.0 if design == "full" else SAMPLE_SHARE
        ingest = share * (num_replicas - 1) * TOKENS_PER_S
        retention = budget / ingest if ingest else math.inf
        seen = share * visible(retention)
        same_replica = 1.0 / num_replicas  # routed anywhere: then its own replica index has it
        related = same_replica * own + (1 - same_replica) * seen
        kept = {"repeat": related, "paraphrase": related, "cross_tenant": related, "unrelated": 1.0}
        return Cell(ingest, ingest, 1, _hit_rate(kept, values), retention)
    partitions = partitions_of(design, num_replicas, rng)
    ingest = np.zeros(num_replicas)
    followed = np.zeros(num_replicas, dtype=int)
    for partition in partitions:
        # Each of its replicas ingests what the others serve.
        for replica, served in zip(partition.replicas, partition.taken):
            ingest[replica] += (partition.share - served) * cluster
            followed[replica] += 1
    retention = np.where(ingest > 0, budget / np.maximum(ingest, 1e-9), np.inf)
    by_tenant: dict[int, list[Partition]] = {}
    for partition in partitions:
        by_tenant.setdefault(partition.tenant, []).append(partition)
    kept = {"repeat": 0.0, "paraphrase": 0.0, "cross_tenant": 0.0}
    for tenant, share in enumerate(tenant_shares()):
        parts = by_tenant[tenant]
        # A request's replica: one of its partition's; it sees that partition's sequences
        # (its own in the replica index, the others' in the pool index while retained).
        in_view = np.mean(
            [
                part.same_replica() * own
                + (1 - part.same_replica())
                * sum(
                    served / part.share * visible(retention[r])
                    for r, served in zip(part.replicas, part.taken)
                )
                for part in parts
            ]
        )
        kept["repeat"] += share * in_view
        kept["paraphrase"] += share * in_view / len(parts)  # a rewording lands in any sub-partition
        # Another tenant's sequence: in view only if the replica follows that tenant's
        # partition too (it serves some of that tenant's traffic as well).
        follows = np.mean([followed[r] for part in parts for r in part.replicas]) / len(partitions)
        kept["cross_tenant"] += share * follows * retained(parts[0], retention)
    kept["unrelated"] = 1.0  # generic phrases: any few minutes of text has them
    busiest = int(np.argmax(ingest))
    return Cell(
        float(ingest[busiest]),
        float(ingest.mean()),
        int(followed[busiest]),
        _hit_rate(kept, values),
        float(retention[busiest]),
    )


def retained(partition: Partition, retention: np.ndarray) -> float:
    """Chance that a sequence of ``partition`` is still in the pool index of the replica its
    related request lands on (replicas weighted by the traffic they serve)."""
    return sum(
        served / partition.share * visible(retention[replica])
        for replica, served in zip(partition.replicas, partition.taken)
    )


def _hit_rate(kept: dict[str, float], values: dict[str, float]) -> float:
    """Expected pool-accepted tokens per request, over what it would be with every related
    sequence and every unrelated one in view."""
    expected = sum(KIND_SHARES[kind] * values[kind] * kept[kind] for kind in KIND_SHARES)
    ideal = sum(KIND_SHARES[kind] * values[kind] for kind in KIND_SHARES)
    return expected / ideal


# -------------------------------------------------------------------- part 3: real Redis
async def redis_cell(
    redis: LocalRedis, num_partitions: int, tokens_per_s: float, sequences: list[list[int]]
) -> dict:
    """A replica tailing ``num_partitions`` partitions (one ``PoolSync`` each, one pool index)
    while publishers feed them ``tokens_per_s`` in all (capped): egress, lag, CPU, backlog."""
    rate = min(tokens_per_s, MAX_PUBLISH_TOKENS_PER_S)
    config = PoolConfig(redis_url=redis.url, warm_start_timeout_s=0)
    stamp = time.time_ns()
    names = [f"scale-{stamp}-{part}" for part in range(max(1, num_partitions))]
    index = NGramIndex(config.index)
    ingest_s = 0.0

    def apply(update) -> None:
        nonlocal ingest_s
        started = time.thread_time()
        update()
        ingest_s += time.thread_time() - started

    readers = [PoolSync(open_store(config, name), index, config, "reader", apply) for name in names]
    writers = [open_store(config, name) for name in names]
    for reader in readers:
        await reader.start()
    for writer in writers:
        await writer.connect()
    out_before = redis.net_output_bytes()
    num_published, owed = 0, 0.0
    rng = random.Random(0)
    deadline = time.monotonic() + REDIS_SECONDS
    started = time.monotonic()
    while time.monotonic() < deadline:
        # Every 50 ms, the rate's sequences, each to a random partition, one publish per
        # partition that got any.
        batches: dict[int, list[list[int]]] = {}
        owed += rate * TICK_S  # tokens due, carried over so slow rates are met on average
        while owed > 0:
            sequence = list(sequences[rng.randrange(len(sequences))])
            sequence[0] = rng.randrange(1 << 20)  # distinct, or the pool de-duplicates it
            batches.setdefault(rng.randrange(len(writers)), []).append(sequence)
            owed -= len(sequence)
            num_published += len(sequence)
        for part, batch in batches.items():
            await writers[part].publish(f"writer-{part}", batch)
        await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - started) % TICK_S))
    elapsed = time.monotonic() - started
    await asyncio.sleep(0.5)  # what arrives in the next half second still counts as kept up
    received = sum(reader.counts["learned_tokens"] for reader in readers)
    lags = [reader.stats()["lag_ms_p99"] for reader in readers]
    out_bytes = redis.net_output_bytes() - out_before
    for reader in readers:
        await reader.stop(flush_timeout_s=1.0)
    for writer in writers:
        await writer.close()
    return {
        "partitions": len(names),
        "modelled_tokens_per_s": round(tokens_per_s),
        "published_tokens_per_s": round(num_published / elapsed),
        "ingested_share": round(received / max(1, num_published), 3),
        "egress_bytes_per_token": round(out_bytes / max(1, received), 2),
        "ingest_cpu_share": round(ingest_s / elapsed, 4),
        "sync_lag_ms_p99": max((lag for lag in lags if lag is not None), default=None),
    }


# ------------------------------------------------------------- part 4: the service itself
async def service_cell(redis: LocalRedis, partitions: int, seed: int = 0) -> dict:
    """``SERVICE_REPLICAS`` real ``SharedPools`` (the replicas' pool layer: partition streams,
    followed on first request, replayed, LRU-bounded) on one real Redis, fed requests placed as
    the service places them: ``deployments.routing.routing_key`` on a hash ring, in
    ``deployments.router.bounded_load_order`` (``partitions`` 0: the less loaded of two random
    replicas, Ray's default). ``SERVICE_TENANTS`` Zipf tenants ask ``SERVICE_QUESTIONS``
    questions each; an answer is a fixed random token sequence, published when its request
    ends. A tick places ``SERVICE_ROWS`` requests per replica, then they all end and the pool
    syncs until it has delivered every entry (``settle``). Reported: the tokens each replica ingested from the
    pool, and for requests that repeat an earlier question, whether the replica serving them
    could draft the earlier answer (its replica or pool index proposes it) at placement."""
    rng = random.Random(seed)
    config = PoolConfig(
        redis_url=redis.url,
        partitions=partitions,
        flush_interval_ms=5,
        read_interval_ms=0,
        warm_start_timeout_s=0,
    )
    namespace = f"service-{time.time_ns()}"
    replicas = [SharedPools(config, namespace, origin=f"replica-{i}") for i in range(SERVICE_REPLICAS)]
    for pools in replicas:
        await pools.start()
    ring = sorted(
        (int.from_bytes(hashlib.blake2b(f"replica-{i}:{v}".encode(), digest_size=8).digest(), "big"), i)
        for i in range(SERVICE_REPLICAS)
        for v in range(RING_VNODES)
    )
    weights = tenant_shares(SERVICE_TENANTS)
    answers: dict[tuple[int, int], list[int]] = {}
    answered: set[tuple[int, int]] = set()
    num_repeats = num_hits = num_published = 0
    for _ in range(SERVICE_TICKS):
        load = [0] * SERVICE_REPLICAS
        ending = []
        for _ in range(SERVICE_ROWS * SERVICE_REPLICAS):
            tenant = rng.choices(range(SERVICE_TENANTS), weights)[0]
            question = (tenant, rng.randrange(SERVICE_QUESTIONS))
            user = f"tenant-{tenant}"
            request = GenerateRequest(
                messages=[{"role": "user", "content": f"question {question[1]}"}], user=user
            )
            key = routing_key(request, partitions)
            if key is None:
                pair = rng.sample(range(SERVICE_REPLICAS), 2)
                replica = min(pair, key=load.__getitem__)
            else:
                capacity = load_capacity(sum(load), SERVICE_REPLICAS, BOUNDED_LOAD)
                replica = bounded_load_order(ring_order(ring, key), load.__getitem__, capacity)[0]
            load[replica] += 1
            partition = pool_partition(request, partitions)
            sources = replicas[replica].sources_for(user, partition)
            answer = answers.setdefault(
                question, [rng.randrange(1, 1 << 15) for _ in range(SERVICE_ANSWER_TOKENS)]
            )
            if question in answered:
                num_repeats += 1
                num_hits += any(index.propose(answer[:2], 4)[0] == answer[2:6] for _, index in sources)
            ending.append((replica, user, partition, answer, question))
        for replica, user, partition, answer, question in ending:
            replicas[replica].publish(user, answer, partition)
            if question not in answered:
                num_published += len(answer)
            answered.add(question)
        await settle(replicas)
    stats = [pools.stats() for pools in replicas]
    ingested = [sum(space["learned_tokens"] for space in stat["namespaces"]) for stat in stats]
    for pools in replicas:
        await pools.stop()
    full = num_published * (SERVICE_REPLICAS - 1) / SERVICE_REPLICAS  # what tailing everything ingests
    return {
        "partitions": partitions,
        "published_tokens": num_published,
        "busiest_ingest_share_of_full": round(max(ingested) / full, 3),
        "mean_ingest_share_of_full": round(sum(ingested) / len(ingested) / full, 3),
        "max_followed_partitions": max(stat["num_partitions_followed"] for stat in stats),
        "repeats": num_repeats,
        "repeat_hit_rate": round(num_hits / max(1, num_repeats), 3),
    }


async def settle(replicas: list[SharedPools], timeout_s: float = SERVICE_SETTLE_TIMEOUT_S) -> None:
    """Wait until the pool has delivered: no replica has a publish pending, and every replica
    following a stream has read at least as many entries as all replicas counted as added to it
    (at least: a publish that timed out on a busy host after Redis ran it is retried, and the
    retry's entries count as duplicates, so the stream can hold more than ``published`` says)."""
    deadline = time.monotonic() + timeout_s
    while True:
        syncs = [sync for pools in replicas for sync in pools.stats()["namespaces"]]
        added: dict[str, int] = {}
        for sync in syncs:
            added[sync["namespace"]] = added.get(sync["namespace"], 0) + sync["published"]
        short = [
            sync
            for sync in syncs
            if sync["pending"]
            or sync["received"] + sync["own_skipped"] + sync["malformed"] + sync["foreign"]
            < added[sync["namespace"]]
        ]
        if not short:
            return
        if time.monotonic() > deadline:
            keys = ("namespace", "state", "last_error", "pending", "received", "own_skipped", "published")
            shown = [{key: sync[key] for key in keys} | {"added": added[sync["namespace"]]} for sync in short]
            raise TimeoutError(f"the pool did not deliver within {timeout_s} s: {shown[:4]}")
        await asyncio.sleep(0.02)


def ring_order(ring: list[tuple[int, int]], key: str) -> list[int]:
    """Every replica once, clockwise from ``key``'s point on ``ring`` ((point, replica) sorted)."""
    point = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    start = bisect.bisect_right(ring, (point, -1))
    order: dict[int, None] = {}
    for offset in range(len(ring)):
        order.setdefault(ring[(start + offset) % len(ring)][1])
        if len(order) == SERVICE_REPLICAS:
            break
    return list(order)


# ------------------------------------------------------------------------------ driver
def load_traces() -> tuple[list[dict], list[dict], str]:
    """The replay traces and their reworded twins, paired (long chats have no twin), and the
    model that answered them."""
    recorded = json.loads(TRACES.read_text())
    originals, reworded = recorded["traces"], json.loads(PARAPHRASE_TRACES.read_text())["traces"]
    pairs = [(o, p) for name in reworded for o, p in zip(originals[name], reworded[name])]
    return [o for o, _ in pairs], [p for _, p in pairs], recorded["meta"]["model"]


def run(replica_counts: tuple[int, ...], with_redis: bool) -> dict:
    originals, paraphrases, model = load_traces()
    sequences = [trace["prompt"] + trace["output"] for trace in originals]
    vocab_size = 1 + max(max(sequence) for sequence in sequences)
    costs = measure_index(sequences, vocab_size)
    values = draft_values(originals, paraphrases)
    cells: dict[str, dict[str, dict]] = {}
    redis = LocalRedis().start() if with_redis else None
    try:
        for num_replicas in replica_counts:
            for design in DESIGNS:
                cell = simulate(design, num_replicas, costs, values)
                row = {
                    "ingest_tokens_per_s": round(cell.ingest_tokens_per_s),
                    "mean_ingest_tokens_per_s": round(cell.mean_ingest_tokens_per_s),
                    "ingest_cpu_share": round(cell.ingest_tokens_per_s * costs.us_per_token / 1e6, 4),
                    "egress_bytes_per_s": round(cell.ingest_tokens_per_s * WIRE_BYTES_PER_TOKEN),
                    # What holding ~3 gaps of its ingest takes (95% of related sequences still
                    # in view), or the whole default budget where that is less.
                    "index_bytes": round(
                        min(costs.budget_tokens, 3 * GAP_S * cell.ingest_tokens_per_s)
                        * costs.entries_per_token
                        * costs.bytes_per_entry
                    ),
                    "followed_partitions": cell.followed_partitions,
                    "retention_s": None if math.isinf(cell.retention_s) else round(cell.retention_s, 1),
                    "hit_rate": round(float(cell.hit_rate), 3),
                }
                if redis is not None:
                    row["redis"] = asyncio.run(
                        redis_cell(redis, cell.followed_partitions, cell.ingest_tokens_per_s, sequences)
                    )
                cells.setdefault(str(num_replicas), {})[design] = row
                print(num_replicas, design, row, flush=True)
        if redis is not None:
            rule = partitions_for(tenant_shares(SERVICE_TENANTS)[0], SERVICE_REPLICAS)
            service = [asyncio.run(service_cell(redis, parts)) for parts in sorted({0, 1, rule, 2 * rule})]
            print(service, flush=True)
    finally:
        if redis is not None:
            redis.stop()
    for by_design in cells.values():
        for row in by_design.values():
            row["hit_rate_vs_full"] = round(row["hit_rate"] / by_design["full"]["hit_rate"], 3)
    return {
        "benchmark": "pool_scale",
        "meta": {
            **run_metadata(None, "float32", "benchmarks.pool_scale"),
            "model": f"{model} (recorded greedy traces)",
            "tokens_per_s_per_replica": TOKENS_PER_S,
            "tenants": TENANTS,
            "kind_shares": KIND_SHARES,
            "gap_s": GAP_S,
            "index": {
                "us_per_token": round(costs.us_per_token, 3),
                "entries_per_token": round(costs.entries_per_token, 3),
                "bytes_per_entry": round(costs.bytes_per_entry, 1),
                "budget_tokens": round(costs.budget_tokens),
            },
            "draft_values": {kind: round(value, 2) for kind, value in values.items()},
        },
        "cells": cells,
        **({"service": service} if redis is not None else {}),
    }


def markdown_table(payload: dict) -> str:
    lines = [
        "| replicas | design | ingest tok/s (busiest / mean) | ingest CPU | index MB | retention s "
        "| partitions followed | hit rate (vs ideal / vs full) "
        "| Redis: ingested, egress B/tok, lag p99 ms, ingest CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for num_replicas, by_design in payload["cells"].items():
        for design, row in by_design.items():
            real = row.get("redis")
            redis_cell_text = (
                f"{real['ingested_share']:.0%} of {real['published_tokens_per_s']:,} tok/s, "
                f"{real['egress_bytes_per_token']:.1f}, {real['sync_lag_ms_p99'] or 0:.0f}, "
                f"{real['ingest_cpu_share']:.1%}"
                if real
                else "-"
            )
            retention = "∞" if row["retention_s"] is None else f"{row['retention_s']:,}"
            lines.append(
                f"| {num_replicas} | {design} | {row['ingest_tokens_per_s']:,} / "
                f"{row['mean_ingest_tokens_per_s']:,} | {row['ingest_cpu_share']:.1%} "
                f"| {row['index_bytes'] / 1e6:.0f} | {retention} | {row['followed_partitions']} "
                f"| {row['hit_rate']:.2f} / {row['hit_rate_vs_full']:.2f}x | {redis_cell_text} |"
            )
    if "service" in payload:
        lines += [
            "",
            f"The service's own pool layer and routing ({SERVICE_REPLICAS} replicas, "
            f"{SERVICE_TENANTS} tenants, real `SharedPools` on a real Redis):",
            "",
            "| `pool_partitions` | ingest vs unpartitioned (busiest / mean) | partitions followed (most) "
            "| repeats whose earlier answer the replica could draft |",
            "|---|---|---|---|",
        ]
        unpartitioned = payload["service"][0]["repeat_hit_rate"]
        for row in payload["service"]:
            lines.append(
                f"| {row['partitions']} | {row['busiest_ingest_share_of_full']:.0%} / "
                f"{row['mean_ingest_share_of_full']:.0%} | {row['max_followed_partitions']} "
                f"| {row['repeat_hit_rate']:.0%} "
                f"({row['repeat_hit_rate'] / unpartitioned:.2f}x unpartitioned's) |"
            )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """Each design's hit rate over full replication's, keyed for comparing two runs."""
    return {
        f"{num_replicas}/{design}": row["hit_rate_vs_full"]
        for num_replicas, by_design in payload["cells"].items()
        for design, row in by_design.items()
        if design != "full"
    }


def plot(payload: dict):
    figure, axes = new_figure(2)
    counts = list(payload["cells"])
    for axis, metric, label in zip(
        axes, ("ingest_cpu_share", "hit_rate"), ("busiest replica's ingest CPU (cores)", "pool hit rate")
    ):
        grouped_bars(
            axis,
            [f"{count} replicas" for count in counts],
            {design: [payload["cells"][count][design][metric] for count in counts] for design in DESIGNS},
            label,
        )
        axis.set_title(f"pool at scale: {label}")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--record", action="store_true", help="record the paraphrase traces")
    parser.add_argument("--quick", action="store_true", help="8 and 64 replicas, no real Redis part")
    args = parser.parse_args()
    if args.record:
        PARAPHRASE_TRACES.write_text(json.dumps(record_paraphrases()))
        return
    counts = REPLICA_COUNTS[:2] if args.quick else REPLICA_COUNTS
    payload = run(counts, with_redis=not args.quick and LocalRedis.available())
    publish_run("pool_scale", "float32", args.quick, payload, plot, markdown_table)


if __name__ == "__main__":
    main()
