"""Engine concurrency sweep: throughput and per-token latency for speculation off / on / auto.

For each mix (repetitive, creative, long chats) and concurrency C, the engine runs with
``max_batch_rows=C`` and is handed ``2*C`` requests at once, so continuous batching keeps C
of them in flight. All modes run in the same process on the same prompts; the report gives
ratios to ``off``. ``off`` and ``auto`` run four times per cell (twice for long chats),
interleaved (``run_order``), and their figures pool the runs.

    python -m benchmarks.concurrency            # C = 1, 4, 16, 32; 2C requests of 64 tokens
    python -m benchmarks.concurrency --quick    # the full run's C = 1, 4 cells, each mode once
    python -m benchmarks.concurrency --device cuda --dtype bfloat16 --levels 1 4 16 32 64 --repeats 2
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import cycle, islice

from tqdm import tqdm

from benchmarks.common import (
    concurrency_lines,
    new_figure,
    percentile,
    publish_run,
    result_name,
    run_metadata,
    suite_parser,
    write_result,
)
from benchmarks.workloads import long_chats, make_workload
from nasd_core.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine, warm_up
from nasd_core.loader import load_model
from nasd_core.metrics import SpecStats
from nasd_core.runner.model_runner import ModelRunner
from nasd_core.speculation.calibration import Calibration, calibrate

MIXES = {
    "repetitive": ("code_edit", "rag_quote", "json_reformat", "translation"),
    "non_repetitive": ("creative",),
}
# The engine sweep's third mix (not the HTTP sweep's: its prompts are token ids): chats of
# 600, 1000 and 1600 prompt tokens in turn, every workload's conversations as history and one
# workload's request last (``benchmarks.workloads.long_chats``), the inputs of a long chat service.
LONG_CHAT = "long_chat"
SWEEP_MIXES = (*MIXES, LONG_CHAT)
# Runs of off and auto per cell of the full sweep. Why four: two runs of the same work here
# differ by up to 10% (``off_spread``), and where auto drafts little (creative text at 16-32
# rows) it differs from off by less than that. Long chats twice: their C=32 cell alone runs ~4
# minutes per pair, and there auto's differences from off are not that small.
REPEATS = 4
LONG_CHAT_REPEATS = 2
MODES = ("off", "on", "auto")


@dataclass
class CellRun:
    """Raw measurements of one or more runs of one (concurrency, mode) cell."""

    num_requests: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    first_token_s: list[float] = field(default_factory=list)
    per_token_s: list[float] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    width_histogram: Counter = field(default_factory=Counter)
    outputs: list[list[int]] | None = None
    runs_agree: bool = True
    run_tokens_per_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "requests": self.num_requests,
            "tokens": self.num_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.num_tokens / self.seconds, 2),
            "tokens_per_step": round(self.stats.tokens_per_step, 3),
            "ttft_p50_ms": round(1000 * percentile(self.first_token_s, 50), 1),
            "ttft_p99_ms": round(1000 * percentile(self.first_token_s, 99), 1),
            "itl_p50_ms": round(1000 * percentile(self.per_token_s, 50), 1),
            "itl_p99_ms": round(1000 * percentile(self.per_token_s, 99), 1),
            "draft_width_histogram": dict(sorted(self.width_histogram.items())),
            "run_tokens_per_s": [round(rate, 2) for rate in self.run_tokens_per_s],
        }


def run_cell(
    model,
    tokenizer,
    prompts: list[list[int]],
    concurrency: int,
    mode: str,
    max_tokens: int,
    into: CellRun,
    step_graphs: bool | None = None,
    runner: ModelRunner | None = None,
    calibration: Calibration | None = None,
) -> None:
    """One run of (concurrency, mode) over ``prompts``, added to ``into``; ``runner``: the
    sweep's one runner (its graphs captured once), else the engine makes its own."""
    config = EngineConfig(max_batch_rows=concurrency, max_waiting=len(prompts), step_graphs=step_graphs)
    if runner is not None:
        runner.cache.drop_prefix_cache()  # no run reuses another's prompts
    engine = Engine(model, tokenizer, config, runner=runner, calibration=calibration)
    last_emit: dict[str, float] = {}

    def on_tokens(request, token_ids) -> None:
        now = time.perf_counter()
        if not token_ids:
            return
        previous = last_emit.get(request.request_id)
        if previous is None:
            into.first_token_s.append(now - request.arrival_time)
        else:
            # A step that emits k tokens spreads its wait over them: per-token latency.
            into.per_token_s.extend([(now - previous) / len(token_ids)] * len(token_ids))
        last_emit[request.request_id] = now

    started = time.perf_counter()
    ids = [
        engine.add_request(
            prompt, SamplingParams(max_tokens=max_tokens), SpecConfig(mode=mode), on_tokens=on_tokens
        )
        for prompt in prompts
    ]
    while not engine.is_finished():
        engine.step()
    seconds = time.perf_counter() - started
    into.seconds += seconds
    outputs = [engine.pop_result(request_id).token_ids for request_id in ids]
    num_tokens = sum(len(output) for output in outputs)
    into.num_requests += len(prompts)
    into.num_tokens += num_tokens
    into.run_tokens_per_s.append(num_tokens / seconds)
    into.stats.merge(engine.stats)
    into.width_histogram.update(engine.width_histogram)
    # Greedy: every run of a cell must give the same tokens.
    if into.outputs is None:
        into.outputs = outputs
    elif outputs != into.outputs:
        into.runs_agree = False


def run_order(repeats: int) -> list[str]:
    """Modes in the order one cell runs them: every mode once, then ``off`` and ``auto``
    again in reverse for each further repeat (the two compared most closely; on this
    machine back-to-back runs of one mode differ by up to 10%, so one run each cannot
    show a 5% difference; ``on`` is far from both or slower than auto and runs once)."""
    return [*MODES, *(["auto", "off"] * (repeats - 1))]


def run_sweep(
    levels: list[int],
    max_tokens: int,
    dtype: str,
    requests_per_level: int = 2,
    repeats: int = REPEATS,
    long_chat_repeats: int = LONG_CHAT_REPEATS,
    device: str = "cpu",
    on_cell: Callable[[dict], object] | None = None,
    step_graphs: bool | None = None,
) -> dict:
    """The sweep's payload; ``on_cell`` gets it after every finished cell (a run stopped midway,
    such as one on a machine lent for minutes, keeps the cells it finished). ``step_graphs``:
    every engine (and the probe) on fixed-shape steps, CUDA graphs on a GPU (None: wherever CUDA
    is). Off the CPU every run shares one runner, its graphs captured once before the sweep."""
    model, tokenizer = load_model(config=ModelConfig(dtype=dtype, device=device))
    runner = None
    if device != "cpu":
        config = EngineConfig(max_batch_rows=max(levels), step_graphs=step_graphs)
        runner = ModelRunner(model, config.runner)
        warm_up(runner, config)
    calibration = calibrate(model, max(levels), step_graphs=bool(step_graphs), runner=runner)
    sweep: dict[str, dict] = {}
    orders = {mix: run_order(long_chat_repeats if mix == LONG_CHAT else repeats) for mix in SWEEP_MIXES}
    payload = {
        "benchmark": "concurrency",
        "meta": {
            **run_metadata(model, dtype, "benchmarks.concurrency"),
            "max_tokens": max_tokens,
            "requests_per_level": requests_per_level,
            "run_order": orders,
            "step_graphs": step_graphs,
        },
        "sweep": sweep,
    }
    cells = [(mix, level) for mix in SWEEP_MIXES for level in levels]
    for mix, level in tqdm(cells, desc="concurrency", unit="cell"):
        order = orders[mix]
        prompts = mix_prompts(tokenizer, mix, requests_per_level * level)
        runs = {mode: CellRun() for mode in MODES}
        if device != "cpu":
            # On an H100 the first run of every cell was 1.1-3x slower than the cell's last run of
            # the same mode (results/concurrency_cuda_bfloat16.json, ``runs_table``), likely its
            # clocks falling while the host prepares a cell (it idles at 345 MHz; not confirmed).
            # An untimed run first keeps that out of the compared runs.
            run_cell(
                model,
                tokenizer,
                prompts,
                level,
                "off",
                max_tokens,
                CellRun(),
                step_graphs,
                runner,
                calibration,
            )
        for mode in order:
            run_cell(
                model,
                tokenizer,
                prompts,
                level,
                mode,
                max_tokens,
                runs[mode],
                step_graphs,
                runner,
                calibration,
            )
        row = {mode: {**runs[mode].summary(), "runs": order.count(mode)} for mode in MODES}
        # Greedy: every mode must produce the same tokens; a mismatch is reported, not hidden.
        for mode in MODES:
            row[mode]["identical_to_off"] = (
                runs[mode].runs_agree and runs["off"].runs_agree and runs[mode].outputs == runs["off"].outputs
            )
        add_ratios_to_off(row)
        sweep.setdefault(mix, {})[str(level)] = row
        if mix == "repetitive" and level == 1:  # the figure issue 40 tracks
            payload["single_stream_auto_over_off"] = row["auto"]["ratio_to_off"]
        if on_cell is not None:
            on_cell(payload)
    return payload


def mix_prompts(tokenizer, mix: str, count: int) -> list[list[int]]:
    """``count`` prompts (token ids) of one of ``SWEEP_MIXES``."""
    if mix == LONG_CHAT:
        return long_chats(tokenizer, count)
    conversations = [conv for name in MIXES[mix] for conv in make_workload(name, 8, seed=3)]
    return [
        tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        for conv in islice(cycle(conversations), count)
    ]


def markdown_table(payload: dict) -> str:
    lines = [
        "| mix | concurrency | off tok/s | on | auto | off run / off run | auto ITL p50 / p99 ms "
        "| auto tokens/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mix, levels in payload["sweep"].items():
        for level, row in levels.items():
            flags = "" if all(row[m]["identical_to_off"] for m in MODES) else " ≠"
            lines.append(
                f"| {mix} | {level} | {row['off']['tokens_per_s']:.1f} | {row['on']['ratio_to_off']:.2f}x "
                f"| {row['auto']['ratio_to_off']:.2f}x{flags} | {off_spread(row['off'])} "
                f"| {row['auto']['itl_p50_ms']:.0f} / "
                f"{row['auto']['itl_p99_ms']:.0f} | {row['auto']['tokens_per_step']:.2f} |"
            )
    return "\n".join(lines)


def runs_table(payload: dict) -> str:
    """Every run of every cell in its run order (``run_order``: off, on, auto, auto, off): where
    runs of one mode differ by more than the modes do (a run-order effect, such as a GPU's
    clocks rising over a cell), the pooled ratios of ``markdown_table`` would mislead."""
    lines = [
        "| mix | concurrency | off, 1st run tok/s | on | auto runs | off, last run | auto / last off "
        "| auto tokens/step | outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mix, levels in payload["sweep"].items():
        for level, row in levels.items():
            off_runs, auto_runs = row["off"]["run_tokens_per_s"], row["auto"]["run_tokens_per_s"]
            auto_mean = sum(auto_runs) / len(auto_runs)
            same = "identical" if all(row[mode]["identical_to_off"] for mode in MODES) else "≠ off"
            lines.append(
                f"| {mix} | {level} | {off_runs[0]:.1f} | {row['on']['run_tokens_per_s'][0]:.1f} "
                f"| {' / '.join(f'{rate:.1f}' for rate in auto_runs)} | {off_runs[-1]:.1f} "
                f"| {auto_mean / off_runs[-1]:.2f}x | {row['auto']['tokens_per_step']:.2f} | {same} |"
            )
    return "\n".join(lines)


def off_spread(off: dict) -> str:
    """The noise floor of a cell: its faster ``off`` run's tokens/s over its slower one's (the
    same work twice; an ``auto`` ratio inside it is not a measured difference)."""
    rates = off.get("run_tokens_per_s", [])
    return f"{max(rates) / min(rates):.2f}x" if len(rates) > 1 else "-"


def add_ratios_to_off(row: dict[str, dict]) -> None:
    """Give each mode's cell of one (mix, concurrency) row its tokens/s over ``off``'s."""
    for mode in MODES:
        row[mode]["ratio_to_off"] = round(row[mode]["tokens_per_s"] / row["off"]["tokens_per_s"], 3)


def sweep_ratios(sweep: dict[str, dict], prefix: str = "") -> dict[str, float]:
    """Every speculating mode's ratio to ``off`` in a {mix: {C: row}} sweep, keyed for
    comparing two runs (this suite's and the HTTP one's)."""
    return {
        f"{prefix}{mix}/C={level}/{mode}": row[mode]["ratio_to_off"]
        for mix, levels in sweep.items()
        for level, row in levels.items()
        for mode in MODES
        if mode != "off"
    }


def ratios(payload: dict, like: dict | None = None) -> dict[str, float]:
    """tokens/s over ``off`` at the same concurrency, keyed for comparing two runs (a quick
    run's cells are some of the full run's, defined alike, so ``like`` changes nothing)."""
    return sweep_ratios(payload["sweep"])


def plot(payload: dict):
    """Tokens/s against concurrency, one panel per mix, one line per mode."""
    figure, axes = new_figure(len(payload["sweep"]))
    for axis, (mix, levels) in zip(axes, payload["sweep"].items()):
        concurrency_lines(axis, levels, {mode: mode for mode in MODES}, "tokens_per_s", f"engine, {mix} mix")
        axis.set_ylabel("output tokens/s")
    return figure


def main() -> None:
    parser = suite_parser(__doc__, quick="the short version")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="torch device of the model (cuda on a GPU)")
    parser.add_argument("--levels", nargs="*", type=int, default=[1, 4, 16, 32], help="concurrencies")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs of off and auto per cell")
    parser.add_argument(
        "--packed",
        action="store_true",
        help="no fixed-shape steps (by default: CUDA graphs wherever CUDA is)",
    )
    args = parser.parse_args()
    if args.quick:
        # The full run's C = 1 and 4 cells, as defined there, each mode run once.
        payload = run_sweep(
            [1, 4], 64, args.dtype, requests_per_level=2, repeats=1, long_chat_repeats=1, device=args.device
        )
    else:
        name = result_name("concurrency", args.dtype, args.quick, args.device)
        payload = run_sweep(
            args.levels,
            64,
            args.dtype,
            repeats=args.repeats,
            long_chat_repeats=min(args.repeats, LONG_CHAT_REPEATS),
            device=args.device,
            on_cell=lambda partial: write_result(name, partial),
            step_graphs=False if args.packed else None,
        )
    publish_run(
        result_name("concurrency", args.dtype, args.quick, args.device), payload, markdown_table, plot
    )


if __name__ == "__main__":
    main()
