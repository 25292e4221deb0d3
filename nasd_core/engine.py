"""Continuous-batching NASD engine: requests join and leave between steps.

    engine = Engine(model, tokenizer)
    engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while not engine.is_finished():
        engine.step()

``step()`` admits waiting requests, prefills new prompts up to a per-step token budget (so
running rows keep decoding while long prompts come in), runs one batched forward that verifies every
running row's draft (each row its own draft length), and retires finished rows.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from nasd_core.batch_kv import BatchKV
from nasd_core.config import EngineConfig, SamplingParams, SpecConfig, build
from nasd_core.drafter import EMPTY_DRAFT, Draft, RequestDrafter
from nasd_core.errors import EngineOverloadedError, InvalidRequestError
from nasd_core.generate import (
    GenerationResult,
    check_context,
    encode_prompt,
    eos_ids,
    model_step_time,
    prefill,
)
from nasd_core.metrics import SpecStats
from nasd_core.ngram import NGramIndex
from nasd_core.policy import RowDraft, choose_batch_draft_lengths
from nasd_core.sampling import make_generator
from nasd_core.sequence import Request, RequestStatus
from nasd_core.stopping import StopChecker
from nasd_core.verify import verify

TokenListener = Callable[[Request, list[int]], None]


class Engine:
    """Batched NASD over one model.

    Args:
        model: causal LM in eval mode.
        tokenizer: its tokenizer.
        config: batch and queue limits, default speculation settings.
        shared: read-only ``(name, index)`` draft sources shared by all requests (the
            replica's index of finished requests, the pool-fed index).
    """

    def __init__(
        self,
        model,
        tokenizer,
        config: EngineConfig | None = None,
        shared: Sequence[tuple[str, NGramIndex]] = (),
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.shared = list(shared)
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.step_time = model_step_time(model)
        self.batch = BatchKV(self.config.compact_waste_ratio)
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SpecStats()
        self.width_histogram: dict[int, int] = {}
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
        shared: Sequence[tuple[str, NGramIndex]] | None = None,
    ) -> str:
        """Queue a request; returns its id.

        ``shared`` replaces the engine's shared draft sources for this request only (a
        tenant reads only its own indexes); None keeps the engine's.

        Raises:
            InvalidRequestError: bad prompt or parameters (nothing is queued).
            EngineOverloadedError: the waiting queue is full.
        """
        params = params if params is not None else build(SamplingParams)
        spec = spec if spec is not None else self.config.spec
        prompt_ids = encode_prompt(self.tokenizer, prompt, self.vocab_size)
        check_context(self.model, len(prompt_ids), params.max_tokens)
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"the engine queue is full ({self.config.max_waiting} waiting requests); retry later"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        request = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            spec=spec,
            stopper=StopChecker(self.tokenizer, params, self.eos_token_ids),
            drafter=RequestDrafter(
                spec, self.shared if shared is None else shared, vocab_size=self.vocab_size, seed=params.seed
            ),
            generator=make_generator(params.seed),
            on_tokens=on_tokens,
            arrival_time=time.perf_counter(),
        )
        request.drafter.observe(request.tokens)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

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
            self._finish(request)
        self.running, self.prefilling, self.waiting = [], deque(), deque()
        self.batch.keep_rows([])
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

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit, prefill within the token budget, verify one batched step, retire; returns the finished."""
        self._admit()
        self._prefill()
        if self.running:
            self._decode()
        return self._retire()

    def _admit(self) -> None:
        capacity = self.config.max_batch_rows - len(self.running) - len(self.prefilling)
        while capacity > 0 and self.waiting:
            request = self.waiting.popleft()
            request.status = RequestStatus.PREFILLING
            self.prefilling.append(request)
            capacity -= 1

    def _prefill(self) -> None:
        """Feed up to ``prefill_chunk_tokens`` prompt tokens, oldest prefilling request first;
        each request whose prompt is in joins the batch.

        The budget is per step, not per request: short prompts arriving together all join
        within a step or two (one request per step made the last of C arrivals wait C steps,
        and speculative steps are longer), while a long prompt is still cut into chunks so
        the running rows' inter-token latency stays bounded.
        """
        budget = self.config.prefill_chunk_tokens
        while self.prefilling:
            request = self.prefilling[0]
            target = len(request.prompt_ids) - 1  # the last prompt token is fed by the first step
            if request.prefill_cache is None:
                request.prefill_cache = DynamicCache()
            if request.num_prefilled < target:
                if budget == 0:
                    return
                end = min(target, request.num_prefilled + budget)
                started = time.perf_counter()
                prefill(self.model, request.prompt_ids[request.num_prefilled : end], request.prefill_cache)
                request.stats.prefill_time_s += time.perf_counter() - started
                budget -= end - request.num_prefilled
                request.num_prefilled = end
            if request.num_prefilled < target:
                return
            self.prefilling.popleft()
            self.batch.add_row(self._row_cache(request), target)
            request.prefill_cache = None
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _row_cache(self, request: Request) -> DynamicCache:
        if request.num_prefilled > 0:
            return request.prefill_cache
        # A one-token prompt prefills nothing: an empty row of the right shape.
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        empty = torch.zeros((1, heads, 0, head_dim), dtype=self.model.dtype, device=self.model.device)
        return DynamicCache(ddp_cache_data=[(empty, empty)] * config.num_hidden_layers)

    def _decode(self) -> None:
        rows = self.running
        started = time.perf_counter()
        drafts = self._propose(rows)
        lengths = self._draft_lengths([request.row_draft(draft) for request, draft in zip(rows, drafts)])
        drafting_s = time.perf_counter() - started
        width = 1 + max(lengths)
        input_rows = [
            [request.tokens[-1], *draft.tokens[:length]]
            for request, draft, length in zip(rows, drafts, lengths)
        ]
        # Padding slots are masked out; their token id does not matter.
        input_ids = torch.tensor(
            [row + [0] * (width - len(row)) for row in input_rows], dtype=torch.long, device=self.model.device
        )
        attention_mask, position_ids = self.batch.step_inputs([len(row) for row in input_rows], width)

        forward_started = time.perf_counter()
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.batch.cache,
            use_cache=True,
        )
        emitted_rows = [
            verify(
                output.logits[index, : length + 1], draft.tokens[:length], request.params, request.generator
            )
            for index, (request, draft, length) in enumerate(zip(rows, drafts, lengths))
        ]
        step_s = time.perf_counter() - forward_started
        self.step_time.observe(len(rows), width, step_s)
        self.batch.commit([len(emitted) for emitted in emitted_rows], width)
        self.width_histogram[width - 1] = self.width_histogram.get(width - 1, 0) + 1

        learn_started = time.perf_counter()
        now = time.perf_counter()
        for request, draft, length, emitted in zip(rows, drafts, lengths, emitted_rows):
            kept = request.advance(draft, length, emitted)
            request.stats.decode_time_s += step_s
            if request.first_token_time is None:
                request.first_token_time = now
            if request.on_tokens is not None:
                request.on_tokens(request, kept)
        share = (drafting_s + time.perf_counter() - learn_started) / len(rows)
        for request in rows:
            request.stats.drafting_time_s += share

    def _propose(self, rows: list[Request]) -> list[Draft]:
        """This step's drafts; none at all when even the best drafts the rows could have
        would not be verified (a large batch of poorly matching rows: building 16 drafts a
        step was 4% of a creative-text step at 16 rows, for nothing)."""
        if max(self._draft_lengths([request.best_case() for request in rows])) == 0:
            return [EMPTY_DRAFT] * len(rows)
        return [request.propose() for request in rows]

    def _draft_lengths(self, row_drafts: list[RowDraft]) -> list[int]:
        """The policy's draft length per row; the cold-start table caps it until a step of
        this batch's rows and widest draft has been timed."""
        widest = 1 + max(row.num_available for row in row_drafts)
        calibrated = self.step_time.covers(len(row_drafts), widest)
        return choose_batch_draft_lengths(row_drafts, self.step_time, calibrated)

    def _retire(self) -> list[Request]:
        done = [request for request in self.running if request.stopper.is_finished or request.cancelled]
        if not done:
            return []
        keep = [index for index, request in enumerate(self.running) if request not in done]
        self.batch.keep_rows(keep)
        self.running = [self.running[index] for index in keep]
        for request in done:
            self._finish(request)
        return done

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_time = time.perf_counter()
        request.prefill_cache = None
        self.stats.merge(request.stats)
        if request.request_id in self._detached:
            self._detached.discard(request.request_id)
            self.requests.pop(request.request_id, None)
