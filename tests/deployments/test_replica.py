"""NASDServer without Serve, on the real model: text streaming, error chunks, overload, and the
graceful shutdown that flushes pool writes to the machine's Redis."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import redis

from deployments.outputs import TextStream
from deployments.replica import NASDServer, ReplicaConfig
from deployments.schemas import GenerateChunk
from nasd_core import SamplingParams, generate
from nasd_core.config import EngineConfig
from nasd_core.speculation.calibration import PROBE_POSITIONS
from pool_service import PoolConfig, open_store
from tests.redis_server import MACHINE_REDIS_URL, is_up, require

PROMPT = "one, two, three, four, five,"


def collect(server: NASDServer, loop: asyncio.AbstractEventLoop, request: dict) -> list[GenerateChunk]:
    async def run() -> list[GenerateChunk]:
        return [chunk async for chunk in server.generate(request)]

    return loop.run_until_complete(run())


@pytest.fixture(scope="module")
def model(gguf_model):
    """The library's reference: a replica's default weights (the embedded model's GGUF blocks)."""
    return gguf_model


@pytest.fixture(scope="module")
def served():
    """A started server that runs one request at a time and queues one more."""
    loop = asyncio.new_event_loop()
    config = ReplicaConfig(engine=EngineConfig(max_batch_rows=1, max_waiting=1), probe_max_rows=8)
    server = NASDServer(config, origin="test")
    loop.run_until_complete(server.start())
    yield server, loop
    loop.run_until_complete(server.shutdown())
    loop.close()


# ------------------------------------------------------------------- TextStream
@pytest.mark.parametrize("stop", [(), (" green",), ("é b", "zz")])
def test_text_stream_deltas_add_up_to_the_cut_text(tokenizer, stop):
    text = "café ☕ red, green, blue; é by é by"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, stop)
    deltas = []
    for count, token in enumerate(token_ids, start=1):
        # Fed as the engine feeds it: the request ends with the token that completes a stop.
        so_far = tokenizer.decode(token_ids[:count])
        found = [at for at in (so_far.find(s) for s in stop) if at >= 0]
        finished = count == len(token_ids) or bool(found)
        deltas.append(stream.push([token], finished, min(found, default=None)))
        if finished:
            break
    cut = min((at for at in (text.find(s) for s in stop) if at >= 0), default=len(text))
    assert "".join(deltas) == text[:cut]
    assert len(deltas) > 3 and all("\ufffd" not in delta for delta in deltas), "a half character was sent"


def test_a_stop_string_below_min_tokens_stays_in_the_text(served, model, tokenizer):
    """The engine looks for stop strings only from min_tokens on; the text a client gets is cut
    where the engine stopped, not at an earlier occurrence, as the library's result is."""
    server, loop = served
    params = SamplingParams(max_tokens=24, min_tokens=8, stop=[" "])
    expected = generate(model, tokenizer, PROMPT, params)
    assert " " in expected.text, "the test needs a space that min_tokens kept"
    body = {"prompt": PROMPT, "max_tokens": 24, "min_tokens": 8, "stop": [" "], "temperature": 0}
    (whole,) = collect(server, loop, body)
    streamed = collect(server, loop, {**body, "stream": True})
    assert whole.text == "".join(chunk.text for chunk in streamed) == expected.text


def test_start_probes_step_times_up_to_the_batch_limit(served):
    """Before any request, the step-time surface holds every probed width for the one row
    this server batches (the cold-start table would cap the draft at 5 positions)."""
    server, _ = served
    step_time = server.async_engine.engine.calibration.step_time
    assert step_time.widest_measured(1) == max(PROBE_POSITIONS) - 1 and step_time.widest_measured(2) is None


# -------------------------------------------------------------- error chunks
@pytest.mark.parametrize(
    ("request_body", "param", "code"),
    [
        ({"prompt": [1] * 9000, "max_tokens": 4}, "max_tokens", "context_length_exceeded"),
        ({"prompt": [49152]}, "prompt", None),
        ({"prompt": PROMPT, "temperature": -1}, "temperature", None),
        ({"prompt": PROMPT, "num_draft_tokens": 65}, "num_draft_tokens", None),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", None),
        ({"max_tokens": 3}, "prompt", None),
        (
            {"prompt": PROMPT, "top_k": "many"},
            "top_k",
            None,
        ),  # what a caller other than the ingress could send
    ],
)
def test_bad_requests_are_error_chunks(served, request_body, param, code):
    server, loop = served
    (chunk,) = collect(server, loop, request_body)
    assert chunk.status_code == 400
    assert (chunk.error.type, chunk.error.param, chunk.error.code) == ("invalid_request_error", param, code)
    server.check_health()


def test_streaming_yields_text_per_step_and_usage_last(served, model, tokenizer):
    server, loop = served
    expected = generate(model, tokenizer, PROMPT, SamplingParams(max_tokens=12))
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    streamed = collect(server, loop, {**body, "stream": True})
    (whole,) = collect(server, loop, body)
    assert len(streamed) > 1
    assert "".join(chunk.text for chunk in streamed) == whole.text == expected.text
    assert [chunk.finish_reason for chunk in streamed[:-1]] == [None] * (len(streamed) - 1)
    assert streamed[-1].usage.completion_tokens == len(expected.token_ids)
    assert streamed[-1].replica["replica_id"] == "test"
    assert server.stats()["num_requests"] >= 2


def test_full_queue_answers_503_and_the_queued_requests_finish(served):
    server, loop = served

    async def scenario() -> tuple[list[GenerateChunk], GenerateChunk, list[GenerateChunk]]:
        # Long enough to hold the only batch row for as long as the scenario takes on any host.
        holder = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
        running = server.generate({**holder, "speculation": "off"})
        first = await running.__anext__()  # admitted: it now holds the only batch row
        queued = asyncio.ensure_future(_drain(server.generate({"prompt": PROMPT, "max_tokens": 2})))
        deadline = time.monotonic() + 60
        while server.stats()["num_waiting"] < 1:  # it takes the only queue place
            assert time.monotonic() < deadline, "the second request never queued"
            await asyncio.sleep(0.01)
        (refused,) = await _drain(server.generate({"prompt": PROMPT, "max_tokens": 2}))
        return [first, *await _drain(running)], refused, await queued

    running, refused, queued = loop.run_until_complete(scenario())
    assert refused.status_code == 503 and refused.error.code == "engine_overloaded"
    assert running[-1].finish_reason == "length" and queued[-1].finish_reason == "length"


async def _drain(chunks) -> list[GenerateChunk]:
    return [chunk async for chunk in chunks]


# ------------------------------------------------------------------ shutdown
def test_start_freezes_the_heap_and_shutdown_flushes_pool_writes_then_stops_the_engine(model, tokenizer):
    require(is_up(MACHINE_REDIS_URL), f"no Redis at {MACHINE_REDIS_URL}")
    namespace = f"test-shutdown-{time.time_ns()}"
    config = ReplicaConfig(pool=PoolConfig(redis_url=MACHINE_REDIS_URL), pool_namespace=namespace)
    server = NASDServer(config, origin="flusher")
    expected = generate(model, tokenizer, PROMPT, SamplingParams(max_tokens=8))

    async def serve_one_then_stop() -> None:
        gc.unfreeze()  # the module's other server froze the heap too
        await server.start()
        # What start-up built lives as long as the replica: frozen, a full collection (0.5 s
        # over a replica's 600k objects on 2 cores) no longer walks it inside a step.
        assert gc.get_freeze_count() > 0
        (chunk,) = [c async for c in server.generate({"prompt": PROMPT, "max_tokens": 8, "temperature": 0})]
        assert chunk.finish_reason is not None
        # At once: the write-behind delay has not passed, so only the shutdown can flush it.
        await server.shutdown()
        assert gc.get_freeze_count() == 0

    async def read_pool() -> list[list[int]]:
        store = open_store(PoolConfig(redis_url=MACHINE_REDIS_URL), server.pools.namespace)
        await store.connect()
        batch = await store.read("0-0", 100, 0)
        await store.close()
        return [entry.token_ids for entry in batch.entries]

    try:
        # Each in its own event loop: the server's loop is gone when the pool is read.
        asyncio.run(serve_one_then_stop())
        assert asyncio.run(read_pool()) == [expected.prompt_ids + expected.token_ids]
        with pytest.raises(RuntimeError, match="engine thread"):
            server.check_health()
    finally:
        client = redis.Redis.from_url(MACHINE_REDIS_URL)
        for key in client.scan_iter(match=f"nasd:{{{namespace}*"):
            client.delete(key)
