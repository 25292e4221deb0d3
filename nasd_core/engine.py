"""Continuous-batching NASD engine: requests join and leave between steps.

    engine = Engine(model, tokenizer)
    engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while not engine.is_finished():
        engine.step()

``step()`` admits waiting requests while the paged KV-cache has blocks for them, builds one
ragged forward (every running row's last token and its own draft, plus chunks of new prompts up
to a per-step token budget, so running rows keep decoding while long prompts come in), verifies
every row from that one forward's logits, rolls rejected drafts back by setting each row's
cached length, and retires finished rows.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from nasd_core.calibration import model_acceptance, model_graph_step_times, model_step_time, step_time_payoff
from nasd_core.config import EngineConfig, SamplingParams, SpecConfig, build
from nasd_core.drafter import EMPTY_DRAFT, Draft, RequestDrafter, SharedIndex, longest_matches, propose_rows
from nasd_core.errors import ContextLengthError, EngineOverloadedError, InvalidRequestError
from nasd_core.graph_plan import plan_graph_drafts
from nasd_core.inputs import check_context, encode_prompt, eos_ids
from nasd_core.logprobs import token_logprobs
from nasd_core.metrics import SpecStats
from nasd_core.model_runner import ModelRunner, StepRow
from nasd_core.ngram import NGramIndex
from nasd_core.policy import (
    AcceptanceEstimator,
    DraftPayoff,
    DraftPlan,
    RowDraft,
    draft_position_cap,
    plan_batch_drafts,
)
from nasd_core.processors import LogitsProcessors, needs_processing
from nasd_core.sampling import TokenDraws
from nasd_core.sequence import GenerationResult, Request, RequestStatus
from nasd_core.stopping import StopChecker
from nasd_core.verify import verify_rows

TokenListener = Callable[[Request, list[int]], None]
DRAFTING_COST_WEIGHT = 0.1  # moving-average weight of each step's drafting time per row
# Prompt tokens per step by default. On a CPU a step's cost grows with its tokens from the
# first ones, so chunks stay short and running rows keep their inter-token latency; on a GPU it
# hardly grows (a 1.5B model on an H100: 23-28 ms from 1 to 1088 positions,
# benchmarks/results/step_cost_cuda_qwen2-1.5b.json), so short chunks would only multiply a long
# prompt's steps: a 1000-token chat takes 4 steps of 256, 1 of 2048.
CPU_PREFILL_CHUNK_TOKENS = 256
GPU_PREFILL_CHUNK_TOKENS = 2048
# Prefix cache kept by default on a CPU, in positions: its blocks stay resident there (the
# embedded model's keys and values are 46 KB a position: 8192 of them are ~380 MB), a chat's
# history or two. On a GPU free blocks are memory already taken, so every one may stay cached.
CPU_PREFIX_CACHE_TOKENS = 8192


def default_prefill_chunk(device: torch.device) -> int:
    return CPU_PREFILL_CHUNK_TOKENS if device.type == "cpu" else GPU_PREFILL_CHUNK_TOKENS


def warm_up(runner: ModelRunner, config: EngineConfig) -> None:
    """Capture ``runner``'s fixed-shape steps for engines of ``config`` before they serve: rows up
    to its batch, widths up to its default draft, contexts up to the model's or the cache's."""
    context = getattr(runner.model.config, "max_position_embeddings", None) or runner.cache.capacity_tokens
    runner.warm_up(
        config.max_batch_rows,
        1 + config.spec.num_draft_tokens,
        min(runner.cache.capacity_tokens, context),
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
    """

    def __init__(
        self,
        model,
        tokenizer,
        config: EngineConfig | None = None,
        shared: Sequence[tuple[str, SharedIndex]] = (),
        runner: ModelRunner | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.shared = list(shared)
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.step_time = model_step_time(model)
        self.graph_step_times = model_graph_step_times(model)
        if runner is None:
            runner = ModelRunner(
                model,
                self.config.kv_cache_tokens,
                self.config.kv_block_size,
                self.config.max_batch_rows,
                step_graphs=self.config.step_graphs,
            )
            warm_up(runner, self.config)
        self.runner = runner
        self.cache = self.runner.cache
        prefix_tokens = self.config.prefix_cache_tokens
        if prefix_tokens is None:
            on_cpu = model.device.type == "cpu"
            prefix_tokens = CPU_PREFIX_CACHE_TOKENS if on_cpu else self.cache.capacity_tokens
        self.cache.prefix_cache_blocks = prefix_tokens // self.cache.block_size
        self.prefill_chunk_tokens = self.config.prefill_chunk_tokens or default_prefill_chunk(model.device)
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SpecStats()
        self.width_histogram: dict[int, int] = {}
        # Seconds to build one row's draft (moving average): the policy weighs it when
        # choosing which rows to draft for at all.
        self.drafting_s_per_row = 0.0
        # Acceptance pooled over the model's requests: the prior of each new request's own.
        self.acceptance = model_acceptance(model)
        self._ids = itertools.count()
        self._detached: set[str] = set()

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
        outside = [token for token in params.logit_bias if token >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})",
                param="logit_bias",
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
            acceptance=AcceptanceEstimator(prior=self.acceptance),
            on_tokens=on_tokens,
            processors=(
                LogitsProcessors(params, prompt_ids, self.vocab_size, stopper.stop_ids)
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
        self.waiting.append(request)
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
        request.cancelled = True
        if request.status in (RequestStatus.WAITING, RequestStatus.PREFILLING):
            for queue in (self.waiting, self.prefilling):
                if request in queue:
                    queue.remove(request)
            self._finish(request)
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
        """Cancel and finish every queued and running request at once (shutdown, a broken step)."""
        aborted = [*self.running, *self.prefilling, *self.waiting]
        for request in aborted:
            request.cancelled = True
            self._finish(request, keep_prefix=False)
        self.running, self.prefilling, self.waiting = [], deque(), deque()
        return aborted

    def is_finished(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

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
    def payoff(self) -> DraftPayoff:
        """What drafted steps priced by this engine's step-time model deliver (``DraftPayoff``)."""
        return step_time_payoff(self.step_time)

    @property
    def graph_payoff(self) -> DraftPayoff:
        """``payoff`` of the fixed-shape (graph) steps, priced by their own step-time model."""
        return step_time_payoff(self.graph_step_times)

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit, run one ragged forward (drafts verified, prompts fed), retire; returns the finished."""
        self._admit()
        chunks = self._prefill_chunks()
        if self.running or chunks:
            self._run(chunks)
        return self._retire()

    def _admit(self) -> None:
        """Move waiting requests in, oldest first, while a row is free and the KV-cache has the
        blocks for the whole request (prompt + max_tokens): a running row never waits for memory."""
        capacity = self.config.max_batch_rows - len(self.running) - len(self.prefilling)
        while capacity > 0 and self.waiting:
            request = self.waiting[0]
            num_tokens = len(request.prompt_ids) + request.params.max_tokens
            if not self.cache.can_allocate(num_tokens):
                return
            self.waiting.popleft()
            # The prompt's positions come from the prefix cache as far as it holds them (all but
            # the last token: the first decode step feeds that); prompt logprobs need every
            # position's logits, and a choice copying another's prefill gets it that way.
            reuse = request.prefill_source is None and request.prompt_logprobs is None
            prefix = request.prompt_ids[:-1] if reuse and self.cache.prefix_cache_blocks else ()
            cached = self.cache.allocate(request.request_id, num_tokens, prefix, request.prefix_salt)
            request.num_prefilled = request.stats.num_cached_prompt_tokens = cached
            request.status = RequestStatus.PREFILLING
            self.prefilling.append(request)
            capacity -= 1

    def _prefill_chunks(self) -> list[tuple[Request, StepRow]]:
        """This step's prompt chunks: up to ``prefill_chunk_tokens`` over all prefilling requests,
        oldest first. A request whose prompt is in (all but its last token, which its first
        decode step feeds) joins the running rows.

        The budget is per step, not per request: short prompts arriving together all join
        within a step or two, while a long prompt is cut into chunks so the running rows'
        inter-token latency stays bounded.
        """
        chunks = []
        budget = self.prefill_chunk_tokens
        for request in list(self.prefilling):
            target = len(request.prompt_ids) - 1
            waits_for_source = request.prefill_source is not None and request.num_prefilled < target
            if waits_for_source and not self._copy_prefill(request, target):
                continue  # its source's prompt is not in yet
            if request.num_prefilled < target:
                if budget == 0:
                    break
                end = min(target, request.num_prefilled + budget)
                chunk = request.prompt_ids[request.num_prefilled : end]
                # Scoring the prompt: every chunk position's logits (each predicts the next prompt token).
                num_logits = len(chunk) if request.prompt_logprobs is not None else 0
                row = StepRow(request.request_id, chunk, num_logits)
                chunks.append((request, row))
                budget -= end - request.num_prefilled
                request.num_prefilled = end
            else:  # prefilled by an earlier step, or a one-token prompt
                self._start_running(request)
        return chunks

    def _copy_prefill(self, request: Request, target: int) -> bool:
        """Copy the source's prompt keys and values into ``request`` once the source runs (its
        prompt is in the cache: chunks are counted when built, before their forward). A source
        that finished first leaves the request to prefill itself. True when the prompt is in."""
        source = request.prefill_source
        if source.status is RequestStatus.RUNNING:
            self.cache.copy_prefix(source.request_id, request.request_id, target)
            request.num_prefilled = target
        if source.status in (RequestStatus.RUNNING, RequestStatus.FINISHED):
            request.prefill_source = None
        return request.num_prefilled >= target

    def _start_running(self, request: Request) -> None:
        self.prefilling.remove(request)
        if request.params.max_tokens == 0:  # only scoring the prompt: done once it is in
            request.stopper.finish_reason = "length"
            self._finish(request)
            if request.on_tokens is not None:
                request.on_tokens(request, [])
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _run(self, chunks: list[tuple[Request, StepRow]]) -> None:
        rows = self.running
        started = time.perf_counter()
        num_chunk_positions = sum(len(row.token_ids) for _, row in chunks)
        drafts = self._propose(rows, len(chunks), num_chunk_positions)
        plan = self._plan(
            [request.row_draft(draft) for request, draft in zip(rows, drafts)],
            len(chunks),
            num_chunk_positions,
        )
        lengths = plan.lengths
        drafting_s = time.perf_counter() - started
        step_rows = [row for _, row in chunks] + [
            StepRow(request.request_id, [request.tokens[-1], *draft.tokens[:length]], 1 + length)
            for request, draft, length in zip(rows, drafts, lengths)
        ]

        forward_started = time.perf_counter()
        logits = self.runner.forward(step_rows)
        # Prompt chunks that score their prompt come first; the rows' verification logits follow.
        num_chunk_logits = sum(row.num_logits for _, row in chunks)
        self._score_prompts(chunks, logits[:num_chunk_logits])
        logits = logits[num_chunk_logits:]
        emitted_rows = verify_rows(
            logits,
            [draft.tokens[:length] for draft, length in zip(drafts, lengths)],
            [request.verify_row() for request in rows],
        )
        step_s = time.perf_counter() - forward_started
        self._learn_step_cost(
            rows, chunks, step_rows, plan, step_s, time.perf_counter() - started, emitted_rows
        )
        if rows:
            widest = max(lengths)
            self.width_histogram[widest] = self.width_histogram.get(widest, 0) + 1

        num_positions = sum(len(row.token_ids) for row in step_rows)
        for request, row in chunks:
            request.stats.prefill_time_s += step_s * len(row.token_ids) / num_positions
            # Each whole block is reusable as soon as it is in: a request arriving while a long
            # prompt with the same start is still being prefilled reuses what is done.
            self._cache_prefix(request)
            if request.num_prefilled == len(request.prompt_ids) - 1:
                self._start_running(request)

        learn_started = now = time.perf_counter()
        offset = 0
        for request, draft, length, emitted in zip(rows, drafts, lengths, emitted_rows):
            # The step cached the last token and every draft; keep the accepted ones only.
            self.cache.set_length(
                request.request_id, self.cache.length(request.request_id) - length + len(emitted) - 1
            )
            # Only an n-gram index learns alternatives (a suffix store holds the sequence alone).
            learns = request.spec.is_speculating and request.drafter.local_index is not None
            if request.spec.filler_top_k > 1 and learns:
                self._learn_alternatives(request, logits[offset : offset + len(emitted)], emitted)
            kept = request.advance(draft, length, emitted)
            if request.logprobs is not None:
                num_top = request.params.logprobs
                request.logprobs += token_logprobs(logits[offset : offset + len(kept)], kept, num_top)
            offset += 1 + length
            request.stats.decode_time_s += step_s
            if request.first_token_time is None:
                request.first_token_time = now
            if request.on_tokens is not None:
                request.on_tokens(request, kept)
        if rows:
            share = (drafting_s + time.perf_counter() - learn_started) / len(rows)
            for request in rows:
                request.stats.drafting_time_s += share

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

    def _propose(self, rows: list[Request], num_other_rows: int, num_other_positions: int) -> list[Draft]:
        """This step's drafts, built only for the rows that could get draft positions even if
        their drafts were as long and well matched as possible, counting the time to build
        them (a large batch of poorly matching rows drafts little or nothing: building every
        row's draft each step cost 1% of a creative-text step at 16 rows, for ~1% more tokens).
        A row whose best case got nothing rests a few steps before its next lookup
        (``policy.dormant_steps``)."""
        if not rows:
            return []
        looked_up = [request for request in rows if request.looks_up]
        matches = iter(
            longest_matches(
                [request.drafter for request in looked_up], [request.tokens for request in looked_up]
            )
        )
        best = self._plan(
            [
                request.best_case(next(matches)) if request.looks_up else request.best_case()
                for request in rows
            ],
            num_other_rows,
            num_other_positions,
            self.drafting_s_per_row,
        ).lengths
        num_rows = len(rows) + num_other_rows
        for request, length in zip(rows, best):
            request.rest(length, num_rows)
        chosen = [request for request, length in zip(rows, best) if length]
        started = time.perf_counter()
        built = iter(
            propose_rows(
                [request.drafter for request in chosen],
                [request.tokens for request in chosen],
                [request.draft_cap for request in chosen],
            )
        )
        drafts = [next(built) if length else EMPTY_DRAFT for length in best]
        if chosen:
            per_row = (time.perf_counter() - started) / len(chosen)
            self.drafting_s_per_row += DRAFTING_COST_WEIGHT * (per_row - self.drafting_s_per_row)
        return drafts

    def _learn_step_cost(
        self,
        rows: list[Request],
        chunks: list[tuple[Request, StepRow]],
        step_rows: list[StepRow],
        plan: DraftPlan,
        step_s: float,
        wall_s: float,
        emitted_rows: list[list[int]],
    ) -> None:
        """Record the step's time in the model of the path that ran it (a fixed shape's by its
        width, the packed path's by its positions), and what its drafts delivered. A step that
        captured its shape is no reading: its time is the capture's, not the shape's."""
        if self.runner.last_captured:
            return
        shape = self.runner.last_graph_shape
        emitted = sum(len(tokens) for tokens in emitted_rows)
        if shape is not None:
            if rows and not chunks and sum(plan.lengths) == plan.num_chosen:  # no "on" row's drafts
                estimate = self.graph_step_times.estimate(len(rows), shape.num_positions)
                self.graph_payoff.record(len(rows), plan, estimate, wall_s, emitted)
            self.graph_step_times.observe(shape.num_rows, shape.num_positions, step_s)
            return
        num_positions = sum(len(row.token_ids) for row in step_rows)
        if rows and not chunks and sum(plan.lengths) == plan.num_chosen:
            self.payoff.record(
                len(rows), plan, self.step_time.estimate(len(rows), num_positions), wall_s, emitted
            )
        self.step_time.observe(len(step_rows), num_positions, step_s)

    def _plan(
        self,
        row_drafts: list[RowDraft],
        num_other_rows: int,
        num_other_positions: int,
        drafting_s_per_row: float = 0.0,
    ) -> DraftPlan:
        """The policy's draft length per row, the step's total draft positions capped by what
        has been timed (``draft_position_cap``), promises discounted by what drafted steps of
        this many rows delivered (``DraftPayoff``)."""
        num_rows = len(row_drafts) + num_other_rows
        widths = self.runner.graph_widths
        if widths is not None and not num_other_rows:  # a fixed-shape step: priced by its width
            return plan_graph_drafts(
                row_drafts,
                widths,
                self.graph_step_times,
                drafting_s_per_row,
                self.graph_payoff.factor(num_rows),
            )
        return plan_batch_drafts(
            row_drafts,
            self.step_time,
            draft_position_cap(num_rows, self.step_time),
            num_other_rows,
            num_other_positions,
            drafting_s_per_row,
            self.payoff.factor(num_rows),
        )

    def _retire(self) -> list[Request]:
        done = [request for request in self.running if request.stopper.is_finished or request.cancelled]
        if not done:
            return []
        self.running = [request for request in self.running if request not in done]
        for request in done:
            self._finish(request)
        return done

    def _cache_prefix(self, request: Request) -> None:
        """Index the request's cached positions (prompt and output) for later prompts."""
        if self.cache.prefix_cache_blocks and request.request_id in self.cache.rows:
            self.cache.cache_prefix(request.request_id, request.tokens)

    def _finish(self, request: Request, keep_prefix: bool = True) -> None:
        """Retire a request; its blocks are freed, its prefix kept unless the engine is aborting
        (after a broken step, its keys and values are not trusted)."""
        request.status = RequestStatus.FINISHED
        request.finish_time = time.perf_counter()
        if keep_prefix:
            self._cache_prefix(request)
        self.cache.free(request.request_id)
        self.stats.merge(request.stats)
        if request.request_id in self._detached:
            self._detached.discard(request.request_id)
            self.requests.pop(request.request_id, None)
