"""The scheduler: which requests hold rows, which prompt chunks a step feeds, who leaves.

It owns the requests' queues and their KV-cache reservations: a request is admitted only when
the cache has blocks for all of it (prompt + max_tokens), so a running row never waits for
memory; its blocks are freed (and its prefix kept for later prompts) when it finishes.
``schedule()`` returns the step's work as a value (``ScheduledStep``): the running rows and
this step's prompt chunks; the engine runs it and hands the chunks back (``chunks_done``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nasd_core.engine.sequence import Request, RequestStatus
from nasd_core.layers.kv_cache import PagedKVCache
from nasd_core.runner.model_runner import StepRow


@dataclass
class ScheduledStep:
    """One step's work: the rows that decode (each feeds its last token and its drafts) and the
    prompt chunks fed beside them."""

    rows: list[Request]
    chunks: list[tuple[Request, StepRow]]

    @property
    def is_empty(self) -> bool:
        return not (self.rows or self.chunks)

    @property
    def num_chunk_positions(self) -> int:
        return sum(len(row.token_ids) for _, row in self.chunks)


class Scheduler:
    """Queues of one engine's requests and their rows in the KV-cache.

    Args:
        cache: the runner's KV-cache (blocks are reserved here at admission).
        max_rows: most requests prefilling or running at once.
        prefill_chunk_tokens: prompt tokens fed per step over all prefilling requests.
        on_finish: called with every request that finishes, whatever the reason.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_rows: int,
        prefill_chunk_tokens: int,
        on_finish: Callable[[Request], None],
    ) -> None:
        self.cache = cache
        self.max_rows = max_rows
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.on_finish = on_finish
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def is_finished(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    def schedule(self) -> ScheduledStep:
        """Admit what fits, then this step's prompt chunks; the rows running before them decode."""
        self._admit()
        chunks = self._prefill_chunks()
        return ScheduledStep(list(self.running), chunks)

    def chunks_done(self, step: ScheduledStep) -> None:
        """After the step's forward: each chunk's whole blocks are reusable at once (a request
        arriving while a long prompt with the same start is still being prefilled reuses what is
        done), and a request whose prompt is in joins the running rows."""
        for request, _ in step.chunks:
            self.cache_prefix(request)
            if request.num_prefilled == len(request.prompt_ids) - 1:
                self._start_running(request)

    def cancel(self, request: Request) -> None:
        """Take a queued request out now; a running row leaves at the end of the next step."""
        request.cancelled = True
        if request.status in (RequestStatus.WAITING, RequestStatus.PREFILLING):
            for queue in (self.waiting, self.prefilling):
                if request in queue:
                    queue.remove(request)
            self.finish(request)

    def abort_all(self) -> list[Request]:
        """Cancel and finish every queued and running request at once (shutdown, a broken step)."""
        aborted = [*self.running, *self.prefilling, *self.waiting]
        for request in aborted:
            request.cancelled = True
            self.finish(request, keep_prefix=False)
        self.running, self.prefilling, self.waiting = [], deque(), deque()
        return aborted

    def retire(self) -> list[Request]:
        """Finish the running rows that stopped or were cancelled; returns them."""
        done = [request for request in self.running if request.stopper.is_finished or request.cancelled]
        if not done:
            return []
        self.running = [request for request in self.running if request not in done]
        for request in done:
            self.finish(request)
        return done

    def finish(self, request: Request, keep_prefix: bool = True) -> None:
        """Retire a request; its blocks are freed, its prefix kept unless the engine is aborting
        (after a broken step, its keys and values are not trusted)."""
        request.status = RequestStatus.FINISHED
        request.finish_time = time.perf_counter()
        if keep_prefix:
            self.cache_prefix(request)
        self.cache.free(request.request_id)
        self.on_finish(request)

    def cache_prefix(self, request: Request) -> None:
        """Index the request's cached positions (prompt and output) for later prompts."""
        if self.cache.prefix_cache_blocks and request.request_id in self.cache.rows:
            self.cache.cache_prefix(request.request_id, request.tokens)

    def _admit(self) -> None:
        """Move waiting requests in, oldest first, while a row is free and the KV-cache has the
        blocks for the whole request (prompt + max_tokens): a running row never waits for memory."""
        capacity = self.max_rows - len(self.running) - len(self.prefilling)
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
                chunks.append((request, StepRow(request.request_id, chunk, num_logits)))
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
            self.finish(request)
            if request.on_tokens is not None:
                request.on_tokens(request, [])
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)
