"""Routing by pool partition, without a cluster: which partition a request belongs to, and the
bounded-load order the router walks the hash ring in."""

from __future__ import annotations

import collections

from deployments.router import bounded_load_order, conversation_order, load_capacity
from deployments.routing import CONVERSATION_KEY_PREFIX, PARTITION_PREFIX_CHARS, placed, pool_partition
from deployments.routing import routing_key as placed_routing_key
from deployments.schemas import GenerateRequest

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def chat(*turns: str, tenant: str | None = None) -> GenerateRequest:
    roles = ["user", "assistant"] * len(turns)
    messages = [SYSTEM] + [{"role": role, "content": turn} for role, turn in zip(roles, turns)]
    return GenerateRequest(messages=messages, tenant=tenant)


def routing_key(request: GenerateRequest, partitions: int, conversation_affinity: bool = False) -> str | None:
    """The session id the ingress gives ``request``: its partition placed, then its key."""
    return placed_routing_key(placed(request, partitions), partitions, conversation_affinity)


def test_the_replica_reads_the_partition_the_ingress_routed_by():
    request = placed(chat("How do I reverse a list in Python?", tenant="t"), 64)
    assert request.pool_partition == pool_partition(request, 64)
    assert placed_routing_key(request, 64) == f"t\0{request.pool_partition}"
    assert GenerateRequest.model_validate(request.model_dump()).pool_partition == request.pool_partition


def test_every_turn_of_a_conversation_keeps_its_partition():
    first = chat("How do I reverse a list in Python?")
    later = chat("How do I reverse a list in Python?", "Use reversed() or slicing.", "And a string?")
    assert pool_partition(first, 64) == pool_partition(later, 64)
    assert routing_key(first, 64) == routing_key(later, 64)


def test_the_tenant_routes_and_the_user_label_does_not():
    request = chat("What is 2 squared?", tenant="t")
    labelled = [request.model_copy(update={"user": f"user-{i}"}) for i in range(5)]
    assert {routing_key(other, 8) for other in labelled} == {routing_key(request, 8)}


def test_partitions_spread_questions_and_tenants():
    questions = [chat(f"Question number {i}: what is {i} squared?") for i in range(400)]
    counts = collections.Counter(pool_partition(question, 8) for question in questions)
    assert sorted(counts) == list(range(8))
    assert max(counts.values()) < 2 * 400 / 8  # about even
    # The same question from two tenants: its partition is drawn for each, and so is its route.
    keys = {routing_key(chat("What is 2 squared?", tenant=f"tenant-{i}"), 8) for i in range(20)}
    assert len(keys) > 4


def test_completion_prompts_are_placed_by_their_opening():
    shared_opening = "x" * PARTITION_PREFIX_CHARS
    one, two = (GenerateRequest(prompt=shared_opening + end) for end in ("one", "two"))
    assert pool_partition(one, 16) == pool_partition(two, 16)
    ids = [pool_partition(GenerateRequest(prompt=[i, 1, 2, 3]), 16) for i in range(64)]
    assert len(set(ids)) > 4


def test_without_partitions_nothing_is_routed_and_one_partition_routes_by_tenant():
    request = chat("Hello")
    assert pool_partition(request, 0) == 0 and routing_key(request, 0) is None
    keys = {routing_key(chat(f"Question {i}", tenant=tenant), 1) for i in range(10) for tenant in ("a", "b")}
    assert keys == {"a\x000", "b\x000"}


def test_with_affinity_every_turn_of_a_conversation_has_one_key_and_conversations_differ():
    turns = [
        chat("Fix the bug in parse()."),
        chat("Fix the bug in parse().", "Here is a fix.", "Now add a test."),
        chat("Fix the bug in parse().", "Here is a fix.", "Now add a test.", "Done.", "Thanks!"),
    ]
    keys = {routing_key(turn, 0, conversation_affinity=True) for turn in turns}
    assert len(keys) == 1 and None not in keys
    others = {routing_key(chat(f"Question {i}"), 0, conversation_affinity=True) for i in range(50)}
    assert len(others) == 50
    # Pool partitions route by partition (a conversation's partition is drawn from the same opening).
    assert routing_key(turns[0], 8, conversation_affinity=True) == routing_key(turns[0], 8)
    # A tenant's conversation is its own, whatever the text.
    assert routing_key(chat("Hi", tenant="a"), 0, True) != routing_key(chat("Hi", tenant="b"), 0, True)


def test_a_conversations_key_is_the_one_the_router_places():
    assert routing_key(chat("Hi"), 0, conversation_affinity=True).startswith(CONVERSATION_KEY_PREFIX)
    assert not routing_key(chat("Hi", tenant="t"), 8).startswith(CONVERSATION_KEY_PREFIX)


def test_new_conversations_spread_and_each_stays_on_its_replica_under_the_bound():
    replicas = ["r0", "r1", "r2", "r3"]
    load = dict.fromkeys(replicas, 0)
    owned: collections.Counter = collections.Counter()
    owners = {}
    # 16 conversations arriving 4 at a time (as benchmarks.agent_cluster runs them): each goes
    # to an idle replica, the one with the fewest conversations first.
    for wave in range(4):
        for index in range(4):
            conversation = 4 * wave + index
            first = conversation_order(
                replicas, None, load.get, lambda r: owned[r], load_capacity(sum(load.values()), 4, 1.25)
            )[0]
            owners[conversation], load[first] = first, load[first] + 1
            owned[first] += 1
        load = dict.fromkeys(replicas, 0)  # the wave's turns end
    assert sorted(owned.values()) == [4, 4, 4, 4]
    # A later turn goes to its owner, unless the owner is at the bound.
    assert conversation_order(replicas, "r2", load.get, lambda r: owned[r], 2)[0] == "r2"
    busy = {**load, "r2": 2}
    assert conversation_order(replicas, "r2", busy.get, lambda r: owned[r], 2)[0] != "r2"


def order(ring: list[str], load: dict[str, int]) -> list[str]:
    """The bounded order of the whole ``ring`` at the router's default bound."""
    return bounded_load_order(ring, load.get, load_capacity(sum(load.values()), len(ring), 1.25))


def test_bounded_load_keeps_the_owner_until_it_is_over_the_bound():
    ring = ["owner", "next", "after"]
    load = dict.fromkeys(ring, 0)
    assert order(ring, load) == ring  # idle: the key's owner
    load.update(owner=2, next=1, after=1)  # capacity ceil(1.25 * 5 / 3) = 3: owner still fits
    assert order(ring, load) == ring
    load.update(owner=4)  # capacity ceil(1.25 * 7 / 3) = 3: the owner is full, its successor next
    assert order(ring, load) == ["next", "after", "owner"]
    ring.append("last")
    load.update(owner=5, next=5, after=0, last=0)  # ceil(1.25 * 11 / 4) = 4: two full, behind, in ring order
    assert order(ring, load) == ["after", "last", "owner", "next"]


def test_capacity_is_the_whole_clusters_mean_not_the_walked_replicas():
    """The router ranks only a few ring successors; capacity comes from every replica's load,
    so a key whose few successors are all busy still spills while the cluster is idle."""
    capacity = load_capacity(total_load=4, num_replicas=16, bound=1.25)  # ceil(1.25 * 5 / 16) = 1
    walked = {"owner": 2, "next": 2, "after": 0}
    assert bounded_load_order(list(walked), walked.get, capacity) == ["after", "owner", "next"]


def test_placing_a_hot_key_never_loads_a_replica_past_the_bound():
    """One key's requests placed one by one (none finishing): the bounded order fills the ring
    from the key's owner, no replica above ceil(bound x mean load); without the bound the owner
    would take them all."""
    ring = [f"replica-{i}" for i in range(8)]
    load = dict.fromkeys(ring, 0)
    for num_placed in range(1, 201):
        chosen = order(ring, load)[0]
        load[chosen] += 1
        assert max(load.values()) <= -(-1.25 * num_placed // len(ring)), (num_placed, load)
    # Filled along the ring from the owner: the owner holds the most, a later replica none yet.
    assert load[ring[0]] == max(load.values()) and load[ring[1]] > 0 and load[ring[-1]] == 0
