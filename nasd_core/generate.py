"""Single-sequence NASD loop: draft from n-grams, verify in one forward pass, keep the KV-cache.

Each step feeds ``[last token, d1..dg]`` to the model on top of the cached prefix, keeps
the accepted drafts plus one token of the model's own, and drops the rejected positions
from the cache with the cache's public ``crop``. The output is exactly what plain decoding
produces: token-identical under greedy, distribution-identical under sampling.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from nasd_core.batch_kv import BatchKV
from nasd_core.config import SamplingParams, SpecConfig, build
from nasd_core.drafter import RequestDrafter
from nasd_core.errors import ContextLengthError, InvalidRequestError
from nasd_core.metrics import SpecStats
from nasd_core.ngram import NGramIndex
from nasd_core.policy import StepTimeModel, choose_draft_length
from nasd_core.sampling import make_generator
from nasd_core.sequence import Request
from nasd_core.stopping import FinishReason, StopChecker
from nasd_core.verify import verify

TokenCallback = Callable[[list[int]], None]

# Verification widths the warm-up probe times: every small width the policy weighs often,
# and sparse wide ones up to the default draft cap (16) that the model interpolates between.
PROBE_POSITIONS = (1, 2, 3, 4, 5, 6, 9, 17)

# Step times measured on a model outlive one request: later requests start calibrated.
_STEP_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_step_time(model) -> StepTimeModel:
    """The step-time model shared by every ``generate`` call on ``model``."""
    if model not in _STEP_TIMES:
        _STEP_TIMES[model] = StepTimeModel()
    return _STEP_TIMES[model]


@dataclass
class GenerationResult:
    """What one request produced.

    Attributes:
        token_ids: generated ids (a final end-of-sequence id included, as transformers does).
        text: decoded output, special tokens removed, cut before any stop string.
        finish_reason: "stop" (eos, stop id or stop string) or "length" (max_tokens).
        prompt_ids: the prompt as token ids.
        stats: speculation counters of this request.
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_ids: list[int]
    stats: SpecStats = field(default_factory=SpecStats)


def prefill(model, token_ids: Sequence[int], cache: DynamicCache) -> None:
    """Feed prompt tokens into ``cache`` without their logits: nobody reads them, and the
    vocabulary projection was 14-26% of a 123-133 token prompt's prefill on the embedded model."""
    inputs = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    model(input_ids=inputs, past_key_values=cache, use_cache=True, **_last_logits_only(model))


def _last_logits_only(model) -> dict[str, int]:
    # transformers' causal LMs take logits_to_keep (0 = all); a custom model may not.
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return {"logits_to_keep": 1}
    return {}


class KVDecoder:
    """One sequence's model state: feeds tokens on top of the cached prefix, rolls back rejects.

    With ``use_cache=False`` it recomputes the whole sequence every call (the slow path the
    seeds default to); the logits it returns are the same either way.
    """

    def __init__(self, model, use_cache: bool = True) -> None:
        self.model = model
        self.use_cache = use_cache
        self.device = model.device
        self._cache = None
        self._tokens: list[int] = []

    @property
    def num_tokens(self) -> int:
        """Tokens the model has seen (and, with the cache, holds keys and values for)."""
        return len(self._tokens)

    def prefill(self, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` without computing their logits."""
        self._tokens.extend(token_ids)
        if self.use_cache:
            self._cache = self._cache if self._cache is not None else DynamicCache()
            prefill(self.model, token_ids, self._cache)

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` and return their ``[len(token_ids), vocab]`` logits."""
        self._tokens.extend(token_ids)
        if self.use_cache:
            inputs = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
            output = self.model(input_ids=inputs, past_key_values=self._cache, use_cache=True)
            self._cache = output.past_key_values
            return output.logits[0]
        inputs = torch.tensor([self._tokens], dtype=torch.long, device=self.device)
        output = self.model(input_ids=inputs, use_cache=False)
        return output.logits[0, -len(token_ids) :]

    def discard(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` tokens (rejected drafts)."""
        if num_tokens <= 0:
            return
        del self._tokens[-num_tokens:]
        if self._cache is not None:
            # Negative = "remove this many" in every transformers release that has crop().
            self._cache.crop(-num_tokens)


def encode_prompt(tokenizer, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """Token ids of a text or id-list prompt; raises InvalidRequestError on empty/out-of-vocab input."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if tokenizer is None:
            raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids", param="prompt")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        prompt_ids = list(prompt)
        if any(not isinstance(token, int) or isinstance(token, bool) for token in prompt_ids):
            raise InvalidRequestError("prompt token ids must be integers", param="prompt")
    if not prompt_ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    bad = [token for token in prompt_ids if not 0 <= token < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    return prompt_ids


def check_context(model, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise ContextLengthError when the prompt plus ``max_tokens`` exceed the context window."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and num_prompt_tokens + max_tokens > limit:
        raise ContextLengthError(
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{num_prompt_tokens} and max_tokens asks for {max_tokens}",
            param="max_tokens",
        )


def eos_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id the model or tokenizer declares."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    spec: SpecConfig | None = None,
    shared: Sequence[tuple[str, NGramIndex]] = (),
    use_cache: bool = True,
    on_tokens: TokenCallback | None = None,
    local_index: NGramIndex | None = None,
    step_time: StepTimeModel | None = None,
) -> GenerationResult:
    """Generate a continuation of ``prompt`` with n-gram speculative decoding.

    Args:
        model: a causal LM (transformers ``AutoModelForCausalLM``), in eval mode.
        tokenizer: its tokenizer.
        prompt: text (tokenized without special tokens) or token ids.
        params: sampling parameters (default: greedy, 128 tokens).
        spec: speculation settings (default: auto, draft cap 16, hybrid request-local source).
        shared: read-only ``(name, index)`` draft sources after the request's own tokens.
        use_cache: keep the KV-cache across steps (False recomputes every step).
        on_tokens: called with each step's newly emitted tokens (streaming).
        local_index: request-local index to use (and grow) instead of a fresh one.
        step_time: measured step times the ``auto`` mode weighs drafts against (default: the
            model's shared one, so later requests start calibrated; see ``measure_step_times``).

    Returns:
        GenerationResult with the tokens, the text, the finish reason and the stats.

    Raises:
        InvalidRequestError: empty prompt, token ids outside the vocabulary, bad parameters.
        ContextLengthError: prompt plus max_tokens longer than the model's context.
    """
    params = params if params is not None else build(SamplingParams)
    spec = spec if spec is not None else build(SpecConfig)
    vocab_size = model.config.vocab_size
    prompt_ids = encode_prompt(tokenizer, prompt, vocab_size)
    check_context(model, len(prompt_ids), params.max_tokens)

    request = Request(
        request_id="generate",
        prompt_ids=prompt_ids,
        params=params,
        spec=spec,
        stopper=StopChecker(tokenizer, params, eos_ids(model, tokenizer)),
        drafter=RequestDrafter(spec, shared, local_index, vocab_size, params.seed),
        generator=make_generator(params.seed),
    )
    stats, drafter = request.stats, request.drafter
    decoder = KVDecoder(model, use_cache)
    step_time = step_time if step_time is not None else model_step_time(model)

    # Prefill all but the last prompt token: every step, the first included, then looks
    # the same - [last token, drafts...] - and the first step can already speculate.
    started = time.perf_counter()
    if len(prompt_ids) > 1:
        decoder.prefill(prompt_ids[:-1])
    stats.prefill_time_s = time.perf_counter() - started
    drafter.observe(request.tokens)
    stats.drafting_time_s += time.perf_counter() - started - stats.prefill_time_s

    decode_started = time.perf_counter()
    while not request.stopper.is_finished:
        draft_started = time.perf_counter()
        draft = request.propose()
        num_drafted = len(draft.tokens)
        if spec.mode == "auto" and draft.tokens:
            num_drafted = choose_draft_length(num_drafted, draft.match_length, request.acceptance, step_time)
        stats.drafting_time_s += time.perf_counter() - draft_started

        forward_started = time.perf_counter()
        proposal = draft.tokens[:num_drafted]
        logits = decoder.forward([request.tokens[-1], *proposal])
        emitted = verify(logits, proposal, params, request.generator)
        step_time.observe(1, 1 + num_drafted, time.perf_counter() - forward_started)
        decoder.discard(num_drafted - (len(emitted) - 1))

        learn_started = time.perf_counter()
        if spec.filler_top_k > 1 and spec.is_speculating:
            top = torch.topk(logits[: len(emitted)], spec.filler_top_k, dim=-1).indices.tolist()
            tail = request.tokens[-spec.max_ngram :]
            for position, alternatives in enumerate(top):
                drafter.learn_alternatives(tail + emitted[:position], alternatives)
        kept = request.advance(draft, num_drafted, emitted)
        stats.drafting_time_s += time.perf_counter() - learn_started
        if on_tokens is not None:
            on_tokens(kept)
    stats.decode_time_s = time.perf_counter() - decode_started

    return GenerationResult(
        token_ids=request.output_ids,
        text=request.stopper.text(),
        finish_reason=request.stopper.finish_reason or "length",
        prompt_ids=prompt_ids,
        stats=stats,
    )


@torch.inference_mode()
def measure_step_times(
    model,
    positions: int | Sequence[int],
    rows: Sequence[int] = (1,),
    context_length: int = 256,
    repeats: int = 3,
    step_time: StepTimeModel | None = None,
) -> StepTimeModel:
    """Warm-up probe: time verification steps of every batch shape ``rows`` x ``positions``
    (an int means 1..positions).

    Gives the ``auto`` policy a calibrated cost surface before the first request. Every
    probe row holds ``context_length`` dummy tokens, so attention costs what a real row's
    does; batches are built like the engine's (2-D mask, explicit positions).
    """
    step_time = step_time if step_time is not None else model_step_time(model)
    positions = range(1, positions + 1) if isinstance(positions, int) else positions
    row_cache = DynamicCache()
    prefill(model, [i % model.config.vocab_size for i in range(context_length)], row_cache)
    for num_rows in rows:
        batch = BatchKV.replicated(row_cache, context_length, num_rows)
        fastest: dict[int, float] = {}
        for _ in range(repeats):
            for num_positions in positions:
                attention_mask, position_ids = batch.step_inputs([num_positions] * num_rows, num_positions)
                started = time.perf_counter()
                output = model(
                    input_ids=torch.zeros((num_rows, num_positions), dtype=torch.long, device=model.device),
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=batch.cache,
                    use_cache=True,
                )
                output.logits[-1, -1, 0].item()  # wait for the device, as verification does
                seconds = time.perf_counter() - started
                fastest[num_positions] = min(seconds, fastest.get(num_positions, seconds))
                batch.cache.crop(-num_positions)
        # The fastest repeat: interference from other processes only ever adds time.
        for num_positions, seconds in fastest.items():
            step_time.observe(num_rows, num_positions, seconds)
    return step_time


def calibrate(model, max_rows: int, repeats: int = 2) -> StepTimeModel:
    """Probe the model's shared step-time surface at 1, 2, 4, ... rows up to ``max_rows``
    (what a server does before its first request, and every benchmark before its runs)."""
    rows = {2**power for power in range(max_rows.bit_length()) if 2**power <= max_rows} | {max_rows}
    return measure_step_times(model, PROBE_POSITIONS, rows=sorted(rows), repeats=repeats)
