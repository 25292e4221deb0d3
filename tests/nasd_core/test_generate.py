"""The NASD loop on the real embedded model: exact greedy identity, lossless sampling, stops, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from benchmarks.workloads import WORKLOADS, make_workload
from nasd_core import InvalidRequestError, NGramIndex, SamplingParams, SpecConfig, generate
from nasd_core.config import EngineConfig, build
from nasd_core.engine.engine import Engine
from nasd_core.errors import ContextLengthError

MAX_TOKENS = 20
RAW_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one, two, three, four, five, six, seven,",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "Monday, Tuesday, Wednesday, Thursday,",
    '{"name": "Ada", "age": 36}\n{"name": "Alan", "age": 41}\n{"name": "Grace", "age":',
    "To be, or not to be, that is the question:",
    "<ul>\n  <li>apple</li>\n  <li>banana</li>\n  <li>",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, city FROM users WHERE",
]


def chat_prompts(tokenizer) -> list[str]:
    conversations = [conv for name in WORKLOADS for conv in make_workload(name, 2, seed=11)]
    return [
        tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        for conv in conversations[:12]
    ]


@pytest.fixture(scope="module")
def greedy_cases(model, tokenizer):
    """20 varied prompts with the reference output of transformers' own greedy generate."""
    cases = []
    for prompt in RAW_PROMPTS + chat_prompts(tokenizer):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        cases.append((prompt, out[0, len(ids) :].tolist()))
    assert len(cases) >= 20
    return cases


@pytest.mark.parametrize("local_index", ["multi_level", "one_level", "prompt_lookup", "hybrid", "suffix"])
def test_greedy_is_token_identical_to_plain_decoding(model, tokenizer, greedy_cases, local_index):
    """Every case drafted from ``local_index`` gives transformers' greedy tokens; the cases run as
    rows of one batch (a row's greedy tokens do not depend on the others: test_engine)."""
    spec = SpecConfig(
        mode="on",
        num_draft_tokens=5,
        local_index=local_index,
        max_ngram=2 if local_index == "one_level" else 3,
    )
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=len(greedy_cases), spec=spec))
    prompts = [tokenizer.encode(prompt, add_special_tokens=False) for prompt, _ in greedy_cases]
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), spec)
    mismatches = [
        (prompt[:40], result.token_ids, expected)
        for (prompt, expected), result in zip(greedy_cases, results, strict=True)
        if result.token_ids != expected
    ]
    assert not mismatches
    assert sum(result.stats.num_accepted for result in results) > 10, "speculation was not exercised"


def test_auto_mode_and_shared_index_keep_identity(model, tokenizer, greedy_cases):
    shared = NGramIndex()
    for prompt, expected in greedy_cases[:6]:
        result = generate(
            model,
            tokenizer,
            prompt,
            SamplingParams(max_tokens=MAX_TOKENS),
            SpecConfig(mode="auto"),
            shared=[("replica", shared)],
        )
        assert result.token_ids == expected
        shared.update(result.prompt_ids + result.token_ids)
    # The second time round the replica index knows these continuations and drafts from them.
    prompt, expected = greedy_cases[0]
    result = generate(
        model,
        tokenizer,
        prompt,
        SamplingParams(max_tokens=MAX_TOKENS),
        SpecConfig(mode="on", local_index="multi_level", max_ngram=2),
        shared=[("replica", NGramIndex.from_bytes(shared.to_bytes()))],
    )
    assert result.token_ids == expected
    assert result.stats.drafted_by_source.get("replica", 0) > 0


NUM_SAMPLES = 150


def assert_sampling_matches_transformers(model, tokenizer) -> None:
    """Two-sample chi-square on (token 1, token 2) pairs: NASD sampling vs transformers' sampler,
    both on ``model``; each side's samples drawn as rows of one batch (one seed per row here,
    one generator for them all there: independent draws either way)."""
    prompt = "My favourite colours are red, green, blue, red, green,"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    spec = SpecConfig(mode="on", num_draft_tokens=3)

    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=NUM_SAMPLES, spec=spec))
    request_ids = [
        engine.add_request(ids, params.model_copy(update={"seed": seed}), spec) for seed in range(NUM_SAMPLES)
    ]
    while not engine.is_finished():
        engine.step()
    counts_ours = Counter(tuple(engine.pop_result(request_id).token_ids[:2]) for request_id in request_ids)

    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids] * NUM_SAMPLES),
            attention_mask=torch.ones(NUM_SAMPLES, len(ids), dtype=torch.long),
            max_new_tokens=2,
            do_sample=True,
            temperature=1.0,
            top_k=3,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )
    counts_theirs = Counter(tuple(row[len(ids) :].tolist()[:2]) for row in out)

    keys = sorted(set(counts_ours) | set(counts_theirs))
    # Pool rare pairs so every cell has a usable expected count.
    common = [k for k in keys if counts_ours[k] + counts_theirs[k] >= 10]
    table = np.array(
        [
            [counts_ours[k] for k in common] + [sum(counts_ours[k] for k in keys if k not in common)],
            [counts_theirs[k] for k in common] + [sum(counts_theirs[k] for k in keys if k not in common)],
        ]
    )
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 3, "the test needs a spread distribution to have power"
    assert chi2_contingency(table).pvalue > 1e-3


def test_sampled_generation_matches_transformers_sampling(model, tokenizer):
    assert_sampling_matches_transformers(model, tokenizer)


def test_same_seed_same_output_with_or_without_speculation(model, tokenizer):
    prompt = "List: alpha, beta, gamma, alpha, beta, gamma, alpha,"
    outputs = set()
    for mode in ("off", "on", "auto"):
        params = SamplingParams(max_tokens=16, temperature=0.8, seed=42)
        outputs.add(tuple(generate(model, tokenizer, prompt, params, SpecConfig(mode=mode)).token_ids))
    assert len(outputs) == 1


def test_stop_string_max_tokens_and_streaming(model, tokenizer):
    prompt = "one, two, three, four, five, six, seven,"
    streamed: list[int] = []
    full = generate(model, tokenizer, prompt, SamplingParams(max_tokens=12), on_tokens=streamed.extend)
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    assert streamed == full.token_ids
    stop_word = full.text.split(",")[1].strip()
    stopped = generate(model, tokenizer, prompt, SamplingParams(max_tokens=12, stop=[stop_word]))
    assert stopped.finish_reason == "stop"
    assert stop_word not in stopped.text
    assert full.text.startswith(stopped.text)


def test_eos_ends_generation_and_is_kept_in_tokens(model, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say only: yes"}], add_generation_prompt=True, tokenize=False
    )
    result = generate(model, tokenizer, prompt, SamplingParams(max_tokens=64))
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token not in result.text


@pytest.mark.parametrize(
    "prompt, fields, param",
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 2, -1], {}, "prompt"),
        ([1, 2, 10**9], {}, "prompt"),
        ("hello", {"max_tokens": 0}, "max_tokens"),
        ("hello", {"max_tokens": -5}, "max_tokens"),
        ("hello", {"temperature": -0.1}, "temperature"),
        ("hello", {"top_p": 0.0}, "top_p"),
        ("hello", {"top_p": 1.5}, "top_p"),
        ("hello", {"top_k": -1}, "top_k"),
    ],
)
def test_bad_input_raises_typed_errors(model, tokenizer, prompt, fields, param):
    with pytest.raises(InvalidRequestError) as info:
        generate(model, tokenizer, prompt, build(SamplingParams, **fields))
    assert info.value.param == param


def test_bad_speculation_config_and_context_length(model, tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        build(SpecConfig, num_draft_tokens=-1)
    assert info.value.param == "num_draft_tokens"
    with pytest.raises(InvalidRequestError):
        build(SpecConfig, max_ngram=2, min_ngram=3)
    limit = model.config.max_position_embeddings
    with pytest.raises(ContextLengthError) as info:
        generate(model, tokenizer, [1] * 10, SamplingParams(max_tokens=limit))
    assert info.value.param == "max_tokens"
