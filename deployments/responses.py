"""The OpenAI Responses API (``POST /v1/responses``) on the chat path.

A Responses request becomes a chat request: its instructions a system message, then the stored
conversation of its ``previous_response_id``, then its input items (messages, function calls and
their outputs) as chat messages; function tools, ``tool_choice`` and ``text.format`` become
chat's tools and ``response_format``, so grammars, tool parsing and speculation are chat's. The
answer's text and calls come back as output items, whole or as the typed stream events the
``openai`` SDK's ``responses.stream()`` parses.

Fields that change the output and are not served here (built-in tools, ``background``,
``include``, ``truncation: auto``, ...) are refused with a 400 that names them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deployments.response_store import StoredResponse, StoreUnavailable
from deployments.schemas import (
    ChatCompletionRequest,
    ErrorInfo,
    FunctionDefinition,
    GenerateChunk,
    SpeculationMode,
    ToolCall,
    Usage,
)

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
# Input item types this server reads; a reasoning item (sent back by a client that got one) is
# not rendered into the prompt, as chat templates drop earlier turns' reasoning.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Output items written as text; the last one is the item a length limit cuts.
TEXT_ITEM_TYPES = ("message", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text", "text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = Field(description="The answer's format.")
    name: str | None = Field(None, description="json_schema: the schema's name.")
    description: str | None = Field(None, description="json_schema: what it is for.")
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: the schema.")
    strict: bool | None = Field(None, description="json_schema: the output always follows it here.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format of type json_schema needs a schema")
        if self.type == "json_schema" and self.name is None:
            self.name = "response"  # OpenAI's answers always name the schema
        return self


class TextConfig(_Request):
    format: TextFormat | None = Field(None, description="The answer's format (default: text).")


class FunctionTool(FunctionDefinition):
    """A Responses function tool: chat's function definition, with its type beside its fields."""

    type: Literal["function"] = Field(description="Only function tools are served.")


class FunctionToolChoice(_Request):
    type: Literal["function"] = Field(description="Only function tools are served.")
    name: str = Field(description="The function the answer must call.")


class ReasoningConfig(_Request):
    effort: str | None = Field(None, description="Not served: refused unless null.")
    summary: str | None = Field(None, description="Not served: refused unless null.")

    @field_validator("effort", "summary")
    @classmethod
    def _not_served(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            raise ValueError(f"reasoning.{info.field_name} is not served by this server")
        return value


def _text_of(content: str | list[dict[str, Any]], where: str) -> str:
    """A message's or a call output's content as one text (parts joined by newlines, as chat's)."""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{index}]: a {kind!r} part is not served (text parts only)")
        texts.append(part["text"])
    return "\n".join(texts)


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str | None = Field(None, description="Served model name (default: the served model).")
    input: str | list[dict[str, Any]] = Field(
        description="A user message's text, or items: message, function_call, function_call_output."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    previous_response_id: str | None = Field(
        None, description="Continue that stored response's conversation (its instructions are not carried)."
    )
    store: bool = Field(True, description="Keep the response for GET and previous_response_id.")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="Function tools.")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = Field(
        "auto", description="none | auto | required | {'type': 'function', 'name': ...}."
    )
    parallel_tool_calls: bool = Field(True, description="Whether a forced answer may call more than once.")
    text: TextConfig | None = Field(None, description="{'format': {'type': 'text' | 'json_object' | ...}}.")
    temperature: float | None = Field(None, description="0 = greedy; > 0 samples (default 1).")
    top_p: float | None = Field(None, description="Nucleus sampling mass, in (0, 1] (default 1).")
    max_output_tokens: int | None = Field(None, description="Most tokens to generate.")
    seed: int | None = Field(None, description="Extra field: seed of this request's sampler.")
    metadata: dict[str, str] | None = Field(
        None, description="Up to 16 key-value pairs kept with the response."
    )
    user: str | None = Field(None, description="End-user label for logs and metrics.")
    stream: bool = Field(False, description="Answer with the typed server-sent events.")
    speculation: SpeculationMode | None = Field(None, description="Extra field: speculation mode.")
    num_draft_tokens: int | None = Field(None, description="Extra field: draft length cap.")
    reasoning: ReasoningConfig | None = Field(None, description="Not served beyond null values.")
    truncation: Literal["disabled"] | None = Field(None, description="Only 'disabled' is served.")
    background: bool | None = Field(None, description="Not served: refused when true.")
    include: list[str] | None = Field(None, description="Not served: refused unless empty.")
    top_logprobs: int | None = Field(None, description="Not served: refused unless 0.")
    max_tool_calls: int | None = Field(None, description="Not served: refused when set.")
    conversation: Any = Field(None, description="Not served (send previous_response_id).")
    prompt: Any = Field(None, description="Not served (reusable prompts).")

    @field_validator("background", "include", "top_logprobs", "max_tool_calls", "conversation", "prompt")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not served by this server")
        return value

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value not in (None, "disabled"):
            raise ValueError(f"truncation {value!r} is not served by this server: only 'disabled'")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _response_id(cls, value: str | None) -> str | None:
        if value is not None and not RESPONSE_ID.match(value):
            raise ValueError(f"{value!r} is not a response id (resp_ and 32 hex digits)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (
            len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
        ):
            raise ValueError("metadata holds at most 16 pairs, keys of 64 characters and values of 512")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        if not isinstance(tools, list):
            return tools  # the field's type says what is wrong
        for index, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"tools[{index}]: the {kind!r} tool is not served here (function tools only)"
                )
            FunctionTool.model_validate(tool)
        return tools

    @field_validator("input")
    @classmethod
    def _known_items(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(value, list):
            if not value:
                raise ValueError("input holds no items")
            for index, item in enumerate(value):
                kind = item.get("type", "message" if "role" in item else None)
                if kind not in INPUT_ITEM_TYPES:
                    served = ", ".join(INPUT_ITEM_TYPES)
                    raise ValueError(f"input[{index}]: item type {kind!r} is not served here ({served})")
        return value

    @model_validator(mode="after")
    def _tool_choice_of_tools(self) -> ResponsesRequest:
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in {
            tool["name"] for tool in self.tools
        }:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items, each with its type and an id (what ``input_items`` lists)."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
        listed = []
        for item in items:
            kind = item.get("type", "message")
            listed.append({**item, "type": kind, "id": item.get("id") or new_item_id(prefixes[kind])})
            if kind == "message" and isinstance(item.get("content"), str):  # listed as its text part
                part = {"type": "input_text", "text": item["content"]}
                if item.get("role") == "assistant":
                    part = {"type": "output_text", "text": item["content"], "annotations": []}
                listed[-1]["content"] = [part]
                listed[-1].setdefault("status", "completed")
        return listed


def chat_messages(items: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` as chat messages after ``history`` (the stored conversation): consecutive
    function calls become one assistant message's calls, each output a tool message.

    Raises:
        ValueError: an item that is malformed, or a function call output without its call.
    """
    calls = {call["id"] for message in history for call in message.get("tool_calls") or []}
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where, kind = f"input[{index}]", item["type"]
        try:
            if kind == "message":
                role = item["role"]
                if role not in ("user", "assistant", "system", "developer"):
                    raise ValueError(f"{where}: role {role!r} is not a message role")
                messages.append({"role": role, "content": _text_of(item["content"], where)})
            elif kind == "function_call":
                call = {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
                if messages and messages[-1]["role"] == "assistant":  # a turn's text and calls: one message
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                calls.add(item["call_id"])
            elif kind == "function_call_output":
                if item["call_id"] not in calls:
                    raise ValueError(
                        f"{where}: function_call_output for call_id {item['call_id']!r}, which no "
                        "function_call before it made"
                    )
                output = _text_of(item["output"], where)
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        except KeyError as missing:
            raise ValueError(f"{where}: a {kind} item needs {missing.args[0]!r}") from None
        except TypeError:
            raise ValueError(f"{where}: a malformed {kind} item") from None
    return messages


def chat_request(
    request: ResponsesRequest, items: list[dict[str, Any]], history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request of ``request`` (its ``items``, after ``history``), and the conversation's
    messages without the instructions (what a stored response keeps).

    Raises:
        ValueError, pydantic.ValidationError: the input or a field is not valid.
    """
    conversation = history + chat_messages(items, history)
    instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
    text_format = request.text.format if request.text is not None else None
    response_format = None
    if text_format is not None and text_format.type != "text":
        response_format = {"type": text_format.type}
        if text_format.type == "json_schema":
            response_format["json_schema"] = {
                "name": text_format.name,
                "schema": text_format.json_schema,
                "strict": text_format.strict,
            }
    tool_choice = request.tool_choice
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    fields = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_output_tokens,
        "seed": request.seed,
        "user": request.user,
        "speculation": request.speculation,
        "num_draft_tokens": request.num_draft_tokens,
        "response_format": response_format,
    }
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": instructions + conversation,
            "tools": [
                {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                for tool in request.tools
            ]
            or None,
            "tool_choice": tool_choice if request.tools else None,
            "parallel_tool_calls": request.parallel_tool_calls,
            **{name: value for name, value in fields.items() if value is not None},
        }
    )
    return chat, conversation


# ----------------------------------------------------------------------------- answers
def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking, whole (``summary`` is for models that summarise theirs)."""
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments,
        "status": status,
    }


def response_usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    details = usage.completion_tokens_details
    reasoning = details.reasoning_tokens if details is not None else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.total_tokens,
    }


def conversation_output(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation renders."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


class ResponseAnswer:
    """One Responses request's answer: its Response object as it grows, its stream events, and
    what is stored once it is done (``save``, None when the request has ``store`` false)."""

    def __init__(
        self,
        request: ResponsesRequest,
        model: str,
        input_items: list[dict[str, Any]],
        conversation: list[dict[str, Any]],
        save: Callable[[StoredResponse], Awaitable[None]] | None,
    ) -> None:
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.model = model
        self.input_items = input_items
        self.conversation = conversation
        self.save = save
        self.output: list[dict[str, Any]] = []
        self.sequence_number = 0

    def response(
        self,
        status: str,
        usage: Usage | None = None,
        nasd: dict[str, Any] | None = None,
        error: ErrorInfo | None = None,
    ) -> dict[str, Any]:
        request = self.request
        tool_choice = request.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": time.time() if status == "completed" else None,
            "status": status,
            "model": self.model,
            "output": self.output,
            "instructions": request.instructions,
            "previous_response_id": request.previous_response_id,
            "tools": request.tools,
            "tool_choice": tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
            if request.text is not None and request.text.format is not None
            else {"format": {"type": "text"}},
            "metadata": request.metadata or {},
            "store": request.store,
            "user": request.user,
            "truncation": "disabled",
            "background": False,
            "reasoning": None,
            "error": {"code": error.code or "server_error", "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": response_usage(usage),
            "nasd": nasd,
        }

    async def finish(self, last: GenerateChunk, finish_reason: str | None) -> dict[str, Any]:
        """The done Response, stored when the request asked for it (``StoreUnavailable`` if the
        store cannot be reached)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        if self.output and self.output[-1]["type"] in TEXT_ITEM_TYPES:  # the item the limit cut
            self.output[-1]["status"] = status
        response = self.response(status, last.usage, last.nasd)
        if self.save is not None:
            messages = self.conversation + conversation_output(self.output)
            await self.save(StoredResponse(response, self.input_items, messages))
        return response

    async def whole(self, choices: list[GenerateChunk], last: GenerateChunk) -> dict[str, Any]:
        """The Response of a request answered whole."""
        choice = choices[0] if choices else GenerateChunk()
        if choice.reasoning:
            self.output.append(reasoning_item(new_item_id("rs"), choice.reasoning, "completed"))
        if choice.text or not (choice.tool_calls or choice.reasoning):
            self.output.append(message_item(new_item_id("msg"), choice.text, "completed"))
        for call in choice.tool_calls or []:
            self.output.append(function_call_item(new_item_id("fc"), call))
        return await self.finish(last, choice.finish_reason)

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _open(self, kind: str) -> list[str]:
        """A new text item (a ``message`` or a ``reasoning`` item) at the end of the output, and
        its events: the item added without its part, which content_part.added adds (as OpenAI's)."""
        index = len(self.output)
        if kind == "message":
            item = message_item(new_item_id("msg"), "", "in_progress")
        else:
            item = reasoning_item(new_item_id("rs"), "", "in_progress")
        self.output.append(item)
        part = {**item["content"][0], "text": ""}
        place = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=index, item={**item, "content": []}),
            self._event("response.content_part.added", **place, part=part),
        ]

    def _close(self, index: int, status: str = "completed") -> list[str]:
        """The events that end the text item at ``index`` (a message or a reasoning item)."""
        item = self.output[index]
        item["status"] = status
        part = item["content"][0]
        place = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            text_done = self._event("response.output_text.done", **place, text=part["text"], logprobs=[])
        else:
            text_done = self._event("response.reasoning_text.done", **place, text=part["text"])
        return [
            text_done,
            self._event("response.content_part.done", **place, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    async def events(self, chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
        """The typed stream: created, in_progress, each output item's events, then completed
        (incomplete at the length limit, failed on an error)."""
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        open_item: int | None = None  # the output index of the text item being written
        last, finish_reason = GenerateChunk(), None
        async for chunk in chunks:
            if chunk.error is not None:
                yield self._event("response.failed", response=self.response("failed", error=chunk.error))
                return
            for kind, text in (("reasoning", chunk.reasoning), ("message", chunk.text)):
                if not text:
                    continue
                if open_item is not None and self.output[open_item]["type"] != kind:
                    for event in self._close(open_item):
                        yield event
                    open_item = None
                if open_item is None:
                    open_item = len(self.output)
                    for event in self._open(kind):
                        yield event
                item = self.output[open_item]
                item["content"][0]["text"] += text
                place = {"item_id": item["id"], "output_index": open_item, "content_index": 0}
                if kind == "message":
                    yield self._event("response.output_text.delta", **place, delta=text, logprobs=[])
                else:
                    yield self._event("response.reasoning_text.delta", **place, delta=text)
            for call in chunk.tool_calls or []:
                if open_item is not None:
                    for event in self._close(open_item):
                        yield event
                    open_item = None
                index = len(self.output)
                item = function_call_item(new_item_id("fc"), call, "in_progress")
                self.output.append(item)
                place = {"item_id": item["id"], "output_index": index}
                yield self._event(
                    "response.output_item.added", output_index=index, item={**item, "arguments": ""}
                )
                yield self._event(
                    "response.function_call_arguments.delta", **place, delta=call.function.arguments
                )
                yield self._event(
                    "response.function_call_arguments.done",
                    **place,
                    name=call.function.name,
                    arguments=item["arguments"],
                )
                item["status"] = "completed"
                yield self._event("response.output_item.done", output_index=index, item=item)
            finish_reason = chunk.finish_reason or finish_reason
            last = chunk
        if not self.output:  # an empty answer is still a message, as a whole response's is
            open_item = 0
            for event in self._open("message"):
                yield event
        if open_item is not None:  # the answer's last item: cut at the length limit, or whole
            for event in self._close(open_item, "incomplete" if finish_reason == "length" else "completed"):
                yield event
        try:
            response = await self.finish(last, finish_reason)
        except StoreUnavailable as exc:
            error = ErrorInfo(message=str(exc), type="server_error", code="store_unavailable")
            yield self._event("response.failed", response=self.response("failed", error=error))
            return
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=response)
