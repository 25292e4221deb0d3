"""Asyncio front of an Engine: the engine steps on its own thread, callers stream tokens.

The engine is not thread-safe, so every call into it (add, cancel, step) happens on the
engine thread; callers talk to it through a command queue and get their tokens back
through an asyncio queue fed with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from nasd_core.config import SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.engine.sequence import Request
from nasd_core.inputs import encode_prompt
from nasd_core.logprobs import TokenLogprob
from nasd_core.metrics import SpecStats
from nasd_core.speculation.drafter import RequestDrafter, SharedIndex

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


@dataclass
class StreamChunk:
    """New tokens of one request; the last chunk has ``finish_reason`` and the request's stats."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    stats: SpecStats | None = None
    logprobs: list[TokenLogprob] | None = None  # of ``token_ids``, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first chunk, when asked for
    # On the last chunk: where in the output's text the stop string that ended it begins.
    stop_text_at: int | None = None


class AsyncEngine:
    """Owns an Engine and the thread that steps it. Construct, then ``start()``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    def start(self) -> None:
        """Build the engine's grammar compiler, then start the thread that steps the engine.

        The compiler (llguidance's tokenizer, 0.5 s on a Zen 5) is built here, before any step
        runs: built at a first constrained request, it would stall every running request. If it
        cannot be built, the engine still starts: constrained requests then try again and report
        the error."""
        if self._thread is None:
            try:
                self.engine.build_grammars()
            except Exception as exc:  # a tokenizer llguidance cannot take
                logger.warning("building the grammar compiler failed: %s", exc)
            self._thread = threading.Thread(target=self._run, name="nasd-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop stepping (requests still running are cancelled) and join the thread."""
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, function: Callable[[Engine], object]) -> Future:
        """Run ``function(engine)`` on the engine thread; the future carries its result or error."""
        future: Future = Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(self.engine))
                except BaseException as exc:  # handed to the caller, never kills the thread
                    future.set_exception(exc)

        self._commands.put(command)
        self._wakeup.set()
        return future

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        request_id: str | None = None,
        shared: Sequence[tuple[str, SharedIndex]] | None = None,
        prefill_from: str | None = None,
        prefix_salt: Hashable = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream one request's tokens. Leaving the iteration early cancels the request.

        ``shared`` overrides the engine's shared draft sources for this request;
        ``prefill_from``: another choice of the same prompt whose prefill this one copies;
        ``prefix_salt``: whose cached prompt prefixes it may reuse (``Engine.add_request``).

        Raises:
            InvalidRequestError, EngineOverloadedError: from ``Engine.add_request``.
        """
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()

        prompt_logprobs_sent = False  # set and read on the engine thread only

        def on_tokens(request: Request, token_ids: list[int]) -> None:
            nonlocal prompt_logprobs_sent
            chunk = StreamChunk(
                request.request_id, list(token_ids), num_prompt_tokens=len(request.prompt_ids)
            )
            if request.logprobs is not None:
                chunk.logprobs = request.logprobs[len(request.logprobs) - len(token_ids) :]
            if request.prompt_logprobs is not None and not prompt_logprobs_sent:
                chunk.prompt_logprobs = request.prompt_logprobs
                prompt_logprobs_sent = True
            if request.stopper.is_finished or request.cancelled:
                chunk.finish_reason, chunk.stats = request.finish_reason, request.stats
                chunk.stop_text_at = request.stopper.stop_text_at
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        def prepare() -> tuple[list[int], RequestDrafter]:
            # Off the engine thread: encoding the prompt and indexing it for the drafter are a
            # few ms for a long prompt, which the engine thread would otherwise spend between
            # two steps of every running request.
            prompt_ids = encode_prompt(self.engine.tokenizer, prompt, self.engine.vocab_size)
            if params is not None and params.grammar is not None:
                # A large schema takes long to compile: here it holds up no other request's step
                # (the engine's matcher then finds it compiled).
                self.engine.grammars.compile(params.grammar)
            seed = params.seed if params is not None else None
            return prompt_ids, self.engine.new_drafter(prompt_ids, spec, seed, shared)

        prompt_ids, drafter = await asyncio.to_thread(prepare)

        def add(engine: Engine) -> str:
            return engine.add_request(
                prompt_ids,
                params,
                spec,
                request_id,
                on_tokens=on_tokens,
                shared=shared,
                prefill_from=prefill_from,
                drafter=drafter,
                prefix_salt=prefix_salt,
            )

        added_id = await asyncio.wrap_future(self.call(add))
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            # Done or abandoned (client gone): stop it if needed, and drop its record.
            self.call(lambda engine: (engine.cancel(added_id), engine.forget(added_id)))

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if engine.is_finished():
                self._wakeup.wait(IDLE_WAIT_S)
                self._wakeup.clear()
                continue
            try:
                engine.step()
            except Exception as exc:  # a broken step must not silently stall every caller
                self.last_error = exc
                logger.exception("engine step failed; failing the running requests")
                self._fail_all(exc)
        self._fail_all(RuntimeError("engine shut down"))

    def _fail_all(self, error: BaseException) -> None:
        for request in self.engine.abort_all():
            logger.warning("request %s aborted: %s", request.request_id, error)
            if request.on_tokens is not None:
                request.on_tokens(request, [])  # its final chunk: finish_reason "cancelled"
