"""Logits processing (temperature, top-k, top-p) and seeded token sampling.

Every sampled token consumes exactly one uniform draw from the request's generator, in
order. Plain decoding and speculative decoding therefore spend the same draws on the same
positions, which is what makes a seeded request reproducible whatever the draft length.
"""

from __future__ import annotations

import numpy as np
import torch

from nasd_core.config import SamplingParams


def make_generator(seed: int | None) -> np.random.Generator:
    """A request's private generator (``seed=None`` draws fresh OS entropy)."""
    return np.random.default_rng(seed)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn ``[n, vocab]`` logits into the sampling distribution of each row (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass strictly before it is < top_p (the top token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(probs: torch.Tensor, generator: np.random.Generator) -> int:
    """Inverse-CDF sample of one token from a ``[vocab]`` distribution with one uniform draw."""
    probs = probs.cpu()  # one device for the draw, so a seed gives the same token everywhere
    cdf = torch.cumsum(probs.double(), dim=0)
    target = generator.random() * float(cdf[-1])
    token = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    # Rounding can leave target == cdf[-1]; step back to the last token with mass.
    return min(token, int(torch.nonzero(probs).max()))
