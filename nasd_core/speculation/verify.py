"""Verification: keep exactly the tokens the target model would have produced.

Both rules take the target's output at the ``len(draft) + 1`` positions of one forward
pass over ``[last token, draft...]`` and return the emitted tokens: the accepted drafts
followed by one token of the target's own (the correction at the first rejection, or the
bonus after a fully accepted draft). A step therefore always emits at least one token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from nasd_core.config import SamplingParams
from nasd_core.processors import LogitsProcessors
from nasd_core.sampling import TokenDraws, logits_to_probs, sample_tokens
from nasd_core.structured import grammar_masks


class VerifyRow(NamedTuple):
    """What verification needs of one row besides its logits and draft."""

    params: SamplingParams
    draws: TokenDraws
    position: int  # output position of the row's first verified token
    processors: LogitsProcessors | None = None


def accept_prefix(target_ids: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The acceptance rule of both modes, given the target's token at each position.

    Accept draft[i] iff it equals the target token given the context plus draft[:i]; at the
    first mismatch emit the target token instead (correction) and stop; if every draft
    matched, the target token after the last one is a free bonus. Greedy: the target token
    is the argmax. Sampled: it is x ~ p drawn at that position, which makes P(emit d) = p(d)
    and P(emit y != d) = p(y), exactly plain sampling (rejection sampling with a one-hot
    draft distribution: accept d with probability p(d), else sample p with d removed).
    """
    num_accepted = 0
    for drafted, target in zip(draft, target_ids):
        if drafted != target:
            break
        num_accepted += 1
    return list(target_ids[: num_accepted + 1])


def verify_sampled(probs: torch.Tensor, draft: Sequence[int], uniforms: torch.Tensor) -> list[int]:
    """One row's sampled verification from its ``[len(draft) + 1, vocab]`` target distributions
    and the draws of those output positions."""
    return accept_prefix(sample_tokens(probs, uniforms[: len(draft) + 1]).tolist(), draft)


def verify_rows(
    logits: torch.Tensor, drafts: Sequence[Sequence[int]], rows: Sequence[VerifyRow]
) -> list[list[int]]:
    """Emitted tokens of every row of a step from the step's one ``[positions, vocab]`` logits
    tensor (row i's ``len(drafts[i]) + 1`` positions after row i-1's).

    The target token of every position (argmax for greedy rows, a sample for the others, each
    after the row's logits processors) is computed on the logits' device and brought to the
    host in one transfer for the step.
    """
    ends = list(itertools.accumulate(len(draft) + 1 for draft in drafts))
    spans = list(zip([0, *ends[:-1]], ends))
    grammar_rows = [
        (row.processors.grammar, start, draft)
        for (start, _), draft, row in zip(spans, drafts, rows)
        if row.processors is not None and row.processors.grammar is not None
    ]
    masks = grammar_masks(grammar_rows, len(logits)) if grammar_rows else None
    targets = logits.argmax(dim=-1)
    for (start, end), draft, row in zip(spans, drafts, rows):
        if row.processors is None and row.params.is_greedy:
            continue
        row_logits = logits[start:end]
        if row.processors is not None:
            row_mask = masks[start:end] if masks is not None and row.processors.grammar is not None else None
            row_logits = row.processors.apply(row_logits, draft, row.position, row_mask)
        if row.params.is_greedy:
            targets[start:end] = row_logits.argmax(dim=-1)
        else:
            uniforms = torch.from_numpy(row.draws.uniforms(row.position, end - start))
            targets[start:end] = sample_tokens(logits_to_probs(row_logits, row.params), uniforms)
    target_ids = targets.tolist()
    return [accept_prefix(target_ids[start:end], draft) for (start, end), draft in zip(spans, drafts)]
