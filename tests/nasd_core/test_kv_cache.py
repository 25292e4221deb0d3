"""Paged KV-cache: block allocation, in-place writes, rollback, admission by free blocks."""

from __future__ import annotations

import sys

import pytest
import torch

from nasd_core import SamplingParams, SpecConfig
from nasd_core.config import EngineConfig, RunnerConfig
from nasd_core.engine.engine import Engine
from nasd_core.errors import ContextLengthError
from nasd_core.layers.kv_cache import BlockAllocator, PagedKVCache
from nasd_core.runner.model_runner import ModelRunner, StepRow


def small_cache(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(2, 1, 2, num_blocks, block_size, torch.float32, "cpu")


def test_allocator_prefers_contiguous_runs_and_falls_back_to_any_free_blocks():
    allocator = BlockAllocator(8)
    first, second, third = allocator.allocate(2), allocator.allocate(3), allocator.allocate(2)
    assert (first, second, third) == ([0, 1], [2, 3, 4], [5, 6])
    allocator.free(first)
    assert allocator.allocate(3) == [0, 1, 7]  # no run of 3 is free: any 3 blocks
    allocator.free(second)
    assert allocator.allocate(2) == [2, 3]  # first fit
    assert allocator.num_free == 1
    with pytest.raises(MemoryError):
        allocator.allocate(2)


def test_rows_write_in_place_roll_back_and_free_their_blocks():
    cache = small_cache()
    cache.allocate("a", 6)  # 2 blocks
    cache.allocate("b", 4)
    assert cache.allocator.num_free == 5 and cache.can_allocate(20) and not cache.can_allocate(21)
    keys = torch.arange(12, dtype=torch.float32).view(1, 6, 2)
    cache.write(0, cache.slots("a", 0, 6), keys, -keys)
    cache.set_length("a", 6)
    row_keys, row_values = cache.row_kv(0, "a", 6)
    assert torch.equal(row_keys[0], keys) and torch.equal(row_values[0], -keys)
    assert row_keys.data_ptr() == cache.keys[0].data_ptr()  # a contiguous row is a view, no copy
    cache.set_length("a", 3)  # rollback: the last three positions are forgotten
    assert cache.length("a") == 3 and torch.equal(cache.row_kv(0, "a", 3)[0][0], keys[:, :3])
    with pytest.raises(ValueError):
        cache.set_length("a", 9)  # beyond the row's reservation
    cache.free("a")
    cache.free("b")
    assert cache.allocator.num_free == 8 and not cache.rows


def test_a_fragmented_row_is_gathered_exactly():
    cache = small_cache(num_blocks=4, block_size=2)
    for row in ("a", "b", "c"):
        cache.allocate(row, 2)
    cache.free("b")
    cache.allocate("d", 4)  # blocks 1 and 3: not contiguous
    assert cache.rows["d"].block_ids == [1, 3] and cache.rows["d"].start_slot is None
    keys = torch.arange(8, dtype=torch.float32).view(1, 4, 2)
    cache.write(1, cache.slots("d", 0, 4), keys, keys + 1)
    assert cache.slots("d", 0, 4).tolist() == [2, 3, 6, 7]
    assert torch.equal(cache.row_kv(1, "d", 4)[0][0], keys)


def test_a_row_that_can_never_fit_is_refused():
    cache = small_cache()
    with pytest.raises(ContextLengthError):
        cache.allocate("huge", 33)


def runner_and_plain_logits(
    model, batch_attention: bool | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(runner's, plain forward's) logits of three rows over ragged steps (prompt chunks and
    two-position rows in one forward), then again after a rollback and refeed of each row's
    last position; on the model's device, as float32 on the host."""
    runner = ModelRunner(
        model, RunnerConfig(kv_cache_tokens=1024, block_size=16, batch_attention=batch_attention)
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (3, 40, 90)]
    with torch.inference_mode():
        expected = [
            model(input_ids=torch.tensor([prompt], device=model.device)).logits[0].float().cpu()
            for prompt in prompts
        ]
    for row, prompt in enumerate(prompts):
        runner.cache.allocate(row, len(prompt))
    runner.forward([StepRow(row, prompt[:-2], 0) for row, prompt in enumerate(prompts)])
    logits = runner.forward([StepRow(row, prompt[-2:], 2) for row, prompt in enumerate(prompts)])
    assert logits.device == model.device
    pairs = [(logits[2 * row : 2 * row + 2].float().cpu(), expected[row][-2:]) for row in range(len(prompts))]
    for row in range(len(prompts)):
        runner.cache.set_length(row, len(prompts[row]) - 1)
    logits = runner.forward([StepRow(row, prompt[-1:], 1) for row, prompt in enumerate(prompts)])
    return pairs + [(logits[row].float().cpu(), expected[row][-1]) for row in range(len(prompts))]


def test_runner_logits_equal_a_plain_forward_across_chunks_rows_and_rollback(model):
    """Each row gets the logits a plain full-sequence forward gives it, and again after a rollback."""
    for ours, plain in runner_and_plain_logits(model):
        torch.testing.assert_close(ours, plain, atol=2e-4, rtol=0)


def test_engine_admits_by_free_blocks_and_frees_them_on_finish_and_cancel(model, tokenizer):
    prompt = "Count: one, two, three, four, five,"
    num_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    params = SamplingParams(max_tokens=8)
    # Room for exactly two such requests at a time.
    config = EngineConfig(max_batch_rows=8, kv_cache_tokens=2 * (num_prompt + 8), kv_block_size=1)
    engine = Engine(model, tokenizer, config)
    ids = [engine.add_request(prompt, params, SpecConfig(mode="off")) for _ in range(3)]
    engine.step()
    assert len(engine.cache.rows) == 2 and len(engine.waiting) == 1  # the third waits for blocks
    assert engine.cancel(ids[0])
    engine.step()  # the cancelled row leaves, and its blocks let the third one in
    engine.step()
    assert ids[2] in engine.cache.rows and ids[0] not in engine.cache.rows
    while not engine.is_finished():
        engine.step()
    results = [engine.pop_result(request_id) for request_id in ids]
    assert results[1].token_ids == results[2].token_ids and len(results[1].token_ids) == 8
    assert not engine.cache.rows and engine.cache.num_available == engine.cache.allocator.num_blocks
    with pytest.raises(ContextLengthError):
        engine.add_request(prompt, SamplingParams(max_tokens=2 * (num_prompt + 8)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are handed back with Linux madvise")
def test_a_freed_rows_memory_goes_back_to_the_os_and_its_neighbours_keep_theirs():
    # One slot = 4 KiB, so every slot but a run's first and last spans whole pages.
    cache = PagedKVCache(1, 2, 1024, 8, 4, torch.float32, "cpu")
    for row in ("a", "b"):
        cache.allocate(row, 16)
        slots = cache.slots(row, 0, 16)
        data = torch.ones(2, 16, 1024)
        cache.write(0, slots, data, data)
        cache.set_length(row, 16)
    cache.set_length("a", 5)  # a rollback does not hand back what was written
    cache.free("a")
    for pool in (cache.keys[0], cache.values[0]):
        assert not pool[:, 1:15].any()  # released: reads as zeros
        assert pool[:, 16:32].eq(1).all()  # row "b" untouched
