"""Pool partitions through the real service: two replicas on a Redis pool with
``pool_partitions``; requests are routed by partition and each replica tails only the
partitions of the requests it served."""

from __future__ import annotations

import pytest
import redis

from deployments.routing import pool_partition
from deployments.schemas import GenerateRequest
from nasd_core.config import EMBEDDED_MODEL
from pool_service.redis_pool import pool_keys
from pool_service.shared import partition_namespace
from tests.deployments.conftest import POOL_PARTITIONS, wait_for

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What does HTTP stand for?",
    "Give me a synonym for happy.",
]


@pytest.fixture(scope="module")
def app(pool_apps):
    return pool_apps.apps["p"], pool_apps.partitioned_namespace, pool_apps.redis_url


def test_requests_meet_their_partition_on_one_replica(app):
    served, namespace, redis_url = app
    client = served.client()
    answers: dict[str, list[str]] = {}
    for question in QUESTIONS * 2:  # each question twice: a repeat follows its partition
        messages = [{"role": "user", "content": question}]
        response = client.chat.completions.create(
            model=EMBEDDED_MODEL, messages=messages, max_tokens=8, temperature=0
        )
        answers.setdefault(question, []).append(response.choices[0].message.content)
    # Greedy and exact: the repeat (drafted from the first answer) says the same.
    assert all(first == again for first, again in answers.values())
    replicas = served.request("GET", "/v1/nasd/stats").body["replicas"]
    assert sum(stats["num_requests"] for stats in replicas) == 2 * len(QUESTIONS)
    streams = {
        stats["replica_id"]: {space["namespace"] for space in stats["pool"]["namespaces"]}
        for stats in replicas
    }
    partitions = {
        pool_partition(GenerateRequest(messages=[{"role": "user", "content": q}]), POOL_PARTITIONS)
        for q in QUESTIONS
    }
    # Every followed stream of every replica (one that served nothing, listed because a stats
    # call reached it, follows none); the model's namespace is read off their names.
    followed = [name for names in streams.values() for name in names]
    model_namespace = followed[0].rsplit("/part-", 1)[0]
    assert model_namespace.startswith(namespace)
    expected = {partition_namespace(model_namespace, None, part) for part in partitions}
    # Every request's partition is tailed, by exactly one replica (sequential requests never
    # load a replica past the bound), and nothing else is.
    assert sorted(followed) == sorted(expected)
    # Each answer was published to its partition's stream, and only there (a replica's publisher
    # flushes in the background, and one stream entry may carry several sequences).
    client_redis = redis.Redis.from_url(redis_url)

    def num_sequences(name: str) -> int:
        entries = client_redis.xrange(pool_keys(name)["seqs"])
        return sum(len(fields[b"l"].split(b",")) for _, fields in entries)

    wait_for(
        lambda: sum(num_sequences(name) for name in expected) >= len(QUESTIONS),
        30,
        "every answer in its partition's stream",
    )
    assert client_redis.xlen(pool_keys(model_namespace)["seqs"]) == 0


def test_a_lone_surrogate_in_a_prompt_or_user_is_a_400_not_a_crash_of_the_partition_hash(app):
    """Partitions hash the prompt's opening and the user: text JSON allows and UTF-8 does not."""
    served, _, _ = app
    for body, param in (
        ({"model": EMBEDDED_MODEL, "prompt": "\ud800 hello", "max_tokens": 2}, "prompt"),
        ({"model": EMBEDDED_MODEL, "prompt": "hello", "user": "\udfff", "max_tokens": 2}, "user"),
    ):
        response = served.request("POST", "/v1/completions", body)
        assert response.status == 400 and response.body["error"]["param"] == param, response.body
    assert served.client().completions.create(model=EMBEDDED_MODEL, prompt="hello", max_tokens=2).choices
