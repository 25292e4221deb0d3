"""Logits processors of one request: a grammar's mask, logit bias, min_tokens,
repetition/presence/frequency penalties.

Semantics are vLLM's (what an OpenAI client of an open server expects):

- ``logit_bias``: ``{token id: bias}`` added to that token's logit.
- ``min_tokens``: until that many tokens are out, the end-of-sequence and stop ids are banned.
- ``repetition_penalty`` (> 0, 1 = off): a token seen in the prompt or the output has its
  logit divided by the penalty when positive, multiplied when not.
- ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]): subtracted once if the token is
  in the output / once per occurrence in the output.

- ``grammar``: tokens the request's grammar forbids get -inf (``nasd_core/structured.py``).

The grammar's mask, bias and the ban come first, then the penalties, then temperature, top-k
and top-p.

Exact under speculation: a step verifies ``[last token, d_1 .. d_g]`` and the logits at
position j predict the output token that follows the output so far *plus d_1 .. d_j*. The
penalties there must count those drafts, since position j's target only matters when all of
them were accepted; so ``apply`` processes every position with its own counts (one
cumulative sum over the drafts), and a greedy step emits exactly what plain decoding with the
same processors would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from nasd_core.config import SamplingParams
from nasd_core.structured import RequestGrammar, apply_masks


def needs_processing(params: SamplingParams) -> bool:
    """Whether any processor of ``params`` changes the logits."""
    return bool(
        params.grammar is not None
        or params.logit_bias
        or params.min_tokens
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
    )


class LogitsProcessors:
    """One request's processors and the token counts they need.

    Args:
        params: the request's sampling parameters.
        prompt_ids: its prompt (the repetition penalty counts prompt tokens too).
        vocab_size: rows of logits are this wide.
        stop_ids: the ids ``min_tokens`` holds back (end-of-sequence and stop ids).
        grammar: the request's grammar state (``params.grammar`` compiled), or None.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        stop_ids: Iterable[int],
        grammar: RequestGrammar | None = None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        # Counts live on the host until the first step moves them to the logits' device.
        self.output_counts = torch.zeros(vocab_size)
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)
        self.prompt_seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        self.bias_ids = torch.tensor([int(token) for token in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    def observe(self, tokens: Sequence[int]) -> None:
        """Count tokens the request kept (and move its grammar past them)."""
        if self.grammar is not None:
            self.grammar.observe(tokens)
        if tokens:
            index = torch.tensor(list(tokens), dtype=torch.long, device=self.output_counts.device)
            self.output_counts.index_add_(0, index, torch.ones(len(tokens), device=index.device))

    def apply(
        self,
        logits: torch.Tensor,
        draft: Sequence[int],
        num_output: int,
        grammar_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Processed copy of one row's ``[len(draft) + 1, vocab]`` verification logits (float32);
        position j follows the output (``num_output`` tokens) plus ``draft[:j]``.
        ``grammar_mask``: the row's grammar bitmasks, computed with the step's other rows
        (``structured.grammar_masks``); None: computed here."""
        params = self.params
        device = logits.device
        if self.output_counts.device != device:
            self.output_counts = self.output_counts.to(device)
            self.prompt_seen = self.prompt_seen.to(device)
        logits = logits.float().clone()
        num_positions = logits.shape[0]
        if self.grammar is not None:
            if grammar_mask is None:
                self.grammar.mask(logits, draft)
            else:
                apply_masks(logits, grammar_mask)
        if len(self.bias_ids):
            logits[:, self.bias_ids.to(device)] += self.bias_values.to(device)
        # Output positions num_output + j below min_tokens may not end the request.
        num_banned = min(num_positions, max(0, params.min_tokens - num_output))
        if num_banned and self.stop_ids:
            logits[:num_banned, torch.tensor(self.stop_ids, device=device)] = float("-inf")
        if params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty:
            return logits
        counts = self.output_counts.expand(num_positions, -1)
        if draft:
            # Position j counts draft[:j]: one-hot at the row after each draft, summed down.
            added = torch.zeros(num_positions, self.vocab_size, device=device)
            rows = torch.arange(1, len(draft) + 1, device=device)
            added[rows, torch.tensor(list(draft), dtype=torch.long, device=device)] = 1.0
            counts = counts + added.cumsum(dim=0)
        if params.repetition_penalty != 1.0:
            seen = self.prompt_seen | (counts > 0)
            penalised = torch.where(
                logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
            )
            logits = torch.where(seen, penalised, logits)
        if params.frequency_penalty:
            logits -= params.frequency_penalty * counts
        if params.presence_penalty:
            logits -= params.presence_penalty * (counts > 0).float()
        return logits
