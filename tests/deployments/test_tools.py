"""Tool calling: the call formats (parsing, streaming, the forcing grammar), chat templates that
render tools and one that cannot, and a replica per model family answering forced calls.

The families: hermes (Hermes, Qwen) and llama3_json (Llama 3.x), each on a tiny random-weight
Qwen2 model with a chat template written here in that family's style (no network, no download);
the embedded SmolLM2, whose template has no tools, gets them through the hermes fallback. A
random model rarely calls a tool of its own accord, so the replica tests force the calls
(``tool_choice`` required or named): the grammar makes the answer a call, and the parser must
read it back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deployments.replica import NASDServer, ReplicaConfig
from deployments.schemas import ChatCompletionRequest, GenerateChunk, GenerateRequest
from deployments.tools import (
    HERMES,
    LLAMA3_JSON,
    ToolStream,
    chat_template_inputs,
    renders_tools,
    tool_format,
)
from nasd_core.config import EngineConfig, GrammarSpec, ModelConfig
from nasd_core.structured import Grammars

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": '{"sky": "snow"}'},
]

# Chat templates in each family's style, written for these tests; both end as ChatML does.
CHATML_TURNS_END = """{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HERMES_TEMPLATE = (
    """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
"""
    + CHATML_TURNS_END
)
LLAMA3_TEMPLATE = (
    """
{%- for message in messages %}
{%- set first_user = 1 if messages[0].role == 'system' else 0 %}
{%- if message.role == 'user' and tools and loop.index0 == first_user %}<|im_start|>user
Respond with a JSON call {"name": function name, "parameters": arguments} of one of:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
<|python_tag|>{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", {#
#}"parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>ipython
{{ message.content }}<|im_end|>
"""
    + CHATML_TURNS_END
)


# ------------------------------------------------------------------ formats
def streamed(fmt, text: str, piece: int = 3) -> tuple[str, list]:
    stream = ToolStream(fmt)
    content, calls = "", []
    for start in range(0, len(text), piece):
        delta, new_calls = stream.push(text[start : start + piece], False)
        content, calls = content + delta, calls + new_calls
    delta, new_calls = stream.push("", True)
    return content + delta, calls + new_calls


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_calls_are_split_from_content_whole_or_in_pieces(piece):
    text = (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    )
    content, calls = streamed(HERMES, text, piece)
    assert content == "Let me look."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}),
        ("ping", {}),
    ]
    assert len({call.id for call in calls}) == 2


def test_a_hermes_call_is_sent_once_it_closes_not_at_the_end():
    stream = ToolStream(HERMES)
    _, calls = stream.push('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_c', False)
    assert [call.function.name for call in calls] == ["ping"]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HERMES, "The sign <tool_calls> is not a call, nor is <tool_call> broken {json"),
        (HERMES, "a < b and b <tool"),
        (LLAMA3_JSON, 'The JSON {"name": "x"} is inside text'),
        (LLAMA3_JSON, '{"not": "a call"}'),
        (LLAMA3_JSON, "   "),
    ],
)
def test_text_that_is_no_call_comes_back_as_content_unchanged(fmt, text):
    assert streamed(fmt, text) == (text, [])


def test_llama3_json_calls_joined_by_semicolons_with_or_without_the_python_tag():
    for prefix in ("", "<|python_tag|>", "  "):
        first = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}; '
        text = prefix + first + '{"name": "ping", "parameters": {}}'
        content, calls = streamed(LLAMA3_JSON, text)
        assert content == prefix if prefix.strip() == "" else content == ""
        assert [call.function.name for call in calls] == ["get_weather", "ping"]
        assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "f"}


def final_answer(fmt, pieces: list[str], names: frozenset[str] | None = None) -> tuple[str, list]:
    """The content and calls of an answer streamed in ``pieces`` (the last push finishes it)."""
    stream = ToolStream(fmt, names)
    content, calls = "", []
    for index, piece in enumerate(pieces):
        delta, new_calls = stream.push(piece, index == len(pieces) - 1)
        content, calls = content + delta, calls + new_calls
    return content, [(call.function.name, call.function.arguments) for call in calls]


def splits(text: str) -> Iterator[list[str]]:
    """``text`` whole, in every 2-piece split (an empty last piece included), and per character."""
    yield [text]
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


GOOD_CALL = '<tool_call>\n{"name": "ping", "arguments": {"host": "a"}}\n</tool_call>'
ANSWERS = {
    "good_then_broken": (HERMES, "Checking.\n" + GOOD_CALL + '\n<tool_call>\n{"name": "ping", "argu'),
    "good_then_text": (HERMES, GOOD_CALL + "\nDone, that was all."),
    "broken_first": (HERMES, 'Sure. <tool_call>\n{"name": ping}\n</tool_call>' + GOOD_CALL),
    "two_good": (HERMES, GOOD_CALL + "\n" + GOOD_CALL.replace('"a"', '"b"')),
    "no_newlines": (HERMES, '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'),
    "llama3_good_then_broken": (LLAMA3_JSON, '{"name": "ping", "parameters": {}}; {"name": "pi'),
    "llama3_two": (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "ping", "parameters": {}}; {"name": "ping", "parameters": {"x": 1}}',
    ),
}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_an_answer_is_the_same_whatever_pieces_its_text_came_in(answer):
    """Speculation groups tokens into steps differently from plain decoding: the API's answer
    (content and calls) must depend on the text alone."""
    fmt, text = ANSWERS[answer]
    whole = final_answer(fmt, [text])
    for pieces in splits(text):
        assert final_answer(fmt, pieces) == whole, pieces
    assert whole[0] or whole[1]  # something came out


def test_a_good_call_then_a_broken_one_keeps_the_call_and_returns_the_rest_as_content():
    content, calls = final_answer(HERMES, [ANSWERS["good_then_broken"][1]])
    assert calls == [("ping", '{"host": "a"}')]
    assert content == 'Checking.\n<tool_call>\n{"name": "ping", "argu'
    content, calls = final_answer(HERMES, [ANSWERS["broken_first"][1]])
    assert calls == [] and content == ANSWERS["broken_first"][1]


def test_hermes_blocks_without_newlines_inside_the_tags_are_calls():
    assert final_answer(HERMES, [ANSWERS["no_newlines"][1]]) == ("", [("ping", "{}")])


def test_plain_json_with_a_name_is_no_call_of_an_undeclared_function():
    text = '{"name": "Bob", "age": 3}'
    assert final_answer(LLAMA3_JSON, [text]) == (text, [])  # no parameters: no call
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert final_answer(LLAMA3_JSON, [call], frozenset({"ping"})) == (call, [])  # not declared
    assert final_answer(LLAMA3_JSON, [call], frozenset({"get_weather"}))[1] == [
        ("get_weather", '{"city": "Oslo"}')
    ]


def test_a_lone_surrogate_escape_in_arguments_stays_escaped_in_valid_utf8():
    content, calls = final_answer(
        HERMES, ['<tool_call>\n{"name": "ping", "arguments": {"s": "\\ud800x"}}\n</tool_call>']
    )
    ((_, arguments),) = calls
    arguments.encode("utf-8")  # would raise on a lone surrogate
    assert json.loads(arguments) == {"s": "\ud800x"}
    chunk = GenerateChunk(
        text=content,
        tool_calls=ToolStream(HERMES).push(
            '<tool_call>\n{"name": "ping", "arguments": {"s": "\\udfff"}}\n</tool_call>', True
        )[1],
    )
    json.loads(chunk.model_dump_json())


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    _, calls = streamed(HERMES, '<tool_call>\n{"name": "ping", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
    assert json.loads(calls[0].function.arguments) == {"a": 1}


def test_the_format_is_picked_from_the_template_or_the_setting():
    assert tool_format(HERMES_TEMPLATE) is HERMES
    assert tool_format(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert tool_format(None) is HERMES and tool_format(HERMES_TEMPLATE, "llama3_json") is LLAMA3_JSON
    assert renders_tools(HERMES_TEMPLATE) and renders_tools(LLAMA3_TEMPLATE)


def test_the_embedded_template_cannot_render_tools_so_the_system_message_describes_them(tokenizer):
    assert not renders_tools(tokenizer.chat_template)
    messages, extra = chat_template_inputs(CONVERSATION, TOOLS, HERMES, template_renders_tools=False)
    assert extra == {}
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.count("<|im_start|>system") == 1 and "Be brief." in prompt
    assert '"name": "get_weather", "description": "The weather in a city."' in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"sky": "snow"}\n</tool_response>' in prompt


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_accepts_the_formats_own_calls_and_nothing_else(tokenizer, fmt, parallel):
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = GrammarSpec(kind="lark", source=fmt.grammar(TOOLS, parallel), param="tool_choice")
    calls = [
        {"function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}},
        {"function": {"name": "ping", "arguments": "{}"}},
    ]

    def accepts(text: str) -> bool:
        grammar = grammars.matcher(spec)
        token_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return grammar.valid_prefix(token_ids) == len(token_ids)

    assert accepts(fmt.render_calls(calls[:1]))
    assert accepts(fmt.render_calls(calls)) == parallel
    assert not accepts(
        fmt.render_calls([{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    )
    assert not accepts("I will not call anything.")


# ------------------------------------------------------------- model families
def tiny_family(directory: Path, tokenizer, chat_template: str | None) -> str:
    """A 2-layer random-weight Qwen2 with the embedded tokenizer and ``chat_template``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template)
    return str(directory)


@pytest.fixture(scope="module")
def families(tmp_path_factory, tokenizer) -> Iterator[dict[str, NASDServer]]:
    """A started server per family: hermes and llama3_json templates on tiny models, and the
    embedded model, whose template has no tools."""
    loop = asyncio.new_event_loop()
    servers = {}
    for name, template in (("hermes", HERMES_TEMPLATE), ("llama3_json", LLAMA3_TEMPLATE)):
        path = tiny_family(tmp_path_factory.mktemp(name), tokenizer, template)
        servers[name] = NASDServer(
            ReplicaConfig(model=ModelConfig(name=path), engine=EngineConfig(max_batch_rows=4)), origin=name
        )
    servers["embedded"] = NASDServer(ReplicaConfig(engine=EngineConfig(max_batch_rows=4)), origin="embedded")
    for server in servers.values():
        loop.run_until_complete(server.start())
    yield {name: (server, loop) for name, server in servers.items()}
    for server in servers.values():
        loop.run_until_complete(server.shutdown())
    loop.close()


def answer(served, **fields) -> list[GenerateChunk]:
    server, loop = served
    body = ChatCompletionRequest(**{"temperature": 0, "max_tokens": 96, **fields})
    request = GenerateRequest.from_chat(body).model_dump()

    async def run() -> list[GenerateChunk]:
        return [chunk async for chunk in server.generate(request)]

    chunks = loop.run_until_complete(run())
    assert all(chunk.error is None for chunk in chunks), chunks[-1].error
    return chunks


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "embedded"])
def test_each_family_renders_its_tools_and_reads_back_the_calls_it_was_made_to_write(families, family):
    server, _ = families[family]
    expected_format = "llama3_json" if family == "llama3_json" else "hermes"
    assert server.tool_format.name == expected_format
    assert server.template_renders_tools == (family != "embedded")
    prompt = server.tokenizer.decode(
        server._prompt_ids(
            GenerateRequest.from_chat(ChatCompletionRequest(messages=CONVERSATION, tools=TOOLS))
        )
    )
    assert '"name": "get_weather"' in prompt and '"description": "The weather in a city."' in prompt
    # The earlier call's arguments are rendered as an object, not a quoted string.
    assert '{"city": "Oslo", "unit": "c"}' in prompt and '"{\\"city' not in prompt
    if family == "hermes":
        assert '<tool_response id="call_7">' in prompt  # tool_call_id reached the template
    # One call each: a random model may go on calling until max_tokens where parallel calls are
    # allowed (those are the format tests' and the SDK test's).
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for stream in (False, True):
            chunks = answer(
                families[family],
                messages=CONVERSATION[:2],
                tools=TOOLS,
                tool_choice=tool_choice,
                parallel_tool_calls=False,
                stream=stream,
            )
            calls = [call for chunk in chunks for call in chunk.tool_calls or []]
            assert chunks[-1].finish_reason == "tool_calls" and calls, chunks
            assert "".join(chunk.text for chunk in chunks).strip() == ""
            assert len(calls) == 1
            for call in calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name in ("get_weather", "ping")
                if call.function.name == "get_weather":
                    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")


def test_forced_calls_are_token_identical_with_speculation_off_on_and_auto(families):
    answers = {}
    for mode in ("off", "on", "auto"):
        chunks = answer(
            families["embedded"],
            messages=[{"role": "user", "content": "Weather in Oslo and in Bergen, in celsius?"}],
            tools=TOOLS,
            tool_choice="required",
            speculation=mode,
        )
        answers[mode] = [
            (call.function.name, call.function.arguments) for c in chunks for call in c.tool_calls or []
        ]
        if mode != "off":
            assert sum(chunks[-1].nasd["drafted_by_source"].values()) > 0, "nothing was drafted"
    assert answers["off"] and answers["on"] == answers["off"] and answers["auto"] == answers["off"]


def test_tool_choice_none_renders_the_tools_but_parses_no_calls(families):
    chunks = answer(
        families["hermes"], messages=CONVERSATION[:2], tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert all(chunk.tool_calls is None for chunk in chunks) and chunks[-1].finish_reason in (
        "stop",
        "length",
    )
