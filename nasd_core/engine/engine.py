"""Continuous-batching NASD engine: requests join and leave between steps.

    engine = Engine(model, tokenizer)
    engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while not engine.is_finished():
        engine.step()

``step()`` is schedule, draft, run, commit: the scheduler (``nasd_core/engine/scheduler.py``) admits
waiting requests while the paged KV-cache has blocks for them and picks this step's prompt
chunks; the speculator (``nasd_core/engine/speculator.py``) drafts for the running rows and plans how
far to verify; the runner feeds every row's last token and its draft, beside the chunks, in one
ragged forward; the commit stage verifies every row from that forward's logits, keeps what
verification emitted (rejected drafts roll back by setting each row's cached length) and
streams it; the scheduler retires finished rows.

On a device that runs steps asynchronously (a GPU), a step's streaming and the policy's
learning from it are its tail, done while the device runs the next step (between that step's
launch and its wait), as vLLM's async scheduling and SGLang's overlap scheduler process one
step's outputs during the next. What the next step needs (the rows' tokens, cache lengths and
finished rows) is committed at once; a streamed token reaches its client after the next step's
launch rather than before. On a CPU, where a forward returns only when it is done, the tail
runs at once.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from nasd_core.config import EngineConfig, ReasoningSpec, SamplingParams, SpecConfig, build
from nasd_core.engine.scheduler import ScheduledStep, Scheduler
from nasd_core.engine.sequence import GenerationResult, Request
from nasd_core.engine.speculator import Speculator
from nasd_core.engine.stopping import StopChecker
from nasd_core.errors import ContextLengthError, EngineOverloadedError, InvalidRequestError
from nasd_core.inputs import check_context, encode_prompt, eos_ids
from nasd_core.logprobs import token_logprobs
from nasd_core.metrics import SpecStats
from nasd_core.processors import LogitsProcessors, needs_processing
from nasd_core.runner.model_runner import ModelRunner, StepRow, max_context
from nasd_core.sampling import TokenDraws
from nasd_core.speculation.acceptance import AcceptanceEstimator
from nasd_core.speculation.calibration import Calibration
from nasd_core.speculation.drafter import Draft, RequestDrafter, SharedIndex
from nasd_core.speculation.ngram import NGramIndex
from nasd_core.speculation.payoff import DraftPayoff
from nasd_core.speculation.policy import DraftPlan
from nasd_core.speculation.step_time import StepTimeModel
from nasd_core.speculation.suffix import compiled_module
from nasd_core.speculation.verify import verify_rows
from nasd_core.structured import Grammars

TokenListener = Callable[[Request, list[int]], None]
# Prefix cache kept by default on a CPU, in positions: its blocks stay resident there (the
# embedded model's keys and values are 23 KB a position in the GGUF path's float16 cache: 8192 of
# them are ~190 MB), a chat's history or two. On a GPU free blocks are memory already taken, so
# every one may stay cached.
CPU_PREFIX_CACHE_TOKENS = 8192
# A wait for the device longer than this means the device, not the host, bounded the step.
DEVICE_BOUND_WAIT_S = 50e-6


def _reasoning_ids(reasoning: ReasoningSpec | None) -> list[int]:
    """The token ids a request's reasoning markers name (checked against the vocabulary)."""
    if reasoning is None:
        return []
    return [*reasoning.end_ids, *([reasoning.start_id] if reasoning.start_id is not None else [])]


def warm_up(runner: ModelRunner, config: EngineConfig) -> None:
    """Capture ``runner``'s fixed-shape steps for engines of ``config`` before they serve: rows up
    to its batch, widths up to its default draft, contexts up to the model's or the cache's."""
    runner.warm_up(
        config.max_batch_rows,
        1 + config.spec.num_draft_tokens,
        max_context(runner.model, runner.cache),
        config.graph_warmup_budget_s,
    )


class Engine:
    """Batched NASD over one model.

    Args:
        model: causal LM in eval mode.
        tokenizer: its tokenizer.
        config: batch and queue limits, default speculation settings.
        shared: read-only ``(name, index)`` draft sources shared by all requests (the
            replica's index of finished requests, the pool-fed index).
        runner: the model runner (and its KV-cache) to use; default: one sized by ``config``.
        calibration: what the engine learns of step costs and acceptance (``Calibration``),
            shared with the engines given the same one; default: a new one.
    """

    def __init__(
        self,
        model,
        tokenizer,
        config: EngineConfig | None = None,
        shared: Sequence[tuple[str, SharedIndex]] = (),
        runner: ModelRunner | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.shared = list(shared)
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = eos_ids(model, tokenizer)
        # Built (or loaded) now, never inside a request: a first build takes seconds.
        compiled_module()
        if runner is None:
            runner = ModelRunner(model, self.config.runner)
            warm_up(runner, self.config)
        self.runner = runner
        self.cache = self.runner.cache
        prefix_tokens = self.config.prefix_cache_tokens
        if prefix_tokens is None:
            on_cpu = model.device.type == "cpu"
            prefix_tokens = CPU_PREFIX_CACHE_TOKENS if on_cpu else self.cache.capacity_tokens
        self.cache.prefix_cache_blocks = prefix_tokens // self.cache.block_size
        self.prefill_chunk_tokens = self.config.runner.prefill_chunk_tokens or runner.prefill_chunk_tokens
        self.scheduler = Scheduler(
            self.cache, self.config.max_batch_rows, self.prefill_chunk_tokens, on_finish=self._finished
        )
        self.calibration = calibration if calibration is not None else Calibration()
        self.speculator = Speculator(runner, self.calibration)
        self.requests: dict[str, Request] = {}
        self.stats = SpecStats()
        self._ids = itertools.count()
        self._detached: set[str] = set()
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        # The last step's streaming and learning, left for the next step's device time.
        self._tail: list[Callable[[], None]] = []

    # The scheduler's queues and the speculator's state, read by callers and tests.
    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def prefilling(self) -> deque[Request]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def acceptance(self) -> AcceptanceEstimator:
        """Acceptance pooled over the greedy requests: the prior of each new greedy request's own
        (``Calibration.acceptance_prior``)."""
        return self.calibration.acceptance

    @property
    def step_time(self) -> StepTimeModel:
        return self.calibration.step_time

    @step_time.setter
    def step_time(self, step_time: StepTimeModel) -> None:
        self.calibration.step_time = step_time

    @property
    def payoff(self) -> DraftPayoff:
        """What drafted steps priced by this engine's step-time model deliver (``DraftPayoff``)."""
        return self.calibration.payoff

    @property
    def width_histogram(self) -> dict[int, int]:
        """Steps by the widest draft they verified."""
        return self.speculator.width_histogram

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        request_id: str | None = None,
        on_tokens: TokenListener | None = None,
        shared: Sequence[tuple[str, SharedIndex]] | None = None,
        local_index: NGramIndex | None = None,
        prefill_from: str | None = None,
        drafter: RequestDrafter | None = None,
        prefix_salt: Hashable = None,
    ) -> str:
        """Queue a request; returns its id.

        ``shared`` replaces the engine's shared draft sources for this request only (a
        tenant reads only its own indexes); None keeps the engine's. ``local_index``: the
        request-local index to use (and grow) instead of a fresh one (the seeds' storage).
        ``prefill_from``: a queued or running request with the same prompt (another choice of it,
        OpenAI's ``n``): this one copies that one's prompt keys and values once they are in
        instead of prefilling them again (if that request is already gone, it prefills itself).
        ``drafter``: one ``new_drafter`` made for this prompt and spec on another thread (its
        prompt indexing then costs the engine thread nothing); None: made here.
        ``prefix_salt``: the prompt reuses (and leaves) prefix-cache blocks only among requests
        of the same salt (a tenant's id keeps tenants from reading each other's prompts' timing).

        Raises:
            InvalidRequestError: bad prompt or parameters (nothing is queued).
            EngineOverloadedError: the waiting queue is full.
        """
        params = params if params is not None else build(SamplingParams)
        spec = spec if spec is not None else self.config.spec
        prompt_ids = encode_prompt(self.tokenizer, prompt, self.vocab_size)
        check_context(self.model, len(prompt_ids), params.max_tokens)
        if not self.cache.can_ever_fit(len(prompt_ids) + params.max_tokens):
            raise ContextLengthError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceed this "
                f"engine's KV-cache ({self.cache.capacity_tokens} positions)",
                param="max_tokens",
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"the engine queue is full ({self.config.max_waiting} waiting requests); retry later"
            )
        for param, tokens in (
            ("logit_bias", list(params.logit_bias)),
            ("reasoning", _reasoning_ids(params.reasoning)),
        ):
            outside = [token for token in tokens if not 0 <= token < self.vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"{param}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})",
                    param=param,
                )
        grammar = (
            self.grammars.matcher(params.grammar, params.reasoning) if params.grammar is not None else None
        )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        source = self._prefill_source(prefill_from, prompt_ids, params)
        stopper = StopChecker(self.tokenizer, params, self.eos_token_ids)
        request = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            spec=spec,
            stopper=stopper,
            drafter=(
                drafter
                if drafter is not None
                else self.new_drafter(prompt_ids, spec, params.seed, shared, local_index)
            ),
            draws=TokenDraws(params.seed),
            acceptance=AcceptanceEstimator(prior=self.calibration.acceptance_prior(params.is_greedy)),
            gate=self.calibration.gate_history.new_gate(),
            on_tokens=on_tokens,
            processors=(
                LogitsProcessors(params, prompt_ids, self.vocab_size, stopper.stop_ids, grammar)
                if needs_processing(params)
                else None
            ),
            logprobs=[] if params.logprobs is not None else None,
            # The first prompt token has no logprob: nothing came before it.
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            arrival_time=time.perf_counter(),
            prefill_source=source,
            prefix_salt=prefix_salt,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def new_drafter(
        self,
        prompt_ids: Sequence[int],
        spec: SpecConfig | None = None,
        seed: int | None = None,
        shared: Sequence[tuple[str, SharedIndex]] | None = None,
        local_index: NGramIndex | None = None,
    ) -> RequestDrafter:
        """A request's drafter, its prompt already learned. Reads nothing the engine thread
        writes (the shared indexes are only stored), so any thread may build it."""
        spec = spec if spec is not None else self.config.spec
        drafter = RequestDrafter(
            spec, self.shared if shared is None else shared, local_index, self.vocab_size, seed
        )
        drafter.observe(prompt_ids)
        return drafter

    def _prefill_source(
        self, prefill_from: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> Request | None:
        if prefill_from is None or params.prompt_logprobs is not None:  # scoring needs its own logits
            return None
        source = self.requests.get(prefill_from)
        if source is None or source.is_finished:
            return None  # gone before this one came (a 1-token answer): nothing to share
        if source.prompt_ids != prompt_ids:
            raise InvalidRequestError(
                "prefill_from needs a request with the same prompt", param="prefill_from"
            )
        return source

    def cancel(self, request_id: str) -> bool:
        """Stop a request now; its output so far is kept. False if unknown or already done."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._settle_tail()  # what it emitted before: streamed before its cancellation
        self.scheduler.cancel(request)
        # A running row leaves the batch at the end of the next step.
        return True

    def forget(self, request_id: str) -> None:
        """Drop a request's record now if finished, else as soon as it finishes (nobody will read it)."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]
        elif request is not None:
            self._detached.add(request_id)

    def abort_all(self) -> list[Request]:
        """Cancel and finish every queued and running request at once (shutdown, a broken step);
        what the last whole step emitted is streamed first."""
        self._settle_tail()
        return self.scheduler.abort_all()

    def is_finished(self) -> bool:
        """No request left to run, and nothing left to stream."""
        return self.scheduler.is_finished() and not self._tail

    def pop_result(self, request_id: str) -> GenerationResult:
        """The finished request's result; forgets the request."""
        request = self.requests[request_id]
        if not request.is_finished:
            raise InvalidRequestError(f"request {request_id!r} has not finished", param="request_id")
        del self.requests[request_id]
        return GenerationResult(
            token_ids=request.output_ids,
            text=request.stopper.text(),
            finish_reason=request.finish_reason or "length",
            prompt_ids=request.prompt_ids,
            stats=request.stats,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
    ) -> list[GenerationResult]:
        """Run a list of prompts to completion together; results in prompt order."""
        ids = [self.add_request(prompt, params, spec) for prompt in prompts]
        while not self.is_finished():
            self.step()
        return [self.pop_result(request_id) for request_id in ids]

    @property
    def grammars(self) -> Grammars:
        """The compiler of requests' grammars (structured output), made at the first one (on
        whichever thread asks first: building llguidance's tokenizer takes a while)."""
        return self.build_grammars()

    def build_grammars(self) -> Grammars:
        """Build the grammar compiler now if it is not built (``AsyncEngine.start`` does)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule, draft, run one ragged forward, commit; returns the requests that finished."""
        scheduled = self.scheduler.schedule()
        if not scheduled.is_empty:
            self._run(scheduled)
        finished = self.scheduler.retire()
        if scheduled.is_empty or self.scheduler.is_finished() or not self.runner.runs_async:
            self._settle_tail()  # no next step to overlap with
        return finished

    def _settle_tail(self) -> float:
        """Run the last step's tail (streaming, learning); the seconds it took. One piece at a
        time: should one raise, the rest is still there for ``abort_all`` to stream."""
        started = time.perf_counter()
        while self._tail:
            self._tail.pop(0)()
        return time.perf_counter() - started

    def _run(self, step: ScheduledStep) -> None:
        started = time.perf_counter()
        proposal = self.speculator.propose(step)
        drafts, plan = proposal.drafts, proposal.plan
        step_rows = [row for _, row in step.chunks] + [
            StepRow(request.request_id, [request.tokens[-1], *draft.tokens[:length]], 1 + length)
            for request, draft, length in zip(step.rows, drafts, plan.lengths)
        ]
        forward_started = time.perf_counter()
        logits = self.runner.forward(step_rows)
        # While the device runs this step: the last one's streaming and learning.
        overlapped_s = self._settle_tail()
        wait_started = time.perf_counter()
        self.runner.wait()
        device_bound = time.perf_counter() - wait_started > DEVICE_BOUND_WAIT_S
        # Prompt chunks that score their prompt come first; the rows' verification logits follow.
        num_chunk_logits = sum(row.num_logits for _, row in step.chunks)
        self._score_prompts(step.chunks, logits[:num_chunk_logits])
        logits = logits[num_chunk_logits:]
        emitted_rows = verify_rows(
            logits,
            [draft.tokens[:length] for draft, length in zip(drafts, plan.lengths)],
            [request.verify_row() for request in step.rows],
        )
        # The step's cost: all of it where the device outlasted the tail (the tail was hidden),
        # else all but the tail (the host was the step's bound, and the tail is no step's work).
        hidden_s = 0.0 if device_bound else overlapped_s
        step_s = time.perf_counter() - forward_started - hidden_s
        num_emitted = sum(map(len, emitted_rows))
        shape, captured = self.runner.last_graph_shape, self.runner.last_captured
        num_positions = sum(len(row.token_ids) for row in step_rows)
        for request, row in step.chunks:
            request.stats.prefill_time_s += step_s * len(row.token_ids) / num_positions
            request.prefilled_chunk(plan.cost_ratio)
        self.scheduler.chunks_done(step)
        self._commit(step, drafts, plan, logits, emitted_rows, step_s, proposal.seconds)
        # The whole step as this host ran it, drafting and commit included: what the rows' pace
        # and gates are charged, and what the policy prices widths by.
        wall_s = time.perf_counter() - started - hidden_s
        self.speculator.charge(step, proposal, emitted_rows, wall_s)
        # After the streaming: learning does not hold up the rows' tokens.
        self._tail.append(
            lambda: self.speculator.learn(
                step, step_rows, proposal, step_s, wall_s, num_emitted, shape, captured
            )
        )

    def _commit(
        self,
        step: ScheduledStep,
        drafts: list[Draft],
        plan: DraftPlan,
        logits: torch.Tensor,
        emitted_rows: list[list[int]],
        step_s: float,
        drafting_s: float,
    ) -> None:
        """Keep each row's verified tokens: its output, drafter, counters and streamed tokens
        advance, and its cached length becomes that of the tokens it holds (rejected drafts'
        slots are overwritten by the next step)."""
        learn_started = now = time.perf_counter()
        lengths = plan.lengths
        offset = 0
        for request, draft, length, emitted in zip(step.rows, drafts, lengths, emitted_rows):
            # Only an n-gram index learns alternatives (a suffix store holds the sequence alone).
            learns = request.spec.is_speculating and request.drafter.local_index is not None
            if request.spec.filler_top_k > 1 and learns:
                self._learn_alternatives(request, logits[offset : offset + len(emitted)], emitted)
            kept = request.advance(draft, length, emitted)
            # The cache holds every token but the last, which the next step feeds.
            self.cache.set_length(request.request_id, len(request.tokens) - 1)
            if request.logprobs is not None:
                num_top = request.params.logprobs
                request.logprobs += token_logprobs(logits[offset : offset + len(kept)], kept, num_top)
            offset += 1 + length
            request.stats.decode_time_s += step_s
            if request.first_token_time is None:
                request.first_token_time = now
            if request.on_tokens is not None:
                self._tail.append(functools.partial(request.on_tokens, request, kept))
        # After the streaming, with the step's other learning: no row's tokens wait for it.
        if any(lengths):
            self._tail.append(
                functools.partial(self._learn_acceptance, step.rows, drafts, lengths, emitted_rows)
            )
        if step.rows:
            share = (drafting_s + time.perf_counter() - learn_started) / len(step.rows)
            for request in step.rows:
                request.stats.drafting_time_s += share

    @staticmethod
    def _learn_acceptance(
        rows: list[Request], drafts: list[Draft], lengths: list[int], emitted_rows: list[list[int]]
    ) -> None:
        """Each row's acceptance counts from its verified draft (the step's tail)."""
        for request, draft, length, emitted in zip(rows, drafts, lengths, emitted_rows):
            request.learn_acceptance(draft, length, len(emitted))

    @staticmethod
    def _score_prompts(chunks: list[tuple[Request, StepRow]], logits: torch.Tensor) -> None:
        """Add each scored chunk's prompt logprobs: position i of a chunk starting at prompt
        index p predicts prompt token p + i + 1 (``logits``: the scored chunks' rows, in order)."""
        offset = 0
        for request, row in chunks:
            if not row.num_logits:
                continue
            start = len(request.prompt_logprobs)  # = the chunk's first prompt index + 1
            targets = request.prompt_ids[start : start + row.num_logits]
            num_top = request.params.prompt_logprobs
            request.prompt_logprobs += token_logprobs(
                logits[offset : offset + row.num_logits], targets, num_top
            )
            offset += row.num_logits

    @staticmethod
    def _learn_alternatives(request: Request, logits: torch.Tensor, emitted: list[int]) -> None:
        """The seeds' filler top-k: the target's top-k tokens at each verified position become
        known continuations of that context."""
        top = torch.topk(logits, request.spec.filler_top_k, dim=-1).indices.tolist()
        tail = request.tokens[-request.spec.max_ngram :]
        for position, alternatives in enumerate(top):
            request.drafter.learn_alternatives(tail + emitted[:position], alternatives)

    def _finished(self, request: Request) -> None:
        """The scheduler retired ``request``: count it, and forget it if nobody will read it."""
        self.stats.merge(request.stats)
        if request.request_id in self._detached:
            self._detached.discard(request.request_id)
            self.requests.pop(request.request_id, None)
