"""The seeds' API (romsto/Speculative-Decoding's NASD) on top of this library.

``NGramStorage(n, vocab_size)`` / ``OneLevelNGramStorage(n, vocab_size)`` keep the seeds'
constructors and methods, the logits processors keep their names, and
``ngram_assisted_speculative_generate`` keeps its signature and return value. Underneath,
everything runs on ``nasd_core.generate`` (a one-row engine): the paged KV-cache with rollback,
the lossless sampled rule, plain-int n-gram indexes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nasd_core.config import IndexConfig, SamplingParams, SpecConfig, build
from nasd_core.generate import generate
from nasd_core.sampling import logits_to_probs
from nasd_core.speculation.ngram import NGramIndex

# A storage is private to its caller; its budget only guards against runaway growth.
_STORAGE_MAX_ENTRIES = 10_000_000


def _rows(input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Normalise a tensor or (nested) list of ids to a list of rows."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.tolist()
    input_ids = list(input_ids)
    if input_ids and isinstance(input_ids[0], int):
        return [input_ids]
    return [list(row) for row in input_ids]


class _SeedStorage:
    """The seeds' INgramStorage interface over an ``NGramIndex`` (``.index``)."""

    def __init__(self, n: int, vocab_size: int, min_context: int) -> None:
        if n < 2:
            raise ValueError("n should be greater than 1")
        self.n = n
        self.vocab_size = vocab_size
        self.index = NGramIndex(
            IndexConfig(
                max_ngram=n - 1, min_ngram=min_context, max_entries=_STORAGE_MAX_ENTRIES, max_successors=256
            )
        )

    def next_token(self, input_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Most frequent next token of each row (random where unknown) and whether it was known."""
        rows = _rows(input_ids)
        out = torch.randint(self.vocab_size, size=(len(rows),))
        known = torch.zeros(len(rows), dtype=torch.bool)
        for i, row in enumerate(rows):
            match = self.index.lookup(row)
            if match is not None:
                out[i], known[i] = match.token, True
        return out, known

    def has_gram(self, ngram) -> bool:
        """Whether the last token of ``ngram`` was seen after some stored suffix of the rest."""
        tokens = _rows(ngram)[0]
        context = tokens[:-1]
        return any(
            tokens[-1] in self.index.successors(context[len(context) - length :])
            for length in range(self.index.min_ngram, min(self.index.max_ngram, len(context)) + 1)
        )

    def update(self, input_ids, next_tokens) -> None:
        """Count each of ``next_tokens[i]`` after the stored suffixes of row i."""
        for row, tokens in zip(_rows(input_ids), _rows(next_tokens)):
            for token in tokens:
                self.index.add(row, token)

    def initialize(self, input_ids) -> None:
        """Learn every n-gram of the given rows."""
        self.index.update_many(_rows(input_ids))

    def reset(self) -> None:
        self.index.clear()


class NGramStorage(_SeedStorage):
    """Multi-level storage: contexts of n-1 tokens down to 1, longest known first."""

    def __init__(self, n: int, vocab_size: int) -> None:
        super().__init__(n, vocab_size, min_context=1)


class OneLevelNGramStorage(_SeedStorage):
    """One-level storage: exactly n-1 tokens of context, no fallback."""

    def __init__(self, n: int, vocab_size: int) -> None:
        super().__init__(n, vocab_size, min_context=n - 1)


class LogitsProcessor:
    """The seeds' processor shape: ``probs = processor(logits)``, ``token = processor.sample(probs)``."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> None:
        self.params = build(SamplingParams, temperature=temperature, top_k=top_k, top_p=top_p)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.params.is_greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return logits_to_probs(logits, self.params)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        if self.params.is_greedy:
            return probs.argmax(-1, keepdim=True)
        return torch.multinomial(probs, num_samples=1)


class GreedyProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__(temperature=0.0)


class MultinomialProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__(temperature=temperature)


class TopKProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0, top_k: int = 0) -> None:
        super().__init__(temperature=temperature, top_k=top_k)


class NucleusProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0, top_p: float = 1.0) -> None:
        super().__init__(temperature=temperature, top_p=top_p)


class TopKNucleusProcessor(LogitsProcessor):
    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> None:
        super().__init__(temperature=temperature, top_k=top_k, top_p=top_p)


def ngram_assisted_speculative_generate(
    inputs: list[int],
    ngramstorage: _SeedStorage,
    target,
    tokenizer=None,
    gamma: int = 5,
    filler_top_k: int = 3,
    logits_processor: LogitsProcessor | None = None,
    max_gen_len: int = 40,
    eos_tokens_id: int | list[int] = 1,
    pad_token_id: int = 0,
    use_cache: bool = False,
    first_target: bool = True,
    stop_if_unknown: bool = False,
    debug: bool = False,
) -> tuple[list[int], float]:
    """The seeds' NASD entry point.

    Returns:
        (generated ids, the end token included if one was produced; accepted / drafted).

    ``pad_token_id``, ``first_target`` and ``use_cache`` are accepted for compatibility and
    change nothing: one sequence needs no padding, this loop's first step verifies drafts
    already, and the KV-cache is always kept (the seeds' ``use_cache=False`` recomputed the
    whole sequence every step for the same logits).
    """
    processor = logits_processor or GreedyProcessor()
    eos = eos_tokens_id if isinstance(eos_tokens_id, list) else [eos_tokens_id]
    limit = getattr(target.config, "max_position_embeddings", len(inputs) + max_gen_len)
    params = build(
        SamplingParams,
        max_tokens=max(1, min(max_gen_len, limit - len(inputs))),
        temperature=processor.params.temperature,
        top_k=processor.params.top_k,
        top_p=processor.params.top_p,
        # Seeded from torch's global generator, so torch.manual_seed reproduces a run as in the seeds.
        seed=int(torch.randint(2**62, (1,)).item()),
        stop_token_ids=eos,
        ignore_eos=True,
    )
    kind = "one_level" if isinstance(ngramstorage, OneLevelNGramStorage) else "multi_level"
    spec = build(
        SpecConfig,
        mode="on",
        num_draft_tokens=gamma,
        max_ngram=ngramstorage.n - 1,
        min_ngram=ngramstorage.index.min_ngram,
        local_index=kind,
        stop_if_unknown=stop_if_unknown,
        filler_top_k=filler_top_k,
    )

    def show(tokens: list[int]) -> None:
        print(tokenizer.decode(tokens) if tokenizer is not None else tokens, flush=True)

    result = generate(
        target,
        tokenizer,
        list(inputs),
        params,
        spec,
        local_index=ngramstorage.index,
        on_tokens=show if debug else None,
    )
    return result.token_ids, result.stats.acceptance_rate
