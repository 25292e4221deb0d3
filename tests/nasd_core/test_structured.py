"""Structured output (``nasd_core/structured.py``) in the engine: constrained output matches its
grammar, greedy constrained output is token for token plain constrained decoding (an
independent step-by-step oracle) with speculation off, on and auto, and bad grammars are
typed errors naming their field."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from nasd_core.config import GrammarSpec, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
# An example in the prompt gives the drafters something to copy: speculation is exercised.
PROMPTS = [
    'Records so far:\n{"name": "Ada", "age": 36, "languages": ["English", "French"]}\n'
    '{"name": "Alan", "age": 41, "languages": ["English"]}\nAnother record, for Grace:\n',
    "Describe a software engineer named Linus as a JSON record.",
]
JSON_SPEC = GrammarSpec(kind="json_schema", source=json.dumps(SCHEMA), param="response_format")
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return Engine(model, tokenizer)


def run(engine: Engine, spec: GrammarSpec, mode: str, temperature: float = 0.0, seed: int | None = None):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, grammar=spec)
    return engine.generate(PROMPTS, params, SpecConfig(mode=mode, num_draft_tokens=8))


def oracle(engine: Engine, prompt: str, spec: GrammarSpec, max_tokens: int) -> list[int]:
    """Plain constrained greedy decoding, step by step over the whole sequence with transformers'
    own forward: the grammar's mask on the last position's logits, then the argmax."""
    model, tokenizer = engine.model, engine.tokenizer
    ids = engine.tokenizer(prompt).input_ids
    matcher = llguidance.LLMatcher(engine.grammars.tokenizer, engine.grammars.compile(spec))
    bitmask = llguidance.torch.allocate_token_bitmask(1, engine.vocab_size)
    output: list[int] = []
    with torch.inference_mode():
        while len(output) < max_tokens:
            logits = model(torch.tensor([ids + output])).logits[0, -1:].float()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            output.append(token)
            if token in engine.eos_token_ids:
                break
            assert matcher.consume_token(token)
    del tokenizer
    return output


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_greedy_constrained_output_is_plain_constrained_decoding(engine, mode):
    results = run(engine, JSON_SPEC, mode)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == oracle(engine, prompt, JSON_SPEC, MAX_TOKENS), prompt
    if mode == "on":
        assert sum(result.stats.num_accepted for result in results) > 0, "speculation was not exercised"
        # The grammar drafts what it forces (keys, punctuation), and those drafts are accepted.
        assert sum(result.stats.accepted_by_source.get("grammar", 0) for result in results) > 0


def test_constrained_answers_parse_against_their_schema_greedy_and_sampled(engine):
    texts = [result.text for result in run(engine, JSON_SPEC, "auto")]
    for seed in range(4):
        texts += [result.text for result in run(engine, JSON_SPEC, "on", temperature=1.0, seed=seed)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    # Unconstrained, the same prompts do not all give such JSON: the grammar is what held.
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), SpecConfig(mode="off"))
    assert not all(_is_valid(result.text) for result in plain)


def _is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (GrammarSpec(kind="regex", source=r"[A-Z][a-z]+, aged \d{2}"), r"[A-Z][a-z]+, aged \d{2}"),
        (
            GrammarSpec(kind="choice", source=json.dumps(["positive", "negative", "neutral"])),
            r"positive|negative|neutral",
        ),
    ],
)
def test_regex_and_choice_constrain_the_whole_answer(engine, spec, check):
    for mode in ("off", "auto"):
        for result in run(engine, spec, mode):
            assert re.fullmatch(check, result.text), result.text


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec(kind="json_schema", source="{not json", param="response_format"),
        GrammarSpec(kind="json_schema", source='{"type": "nonsense"}', param="response_format"),
        GrammarSpec(kind="regex", source="(unclosed", param="guided_regex"),
        GrammarSpec(kind="choice", source="[]", param="guided_choice"),
        GrammarSpec(kind="lark", source="start: undefined_rule", param="guided_grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_is_an_error_naming_its_field(engine, spec):
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("Hello", SamplingParams(max_tokens=4, grammar=spec))
    assert error.value.param == spec.param and error.value.message.startswith(spec.param)
    assert not engine.requests, "nothing is queued"
