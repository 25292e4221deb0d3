"""A prompt is encoded and checked once, however many layers it crosses."""

from __future__ import annotations

import pytest

from nasd_core.errors import InvalidRequestError
from nasd_core.inputs import PromptIds, encode_prompt


def test_encoded_ids_pass_through_and_other_vocabularies_check_them_again(tokenizer):
    vocab_size = len(tokenizer)
    ids = encode_prompt(tokenizer, "Hello there", vocab_size)
    assert isinstance(ids, PromptIds) and ids == tokenizer.encode("Hello there", add_special_tokens=False)
    assert encode_prompt(tokenizer, ids, vocab_size) is ids
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        encode_prompt(tokenizer, ids, min(ids))
    # A plain list of the same ids is checked, and comes back checked.
    assert encode_prompt(tokenizer, list(ids), vocab_size) == ids
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        encode_prompt(tokenizer, [*ids, vocab_size], vocab_size)
