"""A Redis outage under the pool apps (their redis-server is the suite's own): requests that need
the Responses store get a 503 with Retry-After, every other request is answered, and the store
serves again once Redis is back. The last module to use those apps (the outage empties their pool),
named to run right after the other two, before another module deploys other apps in their place."""

from __future__ import annotations

from nasd_core.config import EMBEDDED_MODEL

SETTINGS = {"model": EMBEDDED_MODEL, "max_output_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


def test_a_redis_outage_turns_away_store_requests_only(pool_apps, pool_redis):
    app = pool_apps.apps["a"]
    stored = app.client().responses.create(input="Say hi.", **SETTINGS)
    pool_redis.stop()
    try:
        for method, path, body in (
            ("POST", "/v1/responses", {"input": "Say hi.", **SETTINGS}),  # stored by default
            ("POST", "/v1/responses", {"input": "Go on.", "previous_response_id": stored.id, **SETTINGS}),
            ("GET", f"/v1/responses/{stored.id}", None),
            ("DELETE", f"/v1/responses/{stored.id}", None),
        ):
            answer = app.request(method, path, body)
            assert answer.status == 503, (method, path, answer.body)
            assert answer.body["error"]["code"] == "store_unavailable"
            assert int(answer.headers["retry-after"]) > 0
        unstored = app.request("POST", "/v1/responses", {"input": "Say hi.", "store": False, **SETTINGS})
        assert unstored.status == 200 and unstored.body["output"], unstored.body
        chat = app.request("POST", "/v1/chat/completions", CHAT)
        assert chat.status == 200 and chat.body["choices"][0]["message"]["content"], chat.body
    finally:
        pool_redis.start()
    # Back (empty: the server keeps nothing on disk), the store takes and serves responses again.
    again = app.client().responses.create(input="Say hi.", **SETTINGS)
    assert app.client().responses.retrieve(again.id).output_text == again.output_text
