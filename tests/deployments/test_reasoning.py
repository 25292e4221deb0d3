"""Reasoning output: the split of thinking from answer under every grouping of the text, the
format picked from the chat template and the prompt, and, over real HTTP with the ``openai``
client, chat's ``reasoning``, its stream deltas and the Responses ``reasoning`` item."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseReasoningItem

from deployments.builder import EMBEDDED_MODEL
from deployments.outputs import ChoiceOutput, ToolParsing
from deployments.reasoning import (
    ANSWER,
    DEEPSEEK_R1,
    MAY_OPEN,
    QWEN3,
    REASONING,
    ReasoningFormat,
    ReasoningStream,
    reasoning_format,
)
from deployments.tools import HERMES
from nasd_core import SamplingParams, generate
from nasd_core.config import SpecConfig
from nasd_core.engine.async_engine import StreamChunk

ANSWERS = [
    "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
    "<think>no end tag, cut off",
    "Plain answer with a </think> inside and <think> too.",
    "<think></think>Empty thinking.",
    " <think>leading space: not an opening tag</think>",
    "<thi",
]


def split_everywhere(fmt: ReasoningFormat, state: str, text: str) -> set[tuple[str, str]]:
    """``text`` through a ReasoningStream in two deltas, cut at every point, and in one."""
    results = set()
    for cut in range(len(text) + 1):
        stream = ReasoningStream(fmt, state)
        first = stream.push(text[:cut], False)
        second = stream.push(text[cut:], True)
        results.add((first[0] + second[0], first[1] + second[1]))
    return results


@pytest.mark.parametrize("text", ANSWERS)
@pytest.mark.parametrize("fmt,state", [(QWEN3, MAY_OPEN), (DEEPSEEK_R1, REASONING), (QWEN3, ANSWER)])
def test_the_split_is_the_same_wherever_the_text_is_cut(fmt, state, text):
    results = split_everywhere(fmt, state, text)
    assert len(results) == 1, results
    stream = ReasoningStream(fmt, state)
    deltas = [stream.push(char, False) for char in text] + [stream.push("", True)]
    assert {("".join(d[0] for d in deltas), "".join(d[1] for d in deltas))} == results


def test_what_each_state_makes_of_an_answer():
    (split,) = split_everywhere(QWEN3, MAY_OPEN, ANSWERS[0])
    assert split == ("\nThe user wants 2+2. That is 4.\n", "The answer is 4.")
    # Opened by the prompt (DeepSeek-R1's template), the tag may be written again or not.
    assert split_everywhere(DEEPSEEK_R1, REASONING, "a</think>\n\n  b") == {("a", "  b")}
    assert split_everywhere(DEEPSEEK_R1, REASONING, "<think>a</think>b") == {("a", "b")}
    assert split_everywhere(DEEPSEEK_R1, REASONING, ANSWERS[1]) == {("no end tag, cut off", "")}
    # A qwen3 answer that does not open with the tag has no reasoning; a closed prompt, none.
    assert split_everywhere(QWEN3, MAY_OPEN, ANSWERS[2]) == {("", ANSWERS[2])}
    assert split_everywhere(QWEN3, ANSWER, ANSWERS[0]) == {("", ANSWERS[0])}


def test_the_format_comes_from_the_setting_or_the_template_and_the_state_from_the_prompts_end():
    assert reasoning_format("{{ '<think>' }}...{{ '</think>' }}") is QWEN3
    assert reasoning_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert reasoning_format(None, "deepseek_r1") is DEEPSEEK_R1
    assert reasoning_format("... </think> ...", "none") is None
    assert QWEN3.first_state("<|im_start|>assistant\n") == MAY_OPEN
    assert QWEN3.first_state("<|im_start|>assistant\n<think>\n") == REASONING
    assert QWEN3.first_state("assistant\n<think>\n\n</think>\n\n") == ANSWER
    assert DEEPSEEK_R1.first_state("<｜Assistant｜>") == REASONING


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(tokenizer):
    thought = 'I could write <tool_call>{"name": "get_weather", "arguments": {}}</tool_call> here.'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    token_ids = tokenizer.encode(f"<think>{thought}</think>\n{call}", add_special_tokens=False)
    # Reasoning tokens: from the one that completes "<think>" to the one that completes "</think>".
    prefixes = [tokenizer.decode(token_ids[: k + 1]) for k in range(len(token_ids))]
    opened = next(k for k, text in enumerate(prefixes) if text.startswith("<think>"))
    closed = next(k for k, text in enumerate(prefixes) if "</think>" in text)
    for size in (1, 3, 7, len(token_ids)):
        output = ChoiceOutput(
            tokenizer,
            SamplingParams(),
            "",
            ToolParsing(HERMES, frozenset({"get_weather"})),
            reasoning=ReasoningStream(QWEN3, MAY_OPEN),
        )
        reasoning, content, calls = "", "", []
        for begin in range(0, len(token_ids), size):
            last = begin + size >= len(token_ids)
            step = StreamChunk("r", token_ids[begin : begin + size], "stop" if last else None)
            output.add(step, None)
            chunk = output.chunk(0, step.finish_reason)
            reasoning += chunk.reasoning or ""
            content += chunk.text
            calls += chunk.tool_calls or []
        assert reasoning == thought, size
        assert output.num_reasoning_tokens == closed - opened + 1, size
        assert content == ""
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo"})
        ]
        assert chunk.finish_reason == "tool_calls"


# ------------------------------------------------------------------------- over HTTP
# The embedded SmolLM2 writes no "</think>": under deepseek_r1 (reasoning open from the answer's
# start) its whole answer is reasoning. What reaches the client is what a reasoning model's
# unfinished thinking would be, through every surface.
REASONING_APP = {"num_cpus_per_replica": 2, "reasoning_parser": "deepseek_r1"}
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 24
MODEL = EMBEDDED_MODEL


@pytest.fixture(scope="module")
def app(serve_session):
    return serve_session.deploy({"reasoning": REASONING_APP})["reasoning"]


@pytest.fixture(scope="module")
def thinking(gguf_model, tokenizer) -> str:
    """The library's greedy answer to CHAT on the server's weights: what comes back as reasoning."""
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return generate(gguf_model, tokenizer, prompt, params, SpecConfig(mode="off")).text


def test_chat_returns_the_reasoning_apart_from_the_content(app, thinking):
    client = app.client()
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == thinking
    assert not message.content
    assert answer.usage.completion_tokens_details.reasoning_tokens == answer.usage.completion_tokens
    # SmolLM2 writes "</think>" in three tokens, which the engine could not follow for certain (the
    # model may write them otherwise): with a grammar, the whole answer is the constrained answer.
    constrained_answer = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    constrained = constrained_answer.choices[0].message
    assert "reasoning" not in constrained.model_extra and constrained.content.startswith("{")
    assert constrained_answer.usage.completion_tokens_details.reasoning_tokens == 0
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thinking
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thinking
    assert not "".join(d.content or "" for d in deltas)


def test_responses_return_a_reasoning_item_whole_and_streamed(app, thinking):
    client = app.client()
    response = client.responses.create(
        model=MODEL, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0
    )
    (item,) = response.output
    assert isinstance(item, ResponseReasoningItem)
    assert item.content[0].text == thinking and item.status == "incomplete"
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens
    assert response.status == "incomplete"
    with client.responses.stream(
        model=MODEL, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0
    ) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # cut at the limit, as the whole one was
    final = events[-1].response
    kinds = [event.type for event in events]
    assert kinds.index("response.content_part.added") < kinds.index("response.reasoning_text.delta")
    done_at = kinds.index("response.reasoning_text.done")
    assert done_at < kinds.index("response.content_part.done") < kinds.index("response.output_item.done")
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thinking
    (done,) = [event.text for event in events if event.type == "response.reasoning_text.done"]
    assert done == thinking
    assert [item.type for item in final.output] == ["reasoning"]
    # The stored conversation goes on: its reasoning is not rendered into the next prompt.
    follow = client.responses.create(
        model=MODEL, input="And two more?", previous_response_id=final.id, max_output_tokens=4, temperature=0
    )
    assert follow.output[0].type == "reasoning"
