"""Logits processors and logprobs on the real model: vLLM's semantics, exact under speculation."""

from __future__ import annotations

import pytest
import torch

from nasd_core import InvalidRequestError, SamplingParams, SpecConfig, generate
from nasd_core.config import EngineConfig, build
from nasd_core.engine.engine import Engine

PROMPT = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the"
MAX_TOKENS = 24
PROCESSORS = {
    "frequency": {"frequency_penalty": 0.8},
    "presence": {"presence_penalty": 1.5},
    "negative presence": {"presence_penalty": -1.0},
    "repetition": {"repetition_penalty": 1.3},
    "repetition below 1": {"repetition_penalty": 0.8},
    "logit bias": {"logit_bias": {260: -100.0, 1345: 5.0}},
    "min tokens": {"min_tokens": 12, "stop_token_ids": [30]},
    "all": {
        "frequency_penalty": 0.3,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logit_bias": {28: 2.0},
        "min_tokens": 3,
    },
}


def reference_decode(model, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding with vLLM's processors written out one token at a time over a full
    forward of the whole context each step (no cache, no drafts): the oracle."""
    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.inference_mode():
            logits = (
                model(torch.tensor([prompt_ids + output], device=model.device)).logits[0, -1].float().cpu()
            )
        logits = logits.clone()  # a normal tensor: edited in place below
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        if len(output) < params.min_tokens:
            for token in stop_ids:
                logits[token] = float("-inf")
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
        seen = counts > 0
        seen[torch.tensor(prompt_ids)] = True
        penalty = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        token = int(logits.argmax())
        output.append(token)
        if token in stop_ids and len(output) > params.min_tokens:
            break
    return output


@pytest.fixture(scope="module")
def unprocessed(model, tokenizer) -> list[int]:
    """PROMPT's plain greedy output, without any processor."""
    return generate(
        model, tokenizer, PROMPT, SamplingParams(max_tokens=MAX_TOKENS), SpecConfig(mode="off")
    ).token_ids


def batched_outputs(model, tokenizer, params: dict[str, SamplingParams], mode: str) -> dict[str, list[int]]:
    """PROMPT under each of ``params`` as one row of one batch, speculating in ``mode``: every
    row's processors are its own, whatever the other rows'."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=len(params)))
    spec = SpecConfig(mode=mode, num_draft_tokens=8)
    ids = {name: engine.add_request(PROMPT, row_params, spec) for name, row_params in params.items()}
    while not engine.is_finished():
        engine.step()
    return {name: engine.pop_result(request_id).token_ids for name, request_id in ids.items()}


MODES = ("off", "on", "auto")


@pytest.fixture(scope="module")
def processed_greedy(model, tokenizer) -> dict[str, dict[str, list[int]]]:
    """Each mode's greedy output under every ``PROCESSORS`` entry, the entries rows of one batch."""
    params = {name: SamplingParams(max_tokens=MAX_TOKENS, **fields) for name, fields in PROCESSORS.items()}
    return {mode: batched_outputs(model, tokenizer, params, mode) for mode in MODES}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_processed_greedy_output_is_plain_decoding_with_the_processors(
    model, tokenizer, unprocessed, processed_greedy, name
):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, **PROCESSORS[name])
    stop_ids = set(params.stop_token_ids) | {tokenizer.eos_token_id}
    expected = reference_decode(model, prompt_ids, params, stop_ids)
    for mode in MODES:
        assert processed_greedy[mode][name] == expected, mode
    # The processors changed the output (else this test could not fail).
    assert unprocessed != expected
    if "min_tokens" in PROCESSORS[name]:
        assert all(token not in stop_ids for token in expected[: params.min_tokens])


def test_drafts_are_verified_under_penalties_that_count_them(model, tokenizer):
    """A repetitive prompt drafts long copies; with a frequency penalty, the positions after an
    accepted draft token must see it counted, so many drafts get rejected and the output still
    matches plain decoding (checked above). Here: speculation really ran."""
    params = SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=0.8)
    result = generate(model, tokenizer, PROMPT, params, SpecConfig(mode="on", num_draft_tokens=8))
    assert result.stats.num_drafted > 0


def test_sampled_penalised_output_is_the_same_with_or_without_speculation(model, tokenizer):
    params = {
        name: SamplingParams(max_tokens=16, temperature=0.8, seed=7, **fields)
        for name, fields in PROCESSORS.items()
    }
    outputs = {mode: batched_outputs(model, tokenizer, params, mode) for mode in MODES}
    for name in PROCESSORS:
        assert outputs["on"][name] == outputs["off"][name] == outputs["auto"][name], name


def test_logprobs_are_the_plain_forwards_log_softmax(model, tokenizer):
    """Raw logprobs, as vLLM returns by default: with a penalty the tokens change, the model's
    distribution at each of them does not."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    for mode, fields in [("off", {}), ("on", {}), ("on", {"frequency_penalty": 0.8})]:
        params = SamplingParams(max_tokens=12, logprobs=5, **fields)
        result = generate(model, tokenizer, prompt_ids, params, SpecConfig(mode=mode, num_draft_tokens=8))
        assert [entry.token_id for entry in result.logprobs] == result.token_ids
        with torch.inference_mode():
            full = (
                model(torch.tensor([prompt_ids + result.token_ids], device=model.device))
                .logits[0]
                .float()
                .cpu()
            )
        reference = torch.log_softmax(full[len(prompt_ids) - 1 : -1], dim=-1)
        for position, entry in enumerate(result.logprobs):
            assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-3)
            top_values, top_ids = torch.topk(reference[position], 5)
            assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=1e-3)
            assert entry.top[0][0] == top_ids[0].item()
            if not fields:
                assert entry.token_id == entry.top[0][0]  # greedy, unprocessed: the top token
    assert generate(model, tokenizer, prompt_ids, SamplingParams(max_tokens=4)).logprobs is None
    zero = generate(model, tokenizer, prompt_ids, SamplingParams(max_tokens=4, logprobs=0))
    assert len(zero.logprobs) == 4 and all(entry.top == [] for entry in zero.logprobs)


def test_logprobs_stream_with_their_tokens(model, tokenizer):
    engine = Engine(model, tokenizer)
    seen = []
    engine.add_request(
        PROMPT,
        SamplingParams(max_tokens=10, logprobs=2),
        SpecConfig(mode="on"),
        on_tokens=lambda request, tokens: seen.append(
            (list(tokens), request.logprobs[len(request.logprobs) - len(tokens) :])
        ),
    )
    while not engine.is_finished():
        engine.step()
    for tokens, entries in seen:
        assert [entry.token_id for entry in entries] == tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_out_of_range_processor_fields_are_typed_errors(model, tokenizer, fields, param):
    with pytest.raises(InvalidRequestError) as error:
        generate(model, tokenizer, PROMPT, build(SamplingParams, **fields))
    assert error.value.param == param


def test_prompt_logprobs_score_the_prompt_in_chunks_beside_running_rows(model, tokenizer):
    """What lm-eval's log-likelihood requests need: every prompt token's logprob (``echo``),
    here cut into 5-token prefill chunks that share steps with a decoding row."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.inference_mode():
        full = model(torch.tensor([prompt_ids])).logits[0].float()
    reference = torch.log_softmax(full[:-1], dim=-1)
    engine = Engine(model, tokenizer, EngineConfig(prefill_chunk_tokens=5))
    decoding = engine.add_request("one, two, three,", SamplingParams(max_tokens=12))
    engine.step()
    engine.step()
    scored = engine.add_request(prompt_ids, SamplingParams(max_tokens=3, prompt_logprobs=2))
    scored_only = engine.add_request(prompt_ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    while not engine.is_finished():
        engine.step()
    results = {request_id: engine.pop_result(request_id) for request_id in (scored, scored_only, decoding)}
    for request_id, num_top in [(scored, 2), (scored_only, 0)]:
        entries = results[request_id].prompt_logprobs
        assert len(entries) == len(prompt_ids) and entries[0] is None
        assert [entry.token_id for entry in entries[1:]] == prompt_ids[1:]
        expected = reference[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
        assert [entry.logprob for entry in entries[1:]] == pytest.approx(expected.tolist(), abs=1e-3)
        assert all(len(entry.top) == num_top for entry in entries[1:])
        if num_top:
            assert [entry.top[0][0] for entry in entries[1:]] == reference.argmax(-1).tolist()
    assert results[scored_only].token_ids == [] and results[scored_only].finish_reason == "length"
    # Scoring changes nothing else: the scored request and the row beside it decode as alone.
    alone = generate(model, tokenizer, prompt_ids, SamplingParams(max_tokens=3))
    assert results[scored].token_ids == alone.token_ids and results[scored].logprobs is None
    beside = generate(model, tokenizer, "one, two, three,", SamplingParams(max_tokens=12))
    assert results[decoding].token_ids == beside.token_ids


def test_max_tokens_zero_needs_prompt_logprobs(model, tokenizer):
    with pytest.raises(InvalidRequestError) as error:
        build(SamplingParams, max_tokens=0)
    assert error.value.param == "max_tokens"
