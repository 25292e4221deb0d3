"""A request's inputs: prompt encoding and validation, the model's end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence

from nasd_core.errors import ContextLengthError, InvalidRequestError


class PromptIds(list):
    """Token ids ``encode_prompt`` has checked against a vocabulary of ``vocab_size``. Each layer
    a prompt crosses (replica, async engine, engine) asks ``encode_prompt`` for its ids; these
    come back as they are, so a prompt is encoded and checked once."""

    def __init__(self, ids: Sequence[int], vocab_size: int) -> None:
        super().__init__(ids)
        self.vocab_size = vocab_size


def encode_prompt(
    tokenizer,
    prompt: str | Sequence[int],
    vocab_size: int,
    param: str = "prompt",
    add_special_tokens: bool = False,
) -> PromptIds:
    """Token ids of a text or id-list prompt; raises InvalidRequestError (naming ``param``) on
    empty, non-Unicode or out-of-vocabulary input. ``add_special_tokens``: let the tokenizer
    add its own (a BOS token...) to a text prompt; generation feeds the text as it is."""
    if isinstance(prompt, PromptIds) and prompt.vocab_size == vocab_size:
        return prompt
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param=param)
        if tokenizer is None:
            raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids", param=param)
        try:  # JSON can carry a lone surrogate ("\ud800"), which no tokenizer can encode
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"{param} is not valid Unicode text: {exc.reason} at character {exc.start}", param=param
            ) from None
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        prompt_ids = list(prompt)
        if any(not isinstance(token, int) or isinstance(token, bool) for token in prompt_ids):
            raise InvalidRequestError("prompt token ids must be integers", param=param)
    if not prompt_ids:
        raise InvalidRequestError("prompt must not be empty", param=param)
    bad = [token for token in prompt_ids if not 0 <= token < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param
        )
    return PromptIds(prompt_ids, vocab_size)


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
