"""Single-request generation: a one-row use of the engine.

``generate`` runs the same step as a batch of many requests (``Engine.step``): one ragged
forward over ``[last token, drafts...]`` on the paged KV-cache, verification, rollback by
setting the row's length back. The output is exactly what plain decoding produces:
token-identical under greedy, distribution-identical under sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nasd_core.config import EngineConfig, RunnerConfig, SamplingParams, SpecConfig, build
from nasd_core.engine.engine import Engine
from nasd_core.engine.sequence import GenerationResult
from nasd_core.inputs import check_context, encode_prompt
from nasd_core.runner.model_runner import ModelRunner
from nasd_core.speculation.calibration import Calibration
from nasd_core.speculation.drafter import SharedIndex
from nasd_core.speculation.ngram import NGramIndex

TokenCallback = Callable[[list[int]], None]


def generate(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    spec: SpecConfig | None = None,
    shared: Sequence[tuple[str, SharedIndex]] = (),
    on_tokens: TokenCallback | None = None,
    local_index: NGramIndex | None = None,
    calibration: Calibration | None = None,
) -> GenerationResult:
    """Generate a continuation of ``prompt`` with n-gram speculative decoding.

    Args:
        model: a causal LM (transformers ``AutoModelForCausalLM``), in eval mode.
        tokenizer: its tokenizer.
        prompt: text (tokenized without special tokens) or token ids.
        params: sampling parameters (default: greedy, 128 tokens).
        spec: speculation settings (default: auto, draft cap 16, hybrid request-local source).
        shared: read-only ``(name, index)`` draft sources after the request's own tokens.
        on_tokens: called with each step's newly emitted tokens (streaming).
        local_index: request-local index to use (and grow) instead of a fresh one.
        calibration: step times and acceptance the ``auto`` mode weighs drafts with, and
            learns into (pass one across calls so later requests start calibrated, as from
            ``calibrate``); default: a new one.

    Returns:
        GenerationResult with the tokens, the text, the finish reason and the stats.

    Raises:
        InvalidRequestError: empty prompt, token ids outside the vocabulary, bad parameters.
        ContextLengthError: prompt plus max_tokens longer than the model's context.
    """
    params = params if params is not None else build(SamplingParams)
    spec = spec if spec is not None else build(SpecConfig)
    prompt_ids = encode_prompt(tokenizer, prompt, model.config.vocab_size)
    check_context(model, len(prompt_ids), params.max_tokens)
    # A KV-cache of exactly this request's size, in one block; packed steps, since a runner made
    # for one call would capture its CUDA graphs anew at every call (an Engine keeps its own).
    num_tokens = len(prompt_ids) + params.max_tokens
    # Uncompiled: compiling would change the caller's model in place.
    runner = ModelRunner(
        model,
        RunnerConfig(
            kv_cache_tokens=num_tokens, block_size=num_tokens, step_graphs=False, compiled_layers=False
        ),
    )
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=1, spec=spec), shared, runner, calibration)
    listener = (lambda _request, tokens: on_tokens(tokens)) if on_tokens is not None else None
    request_id = engine.add_request(prompt_ids, params, spec, on_tokens=listener, local_index=local_index)
    while not engine.is_finished():
        engine.step()
    return engine.pop_result(request_id)
