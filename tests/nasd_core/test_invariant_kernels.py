"""The deterministic mode's Triton kernels: a row's output has the same bits whatever the other
rows and however many positions its step verifies, and is the function it claims to be (against
torch, within rounding). On a GPU they run compiled, in bfloat16 too; on the CPU under Triton's
interpreter, in float32 and float16 (the interpreter computes in NumPy, which has no bfloat16)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nasd_core.layers import invariant_kernels
from nasd_core.layers.attention import DETERMINISTIC_KEYS_PER_UNIT

# tests/conftest.py sets TRITON_INTERPRET=1 off a GPU, before anything imports triton.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="off a GPU, Triton's interpreter runs these (TRITON_INTERPRET=1)",
)

ROW_COUNTS = (1, 3, 17, 64)
DTYPES = (torch.float32, torch.float16, *((torch.bfloat16,) if DEVICE == "cuda" else ()))
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def rows_alone_and_among(function, x: torch.Tensor) -> None:
    """``function``'s output rows are the same bits for every row count and every row alone."""
    full = function(x)
    for count in ROW_COUNTS:
        assert torch.equal(function(x[:count]), full[:count]), count
    for row in (0, 5, len(x) - 1):
        assert torch.equal(function(x[row : row + 1]), full[row : row + 1]), row
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1)).to(x.device)
    assert torch.equal(function(x[order]), full[order])


@pytest.mark.skipif(DEVICE == "cuda", reason="about Triton's interpreter, off a GPU")
def test_the_interpreters_tile_product_sums_every_row_alike():
    """What the kernels' tests below stand on: the interpreter's ``tl.dot`` (NumPy's BLAS) gives
    a row the same bits wherever it sits in a tile (OPENBLAS_CORETYPE, tests/conftest.py)."""
    generator = torch.Generator().manual_seed(3)
    kernels = invariant_kernels
    tile = torch.randn(kernels.BLOCK_M, kernels.BLOCK_K, generator=generator).numpy()
    other = torch.randn(kernels.BLOCK_K, kernels.BLOCK_N, generator=generator).numpy()
    product = np.matmul(tile, other, dtype=np.float32)
    for row in range(kernels.BLOCK_M):
        alone = np.zeros_like(tile)
        alone[0] = tile[row]
        assert np.array_equal(np.matmul(alone, other, dtype=np.float32)[0], product[row]), row


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_matmul_row_is_the_same_alone_among_its_positions_and_in_any_batch(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROW_COUNTS), 72, generator=generator).to(DEVICE, dtype)  # K not a whole tile
    weight = torch.randn(40, 72, generator=generator).to(DEVICE, dtype)  # N not a whole tile either
    rows_alone_and_among(lambda rows: invariant_kernels.matmul(rows, weight), x)
    reference = x.float() @ weight.float().T
    scale = reference.abs().max()
    assert (invariant_kernels.matmul(x, weight).float() - reference).abs().max() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_rms_norm_row_is_the_same_alone_and_in_any_batch(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROW_COUNTS), 48, generator=generator).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(48, generator=generator)).to(DEVICE, dtype)
    rows_alone_and_among(lambda rows: invariant_kernels.rms_norm(rows, weight, 1e-6), x)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    reference = weight.float() * normed.to(dtype).float()
    error = (invariant_kernels.rms_norm(x, weight, 1e-6).float() - reference).abs().max()
    assert error <= TOLERANCE[dtype] * 4


BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 16  # grouped queries: two heads share a KV head
# Rows' contexts (keys, new positions included): within a block, at a boundary, across several
# blocks, and past a unit of keys (the deterministic mode's 256).
CONTEXTS = (5, 16, 17, 40, 300)


class PagedCase:
    """A cache whose rows hold ``CONTEXTS`` keys in scattered blocks, and every position's query."""

    def __init__(self, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(2)
        blocks_per_row = [-(-length // BLOCK_SIZE) for length in CONTEXTS]
        num_blocks = sum(blocks_per_row) + 3
        order = torch.randperm(num_blocks, generator=generator).tolist()  # rows' blocks not contiguous
        self.table = torch.zeros(len(CONTEXTS), max(blocks_per_row), dtype=torch.int32)
        for row, count in enumerate(blocks_per_row):
            self.table[row, :count] = torch.tensor([order.pop() for _ in range(count)])
        slots = num_blocks * BLOCK_SIZE
        self.table = self.table.to(DEVICE)
        self.keys = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=generator).to(DEVICE, dtype)
        self.values = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=generator).to(DEVICE, dtype)
        # One query per key position of every row (position p sees keys 0..p).
        self.queries = {
            (row, position): torch.randn(HEADS, HEAD_DIM, generator=generator).to(DEVICE, dtype)
            for row, length in enumerate(CONTEXTS)
            for position in range(length)
        }

    def attend(self, picked: list[tuple[int, int]]) -> torch.Tensor:
        """The kernel's output for the ``picked`` (row, position) queries, packed in that order."""
        queries = torch.stack([self.queries[pick] for pick in picked])
        rows = torch.tensor([row for row, _ in picked], dtype=torch.int32, device=DEVICE)
        last_keys = torch.tensor([position for _, position in picked], dtype=torch.int32, device=DEVICE)
        return invariant_kernels.paged_attention(
            queries,
            self.keys,
            self.values,
            self.table,
            rows,
            last_keys,
            BLOCK_SIZE,
            HEAD_DIM**-0.5,
            DETERMINISTIC_KEYS_PER_UNIT,
            max(position for _, position in picked) + 1,
        )

    def reference(self, row: int, position: int) -> torch.Tensor:
        blocks = self.table[row, : position // BLOCK_SIZE + 1].long()
        slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=DEVICE)).reshape(-1)
        slots = slots[: position + 1]
        keys = self.keys[:, slots].float().repeat_interleave(HEADS // KV_HEADS, 0)
        values = self.values[:, slots].float().repeat_interleave(HEADS // KV_HEADS, 0)
        scores = torch.einsum("hd,hkd->hk", self.queries[(row, position)].float(), keys) * HEAD_DIM**-0.5
        return torch.einsum("hk,hkd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_attends_the_same_alone_among_17_of_its_row_and_among_other_rows(dtype):
    case = PagedCase(dtype)
    verified = 17
    # Every row's last query in one step, in two orders.
    batch = [(row, length - 1) for row, length in enumerate(CONTEXTS)]
    together, reversed_order = case.attend(batch), case.attend(batch[::-1])
    for row, length in enumerate(CONTEXTS):
        alone = case.attend([(row, length - 1)])  # a decode step
        positions = [(row, position) for position in range(max(0, length - verified), length)]
        within = case.attend(positions)  # the same row verifying up to 17 positions
        assert torch.equal(within[-1], alone[0]), (row, length)
        assert torch.equal(together[row], alone[0]), (row, length)
        assert torch.equal(reversed_order[len(CONTEXTS) - 1 - row], alone[0]), (row, length)
        for offset, (_, position) in enumerate(positions):
            error = (within[offset].float() - case.reference(row, position)).abs().max()
            assert error <= TOLERANCE[dtype] * 10, (row, position, float(error))


# ------------------------------------------------------------------ a model through the engine
# A tiny random Llama whose every Linear, norm and attention runs these kernels (under the
# interpreter, so small): its greedy output with speculation is plain decoding's, token for
# token, in a batch that rows join and leave, beside prompt chunks.
TINY_PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [12], [13, 14] * 9]  # ids < 128
TINY_MAX_TOKENS = [8, 6, 10]


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # each kernel program is interpreted: the smallest model with every part
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE).eval()


def tiny_engine(model, tokenizer):
    from nasd_core.config import EngineConfig, RunnerConfig
    from nasd_core.engine.engine import Engine

    runner = RunnerConfig(
        kv_cache_tokens=1024, block_size=16, deterministic=True, deterministic_kernels="triton"
    )
    return Engine(model, tokenizer, EngineConfig(max_batch_rows=4, prefill_chunk_tokens=16, runner=runner))


def test_a_tiny_model_on_these_kernels_decodes_the_same_with_speculation_off_on_and_auto(
    tiny_model, tokenizer
):
    from nasd_core.config import SamplingParams, SpecConfig
    from tests.nasd_core.test_engine import FixedStepTimes

    outputs, drafted = {}, {}
    for mode in ("off", "on", "auto"):
        engine = tiny_engine(tiny_model, tokenizer)
        assert engine.runner.triton_attention
        engine.step_time = FixedStepTimes(lambda *_: 0.1)  # drafts look free: auto verifies them
        spec = SpecConfig(mode=mode, num_draft_tokens=6)
        ids = {}
        pending = list(range(len(TINY_PROMPTS)))
        while pending or not engine.is_finished():  # rows join two at a time, between steps
            for index in pending[:2]:
                params = SamplingParams(max_tokens=TINY_MAX_TOKENS[index], ignore_eos=True)
                ids[index] = engine.add_request(TINY_PROMPTS[index], params, spec)
            pending = pending[2:]
            engine.step()
        outputs[mode] = [engine.pop_result(ids[index]).token_ids for index in range(len(TINY_PROMPTS))]
        drafted[mode] = engine.stats.num_drafted
    assert outputs["on"] == outputs["off"]
    assert outputs["auto"] == outputs["off"]
    assert drafted["on"] > 0 and drafted["auto"] > 0, drafted  # wider verifications ran
    assert type(tiny_model.model.layers[0].self_attn.q_proj).__name__ == "InvariantLinear"
    assert invariant_kernels.use_invariant_kernels(tiny_model) == 0  # each engine found it swapped
