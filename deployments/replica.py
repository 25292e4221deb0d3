"""The NASD replica: one model, one continuous-batching engine and the replica's view of the
shared pool, behind a Ray Serve deployment.

``NASDServer`` is the plain class (constructor without I/O, explicit ``start()``), usable
without Serve; ``NASDReplica`` is the deployment Serve constructs, starts and shuts down.
Every method called through a handle returns or yields plain data, never raises a custom
exception across the handle: a bad request becomes an error chunk the ingress answers with,
and the replica keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from deployments.metrics import EXPORT_INTERVAL_S, ReplicaMetrics
from deployments.outputs import ChoiceOutput, ToolParsing
from deployments.reasoning import ReasoningParser, ReasoningStream, reasoning_format
from deployments.schemas import (
    CompletionTokensDetails,
    DetokenizeRequest,
    ErrorInfo,
    GenerateChunk,
    GenerateRequest,
    PromptTokensDetails,
    TokenizeRequest,
    TokensResult,
    Usage,
)
from deployments.streams import interleave
from deployments.tools import (
    ToolCallParser,
    ToolFormat,
    chat_template_inputs,
    renders_tools,
    tool_format,
)
from nasd_core.config import (
    EMBEDDED_MODEL,
    EngineConfig,
    GrammarSpec,
    ModelConfig,
    SamplingParams,
    SpecConfig,
    build,
)
from nasd_core.engine.async_engine import AsyncEngine, StreamChunk
from nasd_core.engine.engine import Engine
from nasd_core.errors import ContextLengthError, EngineOverloadedError, InvalidRequestError
from nasd_core.inputs import encode_prompt
from nasd_core.loader import load_model
from nasd_core.metrics import SpecStats
from nasd_core.speculation.calibration import calibrate
from pool_service import PoolConfig, SharedPools, namespace_for

logger = logging.getLogger(__name__)

# Serve waits this long for __del__ (flushing the pool) before it kills the replica.
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S = 20.0
ENGINE_SHUTDOWN_TIMEOUT_S = 10.0
# A prompt's last tokens, read for where it leaves a reasoning model (``ReasoningFormat.first_state``).
PROMPT_TAIL_TOKENS = 16


class ReplicaConfig(BaseModel):
    """Everything one replica needs; built by ``build_app`` from the application's arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig, description="Which model, dtype and device.")
    served_model_name: str = Field(EMBEDDED_MODEL, description="The name clients send as `model`.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (the CPUs this replica was given); None = torch's."
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Batch/queue limits, spec default."
    )
    pool: PoolConfig = Field(default_factory=PoolConfig, description="Where the shared pool lives.")
    probe_max_rows: int = Field(
        0,
        ge=0,
        description="Time verification steps of 1, 2, 4, ... up to this many rows at start, so `auto` "
        "weighs drafts against this machine's costs from the first request (0 = no probe).",
    )
    pool_namespace: str | None = Field(
        None, description="Prefix of the pool namespace, to separate deployments sharing one Redis."
    )
    tool_call_parser: ToolCallParser = Field(
        "auto", description="How the model writes tool calls (auto: as its chat template shows, else hermes)."
    )
    reasoning_parser: ReasoningParser = Field(
        "auto",
        description="How the model marks its reasoning, returned apart from the answer (auto: qwen3 "
        "for a chat template that writes </think>, else none).",
    )


def logit_bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) keyed by int."""
    biases = {}
    for key, bias in (logit_bias or {}).items():
        try:
            biases[int(key)] = bias
        except ValueError:
            raise InvalidRequestError(f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
    return biases


def tokens_error(exc: BaseException) -> TokensResult:
    """A failed tokenize / detokenize call, reported as ``error_chunk`` reports a generation."""
    return TokensResult(**error_chunk(exc).model_dump(include={"error", "status_code"}))


def error_chunk(exc: BaseException) -> GenerateChunk:
    """The chunk that reports ``exc`` to the ingress, with the HTTP status it maps to."""
    if isinstance(exc, InvalidRequestError):
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        info = ErrorInfo(message=exc.message, type="invalid_request_error", param=exc.param, code=code)
        return GenerateChunk(error=info, status_code=400)
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        info = ErrorInfo(message=f"{param}: {first['msg']}", type="invalid_request_error", param=param)
        return GenerateChunk(error=info, status_code=400)
    if isinstance(exc, EngineOverloadedError):
        info = ErrorInfo(message=str(exc), type="server_error", code="engine_overloaded")
        return GenerateChunk(error=info, status_code=503)
    return GenerateChunk(
        error=ErrorInfo(message=f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
        status_code=500,
    )


class NASDServer:
    """A model, its engine and the shared pool. Construct (no I/O), then ``await start()``.

    Args:
        config: model, engine and pool settings.
        origin: this replica's name in stats and in the pool (default: host and pid).
    """

    def __init__(self, config: ReplicaConfig, origin: str | None = None) -> None:
        self.config = config
        self.origin = origin
        self.model = None
        self.tokenizer = None
        self.tool_format: ToolFormat | None = None
        self.template_renders_tools = False
        self.async_engine: AsyncEngine | None = None
        self.pools: SharedPools | None = None
        self.totals = SpecStats()  # finished requests, merged on the event loop
        self.num_requests = 0
        self.num_scoring_requests = 0  # finished with no decode step (echo with max_tokens 0)
        self.started_at: float | None = None
        # Set by the Serve deployment, where Ray exports them; None when used as a library.
        self.metrics: ReplicaMetrics | None = None

    async def start(self) -> None:
        """Load the model, start the engine thread and the pool's sync worker, then freeze the
        process's heap (``gc.freeze``: a replica owns its process; ``shutdown`` unfreezes it).

        Raises:
            ModelLoadError: the model cannot be loaded (Serve then reports the replica failed).
        """
        config = self.config
        if config.num_threads is not None:
            # Two replicas on one machine must not both spread over every core.
            torch.set_num_threads(config.num_threads)
        # Loaded on this thread, not with asyncio.to_thread: a model loaded on a helper thread
        # and then run on the engine thread left two OpenMP thread teams fighting over the
        # cores, and every request ran ~5x slower (8.1 s vs 1.5 s for 16 tokens on 2 cores).
        self.model, self.tokenizer = load_model(None, config.model)
        self.tool_format = tool_format(self.tokenizer.chat_template, config.tool_call_parser)
        self.reasoning_format = reasoning_format(self.tokenizer.chat_template, config.reasoning_parser)
        self.template_renders_tools = renders_tools(self.tokenizer.chat_template)
        batch_engine = Engine(self.model, self.tokenizer, config.engine)
        if config.probe_max_rows:
            # On the engine's own runner: the steps it times are the ones it will run (its graphs).
            started = time.perf_counter()
            calibrate(
                self.model,
                min(config.probe_max_rows, config.engine.max_batch_rows),
                repeats=1,
                runner=batch_engine.runner,
                calibration=batch_engine.calibration,
            )
            logger.info("step times probed in %.1f s", time.perf_counter() - started)
        # AsyncEngine.start builds the grammar compiler before its thread runs.
        self.async_engine = AsyncEngine(batch_engine)
        self.async_engine.start()
        namespace = namespace_for(config.model.name or EMBEDDED_MODEL, self.tokenizer)
        if config.pool_namespace:
            namespace = f"{config.pool_namespace}/{namespace}"
        engine = self.async_engine
        self.pools = SharedPools(
            config.pool,
            namespace,
            # Index updates run between engine steps, where no request reads the indexes.
            apply=lambda update: engine.call(lambda _: update()),
            origin=self.origin,
            vocab_size=self.model.config.vocab_size,
        )
        await self.pools.start()
        # What start-up built (model, tokenizer, indexes, graphs) lives as long as the replica:
        # frozen, a full collection no longer walks it, which paused a step for ~0.5 s (vLLM
        # and SGLang freeze their heap after warm-up for the same reason).
        gc.collect()
        gc.freeze()
        self.started_at = time.time()
        logger.info(
            "replica %s serving %s (pool namespace %s)", self.origin, config.served_model_name, namespace
        )

    async def shutdown(self) -> None:
        """Flush the pool's pending writes, then stop the engine.

        Serve calls this once the replica's ongoing requests are done. The pool stops first:
        its index updates run on the engine thread.
        """
        if self.pools is not None:
            await self.pools.stop()
        if self.async_engine is not None:
            await asyncio.to_thread(self.async_engine.shutdown, ENGINE_SHUTDOWN_TIMEOUT_S)
        gc.unfreeze()  # what start froze may be collected again (a process serving on)

    # ------------------------------------------------------------ handle API
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[GenerateChunk]:
        """Stream one request (a ``GenerateRequest`` as a dict), its ``n`` choices as rows.

        With ``stream`` set, yields a chunk per engine step that produced text; otherwise one
        chunk per choice at its end. A choice's last chunk has its finish reason; the request's
        last chunk has the usage and counters (for one choice, the same chunk). Any failure is
        yielded as a chunk with ``error`` set, never raised.
        """
        try:
            parsed = GenerateRequest.model_validate(request)
            prompt_ids = self._prompt_ids(parsed)
            reasoning = self._reasoning_state(parsed, prompt_ids)
            params, spec = self._params(parsed, len(prompt_ids), reasoning)
            if reasoning is not None and params.grammar is not None and params.reasoning is None:
                reasoning.without_reasoning()  # the grammar constrains the answer from its start
            echo = self._echo_text(parsed, prompt_ids) if parsed.echo else ""
            tools = ToolParsing(self.tool_format, parsed.tool_names()) if parsed.parse_tool_calls else None
            choices = [
                ChoiceOutput(self.tokenizer, params, echo, tools, len(prompt_ids), reasoning)
                for _ in range(parsed.n)
            ]
            stats = SpecStats()
            steps = self._choice_steps(prompt_ids, params, spec, parsed)
            async with contextlib.aclosing(steps):
                async for index, step in steps:
                    if step.finish_reason == "cancelled":  # the engine aborted it (shutdown, failed step)
                        message = "the engine stopped this request; retry"
                        yield GenerateChunk(
                            error=ErrorInfo(message=message, type="server_error"), status_code=503
                        )
                        return
                    choice = choices[index]
                    choice.add(step, prompt_ids if parsed.echo else None)
                    if step.finish_reason is not None:
                        stats.merge(step.stats)
                        self.pools.publish(
                            parsed.tenant, prompt_ids + choice.text.output_ids, parsed.pool_partition
                        )
                        chunk = choice.chunk(index, step.finish_reason)
                        if all(other.finish_reason for other in choices):  # the request's last chunk
                            yield self._finish(prompt_ids, choices, stats, chunk)
                        else:
                            yield chunk
                    elif parsed.stream and choice.has_pending:
                        yield choice.chunk(index, None)
        except Exception as exc:  # reported, never raised: a bad request must not kill the replica
            if not isinstance(exc, InvalidRequestError | ValidationError | EngineOverloadedError):
                logger.exception("request failed")
            yield error_chunk(exc)

    def _choice_steps(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecConfig,
        request: GenerateRequest,
    ) -> AsyncIterator[tuple[int, StreamChunk]]:
        """Every choice's engine steps as they come, tagged with the choice's index. The first
        choice starts alone; the others join after its first step and copy its prefill. Choice
        i samples with seed + i. Leaving early (the client went away) cancels every choice."""
        shared = self.pools.sources_for(request.tenant, request.pool_partition)
        first_id = f"choice0-{uuid.uuid4().hex}"
        streams = [
            self.async_engine.generate(
                prompt_ids,
                params if params.seed is None else params.model_copy(update={"seed": params.seed + index}),
                spec,
                request_id=first_id if index == 0 else None,
                shared=shared,
                prefill_from=first_id if index else None,
                # Tenants reuse only their own prompts' cached prefixes.
                prefix_salt=request.tenant if self.config.pool.tenant_isolation else None,
            )
            for index in range(request.n)
        ]
        return interleave(streams, first_alone=True)

    def stats(self) -> dict[str, Any]:
        """JSON-able counters of this replica: speculation totals, policy widths, queue, pool."""
        engine = self.async_engine.engine
        # Read from the event loop while the engine thread steps: lengths and a plain dict copy
        # are atomic under the GIL, which is all a monitoring snapshot needs.
        widths = dict(engine.width_histogram)
        return {
            "replica_id": self.pools.origin,
            "model": self.config.served_model_name,
            "updated_at": time.time(),
            "num_requests": self.num_requests,
            "num_scoring_requests": self.num_scoring_requests,
            "num_running": len(engine.running),
            "num_waiting": len(engine.waiting) + len(engine.prefilling),
            "spec": self.totals.to_dict(),
            "width_histogram": {str(width): count for width, count in sorted(widths.items())},
            "pool": self.pools.stats(),
            "runner": engine.runner.report(),
        }

    def tokenize(self, request: dict[str, Any]) -> TokensResult:
        """Token ids of a ``TokenizeRequest``'s prompt or messages, encoded as ``generate`` does."""
        try:
            parsed = TokenizeRequest.model_validate(request)
            messages = parsed.messages and [message.as_template_input() for message in parsed.messages]
            prompt = GenerateRequest(prompt=parsed.prompt, messages=messages)
            tokens = self._prompt_ids(prompt, add_special_tokens=parsed.add_special_tokens)
            limit = getattr(self.model.config, "max_position_embeddings", None)
            return TokensResult(tokens=tokens, max_model_len=limit)
        except Exception as exc:
            return tokens_error(exc)

    def detokenize(self, request: dict[str, Any]) -> TokensResult:
        """The text of a ``DetokenizeRequest``'s token ids."""
        try:
            parsed = DetokenizeRequest.model_validate(request)
            if parsed.tokens:  # ids outside the vocabulary are a 400, not a tokenizer crash
                encode_prompt(self.tokenizer, parsed.tokens, self.model.config.vocab_size, param="tokens")
            return TokensResult(text=self.tokenizer.decode(parsed.tokens))
        except Exception as exc:
            return tokens_error(exc)

    def model_info(self) -> dict[str, Any]:
        """Name, context length and vocabulary size of the served model."""
        model_config = self.model.config
        return {
            "id": self.config.served_model_name,
            "max_model_len": getattr(model_config, "max_position_embeddings", None),
            "vocab_size": model_config.vocab_size,
            "created": int(self.started_at or time.time()),
        }

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the tokenizer's class, special tokens, chat template and
        settings (what lm-evaluation-harness reads to tokenize through the server)."""
        info: dict[str, Any] = {"tokenizer_class": type(self.tokenizer).__name__}
        for key, value in self.tokenizer.init_kwargs.items():
            if key in ("name_or_path", "vocab_file", "tokenizer_file"):  # paths on the replica's disk
                continue
            if hasattr(value, "content"):  # an AddedToken: its text, as the tokenizer config writes it
                value = value.content
            if value is None or isinstance(value, str | int | float | bool):
                info[key] = value
        # The tokenizer's own limit is often a "no limit" sentinel; the model's is the real one.
        model_limit = getattr(self.model.config, "max_position_embeddings", None)
        if model_limit is not None:
            info["model_max_length"] = min(info.get("model_max_length", model_limit), model_limit)
        info["chat_template"] = self.tokenizer.chat_template
        return info

    def check_health(self) -> None:
        """Raise when the engine thread is gone (Serve then replaces this replica)."""
        if self.async_engine is None or not self.async_engine.is_running:
            raise RuntimeError(
                f"the engine thread is not running (last error: {self.async_engine.last_error!r})"
            )

    # ------------------------------------------------------------- helpers
    def _prompt_ids(self, request: GenerateRequest, add_special_tokens: bool = False) -> list[int]:
        vocab_size = self.model.config.vocab_size
        if request.messages is not None:
            messages, template_args = chat_template_inputs(
                request.messages, request.tools, self.tool_format, self.template_renders_tools
            )
            try:
                prompt = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False, **template_args
                )
            except Exception as exc:  # jinja raises whatever the template author chose
                raise InvalidRequestError(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from None
            return encode_prompt(self.tokenizer, prompt, vocab_size, "messages", add_special_tokens)
        if request.prompt is None:
            raise InvalidRequestError("a prompt or messages are required", param="prompt")
        return encode_prompt(self.tokenizer, request.prompt, vocab_size, "prompt", add_special_tokens)

    def _echo_text(self, request: GenerateRequest, prompt_ids: list[int]) -> str:
        return request.prompt if isinstance(request.prompt, str) else self.tokenizer.decode(prompt_ids)

    def _reasoning_state(self, request: GenerateRequest, prompt_ids: list[int]) -> ReasoningStream | None:
        """A chat answer's reasoning split, started where its prompt leaves it (None: the model
        marks no reasoning, or a completion, whose prompt the client wrote)."""
        if self.reasoning_format is None or request.messages is None:
            return None
        prompt_tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
        return ReasoningStream(self.reasoning_format, self.reasoning_format.first_state(prompt_tail))

    def _params(
        self, request: GenerateRequest, num_prompt_tokens: int, reasoning: ReasoningStream | None = None
    ) -> tuple[SamplingParams, SpecConfig]:
        context = getattr(self.model.config, "max_position_embeddings", None)
        max_tokens = request.max_new_tokens(context, num_prompt_tokens)
        sampling: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": 0 if request.top_k == -1 else request.top_k,  # vLLM spells "all" as -1
            "seed": request.seed,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty,
            "logit_bias": logit_bias_ids(request.logit_bias),
            "min_tokens": request.min_tokens,
            "stop_token_ids": request.stop_token_ids or [],
            "ignore_eos": request.ignore_eos,
            "logprobs": request.logprobs,
        }
        if request.echo and (request.logprobs is not None or max_tokens == 0):
            # Echo with logprobs scores the prompt too; max_tokens 0 only scores it.
            sampling["prompt_logprobs"] = request.logprobs or 0
        if request.stop is not None:
            sampling["stop"] = request.stop
        grammar = request.grammar()
        if request.forced_tools:  # tool_choice required or named: the answer is calls
            source = self.tool_format.grammar(request.forced_tools, request.parallel_tool_calls)
            grammar = {"kind": "lark", "source": source, "param": "tool_choice"}
        if grammar is not None:
            sampling["grammar"] = build(GrammarSpec, **grammar)
            if reasoning is not None:  # the grammar constrains the answer after the reasoning
                sampling["reasoning"] = reasoning.fmt.grammar_spec(self.tokenizer, reasoning.state)
        spec = self.config.engine.spec
        overrides = {
            name: value
            for name, value in (("mode", request.speculation), ("num_draft_tokens", request.num_draft_tokens))
            if value is not None
        }
        if overrides:
            spec = build(SpecConfig, **{**spec.model_dump(), **overrides})
        return build(SamplingParams, **sampling), spec

    def _finish(
        self, prompt_ids: list[int], choices: list[ChoiceOutput], stats: SpecStats, last: GenerateChunk
    ) -> GenerateChunk:
        """Count the finished request and complete its last chunk with usage and counters."""
        self.num_requests += 1
        if stats.num_steps == 0:
            self.num_scoring_requests += 1
        self.totals.merge(stats)
        if self.metrics is not None:
            self.metrics.record_request(last.finish_reason, len(prompt_ids), stats)
        num_output = sum(len(choice.text.output_ids) for choice in choices)
        usage = Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=num_output,
            total_tokens=len(prompt_ids) + num_output,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.num_cached_prompt_tokens),
            completion_tokens_details=CompletionTokensDetails(
                reasoning_tokens=sum(choice.num_reasoning_tokens for choice in choices)
            ),
        )
        return last.model_copy(update={"usage": usage, "nasd": stats.to_dict(), "replica": self.stats()})


class NASDReplica(NASDServer):
    """The Serve deployment of a NASDServer (``build_app`` applies the deployment options)."""

    async def __init__(self, config: ReplicaConfig) -> None:  # Serve awaits an async constructor
        super().__init__(config, origin=serve.get_replica_context().replica_id.unique_id)
        await self.start()
        self.metrics = ReplicaMetrics(config.served_model_name, self.pools.origin)
        self._exporter = asyncio.create_task(self._export_metrics())

    async def _export_metrics(self) -> None:
        while True:
            try:
                self.metrics.export(self.stats())
            except Exception:  # a monitoring hiccup must not end the loop
                logger.exception("metrics export failed")
            await asyncio.sleep(EXPORT_INTERVAL_S)

    async def __del__(self) -> None:  # Serve's graceful-shutdown hook
        self._exporter.cancel()
        await self.shutdown()
