"""Log-probabilities of emitted tokens, read from the verification step's own logits.

The logits at an emitted token's position are the model's output for exactly the context
plain decoding would have fed (every earlier token of the step was accepted), so these are
the plain forward's log-probabilities. Like vLLM's default, they are the model's raw
distribution: before logit bias, penalties, temperature and top-k/top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprob:
    """One output token's log-probability and the ``num_top`` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``token_ids[i]`` from the logits row ``i`` (``[len(token_ids), vocab]``),
    computed on the logits' device and brought to the host in one transfer."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index.unsqueeze(1)).squeeze(1)
    top = torch.topk(logprobs, num_top, dim=-1) if num_top else None
    parts = [chosen] + ([top.values, top.indices.to(logprobs.dtype)] if top is not None else [])
    # Token ids ride in the float tensor (exact below 2**24, far above any vocabulary here).
    host = torch.cat([part.reshape(len(token_ids), -1) for part in parts], dim=1).cpu().tolist()
    results = []
    for token_id, row in zip(token_ids, host):
        values, ids = row[1 : 1 + num_top], row[1 + num_top :]
        results.append(TokenLogprob(token_id, row[0], [(int(i), v) for i, v in zip(ids, values)]))
    return results
