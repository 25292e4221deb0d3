"""The seeds' API: storages, processors and ngram_assisted_speculative_generate, on the real model."""

from __future__ import annotations

import pytest
import torch

from nasd_core.compat import (
    GreedyProcessor,
    NGramStorage,
    OneLevelNGramStorage,
    TopKProcessor,
    ngram_assisted_speculative_generate,
)

PROMPT = "The cat sat on the mat. The dog sat on the log. The bird sat on the"


def test_storages_keep_the_seeds_semantics():
    storage = NGramStorage(n=3, vocab_size=50)
    storage.initialize(torch.tensor([[1, 2, 3, 1, 2, 4, 1, 2, 4]]))
    token, known = storage.next_token(torch.tensor([[7, 1, 2]]))
    assert known.tolist() == [True] and token.tolist() == [4]  # (1, 2) -> 4 twice, 3 once
    token, known = storage.next_token(torch.tensor([[9, 9, 3]]))
    assert known.tolist() == [True] and token.tolist() == [1]  # falls back to (3,)
    assert storage.has_gram(torch.tensor([1, 2, 3]))
    assert storage.has_gram(torch.tensor([9, 2, 3]))  # (2,) -> 3 was seen: the fallback counts
    assert not storage.has_gram(torch.tensor([5, 5, 9]))
    storage.update(torch.tensor([[5, 6]]), torch.tensor([[8, 8]]))
    assert storage.next_token([[5, 6]])[0].tolist() == [8]
    storage.reset()
    assert storage.next_token([[1, 2]])[1].tolist() == [False]

    one_level = OneLevelNGramStorage(n=3, vocab_size=50)
    one_level.initialize([[1, 2, 3]])
    assert one_level.next_token([[1, 2]])[1].tolist() == [True]
    assert one_level.next_token([[9, 2]])[1].tolist() == [False]
    with pytest.raises(ValueError):
        NGramStorage(n=1, vocab_size=50)


@pytest.mark.parametrize("storage_cls", [NGramStorage, OneLevelNGramStorage])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("stop_if_unknown", [True, False])
def test_seed_entry_point_is_exact_under_greedy(model, tokenizer, storage_cls, use_cache, stop_if_unknown):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    storage = storage_cls(3, model.config.vocab_size)
    output, acceptance_rate = ngram_assisted_speculative_generate(
        ids,
        storage,
        model,
        gamma=4,
        filler_top_k=3,
        logits_processor=GreedyProcessor(),
        max_gen_len=16,
        eos_tokens_id=[tokenizer.eos_token_id],
        use_cache=use_cache,
        stop_if_unknown=stop_if_unknown,
    )
    assert output == reference[0, len(ids) :].tolist()
    assert 0.0 < acceptance_rate <= 1.0
    # The caller's storage learned the prompt and the output.
    full = ids + output
    assert storage.has_gram(torch.tensor(ids[:3]))
    assert storage.has_gram(torch.tensor(full[-3:]))


def test_seed_entry_point_sampling_is_reproducible_with_torch_seed(model, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    outputs = []
    for _ in range(2):
        torch.manual_seed(3)
        output, _ = ngram_assisted_speculative_generate(
            ids,
            NGramStorage(3, model.config.vocab_size),
            model,
            logits_processor=TopKProcessor(0.9, 20),
            max_gen_len=10,
            eos_tokens_id=tokenizer.eos_token_id,
            use_cache=True,
        )
        outputs.append(output)
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0
