"""The OpenAI-compatible HTTP front: FastAPI mounted on a Serve deployment that holds only a
handle to the replicas (no model files, no torch).

Every error leaves as OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``,
with a 4xx status for a bad request (FastAPI's own 422 validation answer is replaced by 400).
With API keys configured (``deployments/auth.py``), every route but ``/health`` needs a valid
bearer key (401 otherwise), generation routes count against the key's limits (429 with
``Retry-After`` over them), and a request's tenant is its key's.
"""

# No `from __future__ import annotations` here: serve.ingress pickles the FastAPI app when the
# class is decorated, and FastAPI must then resolve the route annotations as real types. For
# the same reason every helper the routes use is defined above the class.
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException
from starlette.requests import Request

from deployments.auth import Admission, ApiKey, AuthSettings, Gate, Rejection, install_gate, installed_gate
from deployments.metrics import TenantMetrics
from deployments.response_store import (
    ResponseStoreSettings,
    StoredResponse,
    StoreUnavailable,
    open_response_store,
)
from deployments.responses import RESPONSE_ID, ResponseAnswer, ResponsesRequest, chat_request
from deployments.routing import placed, routing_key
from deployments.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    GenerateChunk,
    GenerateRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenLogprob,
    TokensResult,
    ToolCallDelta,
    Usage,
    new_id,
)
from deployments.streams import interleave

logger = logging.getLogger(__name__)

# While draining, a new generation request is told to come back after this many seconds.
DRAINING_RETRY_AFTER_S = 5
# Counters summed over replicas in the stats endpoint's "total".
_SUMMED = ("num_steps", "num_emitted", "num_drafted", "num_accepted")

app = FastAPI(title="NASD-Serve", description="OpenAI-compatible server with n-gram speculative decoding.")


def error_response(status_code: int, info: ErrorInfo) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return error_response(400, ErrorInfo(message=message, type="invalid_request_error"))
    # loc is ("body", field, ...): the top-level field is the param (as OpenAI names it), the
    # full path goes in the message.
    path = first["loc"][1:]
    param = str(path[0]) if path else None
    message = _located(path, first["msg"])
    return error_response(400, ErrorInfo(message=message, type="invalid_request_error", param=param))


def _located(path: Sequence[Any], message: str) -> str:
    """A validation message after the dotted path of the field it is about."""
    return f"{'.'.join(str(part) for part in path) or 'body'}: {message}"


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, ErrorInfo(message=str(exc.detail), type=kind))


# Times a generation call that failed before its first chunk is sent again (a replica died).
REPLICA_RETRIES = 1


def _shutting_down() -> JSONResponse:
    info = ErrorInfo(
        message="The server is shutting down; retry the request.",
        type="service_unavailable",
        code="shutting_down",
    )
    response = error_response(503, info)
    response.headers["Retry-After"] = str(DRAINING_RETRY_AFTER_S)
    return response


def _store_unavailable(exc: StoreUnavailable) -> JSONResponse:
    info = ErrorInfo(
        message=f"{exc}; retry the request.", type="service_unavailable", code="store_unavailable"
    )
    response = error_response(503, info)
    response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


def _response_not_found(response_id: str, param: str | None = None) -> JSONResponse:
    """An unknown, expired, deleted or another tenant's response id: one answer for all four."""
    message = f"no response with id {response_id!r} (unknown, expired or deleted)"
    return error_response(
        404, ErrorInfo(message=message, type="invalid_request_error", param=param, code="response_not_found")
    )


def _malformed_response_id(response_id: str) -> JSONResponse:
    message = f"{response_id!r} is not a response id (resp_ and 32 hex digits)"
    return error_response(
        400, ErrorInfo(message=message, type="invalid_request_error", code="invalid_response_id")
    )


def _invalid_text(exc: ValueError) -> str:
    """A validation failure as one line: pydantic's errors with their fields, or the message."""
    if isinstance(exc, ValidationError):
        return "; ".join(_located(error["loc"], error["msg"]) for error in exc.errors())
    return str(exc)


def _route_path(request: Request) -> str:
    """The request's path inside the application (without the route prefix Serve mounts it at)."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _unauthorized(has_header: bool) -> JSONResponse:
    message = (
        "Incorrect API key provided."
        if has_header
        else "Missing bearer authentication in header: send 'Authorization: Bearer <key>'."
    )
    response = error_response(
        401, ErrorInfo(message=message, type="invalid_request_error", code="invalid_api_key")
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


class _ReleasingStream(StreamingResponse):
    """Server-sent events that call ``release`` once the response is over: sent, abandoned by
    the client, or cancelled before its first byte (when a body generator never starts, its
    own ``finally`` never runs)."""

    def __init__(self, events: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


@app.middleware("http")
async def _authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Without keys, nothing. With keys: the bearer key's ``ApiKey`` in ``request.state.api_key``
    (401 without a valid one, except on /health); the generation routes admit it against its
    limits once they know the request's rows (``OpenAIIngress._answer``)."""
    gate = installed_gate()
    path = _route_path(request)
    if gate is None or not gate.keys.enabled or path == "/health":
        request.state.api_key = None
        return await call_next(request)
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    key = gate.keys.find(presented.strip()) if scheme.lower() == "bearer" and presented.strip() else None
    if key is None:
        gate.limiter.num_unauthorized += 1
        if gate.metrics is not None:
            gate.metrics.record_unauthorized()
        return _unauthorized(bool(header))
    request.state.api_key = key
    gate.export_key_file()
    return await call_next(request)


class TokenTally:
    """The tokens a request's prompts used so far, from their chunks: the usage of each prompt's
    last chunk, or, for a stream dropped or cut by an error before it, its prompt's tokens and
    every token its chunks carried."""

    def __init__(self, num_prompts: int) -> None:
        self.prompt = [0] * num_prompts
        self.completion = [0] * num_prompts

    async def counted(self, index: int, chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
        async for chunk in chunks:
            if chunk.usage is not None:
                self.prompt[index] = chunk.usage.prompt_tokens
                self.completion[index] = chunk.usage.completion_tokens
            else:
                self.prompt[index] = max(self.prompt[index], chunk.prompt_tokens)
                self.completion[index] += chunk.tokens
            yield chunk

    def totals(self) -> tuple[int, int]:
        return sum(self.prompt), sum(self.completion)


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> CompletionLogprobs:
    """Completions' logprobs shape (parallel lists) of chat-shaped ``entries``; offsets count
    from ``text_offset`` (the characters of the answer sent before them)."""
    logprobs = CompletionLogprobs()
    for entry in entries:
        logprobs.text_offset.append(text_offset)
        logprobs.tokens.append(entry.token)
        logprobs.token_logprobs.append(entry.logprob)
        scored = entry.logprob is not None  # an echoed prompt's first token is not
        logprobs.top_logprobs.append(
            {top.token: top.logprob for top in entry.top_logprobs} if scored else None
        )
        text_offset += len(entry.token)
    return logprobs


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _replica_failure(exc: Exception) -> GenerateChunk:
    # The replica reports request errors as chunks; an exception here means the call itself
    # failed (replica died mid-request, no replica reachable).
    logger.warning("replica call failed: %s: %s", type(exc).__name__, exc)
    info = ErrorInfo(
        message=f"the replica serving this request failed ({type(exc).__name__}); retry", type="server_error"
    )
    return GenerateChunk(error=info, status_code=503)


def _sum_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    sums: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            sums[key] = sums.get(key, 0) + value
    return sums


def sum_spec(specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Speculation counters (``SpecStats.to_dict``) summed, with the rates recomputed from the
    sums: over the replicas in the stats endpoint, over the prompts of a batched request."""
    total: dict[str, Any] = {name: sum(spec[name] for spec in specs) for name in _SUMMED}
    total["tokens_per_step"] = (
        round(total["num_emitted"] / total["num_steps"], 4) if total["num_steps"] else 0.0
    )
    total["acceptance_rate"] = (
        round(total["num_accepted"] / total["num_drafted"], 4) if total["num_drafted"] else 0.0
    )
    for name in ("drafted_by_source", "accepted_by_source"):
        total[name] = _sum_counts([spec[name] for spec in specs])
    return total


def _total(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed over replicas."""
    return {
        "num_requests": sum(stats["num_requests"] for stats in replicas),
        "num_scoring_requests": sum(stats.get("num_scoring_requests", 0) for stats in replicas),
        **sum_spec([stats["spec"] for stats in replicas]),
        "width_histogram": _sum_counts([stats["width_histogram"] for stats in replicas]),
    }


async def _collect(chunks: AsyncIterator[GenerateChunk]) -> tuple[GenerateChunk, list[GenerateChunk]]:
    """The last chunk (or an error chunk, as it came) and each choice in index order, as one
    chunk with its whole text, logprobs and finish reason."""
    last, choices = GenerateChunk(), {}
    async for chunk in chunks:
        last = chunk
        choice = choices.setdefault(chunk.index, GenerateChunk(index=chunk.index))
        choice.text += chunk.text
        if chunk.reasoning:
            choice.reasoning = (choice.reasoning or "") + chunk.reasoning
        if chunk.tool_calls:
            choice.tool_calls = (choice.tool_calls or []) + chunk.tool_calls
        if chunk.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + chunk.logprobs
        choice.finish_reason = chunk.finish_reason or choice.finish_reason
    return last, [choices[index] for index in sorted(choices)]


async def _merged(
    streams: list[AsyncGenerator[GenerateChunk, None]], num_choices: int
) -> AsyncIterator[GenerateChunk]:
    """The chunks of a batch's requests (one per prompt) as one request's, in arrival order:
    choice i of prompt p becomes choice p * num_choices + i, and only the last chunk carries
    usage and counters, summed over the prompts. An error ends the whole; leaving early
    cancels every prompt's request."""
    usages: list[Usage] = []
    specs: list[dict[str, Any]] = []
    async with contextlib.aclosing(interleave(streams)) as chunks:
        async for prompt_index, chunk in chunks:
            chunk.index += prompt_index * num_choices
            if chunk.error is not None:
                yield chunk
                return
            if chunk.usage is not None:  # this prompt's last chunk
                usages.append(chunk.usage)
                specs.append(chunk.nasd or {})
                if len(usages) < len(streams):
                    chunk.usage = chunk.nasd = None
                else:
                    chunk.usage = Usage(
                        prompt_tokens=sum(usage.prompt_tokens for usage in usages),
                        completion_tokens=sum(usage.completion_tokens for usage in usages),
                        total_tokens=sum(usage.total_tokens for usage in usages),
                        prompt_tokens_details=PromptTokensDetails(
                            cached_tokens=sum(
                                usage.prompt_tokens_details.cached_tokens
                                for usage in usages
                                if usage.prompt_tokens_details is not None
                            )
                        ),
                    )
                    chunk.nasd = sum_spec(specs) if all(specs) else None
            yield chunk


@serve.ingress(app)
class OpenAIIngress:
    """OpenAI routes over a handle to the NASD replicas.

    Args:
        replica: handle to the ``NASDReplica`` deployment.
        served_model_name: the name of the served model (answers carry it).
        aliases: other names requests may ask for it by (listed in ``/v1/models`` too).
        pool_partitions: the replicas' ``PoolConfig.partitions``; with partitions each request
            carries its tenant and partition as its session id, for the replicas' router.
        auth: API keys and their limits (``deployments/auth.py``); None: an open server.
        response_store: where the Responses API keeps its responses; None: this process's memory.
        conversation_affinity: route each request by its conversation (``routing_key``), so later
            turns find their prefix in a replica's cache (the replicas' router bounds the load).
    """

    def __init__(
        self,
        replica: DeploymentHandle,
        served_model_name: str,
        aliases: Sequence[str] = (),
        pool_partitions: int = 0,
        auth: AuthSettings | None = None,
        response_store: ResponseStoreSettings | None = None,
        conversation_affinity: bool = False,
    ) -> None:
        self.response_store = open_response_store(response_store or ResponseStoreSettings())
        self.gate = Gate(auth or AuthSettings(), lambda: TenantMetrics(served_model_name))
        install_gate(self.gate)
        self.replica = replica
        self.pool_partitions = pool_partitions
        self.conversation_affinity = conversation_affinity
        self.served_model_name = served_model_name
        self.model_names = [served_model_name, *aliases]
        self.created = int(time.time())
        self.model_info: dict[str, Any] | None = None
        # Each replica's latest stats, from the last chunk of every request and stats calls.
        self.replica_stats: dict[str, dict[str, Any]] = {}
        # Generation requests not yet fully answered, and whether new ones are turned away.
        self.num_answering = 0
        self.draining = False

    async def drain(self, timeout_s: float) -> int:
        """Turn new generation requests away (503, and 503 on ``/health`` so a balancer stops
        sending) and wait up to ``timeout_s`` for those being answered to finish. Returns how
        many are still being answered. Called by ``deployments.shutdown`` before Serve stops."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.num_answering and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.num_answering

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health(self) -> Response:
        if self.draining:
            return _shutting_down()
        try:
            await self.replica.check_health.remote()
        except Exception as exc:
            return error_response(503, _replica_failure(exc).error)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[await self._model_card(name) for name in self.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(self, model_id: str) -> Response:
        if (error := self._check_model(model_id)) is not None:
            return error
        return JSONResponse((await self._model_card(model_id)).model_dump())

    @app.post("/v1/completions", response_model=None)
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        request_id = new_id("cmpl")
        tenant = self._tenant(raw, body.user)

        async def whole(choices: list[GenerateChunk], last: GenerateChunk) -> dict[str, Any]:
            return CompletionResponse(
                id=request_id,
                model=self.served_model_name,
                choices=[
                    CompletionChoice(
                        index=choice.index,
                        text=choice.text,
                        finish_reason=choice.finish_reason,
                        logprobs=completion_logprobs(choice.logprobs)
                        if choice.logprobs is not None
                        else None,
                    )
                    for choice in choices
                ],
                usage=last.usage,
                nasd=last.nasd,
            ).model_dump()

        return await self._answer(
            raw.state.api_key,
            body.model,
            [GenerateRequest.from_completion(body, prompt, tenant) for prompt in body.prompts],
            body.stream,
            lambda chunks: self._completion_events(request_id, body, chunks),
            whole,
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        request_id = new_id("chatcmpl")

        async def whole(choices: list[GenerateChunk], last: GenerateChunk) -> dict[str, Any]:
            return ChatCompletionResponse(
                id=request_id,
                model=self.served_model_name,
                choices=[
                    ChatChoice(
                        index=choice.index,
                        message=AssistantMessage(
                            content=choice.text if choice.text or not choice.tool_calls else None,
                            reasoning=choice.reasoning,
                            reasoning_content=choice.reasoning,
                            tool_calls=choice.tool_calls,
                        ),
                        finish_reason=choice.finish_reason,
                        logprobs=ChatLogprobs(content=choice.logprobs)
                        if choice.logprobs is not None
                        else None,
                    )
                    for choice in choices
                ],
                usage=last.usage,
                nasd=last.nasd,
            ).model_dump()

        return await self._answer(
            raw.state.api_key,
            body.model,
            [GenerateRequest.from_chat(body, self._tenant(raw, body.user))],
            body.stream,
            lambda chunks: self._chat_events(request_id, body, chunks),
            whole,
        )

    @app.post("/v1/responses", response_model=None)
    async def responses(self, body: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API on the chat path (``deployments/responses.py``): a stored
        conversation continued by ``previous_response_id``, function tools, ``text.format``."""
        tenant = self._store_tenant(raw)
        try:
            history: list[dict[str, Any]] = []
            if body.previous_response_id is not None:
                previous = await self.response_store.get(tenant, body.previous_response_id)
                if previous is None:
                    return _response_not_found(body.previous_response_id, "previous_response_id")
                history = previous.messages
            elif body.store:
                await self.response_store.check()
            items = body.input_items()
            chat, conversation = chat_request(body, items, history)
        except StoreUnavailable as exc:
            return _store_unavailable(exc)
        except ValueError as exc:  # pydantic's ValidationError included
            return error_response(400, ErrorInfo(message=_invalid_text(exc), type="invalid_request_error"))

        async def save(stored: StoredResponse) -> None:
            await self.response_store.put(tenant, answer.id, stored)

        answer = ResponseAnswer(
            body, self.served_model_name, items, conversation, save if body.store else None
        )
        try:
            return await self._answer(
                raw.state.api_key,
                body.model,
                [GenerateRequest.from_chat(chat, self._tenant(raw, body.user))],
                body.stream,
                answer.events,
                answer.whole,
            )
        except StoreUnavailable as exc:  # answered, but not stored: the client is told to retry
            return _store_unavailable(exc)

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def stored_response(self, response_id: str, raw: Request) -> Response:
        stored = await self._stored(response_id, raw)
        return stored if isinstance(stored, Response) else JSONResponse(stored.response)

    @app.get("/v1/responses/{response_id}/input_items", response_model=None)
    async def response_input_items(
        self, response_id: str, raw: Request, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> Response:
        """The stored response's own input items (OpenAI's list shape: newest first by default)."""
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            message = "order is 'asc' or 'desc', and limit in [1, 100]"
            return error_response(400, ErrorInfo(message=message, type="invalid_request_error"))
        stored = await self._stored(response_id, raw)
        if isinstance(stored, Response):
            return stored
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        ids = [item["id"] for item in items]
        if after is not None:
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    @app.delete("/v1/responses/{response_id}", response_model=None)
    async def delete_response(self, response_id: str, raw: Request) -> Response:
        if not RESPONSE_ID.match(response_id):
            return _malformed_response_id(response_id)
        try:
            deleted = await self.response_store.delete(self._store_tenant(raw), response_id)
        except StoreUnavailable as exc:
            return _store_unavailable(exc)
        if not deleted:
            return _response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/tokenize", response_model=None)
    async def tokenize(self, body: TokenizeRequest) -> Response:
        """vLLM's route: the prompt's (or the rendered messages') token ids."""
        result = await self._tokens_call(body.model, self.replica.tokenize, body)
        if isinstance(result, Response):
            return result
        return JSONResponse(
            {"count": len(result.tokens), "max_model_len": result.max_model_len, "tokens": result.tokens}
        )

    @app.post("/detokenize", response_model=None)
    async def detokenize(self, body: DetokenizeRequest) -> Response:
        """vLLM's route: the text of token ids."""
        result = await self._tokens_call(body.model, self.replica.detokenize, body)
        if isinstance(result, Response):
            return result
        return JSONResponse({"prompt": result.text})

    @app.get("/tokenizer_info", response_model=None)
    async def tokenizer_info(self) -> Response:
        """vLLM's route: the tokenizer's special tokens, chat template and settings."""
        try:
            return JSONResponse(await self.replica.tokenizer_info.remote())
        except Exception as exc:
            failure = _replica_failure(exc)
            return error_response(failure.status_code, failure.error)

    @app.get("/v1/nasd/stats")
    async def nasd_stats(self, raw: Request) -> dict[str, Any]:
        """Speculation counters per replica (the latest each one reported) and summed; with API
        keys, the tenants' counters: every tenant's for an admin key, the key's own otherwise."""
        try:
            self._remember(await self.replica.stats.remote())
        except Exception as exc:  # still show what earlier requests reported
            logger.warning("stats call failed: %s", exc)
        replicas = sorted(self.replica_stats.values(), key=lambda stats: stats["replica_id"])
        stats = {
            "object": "nasd.stats",
            "model": self.served_model_name,
            "total": _total(replicas),
            "replicas": replicas,
        }
        key: ApiKey | None = raw.state.api_key
        if key is not None:
            stats["auth"] = self.gate.limiter.snapshot(None if key.admin else key.tenant)
            if key.admin:
                stats["auth"]["key_file"] = self.gate.key_file_state()
        return stats

    # ----------------------------------------------------------------- helpers
    def _store_tenant(self, raw: Request) -> str | None:
        """Whose stored responses a request reads: its API key's tenant (None without keys: the
        ``user`` label is any caller's to write, so it scopes nothing here)."""
        key: ApiKey | None = raw.state.api_key
        return key.tenant if key is not None else None

    async def _stored(self, response_id: str, raw: Request) -> StoredResponse | Response:
        """The stored response of ``response_id`` for the request's tenant, or the error answer."""
        if not RESPONSE_ID.match(response_id):
            return _malformed_response_id(response_id)
        try:
            stored = await self.response_store.get(self._store_tenant(raw), response_id)
        except StoreUnavailable as exc:
            return _store_unavailable(exc)
        return stored if stored is not None else _response_not_found(response_id)

    def _tenant(self, raw: Request, user: str | None) -> str | None:
        """A request's tenant: its key's where keys are configured, else its ``user`` label
        (which any caller may write: not isolation)."""
        key: ApiKey | None = raw.state.api_key
        return key.tenant if key is not None else user

    async def _answer(
        self,
        key: ApiKey | None,
        model: str | None,
        requests: list[GenerateRequest],
        stream: bool,
        events: Callable[[AsyncIterator[GenerateChunk]], AsyncIterator[str]],
        whole: Callable[[list[GenerateChunk], GenerateChunk], Awaitable[dict[str, Any]]],
    ) -> Response:
        """One generation route: check the model, start the requests (one per prompt) on
        replicas, then answer with ``events`` (SSE) or, once they are done, the ``whole``
        response; errors as JSON. The tokens are counted against ``key`` (None: no keys)."""
        if (error := self._check_model(model)) is not None:
            return error
        if self.draining:
            return _shutting_down()
        # Counted from here, admission included, so a drain waits for it; released once on every
        # path (a stream's response releases it when the stream is over).
        self.num_answering += 1
        admission: Admission | None = None
        tally = TokenTally(len(requests))
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_answering -= 1
                if admission is not None:
                    self.gate.finish(admission, *tally.totals())

        streaming = False
        try:
            if key is not None:
                admitted = self.gate.admit(key, sum(r.n for r in requests), await self._reserve(requests))
                if isinstance(admitted, Rejection):
                    info = ErrorInfo(message=admitted.message, type=admitted.kind, code="rate_limit_exceeded")
                    response = error_response(429, info)
                    response.headers["Retry-After"] = str(admitted.retry_after_s)
                    return response
                admission = admitted
            started = await asyncio.gather(*(self._start(request) for request in requests))
            failed = [first for _, first in started if first.error is not None]
            if failed:  # none of the batch is answered: cancel the prompts that did start
                for chunks, first in started:
                    if chunks is not None and first.error is None:
                        chunks.cancel()
                return error_response(failed[0].status_code, failed[0].error)
            streams = [
                tally.counted(index, self._chunks(first, chunks))
                for index, (chunks, first) in enumerate(started)
            ]
            merged = streams[0] if len(streams) == 1 else _merged(streams, requests[0].n)
            if stream:
                streaming = True
                return _ReleasingStream(events(merged), release)
            last, choices = await _collect(merged)
        finally:
            if not streaming:
                release()
        if last.error is not None:
            return error_response(last.status_code, last.error)
        return JSONResponse(await whole(choices, last))

    async def _reserve(self, requests: list[GenerateRequest]) -> int:
        """Tokens a request reserves against its key's minute: each row's most new tokens
        (``GenerateRequest.max_new_tokens``, the prompt not yet encoded)."""
        context = None
        if any(request.max_tokens is None for request in requests):
            await self._model_card(self.served_model_name)
            context = (self.model_info or {}).get("max_model_len")
        return sum(request.n * request.max_new_tokens(context) for request in requests)

    async def _tokens_call(self, model: str | None, method, body: BaseModel) -> TokensResult | Response:
        """A tokenize / detokenize call on a replica; an error as an OpenAI error response."""
        if (error := self._check_model(model)) is not None:
            return error
        try:
            result = await method.remote(body.model_dump())
        except Exception as exc:
            failure = _replica_failure(exc)
            return error_response(failure.status_code, failure.error)
        if result.error is not None:
            return error_response(result.status_code, result.error)
        return result

    async def _model_card(self, name: str) -> ModelCard:
        if self.model_info is None:
            try:  # asked once: every replica serves the same model
                self.model_info = await self.replica.model_info.remote()
            except Exception as exc:  # still list the model, without its context length
                logger.warning("model_info call failed: %s", exc)
        max_model_len = self.model_info["max_model_len"] if self.model_info else None
        return ModelCard(id=name, created=self.created, max_model_len=max_model_len)

    def _check_model(self, model: str | None) -> JSONResponse | None:
        if model is None or model in self.model_names:
            return None
        info = ErrorInfo(
            message=f"the model {model!r} does not exist; this server serves {self.served_model_name!r}",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )
        return error_response(404, info)

    async def _start(
        self, request: GenerateRequest
    ) -> tuple[DeploymentResponseGenerator | None, GenerateChunk]:
        """Send the request to a replica and wait for its first chunk (which may be an error),
        so the HTTP status is known before any byte of the answer is sent. A call that fails
        before its first chunk (the replica died) is sent again, once: nothing of it reached the
        client (a whole answer's first chunk is its last), and Serve routes it to a live replica."""
        request = placed(request, self.pool_partitions)
        session_id = routing_key(request, self.pool_partitions, self.conversation_affinity)
        handle = self.replica.options(stream=True, **({"session_id": session_id} if session_id else {}))
        for attempt in range(1 + REPLICA_RETRIES):
            chunks = handle.generate.remote(request.model_dump())
            try:
                first = await chunks.__anext__()
            except Exception as exc:
                chunks.cancel()
                if attempt < REPLICA_RETRIES:
                    logger.warning("replica call failed before its first chunk (%s); sending it again", exc)
                    continue
                return None, _replica_failure(exc)
            self._remember(first.replica)
            return chunks, first

    async def _next(self, chunks: DeploymentResponseGenerator) -> GenerateChunk | None:
        """The next chunk, None at the end; a failed call becomes an error chunk."""
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as exc:
            return _replica_failure(exc)
        self._remember(chunk.replica)
        return chunk

    async def _chunks(
        self, first: GenerateChunk, chunks: DeploymentResponseGenerator
    ) -> AsyncIterator[GenerateChunk]:
        """Every chunk of a request, the first included, up to the last or an error. Leaving
        early (the client went away) cancels the request on the replica."""
        chunk: GenerateChunk | None = first
        try:
            while chunk is not None:
                yield chunk
                if chunk.usage is not None or chunk.error is not None:  # the request's last chunk
                    return
                chunk = await self._next(chunks)
        finally:
            if chunk is None or (chunk.usage is None and chunk.error is None):
                chunks.cancel()

    def _remember(self, stats: dict[str, Any] | None) -> None:
        if stats is not None and stats.get("replica_id"):
            self.replica_stats[stats["replica_id"]] = stats

    async def _completion_events(
        self, request_id: str, body: CompletionRequest, chunks: AsyncIterator[GenerateChunk]
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def event(choices: list[CompletionChoice], usage=None) -> str:
            return _sse(
                CompletionChunk(
                    id=request_id, created=created, model=self.served_model_name, choices=choices, usage=usage
                )
            )

        text_offsets = [0] * (len(body.prompts) * body.n)  # per choice: where its next token starts
        async for chunk in chunks:
            if chunk.error is not None:
                yield _sse(ErrorResponse(error=chunk.error))
                break
            logprobs = None
            if chunk.logprobs is not None:
                logprobs = completion_logprobs(chunk.logprobs, text_offsets[chunk.index])
                text_offsets[chunk.index] += sum(len(token) for token in logprobs.tokens)
            choice = CompletionChoice(
                index=chunk.index, text=chunk.text, finish_reason=chunk.finish_reason, logprobs=logprobs
            )
            yield event([choice])
            if chunk.usage is not None and body.include_usage:
                yield event([], usage=chunk.usage)
        yield "data: [DONE]\n\n"

    async def _chat_events(
        self, request_id: str, body: ChatCompletionRequest, chunks: AsyncIterator[GenerateChunk]
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def event(choices: list[ChatChunkChoice], usage=None) -> str:
            return _sse(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.served_model_name, choices=choices, usage=usage
                )
            )

        # OpenAI opens each choice of a chat stream with the role, then sends content deltas.
        num_calls = [0] * body.n
        for index in range(body.n):
            yield event([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        async for chunk in chunks:
            if chunk.error is not None:
                yield _sse(ErrorResponse(error=chunk.error))
                break
            if chunk.reasoning:
                delta = Delta(reasoning=chunk.reasoning, reasoning_content=chunk.reasoning)
                yield event([ChatChunkChoice(index=chunk.index, delta=delta)])
            if chunk.text or chunk.logprobs:
                logprobs = ChatLogprobs(content=chunk.logprobs) if chunk.logprobs is not None else None
                delta = Delta(content=chunk.text)
                yield event([ChatChunkChoice(index=chunk.index, delta=delta, logprobs=logprobs)])
            if chunk.tool_calls:
                first = num_calls[chunk.index]
                num_calls[chunk.index] += len(chunk.tool_calls)
                calls = [
                    ToolCallDelta(index=first + offset, **call.model_dump())
                    for offset, call in enumerate(chunk.tool_calls)
                ]
                yield event([ChatChunkChoice(index=chunk.index, delta=Delta(tool_calls=calls))])
            if chunk.finish_reason is not None:
                finish = ChatChunkChoice(index=chunk.index, delta=Delta(), finish_reason=chunk.finish_reason)
                yield event([finish])
            if chunk.usage is not None and body.include_usage:
                yield event([], usage=chunk.usage)
        yield "data: [DONE]\n\n"
