"""API keys and tenants (``deployments/auth.py``): the key file and limits on their own, then
through the real service with the openai client: 401s, the key's tenant as the isolation
boundary whatever ``user`` a request sends (keys imply isolation), each tenant seeing its own
counters, 429s with Retry-After, rows and reserved tokens that hold under concurrency, dropped
streams counted, and a key rotated in the file taking effect without a restart."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

import openai
import pytest

from deployments.auth import (
    RELOAD_CHECK_INTERVAL_S,
    RELOAD_SETTLE_S,
    Admission,
    ApiKeys,
    KeyFileError,
    KeyLimiter,
    KeyLimits,
    Rejection,
    parse_keys,
)
from deployments.builder import AppArgs, tenant_isolation
from nasd_core.config import EMBEDDED_MODEL
from tests.deployments.conftest import wait_for, wait_for_samples

KEYS = {
    "alice": "sk-test-alice-0123456789",
    "bob": "sk-test-bob-9876543210",
    "one": "sk-test-one-in-flight",
    "tpm": "sk-test-tokens-per-minute",
    "two": "sk-test-two-rows-in-flight",
    "budget": "sk-test-token-budget",
    "ops": "sk-test-operator-admin",
}
TOKENS_PER_MINUTE = 60
BUDGET_TOKENS = 100
# Past the reload check interval and the settle time of a changed key file.
RELOAD_WAIT_S = RELOAD_CHECK_INTERVAL_S + RELOAD_SETTLE_S + 0.2
# How far ahead a key file being written is dated (test_a_key_file_edited_in_place_...).
UNSETTLED_AHEAD_S = 30 * RELOAD_SETTLE_S
QUESTION = [{"role": "user", "content": "List the first eight planets of the solar system, in order."}]


def key_file_text(keys: dict[str, str]) -> str:
    return (
        "# test keys\n"
        f"{keys['alice']} alice\n"
        f"{keys['bob']} bob   # a comment\n"
        f"{keys['one']} one max_in_flight=1\n"
        f"\n{keys['tpm']} tpm tokens_per_minute={TOKENS_PER_MINUTE}\n"
        f"{keys['two']} two max_in_flight=2\n"
        f"{keys['budget']} budget tokens_per_minute={BUDGET_TOKENS}\n"
        f"{keys['ops']} ops admin\n"
    )


def write_atomically(path, text: str) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)


# ------------------------------------------------------------------ without a server
def test_key_file_lines_give_tenants_and_limits():
    keys = parse_keys(key_file_text(KEYS), KeyLimits(max_in_flight=5))
    by_tenant = {key.tenant: key for key in keys.values()}
    assert set(by_tenant) == {"alice", "bob", "one", "tpm", "two", "budget", "ops"}
    assert by_tenant["ops"].admin and not by_tenant["alice"].admin
    assert by_tenant["alice"].limits == KeyLimits(max_in_flight=5)  # the defaults
    assert by_tenant["one"].limits.max_in_flight == 1
    assert by_tenant["tpm"].limits == KeyLimits(5, TOKENS_PER_MINUTE)


@pytest.mark.parametrize(
    "line",
    [
        "sk-only-a-key",
        "sk-x bad/tenant",
        "sk-x t max_in_flight=0",
        "sk-x t speed=3",
        "sk-x t\nsk-x u",
        # "²".isdigit() is true and int("²") raises: a parse error, not a crash of every reload.
        "sk-x t max_in_flight=\u00b2",
        "sk-x t tokens_per_minute=\u0663",
    ],
)
def test_a_bad_key_file_line_is_named_by_number_never_by_key(line):
    with pytest.raises(KeyFileError) as error:
        parse_keys(line, KeyLimits())
    assert "line" in str(error.value) and "sk-x" not in str(error.value) and "sk-only" not in str(error.value)


def test_keys_are_found_by_value_and_a_changed_file_is_read_again(tmp_path):
    path = tmp_path / "keys"
    path.write_text(key_file_text(KEYS))
    keys = ApiKeys("sk-single", str(path))
    assert keys.find("sk-single").tenant == "default"
    assert keys.find(KEYS["bob"]).tenant == "bob"
    assert keys.find("sk-test-bob") is None and keys.find("") is None
    write_atomically(path, "sk-rotated bob\n")
    time.sleep(RELOAD_WAIT_S)
    assert keys.find(KEYS["bob"]) is None and keys.find("sk-rotated").tenant == "bob"
    write_atomically(path, f"not a valid file\n{KEYS['alice']} alice max_in_flight=\u00b2\n")
    time.sleep(RELOAD_WAIT_S)
    assert keys.find("sk-rotated").tenant == "bob", "a bad file must keep the keys read before"
    assert keys.num_reload_errors == 1 and "line 1" in keys.last_error and keys.num_reloads == 2


def test_a_key_file_edited_in_place_never_revokes_its_keys_while_it_is_written(tmp_path):
    path = tmp_path / "keys"
    path.write_text(key_file_text(KEYS))
    keys = ApiKeys(None, str(path))

    def touched(seconds_from_now: float) -> None:
        at = time.time() + seconds_from_now
        os.utime(path, (at, at))

    # An editor's save: truncate, then write the new text in pieces, each check of the file (one
    # per interval) seeing a version still being written. Its time is set ahead so that no stall
    # of this process shorter than UNSETTLED_AHEAD_S makes a piece look settled (pieces of a real
    # save land within milliseconds of each other).
    text = key_file_text({**KEYS, "bob": "sk-test-bob-new"})
    pieces = [text[start : start + 40] for start in range(0, len(text), 40)]
    with open(path, "w") as file:
        for piece in ["", *pieces]:  # the empty file first
            file.write(piece)
            file.flush()
            touched(UNSETTLED_AHEAD_S)
            time.sleep(RELOAD_CHECK_INTERVAL_S)
            assert keys.find(KEYS["alice"]) is not None, "a key was revoked mid-write"
            assert keys.find(KEYS["bob"]) is not None, "the edit was read before it settled"
    touched(-RELOAD_SETTLE_S)
    time.sleep(RELOAD_CHECK_INTERVAL_S)
    assert keys.find(KEYS["bob"]) is None and keys.find("sk-test-bob-new").tenant == "bob"


def test_a_missing_key_file_refuses_to_start_an_open_server(tmp_path):
    with pytest.raises(FileNotFoundError):
        ApiKeys(None, str(tmp_path / "absent"))


def test_limits_count_rows_in_flight_and_tokens_used_or_reserved_per_minute():
    keys = parse_keys(key_file_text(KEYS), KeyLimits())
    one, tpm, two = (
        next(key for key in keys.values() if key.tenant == name) for name in ("one", "tpm", "two")
    )
    limiter = KeyLimiter()
    first = limiter.admit(one, now=0.0)
    assert isinstance(first, Admission)
    rejection = limiter.admit(one, now=0.0)
    assert isinstance(rejection, Rejection) and rejection.kind == "requests" and rejection.retry_after_s >= 1
    limiter.finish(first, 0, 0)
    assert isinstance(limiter.admit(one, now=0.0), Admission)
    # Rows, not requests: 3 rows never fit 2, 2 do, and then not one more.
    assert isinstance(limiter.admit(two, rows=3, now=0.0), Rejection)
    pair = limiter.admit(two, rows=2, now=0.0)
    assert isinstance(pair, Admission) and isinstance(limiter.admit(two, now=0.0), Rejection)
    limiter.finish(pair, 0, 0)
    # Reserved tokens count before they are used; what was not used is given back.
    held = limiter.admit(tpm, reserve_tokens=50, now=0.0)
    assert isinstance(held, Admission)
    assert isinstance(limiter.admit(tpm, reserve_tokens=20, now=0.0), Rejection)
    limiter.finish(held, 20, 10, now=5.0)  # used 30 of the 50 it reserved
    assert isinstance(limiter.admit(tpm, reserve_tokens=30, now=6.0), Admission)
    assert limiter.reserved[tpm.key_id] == 30
    limiter.record_tokens(tpm, 40, 25, now=10.0)  # 30 + 65 used, 30 reserved, of 60
    rejection = limiter.admit(tpm, now=20.0)
    assert isinstance(rejection, Rejection) and rejection.kind == "tokens" and rejection.retry_after_s == 50
    counters = limiter.snapshot()["tenants"]
    assert counters["one"]["rejected_requests"] == 1 and counters["tpm"]["rejected_tokens"] == 2
    assert counters["tpm"]["prompt_tokens"] == 60 and counters["tpm"]["completion_tokens"] == 35
    assert set(limiter.snapshot("tpm")["tenants"]) == {"tpm"} and "unauthorized" not in limiter.snapshot(
        "tpm"
    )


def test_keys_imply_tenant_isolation_and_an_explicit_opt_out_is_logged(caplog):
    assert tenant_isolation(AppArgs(api_key="sk-x")) and tenant_isolation(AppArgs(api_keys_file="keys"))
    assert not tenant_isolation(AppArgs()) and tenant_isolation(AppArgs(tenant_isolation=True))
    with caplog.at_level(logging.WARNING):
        assert not tenant_isolation(AppArgs(api_key="sk-x", tenant_isolation=False))
    assert "tenant_isolation is off with API keys" in caplog.text


# ------------------------------------------------------------------ through the service
@pytest.fixture(scope="module")
def keyed(tmp_path_factory, serve_session):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(key_file_text(KEYS))
    # No tenant_isolation: keys imply it.
    args = {"num_cpus_per_replica": 2, "api_keys_file": str(path)}
    return serve_session.deploy({"keyed": args})["keyed"], path


def ask(client: openai.OpenAI, user: str | None = None, max_tokens: int = 24, **extra):
    return client.chat.completions.create(
        model=EMBEDDED_MODEL,
        messages=QUESTION,
        max_tokens=max_tokens,
        temperature=0,
        user=user if user is not None else openai.NOT_GIVEN,
        extra_body={"speculation": "on", **extra},
    )


def test_no_key_and_a_wrong_key_get_401_the_right_key_200_and_health_is_open(keyed):
    served, _ = keyed
    for wrong in ("unused", KEYS["alice"] + "x"):
        with pytest.raises(openai.AuthenticationError) as error:
            ask(served.client(wrong))
        assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    missing = served.request("POST", "/v1/chat/completions", {"model": EMBEDDED_MODEL, "messages": QUESTION})
    assert missing.status == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.body["error"]["type"] == "invalid_request_error"
    assert ask(served.client(KEYS["alice"])).choices[0].message.content
    assert served.request("GET", "/health").status == 200


def test_every_route_but_health_needs_a_key(keyed):
    served, _ = keyed
    authorized = {"Authorization": f"Bearer {KEYS['bob']}"}
    spec = served.request("GET", "/openapi.json", headers=authorized)
    assert spec.status == 200 and served.request("GET", "/openapi.json").status == 401
    routes = [(method.upper(), path) for path, item in spec.body["paths"].items() for method in item]
    assert len(routes) >= 9
    for method, path in routes:
        response = served.request(
            method, path.replace("{model_id}", EMBEDDED_MODEL), {} if method == "POST" else None
        )
        expected = 200 if path == "/health" else 401
        assert response.status == expected, f"{method} {path}: {response.status}"
    assert served.request("GET", "/v1/models", headers=authorized).status == 200


def test_a_tenant_drafts_nothing_from_another_tenants_answer_whatever_user_it_sends(keyed):
    served, _ = keyed
    alice, bob = served.client(KEYS["alice"]), served.client(KEYS["bob"])
    first = ask(alice, user="alice", max_tokens=32)
    # bob claims to be alice: the key, not the label, is the tenant.
    other = ask(bob, user="alice", max_tokens=32)
    again = ask(alice, user="someone-else", max_tokens=32)
    answer = first.choices[0].message.content
    assert other.choices[0].message.content == answer == again.choices[0].message.content
    shared_sources = {"replica", "pool"}

    def from_shared(response) -> int:
        return sum(
            response.model_extra["nasd"]["accepted_by_source"].get(source, 0) for source in shared_sources
        )

    assert from_shared(other) == 0, "bob drafted from alice's answer"
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "bob reused alice's prefix blocks"
    # The same request from alice's own key does draft from her first answer and reuse her prefix:
    # what bob was denied is there to take.
    assert from_shared(again) > 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_limits_answer_429_with_retry_after_and_nothing_else_breaks(keyed):
    served, _ = keyed
    one = served.client(KEYS["one"])
    stream = one.chat.completions.create(
        model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=48, temperature=0, stream=True
    )
    pieces = [next(stream)]  # the first request is in flight
    over = served.request(
        "POST",
        "/v1/chat/completions",
        {"model": EMBEDDED_MODEL, "messages": QUESTION, "max_tokens": 4},
        {"Authorization": f"Bearer {KEYS['one']}"},
    )
    assert over.status == 429 and int(over.headers["retry-after"]) >= 1
    assert over.body["error"]["code"] == "rate_limit_exceeded" and over.body["error"]["type"] == "requests"
    assert ask(served.client(KEYS["bob"]), max_tokens=4).choices[0].message.content  # other keys go on
    pieces.extend(stream)
    assert "".join(piece.choices[0].delta.content or "" for piece in pieces if piece.choices)
    assert ask(one, max_tokens=4).choices  # the slot came back when the stream ended
    # A completion of 3 prompts is 3 rows: over a key allowed 2 in flight, whatever else runs.
    rows = served.client(KEYS["two"]).completions
    with pytest.raises(openai.RateLimitError) as error:
        rows.create(model=EMBEDDED_MODEL, prompt=["a", "b", "c"], max_tokens=2)
    assert error.value.body["type"] == "requests"
    assert len(rows.create(model=EMBEDDED_MODEL, prompt=["a", "b"], max_tokens=2).choices) == 2

    tpm = served.client(KEYS["tpm"])
    ask(tpm, max_tokens=48)  # the question's prompt and answer exceed the minute's tokens
    with pytest.raises(openai.RateLimitError) as error:
        ask(tpm, max_tokens=4)
    assert error.value.body["type"] == "tokens"
    assert 1 <= int(error.value.response.headers["retry-after"]) <= 60
    stats = served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['ops']}"}).body
    tenants = stats["auth"]["tenants"]
    assert tenants["one"]["rejected_requests"] == 1 and tenants["one"]["in_flight"] == 0
    assert tenants["tpm"]["rejected_tokens"] == 1 and tenants["tpm"]["prompt_tokens"] > 0
    assert stats["auth"]["unauthorized"] > 0


def test_a_tenant_sees_its_own_counters_and_an_admin_every_tenants(keyed):
    served, _ = keyed
    ask(served.client(KEYS["bob"]), max_tokens=2)
    ask(served.client(KEYS["alice"]), max_tokens=2)
    own = served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['bob']}"}).body
    assert set(own["auth"]["tenants"]) == {"bob"} and own["auth"]["tenants"]["bob"]["requests"] >= 1
    assert "unauthorized" not in own["auth"] and "key_file" not in own["auth"]
    every = served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['ops']}"}).body
    assert {"alice", "bob"} <= set(every["auth"]["tenants"]) and "unauthorized" in every["auth"]
    assert every["auth"]["key_file"]["reloads"] >= 1


# Chunks a client reads before it drops the stream.
DROPPED_AFTER = 300


def test_a_dropped_stream_counts_the_tokens_it_was_sent(keyed):
    served, _ = keyed

    def completion_tokens() -> int:
        stats = served.request(
            "GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['alice']}"}
        ).body
        return stats["auth"]["tenants"]["alice"]["completion_tokens"]

    before = completion_tokens()
    stream = served.client(KEYS["alice"]).chat.completions.create(
        model=EMBEDDED_MODEL,
        messages=QUESTION,
        max_tokens=DROPPED_AFTER + 100,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "speculation": "off"},
    )
    received = [chunk for _, chunk in zip(range(DROPPED_AFTER), stream)]
    stream.close()  # the client goes away mid-answer: no usage chunk ever comes
    assert len(received) == DROPPED_AFTER
    deadline = time.monotonic() + 10
    # One token a chunk (speculation off), the first chunk the role alone.
    while completion_tokens() - before < DROPPED_AFTER - 1:
        assert time.monotonic() < deadline, (
            f"{completion_tokens() - before} tokens counted for the dropped stream"
        )
        time.sleep(0.2)


def test_concurrent_requests_reserve_their_max_tokens_against_the_token_budget(keyed):
    served, _ = keyed
    responses = parallel_responses(served, KEYS["budget"], 20, max_tokens=16)
    statuses = [response.status for response in responses]
    # Each reserves 16 of the 100 while it runs, and once it ends counts what it used (its
    # prompt alone is more than 16): however their runs overlap, at most 6 get in, and every
    # other is refused for tokens, each only when its 16 would have gone over.
    admitted = statuses.count(200)
    assert 1 <= admitted <= BUDGET_TOKENS // 16 and statuses.count(429) == 20 - admitted, statuses
    for response in responses:
        if response.status == 429:
            message = response.body["error"]["message"]
            used, reserved = map(int, re.search(r"(\d+) tokens used and (\d+) reserved", message).groups())
            assert used + reserved + 16 > BUDGET_TOKENS, message
    auth = admin_stats(served)["auth"]["tenants"]["budget"]
    assert auth["rejected_tokens"] == 20 - admitted and auth["in_flight"] == 0


def test_prometheus_counts_match_the_stats_endpoint_per_tenant(keyed):
    served, _ = keyed
    stats = served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['ops']}"}).body
    tenants = stats["auth"]["tenants"]
    expected = {
        "ray_nasd_tenant_requests_total[outcome=rejected_requests][tenant=one]": tenants["one"][
            "rejected_requests"
        ],
        "ray_nasd_tenant_requests_total[outcome=rejected_tokens][tenant=tpm]": tenants["tpm"][
            "rejected_tokens"
        ],
        "ray_nasd_tenant_requests_total[outcome=admitted][tenant=alice]": tenants["alice"]["requests"],
        "ray_nasd_tenant_tokens_total[kind=completion][tenant=alice]": tenants["alice"]["completion_tokens"],
        "ray_nasd_unauthorized_requests_total": stats["auth"]["unauthorized"],
    }
    assert all(expected.values()), expected
    wait_for_samples(served.metrics_url, expected, ("outcome", "kind", "tenant"))


# A changed key file is read within its settle time and a check interval: this is a bound.
RELOAD_TIMEOUT_S = 30


def admin_stats(served) -> dict:
    return served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['ops']}"}).body


def key_status(served, key: str) -> int:
    """The status a route that generates nothing answers ``key`` with."""
    return served.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}).status


def accepted(served, key: str) -> bool:
    return key_status(served, key) == 200


def parallel_statuses(served, key: str, count: int, max_tokens: int) -> list[int]:
    """The statuses of ``count`` chat requests of ``key`` sent at once."""
    return sorted(response.status for response in parallel_responses(served, key, count, max_tokens))


def parallel_responses(served, key: str, count: int, max_tokens: int) -> list:
    """The responses to ``count`` chat requests of ``key`` sent at once."""
    responses: list = []
    ready = threading.Barrier(count)

    def call() -> None:
        ready.wait()
        response = served.request(
            "POST",
            "/v1/chat/completions",
            {"model": EMBEDDED_MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0},
            {"Authorization": f"Bearer {key}"},
        )
        responses.append(response)

    threads = [threading.Thread(target=call) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return responses


# Tokens for a stream that holds its row for as long as a test needs it, on any host.
HOLDING_TOKENS = 4000


def test_concurrent_requests_of_one_key_never_exceed_its_limit(keyed):
    served, _ = keyed
    client = served.client(KEYS["two"])
    holders = []
    try:
        for _ in range(2):
            holders.append(
                client.completions.create(
                    model=EMBEDDED_MODEL,
                    prompt="Count: 1, 2,",
                    max_tokens=HOLDING_TOKENS,
                    stream=True,
                    extra_body={"ignore_eos": True, "speculation": "off"},
                )
            )
            next(iter(holders[-1]))  # admitted, and streaming
        # The key's 2 rows are taken: 6 more sent at once are all refused.
        assert parallel_statuses(served, KEYS["two"], 6, max_tokens=4) == [429] * 6
    finally:
        for holder in holders:
            holder.close()
    wait_for(lambda: admin_stats(served)["auth"]["tenants"]["two"]["in_flight"] == 0, 60, "the rows back")
    assert parallel_statuses(served, KEYS["two"], 1, max_tokens=4) == [200]


def test_a_key_rotated_in_the_file_takes_effect_without_a_restart(keyed):
    served, path = keyed
    rotated = {**KEYS, "alice": "sk-test-alice-rotated"}
    write_atomically(path, key_file_text(rotated))
    try:
        wait_for(lambda: accepted(served, rotated["alice"]), RELOAD_TIMEOUT_S, "the rotated key")
        assert key_status(served, KEYS["alice"]) == 401
        assert ask(served.client(rotated["alice"]), max_tokens=2).choices
    finally:
        write_atomically(path, key_file_text(KEYS))
        wait_for(lambda: accepted(served, KEYS["alice"]), RELOAD_TIMEOUT_S, "the original key back")


def test_no_log_holds_a_key(keyed):
    """Every key this module sent, valid or not, is absent from every log Ray and Serve wrote."""
    sent = [*KEYS.values(), KEYS["alice"] + "x", "sk-test-alice-rotated", "sk-test-bob-new"]
    logs = Path("/tmp/ray/session_latest/logs")
    assert logs.is_dir(), "no Ray session logs to search"
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert any("OpenAIIngress" in path.name for path in files), "the ingress's log is not there"
    for path in files:
        text = path.read_bytes()
        leaked = [key for key in sent if key.encode() in text]
        assert not leaked, f"{path} holds a key"


def test_a_stored_response_is_its_tenants_alone(keyed):
    """Another tenant's response id answers exactly as an unknown one: 404, whatever it asks."""
    served, _ = keyed
    alice, bob = served.client(KEYS["alice"]), served.client(KEYS["bob"])
    made = alice.responses.create(
        model=EMBEDDED_MODEL, input="Say hello.", temperature=0, max_output_tokens=4
    )
    assert alice.responses.retrieve(made.id).id == made.id
    unknown = f"resp_{'0' * 32}"
    for response_id in (made.id, unknown):
        for call in (
            lambda rid: bob.responses.retrieve(rid),
            lambda rid: bob.responses.input_items.list(rid),
            lambda rid: bob.responses.delete(rid),
            lambda rid: bob.responses.create(
                model=EMBEDDED_MODEL, previous_response_id=rid, input="Hi", max_output_tokens=2
            ),
        ):
            with pytest.raises(openai.NotFoundError) as missing:
                call(response_id)
            assert missing.value.body["code"] == "response_not_found"
            assert response_id in missing.value.body["message"]
    assert alice.responses.retrieve(made.id).output_text == made.output_text  # bob's delete did nothing
