"""Single-stream benchmark: every compared system in one process, on the same prompts, in one run.

Systems: transformers greedy (``hf_greedy``), transformers prompt lookup
(``hf_prompt_lookup``, ``prompt_lookup_num_tokens=10``), the seeds' NASD as published
(``seed_nasd``), and this library with speculation off / on / auto, all on one model as
``load_model`` gives it (on CPU, with the fast path of ``nasd_core/layers/cpu_kernels.py``); plus
``hf_greedy_stock`` and ``hf_prompt_lookup_stock``: transformers greedy and prompt lookup on
a second copy of the model with transformers' stock CPU kernels, i.e. what a transformers
user runs today. All greedy, so every system must emit exactly ``hf_greedy``'s tokens; the
run records whether each did.

    python -m benchmarks.single_stream            # full: 5 prompts x 7 workloads, 128 tokens
    python -m benchmarks.single_stream --quick    # the full run's first prompt of 4 workloads, 3 systems

The full run keeps each prompt's tokens and seconds, so a quick run is held against the
full run's figures for the very prompts it measured (``ratios(full, like=quick)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from benchmarks.baselines.seed_nasd import seed_nasd_generate
from benchmarks.common import (
    counting_forwards,
    grouped_bars,
    new_figure,
    publish_run,
    result_name,
    rotated,
    run_metadata,
    suite_parser,
)
from benchmarks.workloads import REPETITIVE, WORKLOADS, make_workload
from nasd_core.config import ModelConfig, SamplingParams, SpecConfig
from nasd_core.generate import generate
from nasd_core.inputs import eos_ids
from nasd_core.loader import load_model
from nasd_core.metrics import SpecStats
from nasd_core.speculation.calibration import Calibration, calibrate

SYSTEMS = (
    "hf_greedy",
    "hf_greedy_stock",
    "hf_prompt_lookup",
    "hf_prompt_lookup_stock",
    "seed_nasd",
    "nasd_off",
    "nasd_on",
    "nasd_auto",
)
# Systems that run on the stock-kernel copy of the model.
STOCK_SYSTEMS = ("hf_greedy_stock", "hf_prompt_lookup_stock")
BASELINE = "hf_greedy"
# The quick run: the headline comparison on one repetitive-copy, one reasoning-over-history
# and one control workload, at the full run's prompt length and token count.
QUICK_SYSTEMS = ("hf_greedy", "hf_prompt_lookup", "nasd_auto")
QUICK_WORKLOADS = ("code_edit", "rag_quote", "multi_turn", "creative")


@dataclass
class Totals:
    """Sums over the prompts of one (workload, system) cell."""

    num_prompts: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    num_forwards: int = 0
    num_identical: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    per_prompt: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)

    def summary(self, baseline_tokens_per_s: float) -> dict[str, object]:
        tokens_per_s = self.num_tokens / self.seconds if self.seconds else 0.0
        row: dict[str, object] = {
            "tokens": self.num_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(tokens_per_s, 2),
            "speedup_vs_hf_greedy": round(tokens_per_s / baseline_tokens_per_s, 3)
            if baseline_tokens_per_s
            else None,
            # Every forward counts, prefill included, for every system alike (hf_greedy = 1.0).
            "tokens_per_forward": round(self.num_tokens / self.num_forwards, 3) if self.num_forwards else 0.0,
            "identical_to_hf_greedy": self.num_identical == self.num_prompts,
            "per_prompt": [[tokens, round(seconds, 3)] for tokens, seconds in self.per_prompt],
        }
        if self.stats.num_steps:
            row["acceptance_by_position"] = [round(rate, 3) for rate in self.stats.acceptance_by_position]
            row["drafting_share"] = round(self.stats.drafting_share, 5)
            row["acceptance_rate"] = round(self.stats.acceptance_rate, 3)
        return row


def make_runners(
    model, tokenizer, max_tokens: int, calibration: Calibration, stock_model=None
) -> dict[str, Callable]:
    """One callable per system: prompt ids -> (generated ids, SpecStats or None)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = eos_ids(model, tokenizer)

    def hf(prompt_ids: list[int], on_model=model, **extra) -> tuple[list[int], None]:
        inputs = torch.tensor([prompt_ids], device=on_model.device)
        with torch.inference_mode():
            out = on_model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                **extra,
            )
        return out[0, len(prompt_ids) :].tolist(), None

    def nasd(mode: str) -> Callable:
        def run(prompt_ids: list[int]) -> tuple[list[int], SpecStats]:
            result = generate(
                model,
                tokenizer,
                prompt_ids,
                SamplingParams(max_tokens=max_tokens),
                SpecConfig(mode=mode),
                calibration=calibration,
            )
            return result.token_ids, result.stats

        return run

    return {
        "hf_greedy": hf,
        "hf_greedy_stock": lambda ids: hf(ids, on_model=stock_model),
        "hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=10),
        "hf_prompt_lookup_stock": lambda ids: hf(ids, on_model=stock_model, prompt_lookup_num_tokens=10),
        "seed_nasd": lambda ids: (seed_nasd_generate(model, ids, max_tokens, stop_ids), None),
        "nasd_off": nasd("off"),
        "nasd_on": nasd("on"),
        "nasd_auto": nasd("auto"),
    }


def run_benchmark(
    num_prompts: int,
    max_tokens: int,
    workloads: list[str],
    dtype: str,
    seed: int,
    systems: tuple[str, ...] = SYSTEMS,
    device: str = "cpu",
) -> dict:
    model, tokenizer = load_model(config=ModelConfig(dtype=dtype, device=device))
    stock_model = None
    if any(system in STOCK_SYSTEMS for system in systems):
        stock_model, _ = load_model(config=ModelConfig(dtype=dtype, device=device, cpu_fast_path=False))
    calibration = calibrate(model, 1)
    runners = make_runners(model, tokenizer, max_tokens, calibration, stock_model)
    prompts = {
        name: [
            tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
            for conv in make_workload(name, num_prompts, seed)
        ]
        for name in workloads
    }
    for system in systems:  # warm-up: first calls pay one-off allocation costs
        runners[system](prompts[workloads[0]][0][:32])

    totals = {name: {system: Totals() for system in systems} for name in workloads}
    jobs = [(name, index) for name in workloads for index in range(num_prompts)]
    for job_number, (name, index) in enumerate(tqdm(jobs, desc="single-stream", unit="prompt")):
        prompt_ids = list(prompts[name][index])
        reference: list[int] | None = None
        # Rotate the order per prompt so no system always runs first (cache/thermal effects).
        outputs = {}
        for system in rotated(systems, job_number):
            with counting_forwards(stock_model if system in STOCK_SYSTEMS else model) as forwards:
                started = time.perf_counter()
                output, stats = runners[system](prompt_ids)
                elapsed = time.perf_counter() - started
            cell = totals[name][system]
            cell.num_prompts += 1
            cell.num_tokens += len(output)
            cell.seconds += elapsed
            cell.num_forwards += forwards.count
            cell.per_prompt.append((len(output), elapsed))
            if stats is not None:
                cell.stats.merge(stats)
            outputs[system] = output
        reference = outputs[BASELINE]
        for system in systems:
            totals[name][system].num_identical += outputs[system] == reference

    results: dict[str, object] = {}
    for name in workloads:
        baseline = totals[name][BASELINE]
        baseline_rate = baseline.num_tokens / baseline.seconds if baseline.seconds else 0.0
        results[name] = {system: totals[name][system].summary(baseline_rate) for system in systems}
    return {
        "benchmark": "single_stream",
        "meta": {
            **run_metadata(model, dtype, "benchmarks.single_stream"),
            "num_prompts_per_workload": num_prompts,
            "max_tokens": max_tokens,
            "workload_seed": seed,
            "step_time_probe_ms": {
                n: round(calibration.step_time.estimate(1, n) * 1000, 1)
                for n in range(1, SpecConfig().num_draft_tokens + 2)
            },
        },
        "workloads": results,
    }


def systems_of(payload: dict) -> list[str]:
    """The systems a run measured, in the usual order (a quick run measures fewer)."""
    measured = next(iter(payload["workloads"].values()))
    return [system for system in SYSTEMS if system in measured]


def markdown_table(payload: dict) -> str:
    """The results table: tokens/s ratio to plain greedy by workload and system."""
    systems = systems_of(payload)
    header = "| workload | " + " | ".join(systems) + " | nasd_auto tokens/forward | drafting share |"
    lines = [header, "|" + "---|" * (len(systems) + 3)]
    for name, rows in payload["workloads"].items():
        ratios = [
            f"{rows[s]['speedup_vs_hf_greedy']:.2f}x" + ("" if rows[s]["identical_to_hf_greedy"] else " ≠")
            for s in systems
        ]
        auto = rows["nasd_auto"]
        lines.append(
            f"| {name}{' (rep.)' if name in REPETITIVE else ''} | "
            + " | ".join(ratios)
            + f" | {auto['tokens_per_forward']:.2f} | {100 * auto.get('drafting_share', 0):.2f}% |"
        )
    return "\n".join(lines)


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """The run's headline ratios (tokens/s over plain greedy), keyed for comparing two runs.

    With ``like`` (a quick run's payload), the ratios are taken over the prompts that run
    measured (the first ``num_prompts_per_workload`` of each workload), so the two runs
    compare the same prompts and only the noise differs.
    """
    num_prompts = like["meta"]["num_prompts_per_workload"] if like is not None else None

    def tokens_per_s(row: dict) -> float:
        if num_prompts is None or "per_prompt" not in row:
            return row["tokens_per_s"]
        measured = row["per_prompt"][:num_prompts]
        return sum(tokens for tokens, _ in measured) / sum(seconds for _, seconds in measured)

    return {
        f"{name}/{system}": round(tokens_per_s(rows[system]) / tokens_per_s(rows[BASELINE]), 3)
        for name, rows in payload["workloads"].items()
        for system in rows
        if system != BASELINE
    }


def plot(payload: dict):
    """Left: tokens/s over plain greedy by workload and system. Right: how often ``nasd_auto``'s
    drafted token at each position was accepted, by workload."""
    figure, (speedups, acceptance) = new_figure(2, width=7.0)
    workloads = list(payload["workloads"])
    grouped_bars(
        speedups,
        workloads,
        {
            system: [payload["workloads"][name][system]["speedup_vs_hf_greedy"] for name in workloads]
            for system in systems_of(payload)
        },
        "tokens/s ÷ hf_greedy",
    )
    speedups.axhline(1.0, color="grey", linewidth=0.8)
    speedups.set_title("single stream: speed-up over transformers greedy")
    for name in workloads:
        rates = payload["workloads"][name]["nasd_auto"].get("acceptance_by_position", [])
        if rates:
            acceptance.plot(range(1, len(rates) + 1), rates, marker=".", label=name)
    acceptance.set_xlabel("draft position")
    acceptance.set_ylabel("acceptance rate")
    acceptance.set_ylim(0, 1.05)
    acceptance.set_title("nasd_auto: acceptance by draft position")
    acceptance.legend(fontsize="small")
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="first prompt of 4 workloads, 3 systems, full length")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", nargs="*", default=None, choices=list(WORKLOADS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0, help="workload generator seed")
    parser.add_argument("--device", default="cpu", help="torch device of the model (cuda on a GPU)")
    args = parser.parse_args()
    num_prompts = args.prompts or (1 if args.quick else 5)
    workloads = args.workloads or list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    systems = QUICK_SYSTEMS if args.quick else SYSTEMS
    if args.device != "cpu":  # the stock/fast kernel pairs compare CPU kernels only
        systems = tuple(system for system in systems if system not in STOCK_SYSTEMS)
    payload = run_benchmark(
        num_prompts, args.max_tokens, workloads, args.dtype, args.seed, systems, args.device
    )
    publish_run(
        result_name("single_stream", args.dtype, args.quick, args.device), payload, markdown_table, plot
    )


if __name__ == "__main__":
    main()
