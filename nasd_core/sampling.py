"""Logits processing (temperature, top-k, top-p) and seeded, counter-based token sampling.

The sampled token at output position t of a request uses the uniform draw ``u_t``, a hash
of (the request's seed, t): a counter-based generator. A step can therefore take the draws
of every position it verifies at once and sample them all on the model's device in one
pass, and plain and speculative decoding use the same draw for the same output position
whatever the draft lengths, which is what makes a seeded request reproducible with
speculation off, on or auto. Reusing ``u_t`` after a rejection at an earlier position is
sound: everything that decided the rejection depends only on the draws before t.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from nasd_core.config import SamplingParams

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


class TokenDraws:
    """The uniform draws of one request's output positions (SplitMix64 of seed and position).

    Args:
        seed: the request's seed; None draws a fresh random one.
    """

    def __init__(self, seed: int | None) -> None:
        key = secrets.randbits(64) if seed is None else seed
        self.key = np.uint64(key % 2**64)

    def uniforms(self, start: int, count: int) -> np.ndarray:
        """Draws in [0, 1) of output positions ``start .. start + count - 1`` (float64)."""
        with np.errstate(over="ignore"):
            state = self.key + (np.arange(start + 1, start + count + 1, dtype=np.uint64) * _GOLDEN)
            state = (state ^ (state >> np.uint64(30))) * _MIX_1
            state = (state ^ (state >> np.uint64(27))) * _MIX_2
            state ^= state >> np.uint64(31)
        return (state >> np.uint64(11)).astype(np.float64) * 2.0**-53


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


def sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF samples of ``[n, vocab]`` distributions with one draw each (stays on the
    device of ``probs``; float64 sums, so a draw lands on the same token on any device)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    targets = uniforms.to(cdf.device, torch.float64).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding can leave a target at cdf[-1] (past the vocabulary) or on a token without mass:
    # step back to the last token with mass. On a CPU that full-vocabulary pass runs only for a
    # draw that needs it; on a device, always, since asking would wait for the device.
    vocab_size = probs.shape[-1]
    if probs.device.type == "cpu":
        picked = probs.gather(1, tokens.clamp(max=vocab_size - 1).unsqueeze(1)).squeeze(1)
        if not bool(((tokens >= vocab_size) | (picked <= 0)).any()):
            return tokens
    vocab = torch.arange(vocab_size, device=probs.device)
    last_with_mass = torch.where(probs > 0, vocab, 0).amax(dim=-1)
    return torch.minimum(tokens, last_with_mass)
