"""The server's wire formats: the OpenAI API's requests (``requests``) and answers (``answers``),
and what the ingress and a replica exchange through a deployment handle (``protocol``).

Import them from here: ``from deployments.schemas import ChatCompletionRequest``.
"""
# ruff: noqa: F401 (the package re-exports its modules' names)

from deployments.schemas.answers import (
    REASONING_FIELDS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    ErrorInfo,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
)
from deployments.schemas.protocol import (
    GenerateChunk,
    GenerateRequest,
    TokensResult,
)
from deployments.schemas.requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    MAX_CHOICES,
    MAX_PROMPTS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Role,
    SamplingFields,
    SpeculationMode,
    StreamOptions,
    StructuredOutputs,
    TextPart,
    TokenizeRequest,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoiceMode,
)
