"""The Responses API (``/v1/responses``) over real HTTP with the official ``openai`` client, on
the server's default application (shared with test_ingress): answers equal the chat route's for
the same conversation, the SDK's stream helper and ``parse`` read the server's answers, stored
responses continue conversations, and bad input is an OpenAI-shaped 400."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response

from tests.deployments.conftest import DEFAULT_APP
from tests.deployments.test_ingress import MODEL, PERSON_PROMPT, WEATHER_TOOLS, Person

RESPONSES_PATH = "/v1/responses"
# The Responses API's function tools: chat's, with the function's fields at the top level.
TOOLS = [{"type": "function", **tool["function"]} for tool in WEATHER_TOOLS]
GREEDY = {"temperature": 0, "max_output_tokens": 24}
# Room for a whole call (a call cut at the length limit is text, as on the chat route).
CALLING = {"temperature": 0, "max_output_tokens": 64}
INSTRUCTIONS = "Answer in one short sentence."


@pytest.fixture(scope="module")
def app(serve_session):
    return serve_session.deploy({"default": DEFAULT_APP})["default"]


@pytest.fixture(scope="module")
def replica_ids(app) -> set[str]:
    return {replica["replica_id"] for replica in app.request("GET", "/v1/nasd/stats").body["replicas"]}


def chat_text(app, messages: list[dict], max_tokens: int = GREEDY["max_output_tokens"], **extra) -> str:
    """The chat route's greedy answer to ``messages`` (the reference of a Responses answer)."""
    completion = app.client().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **extra
    )
    return completion.choices[0].message.content or ""


def test_a_text_input_is_answered_as_chat_answers_its_conversation(app, replica_ids):
    question = "Name three colours of the rainbow."
    raw = app.request(
        "POST", RESPONSES_PATH, {"model": MODEL, "input": question, "instructions": INSTRUCTIONS, **GREEDY}
    )
    assert raw.status == 200, raw.body
    response = Response.model_validate(raw.body)  # the SDK's own types, validated strictly
    expected = chat_text(
        app, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
    )
    assert response.output_text == expected and expected
    assert response.status in ("completed", "incomplete") and response.object == "response"
    assert response.instructions == INSTRUCTIONS and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert usage.output_tokens >= 1 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert raw.body["nasd"]["num_emitted"] == usage.output_tokens
    # At the length limit the response is incomplete, saying why.
    short = app.client().responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 2


def test_the_sdks_stream_helper_reads_the_events_and_ends_with_the_whole_answer(app):
    client = app.client()
    question = "Count from one to five in words."
    for limit in (8, 64):  # cut at the limit (response.incomplete), and whole (response.completed)
        whole = client.responses.create(
            model=MODEL, input=question, store=False, temperature=0, max_output_tokens=limit
        )
        with client.responses.stream(
            model=MODEL, input=question, store=False, temperature=0, max_output_tokens=limit
        ) as stream:
            events = list(stream)
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == f"response.{whole.status}"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        final = events[-1].response
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        assert "".join(deltas) == final.output_text == whole.output_text
        assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added")
        assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
        assert final.usage.output_tokens == whole.usage.output_tokens
        [added] = [event.item for event in events if event.type == "response.output_item.added"]
        assert added.content == []  # its part comes in content_part.added, once (as OpenAI sends it)
        [done] = [event.item for event in events if event.type == "response.output_item.done"]
        assert done.status == whole.output[0].status == ("incomplete" if limit == 8 else "completed")
        if whole.status == "completed":  # the helper's final response is a completed one's
            assert stream.get_final_response().output_text == whole.output_text
    assert whole.status == "completed", "64 tokens answer the question"


def test_previous_response_id_continues_the_stored_conversation(app):
    client = app.client()
    first_input = "My name is Ada. Say hello to me."
    first = client.responses.create(model=MODEL, input=first_input, instructions=INSTRUCTIONS, **GREEDY)
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my name?",
        instructions=INSTRUCTIONS,
        **GREEDY,
    )
    # A continuation renders its own instructions (an earlier response's are not carried, as in
    # OpenAI's API), the stored conversation and its input.
    history = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": first_input},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == chat_text(app, history)
    assert second.previous_response_id == first.id
    # The prefix the first turn left in the cache serves the second.
    assert second.usage.input_tokens_details.cached_tokens > 0

    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    items = client.responses.input_items.list(second.id)
    assert [(item.type, item.role) for item in items.data] == [("message", "user")]
    assert items.data[0].content[0].text == "What is my name?"

    assert client.responses.delete(first.id) is None  # the SDK returns nothing on success
    for call in (
        lambda: client.responses.retrieve(first.id),
        lambda: client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi", **GREEDY),
        lambda: client.responses.delete(first.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "response_not_found"
    # A response made with store false is not kept.
    unstored = client.responses.create(
        model=MODEL, input="Hi", store=False, temperature=0, max_output_tokens=2
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_tools_are_called_and_their_outputs_answered(app):
    client = app.client()
    question = "What is the weather in Paris?"
    called = client.responses.create(
        model=MODEL, input=question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **CALLING
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in {"get_weather", "get_time"}
    arguments = json.loads(calls[0].arguments)  # a forced call's arguments follow its schema
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 20
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C."}],
        tools=TOOLS,
        **GREEDY,
    )
    assert answered.output and answered.usage.output_tokens >= 1
    # The same conversation sent whole as items (store false) is the chat route's.
    items = [
        {"role": "user", "content": question},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."},
    ]
    whole = client.responses.create(model=MODEL, input=items, store=False, **GREEDY)
    chat = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    assert whole.output_text == chat_text(app, chat)
    # Streamed, a call arrives as its item and its arguments' events.
    with client.responses.stream(
        model=MODEL, input=question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **CALLING
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [item.type for item in final.output if item.type == "function_call"] == ["function_call"]


def test_the_sdks_parse_reads_a_json_schema_answer_into_its_model(app):
    parsed = app.client().responses.parse(
        model=MODEL,
        input=PERSON_PROMPT[0]["content"],
        text_format=Person,
        temperature=0,
        max_output_tokens=96,
    )
    assert isinstance(parsed.output_parsed, Person)


BAD_REQUESTS = {
    "unknown_item_type": ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    "output_without_its_call": (
        {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
        None,
    ),
    "malformed_previous_id": ({"input": "hi", "previous_response_id": "resp_../x"}, "previous_response_id"),
    "built_in_tool": ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    "background": ({"input": "hi", "background": True}, "background"),
    "include": ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
    "truncation_auto": ({"input": "hi", "truncation": "auto"}, "truncation"),
    "unknown_tool_choice": (
        {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}},
        None,
    ),
    "image_part": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
        None,
    ),
    "empty_items": ({"input": []}, "input"),
    "reasoning_effort": ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_input_is_an_openai_400_naming_what_is_wrong(app, name):
    body, param = BAD_REQUESTS[name]
    response = app.request("POST", RESPONSES_PATH, {"model": MODEL, "max_output_tokens": 2, **body})
    assert response.status == 400, response.body
    error = response.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_ids_are_checked_and_unknown_ids_are_404(app, replica_ids):
    malformed = app.request("GET", f"{RESPONSES_PATH}/not-an-id")
    assert malformed.status == 400 and malformed.body["error"]["code"] == "invalid_response_id"
    unknown = app.request("GET", f"{RESPONSES_PATH}/resp_{'0' * 32}/input_items")
    assert unknown.status == 404 and unknown.body["error"]["code"] == "response_not_found"
    other_model = app.request("POST", RESPONSES_PATH, {"model": "gpt-4", "input": "hi"})
    assert other_model.status == 404 and other_model.body["error"]["code"] == "model_not_found"
    stats = app.request("GET", "/v1/nasd/stats").body
    assert {replica["replica_id"] for replica in stats["replicas"]} == replica_ids
