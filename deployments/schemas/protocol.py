"""What the ingress and a replica exchange through a deployment handle: the request a replica
runs (``GenerateRequest``, built from an OpenAI request), and what it yields back."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from deployments.schemas.answers import ErrorInfo, FinishReason, TokenLogprob, Usage
from deployments.schemas.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    ToolCall,
)


class GenerateRequest(SamplingFields):
    """What the ingress sends a replica: exactly one of ``prompt`` (text or ids) or ``messages``
    (role/content dicts the replica renders with its tokenizer's chat template)."""

    prompt: str | list[int] | None = Field(None, description="Completion prompt.")
    messages: list[dict[str, Any]] | None = Field(None, description="Chat messages, content as text.")
    tools: list[dict[str, Any]] | None = Field(None, description="Chat: the tools, rendered into the prompt.")
    parse_tool_calls: bool = Field(
        False, description="Chat: answer calls as tool_calls (tool_choice not none)."
    )
    forced_tools: list[dict[str, Any]] | None = Field(
        None, description="Chat: the answer is calls of these (tool_choice required or named)."
    )
    parallel_tool_calls: bool = Field(True, description="Chat: a forced answer may call more than once.")
    logprobs: int | None = Field(None, description="Top logprobs per token (None: no logprobs).")
    echo: bool = Field(False, description="Send the prompt first (and its logprobs with logprobs).")
    tenant: str | None = Field(
        None,
        description="Set by the ingress, never by a client: the API key's tenant, or without keys the "
        "`user` label. It picks the pool namespace, the prefix-cache salt and the routing key.",
    )
    pool_partition: int = Field(
        0,
        ge=0,
        description="Set by the ingress, never by a client: which of its tenant's pool partitions the "
        "request reads and feeds, the one it was routed by (deployments.routing.placed).",
    )

    @classmethod
    def from_completion(
        cls, request: CompletionRequest, prompt: str | list[int], tenant: str | None = None
    ) -> GenerateRequest:
        """The replica request of ``prompt``, one of ``request.prompts``, for ``tenant``."""
        return cls(
            prompt=prompt,
            logprobs=request.logprobs,
            echo=request.echo,
            tenant=tenant,
            **request.model_dump(include=_SAMPLING_FIELDS),
        )

    @classmethod
    def from_chat(cls, request: ChatCompletionRequest, tenant: str | None = None) -> GenerateRequest:
        messages = [message.as_template_input() for message in request.messages]
        fields = request.model_dump(include=_SAMPLING_FIELDS)
        if request.max_completion_tokens is not None:
            fields["max_tokens"] = request.max_completion_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []] or None
        return cls(
            messages=messages,
            logprobs=logprobs,
            tenant=tenant,
            tools=tools,
            parse_tool_calls=tools is not None and request.tool_choice != "none",
            forced_tools=request.forced_tools(),
            parallel_tool_calls=request.parallel_tool_calls,
            **fields,
        )

    def max_new_tokens(self, context_tokens: int | None, num_prompt_tokens: int = 0) -> int:
        """The most tokens the request may generate: its ``max_tokens``, or, for a chat without one,
        up to the end of the model's context as vLLM does (no context known: as many again as the
        prompt). The ingress reserves it before the prompt is encoded (``num_prompt_tokens`` 0:
        the whole context), the replica generates it."""
        if self.max_tokens is not None:
            return self.max_tokens
        limit = context_tokens or 2 * num_prompt_tokens
        return max(1, limit - num_prompt_tokens)

    def tool_names(self) -> frozenset[str]:
        """The names of the functions the request declares (its answer may call only these)."""
        return frozenset(tool["function"]["name"] for tool in self.tools or ())


_SAMPLING_FIELDS = set(SamplingFields.model_fields)


class TokensResult(BaseModel):
    """A replica's answer to a tokenize or detokenize call (an error as for generation)."""

    tokens: list[int] | None = None
    text: str | None = None
    max_model_len: int | None = None
    error: ErrorInfo | None = None
    status_code: int = 200


class GenerateChunk(BaseModel):
    """What a replica yields: new text, or at the end the finish reason, usage and counters;
    or an error (then ``status_code`` says which HTTP status the ingress answers)."""

    index: int = Field(0, description="The choice this chunk belongs to.")
    text: str = Field("", description="New text since the previous chunk.")
    reasoning: str | None = Field(None, description="New reasoning text since the previous chunk.")
    tool_calls: list[ToolCall] | None = Field(
        None, description="Tool calls completed since the previous chunk."
    )
    logprobs: list[TokenLogprob] | None = Field(None, description="Of the tokens since the previous chunk.")
    finish_reason: FinishReason | None = Field(None, description="Set on a choice's last chunk.")
    usage: Usage | None = Field(None, description="Set on the request's last chunk (all choices).")
    nasd: dict[str, Any] | None = Field(None, description="This request's speculation counters (last chunk).")
    replica: dict[str, Any] | None = Field(None, description="The replica's stats after it (last chunk).")
    error: ErrorInfo | None = Field(None, description="Set when the request failed.")
    status_code: int = Field(200, description="HTTP status of the error.")
    prompt_tokens: int = Field(0, description="The request's prompt tokens (counted against its key).")
    tokens: int = Field(0, description="Tokens generated for this choice since its previous chunk.")
