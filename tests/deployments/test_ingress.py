"""The OpenAI API over real HTTP: one Serve application (ingress + one replica on the real
model), the official OpenAI client, outputs compared token for token with the library."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import socket
import time
from typing import Annotated, Literal

import hypothesis
import openai
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.schemas import MAX_PROMPTS
from nasd_core import SamplingParams, SpecConfig, generate
from nasd_core.config import EMBEDDED_MODEL, EMBEDDED_MODEL_ALIASES
from tests.deployments.conftest import DEFAULT_APP, wait_for_samples

MODEL = EMBEDDED_MODEL
PROMPTS = [
    "one, two, three, four, five,",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "Monday, Tuesday,",
    '{"name": "Ada", "age": 36}\n{"name": "Alan", "age":',
    "To be, or not to be,",
    "SELECT name FROM users WHERE age > 30;\nSELECT name FROM users WHERE",
    "Once upon a time, in a small village by the sea, there lived",
]
CHAT = [{"role": "user", "content": "List the first five days of the week, comma separated."}]
MAX_TOKENS = 16
# Per-request speculation settings: every one must give the same greedy text.
EXTRA_VARIANTS = [
    {},
    {"speculation": "off"},
    {"speculation": "on", "num_draft_tokens": 2},
    {"speculation": "auto", "num_draft_tokens": 4},
]

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "additionalProperties": False,
            },
        },
    },
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


@pytest.fixture(scope="module")
def app(serve_session):
    # The server's defaults: one replica on both cores (the ingress takes none), on the
    # embedded model's GGUF blocks, as the test process computing the reference outputs.
    return serve_session.deploy({"default": DEFAULT_APP})["default"]


@pytest.fixture(scope="module")
def model(gguf_model):
    """The library's reference: the server's default weights (the embedded model's GGUF blocks)."""
    return gguf_model


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """The library's greedy result for a prompt, computed once per (prompt, max_tokens, stop)."""
    cache = {}

    def run(prompt: str | list[int], max_tokens: int = MAX_TOKENS, stop: tuple[str, ...] = ()):
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens, stop)
        if key not in cache:
            cache[key] = generate(
                model, tokenizer, prompt, SamplingParams(max_tokens=max_tokens, stop=list(stop))
            )
        return cache[key]

    return run


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def replica_ids(app) -> set[str]:
    """The replica(s) serving at the start of the module: bad input must never replace one."""
    return {replica["replica_id"] for replica in app.request("GET", "/v1/nasd/stats").body["replicas"]}


# ------------------------------------------------------------------------- basics
def test_models_and_health(app):
    models = app.client().models.list()
    assert [model.id for model in models.data] == [MODEL, *EMBEDDED_MODEL_ALIASES]
    assert models.data[0].model_extra["max_model_len"] == 8192
    assert app.request("GET", "/health").status == 200


def test_the_embedded_model_answers_to_its_hugging_face_id(app, reference):
    """The README's first example asks for the model by its Hugging Face id."""
    (alias,) = EMBEDDED_MODEL_ALIASES
    assert alias == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert app.client().models.retrieve(alias).id == alias
    assert app.client().models.retrieve(MODEL).id == MODEL
    missing = app.request("GET", "/v1/models/gpt-4")
    assert missing.status == 404 and missing.body["error"]["code"] == "model_not_found"
    response = app.client().completions.create(
        model=alias, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].text == reference(PROMPTS[0]).text


def test_completion_equals_library_greedy(app, reference):
    expected = reference(PROMPTS[0])
    response = app.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == len(expected.prompt_ids) + len(expected.token_ids)
    # The same prompt as token ids (and as a one-element batch) gives the same text.
    by_ids = app.client().completions.create(
        model=MODEL, prompt=expected.prompt_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == expected.text
    as_batch = app.request(
        "POST", "/v1/completions", {"prompt": [PROMPTS[0]], "max_tokens": MAX_TOKENS, "temperature": 0}
    )
    assert as_batch.status == 200 and as_batch.body["choices"][0]["text"] == expected.text


def test_completion_stream_equals_library_greedy_and_reports_usage_last(app, reference):
    expected = reference(PROMPTS[1])
    chunks = list(
        app.client().completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == expected.text
    assert len(texts) > 1, "the answer was not streamed"
    assert [chunk.usage for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason


def test_a_chats_next_turn_reports_its_cached_prompt_tokens_and_the_library_text(app, reference, tokenizer):
    """The second turn's prompt starts with the first's prompt and answer: their whole KV blocks
    come from the replica's prefix cache (``usage.prompt_tokens_details.cached_tokens``), and the
    text is still the library's greedy text for that prompt."""
    messages = [
        {"role": "system", "content": "You are a terse assistant for a bicycle shop. " * 8},
        {"role": "user", "content": "Which tyre pressure suits a city bike?"},
    ]
    first = app.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And for a road bike?"},
    ]
    second = app.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert second.choices[0].message.content == reference(prompt).text
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_chat_equals_library_greedy_on_the_chat_template(app, reference, chat_prompt):
    expected = reference(chat_prompt, max_tokens=24)
    response = app.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)

    stream = app.client().chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # Text parts are joined into the same message.
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    by_parts = app.client().chat.completions.create(model=MODEL, messages=parts, max_tokens=24, temperature=0)
    assert by_parts.choices[0].message.content == expected.text


def test_stop_string_cuts_streamed_and_whole_text_alike(app, reference):
    expected = reference(PROMPTS[0], stop=(" eight",))
    assert expected.finish_reason == "stop" and " eight" not in expected.text  # the case is exercised
    client = app.client()
    whole = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=" eight"
    )
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[" eight"], stream=True
    )
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == "stop"
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text


def test_seeded_sampling_repeats_and_unknown_fields_are_ignored(app):
    body = {
        "prompt": PROMPTS[5],
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "logit_bias": {},
        "frobnicate": 1,
    }
    first, second = (app.request("POST", "/v1/completions", body) for _ in range(2))
    assert first.status == second.status == 200
    assert first.body["choices"][0]["text"] == second.body["choices"][0]["text"]


def test_any_integer_seed_is_accepted(app):
    for path, body in [(COMPLETIONS_PATH, {"prompt": "hi"}), (CHAT_PATH, {"messages": HI})]:
        for seed in (-1, 2**70):
            response = app.request("POST", path, {**body, "max_tokens": 3, "temperature": 1.0, "seed": seed})
            assert response.status == 200, response.body


# ------------------------------------------------------------ sampling parity
PENALTIES = {
    "frequency_penalty": 0.8,
    "presence_penalty": 0.4,
    "repetition_penalty": 1.1,
    "logit_bias": {"28": 3.0},
}


@pytest.mark.parametrize("speculation", ["off", "on", "auto"])
def test_penalised_greedy_answers_equal_the_library(app, model, tokenizer, speculation):
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=20, min_tokens=6, **{**PENALTIES, "logit_bias": {28: 3.0}})
    expected = generate(model, tokenizer, prompt, params, SpecConfig(mode="off"))
    fields = {**PENALTIES, "min_tokens": 6, "speculation": speculation}
    whole = app.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body=fields
    )
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    streamed = app.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body=fields
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text
    unpenalised = generate(model, tokenizer, prompt, SamplingParams(max_tokens=20))
    assert unpenalised.text != expected.text  # the fields reached the engine


def test_completion_logprobs_equal_the_library(app, model, tokenizer):
    prompt = PROMPTS[2]
    expected = generate(model, tokenizer, prompt, SamplingParams(max_tokens=10, logprobs=3))
    response = app.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([entry.token_id]) for entry in expected.logprobs]
    assert logprobs.token_logprobs == pytest.approx([entry.logprob for entry in expected.logprobs], abs=1e-4)
    assert [len(top) for top in logprobs.top_logprobs] == [3] * 10
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = app.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3, stream=True
    )
    tokens, offsets = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset


def test_echo_scores_the_prompt_as_lm_eval_asks(app, model, tokenizer):
    """lm-eval's log-likelihood request: the prompt as token ids, echo, logprobs, 1 new token;
    and the pure scoring form with max_tokens 0."""
    prompt_ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    expected = generate(
        model, tokenizer, prompt_ids, SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)
    )
    body = {"prompt": prompt_ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    response = app.request("POST", COMPLETIONS_PATH, body)
    assert response.status == 200, response.body
    choice = response.body["choices"][0]
    assert choice["text"] == tokenizer.decode(prompt_ids) + tokenizer.decode(expected.token_ids)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    library = [entry.logprob for entry in expected.prompt_logprobs[1:]] + [expected.logprobs[0].logprob]
    assert logprobs["token_logprobs"][1:] == pytest.approx(library, abs=1e-4)
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    scoring = app.request("POST", COMPLETIONS_PATH, {**body, "max_tokens": 0})
    assert scoring.status == 200, scoring.body
    assert scoring.body["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]
    assert scoring.body["usage"]["completion_tokens"] == 0
    text_only = app.request("POST", COMPLETIONS_PATH, {"prompt": PROMPTS[1], "echo": True, "max_tokens": 0})
    assert text_only.status == 200 and text_only.body["choices"][0]["text"] == PROMPTS[1]
    streamed = app.client().completions.create(
        model=MODEL, prompt=prompt_ids, echo=True, logprobs=1, max_tokens=1, temperature=0, stream=True
    )
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    assert "".join(choice.text for choice in chunks) == choice["text"]
    assert [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs] == logprobs[
        "token_logprobs"
    ]


def test_n_choices_are_rows_of_one_request(app, model, tokenizer, reference, chat_prompt):
    """n greedy choices are the greedy answer n times; seeded sampled choice i is the library's
    answer with seed + i; streamed choices assemble to the whole ones; usage counts them all."""
    expected = reference(PROMPTS[3])
    whole = app.client().completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0, n=3
    )
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert all(choice.text == expected.text for choice in whole.choices)
    assert whole.usage.completion_tokens == 3 * len(expected.token_ids)
    assert whole.usage.prompt_tokens == len(expected.prompt_ids)
    streamed = app.client().completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0, n=3, stream=True
    )
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [expected.text] * 3 and finishes == [expected.finish_reason] * 3
    sampled = app.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=5, n=2
    )
    for choice in sampled.choices:
        library = generate(
            model,
            tokenizer,
            chat_prompt,
            SamplingParams(max_tokens=8, temperature=1.0, seed=5 + choice.index),
        )
        assert choice.message.content == library.text
    chat_stream = app.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=5, n=2, stream=True
    )
    contents = ["", ""]
    for chunk in chat_stream:
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
    assert contents == [choice.message.content for choice in sampled.choices]


def test_batched_prompts_answer_each_prompt_as_its_own_request(app, reference):
    """A batch of prompts with n choices: prompt p's choice i is choice p * n + i and equals
    that prompt's own greedy answer; usage sums the prompts; streamed choices assemble to the
    whole ones, usage in the last chunk only; a batch of token-id prompts answers alike."""
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[5]]
    expected = [reference(prompt) for prompt in prompts]
    whole = app.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2
    )
    assert [choice.index for choice in whole.choices] == list(range(6))
    assert [choice.text for choice in whole.choices] == [result.text for result in expected for _ in "ab"]
    assert whole.usage.prompt_tokens == sum(len(result.prompt_ids) for result in expected)
    assert whole.usage.completion_tokens == 2 * sum(len(result.token_ids) for result in expected)
    assert whole.model_extra["nasd"]["num_emitted"] == whole.usage.completion_tokens
    chunks = list(
        app.client().completions.create(
            model=MODEL,
            prompt=prompts,
            max_tokens=MAX_TOKENS,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [choice.text for choice in whole.choices]
    assert [chunk.usage for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].usage == whole.usage
    by_ids = app.client().completions.create(
        model=MODEL, prompt=[result.prompt_ids for result in expected], max_tokens=MAX_TOKENS, temperature=0
    )
    assert [choice.text for choice in by_ids.choices] == [result.text for result in expected]


@pytest.mark.parametrize("prompt", [PROMPTS[7], PROMPTS[5:8]], ids=["one_prompt", "batch"])
def test_a_client_leaving_a_stream_frees_its_rows(app, prompt):
    """Closing the connection mid-stream cancels every prompt's request on the replica."""
    body = {"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    host, port = app.base_url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        payload = json.dumps(body).encode()
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while received.count(b"data: ") < 4:  # the answer is streaming
            received += connection.recv(65536)
        replicas = app.request("GET", "/v1/nasd/stats").body["replicas"]
        running = [replica["num_running"] for replica in replicas]
        assert running == [len(prompt) if isinstance(prompt, list) else 1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        replicas = app.request("GET", "/v1/nasd/stats").body["replicas"]
        if all(replica["num_running"] == 0 and replica["num_waiting"] == 0 for replica in replicas):
            break
        time.sleep(0.2)
    assert [(replica["num_running"], replica["num_waiting"]) for replica in replicas] == [(0, 0)]


def test_tokenizer_info_lets_a_client_tokenize_through_the_server(app, tokenizer):
    """vLLM's /tokenizer_info (lm-evaluation-harness's remote tokenizer reads it)."""
    info = app.request("GET", "/tokenizer_info")
    assert info.status == 200
    assert info.body["eos_token"] == tokenizer.eos_token and info.body["bos_token"] == tokenizer.bos_token
    assert info.body["chat_template"] == tokenizer.chat_template
    assert info.body["model_max_length"] == 8192
    eos = app.request("POST", "/tokenize", {"prompt": info.body["eos_token"]})
    assert eos.body["tokens"] == [tokenizer.eos_token_id]


def test_tokenize_and_detokenize_agree_with_the_generation_routes(app, tokenizer):
    tokenized = app.request("POST", "/tokenize", {"prompt": PROMPTS[2]})
    assert tokenized.status == 200
    assert tokenized.body["tokens"] == tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    assert (
        tokenized.body["count"] == len(tokenized.body["tokens"]) and tokenized.body["max_model_len"] == 8192
    )
    completion = app.request("POST", COMPLETIONS_PATH, {"prompt": PROMPTS[2], "max_tokens": 1})
    assert completion.body["usage"]["prompt_tokens"] == tokenized.body["count"]
    chat_tokens = app.request("POST", "/tokenize", {"model": MODEL, "messages": CHAT})
    chat = app.request("POST", CHAT_PATH, {"messages": CHAT, "max_tokens": 1})
    assert chat_tokens.body["count"] == chat.body["usage"]["prompt_tokens"]
    text = app.request("POST", "/detokenize", {"tokens": tokenized.body["tokens"]})
    assert text.status == 200 and text.body == {"prompt": PROMPTS[2]}
    assert app.request("POST", "/detokenize", {"tokens": []}).body == {"prompt": ""}


def test_chat_logprobs_equal_the_library(app, model, tokenizer, chat_prompt):
    expected = generate(model, tokenizer, chat_prompt, SamplingParams(max_tokens=8, logprobs=2))
    response = app.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(
        [e.logprob for e in expected.logprobs], abs=1e-4
    )
    for entry, reference_entry in zip(content, expected.logprobs):
        assert entry.token == tokenizer.decode([reference_entry.token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [top.token for top in entry.top_logprobs] == [
            tokenizer.decode([i]) for i, _ in reference_entry.top
        ]
    plain = app.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = app.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, stream=True
    )
    entries = [
        entry
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [entry.token for entry in entries] == [entry.token for entry in content]
    assert all(entry.top_logprobs == [] for entry in entries)


def test_speculation_is_used_and_reported(app):
    prompt = "red green blue red green blue red green blue red green blue red green blue"
    response = app.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"speculation": "on"}
    )
    nasd = response.model_extra["nasd"]
    assert nasd["num_accepted"] > 0 and nasd["tokens_per_step"] > 1.0
    stats = app.request("GET", "/v1/nasd/stats").body
    (replica,) = stats["replicas"]
    assert replica["spec"]["num_accepted"] >= nasd["num_accepted"]
    assert any(int(width) > 0 for width in replica["width_histogram"])
    assert stats["total"]["num_requests"] == replica["num_requests"] >= 1
    assert stats["total"]["tokens_per_step"] > 1.0
    assert replica["pool"]["backend"] == "memory"
    assert replica["pool"]["namespaces"][0]["state"] == "connected"
    runner = replica["runner"]
    assert runner["device"] == "cpu" and runner["kv_cache_positions"] > 0 and runner["memory_plan"] is None


# ---------------------------------------------------------------------- bad input
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
# A 400-digit bound: valid JSON, which the grammar builder cannot write back.
BIG_INTEGER_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "n", "schema": {"type": "integer", "maximum": 10**400}},
}
BAD_INPUT = {
    # id: (path, body, status, param, code)
    "invalid_json": (COMPLETIONS_PATH, b'{"prompt": "hi", ', 400, None, None),
    "body_not_an_object": (COMPLETIONS_PATH, [1, 2], 400, None, None),
    "missing_prompt": (COMPLETIONS_PATH, {"max_tokens": 4}, 400, "prompt", None),
    "max_tokens_wrong_type": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "max_tokens": "many"},
        400,
        "max_tokens",
        None,
    ),
    "temperature_wrong_type": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    "seed_wrong_type": (COMPLETIONS_PATH, {"prompt": "hi", "seed": "abc"}, 400, "seed", None),
    "unknown_model": (COMPLETIONS_PATH, {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    "unknown_model_chat": (CHAT_PATH, {"model": "gpt-4", "messages": HI}, 404, "model", "model_not_found"),
    "empty_messages": (CHAT_PATH, {"messages": []}, 400, "messages", None),
    "missing_messages": (CHAT_PATH, {"max_tokens": 4}, 400, "messages", None),
    "unknown_role": (CHAT_PATH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
    "image_content": (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        None,
    ),
    "max_tokens_zero": (COMPLETIONS_PATH, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    "user_lone_surrogate": (COMPLETIONS_PATH, {"prompt": "hi", "user": "\ud800"}, 400, "user", None),
    "prompt_lone_surrogate": (COMPLETIONS_PATH, {"prompt": "a\ud800"}, 400, "prompt", None),
    "schema_integer_past_the_builder": (
        CHAT_PATH,
        {"messages": HI, "response_format": BIG_INTEGER_SCHEMA},
        400,
        "response_format",
        None,
    ),
    "max_tokens_negative": (CHAT_PATH, {"messages": HI, "max_tokens": -3}, 400, "max_tokens", None),
    "max_tokens_beyond_context": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "max_tokens": 10**6},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "prompt_beyond_context": (
        COMPLETIONS_PATH,
        {"prompt": [1] * 9000, "max_tokens": 4},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "temperature_negative": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "temperature": -0.5},
        400,
        "temperature",
        None,
    ),
    "top_p_zero": (COMPLETIONS_PATH, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    "top_p_above_one": (CHAT_PATH, {"messages": HI, "top_p": 1.5}, 400, "top_p", None),
    "n_zero": (COMPLETIONS_PATH, {"prompt": "hi", "n": 0}, 400, "n", None),
    "n_above_max": (CHAT_PATH, {"messages": HI, "n": 17}, 400, "n", None),
    "batch_above_max": (COMPLETIONS_PATH, {"prompt": ["a"] * (MAX_PROMPTS + 1)}, 400, "prompt", None),
    "batch_with_a_bad_prompt": (COMPLETIONS_PATH, {"prompt": ["hi", ""]}, 400, "prompt", None),
    "empty_prompt": (COMPLETIONS_PATH, {"prompt": ""}, 400, "prompt", None),
    "empty_token_prompt": (COMPLETIONS_PATH, {"prompt": []}, 400, "prompt", None),
    "token_id_beyond_vocab": (COMPLETIONS_PATH, {"prompt": [49152]}, 400, "prompt", None),
    "token_id_negative": (COMPLETIONS_PATH, {"prompt": [5, -1]}, 400, "prompt", None),
    "stop_not_str_or_list": (COMPLETIONS_PATH, {"prompt": "hi", "stop": 5}, 400, "stop", None),
    "stop_empty_string": (COMPLETIONS_PATH, {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    "speculation_bad_value": (
        CHAT_PATH,
        {"messages": HI, "speculation": "sometimes"},
        400,
        "speculation",
        None,
    ),
    "presence_penalty_above_2": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "presence_penalty": 3},
        400,
        "presence_penalty",
        None,
    ),
    "frequency_penalty_below_minus_2": (
        CHAT_PATH,
        {"messages": HI, "frequency_penalty": -2.5},
        400,
        "frequency_penalty",
        None,
    ),
    "repetition_penalty_zero": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        None,
    ),
    "logit_bias_key_not_an_id": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "logit_bias": {"abc": 1}},
        400,
        "logit_bias",
        None,
    ),
    "logit_bias_value_above_100": (
        CHAT_PATH,
        {"messages": HI, "logit_bias": {"5": 150}},
        400,
        "logit_bias",
        None,
    ),
    "logit_bias_id_beyond_vocab": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "logit_bias": {"49152": 1}},
        400,
        "logit_bias",
        None,
    ),
    "min_tokens_above_max_tokens": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens",
        None,
    ),
    "completion_logprobs_above_20": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "logprobs": 21},
        400,
        "logprobs",
        None,
    ),
    "top_logprobs_without_logprobs": (
        CHAT_PATH,
        {"messages": HI, "top_logprobs": 3},
        400,
        "top_logprobs",
        None,
    ),
    "top_logprobs_above_20": (
        CHAT_PATH,
        {"messages": HI, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        None,
    ),
    "tools_without_a_function": (
        CHAT_PATH,
        {"messages": HI, "tools": [{"type": "function"}]},
        400,
        "tools",
        None,
    ),
    "tools_bad_function_name": (
        CHAT_PATH,
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "two words"}}]},
        400,
        "tools",
        None,
    ),
    "tools_on_completions": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
        None,
    ),
    "tool_choice_names_an_unknown_tool": (
        CHAT_PATH,
        {
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
        None,
    ),
    "tool_choice_required_without_tools": (
        CHAT_PATH,
        {"messages": HI, "tool_choice": "required"},
        400,
        "tool_choice",
        None,
    ),
    "tool_choice_unknown_mode": (
        CHAT_PATH,
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
        400,
        "tool_choice",
        None,
    ),
    "tool_parameters_bad_schema": (
        CHAT_PATH,
        {
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": "required",
        },
        400,
        "tool_choice",
        None,
    ),
    "forced_call_and_response_format": (
        CHAT_PATH,
        {
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
        None,
        None,
    ),
    "response_format_bad_schema": (
        CHAT_PATH,
        {
            "messages": HI,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        },
        400,
        "response_format",
        None,
    ),
    "response_format_schema_missing": (
        CHAT_PATH,
        {"messages": HI, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
        None,
    ),
    "guided_regex_unclosed": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "guided_regex": "(a"},
        400,
        "guided_regex",
        None,
    ),
    "guided_choice_empty": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "guided_choice": []},
        400,
        "guided_choice",
        None,
    ),
    "two_output_constraints": (
        CHAT_PATH,
        {"messages": HI, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
        400,
        None,
        None,
    ),
    "detokenize_id_beyond_vocab": ("/detokenize", {"tokens": [49152]}, 400, "tokens", None),
    "tokenize_nothing": ("/tokenize", {}, 400, "prompt", None),
    "tokenize_lone_surrogate": ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", None),
    "tokenize_unknown_model": (
        "/tokenize",
        {"model": "gpt-4", "prompt": "hi"},
        404,
        "model",
        "model_not_found",
    ),
    "chat_echo": (CHAT_PATH, {"messages": HI, "echo": True}, 400, "echo", None),
    "max_tokens_zero_without_echo": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "max_tokens": 0, "logprobs": 1},
        400,
        "max_tokens",
        None,
    ),
    "lone_surrogate_prompt": (COMPLETIONS_PATH, {"prompt": "hi \ud800 there"}, 400, "prompt", None),
    "lone_surrogate_message": (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "\udfff"}]},
        400,
        "messages",
        None,
    ),
    "draft_length_negative": (
        COMPLETIONS_PATH,
        {"prompt": "hi", "num_draft_tokens": -1},
        400,
        "num_draft_tokens",
        None,
    ),
}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), BAD_INPUT.values(), ids=BAD_INPUT.keys()
)
def test_bad_input_gets_openai_error_and_the_replica_keeps_serving(
    app, replica_ids, path, body, status, param, code
):
    response = app.request("POST", path, body)
    assert response.status == status, response.body
    error = response.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    normal = app.request("POST", COMPLETIONS_PATH, {"prompt": "hi", "max_tokens": 2})
    assert normal.status == 200
    stats = app.request("GET", "/v1/nasd/stats").body
    assert {replica["replica_id"] for replica in stats["replicas"]} == replica_ids, "a replica was replaced"


def test_unknown_route_is_an_openai_error(app):
    response = app.request("GET", "/v1/nope")
    assert response.status == 404
    assert response.body["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------- concurrency
def test_64_concurrent_requests_each_equal_their_single_request_output(app, reference):
    requests = [
        (prompt, extra) for prompt, extra in itertools.product(PROMPTS, EXTRA_VARIANTS + EXTRA_VARIANTS)
    ]
    assert len(requests) == 64
    expected = {prompt: reference(prompt).text for prompt in PROMPTS}

    async def run_all() -> list[str]:
        client = app.async_client()

        async def one(prompt: str, extra: dict) -> str:
            response = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
            )
            return response.choices[0].text

        try:
            return await asyncio.gather(*(one(prompt, extra) for prompt, extra in requests))
        finally:
            await client.close()

    outputs = asyncio.run(run_all())
    mismatches = [
        (prompt, extra) for (prompt, extra), text in zip(requests, outputs) if text != expected[prompt]
    ]
    assert not mismatches, (
        f"{len(mismatches)} outputs differ from their single-request runs: {mismatches[:4]}"
    )


# ------------------------------------------------------------------------ metrics
METRICS_WAIT_S = 45


def test_prometheus_metrics_match_the_stats_endpoint(app):
    # Last in the module: no request runs while the exporter catches up with the stats.
    app.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0)
    stats = app.request("GET", "/v1/nasd/stats").body
    total, replica_runner = stats["total"], stats["replicas"][0]["runner"]
    expected = {
        "ray_nasd_generated_tokens_total": total["num_emitted"],
        "ray_nasd_target_forwards_total": total["num_steps"],
        "ray_nasd_requests_total": total["num_requests"],
        "ray_nasd_accepted_tokens_total": total["num_accepted"],
        "ray_nasd_pool_connected": 1.0,
        "ray_nasd_paged_attention_fallback": 0.0,
        "ray_nasd_kv_cache_positions": replica_runner["kv_cache_positions"],
        **{f"ray_nasd_policy_rows_total[width={w}]": count for w, count in total["width_histogram"].items()},
    }
    replicas = {"replica": {replica["replica_id"] for replica in stats["replicas"]}}
    samples = wait_for_samples(app.metrics_url, expected, ("width",), METRICS_WAIT_S, only=replicas)
    # Requests that only scored their prompt (echo, max_tokens 0) have no tokens per step.
    assert total["num_scoring_requests"] >= 2  # test_echo_scores_the_prompt_as_lm_eval_asks sent two
    decoded = total["num_requests"] - total["num_scoring_requests"]
    assert samples["ray_nasd_request_tokens_per_step_count"] == decoded


# ----------------------------------------------------------------------- fuzzing
# Odd JSON values any field may get: wrong types, out of range, huge, NaN, a lone surrogate.
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.just("\ud800"),
    st.lists(st.integers(-5, 60_000), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2),
)
# Small lengths only: a valid huge max_tokens (or min_tokens) would just run long.
LENGTH = st.one_of(st.integers(-3, 6), st.sampled_from([2**31, 2**70, 10**6]), st.text(max_size=2))
FIELDS = {
    "model": st.sampled_from([MODEL, *EMBEDDED_MODEL_ALIASES, "gpt-4", ""]),
    "max_tokens": LENGTH,
    "max_completion_tokens": LENGTH,
    "temperature": st.one_of(st.floats(0, 2), ODD),
    "top_p": st.one_of(st.floats(0, 1), ODD),
    "top_k": st.one_of(st.integers(-1, 50), ODD),
    "stop": st.one_of(st.sampled_from(["\n", ".", ["a", "the"], []]), ODD),
    "seed": st.one_of(st.integers(-(2**65), 2**65), ODD),
    "n": st.one_of(st.integers(0, 3), ODD),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), ODD),
    "user": st.one_of(st.text(max_size=6), ODD),
    "speculation": st.one_of(st.sampled_from(["auto", "on", "off"]), ODD),
    "num_draft_tokens": st.one_of(st.integers(-1, 8), ODD),
    "presence_penalty": st.one_of(st.floats(-2.5, 2.5), ODD),
    "frequency_penalty": st.one_of(st.floats(-2.5, 2.5), ODD),
    "repetition_penalty": st.one_of(st.floats(-0.5, 3), ODD),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(-2, 50_000).map(str), st.floats(-150, 150), max_size=3), ODD
    ),
    "min_tokens": st.one_of(st.integers(-1, 6), ODD),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 50_000), max_size=3), ODD),
    "ignore_eos": st.one_of(st.booleans(), ODD),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 22), ODD),
    "top_logprobs": st.one_of(st.integers(-1, 22), ODD),
    "echo": st.one_of(st.booleans(), ODD),
    "tools": st.one_of(st.just([]), st.just([{"type": "function"}]), st.just(WEATHER_TOOLS), ODD),
    "tool_choice": st.one_of(
        st.sampled_from(
            ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
        ),
        ODD,
    ),
    "parallel_tool_calls": st.one_of(st.booleans(), ODD),
    "response_format": st.one_of(
        st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
                BIG_INTEGER_SCHEMA,
            ]
        ),
        ODD,
    ),
    "guided_regex": st.one_of(st.sampled_from(["[0-9]+", "(", "a|b"]), ODD),
    "best_of": st.one_of(st.integers(0, 3), ODD),
}
TOKEN_IDS = st.lists(st.integers(-2, 50_000), max_size=6)
PROMPT_VALUES = st.one_of(
    st.sampled_from(PROMPTS),
    st.text(max_size=30),
    TOKEN_IDS,
    st.lists(st.one_of(st.sampled_from(PROMPTS), st.text(max_size=8)), max_size=3),  # batches
    st.lists(TOKEN_IDS, max_size=3),
    ODD,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "wizard"]), "content": PROMPT_VALUES}
        ),
        max_size=3,
    ),
    ODD,
)


RESPONSES_PATH = "/v1/responses"
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in WEATHER_TOOLS]
INPUT_ITEMS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": PROMPT_VALUES}
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": st.sampled_from(["call_1", "call_2"]),
                "name": st.sampled_from(["get_weather", "nope"]),
                "arguments": st.one_of(st.just('{"city": "Rome"}'), ODD),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call_output"),
                "call_id": st.sampled_from(["call_1", "x"]),
                "output": ODD,
            }
        ),
        st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])}),
        ODD,
    ),
    max_size=4,
)
# The Responses route's own fields (temperature, top_p, seed, user, stream... are FIELDS').
RESPONSES_FIELDS = {
    "input": st.one_of(PROMPT_VALUES, INPUT_ITEMS),
    "instructions": st.one_of(st.text(max_size=12), ODD),
    "max_output_tokens": LENGTH,
    "previous_response_id": st.one_of(st.sampled_from([f"resp_{'0' * 32}", "resp_x", ""]), ODD),
    "store": st.one_of(st.booleans(), ODD),
    "tools": st.one_of(st.just([]), st.just([{"type": "web_search"}]), st.just(RESPONSES_TOOLS), ODD),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required", {"type": "function", "name": "get_weather"}]), ODD
    ),
    "text": st.one_of(
        st.sampled_from(
            [
                {"format": {"type": "json_object"}},
                {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}},
                {"format": {"type": "json_schema"}},
            ]
        ),
        ODD,
    ),
    "metadata": st.one_of(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2), ODD),
    "background": st.one_of(st.booleans(), ODD),
    "include": st.one_of(st.just([]), st.just(["reasoning.encrypted_content"]), ODD),
    "truncation": st.one_of(st.sampled_from(["auto", "disabled"]), ODD),
    "reasoning": st.one_of(st.sampled_from([{}, {"effort": "low"}]), ODD),
}
SHARED_FIELDS = ["model", "temperature", "top_p", "seed", "user", "stream", "speculation", "num_draft_tokens"]


@st.composite
def fuzzed_requests(draw) -> tuple[str, dict]:
    """A valid request with some of its fields (every one the routes know) replaced."""
    path = draw(st.sampled_from([COMPLETIONS_PATH, CHAT_PATH, RESPONSES_PATH]))
    if path == RESPONSES_PATH:
        body = {"input": "hi", "max_output_tokens": 4, "temperature": 0}
        fields = {**{name: FIELDS[name] for name in SHARED_FIELDS}, **RESPONSES_FIELDS}
    else:
        body = {"max_tokens": 4, "temperature": 0}
        body |= {"prompt": draw(PROMPT_VALUES)} if path == COMPLETIONS_PATH else {"messages": draw(MESSAGES)}
        fields = FIELDS
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True))
    body |= {name: draw(fields[name]) for name in names}
    return path, body


# CI runs 150 fixed examples; a longer run: NASD_FUZZ_EXAMPLES=1000 NASD_FUZZ_SEED=11 (docs/results.md).
FUZZ_EXAMPLES = int(os.environ.get("NASD_FUZZ_EXAMPLES", "150"))
FUZZ_SEED = os.environ.get("NASD_FUZZ_SEED")


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=FUZZ_SEED is None, database=None)
@(hypothesis.seed(int(FUZZ_SEED)) if FUZZ_SEED else lambda test: test)
@given(request=fuzzed_requests())
def test_fuzzed_requests_get_an_answer_or_an_openai_error_never_a_500(app, request):
    path, body = request
    response = app.request("POST", path, body)
    assert response.status < 500, (body, response.body)
    if response.status >= 400:
        error = response.body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    elif body.get("stream") is True and path == RESPONSES_PATH:
        last_event = response.body.rstrip().rsplit("event: ", 1)[-1]
        assert last_event.startswith(("response.completed", "response.incomplete")), response.body[-500:]
    elif body.get("stream") is True:
        assert response.body.rstrip().endswith("data: [DONE]") and "server_error" not in response.body


def test_the_replica_survives_the_fuzzing(app, replica_ids):
    """Runs after the fuzz test (file order): the same replica still answers."""
    assert app.request("POST", COMPLETIONS_PATH, {"prompt": "hi", "max_tokens": 2}).status == 200
    stats = app.request("GET", "/v1/nasd/stats").body
    assert {replica["replica_id"] for replica in stats["replicas"]} == replica_ids


# ---------------------------------------------------------------- structured output
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int
    languages: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(max_length=3)


PERSON_PROMPT = [
    {
        "role": "user",
        "content": 'Records: {"name": "Ada", "age": 36, "languages": ["English"]}. '
        "Write the record of Grace.",
    }
]


def test_the_openai_sdks_parse_gets_its_pydantic_object_whole_and_streamed(app):
    """``client.chat.completions.parse`` sends a strict json_schema response_format and parses
    the answer into the model; streamed, the greedy answer is the same text."""
    client = app.client()
    answers = {}
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=PERSON_PROMPT,
            response_format=Person,
            temperature=temperature,
            max_tokens=96,
            seed=3,
        )
        assert isinstance(completion.choices[0].message.parsed, Person)
        answers[temperature] = completion.choices[0].message.content
    # The SDK's streaming helper: the same strict schema, the answer as chunks, parsed at the end.
    with client.chat.completions.stream(
        model=MODEL, messages=PERSON_PROMPT, response_format=Person, temperature=0, max_tokens=96
    ) as stream:
        num_chunks = sum(1 for event in stream if event.type == "content.delta")
        final = stream.get_final_completion()
    assert num_chunks > 1 and final.choices[0].message.content == answers[0.0]
    assert isinstance(final.choices[0].message.parsed, Person)


def test_guided_fields_constrain_completions_and_chat(app):
    client = app.client()
    choice = client.completions.create(
        model=MODEL,
        prompt="The review 'great film!' is",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["positive", "negative"]},
    )
    assert choice.choices[0].text in ("positive", "negative")
    number = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=8, temperature=0, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert re.fullmatch("[0-9]{3}", number.choices[0].message.content)
    record = client.chat.completions.create(
        model=MODEL,
        messages=PERSON_PROMPT,
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(record.choices[0].message.content), dict)


# ---------------------------------------------------------------------- tools


def weather_of(arguments: str) -> str:
    """The tool the test "executes": a fixed answer for the city it is asked about."""
    city = json.loads(arguments)["city"]
    return json.dumps({"city": city, "temperature": 21, "sky": "clear"})


def test_a_tool_calling_loop_with_the_openai_sdk_whole_and_streamed(app):
    """Call (tool_choice required: the grammar makes the answer calls), execute, send each result
    back as a ``tool`` message with its ``tool_call_id``, get a final answer. Streamed, the SDK's
    helper assembles the same calls from ``delta.tool_calls`` (greedy: identical arguments)."""
    client = app.client()
    first = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice="required", temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert first.nasd["drafted_by_source"].get("grammar", 0) > 0
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments)["city"], str)
    with client.chat.completions.stream(
        model=MODEL, messages=WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice="required", temperature=0
    ) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_completion().choices[0]
    assert "tool_calls.function.arguments.done" in events
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    messages = [
        *WEATHER_QUESTION,
        choice.message.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": weather_of(call.function.arguments)}
            for call in choice.message.tool_calls
        ),
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER_TOOLS, tool_choice="none", temperature=0, max_tokens=32
    )
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_named_tool_choice_calls_that_tool_once_without_parallel_calls(app):
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        response = app.request(
            "POST",
            CHAT_PATH,
            {
                "messages": WEATHER_QUESTION,
                "tools": WEATHER_TOOLS,
                "tool_choice": named,
                "parallel_tool_calls": False,
                "temperature": 1.0,
                "seed": 5,
                "stream": stream,
            },
        )
        assert response.status == 200, response.body
        if stream:
            chunks = [json.loads(line[6:]) for line in response.body.splitlines() if line[6:].startswith("{")]
            calls = [
                call
                for chunk in chunks
                for c in chunk["choices"]
                for call in c["delta"].get("tool_calls") or []
            ]
            assert [call["index"] for call in calls] == [0]
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            calls = response.body["choices"][0]["message"]["tool_calls"]
            assert response.body["choices"][0]["message"]["content"] is None
        assert [call["function"]["name"] for call in calls] == ["get_time"]
        json.loads(calls[0]["function"]["arguments"])


def test_the_sdks_pydantic_function_tool_parses_its_arguments(app):
    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        unit: Literal["celsius", "fahrenheit"]

    completion = app.client().chat.completions.parse(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        temperature=0,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and all(isinstance(call.function.parsed_arguments, GetWeather) for call in calls)
