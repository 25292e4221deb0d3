"""Prefix cache: later prompts reuse the keys and values of earlier ones' whole blocks.

The cache must hand a prompt only blocks that hold exactly its first tokens (same tokens, same
blocks before them, same salt), never let a sharer write into a shared block, keep a cached
block only while nothing needs its room, and the engine must emit the tokens it emits
without the cache.
"""

from __future__ import annotations

import pytest
import torch

from nasd_core import SamplingParams, SpecConfig
from nasd_core.config import EngineConfig
from nasd_core.engine.engine import Engine
from nasd_core.layers.kv_cache import PagedKVCache

BLOCK = 4


def cache_with(num_blocks: int, kept_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(1, 1, 2, num_blocks, BLOCK, torch.float32, "cpu", prefix_cache_blocks=kept_blocks)


def finished_row(cache: PagedKVCache, row_id: str, tokens: list[int], salt=None) -> list[int]:
    """A row that held ``tokens`` (each position's keys: the token itself), indexed and freed;
    its block ids."""
    cache.allocate(row_id, len(tokens) + 2, salt=salt)
    keys = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1).expand(1, -1, 2)
    cache.write(0, cache.slots(row_id, 0, len(tokens)), keys, keys)
    cache.set_length(row_id, len(tokens))
    cache.cache_prefix(row_id, tokens)
    block_ids = list(cache.rows[row_id].block_ids)
    cache.free(row_id)
    return block_ids


def test_a_prompt_reuses_the_whole_cached_blocks_it_starts_with_and_nothing_else():
    cache = cache_with(num_blocks=32)
    first = list(range(100, 110))  # 2 whole blocks and 2 positions
    blocks = finished_row(cache, "a", first)
    # The same 8 tokens and more: both whole blocks, the very ones "a" wrote.
    assert cache.allocate("b", 20, [*first[:8], 7, 7, 7]) == 8
    assert cache.rows["b"].block_ids[:2] == blocks[:2] and cache.length("b") == 8
    assert torch.equal(cache.row_kv(0, "b", 8)[0][0, 0, :, 0], torch.tensor(first[:8], dtype=torch.float32))
    # One token changed in the second block: only the first block.
    assert cache.allocate("c", 20, [*first[:6], 1, *first[7:]]) == 4
    # A different first token, a prompt shorter than a block, another salt: nothing.
    assert cache.allocate("d", 20, [1, *first[1:]]) == 0
    assert cache.allocate("e", 20, first[:3]) == 0
    assert cache.allocate("f", 20, first, salt="tenant-2") == 0
    # A shared block is never written by its sharer: "b" writes from position 8 on.
    assert cache.slots("b", 8, 9).item() not in range(blocks[0] * BLOCK, (blocks[1] + 1) * BLOCK)


def test_reused_blocks_out_of_order_are_read_in_the_rows_order():
    """Shared blocks 0 and 2 then fresh blocks 1 and 3: ids spanning a run of four, not in its
    order, so the row must be read block by block, not as one run of the pool."""
    cache = cache_with(num_blocks=4)
    for row in ("h0", "h1", "h2", "h3"):
        cache.allocate(row, BLOCK)
    cache.free("h0")
    cache.free("h2")
    tokens = list(range(20, 28))
    cache.allocate("x", 8)
    keys = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1).expand(1, -1, 2)
    cache.write(0, cache.slots("x", 0, 8), keys, keys)
    cache.set_length("x", 8)
    cache.cache_prefix("x", tokens)
    assert cache.rows["x"].block_ids == [0, 2]
    cache.free("x")
    cache.free("h1")
    cache.free("h3")
    assert cache.allocate("y", 16, [*tokens, 5]) == 8
    assert cache.rows["y"].block_ids == [0, 2, 1, 3]
    assert torch.equal(cache.row_kv(0, "y", 8)[0][0, 0, :, 0], torch.tensor(tokens, dtype=torch.float32))
    assert cache.slots("y", 8, 9).item() == 1 * BLOCK  # its first own position: block 1's first slot


def test_cached_blocks_are_kept_while_their_room_is_not_needed_and_given_up_oldest_first():
    cache = cache_with(num_blocks=6, kept_blocks=3)
    finished_row(cache, "old", list(range(8)))  # 2 cached blocks (of 3 reserved)
    new = finished_row(cache, "new", list(range(50, 58)))  # 2 more: the oldest one goes
    assert cache.num_available == 6 and len(cache._unused) == 3
    assert cache.allocate("x", 8, list(range(8))) == 0, "old's first block was given up"
    cache.free("x")
    # A row holding a cached block keeps it; a new row needing every free block takes the others.
    assert cache.allocate("y", 12, [*list(range(50, 58)), 9]) == 8
    assert cache.rows["y"].block_ids[:2] == new[:2]
    cache.allocate("z", 12)  # every block left, the last cached one no row holds given up
    assert cache.num_available == 0 and not set(cache.rows["z"].block_ids) & set(new[:2])
    cache.free("y")
    cache.free("z")
    assert cache.num_available == 6


def test_a_block_reused_for_other_tokens_never_matches_what_followed_it_before():
    """An entry's key names the block before it and that block's allocation, so an entry
    cached after a block that was since given up and refilled cannot be found again."""
    cache = cache_with(num_blocks=4, kept_blocks=4)
    chain = finished_row(cache, "a", list(range(8)))  # blocks p, c cached: c after p
    # Three blocks needed, two free: p, unused longest, is given up (c stays cached) and refilled.
    refilled = finished_row(cache, "b", [9, 9, 9, 9, 1, 1, 1, 1, 1, 1])
    assert refilled[0] == chain[0] and chain[1] not in refilled
    assert cache.allocate("c", 12, [9, 9, 9, 9, 4, 5, 6, 7]) == 4, "c followed p's old tokens, not these"


def run_turns(model, tokenizer, prefix_cache_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Three chat turns, each prompt the previous prompt, its answer and a new question, then two
    requests sharing a system prompt sent together; outputs and cached prompt positions."""
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(max_batch_rows=4, kv_block_size=16, prefix_cache_tokens=prefix_cache_tokens),
    )
    spec = SpecConfig(mode="auto")
    outputs, cached = [], []
    history = tokenizer("You are a careful assistant. Answer in one sentence.\n").input_ids
    for question in ("What is a list in Python?", "And a tuple?", "Which is faster to create?"):
        history = history + tokenizer(f"\nUser: {question}\nAssistant:").input_ids
        (result,) = engine.generate([history], SamplingParams(max_tokens=24), spec)
        outputs.append(result.token_ids)
        cached.append(result.stats.num_cached_prompt_tokens)
        history = history + result.token_ids
    system = tokenizer("System: you answer questions about the solar system, briefly.\n" * 3).input_ids
    ids = [
        engine.add_request(system + tokenizer(question).input_ids, SamplingParams(max_tokens=12), spec)
        for question in ("User: how far is Mars?", "User: how hot is Venus?")
    ]
    while not engine.is_finished():
        engine.step()
    for request_id in ids:
        result = engine.pop_result(request_id)
        outputs.append(result.token_ids)
        cached.append(result.stats.num_cached_prompt_tokens)
    assert not engine.cache.rows and engine.cache.num_available == engine.cache.num_row_blocks
    return outputs, cached


def test_later_chat_turns_reuse_the_earlier_ones_and_emit_the_same_tokens(model, tokenizer):
    expected, none_cached = run_turns(model, tokenizer, prefix_cache_tokens=0)
    outputs, cached = run_turns(model, tokenizer, prefix_cache_tokens=4096)
    assert outputs == expected
    assert none_cached == [0] * 5
    # Turn 2 and 3 reuse the whole blocks of the turn before (prompt and answer).
    assert cached[0] == 0 and cached[1] >= 32 and cached[2] > cached[1]
    assert sum(cached[3:]) == 0, "sent together: the second prompt's prefix was not in yet"


def test_a_request_scoring_its_prompt_reuses_nothing(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(kv_block_size=8))
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 4).input_ids
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=4, prompt_logprobs=1))
    (again,) = engine.generate([prompt], SamplingParams(max_tokens=4, prompt_logprobs=1))
    (plain,) = engine.generate([prompt], SamplingParams(max_tokens=4))
    assert again.stats.num_cached_prompt_tokens == 0 and plain.stats.num_cached_prompt_tokens > 0
    assert [entry.logprob for entry in again.prompt_logprobs[1:]] == pytest.approx(
        [entry.logprob for entry in first.prompt_logprobs[1:]], abs=1e-4
    )
    assert plain.token_ids == first.token_ids


def test_a_prompt_arriving_during_anothers_prefill_reuses_the_blocks_already_in(model, tokenizer):
    system = tokenizer("System: you answer questions about the solar system, briefly.\n" * 6).input_ids
    prompts = [system + tokenizer(question).input_ids for question in ("User: Mars?", "User: Venus?")]
    outputs, cached = {}, {}
    for cache_tokens in (0, 4096):
        config = EngineConfig(
            max_batch_rows=2, kv_block_size=16, prefill_chunk_tokens=32, prefix_cache_tokens=cache_tokens
        )
        engine = Engine(model, tokenizer, config)
        first = engine.add_request(prompts[0], SamplingParams(max_tokens=8))
        for _ in range(2):  # two chunks of the first prompt are in: 64 positions, 4 blocks
            engine.step()
        second = engine.add_request(prompts[1], SamplingParams(max_tokens=8))
        while not engine.is_finished():
            engine.step()
        results = [engine.pop_result(request_id) for request_id in (first, second)]
        outputs[cache_tokens] = [result.token_ids for result in results]
        cached[cache_tokens] = results[1].stats.num_cached_prompt_tokens
    assert outputs[4096] == outputs[0]
    assert cached == {0: 0, 4096: 64}
