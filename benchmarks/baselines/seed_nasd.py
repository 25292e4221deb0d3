"""Baseline: the seeds' NASD algorithm re-implemented as published (romsto/Speculative-Decoding).

Kept faithful on purpose, so the benchmark measures what this project changed:
* storage: per-level dicts keyed by tuples; contexts of n-1 down to 2 tokens (the seeds'
  ``range(n - 1, 1, -1)``); every lookup and update converts torch tensors with ``tolist``;
* drafting: one ``next_token`` call per draft position on a cloned id tensor, stopping at
  an unknown context (``stop_if_unknown=True``, as in the seeds' usage example);
* verification: greedy matching of the target's choice against each draft, bonus token;
* updates: accepted tokens plus the target's top-k (``filler_top_k=3``) at each position.
The one fix: the KV-cache is used (the seeds' default recomputes everything each step,
which would make the baseline a straw man) and rolled back with the public ``crop``.
"""

from __future__ import annotations

import torch


class SeedNGramStorage:
    """Multi-level storage with the seeds' semantics (contexts of n-1..2 tokens)."""

    def __init__(self, n: int, vocab_size: int) -> None:
        self.n = n
        self.vocab_size = vocab_size
        self.counts: dict[int, dict[tuple, dict[int, int]]] = {}
        self.best: dict[int, dict[tuple, int]] = {}

    def _add(self, level: int, gram: tuple, token: int) -> None:
        counts = self.counts.setdefault(level, {}).setdefault(gram, {})
        best = self.best.setdefault(level, {})
        best.setdefault(gram, token)
        counts[token] = counts.get(token, 0) + 1
        if counts[token] > counts.get(best[gram], 0):
            best[gram] = token

    def initialize(self, input_ids: torch.Tensor) -> None:
        for seq in input_ids:
            for i in range(seq.shape[0]):
                for level in range(min(self.n - 1, i), 1, -1):
                    self._add(level, tuple(seq[i - level : i].tolist()), seq[i].item())

    def update(self, input_ids: torch.Tensor, next_tokens: torch.Tensor) -> None:
        for i, seq in enumerate(input_ids):
            tokens = next_tokens[i].tolist() if next_tokens.dim() > 1 else [next_tokens[i].item()]
            for level in range(min(self.n - 1, seq.shape[0]), 1, -1):
                gram = tuple(seq[-level:].tolist())
                for token in tokens:
                    self._add(level, gram, token)

    def next_token(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.randint(self.vocab_size, size=(input_ids.shape[0],))
        known = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for i, seq in enumerate(input_ids):
            for level in range(min(self.n - 1, seq.shape[0]), 1, -1):
                gram = tuple(seq[-level:].tolist())
                if gram in self.best.get(level, {}):
                    out[i], known[i] = self.best[level][gram], True
                    break
        return out, known


@torch.inference_mode()
def seed_nasd_generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    n: int = 3,
    gamma: int = 5,
    filler_top_k: int = 3,
) -> list[int]:
    """Greedy NASD as published; returns the generated ids (end token included)."""
    storage = SeedNGramStorage(n, model.config.vocab_size)
    prompt_len = len(prompt_ids)
    total_len = prompt_len + max_new_tokens
    input_ids = torch.zeros((1, total_len), dtype=torch.long)
    input_ids[0, :prompt_len] = torch.tensor(prompt_ids)
    storage.initialize(input_ids[:, :prompt_len])

    # The n-gram table and the ids live on the host; only the model's inputs go to its device.
    out = model(input_ids=input_ids[:, :prompt_len].to(model.device), use_cache=True)
    cache = out.cache
    first = out.logits[:, -1, :].argmax(-1).cpu()
    input_ids[0, prompt_len] = first
    storage.update(input_ids[:, :prompt_len], first)
    position = prompt_len + 1
    if first.item() in eos_ids:
        return input_ids[0, prompt_len:position].tolist()

    while position < total_len:
        corrected_gamma = min(gamma, total_len - position - 1)
        drafts = input_ids.clone()
        for k in range(corrected_gamma):
            token, known = storage.next_token(drafts[:, : position + k])
            if not known[0]:
                corrected_gamma = k
                break
            drafts[0, position + k] = token[0]
        # Feed [last accepted, drafts...]: the cache holds everything before the last token.
        step = model(
            input_ids=drafts[:, position - 1 : position + corrected_gamma].to(model.device),
            cache=cache,
            use_cache=True,
        )
        cache = step.cache
        choices = step.logits[0].argmax(-1).cpu()
        accepted = corrected_gamma
        for i in range(corrected_gamma):
            if drafts[0, position + i] != choices[i]:
                accepted = i
                break
        if corrected_gamma > accepted:
            cache.crop(-(corrected_gamma - accepted))
        input_ids[0, position : position + accepted] = drafts[0, position : position + accepted]
        bonus = choices[accepted]
        input_ids[0, position + accepted] = bonus
        top = step.logits[0].topk(filler_top_k).indices.cpu() if filler_top_k > 1 else None
        for i in range(accepted + 1):
            context = input_ids[:, : position + i]
            storage.update(context, input_ids[:, position + i])
            if top is not None:
                storage.update(context, top[i].unsqueeze(0))
        emitted = input_ids[0, position : position + accepted + 1].tolist()
        for offset, token in enumerate(emitted):
            if token in eos_ids:
                return input_ids[0, prompt_len : position + offset + 1].tolist()
        position += accepted + 1
    return input_ids[0, prompt_len:total_len].tolist()
