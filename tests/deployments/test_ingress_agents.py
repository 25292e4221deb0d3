"""The OpenAI Agents SDK as a client of the server's default application, over real HTTP: an
agent with two function tools runs over the Responses API (the SDK's default) and over chat
completions; its tools are called with arguments that satisfy their schemas, and its final
answer arrives."""

from __future__ import annotations

import asyncio
import json

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem

from tests.deployments.conftest import DEFAULT_APP
from tests.deployments.test_ingress import MODEL

# The SDK exports traces to OpenAI by default: nothing leaves this machine in a test.
set_tracing_disabled(True)


@pytest.fixture(scope="module")
def app(serve_session):
    return serve_session.deploy({"default": DEFAULT_APP})["default"]


@function_tool
def get_weather(city: str) -> str:
    """The weather now in a city.

    Args:
        city: The city's name.
    """
    return f"Sunny and 21 C in {city}."


@function_tool
def get_time(city: str) -> str:
    """The local time in a city.

    Args:
        city: The city's name.
    """
    return f"It is 10:30 in {city}."


TOOLS = {tool.name: tool for tool in (get_weather, get_time)}


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_calls_its_tools_with_valid_arguments_and_gets_its_answer(app, api):
    client = app.async_client()
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="assistant",
        instructions="Use the tools to answer, then answer in one sentence.",
        tools=list(TOOLS.values()),
        model=model_class(model=MODEL, openai_client=client),
        # The first turn must call a tool (a grammar holds the call to its schema); the SDK then
        # sets tool_choice back to auto (reset_tool_choice), so the model may answer.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert calls and len(outputs) == len(calls)
    for call in calls:  # the SDK gives both APIs' calls as Responses function_call items
        schema = TOOLS[call.name].params_json_schema
        parsed = json.loads(call.arguments)
        assert set(parsed) == set(schema["required"]) and isinstance(parsed["city"], str)
    assert isinstance(result.final_output, str) and result.final_output.strip()
