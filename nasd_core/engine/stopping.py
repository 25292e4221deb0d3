"""Stop conditions of one request: end-of-sequence ids, stop strings, max tokens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from nasd_core.config import SamplingParams

FinishReason = Literal["stop", "length"]


class StopChecker:
    """Feeds emitted tokens one at a time and says when (and why) the request is done.

    Args:
        tokenizer: decodes the output to look for stop strings (only when there are any).
        params: the request's sampling parameters.
        eos_token_ids: the model's end-of-sequence ids (ignored with ``params.ignore_eos``).
    """

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stop_text_at: int | None = None  # char offset where a stop string begins
        self._text_checked = 0

    def extend(self, tokens: Sequence[int]) -> int:
        """Append tokens until one ends the request; returns how many were taken."""
        for taken, token in enumerate(tokens, start=1):
            self.output_ids.append(token)
            # Stop ids are banned below min_tokens (LogitsProcessors); stop strings are not
            # looked for there either, as in vLLM.
            if token in self.stop_ids or (self.params.stop and self._found_stop_string()):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                return taken
        return len(tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def text(self) -> str:
        """The output text, special tokens removed and cut before a stop string."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return text if self.stop_text_at is None else text[: self.stop_text_at]

    def _found_stop_string(self) -> bool:
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        longest = max(len(stop) for stop in self.params.stop)
        # Only the new text (plus a stop string's length of overlap) can hold a new match.
        search_from = max(0, self._text_checked - longest)
        self._text_checked = len(text)
        self.stop_text_at = first_stop_at(text, self.params.stop, search_from)
        if len(self.output_ids) < self.params.min_tokens:
            self.stop_text_at = None
        return self.stop_text_at is not None


def first_stop_at(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string in ``text[start:]`` begins, None if there is none."""
    hits = [at for at in (text.find(string, start) for string in stop) if at >= 0]
    return min(hits, default=None)
