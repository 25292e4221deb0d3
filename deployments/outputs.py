"""A replica's output processing: each choice's tokens on their way out as text that never
needs taking back (``TextStream``: stop strings cut, half characters held), split into the
model's reasoning (``reasoning.ReasoningStream``), its answer and its tool calls
(``tools.ToolStream``), with logprobs, and sent as ``GenerateChunk``s (``ChoiceOutput``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from deployments.reasoning import ANSWER, REASONING, ReasoningStream
from deployments.schemas import GenerateChunk, TokenLogprob, ToolCall
from deployments.tools import ToolFormat, ToolStream
from nasd_core import logprobs as engine_logprobs
from nasd_core.config import SamplingParams
from nasd_core.engine.async_engine import StreamChunk


class TextStream:
    """Turns a growing list of output ids into text deltas that never need taking back.

    While a request runs, the tail that could still be the start of a stop string (and an
    incomplete UTF-8 character) is held back; at the end the text is cut where the engine found
    the stop string that ended it (``StreamChunk.stop_text_at``), as the library's result is.
    """

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_ids: list[int] = []
        self.num_sent = 0

    def push(self, token_ids: Sequence[int], finished: bool, stop_at: int | None = None) -> str:
        """The new text that can be sent; ``stop_at`` (with ``finished``): where the text ends."""
        self.output_ids.extend(token_ids)
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        if finished:
            end = len(text) if stop_at is None else stop_at
        else:
            end = len(text) - self.holdback
            while end > self.num_sent and text[end - 1] == "\ufffd":  # a character still arriving
                end -= 1
        delta = text[self.num_sent : end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return delta


def logprob_entries(tokenizer, logprobs: Sequence[engine_logprobs.TokenLogprob]) -> list[TokenLogprob]:
    """The API's logprob entries of engine ``logprobs``: each token as its own decoded text."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        TokenLogprob(
            **entry(item.token_id, item.logprob),
            top_logprobs=[entry(token_id, logprob) for token_id, logprob in item.top],
        )
        for item in logprobs
    ]


def prompt_entries(
    tokenizer, prompt_ids: Sequence[int], logprobs: Sequence[engine_logprobs.TokenLogprob | None]
) -> list[TokenLogprob]:
    """An echoed prompt's logprob entries: its first token has none (nothing came before it)."""
    first = tokenizer.decode([prompt_ids[0]])
    return [
        TokenLogprob(token=first, logprob=None, bytes=list(first.encode("utf-8"))),
        *logprob_entries(tokenizer, logprobs[1:]),
    ]


@dataclass(frozen=True)
class ToolParsing:
    """How a request's answer is read for tool calls: the model's format, the declared tools."""

    format: ToolFormat
    names: frozenset[str]


class ChoiceOutput:
    """One choice's text, tool calls and logprobs on their way out: what is pending until the
    next chunk. With a tool format, the answer's calls are split from its content."""

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        echo: str,
        tools: ToolParsing | None = None,
        num_prompt_tokens: int = 0,
        reasoning: ReasoningStream | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.pending_tokens = 0  # generated since the last chunk
        self.text = TextStream(tokenizer, params.stop)
        self.tools = ToolStream(tools.format, tools.names) if tools is not None else None
        # Each choice splits its own answer (a copy of the request's split, at its start).
        self.reasoning = replace(reasoning) if reasoning is not None else None
        self.pending = echo  # echo: the prompt leads the answer
        self.pending_reasoning = ""
        self.num_reasoning_tokens = 0  # generated while the answer was in its reasoning
        self.pending_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None

    @property
    def has_pending(self) -> bool:
        return bool(self.pending or self.pending_reasoning or self.pending_calls or self.logprobs)

    def add(self, step: StreamChunk, echoed_prompt: list[int] | None) -> None:
        finished = step.finish_reason is not None
        self.pending_tokens += len(step.token_ids)
        text = self._answer_text(step.token_ids, finished, step.stop_text_at)
        if self.tools is not None:  # tool calls are read from the answer after the reasoning
            text, calls = self.tools.push(text, finished)
            self.pending_calls += calls
        self.pending += text
        if self.logprobs is None:
            return
        if echoed_prompt is not None and step.prompt_logprobs is not None:
            self.logprobs += prompt_entries(self.tokenizer, echoed_prompt, step.prompt_logprobs)
        if step.logprobs:
            self.logprobs += logprob_entries(self.tokenizer, step.logprobs)

    def _answer_text(self, token_ids: Sequence[int], finished: bool, stop_at: int | None) -> str:
        """The new tokens' answer text, their reasoning added to what is pending. Until the
        reasoning ends the tokens go through one at a time, so that each one is counted as
        reasoning or not whatever the grouping of tokens into steps: a token is reasoning where
        the split is in the reasoning before or after it (so the closing marker's are)."""
        if self.reasoning is None:
            return self.text.push(token_ids, finished, stop_at)
        if self.reasoning.state == ANSWER or not token_ids:
            reasoning, text = self.reasoning.push(self.text.push(token_ids, finished, stop_at), finished)
            self.pending_reasoning += reasoning
            return text
        answer = []
        for position, token_id in enumerate(token_ids):
            last = finished and position == len(token_ids) - 1
            was_reasoning = self.reasoning.state == REASONING
            reasoning, text = self.reasoning.push(self.text.push([token_id], last, stop_at), last)
            self.pending_reasoning += reasoning
            answer.append(text)
            self.num_reasoning_tokens += was_reasoning or self.reasoning.state == REASONING
        return "".join(answer)

    def chunk(self, index: int, finish_reason: str | None) -> GenerateChunk:
        """The pending text and logprobs as a chunk (the choice's last with ``finish_reason``)."""
        if finish_reason == "stop" and self.tools is not None and self.tools.calls:
            finish_reason = "tool_calls"
        chunk = GenerateChunk(
            index=index,
            text=self.pending,
            reasoning=self.pending_reasoning or None,
            tool_calls=self.pending_calls or None,
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            prompt_tokens=self.num_prompt_tokens,
            tokens=self.pending_tokens,
        )
        self.pending, self.pending_reasoning, self.pending_calls, self.pending_tokens = "", "", [], 0
        self.logprobs = [] if self.logprobs is not None else None
        self.finish_reason = finish_reason
        return chunk
