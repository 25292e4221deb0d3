"""The OpenAI API's requests: completions, chat completions, tokenize and detokenize, with this
server's extras (``speculation``, ``num_draft_tokens``, structured outputs).

Request models ignore unknown fields (as vLLM's server does), so clients that send newer
OpenAI fields keep working. Pydantic only: the ingress uses them without loading torch.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# The OpenAI completions API documents 16 as the default of max_tokens. Chat has no default:
# the replica lets it run to the end of the context, as vLLM does.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# OpenAI's default; send temperature 0 for greedy (token-identical to plain decoding) output.
DEFAULT_TEMPERATURE = 1.0

# Most choices (``n``) one request may ask for: each is a row of the engine.
MAX_CHOICES = 16
# Most prompts one completions request may batch: each is a request of its own to a replica
# (as in vLLM), so a batch spreads over replicas and joins their running batches.
MAX_PROMPTS = 64
SpeculationMode = Literal["auto", "on", "off"]
Role = Literal["system", "developer", "user", "assistant", "tool"]
ToolChoiceMode = Literal["none", "auto", "required"]


# Known OpenAI request fields that change the output and are not implemented: refused with a
# 400 naming them when a request uses them (a neutral value such as "functions": [] passes).
# The legacy ``functions`` / ``function_call`` pair is superseded by ``tools`` / ``tool_choice``.
UNSUPPORTED_FIELDS = {
    "functions": bool,
    "function_call": lambda value: value not in (None, "none"),
    "best_of": lambda value: value not in (None, 1),
    "suffix": bool,
    "audio": bool,
    "modalities": lambda value: value not in (None, ["text"]),
    "prediction": bool,
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with the request's usage.")


def _specs(fields: list[tuple[str, str, Any]]) -> list[dict[str, str]]:
    """The ``GrammarSpec`` fields of each given constraint, from ``(param, kind, value)``: a
    json_schema value is a schema (text or object), a choice value a list, the others text."""
    specs = []
    for param, kind, value in fields:
        if value is None:
            continue
        if kind == "choice" or (kind == "json_schema" and not isinstance(value, str)):
            value = json.dumps(value)
        specs.append({"kind": kind, "source": value, "param": param})
    return specs


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = Field(None, description="The schema's name.")
    description: str | None = Field(None, description="What the schema is for.")
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON schema.")
    strict: bool | None = Field(None, description="The output always follows the schema here.")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = Field(description="The answer's format.")
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema")
        return self


class StructuredOutputs(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, description="A regex the output matches.")
    choice: list[str] | None = Field(None, description="The output is one of these.")
    grammar: str | None = Field(None, description="A Lark grammar.")

    def specs(self) -> list[dict[str, str]]:
        prefix = "structured_outputs."
        return _specs(
            [
                (prefix + "json", "json_schema", self.json_),
                (prefix + "regex", "regex", self.regex),
                (prefix + "choice", "choice", self.choice),
                (prefix + "grammar", "lark", self.grammar),
            ]
        )


class SamplingFields(_Request):
    """Fields every generation request shares. Ranges are checked by the engine, which knows the
    model's context length, so one rule answers both the library and the service."""

    max_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float = Field(DEFAULT_TEMPERATURE, description="0 = greedy; > 0 samples.")
    top_p: float = Field(1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, description="Keep the k most likely tokens; 0 or -1 = all (extra field).")
    stop: str | list[str] | None = Field(None, description="Stop strings; the text ends before them.")
    seed: int | None = Field(None, description="Seed of this request's sampler.")
    n: int = Field(1, description="Choices per request; they share the prompt's prefill.")
    presence_penalty: float = Field(
        0.0, description="In [-2, 2]: subtracted from tokens already in the output."
    )
    frequency_penalty: float = Field(0.0, description="In [-2, 2]: subtracted per occurrence in the output.")
    repetition_penalty: float = Field(
        1.0, description="Extra field (vLLM's): > 1 discourages tokens seen in the prompt or output."
    )
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in [-100, 100].")
    min_tokens: int = Field(0, description="Extra field: no end before this many tokens.")
    stop_token_ids: list[int] | None = Field(None, description="Extra field: token ids that end the text.")
    ignore_eos: bool = Field(False, description="Extra field: keep going past end-of-sequence.")
    stream: bool = Field(False, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    user: str | None = Field(
        None,
        description="End-user label for logs and metrics. Without API keys it is also the tenant "
        "(pool, prefix cache, routing): a field any caller may write, so not isolation.",
    )
    speculation: SpeculationMode | None = Field(
        None, description="Extra field: speculative decoding mode of this request (default: the server's)."
    )
    num_draft_tokens: int | None = Field(
        None, description="Extra field: draft length cap of this request (default: the server's)."
    )

    @field_validator("user")
    @classmethod
    def _user_is_text(cls, value: str | None) -> str | None:
        # JSON can carry a lone surrogate ("\ud800"); the user names a pool namespace and a route.
        if value is not None:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"not valid Unicode text: {exc.reason} at character {exc.start}") from None
        return value

    @field_validator("n")
    @classmethod
    def _choices_in_range(cls, value: int) -> int:
        if not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
        return value

    # Known OpenAI fields this server does not implement: declared so that using one is a 400
    # naming it (validators run only on fields a request sends).
    functions: Any = Field(None, description="Not supported (refused unless empty): send tools.")
    function_call: Any = Field(None, description="Not supported (refused unless 'none').")
    best_of: Any = Field(None, description="Only 1 is supported.")
    suffix: Any = Field(None, description="Not supported (refused unless empty).")
    audio: Any = Field(None, description="Not supported.")
    modalities: Any = Field(None, description="Only ['text'] is supported.")
    prediction: Any = Field(None, description="Not supported.")

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if UNSUPPORTED_FIELDS[info.field_name](value):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    # Structured output: OpenAI's response_format and vLLM's guided fields (at most one).
    response_format: ResponseFormat | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {...}}."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Extra field (vLLM's): a JSON schema.")
    guided_regex: str | None = Field(None, description="Extra field (vLLM's): a regex the output matches.")
    guided_choice: list[str] | None = Field(
        None, description="Extra field (vLLM's): the output is one of these."
    )
    guided_grammar: str | None = Field(None, description="Extra field (vLLM's): a Lark grammar.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extra field (vLLM's newer form): one of json, regex, choice, grammar."
    )

    def constraints(self) -> list[dict[str, str]]:
        """The ``GrammarSpec`` fields (kind, source, the field it came from) of each output
        constraint the request gives (at most one passes validation)."""
        response_format = None
        if self.response_format is not None and self.response_format.type != "text":
            response_format = (
                self.response_format.json_schema.json_schema
                if self.response_format.json_schema is not None
                else {"type": "object"}
            )
        specs = _specs(
            [
                ("response_format", "json_schema", response_format),
                ("guided_json", "json_schema", self.guided_json),
                ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice),
                ("guided_grammar", "lark", self.guided_grammar),
            ]
        )
        return specs + (self.structured_outputs.specs() if self.structured_outputs is not None else [])

    def grammar(self) -> dict[str, str] | None:
        """The request's output constraint as a ``GrammarSpec``'s fields, or None."""
        constraints = self.constraints()
        return constraints[0] if constraints else None

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        names = [spec["param"] for spec in self.constraints()]
        if len(names) > 1:
            raise ValueError(f"at most one output constraint per request: {', '.join(names)} are given")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    model: str | None = Field(None, description="Served model name (default: the served model).")
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description=f"A prompt (text or token ids) or a batch of up to {MAX_PROMPTS}: prompt p's "
        "choice i is answered as choice p * n + i."
    )
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, description="Most tokens to generate.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return each token's logprob and this many top ones."
    )
    echo: bool = Field(
        False, description="Answer the prompt followed by the completion; with logprobs, the prompt's too."
    )

    tools: Any = Field(None, description="Not on this route (refused unless empty): chat serves tools.")
    tool_choice: Any = Field(None, description="Not on this route (refused unless 'none').")

    @field_validator("tools", "tool_choice")
    @classmethod
    def _tools_are_chat(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none"):
            raise ValueError(f"{info.field_name} is served on /v1/chat/completions, not on completions")
        return value

    @field_validator("prompt")
    @classmethod
    def _batch_size(cls, value: str | list) -> str | list:
        if isinstance(value, list) and len(value) > MAX_PROMPTS and isinstance(value[0], str | list):
            raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts (got {len(value)})")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one, or each of a batch."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            return list(self.prompt)
        return [self.prompt]


class TextPart(_Request):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class FunctionCall(_Request):
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments: a JSON object, as text.")


class ToolCall(_Request):
    """A call the assistant made (in an answer, or sent back in the conversation)."""

    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", description="The call's id.")
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    """A streamed call: sent whole, in one chunk, with its position among the choice's calls."""

    index: int = Field(description="The call's position among the choice's calls.")


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="The function's name.")
    description: str | None = Field(None, description="What it does, for the model.")
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of its arguments.")
    strict: bool | None = Field(None, description="Arguments always follow the schema here when forced.")


class Tool(_Request):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(description="The function the answer must call.")


class NamedToolChoice(_Request):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: NamedFunction


class ChatMessage(_Request):
    role: Role = Field(description="Who wrote the message.")
    content: str | list[TextPart] | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Optional author name.")
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: str | None = Field(None, description="A tool message's answer to this call.")

    def as_template_input(self) -> dict[str, Any]:
        """What the chat template renders of this message: role, content as text, and the name,
        calls and call id it has."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model: str | None = Field(None, description="Served model name (default: the served model).")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        None, description="Newer name of max_tokens; wins when both are given."
    )
    echo: Any = Field(None, description="Not supported in chat (refused when true).")
    logprobs: bool = Field(False, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With logprobs: this many top tokens per position."
    )
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoiceMode | NamedToolChoice | None = Field(
        None,
        description="none | auto (the default with tools) | required (one call or more) | "
        "{'type': 'function', 'function': {'name': ...}}; required and named are enforced by a grammar.",
    )
    parallel_tool_calls: bool = Field(True, description="Whether a forced answer may call more than once.")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_of_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice in (None, "none", "auto"):
            return choice
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in [
            t.function.name for t in tools
        ]:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return choice

    @model_validator(mode="after")
    def _forced_calls_alone(self) -> ChatCompletionRequest:
        if self.forced_tools() and self.constraints():
            raise ValueError("a forced tool call (tool_choice) cannot also follow another output constraint")
        return self

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools an answer must call one of (tool_choice required or named), or None."""
        if self.tool_choice in (None, "none", "auto") or not self.tools:
            return None
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [tool for tool in tools if tool["function"]["name"] == self.tool_choice.function.name]
        return tools

    @field_validator("echo")
    @classmethod
    def _no_chat_echo(cls, value: Any) -> Any:
        if value:
            raise ValueError("echo is not supported by this server's chat route")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a completion ``prompt`` or chat ``messages``, encoded as the
    generation routes encode them (so ``count`` is what ``usage.prompt_tokens`` will say)."""

    model: str | None = Field(None, description="Served model name (default: the served model).")
    prompt: str | None = Field(None, description="Text to encode as a completion prompt.")
    messages: list[ChatMessage] | None = Field(None, description="Messages to render and encode.")
    add_special_tokens: bool = Field(False, description="Let the tokenizer add its special tokens.")


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    model: str | None = Field(None, description="Served model name (default: the served model).")
    tokens: list[int] = Field(description="Token ids to decode.")
