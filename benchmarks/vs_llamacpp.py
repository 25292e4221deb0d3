"""The embedded engine against llama.cpp on one CPU, the same GGUF file, in one run (issue 51).

llama.cpp (through llama-cpp-python, built for this CPU by ``make bench-peers``) decodes the
embedded SmolLM2-135M Q4_1 GGUF; the engine loads the same file (``dtype="gguf"``: its blocks
kept, ``nasd_core/layers/quantized.py``) and, for reference, its float32 conversion. Every system
gets the same chat prompts as token ids, the same threads and the same token budget, greedy.

Systems, one request at a time (tokens/s = generated tokens / wall time, prompt included):
- ``llamacpp``: llama.cpp's plain decoding;
- ``llamacpp_lookup``: llama-cpp-python's prompt-lookup draft (``LlamaPromptLookupDecoding``,
  which needs every position's logits);
- ``nasd_gguf_off`` / ``nasd_gguf_auto``: the engine on the GGUF blocks, speculation off / auto;
- ``nasd_float32_off`` (and ``nasd_float32_auto`` with ``--float32 off auto``): the same on the
  float32 weights, the engine's CPU path before the GGUF blocks.
Then the engine on the GGUF blocks with 8 requests at once (``C=8``), off and auto.

Each request's tokens are kept: the engine's greedy output with speculation is its output
without it (``identical``); llama.cpp's arithmetic is its own (8-bit activations), so its
tokens are compared only as the share of requests whose first 32 tokens match the engine's.

    make bench-peers                                   # builds llama.cpp, then runs this
    PYTHONPATH=.bench-peers python -m benchmarks.vs_llamacpp [--prompts 3] [--max-tokens 128]
    python -m benchmarks.vs_llamacpp --footprint-only  # one engine process's RSS, gguf and float32
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import torch

from benchmarks.common import (
    RESULTS_DIR,
    grouped_bars,
    new_figure,
    publish_run,
    result_name,
    run_metadata,
    suite_parser,
)
from benchmarks.workloads import REPETITIVE, WORKLOADS, chat_ids, long_chats, make_workload
from nasd_core.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.generate import generate
from nasd_core.loader import embedded_gguf_path, load_model
from nasd_core.speculation.calibration import calibrate

CONCURRENT = 8
# Chats of 600-1600 prompt tokens (workloads.long_chats), beside the short workloads.
LONG_CHAT = "long_chat"
COMPARED_PREFIX = 32
# One engine process's memory: load the model, answer once, report peak and current RSS (MB).
# (VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's at the fork.)
FOOTPRINT_SCRIPT = """
from nasd_core.config import ModelConfig, SamplingParams
from nasd_core.generate import generate
from nasd_core.loader import load_model
model, tokenizer = load_model(config=ModelConfig(dtype={dtype!r}))
generate(model, tokenizer, "Hello there", SamplingParams(max_tokens=8))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmHWM"].split()[0]) // 1024, int(status["VmRSS"].split()[0]) // 1024)
"""


def footprint(dtype: str) -> dict:
    """Peak and current RSS (MB) of a fresh process that loads the embedded model as ``dtype``."""
    out = subprocess.run(
        [sys.executable, "-c", FOOTPRINT_SCRIPT.format(dtype=dtype)],
        capture_output=True,
        text=True,
        check=True,
    )
    peak, current = map(int, out.stdout.split()[-2:])
    return {"peak_mb": peak, "current_mb": current}


def llamacpp_systems(threads: int, context: int) -> dict:
    """llama.cpp's two ways to decode, each a function of (prompt ids, max tokens) -> ids."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    path = str(embedded_gguf_path())
    common = {"n_ctx": context, "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    plain = Llama(model_path=path, **common)
    lookup = Llama(model_path=path, logits_all=True, draft_model=LlamaPromptLookupDecoding(), **common)

    def decoder(llm):
        def decode(prompt: list[int], max_tokens: int) -> list[int]:
            out = []
            llm.reset()
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
                if llm.token_eos() == token:
                    break
                out.append(token)
                if len(out) == max_tokens:
                    break
            return out

        return decode

    return {"llamacpp": decoder(plain), "llamacpp_lookup": decoder(lookup)}


def engine_system(model, tokenizer, mode: str, calibration):
    def decode(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        spec = SpecConfig(mode=mode)
        return generate(model, tokenizer, prompt, params, spec, calibration=calibration).token_ids

    return decode


def concurrent_run(model, tokenizer, prompts: list[list[int]], max_tokens: int, mode: str) -> dict:
    """All prompts through one engine, ``CONCURRENT`` rows at a time: tokens/s and outputs."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch_rows=CONCURRENT))
    started = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    ids = [engine.add_request(prompt, params, SpecConfig(mode=mode)) for prompt in prompts]
    while not engine.is_finished():
        engine.step()
    seconds = time.perf_counter() - started
    outputs = [engine.pop_result(request_id).token_ids for request_id in ids]
    return {"tok_s": round(sum(map(len, outputs)) / seconds, 2), "outputs": outputs}


def run(num_prompts: int, max_tokens: int, threads: int, float32_modes: list[str]) -> dict:
    torch.set_num_threads(threads)
    gguf_model, tokenizer = load_model(config=ModelConfig(dtype="gguf"))
    float_model, _ = load_model(config=ModelConfig(dtype="float32"))
    prompts = {
        name: [chat_ids(tokenizer, conv) for conv in make_workload(name, num_prompts)] for name in WORKLOADS
    }
    prompts[LONG_CHAT] = long_chats(tokenizer, num_prompts)
    longest = max(len(prompt) for group in prompts.values() for prompt in group)
    systems = llamacpp_systems(threads, longest + max_tokens + 64)
    for name, model, modes in (
        ("gguf", gguf_model, ["off", "auto"]),
        ("float32", float_model, float32_modes),
    ):
        calibration = calibrate(model, 1)
        for mode in modes:
            systems[f"nasd_{name}_{mode}"] = engine_system(model, tokenizer, mode, calibration)
    for decode in systems.values():  # first calls pay for threads, caches and kernels
        decode(prompts["creative"][0][:16], 4)
    cells: dict = {}
    for workload, group in prompts.items():
        cells[workload] = {}
        for system, decode in systems.items():
            tokens, seconds, outputs = 0, 0.0, []
            for prompt in group:
                started = time.perf_counter()
                out = decode(prompt, max_tokens)
                seconds += time.perf_counter() - started
                tokens += len(out)
                outputs.append(out)
            rate = round(tokens / seconds, 2)
            cells[workload][system] = {"tok_s": rate, "tokens": tokens, "outputs": outputs}
            print(workload, system, cells[workload][system]["tok_s"], flush=True)
    everything = [prompt for group in prompts.values() for prompt in group]
    concurrent = {
        mode: concurrent_run(gguf_model, tokenizer, everything, max_tokens, mode) for mode in ("off", "auto")
    }
    return {
        "benchmark": "vs_llamacpp",
        "meta": run_metadata(gguf_model, "gguf", "benchmarks.vs_llamacpp"),
        "threads": threads,
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "cells": cells,
        "concurrent": {"rows": CONCURRENT, **concurrent},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "footprint": {dtype: footprint(dtype) for dtype in ("gguf", "float32")},
    }


def summary(payload: dict) -> dict:
    """Tokens/s by system over the repetitive workloads, the others, and all; and identities."""
    cells = payload["cells"]
    systems = list(next(iter(cells.values())))

    def rate(system: str, workloads) -> float:
        tokens = sum(cells[w][system]["tokens"] for w in workloads)
        seconds = sum(cells[w][system]["tokens"] / cells[w][system]["tok_s"] for w in workloads)
        return round(tokens / seconds, 2)

    repetitive = [w for w in cells if w in REPETITIVE]
    other = [w for w in cells if w not in REPETITIVE]
    groups = {"repetitive": repetitive, "other": other, "all": list(cells)}
    groups.update({name: [name] for name in ("creative", LONG_CHAT) if name in cells})
    rates = {system: {group: rate(system, ws) for group, ws in groups.items()} for system in systems}

    def outputs(system: str) -> list:
        return [out for w in cells for out in cells[w][system]["outputs"]]

    identical = {
        name: outputs(f"nasd_{name}_auto") == outputs(f"nasd_{name}_off")
        for name in ("gguf", "float32")
        if f"nasd_{name}_auto" in systems and f"nasd_{name}_off" in systems
    }
    concurrent = payload["concurrent"]
    identical["gguf_c8"] = concurrent["auto"]["outputs"] == concurrent["off"]["outputs"]
    pairs = list(zip(outputs("llamacpp"), outputs("nasd_gguf_off"), strict=True))
    prefix_match = sum(a[:COMPARED_PREFIX] == b[:COMPARED_PREFIX] for a, b in pairs) / len(pairs)
    return {"rates": rates, "identical": identical, "llamacpp_prefix_match": round(prefix_match, 2)}


def ratios(payload: dict) -> dict[str, float]:
    """Each system's tokens/s over llama.cpp plain's, by workload group ("system/group")."""
    rates = summary(payload)["rates"]
    base = rates["llamacpp"]
    return {
        f"{system}/{group}": rate[group] / base[group] for system, rate in rates.items() for group in rate
    }


def markdown_table(payload: dict) -> str:
    facts = summary(payload)
    rates, base = facts["rates"], facts["rates"]["llamacpp"]
    groups = list(base)
    lines = [
        "| system | "
        + " | ".join(f"{group} tok/s" for group in groups)
        + " | "
        + " | ".join(f"{group} / llama.cpp" for group in groups)
        + " |",
        "|---|" + "---|" * 2 * len(groups),
    ]
    for system, rate in rates.items():
        values = " | ".join(f"{rate[group]:.1f}" for group in groups)
        ratios = " | ".join(f"{rate[group] / base[group]:.2f}x" for group in groups)
        lines.append(f"| {system} | {values} | {ratios} |")
    concurrent = payload["concurrent"]
    off, auto = concurrent["off"]["tok_s"], concurrent["auto"]["tok_s"]
    identical = facts["identical"]
    lines += [
        "",
        f"Engine on the GGUF blocks, {concurrent['rows']} requests at once: off {off:.1f} tok/s, "
        f"auto {auto:.1f} tok/s ({auto / off:.2f}x).",
        "Greedy `auto` = `off`: "
        + ", ".join(f"{name} {'yes' if same else 'NO'}" for name, same in identical.items())
        + f". llama.cpp's first {COMPARED_PREFIX} tokens "
        f"equal the engine's on {facts['llamacpp_prefix_match']:.0%} of requests. "
        f"{payload['num_prompts']} prompts x {len(payload['cells'])} workloads, {payload['max_tokens']} "
        f"tokens, {payload['threads']} threads; this process's peak RSS {payload['peak_rss_mb']} MB.",
    ]
    if "footprint" in payload:
        lines.append(
            "One engine process (load, answer once), RSS peak / after: "
            + ", ".join(
                f"{dtype} {cell['peak_mb']} / {cell['current_mb']} MB"
                for dtype, cell in payload["footprint"].items()
            )
            + "."
        )
    return "\n".join(lines)


def plot(payload: dict):
    figure, (axis,) = new_figure(1, width=9)
    rates = summary(payload)["rates"]
    groups = ["repetitive", "other", "all"]
    series = {system: [rate[group] for group in groups] for system, rate in rates.items()}
    grouped_bars(axis, groups, series, "tokens/s")
    axis.set_title("llama.cpp and the NASD engine on the embedded GGUF, one request at a time")
    return figure


def main() -> None:
    parser = suite_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--float32", nargs="*", default=["off"], choices=["off", "auto"], help="engine modes on float32"
    )
    parser.add_argument(
        "--footprint-only",
        action="store_true",
        help="measure only the engine processes' memory, into the last run's result",
    )
    args = parser.parse_args()
    name = result_name("vs_llamacpp", "gguf", False)
    if args.footprint_only:
        payload = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        payload["footprint"] = {dtype: footprint(dtype) for dtype in ("gguf", "float32")}
        publish_run(name, payload, markdown_table)
        return
    publish_run(name, run(args.prompts, args.max_tokens, args.threads, args.float32), markdown_table, plot)


if __name__ == "__main__":
    main()
