"""Verification: keep exactly the tokens the target model would have produced.

Both rules take the target's output at the ``len(draft) + 1`` positions of one forward
pass over ``[last token, draft...]`` and return the emitted tokens: the accepted drafts
followed by one token of the target's own (the correction at the first rejection, or the
bonus after a fully accepted draft). A step therefore always emits at least one token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nasd_core.config import SamplingParams
from nasd_core.sampling import logits_to_probs, sample_token


def verify_greedy(target_ids: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Greedy rule.

    Accept draft[i] iff it equals the target's argmax given the context plus draft[:i];
    at the first mismatch emit the argmax instead (correction) and stop; if every draft
    matched, the argmax after the last one is a free bonus token.
    """
    num_accepted = 0
    for drafted, target in zip(draft, target_ids):
        if drafted != target:
            break
        num_accepted += 1
    return list(target_ids[: num_accepted + 1])


def verify_sampled(probs: torch.Tensor, draft: Sequence[int], generator: np.random.Generator) -> list[int]:
    """Lossless rule for a deterministic draft (rows of ``probs`` = target distributions).

    Sample x ~ p at each position; accept the draft d if x == d and go on, else emit x
    and stop. P(emit d) = p(d) and P(emit y != d) = p(y): exactly plain sampling. This
    equals "accept d with probability p(d), else sample p with d removed", i.e. rejection
    sampling with a one-hot draft distribution.
    """
    emitted: list[int] = []
    for position in range(len(draft) + 1):
        token = sample_token(probs[position], generator)
        emitted.append(token)
        if position == len(draft) or token != draft[position]:
            break
    return emitted


def verify(
    logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, generator: np.random.Generator
) -> list[int]:
    """Emitted tokens of one row from its ``[len(draft) + 1, vocab]`` logits, by the request's rule."""
    if params.is_greedy:
        return verify_greedy(logits.argmax(dim=-1).tolist(), draft)
    return verify_sampled(logits_to_probs(logits, params), draft, generator)


def verify_rows(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    rows: Sequence[tuple[SamplingParams, np.random.Generator]],
) -> list[list[int]]:
    """Emitted tokens of every row of a step from the step's one ``[positions, vocab]`` logits
    tensor (row i's ``len(drafts[i]) + 1`` positions after row i-1's).

    Greedy rows share one argmax over every position and one transfer to the host, however
    many rows there are; sampled rows draw on the host from their own positions.
    """
    greedy_ids = logits.argmax(dim=-1).tolist() if any(params.is_greedy for params, _ in rows) else []
    emitted_rows = []
    offset = 0
    for draft, (params, generator) in zip(drafts, rows):
        end = offset + len(draft) + 1
        if params.is_greedy:
            emitted_rows.append(verify_greedy(greedy_ids[offset:end], draft))
        else:
            emitted_rows.append(verify_sampled(logits_to_probs(logits[offset:end], params), draft, generator))
        offset = end
    return emitted_rows
