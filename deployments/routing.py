"""Which pool partition a request reads and feeds, and which session id the ingress routes it
by: keys hashed from its tenant and its conversation's opening, so that every turn of a
conversation, and every repeat of a question, gets the same ones."""

from __future__ import annotations

import hashlib
import json

from deployments.schemas import GenerateRequest

# A completion prompt's opening that picks its pool partition: long enough to tell questions
# apart, short enough that a conversation continued as one growing prompt keeps its partition.
PARTITION_PREFIX_CHARS = 512
PARTITION_PREFIX_IDS = 128
# The session ids of conversation affinity start with this (``deployments.router`` reads it).
CONVERSATION_KEY_PREFIX = "conversation\0"


def conversation_hash(request: GenerateRequest) -> int:
    """A 64-bit hash of the tenant and the conversation's opening: the messages up to the first
    user turn (every later turn of the chat, a Responses continuation of it, and every repeat of
    the question keep it), or a completion prompt's first ``PARTITION_PREFIX_CHARS`` characters
    (ids: ``PARTITION_PREFIX_IDS``)."""
    if request.messages is not None:
        messages = request.messages
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), 0)
        opening = json.dumps([m.get("content") for m in messages[: first_user + 1]])
    elif isinstance(request.prompt, str):
        opening = request.prompt[:PARTITION_PREFIX_CHARS]
    else:
        opening = json.dumps((request.prompt or [])[:PARTITION_PREFIX_IDS])
    # surrogatepass: a lone surrogate (valid JSON, not UTF-8) is a 400 from the replica's
    # prompt check, never a crash here.
    key = f"{request.tenant or ''}\0{opening}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def pool_partition(request: GenerateRequest, partitions: int) -> int:
    """Which of its tenant's ``partitions`` pool partitions ``request`` reads and feeds: by
    ``conversation_hash``. The ingress routes by the same key, so a partition's requests meet
    on a few replicas."""
    if partitions <= 1:  # none, or one per tenant
        return 0
    return conversation_hash(request) % partitions


def placed(request: GenerateRequest, partitions: int) -> GenerateRequest:
    """``request`` with its pool partition set: decided once, by the ingress, which routes by it,
    and read by the replica."""
    return request.model_copy(update={"pool_partition": pool_partition(request, partitions)})


def routing_key(request: GenerateRequest, partitions: int, conversation_affinity: bool = False) -> str | None:
    """The session id the ingress routes a ``placed`` request by: with pool partitions, its tenant
    and partition; else with conversation affinity, its conversation (every turn then goes to the
    replica whose prefix cache holds the earlier ones, while that replica is not overloaded);
    else None (the less loaded of two replicas)."""
    if partitions:
        return f"{request.tenant or ''}\0{request.pool_partition}"
    if conversation_affinity:
        return f"{CONVERSATION_KEY_PREFIX}{conversation_hash(request):016x}"
    return None
