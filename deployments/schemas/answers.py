"""The OpenAI API's answers: completions and chat completions, whole and streamed, their usage
and logprobs, errors, and the model list."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from deployments.schemas.requests import ToolCall, ToolCallDelta

FinishReason = Literal["stop", "length", "tool_calls"]


class ErrorInfo(BaseModel):
    message: str = Field(description="What is wrong, for a human.")
    type: str = Field(description="invalid_request_error, server_error...")
    param: str | None = Field(None, description="The offending request field, if any.")
    code: str | None = Field(None, description="Machine-readable reason, e.g. context_length_exceeded.")


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens whose keys and values were in the prefix cache.")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(
        0, description="Generated tokens of the model's reasoning, the markers around it included."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None  # None only for an echoed prompt's first token
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """One output token's logprob (chat's shape; completions' is built from these)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


REASONING_FIELDS = ("reasoning", "reasoning_content")


class _WithReasoning(BaseModel):
    """A reasoning model's thinking (``reasoning``, vLLM's name since 0.11, and
    ``reasoning_content``, the name older clients read), left out where there is none: a client
    may take the key's presence for a reasoning model."""

    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_reasoning(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in REASONING_FIELDS:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class AssistantMessage(_WithReasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class Delta(_WithReasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class _Answer(BaseModel):
    """Fields every completion answer and stream chunk share."""

    id: str
    created: int = Field(default_factory=_now)
    model: str
    usage: Usage | None = None


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    nasd: dict[str, Any] | None = Field(None, description="Extra: speculation counters of this request.")


class CompletionChunk(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    nasd: dict[str, Any] | None = Field(None, description="Extra: speculation counters of this request.")


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nasd-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
