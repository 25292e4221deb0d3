"""Tool calling: tools rendered into the chat prompt, calls parsed out of the answer.

A model family writes its tool calls in its own format, which a ``ToolFormat`` knows: where the
calls start in an answer, how to parse them, the grammar that makes an answer nothing but calls
(``tool_choice`` "required" or a named function: enforced, not hoped for), and how to describe
tools and earlier calls to a template that cannot. Formats:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
  call (Hermes 2/3, Qwen 2/2.5/3, and the format this server writes for templates without tools);
- ``llama3_json``: the answer is ``{"name": ..., "parameters": {...}}``, calls joined by ``"; "``,
  optionally after ``<|python_tag|>`` (Llama 3.1/3.2/3.3 JSON tool calling).

The format is picked from the chat template (``tool_format``) or by the ``tool_call_parser``
setting, as vLLM's ``--tool-call-parser`` does. A template that renders ``tools`` itself gets
them with each message's ``tool_calls`` and ``tool_call_id``; one that does not (SmolLM2's) gets
the tools as a system message and earlier calls and results as text, in the hermes format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from deployments.schemas import FunctionCall, ToolCall
from deployments.streams import marker_start_length
from nasd_core.structured import JSON_OPTIONS

ToolCallParser = Literal["auto", "hermes", "llama3_json"]


def _as_object(arguments: Any) -> Any:
    """Arguments written as JSON text (as clients send them, and as some models write them)
    parsed; anything else, or text that is not JSON, as it is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _arguments_text(arguments: Any) -> str | None:
    """A parsed call's arguments as JSON text; None when they are not an object. A model may
    write a lone surrogate escape ("\\ud800") in a string: it stays escaped, so the text is
    valid UTF-8 and the answer valid JSON."""
    arguments = _as_object(arguments)
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(arguments)
    return text


def _call_of(obj: Any, arguments_key: str, names: frozenset[str] | None) -> ToolCall | None:
    """The call ``obj`` writes: a declared tool's name (any name where ``names`` is None) and an
    arguments object under ``arguments_key`` (or "arguments"); None for anything else, such as
    plain JSON that happens to hold a "name"."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    if arguments_key not in obj and "arguments" not in obj:
        return None
    arguments = _arguments_text(obj.get(arguments_key, obj.get("arguments")))
    if arguments is None:
        return None
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=arguments))


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments_key: function.get("parameters") or {"type": "object"},
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _json_rule(tools: Sequence[dict[str, Any]], arguments_key: str) -> str:
    """A Lark rule body (llguidance's ``%json``): one call of any of ``tools``."""
    schemas = [_call_schema(tool, arguments_key) for tool in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # JSON inside a forced call is written as structured output writes it.
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls.

    Attributes:
        name: the ``tool_call_parser`` value that selects it.
        markers: texts that open the calls in an answer (hermes: anywhere; llama3_json: only at
            the answer's start, after whitespace).
        arguments_key: the key that holds a call's arguments.
    """

    name: str
    markers: tuple[str, ...]
    arguments_key: str
    anywhere: bool = True
    call_open: str = ""
    call_close: str = ""
    separator: str = ""

    def start(self, text: str) -> int | None:
        """Where the calls begin in ``text`` (None: no call yet)."""
        if self.anywhere:
            found = [index for index in (text.find(marker) for marker in self.markers) if index >= 0]
            return min(found) if found else None
        stripped = len(text) - len(text.lstrip())
        return stripped if text[stripped:].startswith(self.markers) else None

    def may_start(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the beginning of a marker (held
        back while streaming; the whole answer while it is only whitespace, for llama3_json)."""
        if not self.anywhere:
            return (
                len(text) if not text.strip() or any(m.startswith(text.lstrip()) for m in self.markers) else 0
            )
        return marker_start_length(text, self.markers)

    def parse(
        self, calls_text: str, finished: bool, names: frozenset[str] | None = None
    ) -> tuple[list[ToolCall], int | None]:
        """The calls complete in ``calls_text`` (the answer from ``start``) up to the first part
        that is no call of ``names``, and where that part begins (None: none so far). From there
        on the answer is content: calls already made stay made (a stream sent them), so the
        answer depends on its text alone, never on how its tokens were grouped into steps.

        Blocks are read between the tags without their newlines, as vLLM's hermes parser reads
        them; formats without tags are read whole, once the answer is finished."""
        if self.call_open:  # one block per call, closed by its tag (or by the answer's end)
            open_tag, close_tag = self.call_open.strip(), self.call_close.strip()
            calls, position = [], 0
            while True:
                begin = calls_text.find(open_tag, position)
                if begin < 0:
                    if finished and calls_text[position:].strip():
                        return calls, position  # text after the calls that is no call
                    return calls, None
                end = calls_text.find(close_tag, begin)
                if end < 0 and not finished:
                    return calls, None
                body_end = end if end >= 0 else len(calls_text)
                call = self._loads(calls_text[begin + len(open_tag) : body_end], names)
                if call is None:
                    return calls, begin
                calls.append(call)
                position = body_end + len(close_tag) if end >= 0 else len(calls_text)
        if not finished:
            return [], None
        body = calls_text.strip()
        for marker in self.markers:
            if marker != "{" and body.startswith(marker):
                body = body[len(marker) :]
        calls = [self._loads(part, names) for part in _split_objects(body, self.separator.strip())]
        if not calls or any(call is None for call in calls):
            return [], 0
        return calls, None

    def _loads(self, text: str, names: frozenset[str] | None) -> ToolCall | None:
        try:
            return _call_of(json.loads(text), self.arguments_key, names)
        except (json.JSONDecodeError, RecursionError):
            return None

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose every answer is one call of ``tools``, or
        with ``parallel`` one or more."""
        call = (
            f"{json.dumps(self.call_open)} body {json.dumps(self.call_close)}" if self.call_open else "body"
        )
        repeat = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        return f"start: call{repeat}\ncall: {call}\nbody: {_json_rule(tools, self.arguments_key)}\n"

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        """Earlier calls (OpenAI's ``tool_calls``) as this format writes them."""
        objects = [
            json.dumps({"name": call["function"]["name"], self.arguments_key: _arguments_of(call)})
            for call in calls
        ]
        return self.separator.join(f"{self.call_open}{text}{self.call_close}" for text in objects)


def _split_objects(text: str, separator: str) -> list[str]:
    """The JSON objects of ``text`` written one after another, with ``separator`` between."""
    decoder, parts, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return [text]  # not a sequence of objects: one part that will not parse
        parts.append(text[position:end])
        position = end
        rest = text[position:].lstrip()
        if separator and rest.startswith(separator):
            rest = rest[len(separator) :]
        position = len(text) - len(rest.lstrip())
    return parts


def _arguments_of(call: dict[str, Any]) -> Any:
    """An earlier call's arguments as an object (clients send them as JSON text)."""
    return _as_object(call["function"].get("arguments", "{}"))


HERMES = ToolFormat(
    name="hermes",
    markers=("<tool_call>",),
    arguments_key="arguments",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    markers=("<|python_tag|>", "{"),
    arguments_key="parameters",
    anywhere=False,
    separator="; ",
)
FORMATS = {tool_format.name: tool_format for tool_format in (HERMES, LLAMA3_JSON)}


def tool_format(chat_template: str | None, setting: str = "auto") -> ToolFormat:
    """The format of ``setting``, or with "auto" the one the chat template writes (hermes when
    the template shows none)."""
    if setting != "auto":
        return FORMATS[setting]
    template = chat_template or ""
    if "<tool_call>" not in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return LLAMA3_JSON
    return HERMES


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template renders a ``tools`` argument (SmolLM2's, for one, ignores it)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tools_prompt(tools: Sequence[dict[str, Any]], fmt: ToolFormat) -> str:
    """The system text that describes ``tools`` to a model whose template cannot."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = fmt.render_calls([{"function": {"name": "<function-name>", "arguments": {"<arg>": "<value>"}}}])
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The functions "
        f"are:\n<tools>\n{signatures}\n</tools>\n\nTo call a function, answer with:\n{example}"
    )


def chat_template_inputs(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    fmt: ToolFormat,
    template_renders_tools: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra arguments ``apply_chat_template`` renders a chat with.

    A template that renders tools gets them, and each earlier call's arguments as an object (as
    templates write them with ``tojson``). For one that does not, the tools are described in the
    system message, earlier calls are written out in ``fmt`` and tool results become user turns.
    """
    if template_renders_tools:
        native = [
            {**message, "tool_calls": [_with_object_arguments(call) for call in message["tool_calls"]]}
            if message.get("tool_calls")
            else dict(message)
            for message in messages
        ]
        return native, ({"tools": list(tools)} if tools else {})
    rendered: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = fmt.render_calls(message["tool_calls"])
            rendered.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif message["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            rendered.append(
                {key: value for key, value in message.items() if key in ("role", "content", "name")}
            )
    if tools:
        description = tools_prompt(tools, fmt)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{description}"}
        else:
            rendered.insert(0, {"role": "system", "content": description})
    return rendered, {}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    return {**call, "function": {**call["function"], "arguments": _arguments_of(call)}}


@dataclass
class ToolStream:
    """Splits a streamed answer into content and tool calls: content streams as it comes (less
    a tail that may open a call), the calls are held until each one is whole. Where the calls
    stop parsing (a broken block, text that is no call), the rest of the answer is content.

    ``push`` takes new answer text and returns (content to send, calls to send).

    Attributes:
        fmt: how the model writes calls.
        names: the request's declared tools (None: any name is a call).
    """

    fmt: ToolFormat
    names: frozenset[str] | None = None
    text: str = ""
    num_sent: int = 0  # characters of ``text`` sent as content
    calls_at: int | None = None  # where the calls begin
    content_again_at: int | None = None  # where the calls stopped parsing
    calls: list[ToolCall] = field(default_factory=list)

    def push(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.calls_at is None:
            self.calls_at = self.fmt.start(self.text)
        if self.calls_at is None:
            end = len(self.text) if finished else len(self.text) - self.fmt.may_start(self.text)
            return self._content(end), []
        new_calls: list[ToolCall] = []
        if self.content_again_at is None:
            calls, stopped = self.fmt.parse(self.text[self.calls_at :], finished, self.names)
            new_calls = calls[len(self.calls) :]
            self.calls.extend(new_calls)
            if stopped is not None:
                self.content_again_at = self.calls_at + stopped
        content = self._content(self.calls_at)
        if self.content_again_at is not None:
            self.num_sent = max(self.num_sent, self.content_again_at)
            content += self._content(len(self.text))
        return content, new_calls

    def _content(self, end: int) -> str:
        if end <= self.num_sent:
            return ""
        content, self.num_sent = self.text[self.num_sent : end], end
        return content
