"""API keys and tenants (``deployments/auth.py``): the key file and limits on their own, then
through the real service with the openai client: 401s, the key's tenant as the isolation
boundary whatever ``user`` a request sends, 429s with Retry-After, and a key rotated in the
file taking effect without a restart."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import openai
import pytest

from deployments.auth import ApiKeys, KeyFileError, KeyLimiter, KeyLimits, parse_keys
from nasd_core.config import EMBEDDED_MODEL
from tests.deployments.conftest import serve_apps, wait_for_samples

KEYS = {
    "alice": "sk-test-alice-0123456789",
    "bob": "sk-test-bob-9876543210",
    "one": "sk-test-one-in-flight",
    "tpm": "sk-test-tokens-per-minute",
}
TOKENS_PER_MINUTE = 60
QUESTION = [{"role": "user", "content": "List the first eight planets of the solar system, in order."}]


def key_file_text(keys: dict[str, str]) -> str:
    return (
        "# test keys\n"
        f"{keys['alice']} alice\n"
        f"{keys['bob']} bob   # a comment\n"
        f"{keys['one']} one max_in_flight=1\n"
        f"\n{keys['tpm']} tpm tokens_per_minute={TOKENS_PER_MINUTE}\n"
    )


def write_atomically(path, text: str) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)


# ------------------------------------------------------------------ without a server
def test_key_file_lines_give_tenants_and_limits():
    keys = parse_keys(key_file_text(KEYS), KeyLimits(max_in_flight=5))
    by_tenant = {key.tenant: key for key in keys.values()}
    assert set(by_tenant) == {"alice", "bob", "one", "tpm"}
    assert by_tenant["alice"].limits == KeyLimits(max_in_flight=5)  # the defaults
    assert by_tenant["one"].limits.max_in_flight == 1
    assert by_tenant["tpm"].limits == KeyLimits(5, TOKENS_PER_MINUTE)


@pytest.mark.parametrize(
    "line",
    ["sk-only-a-key", "sk-x bad/tenant", "sk-x t max_in_flight=0", "sk-x t speed=3", "sk-x t\nsk-x u"],
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
    time.sleep(0.6)  # past the reload check interval
    assert keys.find(KEYS["bob"]) is None and keys.find("sk-rotated").tenant == "bob"
    write_atomically(path, "not a valid file\n")
    time.sleep(0.6)
    assert keys.find("sk-rotated").tenant == "bob", "a bad file must keep the keys read before"


def test_a_missing_key_file_refuses_to_start_an_open_server(tmp_path):
    with pytest.raises(FileNotFoundError):
        ApiKeys(None, str(tmp_path / "absent"))


def test_limits_count_requests_in_flight_and_tokens_per_minute():
    keys = parse_keys(key_file_text(KEYS), KeyLimits())
    one, tpm = (next(key for key in keys.values() if key.tenant == tenant) for tenant in ("one", "tpm"))
    limiter = KeyLimiter()
    assert limiter.admit(one, now=0.0) is None
    rejection = limiter.admit(one, now=0.0)
    assert rejection is not None and rejection.kind == "requests" and rejection.retry_after_s >= 1
    limiter.release(one)
    assert limiter.admit(one, now=0.0) is None
    assert limiter.admit(tpm, now=0.0) is None
    limiter.release(tpm)
    limiter.record_tokens(tpm, 40, 25, now=10.0)  # 65 of 60 in the window
    rejection = limiter.admit(tpm, now=20.0)
    assert rejection is not None and rejection.kind == "tokens" and rejection.retry_after_s == 50
    assert limiter.admit(tpm, now=70.5) is None  # the tokens left the window
    counters = limiter.snapshot()["tenants"]
    assert counters["one"]["rejected_requests"] == 1 and counters["tpm"]["rejected_tokens"] == 1
    assert counters["tpm"]["prompt_tokens"] == 40 and counters["tpm"]["completion_tokens"] == 25


# ------------------------------------------------------------------ through the service
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(key_file_text(KEYS))
    args = {"num_cpus_per_replica": 2, "api_keys_file": str(path), "tenant_isolation": True}
    with serve_apps({"keyed": args}, num_cpus=2) as apps:
        yield apps["keyed"], path


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

    tpm = served.client(KEYS["tpm"])
    ask(tpm, max_tokens=48)  # the question's prompt and answer exceed the minute's tokens
    with pytest.raises(openai.RateLimitError) as error:
        ask(tpm, max_tokens=4)
    assert error.value.body["type"] == "tokens"
    assert 1 <= int(error.value.response.headers["retry-after"]) <= 60
    stats = served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['bob']}"}).body
    tenants = stats["auth"]["tenants"]
    assert tenants["one"]["rejected_requests"] == 1 and tenants["one"]["in_flight"] == 0
    assert tenants["tpm"]["rejected_tokens"] == 1 and tenants["tpm"]["prompt_tokens"] > 0
    assert stats["auth"]["unauthorized"] > 0


def test_prometheus_counts_match_the_stats_endpoint_per_tenant(keyed):
    served, _ = keyed
    stats = served.request("GET", "/v1/nasd/stats", headers={"Authorization": f"Bearer {KEYS['bob']}"}).body
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


def test_concurrent_requests_of_one_key_never_exceed_its_limit(keyed):
    served, _ = keyed
    statuses: list[int] = []

    def call() -> None:
        response = served.request(
            "POST",
            "/v1/chat/completions",
            {"model": EMBEDDED_MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0},
            {"Authorization": f"Bearer {KEYS['one']}"},
        )
        statuses.append(response.status)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses


def test_a_key_rotated_in_the_file_takes_effect_without_a_restart(keyed):
    served, path = keyed
    rotated = {**KEYS, "alice": "sk-test-alice-rotated"}
    write_atomically(path, key_file_text(rotated))
    try:
        time.sleep(0.6)  # past the reload check interval
        with pytest.raises(openai.AuthenticationError):
            ask(served.client(KEYS["alice"]), max_tokens=2)
        assert ask(served.client(rotated["alice"]), max_tokens=2).choices
    finally:
        write_atomically(path, key_file_text(KEYS))


def test_no_log_holds_a_key(keyed):
    """Every key this module sent, valid or not, is absent from every log Ray and Serve wrote."""
    sent = [*KEYS.values(), KEYS["alice"] + "x", "sk-test-alice-rotated"]
    logs = Path("/tmp/ray/session_latest/logs")
    assert logs.is_dir(), "no Ray session logs to search"
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert any("OpenAIIngress" in path.name for path in files), "the ingress's log is not there"
    for path in files:
        text = path.read_bytes()
        leaked = [key for key in sent if key.encode() in text]
        assert not leaked, f"{path} holds a key"
