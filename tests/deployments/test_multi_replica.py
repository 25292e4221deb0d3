"""Two replicas sharing a Redis pool, each behind its own application so requests
go to a known replica: what one learns, the other drafts from; a killed replica is replaced."""

from __future__ import annotations

import threading

import openai
import pytest
import ray
import redis
from ray import serve

from deployments.builder import REPLICA_DEPLOYMENT
from nasd_core.config import EMBEDDED_MODEL
from tests.deployments.conftest import ServedApp, wait_for

TURN_1 = [
    {"role": "user", "content": "Write a Python function that returns the sum of the squares of a list."}
]
TURN_TOKENS = 32
POOL_WAIT_S = 15
REPLACE_WAIT_S = 120


@pytest.fixture(scope="module")
def apps(pool_apps):
    return pool_apps.apps


def replica_stats(app: ServedApp) -> dict:
    """The latest stats of the app's replica (a killed one's last report stays listed)."""
    return max(app.request("GET", "/v1/nasd/stats").body["replicas"], key=lambda stats: stats["updated_at"])


def chat(app: ServedApp, messages: list[dict]) -> dict:
    # Speculation on: whether auto's drafts pay depends on the host; what is drafted from where does not.
    body = {"messages": messages, "max_tokens": TURN_TOKENS, "temperature": 0, "speculation": "on"}
    response = app.request("POST", "/v1/chat/completions", body)
    assert response.status == 200, response.body
    return response.body


def test_what_replica_a_finished_replica_b_drafts_from_the_pool(apps):
    a, b = apps["a"], apps["b"]
    on_a = chat(a, TURN_1)
    assert replica_stats(a)["pool"]["backend"] == "redis"
    wait_for(
        lambda: replica_stats(b)["pool"]["namespaces"][0]["index_entries"] > 0,
        POOL_WAIT_S,
        "replica B to learn replica A's answer from the pool",
    )
    # The same turn again (a retry or "regenerate" landing on the other replica): the answer
    # is in no prompt, only in what replica A published. (A next turn would quote the answer in
    # its prompt, and the request's own tokens are drafted from before any shared source.)
    on_b = chat(b, TURN_1)
    assert on_b["choices"][0]["message"]["content"] == on_a["choices"][0]["message"]["content"]
    assert on_b["nasd"]["accepted_by_source"].get("pool", 0) > 0, on_b["nasd"]
    assert on_b["nasd"]["tokens_per_step"] > on_a["nasd"]["tokens_per_step"]
    stats = replica_stats(b)
    assert stats["spec"]["accepted_by_source"]["pool"] >= on_b["nasd"]["accepted_by_source"]["pool"]


def test_a_killed_replicas_unanswered_requests_are_retried_and_it_is_replaced_warm(apps):
    """SIGKILL the replica under a whole answer and a stream: the whole one, of which the client
    had nothing, is sent again and answered by the replacement; the stream, which had sent
    tokens, ends with an error event and [DONE], never a hang."""
    a = apps["a"]
    old_id = replica_stats(a)["replica_id"]
    # Serve names a replica's actor after its app, deployment and replica id.
    (actor,) = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].endswith(old_id) and f"{REPLICA_DEPLOYMENT}" in actor["name"]
    ]
    responses: dict = {}
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0}
    streaming = threading.Event()

    def whole() -> None:
        responses["whole"] = a.request("POST", "/v1/completions", body)

    def stream() -> None:
        pieces, error = [], None
        try:
            for piece in a.client().completions.create(model=EMBEDDED_MODEL, stream=True, **body):
                pieces.append(piece)
                streaming.set()
        except openai.APIError as exc:  # the SDK raises on an error event
            error = exc
        responses["stream"] = pieces, error

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    for thread in threads:
        thread.start()
    assert streaming.wait(60), "the stream sent nothing"
    wait_for(lambda: replica_stats(a)["num_running"] == 2, 30, "both requests to run")
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for thread in threads:
        thread.join(REPLACE_WAIT_S)
    answered = responses["whole"]
    assert answered.status == 200 and answered.body["choices"][0]["text"], answered.body
    pieces, error = responses["stream"]
    assert pieces and error is not None and "failed" in str(error), (len(pieces), error)

    def replaced_and_serving() -> bool:
        status = serve.status().applications["a"].deployments[REPLICA_DEPLOYMENT].status
        if status != "HEALTHY":
            return False
        response = a.request(
            "POST", "/v1/completions", {"model": EMBEDDED_MODEL, "prompt": "Hi", "max_tokens": 4}
        )
        return response.status == 200

    wait_for(replaced_and_serving, REPLACE_WAIT_S, "Serve to replace the killed replica")
    new = replica_stats(a)
    assert new["replica_id"] != old_id
    # The newcomer replayed the pool at start: it begins warm with what the others finished.
    assert new["pool"]["namespaces"][0]["index_entries"] > 0


def test_a_response_stored_through_one_app_is_continued_through_the_other(apps, pool_apps):
    """The apps share their Redis namespace, so their ingresses share the Responses store: an id
    made through A is read and continued through B (its own ingress and replica)."""
    a, b = apps["a"], apps["b"]
    settings = {
        "model": EMBEDDED_MODEL,
        "temperature": 0,
        "max_output_tokens": TURN_TOKENS,
        "extra_body": {"speculation": "on"},  # as chat() sends
    }
    first = a.client().responses.create(input=TURN_1[0]["content"], **settings)
    follow_up = "Now write its docstring."
    second = b.client().responses.create(previous_response_id=first.id, input=follow_up, **settings)
    history = [
        *TURN_1,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow_up},
    ]
    assert second.output_text == chat(b, history)["choices"][0]["message"]["content"]
    assert b.client().responses.retrieve(first.id).output_text == first.output_text
    stored = f"nasd:{{{pool_apps.shared_namespace}}}:responses:*"
    keys = redis.Redis.from_url(pool_apps.redis_url).keys(stored)
    assert len(keys) >= 3  # the two responses and the index
