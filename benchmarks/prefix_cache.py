"""Multi-turn chats with and without the prefix cache (``EngineConfig.prefix_cache_tokens``).

2C conversations on an engine of C rows, each TURNS turns long and closed-loop (a
conversation's next turn is sent once its answer is in, so turns of different conversations
interleave, and the cache holds some histories while others are evicted): the first prompt is
a long chat history (600, 1000 and 1600 tokens in turn, ``workloads.long_chat_messages``), each
later one the conversation so far (the model's answer on the chat template) and a new
question taken from the workloads. Both systems speculate in ``auto`` and run the same
conversations; greedy answers make identical histories, checked turn by turn. Reported: whole
run output tokens/s, time to first token of first and of later turns (p50), and the share of
prompt tokens whose keys and values came from the cache.

python -m benchmarks.prefix_cache            # C = 1 and 4, 4 turns, 64 new tokens per turn
python -m benchmarks.prefix_cache --quick    # C = 1, 3 turns, 48 new tokens
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import (
    grouped_bars,
    new_figure,
    percentile,
    publish_run,
    result_name,
    run_metadata,
    suite_parser,
)
from benchmarks.workloads import WORKLOADS, Messages, chat_ids, long_chat_messages, make_workload
from nasd_core.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.loader import load_model
from nasd_core.speculation.calibration import Calibration, calibrate

SYSTEMS = {"no_cache": 0, "prefix_cache": None}  # prefix_cache_tokens (None: the engine's default)


def follow_up_questions() -> list[str]:
    """The last user message of every workload's conversations: the later turns' questions."""
    return [conv[-1]["content"] for name in WORKLOADS for conv in make_workload(name, 4, seed=13)]


def run_conversations(
    model,
    tokenizer,
    chats: list[Messages],
    concurrency: int,
    turns: int,
    max_tokens: int,
    cache_tokens: int | None,
    calibration: Calibration,
) -> dict:
    """Every chat's ``turns`` turns on one engine of ``concurrency`` rows; the figures of the run."""
    config = EngineConfig(max_batch_rows=concurrency, prefix_cache_tokens=cache_tokens)
    engine = Engine(model, tokenizer, config, calibration=calibration)
    questions = follow_up_questions()
    histories = [list(messages) for messages in chats]
    answers: list[list[list[int]]] = [[] for _ in chats]
    prompts: list[list[list[int]]] = [[] for _ in chats]
    sent: dict[str, tuple[int, float]] = {}  # request id -> (chat, time sent)
    first_token: dict[str, float] = {}
    ttft: dict[str, list[float]] = {"first": [], "later": []}
    prompt_tokens = cached_tokens = output_tokens = 0

    def on_tokens(request, token_ids: list[int]) -> None:
        if token_ids and request.request_id not in first_token:
            first_token[request.request_id] = time.perf_counter()

    def send(chat: int) -> None:
        prompts[chat].append(chat_ids(tokenizer, histories[chat]))
        request_id = engine.add_request(
            prompts[chat][-1],
            SamplingParams(max_tokens=max_tokens),
            SpecConfig(mode="auto"),
            on_tokens=on_tokens,
        )
        sent[request_id] = (chat, time.perf_counter())

    started = time.perf_counter()
    for chat in range(len(chats)):
        send(chat)
    while not engine.is_finished():
        for request in engine.step():
            chat, sent_at = sent.pop(request.request_id)
            result = engine.pop_result(request.request_id)
            turn = len(answers[chat])
            ttft["later" if turn else "first"].append(first_token.pop(request.request_id) - sent_at)
            answers[chat].append(result.token_ids)
            prompt_tokens += len(result.prompt_ids)
            cached_tokens += result.stats.num_cached_prompt_tokens
            output_tokens += len(result.token_ids)
            if turn + 1 < turns:
                question = questions[(chat * turns + turn) % len(questions)]
                histories[chat] += [
                    {"role": "assistant", "content": result.text},
                    {"role": "user", "content": question},
                ]
                send(chat)
    seconds = time.perf_counter() - started
    return {
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / seconds, 2),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "ttft_first_p50_s": round(percentile(ttft["first"], 50), 3),
        "ttft_later_p50_s": round(percentile(ttft["later"], 50), 3),
        "answers": answers,
        "prompts": prompts,
    }


def divergences(model, prompts: list[list[list[int]]], first: list, second: list) -> list[dict]:
    """Where each conversation's answers first differ between two runs (its histories are the
    same up to that turn), with the plain forward's top-two logit gap there: a near-tie, which
    different batch and chunk shapes may round either way, or not."""
    found = []
    for chat, (ours, theirs) in enumerate(zip(first, second)):
        turn = next((turn for turn, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if turn is None:
            continue
        a, b = ours[turn], theirs[turn]
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        context = prompts[chat][turn] + a[:position]
        with torch.inference_mode():
            logits = model(torch.tensor([context])).logits[0, -1]
        top = torch.topk(logits, 2).values
        found.append(
            {"chat": chat, "turn": turn, "token": position, "top2_gap": round(float(top[0] - top[1]), 5)}
        )
    return found


def run_benchmark(levels: list[int], turns: int, max_tokens: int, dtype: str) -> dict:
    model, tokenizer = load_model(config=ModelConfig(dtype=dtype))
    calibration = calibrate(model, max(levels))
    payload = {
        "benchmark": "prefix_cache",
        "meta": {
            **run_metadata(model, dtype, "benchmarks.prefix_cache"),
            "turns": turns,
            "max_tokens": max_tokens,
        },
        "levels": {},
    }
    for index, level in enumerate(levels):
        chats = long_chat_messages(tokenizer, 2 * level)
        # Each level runs the systems in the other order: neither always runs first.
        order = list(SYSTEMS) if index % 2 == 0 else list(reversed(SYSTEMS))
        row = {
            system: run_conversations(
                model, tokenizer, chats, level, turns, max_tokens, SYSTEMS[system], calibration
            )
            for system in order
        }
        answers = [row[system].pop("answers") for system in SYSTEMS]
        prompts = row["no_cache"].pop("prompts")
        row["prefix_cache"].pop("prompts")
        row["identical_answers"] = answers[0] == answers[1]
        row["divergences"] = divergences(model, prompts, *answers)
        row["tokens_per_s_ratio"] = round(
            row["prefix_cache"]["tokens_per_s"] / row["no_cache"]["tokens_per_s"], 3
        )
        row["ttft_later_ratio"] = round(
            row["no_cache"]["ttft_later_p50_s"] / row["prefix_cache"]["ttft_later_p50_s"], 3
        )
        row["order"] = order
        payload["levels"][str(level)] = row
        print(f"C={level}: {row['tokens_per_s_ratio']}x tok/s, later turns' TTFT {row['ttft_later_ratio']}x")
    return payload


def markdown_table(payload: dict) -> str:
    lines = [
        "| conversations (rows) | prompt tokens | cached | tok/s: no cache / prefix cache | ratio "
        "| first-turn TTFT p50 s | later-turn TTFT p50 s: no cache / prefix cache | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level, row in payload["levels"].items():
        off, on = row["no_cache"], row["prefix_cache"]
        gaps = [divergence["top2_gap"] for divergence in row.get("divergences", [])]
        mark = "" if row["identical_answers"] else f" ≠ {len(gaps)}, top-2 gap <= {max(gaps, default=0):.3f}"
        lines.append(
            f"| {2 * int(level)} ({level}){mark} | {on['prompt_tokens']} "
            f"| {on['cached_prompt_tokens'] / on['prompt_tokens']:.0%} "
            f"| {off['tokens_per_s']:.1f} / {on['tokens_per_s']:.1f} | {row['tokens_per_s_ratio']:.2f}x "
            f"| {off['ttft_first_p50_s']:.2f} / {on['ttft_first_p50_s']:.2f} "
            f"| {off['ttft_later_p50_s']:.2f} / {on['ttft_later_p50_s']:.2f} "
            f"| {row['ttft_later_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """Prefix cache over none, by concurrency (``like`` changes nothing: a quick run is C = 1)."""
    return {
        f"C{level}/{name}": row[f"{name}_ratio"]
        for level, row in payload["levels"].items()
        for name in ("tokens_per_s", "ttft_later")
    }


def plot(payload: dict):
    """Both systems by concurrency: output tokens/s, and later turns' time to first token."""
    figure, axes = new_figure(2)
    levels = list(payload["levels"])
    for axis, metric, label in zip(
        axes, ("tokens_per_s", "ttft_later_p50_s"), ("output tokens/s", "later-turn TTFT p50 (s)")
    ):
        grouped_bars(
            axis,
            [f"C={level}" for level in levels],
            {system: [payload["levels"][level][system][metric] for level in levels] for system in SYSTEMS},
            label,
        )
        axis.set_title(f"multi-turn chats: {label}")
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="the short version")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    levels, turns, max_tokens = ([1], 3, 48) if args.quick else ([1, 4], 4, 64)
    payload = run_benchmark(levels, turns, max_tokens, args.dtype)
    publish_run(result_name("prefix_cache", args.dtype, args.quick), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
