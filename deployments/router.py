"""Routing by pool partition (consistent hashing with bounded loads over Ray Serve's own ring),
and by conversation (each conversation placed on a replica, ``ConversationRouter``).

With pool partitions (``PoolConfig.partitions`` >= 1) the ingress sends each request with its
tenant and partition as the session id. Ray's ``ConsistentHashRouter`` sends a session to the replica
that owns it on a hash ring and moves on only when that replica refuses the request (its
``max_ongoing_requests``, here the engine's whole batch and queue, is full), so a hot partition
could fill one replica's queue while others idle. This router keeps Ray's ring and takes
its ring order, but passes over replicas already above ``load_bound`` times the mean load
(Mirrokni et al., "Consistent Hashing with Bounded Loads"): a partition stays on its replica
while that replica is not overloaded and spills to its ring successors, in the same order
from every ingress, when it is (docs/results.md, the shared pool at cluster scale).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

from deployments.routing import CONVERSATION_KEY_PREFIX

# A replica takes at most this many times the mean load before its partitions spill over
# (the simulation's BOUNDED_LOAD): 1.25 keeps queues within a quarter of each other while a
# partition's traffic stays on one or two replicas.
DEFAULT_LOAD_BOUND = 1.25
# Ring successors ranked after a key's owner. The bound decides among them; a longer walk costs
# the ingress a pass over the ring per request (51,200 virtual nodes at 512 replicas), while a
# partition sized by the rule in docs/api.md spills over two or three replicas.
DEFAULT_FALLBACK_REPLICAS = 8
ROUTER_CLASS = f"{__name__}.ConversationRouter"
# Conversations whose replica a router remembers (least recently used forgotten first).
MAX_PLACED_CONVERSATIONS = 65_536

Replica = TypeVar("Replica")


def load_capacity(total_load: int, num_replicas: int, bound: float) -> int:
    """The most requests a replica may hold before keys spill past it: ``bound`` times the mean
    load over every replica, counting the request about to be placed (so an idle cluster's
    first request goes to its key's owner)."""
    return math.ceil(bound * (total_load + 1) / max(1, num_replicas))


def bounded_load_order(
    ring_order: Sequence[Replica], load: Callable[[Replica], int], capacity: int
) -> list[Replica]:
    """``ring_order`` (the key's owner first, then its ring successors) with the replicas at or
    above ``capacity`` moved behind the others, each group in ring order."""
    loads = [load(replica) for replica in ring_order]
    under = [replica for replica, num in zip(ring_order, loads) if num < capacity]
    return under + [replica for replica, num in zip(ring_order, loads) if num >= capacity]


def conversation_order(
    replicas: Sequence[Replica],
    owner: Replica | None,
    load: Callable[[Replica], int],
    owned: Callable[[Replica], int],
    capacity: int,
) -> list[Replica]:
    """The order to try ``replicas`` in for a conversation's request. One it was placed on
    (``owner``, still serving) comes first unless it is at ``capacity``; a new one goes to the
    least loaded replica, ties to the one that holds the fewest conversations (``owned``), then
    in the given order."""
    if owner is not None:  # the others least loaded first: a spilled turn goes where it waits least
        others = sorted((r for r in replicas if r != owner), key=load)
        return bounded_load_order([owner, *others], load, capacity)
    return sorted(replicas, key=lambda replica: (load(replica) >= capacity, load(replica), owned(replica)))


class BoundedLoadHashRouter(ConsistentHashRouter):
    """Ray's consistent-hash router with bounded loads (``request_router_kwargs``:
    ``load_bound``, default ``DEFAULT_LOAD_BOUND``; Ray's ``num_virtual_nodes`` and
    ``num_fallback_replicas``, default here ``DEFAULT_FALLBACK_REPLICAS``). The load of a
    replica is Ray's count of this router's requests ongoing there."""

    def initialize_state(self, **kwargs) -> None:
        self._load_bound = float(kwargs.pop("load_bound", DEFAULT_LOAD_BOUND))
        if self._load_bound < 1:
            raise ValueError(f"load_bound must be >= 1, got {self._load_bound!r}")
        kwargs.setdefault("num_fallback_replicas", DEFAULT_FALLBACK_REPLICAS)
        super().initialize_state(**kwargs)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        if len(ranks) <= 1 or any(len(rank) != 1 for rank in ranks):  # no key: Ray's own fallback
            return ranks
        total = sum(self._load(replica_id) for replica_id in self._replicas)
        capacity = load_capacity(total, len(self._replicas), self._load_bound)
        return bounded_load_order(ranks, lambda rank: self._load(rank[0].replica_id), capacity)

    def _load(self, replica_id) -> int:
        """The requests Ray last counted ongoing at ``replica_id`` (0 when it has no count)."""
        return self.replica_queue_len_cache.get(replica_id) or 0


class ConversationRouter(BoundedLoadHashRouter):
    """``BoundedLoadHashRouter`` for partition keys; conversations (``CONVERSATION_KEY_PREFIX``)
    are placed instead. A conversation's first request goes to the least loaded replica (ties to
    the one holding the fewest conversations), and its later ones to that replica while it is
    under the load bound (``conversation_order``). On a hash ring, 16 conversations on 4 replicas
    put 6 on one of them (``benchmarks/agent_cluster.py``). The placements live in this router,
    one per ingress replica: a conversation another ingress placed is placed again here."""

    def initialize_state(self, **kwargs) -> None:
        self._owners: OrderedDict[str, object] = OrderedDict()  # key -> ReplicaID
        self._owned: Counter = Counter()  # ReplicaID -> conversations placed on it
        # First requests not yet accepted by their replica: a subset of the placed keys (where Ray
        # never calls on_request_routed, a key leaves with its placement or its next turn).
        self._unconfirmed: set[str] = set()
        super().initialize_state(**kwargs)

    def _place(self, key: str, replica_id) -> None:
        previous = self._owners.pop(key, None)
        if previous is not None:
            self._owned[previous] -= 1
        self._owners[key] = replica_id
        self._owned[replica_id] += 1
        while len(self._owners) > MAX_PLACED_CONVERSATIONS:
            forgotten_key, forgotten = self._owners.popitem(last=False)
            self._owned[forgotten] -= 1
            self._unconfirmed.discard(forgotten_key)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = self._routing_key(pending_request)
        if not candidate_replicas or key is None or not key.startswith(CONVERSATION_KEY_PREFIX):
            return await super().choose_replicas(candidate_replicas, pending_request)
        pending_request.routing_context.should_backoff = True
        loads = {replica.replica_id: self._load(replica.replica_id) for replica in candidate_replicas}
        capacity = load_capacity(sum(loads.values()), len(candidate_replicas), self._load_bound)
        owner_id = self._owners.get(key)
        owner = next((r for r in candidate_replicas if r.replica_id == owner_id), None)
        order = conversation_order(
            candidate_replicas,
            owner,
            lambda replica: loads[replica.replica_id],
            lambda replica: self._owned[replica.replica_id],
            capacity,
        )
        if owner is None:
            self._place(key, order[0].replica_id)
            self._unconfirmed.add(key)
        else:  # a later turn: the first was placed, confirmed or not
            self._owners.move_to_end(key)
            self._unconfirmed.discard(key)
        return [[replica] for replica in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """A conversation's first request lives where a replica accepted it (Ray calls this when
        it probes replicas' queues; where it does not, the first choice stands)."""
        key = self._routing_key(pending_request)
        if key in self._unconfirmed:
            self._unconfirmed.discard(key)
            if self._owners.get(key) != replica_id:
                self._place(key, replica_id)
