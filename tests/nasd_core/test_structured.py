"""Structured output (``nasd_core/structured.py``) in the engine: constrained output matches its
grammar, greedy constrained output is token for token plain constrained decoding (an
independent step-by-step oracle) with speculation off, on and auto, and bad grammars are
typed errors naming their field."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from nasd_core.config import GrammarSpec, ReasoningSpec, SamplingParams, SpecConfig
from nasd_core.engine.async_engine import AsyncEngine
from nasd_core.engine.engine import Engine
from nasd_core.errors import InvalidRequestError
from nasd_core.processors import LogitsProcessors
from nasd_core.sampling import TokenDraws, logits_to_probs, sample_tokens
from nasd_core.speculation.verify import VerifyRow, accept_prefix, verify_rows
from nasd_core.structured import apply_masks
from tests.nasd_core.test_verify import NUM_TRIALS, chi_square_p

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


def oracle(engine: Engine, prompt: str, spec: GrammarSpec, max_tokens: int, free: int = 0) -> list[int]:
    """Plain constrained greedy decoding, step by step over the whole sequence with transformers'
    own forward: the grammar's mask on the last position's logits, then the argmax (the first
    ``free`` tokens unconstrained: a reasoning model's thinking)."""
    ids = engine.tokenizer(prompt).input_ids
    matcher = llguidance.LLMatcher(engine.grammars.tokenizer, engine.grammars.compile(spec))
    bitmask = llguidance.torch.allocate_token_bitmask(1, engine.vocab_size)
    output: list[int] = []
    with torch.inference_mode():
        while len(output) < max_tokens:
            logits = engine.model(torch.tensor([ids + output])).logits[0, -1:].float()
            constrained = len(output) >= free
            if constrained:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            output.append(token)
            if token in engine.eos_token_ids:
                break
            assert not constrained or matcher.consume_token(token)
    return output


@pytest.fixture(scope="module")
def json_oracle(engine) -> list[list[int]]:
    """``oracle``'s output for each prompt under JSON_SPEC."""
    return [oracle(engine, prompt, JSON_SPEC, MAX_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_greedy_constrained_output_is_plain_constrained_decoding(engine, json_oracle, mode):
    results = run(engine, JSON_SPEC, mode)
    for prompt, result, expected in zip(PROMPTS, results, json_oracle, strict=True):
        assert result.token_ids == expected, prompt
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


def test_masking_a_draft_that_ends_the_answer_leaves_the_grammar_where_it_was(engine):
    """A draft that runs to the end of sequence (a forced tool call's closing tokens, copied by a
    drafter) is masked without consuming the end: a stopped matcher cannot roll back, and one
    rolled back a token too far rejected the very tokens the step then kept."""
    tokenizer = engine.tokenizer
    grammar = engine.grammars.matcher(GrammarSpec(kind="regex", source="ab c", param="guided_regex"))
    eos = next(iter(engine.eos_token_ids))
    draft = [*tokenizer.encode("ab c", add_special_tokens=False), eos]
    logits = torch.zeros(len(draft) + 1, engine.vocab_size)
    grammar.mask(logits, draft)
    assert grammar.valid_prefix(draft) == len(draft), "the matcher moved"
    assert logits[len(draft) - 1, eos] == 0 and logits[len(draft) - 1, draft[0]] == float("-inf")
    grammar.observe(draft)
    assert grammar.matcher.is_stopped() and not grammar.matcher.is_error()


def test_sampled_constrained_rows_keep_the_constrained_plain_distribution(engine):
    """A sampled row under a grammar ("a digit, then a letter"): the first position follows the
    masked distribution, the position after an accepted draft digit the distribution masked by
    the grammar's state after it, exactly what plain constrained sampling sees. The same test
    rejects verification that masks every position with the state before the draft."""
    spec = GrammarSpec(kind="regex", source="[0-9][a-z]")
    prompt = engine.tokenizer("Codes: 4x 7b 1q 9").input_ids
    with torch.inference_mode():
        raw = engine.model(torch.tensor([prompt])).logits[0, -1:].float()
    params = SamplingParams(temperature=1.0, grammar=spec)

    def masked(logits: torch.Tensor, after: list[int]) -> torch.Tensor:
        grammar = engine.grammars.matcher(spec)
        grammar.observe(after)
        logits = logits.clone()
        grammar.mask(logits, [])
        return logits

    first_logits = masked(raw, [])
    digit = int(first_logits.argmax())
    with torch.inference_mode():
        second_raw = engine.model(torch.tensor([[*prompt, digit]])).logits[0, -1:].float()
    step_logits = torch.cat([raw, second_raw])
    plain = [
        logits_to_probs(first_logits, params)[0],
        logits_to_probs(masked(second_raw, [digit]), params)[0],
    ]

    def run(stateful: bool) -> tuple[Counter, Counter]:
        processors = LogitsProcessors(params, prompt, engine.vocab_size, [], engine.grammars.matcher(spec))
        first, second = Counter(), Counter()
        for trial in range(NUM_TRIALS):
            draws = TokenDraws(5000 + trial)
            if stateful:
                emitted = verify_rows(step_logits, [[digit]], [VerifyRow(params, draws, 0, processors)])[0]
            else:  # lossy: both positions masked as if the draft were not there
                logits = step_logits.clone()
                processors.grammar.mask(logits[:1], [])
                processors.grammar.mask(logits[1:], [])
                targets = sample_tokens(
                    logits_to_probs(logits, params), torch.from_numpy(draws.uniforms(0, 2))
                )
                emitted = accept_prefix(targets.tolist(), [digit])
            first[emitted[0]] += 1
            if emitted[0] == digit:
                second[emitted[1]] += 1
        return first, second

    first, second = run(stateful=True)
    assert chi_square_p(first, plain[0]) > 1e-3
    assert sum(second.values()) > 300
    assert chi_square_p(second, plain[1]) > 1e-3
    _, lossy_second = run(stateful=False)
    assert sum(lossy_second.values()) > 300
    assert not set(lossy_second) <= set(torch.nonzero(plain[1]).flatten().tolist()), (
        "the lossy rule went unnoticed"
    )


def test_a_grammar_answer_past_its_end_with_ignore_eos_is_the_same_whatever_the_drafts(engine):
    """Past a grammar's end, ignore_eos keeps ends of sequence, and the drafters copy them: the
    positions after a drafted end are masked to the end too, or a row emits what the grammar
    forbids there (the correction after a rejected end)."""
    spec = GrammarSpec(kind="choice", source=json.dumps(["yes"]), param="guided_choice")
    params = SamplingParams(max_tokens=12, ignore_eos=True, grammar=spec)
    # An earlier turn answered "yes": the drafters copy it with its end of sequence and what
    # followed, so a step verifies past a drafted end.
    turns = [
        {"role": "user", "content": "Is water wet? Answer yes or no."},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "Is ice cold? Answer yes or no."},
    ]
    prompt = engine.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    outputs = {
        mode: engine.generate([prompt], params, SpecConfig(mode=mode))[0] for mode in ("off", "on", "auto")
    }
    assert outputs["on"].stats.num_accepted > 0, "no draft was verified"
    tokens = {mode: result.token_ids for mode, result in outputs.items()}
    assert tokens["on"] == tokens["auto"] == tokens["off"]
    assert len(tokens["off"]) == 12
    text_ids = [token for token in tokens["off"] if token not in engine.eos_token_ids]
    assert engine.tokenizer.decode(text_ids) == "yes"  # the choice, then ends of sequence only


@pytest.mark.parametrize(
    "schema",
    [
        '{"type": "integer", "maximum": 1' + "0" * 400 + "}",  # past what the builder can write
        '{"type": "integer", "maximum": ' + "9" * 5000 + "}",  # past Python's digit limit
        '{"type": "object"' + ', "properties": {"a": {"type": "object"' * 200 + "}}" * 200 + "}",
    ],
)
def test_a_schema_the_grammar_builder_refuses_is_an_invalid_request_naming_its_field(engine, schema):
    spec = GrammarSpec(kind="json_schema", source=schema, param="response_format")
    with pytest.raises(InvalidRequestError) as refused:
        engine.grammars.compile(spec)
    assert refused.value.param == "response_format" and len(str(refused.value)) < 300


def test_a_servers_grammars_compile_off_the_thread_that_runs_steps(model, tokenizer, monkeypatch):
    import asyncio
    import threading

    from nasd_core.engine.async_engine import AsyncEngine
    from nasd_core.structured import Grammars

    threads: list[str] = []
    compile_grammar = Grammars.compile

    def spying(self, spec):
        threads.append(threading.current_thread().name)
        return compile_grammar(self, spec)

    monkeypatch.setattr(Grammars, "compile", spying)
    server = AsyncEngine(Engine(model, tokenizer))
    server.start()

    async def answer() -> list[int]:
        params = SamplingParams(max_tokens=8, grammar=JSON_SPEC)
        return [
            token
            for chunk in [c async for c in server.generate(PROMPTS[1], params)]
            for token in chunk.token_ids
        ]

    try:
        assert asyncio.run(answer())
    finally:
        server.shutdown()
    assert threads and threads[0] != "nasd-engine", threads  # compiled first on a worker thread


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["numpy", "tensor_ops"])
@pytest.mark.parametrize("vocab_size", [60, 64, 70])
def test_masks_forbid_what_llguidances_kernel_forbids(dtype, vocab_size):
    """``apply_masks`` (NumPy for a CPU's float32 logits, tensor ops otherwise) against
    llguidance's compiled kernel: words with their top bit set, empty and partial ones, a mask
    wider than the logits (a vocabulary off a multiple of 32) and narrower (its missing tokens
    forbidden), one row or several."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab_size, generator=generator, dtype=dtype)
    bitmask = llguidance.torch.allocate_token_bitmask(4, 64)
    bitmask[1] = torch.tensor([0x0F0F0F0F, -(2**31)], dtype=torch.int32)
    bitmask[2] = 0
    bitmask[3] = torch.randint(-(2**31), 2**31 - 1, (2,), generator=generator, dtype=torch.int32)
    expected = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(expected, bitmask)
    masked = logits.clone()
    apply_masks(masked, bitmask)
    assert torch.equal(masked, expected)
    row = logits[3].clone()
    apply_masks(row, bitmask[3])
    assert torch.equal(row, expected[3])


def test_constrained_steps_compile_nothing_on_the_engine_thread(model, tokenizer):
    """No step, with one constrained row or several, compiles (masks are applied without
    torch.compile: ``apply_masks``), so none waits seconds for dynamo, and no compilation traces
    (FX patches ``nn.Module.__call__`` process-wide while it does) beside a running step."""
    torch._dynamo.reset()  # as in a new process: nothing compiled yet
    engine = Engine(model, tokenizer)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    async_engine.shutdown()
    assert engine._grammars is not None
    params = SamplingParams(max_tokens=8, grammar=JSON_SPEC)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert engine.generate(PROMPTS[:1], params, SpecConfig(mode="off"))[0].token_ids
        assert all(result.token_ids for result in engine.generate(PROMPTS, params, SpecConfig(mode="auto")))


def test_an_engine_whose_grammar_compiler_fails_to_build_still_starts(model, tokenizer, monkeypatch, caplog):
    def fails(engine):
        raise RuntimeError("llguidance cannot take this tokenizer")

    monkeypatch.setattr(Engine, "build_grammars", fails)
    async_engine = AsyncEngine(Engine(model, tokenizer))
    async_engine.start()
    try:
        assert async_engine.is_running
        assert "llguidance cannot take this tokenizer" in caplog.text
    finally:
        async_engine.shutdown()


def test_the_grammar_cache_is_bounded_in_characters(engine, monkeypatch):
    from nasd_core import structured

    grammars = structured.Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMAR_CHARS", 4000)
    for index in range(20):
        properties = {f"field_{index}_{k}": {"type": "integer"} for k in range(10)}
        schema = json.dumps({"type": "object", "properties": properties})
        grammars.compile(GrammarSpec(kind="json_schema", source=schema))
        assert grammars.cached_chars <= 4000
    assert 0 < len(grammars._grammars) < 20


# ------------------------------------------------------------ a grammar after the reasoning
THINKING = 5  # tokens of "reasoning" in the tests below: the model's own first tokens


@pytest.fixture(scope="module")
def free_start(engine) -> list[int]:
    """The first tokens the model writes for PROMPTS[0] without a grammar: the tests' stand-in for
    a reasoning model's thinking, the last two of them its end marker (two tokens: a marker may
    span steps and drafts)."""
    tokens = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=THINKING))[0].token_ids
    marker = tokens[THINKING - 2 :]
    assert all(tokens[index : index + 2] != marker for index in range(THINKING - 2)), "the marker is unique"
    return tokens


def run_reasoning(engine: Engine, reasoning: ReasoningSpec, mode: str) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=JSON_SPEC, reasoning=reasoning)
    return engine.generate([PROMPTS[0]], params, SpecConfig(mode=mode, num_draft_tokens=8))[0].token_ids


@pytest.fixture(scope="module")
def reasoning_oracle(engine, free_start) -> list[int]:
    """``oracle``'s output for PROMPTS[0] under JSON_SPEC after THINKING free tokens."""
    expected = oracle(engine, PROMPTS[0], JSON_SPEC, MAX_TOKENS, free=THINKING)
    assert expected[:THINKING] == free_start
    return expected


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_a_grammar_constrains_only_the_answer_after_the_reasoning(engine, free_start, reasoning_oracle, mode):
    expected = reasoning_oracle
    end_ids = free_start[THINKING - 2 :]
    opened_by_prompt = ReasoningSpec(end_ids=end_ids, open=True)
    assert run_reasoning(engine, opened_by_prompt, mode) == expected
    # An answer whose first token opens the reasoning (Qwen3's "<think>"): the same tokens.
    opened_by_answer = ReasoningSpec(end_ids=end_ids, start_id=free_start[0])
    assert run_reasoning(engine, opened_by_answer, mode) == expected


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_an_answer_that_does_not_open_reasoning_is_constrained_from_its_first_token(
    engine, json_oracle, free_start, mode
):
    # The opening token is one the grammar forbids and the model would not pick: not opened.
    start = engine.tokenizer.convert_tokens_to_ids("Ġzebra")
    assert start not in free_start
    reasoning = ReasoningSpec(end_ids=free_start[THINKING - 2 :], start_id=start)
    assert run_reasoning(engine, reasoning, mode) == json_oracle[0]


def test_drafts_are_cut_where_the_grammar_would_refuse_them_after_the_reasoning(engine, free_start):
    end_ids = free_start[THINKING - 2 :]
    grammar = engine.grammars.matcher(JSON_SPEC, ReasoningSpec(end_ids=end_ids, open=True))
    words = engine.tokenizer.encode(" the cat sat", add_special_tokens=False)
    assert grammar.valid_prefix(words) == len(words)  # reasoning: anything goes
    assert grammar.forced_tokens() == []
    brace = engine.tokenizer.encode('{"', add_special_tokens=False)
    assert grammar.valid_prefix(words + end_ids + brace + words) == len(words + end_ids + brace)
    grammar.observe(words + end_ids[:1])  # the marker's first token in one step...
    assert grammar.valid_prefix(end_ids[1:] + words) == 1
    grammar.observe(end_ids[1:])  # ...and its second in the next: the answer starts
    assert grammar.valid_prefix(words) == 0
    assert grammar.forced_tokens(), "a JSON object's opening is forced"
    opening = ReasoningSpec(end_ids=end_ids, start_id=words[0])
    grammar = engine.grammars.matcher(JSON_SPEC, opening)
    assert grammar.valid_prefix(words) == 1, "a draft that opens the reasoning ends there"
    assert grammar.valid_prefix(brace + words) == len(brace)


@pytest.mark.parametrize("field", ["end_ids", "start_id"])
def test_reasoning_markers_outside_the_vocabulary_are_an_invalid_request(engine, field):
    outside = engine.vocab_size
    reasoning = ReasoningSpec(
        end_ids=[outside] if field == "end_ids" else [1], start_id=outside if field == "start_id" else None
    )
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("Hello", SamplingParams(max_tokens=4, grammar=JSON_SPEC, reasoning=reasoning))
    assert error.value.param == "reasoning"
    assert not engine.requests, "nothing is queued"
