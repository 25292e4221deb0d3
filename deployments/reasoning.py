"""Reasoning output: a reasoning model's thinking split from its answer.

A reasoning model (Qwen3, DeepSeek-R1) thinks between ``<think>`` and ``</think>`` before it
answers. The server returns that text as chat's ``message.reasoning`` (and ``reasoning_content``,
which older clients read), as reasoning deltas in a stream, and as a Responses ``reasoning`` item,
as vLLM and llama.cpp do. Tool calls are parsed from the answer after it, and a request's grammar
constrains only that answer (``nasd_core.config.ReasoningSpec``).

Where reasoning starts is read off the end of the rendered prompt, for both formats:

- a prompt that ends with ``<think>`` opened it (DeepSeek-R1's template, Qwen3's thinking-only
  ones): the answer is reasoning until ``</think>``;
- a prompt that ends with ``</think>`` closed it (Qwen3 with ``enable_thinking`` false renders an
  empty block): the answer is all answer;
- otherwise ``qwen3``'s answer reasons only if it opens with ``<think>``, and ``deepseek_r1``'s
  is reasoning until ``</think>`` (R1 may leave out the opening tag; without the closing one, the
  whole answer is reasoning).

The setting is ``reasoning_parser``: ``auto`` picks ``qwen3`` for a chat template that writes
``</think>`` and no parser otherwise (the embedded SmolLM2's), as vLLM's ``--reasoning-parser``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deployments.streams import marker_start_length
from nasd_core.config import ReasoningSpec

ReasoningParser = Literal["auto", "qwen3", "deepseek_r1", "none"]

# Where a stream stands in an answer.
MAY_OPEN, REASONING, ANSWER = "may_open", "reasoning", "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its reasoning.

    Attributes:
        name: the ``reasoning_parser`` value that selects it.
        start, end: the texts that open and close the reasoning.
        implicit: whether an answer the prompt left undecided is reasoning from its start.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit: bool = False

    def first_state(self, prompt_tail: str) -> str:
        """Where an answer starts, from the end of its rendered prompt (module docstring)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return ANSWER
        if tail.endswith(self.start) or self.implicit:
            return REASONING
        return MAY_OPEN

    def grammar_spec(self, tokenizer, state: str) -> ReasoningSpec | None:
        """What a grammar lets through before it constrains an answer that starts in ``state``;
        None where the answer has no reasoning, or where the tokenizer has no single token for
        each marker: the engine follows token ids, and a marker the model could write in other
        tokens than ``encode``'s would leave the grammar waiting for good (reasoning models'
        tokenizers have one token each)."""
        if state == ANSWER:
            return None
        end_ids = tokenizer.encode(self.end, add_special_tokens=False)
        start_ids = tokenizer.encode(self.start, add_special_tokens=False)
        if len(end_ids) != 1 or len(start_ids) != 1:
            return None
        if state == REASONING:
            return ReasoningSpec(end_ids=end_ids, open=True)
        return ReasoningSpec(end_ids=end_ids, start_id=start_ids[0])


QWEN3 = ReasoningFormat(name="qwen3")
DEEPSEEK_R1 = ReasoningFormat(name="deepseek_r1", implicit=True)
FORMATS = {reasoning_format.name: reasoning_format for reasoning_format in (QWEN3, DEEPSEEK_R1)}


def reasoning_format(chat_template: str | None, setting: str = "auto") -> ReasoningFormat | None:
    """The format of ``setting``; with ``auto``, qwen3's for a template that writes ``</think>``,
    else none."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    return QWEN3 if chat_template and QWEN3.end in chat_template else None


@dataclass
class ReasoningStream:
    """Splits a streamed answer into reasoning and the answer proper, whatever the grouping of
    its text into deltas: a tail that may be the start of a marker is held back until the next
    delta tells. The line breaks right after the closing marker are dropped.

    ``push`` takes new answer text and returns (reasoning to send, answer text to send).
    """

    fmt: ReasoningFormat
    state: str
    text: str = ""  # held back: what may be part of a marker
    opening: bool = True  # at the answer's start, which may open with the start marker
    at_answer_start: bool = False  # dropping the line breaks after the closing marker

    def without_reasoning(self) -> None:
        """Read the whole answer as answer (a grammar constrains it from its first token)."""
        self.state, self.opening = ANSWER, False

    def push(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        if self.opening and self.state != ANSWER:
            start = self.fmt.start
            if len(self.text) < len(start) and start.startswith(self.text) and not finished:
                return "", ""
            self.opening = False
            if self.text.startswith(start):
                self.text, self.state = self.text[len(start) :], REASONING
            elif self.state == MAY_OPEN:
                self.state = ANSWER
        reasoning = ""
        if self.state == REASONING:
            end = self.text.find(self.fmt.end)
            if end < 0:
                keep = 0 if finished else marker_start_length(self.text, [self.fmt.end])
                reasoning, self.text = self.text[: len(self.text) - keep], self.text[len(self.text) - keep :]
                return reasoning, ""
            reasoning, self.text = self.text[:end], self.text[end + len(self.fmt.end) :]
            self.state, self.at_answer_start = ANSWER, True
        if self.at_answer_start:  # the blank lines after the marker, not an answer's indentation
            self.text = self.text.lstrip("\r\n")
            self.at_answer_start = not self.text
        answer, self.text = self.text, ""
        return reasoning, answer
